"""sim.replay: one policy replayed on a small synthetic dense trace."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from tiny_shapes import tiny_shape

from sim.config import SimConfig
from sim.replay import ReplayError, committed_path, link_from_cost, replay_policy, split_ns
from specfit.cost import CycleCostModel
from specfit.units import s_to_ns
from traces.reader import open_run
from traces.synthetic import generate_dense_trace

SHAPE = tiny_shape(12_288, "tiny")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    path = generate_dense_trace(
        tmp_path_factory.mktemp("sim-replay") / "tiny",
        SHAPE,
        num_requests=2,
        positions_per_request=24,
        prompt_len=8,
        tree_depth=4,
        tree_topk=3,
        max_nodes=16,
        seed=3,
    )
    return open_run(path)


def _cost(**kw) -> CycleCostModel:
    base = dict(
        draft_s_per_level=1e-3,
        verify_base_s=4e-3,
        verify_s_per_node=2e-5,
        verify_s_per_context_token=1e-7,
        h2d_bytes_per_s=16e9,
        h2d_s_per_transfer=1e-5,
        expert_bytes=9_437_184,
        num_layers=SHAPE.num_layers,
    )
    return CycleCostModel(**{**base, **kw})


def _tokens(result, request_id: int) -> list[int]:
    return [t for c in result.cycles if c.request_id == request_id for t in c.committed_token_ids]


@pytest.mark.parametrize("policy", ["ar", "chain", "topn", "specfit", "cascade"])
def test_every_policy_commits_exactly_the_greedy_output(run, policy: str) -> None:
    result = replay_policy(run, SimConfig(cost=_cost(), policy=policy, cache_capacity_per_layer=4))
    generated = dict(zip(run.requests["request_id"], run.requests["generated_token_ids"]))
    for rid in (0, 1):
        tokens = _tokens(result, rid)
        assert len(tokens) >= 24  # the last tree sits at position 23
        assert tokens == list(generated[rid][: len(tokens)])
    positions = [c.position for c in result.cycles if c.request_id == 0]
    commits = [c.num_committed for c in result.cycles if c.request_id == 0]
    assert positions == list(np.cumsum([0, *commits[:-1]]))
    assert result.totals.num_committed == sum(c.num_committed for c in result.cycles)
    if policy == "ar":
        assert result.totals.tau == 1.0 and all(c.num_draft_levels == 0 for c in result.cycles)


def test_serial_cycle_equals_the_cost_formula_and_oracle_prediction(run) -> None:
    cost = _cost()
    result = replay_policy(
        run, SimConfig(cost=cost, policy="specfit", predictor="oracle", cache_capacity_per_layer=6)
    )
    transfer_ns = s_to_ns(cost.transfer_s(1))
    for c in result.cycles:
        verify_ns = s_to_ns(cost.verify_s(c.num_nodes_verified, c.context_len))
        expected_ns = (
            s_to_ns(cost.draft_s(c.num_draft_levels)) + verify_ns + sum(c.layer_misses) * transfer_ns
        )
        assert s_to_ns(c.cycle_s) == expected_ns
        formula = cost.cycle_s(c.num_draft_levels, c.num_nodes_verified, c.context_len, c.layer_misses)
        assert c.cycle_s == pytest.approx(formula, abs=(sum(c.layer_misses) + 3) * 1e-9)
        # the oracle planner sees the true experts and the same cache: its prediction is exact
        assert c.predicted_cycle_s == pytest.approx(c.cycle_s, abs=(sum(c.layer_misses) + 3) * 1e-9)
        assert c.cache_misses == sum(c.layer_misses)
        assert c.layer_h2d_bytes == [m * cost.expert_bytes for m in c.layer_misses]


def test_totals_are_consistent_with_the_cycles(run) -> None:
    result = replay_policy(run, SimConfig(cost=_cost(), policy="topn", cache_capacity_per_layer=4))
    t, cycles = result.totals, result.cycles
    assert t.num_cycles == len(cycles)
    assert t.decode_s == pytest.approx(sum(c.cycle_s for c in cycles))
    assert t.tokens_per_s == pytest.approx(t.num_committed / t.decode_s)
    assert t.tau == pytest.approx(np.mean([c.num_committed for c in cycles]))
    hits, misses = sum(c.cache_hits for c in cycles), sum(c.cache_misses for c in cycles)
    assert t.hit_rate == pytest.approx(hits / (hits + misses))
    assert t.h2d_bytes == sum(sum(c.layer_h2d_bytes) for c in cycles)
    assert t.prefill_h2d_bytes > 0 and 0 < t.hit_rate < 1
    assert t.to_dict()["h2d_gb"] == pytest.approx(t.h2d_bytes / 1e9)


def test_same_config_same_result_and_bandwidth_monotone(run) -> None:
    config = SimConfig(
        cost=_cost(),
        policy="specfit",
        cache_capacity_per_layer=4,
        overlap=True,
        prefetch=True,
        predictor="recent",
    )
    a, b = replay_policy(run, config), replay_policy(run, config)
    assert a.totals == b.totals and a.cycles == b.cycles
    slow = replay_policy(run, dataclasses.replace(config, cost=_cost(h2d_bytes_per_s=4e9), policy="topn"))
    fast = replay_policy(run, dataclasses.replace(config, cost=_cost(h2d_bytes_per_s=64e9), policy="topn"))
    assert fast.totals.tokens_per_s > slow.totals.tokens_per_s
    assert fast.totals.num_committed == slow.totals.num_committed  # same plans: topn ignores costs


def test_overlap_never_slower_and_simpy_engine_agrees(run) -> None:
    serial = replay_policy(run, SimConfig(cost=_cost(), policy="topn", cache_capacity_per_layer=4))
    over = replay_policy(
        run, SimConfig(cost=_cost(), policy="topn", cache_capacity_per_layer=4, overlap=True)
    )
    assert over.totals.decode_ns <= serial.totals.decode_ns
    assert over.totals.cache_misses == serial.totals.cache_misses  # timing never changes cache decisions
    for c in over.cycles:
        bound = c.draft_s + max(c.verify_s, c.h2d_s)
        assert bound - 1e-9 <= c.cycle_s <= c.draft_s + c.verify_s + c.h2d_s + 1e-9
    both = SimConfig(
        cost=_cost(),
        policy="topn",
        cache_capacity_per_layer=4,
        overlap=True,
        prefetch=True,
        predictor="recent",
    )
    ref = replay_policy(run, dataclasses.replace(both, engine="simpy"))
    fast = replay_policy(run, dataclasses.replace(both, engine="fast"))
    assert ref.totals == fast.totals
    ideal = replay_policy(
        run, SimConfig(cost=_cost(), policy="topn", cache_capacity_per_layer=4, overlap="ideal")
    )
    assert ideal.totals.decode_ns <= over.totals.decode_ns  # the bound is never slower than "on"


def test_prefetch_with_the_oracle_moves_copies_off_the_critical_path(run) -> None:
    base = SimConfig(cost=_cost(), policy="topn", predictor="oracle", cache_capacity_per_layer=14)
    plain = replay_policy(run, base)
    pre = replay_policy(run, dataclasses.replace(base, prefetch=True))
    assert pre.totals.prefetch_bytes > 0
    issued = sum(c.num_prefetch_issued for c in pre.cycles)
    used, wasted = (sum(getattr(c, f"num_prefetch_{k}") for c in pre.cycles) for k in ("used", "wasted"))
    assert issued * 9_437_184 == pre.totals.prefetch_bytes
    assert 0 < used and used + wasted <= issued  # the oracle's prefetches are mostly used
    assert all(c.num_prefetch_issued is None for c in plain.cycles)
    assert pre.totals.cache_hits > plain.totals.cache_hits
    assert pre.totals.stall_ns < plain.totals.stall_ns


def test_cache_policies_and_capacity(run) -> None:
    rates = {}
    for policy in ("lru", "lfu", "static", "belady"):
        result = replay_policy(
            run, SimConfig(cost=_cost(), policy="ar", cache_policy=policy, cache_capacity_per_layer=4)
        )
        rates[policy] = result.totals.hit_rate
    assert (
        rates["belady"] >= max(rates["lru"], rates["lfu"]) - 1e-12
    )  # the oracle bound (same accesses under AR)
    full = replay_policy(
        run, SimConfig(cost=_cost(), policy="ar", cache_capacity_per_layer=SHAPE.num_experts)
    )
    none = replay_policy(run, SimConfig(cost=_cost(), policy="ar", cache_capacity_per_layer=0))
    assert none.totals.hit_rate == 0.0
    assert full.totals.hit_rate > rates["lru"]


def test_link_concurrency_runs_on_simpy_and_helps(run) -> None:
    one = replay_policy(run, SimConfig(cost=_cost(), policy="topn", cache_capacity_per_layer=2))
    two = replay_policy(
        run, SimConfig(cost=_cost(), policy="topn", cache_capacity_per_layer=2, link_concurrency=2)
    )
    assert two.totals.decode_ns < one.totals.decode_ns


def test_helpers() -> None:
    assert split_ns(10, 3) == (3, 3, 4) and sum(split_ns(123_456_789, 48)) == 123_456_789
    link = link_from_cost(_cost())
    assert link.transfer_ns == s_to_ns(_cost().transfer_s(1)) and link.latency_ns == 10_000

    class Tree:
        parents = np.array([-1, 0, 0, 1, 3])
        depths = np.array([0, 1, 1, 2, 3])

    ok = np.array([True, True, False, True, False])
    assert committed_path(Tree, ok, np.array([0, 1, 2, 3, 4])).tolist() == [0, 1, 3]
    assert committed_path(Tree, ok, np.array([0, 2])).tolist() == [0]
    # two path-accepted nodes at the deepest level (greedy never makes them): the lowest id's path,
    # not the accepted nodes as they are (the shortcut for one accepted node per depth)
    Tree.parents, Tree.depths = np.array([-1, 0, 0, 1, 2]), np.array([0, 1, 1, 2, 2])
    assert committed_path(Tree, np.ones(5, dtype=bool), np.arange(5)).tolist() == [0, 1, 3]
    assert committed_path(Tree, np.array([True, False, True, False, True]), np.arange(5)).tolist() == [0, 2, 4]


def test_bad_configs_raise_clear_errors(run) -> None:
    with pytest.raises(ReplayError, match="num_layers=48 but the trace"):
        replay_policy(run, SimConfig(cost=_cost(num_layers=48)))
    with pytest.raises(ReplayError, match="exceeds the trace's 16 experts"):
        replay_policy(run, SimConfig(cost=_cost(), cache_capacity_per_layer=17))
    with pytest.raises(ValueError, match="policy: expected one of"):
        SimConfig(cost=_cost(), policy="greedy")
    with pytest.raises(ValueError, match="unknown expert predictor"):
        replay_policy(run, SimConfig(cost=_cost(), predictor="psychic", cache_capacity_per_layer=4))
    with pytest.raises(ValueError, match="SimConfig.link_concurrency"):
        SimConfig(cost=_cost(), link_concurrency=0)
    with pytest.raises(ValueError, match="SimConfig.acceptance"):
        SimConfig(cost=_cost(), acceptance={"knots_x": [0.5, 0.2], "knots_y": [0, 1]})


def test_config_roundtrip_and_limits(run) -> None:
    config = SimConfig(
        cost=_cost(),
        policy="top-N",
        max_positions=5,
        max_requests=1,
        cache_capacity_per_layer=4,
        acceptance={"knots_x": [0.0, 1.0], "knots_y": [0.0, 0.5]},
    )
    assert config.policy == "topn"
    assert SimConfig.from_dict(config.to_dict()) == config
    result = replay_policy(run, config)
    assert result.totals.num_requests == 1
    assert sum(c.num_committed for c in result.cycles) == 5
    assert all(c.predicted_expected_committed <= 1 + 0.5 * 15 for c in result.cycles)
    assert not math.isnan(result.totals.tokens_per_s)


def test_draft_levels_follow_the_live_engine(run) -> None:
    depth = run.manifest.draft.tree_depth
    levels = {}
    for policy in ("ar", "topn", "chain", "specfit"):
        result = replay_policy(run, SimConfig(cost=_cost(), policy=policy, cache_capacity_per_layer=4))
        levels[policy] = [c.num_draft_levels for c in result.cycles]
        assert result.totals.num_draft_levels == sum(levels[policy])
        assert result.totals.draft_ns == sum(s_to_ns(_cost().draft_s(n)) for n in levels[policy])
    assert set(levels["ar"]) == {0}
    assert set(levels["topn"]) == {depth} and set(levels["chain"]) == {depth}  # full drafted tree
    assert all(0 <= n <= depth for n in levels["specfit"])  # asked on the root, then after each level
    assert any(n > 0 for n in levels["specfit"])


def test_specfit_drafts_nothing_when_no_level_can_pay(run) -> None:
    """The stopping rule is asked on the root alone first: with a 10 s draft level SpecFit is AR."""
    dear = _cost(draft_s_per_level=10.0)
    spec = replay_policy(run, SimConfig(cost=dear, policy="specfit", cache_capacity_per_layer=4))
    ar = replay_policy(run, SimConfig(cost=dear, policy="ar", cache_capacity_per_layer=4))
    assert all(c.num_draft_levels == 0 and c.num_nodes_verified == 1 for c in spec.cycles)
    assert spec.totals.tokens_per_s == pytest.approx(ar.totals.tokens_per_s)
    cheap = replay_policy(run, SimConfig(cost=_cost(), policy="specfit", cache_capacity_per_layer=4))
    assert any(c.num_draft_levels > 0 for c in cheap.cycles)


def test_planner_time_is_charged_to_drafting_policies_only(run) -> None:
    """As live: autoregressive decoding asks no planner, so --decision-us leaves ar unchanged."""
    base = {"cost": _cost(), "cache_capacity_per_layer": 4}
    for policy in ("ar", "topn"):
        free = replay_policy(run, SimConfig(policy=policy, **base))
        slow = replay_policy(run, SimConfig(policy=policy, decision_s=2e-3, **base))
        extra_s = slow.totals.decode_s - free.totals.decode_s
        if policy == "ar":
            assert extra_s == 0.0 and slow.cycles and all(c.decision_s == 0.0 for c in slow.cycles)
        else:
            assert extra_s == pytest.approx(2e-3 * slow.totals.num_cycles, rel=1e-6)


def test_compute_speed_times_cycles_slower_but_keeps_the_planner(run) -> None:
    """SimConfig.compute_speed: cycles timed with cost.with_compute_speed, the planner's decisions
    and predictions (priced with the unscaled cost) unchanged."""
    cost = _cost(host_s_per_transfer=4e-6)
    base = SimConfig(cost=cost, policy="specfit", predictor="oracle", cache_capacity_per_layer=6)
    slow = dataclasses.replace(base, compute_speed=1.5)
    assert SimConfig.from_dict(slow.to_dict()) == slow
    a, b = replay_policy(run, base), replay_policy(run, slow)
    assert [c.verified_nodes for c in a.cycles] == [c.verified_nodes for c in b.cycles]
    assert [c.predicted_cycle_s for c in a.cycles] == [c.predicted_cycle_s for c in b.cycles]
    timed = cost.with_compute_speed(1.5)
    for c in b.cycles:
        formula = timed.cycle_s(c.num_draft_levels, c.num_nodes_verified, c.context_len, c.layer_misses)
        assert c.cycle_s == pytest.approx(formula, abs=(sum(c.layer_misses) + 3) * 1e-9)
    assert b.totals.tokens_per_s < a.totals.tokens_per_s
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="compute_speed"):
            dataclasses.replace(base, compute_speed=bad)


@pytest.mark.parametrize(
    "options",
    [
        {"policy": "ar"},
        {"policy": "topn", "overlap": "on"},
        {"policy": "specfit"},
        {"policy": "specfit", "cache_policy": "belady", "prefetch": "draft"},
        {"policy": "cascade", "cache_policy": "lfu"},
        {"policy": "ar", "engine": "simpy"},  # not paused: SimPy's processes make cycles
    ],
)
def test_a_replay_makes_no_reference_cycles_and_restores_the_collector(run, options) -> None:
    """The replay pauses the cyclic collector (sim.replay._collector_paused): that is only sound
    while its cycles leave nothing for the collector, which this checks (gc.collect() after a
    replay run with the collector off finds no unreachable object), and the collector's state
    is restored after, off as on."""
    import gc

    config = SimConfig(cost=_cost(), cache_capacity_per_layer=4, **options)
    replay_policy(run, config)  # first-use caches (trees, tables) are made outside the check
    gc.collect()
    gc.disable()
    try:
        replay_policy(run, config)
        assert not gc.isenabled()  # left off when it was off
        found = gc.collect()
        assert found == 0 or options.get("engine") == "simpy"  # nothing a reference cycle kept alive
    finally:
        gc.enable()
    during = []  # the collector's state as each cycle ends (the progress callback)
    replay_policy(run, config, progress=lambda n: during.append(gc.isenabled()))
    assert gc.isenabled()
    assert during and set(during) == {options.get("engine") == "simpy"}


def test_a_planner_deadline_of_zero_cuts_searches_and_the_totals_count_them(run) -> None:
    """rev7 (issue 14 item 2): the simulator gave the planner no deadline and recorded neither the
    hits nor the gap. A deadline fraction of 0 cuts every search that needs more than the seed
    (per-node experts, overlap on: the plans need searching); without one nothing is counted."""
    base = {"cost": _cost(), "policy": "specfit", "predictor": "oracle", "overlap": "on", "cache_capacity_per_layer": 4}
    cut = replay_policy(run, SimConfig(planner_deadline_fraction=0.0, **base))
    assert 0 < cut.totals.planner_deadline_hits <= cut.totals.num_cycles
    summary = cut.totals.to_dict()
    assert summary["planner_deadline_hits"] == cut.totals.planner_deadline_hits
    assert summary["planner_mean_gap"] == pytest.approx(cut.totals.planner_gap_sum / cut.totals.planner_deadline_hits)
    assert summary["planner_mean_gap"] > 0
    free = replay_policy(run, SimConfig(**base))
    assert free.totals.planner_deadline_hits == 0 and free.totals.to_dict()["planner_mean_gap"] == 0.0
    # a deadline that cannot hit (1e9 cycle times) replays exactly as no deadline
    loose = replay_policy(run, SimConfig(planner_deadline_fraction=1e9, **base))
    assert loose.totals == free.totals and loose.cycles == free.cycles


def test_planner_deadline_fraction_is_checked(run) -> None:
    for bad in (-0.1, float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="SimConfig.planner_deadline_fraction"):
            SimConfig(cost=_cost(), planner_deadline_fraction=bad)
    with pytest.raises(ValueError, match="only SpecFit"):
        SimConfig(cost=_cost(), policy="topn", planner_deadline_fraction=0.1)
    with pytest.raises(ValueError, match="not both"):
        SimConfig(cost=_cost(), planner_deadline_fraction=0.1, policy_options=(("deadline_fraction", 0.2),))
    config = SimConfig(cost=_cost(), policy="specfit-oracle", planner_deadline_fraction=0.1)
    assert SimConfig.from_dict(config.to_dict()) == config
