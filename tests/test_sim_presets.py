"""sim.presets (hardware cost presets), sim.cells (cache sizes, cell ids) and sim.report."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sim.cells import CellSpec, make_cells, parse_cache_sizes
from sim.presets import (
    DEFAULT_COST,
    QWEN3_30B_A3B_2GPU_POINTS,
    compute_presets,
    cost_from_preset,
    derive_compute_costs,
    link_presets,
    preset_names,
    resolve_cost,
)
from sim.report import format_table, results_frame
from specfit.cost import CycleCostModel

QWEN_EXPERT_BYTES = 9_437_184


def test_compute_preset_reproduces_the_public_cycle_times() -> None:
    cost = cost_from_preset(DEFAULT_COST, expert_bytes=QWEN_EXPERT_BYTES, num_layers=48)
    for point in QWEN3_30B_A3B_2GPU_POINTS:
        predicted = cost.draft_s(point.num_levels) + cost.verify_s(point.num_nodes, 0)
        assert predicted == pytest.approx(point.cycle_s, rel=1e-9)
    # plain decoding at 222.5 tok/s -> 4.494 ms per step; the 60-node cycle is ~4.0x that
    assert cost.verify_s(1, 0) == pytest.approx(1 / 222.5, rel=1e-9)
    assert cost.cycle_s(7, 60, 0, np.zeros(48)) / cost.verify_s(1, 0) == pytest.approx(4.01, abs=0.01)
    assert "222.5" in cost.source and "reference-figures.md" in cost.source


def test_link_presets_and_names() -> None:
    links = link_presets()
    assert links["pcie4-x16"].h2d_bytes_per_s == 24e9
    assert links["pcie5-x16"].h2d_bytes_per_s == 55e9
    assert links["nvlink-c2c"].h2d_bytes_per_s == pytest.approx(97 * 2**30)
    cost = cost_from_preset("qwen3-30b-a3b-2gpu+pcie4-x16", expert_bytes=QWEN_EXPERT_BYTES, num_layers=48)
    # one 9,437,184-byte expert at 24 GB/s + 10 us assumed latency
    assert cost.transfer_s(1) == pytest.approx(QWEN_EXPERT_BYTES / 24e9 + 10e-6)
    assert DEFAULT_COST in preset_names() and set(compute_presets()) <= set(preset_names())
    with pytest.raises(ValueError, match="unknown link preset 'pcie9'"):
        cost_from_preset("qwen3-30b-a3b-2gpu+pcie9", expert_bytes=1, num_layers=1)
    with pytest.raises(ValueError, match="unknown compute preset"):
        resolve_cost("tpu", num_layers=1, expert_bytes=None, default_expert_bytes=1)


def test_derive_compute_costs_rejects_degenerate_points() -> None:
    with pytest.raises(ValueError, match="need >= 3"):
        derive_compute_costs(QWEN3_30B_A3B_2GPU_POINTS[:2])
    same = (QWEN3_30B_A3B_2GPU_POINTS[0],) * 3
    with pytest.raises(ValueError, match="do not determine"):
        derive_compute_costs(same)


def test_resolve_cost_reads_a_calibrated_file(tmp_path) -> None:
    calibrated = CycleCostModel(
        draft_s_per_level=1e-3,
        verify_base_s=5e-3,
        verify_s_per_node=1e-5,
        verify_s_per_context_token=0.0,
        h2d_bytes_per_s=20e9,
        h2d_s_per_transfer=5e-6,
        expert_bytes=1000,
        num_layers=4,
        source="fit on run X",
    )
    path = calibrated.save(tmp_path / "cost.json")
    cost = resolve_cost(str(path), num_layers=4, expert_bytes=None, default_expert_bytes=7, overlap_h2d=True)
    assert cost.expert_bytes == 1000 and cost.overlap_h2d and "fit on run X" in cost.source
    assert resolve_cost(str(path), num_layers=4, expert_bytes=64, default_expert_bytes=7).expert_bytes == 64
    with pytest.raises(ValueError, match="num_layers is 4 but the trace has 48"):
        resolve_cost(str(path), num_layers=48, expert_bytes=None, default_expert_bytes=7)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**calibrated.to_dict(), "units": {"h2d_bytes_per_s": "GB/s"}}))
    with pytest.raises(ValueError, match="bad.json.*h2d_bytes_per_s"):
        resolve_cost(str(bad), num_layers=4, expert_bytes=None, default_expert_bytes=7)


def test_parse_cache_sizes() -> None:
    assert parse_cache_sizes(["0.125", "25%", "32", "0"], 128) == [
        (16, 0.125),
        (32, 0.25),
        (32, 0.25),
        (0, 0.0),
    ]
    with pytest.raises(ValueError, match="--cache: a fraction must be in"):
        parse_cache_sizes(["1.5"], 128)
    with pytest.raises(ValueError, match=r"gives 200 experts per layer; expected a count 0\.\.128 .*or a fraction in \(0, 1\]"):
        parse_cache_sizes(["200"], 128)
    with pytest.raises(ValueError, match=r"gives -4 experts per layer; expected a count 0\.\.128"):
        parse_cache_sizes(["-4"], 128)
    with pytest.raises(ValueError, match="expected a count or a fraction, got 'lots'"):
        parse_cache_sizes(["lots"], 128)


def test_cells_are_a_deterministic_product_with_stable_ids() -> None:
    cost = cost_from_preset(DEFAULT_COST, expert_bytes=QWEN_EXPERT_BYTES, num_layers=48)
    kw = dict(trace_path="/t", cost=cost, bandwidths_gb_per_s=[16, 32], caches=[(16, 0.125), (32, 0.25)])
    cells = make_cells(policies=["autoregressive", "top-N", "specfit"], **kw)
    assert len(cells) == 12
    assert [c.policy for c in cells[:3]] == ["ar", "topn", "specfit"]
    again = make_cells(policies=["ar", "topn", "specfit"], **kw)
    assert [c.cell_id for c in cells] == [c.cell_id for c in again]
    assert len({c.cell_id for c in cells}) == 12
    roundtrip = CellSpec(**json.loads(json.dumps(cells[5].to_dict())))
    assert roundtrip.cell_id == cells[5].cell_id
    config = cells[5].sim_config()
    assert config.cost.h2d_bytes_per_s == cells[5].bandwidth_gb_per_s * 1e9


def _row(policy: str, tps: float, bw: float = 16.0) -> dict:
    return {
        "bandwidth_gb_per_s": bw,
        "cache_experts_per_layer": 16,
        "cache_fraction": 0.125,
        "cache_policy": "lru",
        "predictor": "recent",
        "overlap": False,
        "prefetch": False,
        "policy": policy,
        "tokens_per_s": tps,
        "tau": 2.0,
        "mean_nodes_verified": 3.0,
        "hit_rate": 0.5,
        "h2d_gb": 1.0,
    }


def test_results_frame_speedups_and_specfit_check() -> None:
    rows = [_row("specfit", 90.0), _row("topn", 100.0), _row("ar", 50.0)]
    rows += [_row("ar", 40.0, 32.0), _row("specfit", 80.0, 32.0), _row("topn", 60.0, 32.0)]
    df = results_frame(rows)
    assert list(df["policy"]) == ["ar", "topn", "specfit"] * 2
    assert list(df["bandwidth_gb_per_s"]) == [16.0] * 3 + [32.0] * 3
    assert df.loc[2, "speedup_vs_ar"] == pytest.approx(1.8)
    assert df.loc[2, "speedup_vs_topn"] == pytest.approx(0.9)
    assert list(df["specfit_below_baseline"]) == [False, False, True, False, False, False]
    table = format_table(df, header=["trace: t"])
    lines = table.splitlines()
    assert lines[0] == "trace: t"
    assert lines[5].endswith("!") and not lines[8].endswith("!")
    assert lines[9].startswith("SpecFit check FAILS: 1 of 2 SpecFit cells below the best baseline")
    assert "lowest 0.900 of topn at 16 GB/s" in lines[9]
    assert df.loc[2, "best_baseline_policy"] == "topn" and pd.isna(df.loc[1, "best_baseline_policy"])
    assert "SpecFit below max(autoregressive, chain, top-N, cascade)" in lines[-1]


def test_results_frame_without_baselines_has_nan_speedups() -> None:
    df = results_frame([_row("specfit", 10.0)])
    assert pd.isna(df.loc[0, "speedup_vs_ar"]) and not df.loc[0, "specfit_below_baseline"]


def test_preset_pre_router_fraction_comes_from_the_model_shape() -> None:
    """Issue 13: the preset's pre-router share is the Qwen3-30B-A3B decode step's weight bytes
    before the router (attention q/k/v/o + router) over those plus the top-8 experts'."""
    from sim.presets import QWEN3_30B_A3B_ATTENTION, pre_router_fraction_of
    from specfit.shapes import get_model_shape

    shape = get_model_shape("qwen3-30b-a3b")
    hidden, heads, kv_heads, head_dim = 2048, 32, 4, 128  # config.json
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    router = hidden * 128
    experts = 8 * QWEN_EXPERT_BYTES // 2  # top-8 experts of 3 x 2048 x 768 bf16 weights
    assert attention == 18_874_368 and experts == 37_748_736
    expected = (attention + router) / (attention + router + experts)
    assert pre_router_fraction_of(shape, QWEN3_30B_A3B_ATTENTION) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.3364, abs=1e-4)
    cost = cost_from_preset(DEFAULT_COST, expert_bytes=QWEN_EXPERT_BYTES, num_layers=48, overlap_h2d=True)
    assert cost.pre_router_fraction == pytest.approx(expected, rel=1e-12)
    assert compute_presets()["qwen3-30b-a3b-2gpu"].pre_router_fraction == cost.pre_router_fraction
    assert "pre_router_fraction 0.336" in cost.source
    # a wider attention or fewer active experts moves more of the layer before the router
    wider = type(QWEN3_30B_A3B_ATTENTION)(num_heads=32, num_kv_heads=32, head_dim=128)
    assert pre_router_fraction_of(shape, wider) > expected
