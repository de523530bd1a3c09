"""Decision regret (issue 12, item 2): SpecFit with oracle inputs and the per-cell decomposition."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_shapes import tiny_shape

from sim.cells import make_cells, parse_cache_sizes, run_cell
from sim.config import ORACLE_VARIANTS, SimConfig
from sim.presets import cost_from_preset
from sim.replay import replay_policy
from sim.report import REGRET_COLUMNS, results_frame
from traces.reader import open_run
from traces.synthetic import generate_dense_trace

SHAPE = tiny_shape(12_288, "tiny")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = generate_dense_trace(
        tmp_path_factory.mktemp("regret") / "tiny",
        SHAPE,
        num_requests=2,
        positions_per_request=16,
        prompt_len=8,
        tree_depth=3,
        tree_topk=3,
        max_nodes=12,
        seed=7,
    )
    return str(path)


def _cost():
    return cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=9_437_184, num_layers=SHAPE.num_layers)


def _cycles(trace: str, policy: str):
    config = SimConfig(cost=_cost().with_bandwidth(16e9), policy=policy, cache_capacity_per_layer=4)
    return replay_policy(open_run(trace), config).cycles


def test_oracle_acceptance_predicts_the_realised_acceptance_exactly(trace: str) -> None:
    cycles = _cycles(trace, "specfit-oracle-accept")
    assert cycles
    for c in cycles:  # P = recorded path-accepted flags: E[committed] is what the cycle commits
        assert c.predicted_expected_committed == pytest.approx(c.num_accepted + 1)
    drafted = _cycles(trace, "specfit")
    assert any(c.predicted_expected_committed != pytest.approx(c.num_accepted + 1) for c in drafted)


def test_oracle_experts_predict_the_realised_transfers(trace: str) -> None:
    """With the true experts (no overlap, no planner time) the predicted cycle time is the simulated one."""
    for c in _cycles(trace, "specfit-oracle-experts"):
        assert c.predicted_cycle_s == pytest.approx(c.cycle_s, rel=1e-6, abs=1e-8)


def test_regret_decomposition_per_cell(trace: str) -> None:
    cells = make_cells(
        trace_path=trace,
        cost=_cost(),
        bandwidths_gb_per_s=[4, 64],
        caches=parse_cache_sizes(["0.25"], SHAPE.num_experts),
        policies=["ar", "chain", "topn", "cascade", "specfit", *ORACLE_VARIANTS],
        policy_options={"specfit": {"stopping": "expected"}},
    )
    assert {c.policy_options["stopping"] for c in cells if "specfit" in c.policy} == {"expected"}
    df = results_frame([run_cell(c) for c in cells])
    spec = df[df["policy"] == "specfit"]
    assert len(spec) == 2 and spec[list(REGRET_COLUMNS)].notna().all().all()
    lossless = df.groupby("bandwidth_gb_per_s")["tokens_per_s"].max()
    for _, row in spec.iterrows():
        best = lossless[row["bandwidth_gb_per_s"]]
        assert row["best_in_hindsight_tokens_per_s"] == pytest.approx(best)
        assert row["regret_total"] == pytest.approx((best - row["tokens_per_s"]) / best)
        parts = row[["regret_acceptance", "regret_experts", "regret_myopic", "regret_interaction"]]
        assert float(np.sum(parts)) == pytest.approx(row["regret_total"])
        assert row["regret_total"] >= 0 and row["regret_myopic"] >= 0
    assert df[df["policy"] != "specfit"][list(REGRET_COLUMNS)].isna().all().all()
