"""specfit.prefetch: the experts draft prefetch copies, and the issued/used/wasted ledger."""

from __future__ import annotations

import numpy as np
import pytest

from specfit import bitsets
from specfit.cache import make_expert_cache
from specfit.prefetch import PrefetchLedger, draft_prefetch, rank_experts


def test_rank_experts_by_count_then_id():
    counts = np.array([0, 3, 1, 3, 2, 0])
    np.testing.assert_array_equal(rank_experts(counts, 2), [1, 3])
    np.testing.assert_array_equal(rank_experts(counts, 3), [1, 3, 4])
    assert rank_experts(np.zeros(4, np.int64), 2).size == 0 and rank_experts(counts, 0).size == 0


def test_draft_prefetch_warms_the_cache_and_copies_what_it_lacked():
    cache = make_expert_cache("lru", 2, 8, 2)
    cache.access(0, np.array([0, 1]))
    ids = np.array([[[1, 2], [3, 4]], [[2, 5], [3, 6]]])  # [nodes, L, K]
    copies, evicted = draft_prefetch(cache, bitsets.pack(ids, 8), 8, 2)
    # layer 0: expert 2 (2 nodes) then 1 (id order among count 1: 1 < 5): 1 cached, 2 copied
    # layer 1: expert 3 (2 nodes) then 4: both copied
    assert copies == [(0, 2), (1, 3), (1, 4)]
    np.testing.assert_array_equal(evicted[0], [0])
    assert evicted[1].size == 0
    assert cache.contains(0, 2) and cache.contains(0, 1) and not cache.contains(0, 0)
    none_copies, none_evicted = draft_prefetch(cache, None, 8, 2)  # union-size: names no experts
    assert none_copies == [] and all(e.size == 0 for e in none_evicted)


def test_ledger_counts_used_and_wasted():
    ledger = PrefetchLedger(2, 8)
    ledger.issue(0, [2, 3])
    ledger.issue(1, [4])
    ledger.accessed(0, hits=[2, 5], evicted=[3])
    ledger.evicted(1, [4, 6])
    ledger.accessed(0, hits=[2], evicted=[])  # a second hit is not a second use
    assert ledger.counts() == (3, 1, 2) and not ledger.pending.any()


def test_next_layer_choice_ranks_guesses_by_tokens_then_id_capped_at_capacity():
    from specfit.prefetch import next_layer_choice, uses_draft, uses_next_layer

    guesses = np.array([[3, 1], [3, 5], [1, 3], [7, -1]])  # 3 x3, 1 x2, 5 x1, 7 x1 (-1: padding)
    assert next_layer_choice(guesses, 8, 2).tolist() == [1, 3]
    assert next_layer_choice(guesses, 8, 3).tolist() == [1, 3, 5]  # ties: smaller id first
    assert next_layer_choice(guesses, 8, 0).tolist() == []
    assert next_layer_choice(np.zeros((0, 2), dtype=np.int64), 8, 4).tolist() == []
    assert [uses_draft(m) for m in ("none", "draft", "next-layer", "both")] == [False, True, False, True]
    assert [uses_next_layer(m) for m in ("none", "draft", "next-layer", "both")] == [False, False, True, True]


def test_next_layer_share_is_the_ratio_of_totals_and_refuses_negative_counts() -> None:
    """The share the planner prices next-layer prefetch with: U / (M + U) covered, W / (M + U)
    wasted per miss; 0 and 0 without any miss; a negative count is named."""
    from specfit.prefetch import next_layer_share

    share = next_layer_share(num_misses=30, num_used=10, num_wasted=4)
    assert (share.cover_frac, share.waste_per_miss) == (0.25, 0.1)
    assert (share.num_misses, share.num_used, share.num_wasted) == (30, 10, 4)
    assert (next_layer_share(0, 0, 7).cover_frac, next_layer_share(0, 0, 7).waste_per_miss) == (0.0, 0.0)
    with pytest.raises(ValueError, match="num_wasted"):
        next_layer_share(1, 1, -1)
