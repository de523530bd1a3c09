"""The guard's price of a realised cycle with draft prefetch (issue 13): the cycle's prefetch copies
go on the link before the forward and its demand misses queue behind them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.cost import CycleCostModel

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "default"


def _cost(**kw) -> CycleCostModel:
    base = dict(
        draft_s_per_level=1e-3, verify_base_s=3e-3, verify_s_per_node=0.0, verify_s_per_context_token=0.0,
        h2d_bytes_per_s=1e9, h2d_s_per_transfer=0.0, expert_bytes=1_000_000, num_layers=3, draft_prefetch=True,
    )  # fmt: skip
    base.update(kw)
    return CycleCostModel(**base)


def test_demand_copies_wait_behind_the_prefetch_copies() -> None:
    """3 layers of 1 ms compute, 1 ms per copy, no placing: prefetch copies 2, 0, 1 (all enqueued
    before the forward, landing at 2 and 3 ms), a demand miss at layer 1. Without overlap layer 0
    waits for its copies (ends at 3 ms), layer 1's demand copy starts behind layer 2's prefetch
    copy (at 3 ms) and lands at 4 ms (ends 5 ms), layer 2 ends at 6 ms; plus 1 ms of draft."""
    cost = _cost()
    prefetch, demand = np.array([2, 0, 1]), np.array([0, 1, 0])
    assert cost.realised_cycle_s(1, 1, 0, demand, prefetch) == pytest.approx(7e-3, rel=1e-12)
    assert cost.prefetched_cycle_s(1, 1, 0, prefetch) == pytest.approx(6e-3, rel=1e-12)  # the planner's: no demand
    assert cost.prefetched_cycle_s(1, 1, 0, prefetch, np.zeros(3)) == cost.prefetched_cycle_s(1, 1, 0, prefetch)
    # without prefetch copies (or without draft prefetch, or the bound "ideal") cycle_s of the demand misses
    assert cost.realised_cycle_s(1, 1, 0, demand, np.zeros(3)) == pytest.approx(cost.cycle_s(1, 1, 0, demand), rel=1e-12)
    for other in (dataclasses.replace(cost, draft_prefetch=False), dataclasses.replace(cost, overlap_h2d=True)):
        assert other.realised_cycle_s(1, 1, 0, demand, prefetch) == other.cycle_s(1, 1, 0, demand)
    assert cost.realised_cycle_s(1, 1, 0, demand) == cost.cycle_s(1, 1, 0, demand)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_guards_price_is_the_simulated_cycle_with_draft_prefetch(monkeypatch, overlap) -> None:
    """SpecFit with ``--prefetch draft`` and the ``recent`` predictor (per-node sets: ~19 prefetch
    copies per cycle) on the shipped sample, cache 8, 4 GB/s: the guard's price of every cycle is
    its simulated time (to the ns rounding). Priced as the demand misses alone (before), root
    cycles were 0.51-0.59 of it and drafted ones 0.80-0.82."""
    from sim.config import SimConfig
    from sim.replay import replay_policy
    from specfit.policies import SpecFitPolicy
    from traces.reader import open_run

    run = open_run(SAMPLE)
    model = run.manifest.model
    priced: list[tuple[float, int]] = []
    original = SpecFitPolicy.observe_cycle

    def observe(self, cost, num_committed, num_levels, num_nodes, context_len, misses, root=None, issued=None, *rest):
        price = cost.realised_cycle_s(num_levels, num_nodes, context_len, misses, issued)
        priced.append((price, int(np.sum(issued[:2]))))  # draft and next-layer copies (copies_since)
        return original(self, cost, num_committed, num_levels, num_nodes, context_len, misses, root, issued, *rest)

    monkeypatch.setattr(SpecFitPolicy, "observe_cycle", observe)
    cost = CycleCostModel(
        draft_s_per_level=1.766e-3, verify_base_s=4.475e-3, verify_s_per_node=1.98e-5, verify_s_per_context_token=0.0,
        h2d_bytes_per_s=4e9, h2d_s_per_transfer=1e-5, host_s_per_transfer=2e-6, expert_bytes=9_437_184,
        num_layers=model.num_layers, pre_router_fraction=0.336, overlap_h2d=overlap == "on", overlap_mode="on",
        draft_prefetch=True,
    )  # fmt: skip
    config = SimConfig(
        cost=cost, policy="specfit", predictor="recent", cache_capacity_per_layer=8, prefetch="draft", overlap=overlap,
        max_requests=2,
    )  # fmt: skip
    cycles = replay_policy(run, config).cycles
    assert len(priced) == len(cycles) > 50
    assert sum(n for _, n in priced) > 10 * len(cycles)  # the case has teeth: many prefetch copies per cycle
    for (price, _), cycle in zip(priced, cycles):
        assert price == pytest.approx(cycle.cycle_s, rel=1e-6)


def _ledger_copies(num_layers: int, draft, ahead, hits) -> np.ndarray:
    """``PrefetchLedger.copies_since`` of one cycle: the draft copies (per layer, in link order),
    then the next-layer copies (per layer they fill), then each layer's access hitting ``hits``."""
    from specfit.prefetch import PrefetchLedger

    ledger = PrefetchLedger(num_layers, 16)
    ledger.issue(0, [3])  # an earlier cycle's copy, used then: not this cycle's
    ledger.accessed(0, [3], [])
    mark = ledger.mark()
    for layer, experts in enumerate(draft):
        ledger.issue(layer, experts)
    for layer, experts in enumerate(ahead):
        ledger.issue(layer, experts, ahead=True)
    for layer, experts in enumerate(hits):
        ledger.accessed(layer, experts, [])
    return ledger.copies_since(mark)


def _engine_cycle_s(cost: CycleCostModel, mode: str, draft, ahead, hits, demand) -> float:
    """The simulator's FastEngine timeline of the same cycle (idle link, nothing in flight)."""
    from sim.engine import CyclePlan, FastEngine, LinkSpec

    num_layers = cost.num_layers
    c_ns = round(cost.verify_base_s / num_layers * 1e9)
    plan = CyclePlan(
        draft_ns=0, decision_ns=0, layer_compute_ns=(c_ns,) * num_layers, hits=tuple(map(tuple, hits)),
        demand=tuple(map(tuple, demand)), prefetch=[(layer, e) for layer, es in enumerate(draft) for e in es],
        overlap=mode, host_ns_per_transfer=round(cost.host_s_per_transfer * 1e9),
        next_layer=tuple(tuple(ahead[layer + 1]) for layer in range(num_layers - 1)) + ((),),
        layer_pre_router_ns=(round(cost.pre_router_fraction * c_ns),) * num_layers, copy_stream=True,
        placing_ns_per_transfer=round(cost.placing_after_enqueue_s_per_transfer * 1e9),
    )  # fmt: skip
    return FastEngine(LinkSpec(0, round(cost.link_s_per_transfer * 1e9)), num_layers).run_cycle(plan).cycle_ns * 1e-9


def _random_cycle(rng: np.random.Generator, max_draft: int, max_ahead: int, max_demand: int):
    """A random 4-layer cycle of 16 experts: per layer ``(draft, ahead, hits, demand)`` expert lists,
    below ``max_draft`` draft copies, ``max_ahead`` next-layer copies (none into layer 0; 0: none
    drawn), hits among the copies and the resident experts, below ``max_demand`` demand misses."""
    draft, ahead, hits, demand = [], [], [], []
    for layer in range(4):
        ids = rng.permutation(16)
        nd = rng.integers(0, max_draft) if max_draft else 0
        na = rng.integers(0, max_ahead) if max_ahead and layer else 0
        d, a, rest = sorted(ids[:nd]), sorted(ids[nd : nd + na]), ids[nd + na :]
        flying = [e for e in d + a if rng.random() < 0.5]
        hits.append(sorted(flying + list(rest[: rng.integers(0, 3)])))
        demand.append(sorted(rest[3 : 3 + rng.integers(0, max_demand)]))
        draft.append(d)
        ahead.append(a)
    return draft, ahead, hits, demand


def test_a_layer_waits_only_for_the_prefetch_copies_it_hits() -> None:
    """Limit (a) of issue 13's guard: 3 layers of 1 ms compute, 1 ms per copy, draft guesses 5
    and 6 copied into layer 0. Both engines make a layer wait only for the copies of experts it
    hits: 4 ms when layer 0 hits 5, 3 ms when it hits neither, 5 ms when it hits 6. Priced with
    every copy waited for (an int[L] of copies, the form before) it was 5 ms in all three."""
    cost = _cost()
    draft, ahead, demand = [[5, 6], [], []], [[], [], []], [[], [], []]
    for hit, want_s in (([5], 4e-3), ([], 3e-3), ([6], 5e-3)):
        hits = [hit, [], []]
        copies = _ledger_copies(3, draft, ahead, hits)
        assert copies.tolist() == [[2, 0, 0], [0, 0, 0], [len(hit) and 1 + [5, 6].index(hit[0]), 0, 0]]
        assert cost.realised_cycle_s(0, 1, 0, np.zeros(3, np.int64), copies) == pytest.approx(want_s, rel=1e-12)
        for mode in ("off", "on"):
            priced = dataclasses.replace(cost, overlap_h2d=mode == "on", overlap_mode="on")
            assert priced.realised_cycle_s(0, 1, 0, np.zeros(3, np.int64), copies) == pytest.approx(
                _engine_cycle_s(priced, mode, draft, ahead, hits, demand), rel=1e-9
            )
    assert cost.realised_cycle_s(0, 1, 0, np.zeros(3, np.int64), np.array([2, 0, 0])) == pytest.approx(5e-3, rel=1e-12)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_next_layer_copies_are_priced_where_the_engines_issue_them(mode) -> None:
    """Limit (b): ``--prefetch both`` without a fitted share. Layer 0 has a draft copy it hits;
    layer 1 misses one expert and, after its router, its next-layer guesses 7 and 9 of layer 2
    are placed (0.5 ms each) and copied behind that demand copy; layer 2 hits 7 only. Priced as
    the engine runs it; the int[L] of all copies (the form before) placed the two next-layer
    copies before the forward and waited for both."""
    cost = _cost(host_s_per_transfer=5e-4, h2d_s_per_transfer=1.5e-3, pre_router_fraction=0.25, next_layer_prefetch=True)
    cost = dataclasses.replace(cost, overlap_h2d=mode == "on", overlap_mode="on")
    assert not cost.next_layer_priced
    draft, ahead, hits, demand = [[4], [], []], [[], [], [7, 9]], [[4], [], [7]], [[], [2], []]
    copies = _ledger_copies(3, draft, ahead, hits)
    assert copies.tolist() == [[1, 0, 0], [0, 0, 2], [1, 0, 1]]
    misses = np.array([0, 1, 0])
    want = _engine_cycle_s(cost, mode, draft, ahead, hits, demand)
    assert cost.realised_cycle_s(0, 1, 0, misses, copies) == pytest.approx(want, rel=1e-9)
    assert cost.realised_cycle_s(0, 1, 0, misses, copies[0] + copies[1]) != pytest.approx(want, rel=1e-3)
    # without draft prefetch (--prefetch next-layer, no share) the same copies are priced too
    nl = dataclasses.replace(cost, draft_prefetch=False)
    no_draft = _ledger_copies(3, [[], [], []], ahead, [[], [], [7]])
    want = _engine_cycle_s(nl, mode, [[], [], []], ahead, [[], [], [7]], demand)
    assert nl.realised_cycle_s(0, 1, 0, misses, no_draft) == pytest.approx(want, rel=1e-9)
    assert nl.realised_cycle_s(0, 1, 0, misses, no_draft[0] + no_draft[1]) != pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize(("placing_s", "latency_s"), [(0.0, 7e-4), (1e-4, 7e-4), (1.5e-4, 2.1e-4)])
@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_realised_price_is_the_engines_timeline_on_random_cycles(mode, placing_s, latency_s) -> None:
    """300 random cycles (4 layers, draft and next-layer copies, hits among them and among
    resident experts, demand misses; placing, part of it after the enqueue or none, pre-router
    share; no late-call cost, an idle link at the start): :meth:`realised_cycle_s` of the
    ledger's counts is FastEngine's cycle (a copy's link time below its placing after the
    enqueue in the last case at 64 GB/s: the placing, not the link, times the landings)."""
    rng = np.random.default_rng(13)
    cost = _cost(num_layers=4, verify_base_s=4e-3, host_s_per_transfer=2e-4, h2d_s_per_transfer=latency_s,
                 pre_router_fraction=0.25, next_layer_prefetch=True)  # fmt: skip
    cost = dataclasses.replace(
        cost, overlap_h2d=mode == "on", overlap_mode="on", h2d_bytes_per_s=rng.choice([1e9, 4e9, 64e9]),
        placing_after_enqueue_s_per_transfer=placing_s,
    )  # fmt: skip
    wrong = 0
    for _ in range(300):
        draft, ahead, hits, demand = _random_cycle(rng, 4, 4, 3)
        copies = _ledger_copies(4, draft, ahead, hits)
        misses = np.array([len(x) for x in demand])
        want = _engine_cycle_s(cost, mode, draft, ahead, hits, demand)
        assert cost.realised_cycle_s(0, 1, 0, misses, copies) == pytest.approx(want, rel=1e-9, abs=1e-12)
        wrong += cost.realised_cycle_s(0, 1, 0, misses, copies[0] + copies[1]) != pytest.approx(want, rel=1e-9)
    if latency_s > placing_s * 2:  # (at placing > link time every copy lands as it is placed)
        assert wrong > 100  # the form before was wrong on most of them


def _root_only_cycle(cache, root_ids, predicted_bits, guesses, num_experts: int, capacity: int):
    """A realised root-only cycle on ``cache`` with draft and next-layer prefetch, as the engines
    run it (``specfit.prefetch``): its demand misses int[L] and ledger copies int[3, L]."""
    from specfit.prefetch import PrefetchLedger, draft_prefetch, next_layer_choice, warm_layer

    num_layers = root_ids.shape[0]
    ledger = PrefetchLedger(num_layers, num_experts)
    mark = ledger.mark()
    copies, evicted = draft_prefetch(cache, None if predicted_bits is None else predicted_bits[None], num_experts, capacity)
    for layer in range(num_layers):
        ledger.evicted(layer, evicted[layer])
        ledger.issue(layer, [e for lay, e in copies if lay == layer])
    if guesses is not None:
        for layer in range(num_layers - 1):
            ahead, gone = warm_layer(cache, layer + 1, next_layer_choice(guesses[None, layer], num_experts, capacity))
            ledger.evicted(layer + 1, gone)
            ledger.issue(layer + 1, ahead, ahead=True)
    demand = np.zeros(num_layers, dtype=np.int64)
    for layer in range(num_layers):
        access = cache.access(layer, root_ids[layer])
        ledger.accessed(layer, access.hits, access.evicted, len(access.misses))
        demand[layer] = len(access.misses)
    return demand, ledger.copies_since(mark)


@pytest.mark.parametrize("ahead", [False, True])
def test_root_alone_copies_are_a_root_only_cycles(ahead) -> None:
    """Limit (c): the paired root price's copies (``root_alone_copies``) are those a root-only
    cycle on the same cache realises (draft prefetch of the root's predicted experts, next-layer
    prefetch of its guesses; 200 random caches and predictions, room for every warm so nothing
    the root routes to is evicted)."""
    from specfit import bitsets
    from specfit.cache import make_expert_cache
    from specfit.policies import root_alone_copies

    rng = np.random.default_rng(7)
    num_layers, num_experts, top_k = 4, 16, 2
    for _ in range(200):
        cache = make_expert_cache("lru", num_layers, num_experts, num_experts)
        for layer in range(num_layers):
            cache.access(layer, rng.choice(num_experts, rng.integers(0, 6), replace=False))
        root_ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_layers)])
        predicted = bitsets.pack(np.stack([rng.choice(num_experts, 3, replace=False) for _ in range(num_layers)]), num_experts)
        guesses = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_layers - 1)]) if ahead else None
        want = root_alone_copies(cache.cached_bits(), root_ids, num_experts, num_experts, predicted, guesses)
        got = _root_only_cycle(cache, root_ids, predicted, guesses, num_experts, num_experts)
        np.testing.assert_array_equal(want[0], got[0])
        np.testing.assert_array_equal(want[1], got[1])


def _root_alone_by_sets(cached, root_ids, capacity, predicted, guesses) -> tuple[list, list]:
    """``root_alone_copies`` per layer on Python sets (``cached``, ``predicted``: per-layer sets)."""
    demand, copies = [], [[], [], []]
    for layer, routed in enumerate(root_ids):
        routed = {int(e) for e in routed if e >= 0}
        resident, draft, ahead = set(cached[layer]), [], []
        if predicted is not None and capacity > 0:
            chosen = sorted(predicted[layer])[:capacity]
            draft = [e for e in chosen if e not in resident]
            resident |= set(chosen)
        if guesses is not None and capacity > 0 and layer > 0:
            chosen = sorted({int(e) for e in guesses[layer - 1] if e >= 0})[:capacity]
            ahead = [e for e in chosen if e not in resident]
            resident |= set(chosen)
        demand.append(len(routed - resident))
        waits = [rank for rank, e in enumerate(draft + ahead, start=1) if e in routed]
        for kind, count in enumerate((len(draft), len(ahead), max(waits, default=0))):
            copies[kind].append(count)
    return demand, copies


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 7, 64, 65, 130]),
    st.integers(1, 5),
    st.integers(0, 2**31 - 1),
)
def test_root_alone_copies_equals_a_per_layer_count_on_sets(num_experts, num_layers, seed) -> None:
    """The compiled ``root_alone_copies`` gives what a plain per-layer count on sets gives: the
    ``capacity`` cut binding or not (0, 1, E), draft and next-layer prefetch alone or together,
    padding ids, one or several words per bitset."""
    from specfit import bitsets
    from specfit.policies import root_alone_copies

    rng = np.random.default_rng(seed)
    top_k = int(rng.integers(1, min(num_experts, 6) + 1))
    capacity = int(rng.choice([0, 1, num_experts, int(rng.integers(0, num_experts + 1))]))

    def sets(density):
        return [set(np.flatnonzero(rng.random(num_experts) < density).tolist()) for _ in range(num_layers)]

    def bits(layer_sets):
        ids = np.full((num_layers, num_experts), -1)
        for layer, members in enumerate(layer_sets):
            ids[layer, : len(members)] = sorted(members)
        return bitsets.pack(ids, num_experts)

    cached = sets(rng.random())
    root_ids = rng.integers(-1, num_experts, size=(num_layers, top_k))
    predicted = sets(rng.random()) if rng.random() < 0.7 else None
    guesses = rng.integers(-1, num_experts, size=(num_layers - 1, top_k)) if rng.random() < 0.6 else None
    if predicted is None and guesses is None:
        guesses = rng.integers(-1, num_experts, size=(num_layers - 1, top_k))
    demand, copies = root_alone_copies(
        bits(cached), root_ids, num_experts, capacity, None if predicted is None else bits(predicted), guesses
    )
    assert (demand.tolist(), copies.tolist()) == _root_alone_by_sets(cached, root_ids, capacity, predicted, guesses)
    assert demand.dtype == copies.dtype == np.int64


def test_root_alone_copies_rejects_bad_shapes_and_ids() -> None:
    """Wrong bitset widths, layer counts that disagree and an expert id >= E raise (the compiled
    pass does no bounds checks), as the docstring says."""
    from specfit import bitsets
    from specfit.policies import root_alone_copies

    cached = bitsets.pack(np.array([[1], [2], [3]]), 70)  # 3 layers, 2 words
    ids = np.array([[1, 2], [3, 4], [5, 6]])
    with pytest.raises(ValueError, match="cached_bits"):
        root_alone_copies(cached[:, :1], ids, 70, 4, cached[:, :1])
    with pytest.raises(ValueError, match="root_expert_ids"):
        root_alone_copies(cached, ids[:2], 70, 4, cached)
    with pytest.raises(ValueError, match="predicted_bits"):
        root_alone_copies(cached, ids, 70, 4, cached[:2])
    with pytest.raises(ValueError, match="next_layer_ids"):
        root_alone_copies(cached, ids, 70, 4, None, ids)
    with pytest.raises(IndexError, match="expert id"):
        root_alone_copies(cached, np.array([[1, 2], [3, 70], [5, 6]]), 70, 4, cached)
    with pytest.raises(IndexError, match="expert id"):
        root_alone_copies(cached, ids, 70, 4, None, np.array([[1, 2], [3, 99]]))


def test_the_paired_root_price_has_the_root_alones_prefetch_copies() -> None:
    """Limit (c) at the guard: 3 layers of 1 ms, the root misses expert 1 at layer 0 and expert 5
    at layer 2, and the predictor names the root's experts. A root-only cycle prefetches both
    (placed 1 ms each before the forward, then 1 ms per copy: they land at 2 and 3 ms, while
    layers 0 and 1 compute) and has no demand miss: 5 ms. The drafting cycle's paired price of
    the root alone is now that price; before it was ``cycle_s`` of two demand misses without
    prefetch (3 + 2 x 2 = 7 ms), so the pooled reference rate mixed two pricings."""
    from specfit import bitsets
    from specfit.cache import make_expert_cache
    from specfit.policies import SpecFitPolicy, root_alone_copies, root_layer_misses

    cost = _cost(host_s_per_transfer=1e-3, h2d_s_per_transfer=1e-3, expert_bytes=1_000_000)
    cache = make_expert_cache("lru", 3, 8, 4)
    root_ids = np.array([[1, 2], [3, 4], [5, 6]])
    for layer, resident in enumerate(([2], [3, 4], [6])):
        cache.access(layer, resident)
    cached = cache.cached_bits()
    predicted = bitsets.pack(root_ids, 8)
    demand, copies = root_alone_copies(cached, root_ids, 8, 4, predicted)
    assert demand.tolist() == [0, 0, 0] and copies.tolist() == [[1, 0, 1], [0, 0, 0], [1, 0, 1]]
    realised = _root_only_cycle(cache, root_ids, predicted, None, 8, 4)
    root_only_s = cost.realised_cycle_s(0, 1, 0, *realised)
    assert root_only_s == pytest.approx(5e-3, rel=1e-12)
    policy = SpecFitPolicy()
    policy.observe_cycle(cost, 3, 2, 5, 0, np.zeros(3, np.int64), demand, np.zeros((3, 3), np.int64), copies)
    assert policy.guard.arms["spec"][0][3] == root_only_s
    before = cost.cycle_s(0, 1, 0, root_layer_misses(cached, root_ids))
    assert before == pytest.approx(7e-3, rel=1e-12) and before != pytest.approx(root_only_s, rel=1e-3)


@pytest.mark.parametrize(("prefetch", "overlap"), [("both", "off"), ("next-layer", "on")])
def test_the_guards_price_is_the_simulated_cycle_with_next_layer_copies_and_no_share(monkeypatch, prefetch, overlap) -> None:
    """Limit (b) on the shipped sample (SpecFit, ``recent`` predictor, cache 8, 4 GB/s, no fitted
    share): the guard's price is the simulated cycle to 1e-6 in all but the cycles that start
    with copies still in flight (1 of 92 here). Before: ``both`` priced the next-layer copies as
    placed before the forward (1.007-1.058 of the simulated time, none equal), ``next-layer``
    priced none of them (0.30-0.84)."""
    from sim.config import SimConfig
    from sim.replay import replay_policy
    from specfit.policies import SpecFitPolicy
    from traces.reader import open_run

    run = open_run(SAMPLE)
    priced: list[float] = []
    original = SpecFitPolicy.observe_cycle

    def observe(self, cost, num_committed, num_levels, num_nodes, context_len, misses, *rest):
        priced.append(cost.realised_cycle_s(num_levels, num_nodes, context_len, misses, rest[1]))
        return original(self, cost, num_committed, num_levels, num_nodes, context_len, misses, *rest)

    monkeypatch.setattr(SpecFitPolicy, "observe_cycle", observe)
    cost = CycleCostModel(
        draft_s_per_level=1.766e-3, verify_base_s=4.475e-3, verify_s_per_node=1.98e-5, verify_s_per_context_token=0.0,
        h2d_bytes_per_s=4e9, h2d_s_per_transfer=1e-5, host_s_per_transfer=2e-6, expert_bytes=9_437_184,
        num_layers=run.manifest.model.num_layers, pre_router_fraction=0.336, overlap_h2d=overlap == "on", overlap_mode="on",
        draft_prefetch=prefetch == "both", next_layer_prefetch=True,
    )  # fmt: skip
    assert not cost.next_layer_priced
    config = SimConfig(
        cost=cost, policy="specfit", predictor="recent", cache_capacity_per_layer=8, prefetch=prefetch, overlap=overlap,
        max_requests=2,
    )  # fmt: skip
    cycles = replay_policy(run, config).cycles
    ratios = np.array(priced) / np.array([c.cycle_s for c in cycles])
    assert len(ratios) > 50 and np.sum(np.abs(ratios - 1.0) < 1e-6) >= len(ratios) - 2
    assert np.all(np.abs(ratios - 1.0) < 0.05)


@pytest.mark.parametrize("placing_s", [1e-4, 2e-4, 3e-4])  # below, at and above a copy's link time (2e-4 s)
@pytest.mark.parametrize("prefetch", ["next-layer", "draft", "both"])
@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_copy_stream_run_is_priced_with_its_placing_after_the_enqueue(mode, prefetch, placing_s) -> None:
    """rev2 finding 1: with any prefetch mode the engines put the demand copies on the copy
    stream (``live.offload``'s ``_copy_stream``, ``sim.replay``'s ``copy_stream``), so a
    placing after the enqueue ``P`` overlaps the link without overlap too: a layer's ``m``
    demand copies cost ``host + max(T_link - P, 0)`` each, not ``host + T_link``. 200 random
    cycles (4 layers, demand misses, next-layer copies in about half of them, draft copies,
    no late-call cost): :meth:`cycle_s` of a demand-only cycle and :meth:`realised_cycle_s` of
    every cycle are FastEngine's timeline (before: overlap off priced ``host + T_link`` per demand
    miss, and a next-layer run's cycles without copies took that price while the others took
    the engines' timeline)."""
    rng = np.random.default_rng(int(placing_s * 1e5))
    draft_on, ahead_on = prefetch in ("draft", "both"), prefetch in ("next-layer", "both")
    cost = _cost(
        num_layers=4, verify_base_s=4e-3, h2d_bytes_per_s=1e10, host_s_per_transfer=3e-4, h2d_s_per_transfer=4e-4,
        pre_router_fraction=0.25, draft_prefetch=draft_on, next_layer_prefetch=ahead_on, overlap_h2d=mode == "on",
        overlap_mode="on", placing_after_enqueue_s_per_transfer=placing_s,
    )  # fmt: skip
    assert cost.link_s_per_transfer == pytest.approx(2e-4, rel=1e-12) and not cost.next_layer_priced
    assert cost.priced_s_per_miss == pytest.approx(3e-4 + max(2e-4 - placing_s, 0.0), rel=1e-12)
    for _ in range(200):
        issue_ahead = ahead_on and rng.random() < 0.5
        draft, ahead, hits, demand = _random_cycle(rng, 3 if draft_on else 0, 3 if issue_ahead else 0, 4)
        copies = _ledger_copies(4, draft, ahead, hits)
        misses = np.array([len(x) for x in demand])
        want = _engine_cycle_s(cost, mode, draft, ahead, hits, demand)
        assert cost.realised_cycle_s(0, 1, 0, misses, copies) == pytest.approx(want, rel=1e-9, abs=1e-12)
        if not copies[:2].any():  # demand misses only: the serial / per-layer form itself
            assert cost.cycle_s(0, 1, 0, misses) == pytest.approx(want, rel=1e-9, abs=1e-12)
    # P = 0 or no copy stream (no prefetch without overlap; the bound "ideal"): host + T_link as before
    for other in (
        dataclasses.replace(cost, placing_after_enqueue_s_per_transfer=0.0),
        dataclasses.replace(cost, draft_prefetch=False, next_layer_prefetch=False, overlap_h2d=False),
        dataclasses.replace(cost, overlap_h2d=True, overlap_mode="ideal"),
    ):
        assert other.priced_s_per_miss == other.s_per_miss
        if not other.per_layer_priced:  # the serial form and the bound "ideal"
            assert other.cycle_s(0, 1, 0, np.array([1, 2, 0, 3])) == other.combine_s(0.0, 4e-3, 6 * other.s_per_miss)
