"""The guard's price of a realised cycle with draft prefetch (issue 13): the cycle's prefetch copies
go on the link before the forward and its demand misses queue behind them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

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

    def observe(self, cost, num_committed, num_levels, num_nodes, context_len, misses, root=None, issued=None):
        price = cost.realised_cycle_s(num_levels, num_nodes, context_len, misses, issued)
        priced.append((price, int(np.sum(issued))))
        return original(self, cost, num_committed, num_levels, num_nodes, context_len, misses, root, issued)

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
