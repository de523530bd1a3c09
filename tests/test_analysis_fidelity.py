"""analysis.fidelity on hand-made live and simulated cycles (no live engine needed)."""

import numpy as np
import pandas as pd
import pytest

from analysis import fidelity
from calibration.synthetic import synthetic_tables
from specfit.cost import CycleCostModel

COST = CycleCostModel(
    draft_s_per_level=2e-3,
    verify_base_s=8e-3,
    verify_s_per_node=0.3e-3,
    verify_s_per_context_token=2e-6,
    h2d_bytes_per_s=5e9,
    h2d_s_per_transfer=40e-6,
    expert_bytes=2_000_000,
    num_layers=4,
)
KEY = {"bandwidth_gb_per_s": 5.0, "cache_experts_per_layer": 4, "policy": "specfit"}


@pytest.fixture()
def live() -> tuple[pd.DataFrame, pd.DataFrame]:
    return synthetic_tables(COST, num_cycles=50, noise_rel=0.0, seed=0)


def test_same_subtree_matches_on_request_and_position() -> None:
    live = pd.DataFrame(
        {"request_id": [0, 0, 1], "position": [0, 2, 0], "verified_nodes": [[0, 1], [0], [0, 2, 1]]}
    )
    sim = pd.DataFrame(
        {"request_id": [0, 0, 1], "position": [0, 3, 0], "verified_nodes": [[0, 1], [0], [0, 1]]}
    )
    # positions (0,0) and (1,0) are compared; (0,2)/(0,3) were not both reached
    assert fidelity.same_subtree(live, sim) == (2, 1)


def test_exact_cell_passes_every_target(live) -> None:
    cycles, transfers = live
    totals = fidelity.live_totals(cycles)
    sim_totals = {
        "tokens_per_s": totals["tokens_per_s"],
        "hit_rate": totals["hit_rate"],
        "tau": totals["tau"],
    }
    row = fidelity.compare_cell(KEY, cycles, transfers, sim_totals, cycles, COST)
    assert row["ok"] and row["off_terms"] == ""
    assert row["throughput_error_pct"] == pytest.approx(0.0)
    assert row["same_subtree_fraction"] == 1.0 and row["num_decisions_compared"] == 50
    assert row["cycle_error_median_pct"] == pytest.approx(0.0, abs=1e-9)
    assert row["policy"] == "specfit"


def test_missed_targets_name_the_off_term(live) -> None:
    cycles, transfers = live
    slow = cycles.copy()
    slow["draft_s"] *= 1.5  # the draft term is off by 50 %
    slow["cycle_s"] = slow["draft_s"] + slow["verify_s"] + slow["h2d_s"]
    totals = fidelity.live_totals(slow)
    sim = {"tokens_per_s": totals["tokens_per_s"] * 1.05, "hit_rate": totals["hit_rate"] - 0.01, "tau": 1.0}
    other = slow.copy()
    other["verified_nodes"] = [[0]] * len(other)
    row = fidelity.compare_cell(KEY, slow, transfers, sim, other, COST)
    assert not row["ok"]
    assert row["off_terms"].split(";") == ["draft", "cache", "decisions"]
    assert row["throughput_error_pct"] == pytest.approx(5.0)
    assert row["hit_rate_diff_points"] == pytest.approx(-1.0)


def test_overall_pools_cycles() -> None:
    rows = [
        {"ok": True, "throughput_error_pct": 1.0, "hit_rate_diff_points": 0.1, "same_subtree_fraction": 1.0},
        {
            "ok": False,
            "throughput_error_pct": -3.0,
            "hit_rate_diff_points": 0.2,
            "same_subtree_fraction": np.nan,
        },
    ]
    out = fidelity.overall(rows, [np.array([1.0, -2.0]), np.array([3.0])])
    assert out["cycle_error_median_pct"] == pytest.approx(2.0)
    assert out["num_cells_ok"] == 1 and out["max_abs_throughput_error_pct"] == 3.0
    assert out["min_same_subtree_fraction"] == 1.0
