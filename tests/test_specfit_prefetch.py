"""specfit.prefetch: the experts draft prefetch copies, and the issued/used/wasted ledger."""

from __future__ import annotations

import numpy as np
import pytest

from specfit import bitsets
from specfit.cache import EVICTIONS, HITS, make_expert_cache
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
    assert (share.cover_fraction, share.waste_per_miss) == (0.25, 0.1)
    assert (share.num_misses, share.num_used, share.num_wasted) == (30, 10, 4)
    assert (next_layer_share(0, 0, 7).cover_fraction, next_layer_share(0, 0, 7).waste_per_miss) == (0.0, 0.0)
    with pytest.raises(ValueError, match="num_wasted"):
        next_layer_share(1, 1, -1)


def test_planner_misses_leave_layer_0_out_for_counts_and_arrays() -> None:
    """``B = M - M_0 + U`` in one place: the share's denominator, its property, per-cycle arrays."""
    from specfit.prefetch import next_layer_share, planner_misses

    share = next_layer_share(num_misses=30, num_used=10, num_wasted=4, num_first_layer_misses=8)
    assert share.num_planner_misses == planner_misses(30, 8, 10) == 32
    assert (share.cover_fraction, share.waste_per_miss) == (10 / 32, 4 / 32)
    assert next_layer_share(5, 0, 1, 5).num_planner_misses == 0
    np.testing.assert_array_equal(planner_misses(np.array([3, 4]), np.array([1, 0]), np.array([2, 0])), [4, 4])


def test_next_layer_share_by_nodes_groups_sizes_into_knots() -> None:
    """Knots over the verified nodes: consecutive sizes pooled until a group holds the least
    planner misses, each knot its group's planner-miss-weighted mean size and ratios of totals;
    the pooled share beside them is :func:`next_layer_share` of all counts."""
    from specfit.prefetch import next_layer_share, next_layer_share_by_nodes

    nodes = np.array([1, 1, 1, 3, 4, 4, 30, 30, 31])
    misses = np.array([50, 60, 40, 100, 80, 20, 400, 300, 10])
    used = np.array([100, 90, 110, 60, 40, 40, 60, 40, 0])
    wasted = np.array([30, 30, 30, 20, 10, 10, 5, 5, 0])
    fit = next_layer_share_by_nodes(nodes, misses, used, wasted, min_knot_misses=200, max_knots=8)
    pooled = next_layer_share(misses.sum(), used.sum(), wasted.sum())
    assert (fit.cover_fraction, fit.waste_per_miss, fit.num_misses) == (pooled.cover_fraction, pooled.waste_per_miss, pooled.num_misses)
    # size 1: 450 planner misses (a knot); sizes 3-4: 340; sizes 30-31: 810
    assert fit.nodes == pytest.approx((1.0, (3 * 160 + 4 * 180) / 340, (30 * 800 + 31 * 10) / 810))
    assert fit.cover_fractions == pytest.approx((300 / 450, 140 / 340, 100 / 810))
    assert fit.waste_per_misses == pytest.approx((90 / 450, 40 / 340, 10 / 810))
    # a larger minimum merges; a short last group joins the one before
    merged = next_layer_share_by_nodes(nodes, misses, used, wasted, min_knot_misses=500)
    assert merged.nodes == pytest.approx(((1 * 450 + 3 * 160) / 610, (4 * 180 + 30 * 800 + 31 * 10) / 990))
    last = next_layer_share_by_nodes(nodes, misses, used, wasted, min_knot_misses=800)
    assert len(last.nodes) == 1 and last.cover_fractions[0] == pytest.approx(pooled.cover_fraction)
    assert next_layer_share_by_nodes([2], [0], [0], [3]).nodes == ()  # no planner miss: no knot
    assert "1: 0.67/0.20" in fit.knots_text() and next_layer_share(1, 1, 0).knots_text() == ""
    with pytest.raises(ValueError, match="num_nodes must be >= 1"):
        next_layer_share_by_nodes([0], [1], [1], [1])
    with pytest.raises(ValueError, match="counts per column"):
        next_layer_share_by_nodes([1, 2], [1], [1], [1])
    with pytest.raises(ValueError, match="num_used must be >= 0"):
        next_layer_share_by_nodes([1], [1], [-1], [1])


def test_ledger_miss_fraction_counts_a_used_prefetch_as_a_miss():
    """The planner prices the cache before the cycle's prefetch (issue 13): a hit on a prefetched
    expert is one of its misses, so the ledger's average counts it as one; with nothing
    prefetched it moves exactly as the cache's own average."""
    from specfit.cache import MISS_EMA_WEIGHT

    cache = make_expert_cache("lru", 2, 8, 4)
    ledger = PrefetchLedger(2, 8)
    for ids in ([0, 1], [1, 2, 3]):  # no prefetch: the same values as CacheStats
        access = cache.access(0, np.array(ids))
        ledger.accessed(0, access.hits, access.evicted, len(access.misses))
    np.testing.assert_array_equal(ledger.layer_miss_fraction, cache.stats.layer_miss_fraction)
    before = float(ledger.layer_miss_fraction[0])  # 1 + 0.1 * (2/3 - 1)
    ledger.issue(0, [5, 6])  # two prefetched experts, then an access hitting one of them and 1
    access = cache.access(0, np.array([1, 5]))
    assert len(access.misses) == 1  # expert 5 was not warmed in this toy cache: a demand miss
    ledger.accessed(0, access.hits, access.evicted, len(access.misses))
    assert ledger.layer_miss_fraction[0] == cache.stats.layer_miss_fraction[0]  # 5 not used: same
    ledger.issue(0, [2])  # pretend 2 was prefetched: a hit on it is a planner miss
    access = cache.access(0, np.array([2, 3]))
    ledger.accessed(0, access.hits, access.evicted, len(access.misses))
    cache_value = float(cache.stats.layer_miss_fraction[0])
    ledger_value = float(ledger.layer_miss_fraction[0])
    assert cache_value < ledger_value  # the cache counts the used prefetch as a hit
    after_5 = before + MISS_EMA_WEIGHT * (1 / 2 - before)
    assert ledger_value == pytest.approx(after_5 + MISS_EMA_WEIGHT * (1 / 2 - after_5))
    assert np.isnan(ledger.layer_miss_fraction[1])  # layer 1 never accessed
    ledger.restart(np.array([0.25, np.nan]))
    assert not ledger.pending.any()
    np.testing.assert_array_equal(ledger.layer_miss_fraction, [0.25, np.nan])


def test_planner_miss_fraction_is_the_ledgers_only_under_prefetch():
    from specfit.prefetch import planner_miss_fraction

    cache = make_expert_cache("lru", 1, 8, 4)
    ledger = PrefetchLedger(1, 8)
    ledger.restart(np.array([0.5]))
    cache.access(0, np.array([0, 1]))
    assert planner_miss_fraction(cache, ledger, "none")[0] == 1.0
    assert planner_miss_fraction(cache, ledger, "next-layer")[0] == 0.5


@pytest.mark.parametrize("seed", range(40))
def test_accessed_layers_equals_the_per_layer_calls(seed):
    """``PrefetchLedger.accessed_layers`` (the simulator's batched count) leaves the ledger as
    ``accessed`` at every layer in order does: the counts, the pending marks, the last used copy
    per layer and the miss-fraction averages bit for bit, over random caches, warms (prefetch
    issues and their evictions) and accesses, the compiled and the numpy cache access alike."""
    rng = np.random.default_rng(seed)
    num_layers, num_experts = int(rng.integers(1, 5)), int(rng.choice([3, 8, 70]))
    cache = make_expert_cache("lru", num_layers, num_experts, int(rng.integers(0, num_experts + 1)))
    batched, per_layer = PrefetchLedger(num_layers, num_experts), PrefetchLedger(num_layers, num_experts)
    for step in range(30):
        for layer in range(num_layers):  # a draft prefetch: warm a few, count the copies and evictions
            ids = rng.choice(num_experts, size=int(rng.integers(0, 3)), replace=False)
            missing = [e for e in ids.tolist() if not cache.contains(layer, e)]
            before = cache.cached_ids(layer)
            cache.warm(layer, ids)
            gone = np.setdiff1d(before, cache.cached_ids(layer))
            for ledger in (batched, per_layer):
                ledger.issue(layer, missing, ahead=bool(step % 2))
                ledger.evicted(layer, gone)
        mask = rng.random((num_layers, num_experts)) < rng.uniform(0.05, 0.6)
        access = cache.access_layers(mask, reference=bool(step % 3 == 0))
        batched.accessed_layers(access.keys(HITS), access.keys(EVICTIONS), access.num_hits, access.num_misses)
        for layer, (hit, gone) in enumerate(zip(access.hit_ids(), access.evicted_ids())):
            per_layer.accessed(layer, hit, gone, int(access.num_misses[layer]))
        assert batched.counts() == per_layer.counts()
        assert np.array_equal(batched.pending, per_layer.pending)
        assert batched.layer_last_used.tolist() == per_layer.layer_last_used.tolist()
        assert batched.layer_miss_fraction.tobytes() == per_layer.layer_miss_fraction.tobytes()
