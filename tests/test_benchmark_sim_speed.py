"""benchmarks/sim_speed.py's reported drafting row: its setting drafts, its summary counts right."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

from tests.bench_loader import load_benchmark


def test_drafting_summary_counts_cycles() -> None:
    bench = load_benchmark("sim_speed")
    cycles = [
        SimpleNamespace(num_draft_levels=0, num_nodes_verified=1),
        SimpleNamespace(num_draft_levels=2, num_nodes_verified=1),  # drafted, verified the root alone
        SimpleNamespace(num_draft_levels=3, num_nodes_verified=10),
        SimpleNamespace(num_draft_levels=1, num_nodes_verified=4),
    ]
    assert bench.drafting_summary(cycles) == {
        "drafted_fraction": 0.75,
        "verified_beyond_root_fraction": 0.5,
        "mean_nodes_verified": 4.0,
        "mean_draft_levels": 1.5,
    }
    assert all(math.isnan(v) for v in bench.drafting_summary([]).values())


def test_drafting_row_drafts_where_the_aims_row_does_not(tmp_path) -> None:
    """On a small Qwen3-shape trace the drafting row's setting drafts in most cycles and verifies
    trees; the aim's setting (cache E/4, default preset) verifies the root alone."""
    from sim.config import SimConfig
    from sim.presets import DEFAULT_COST, cost_from_preset
    from sim.replay import replay_policy
    from sim.traceselect import SyntheticSpec, synthetic_trace
    from traces.reader import open_run

    bench = load_benchmark("sim_speed")
    run = open_run(synthetic_trace(SyntheticSpec(num_requests=1, positions_per_request=40), tmp_path))
    model = run.manifest.model
    config = bench.drafting_config(model.num_layers, model.num_experts, 40, bench.EXPERT_BYTES)
    drafting = bench.drafting_summary(
        replay_policy(run, dataclasses.replace(config, record_cycles=True)).cycles
    )
    assert drafting["drafted_fraction"] > 0.5 and drafting["mean_nodes_verified"] > 1.2
    aim_cost = cost_from_preset(DEFAULT_COST, expert_bytes=bench.EXPERT_BYTES, num_layers=model.num_layers)
    aim = SimConfig(cost=aim_cost, cache_capacity_per_layer=model.num_experts // 4, max_positions=40)
    assert bench.drafting_summary(replay_policy(run, aim).cycles)["mean_nodes_verified"] < 1.05


def test_bad_cache_exits_2_before_any_work(tmp_path, monkeypatch, capsys) -> None:
    """``--cache`` is checked before the trace is generated or anything timed: exit 2, one line
    naming the flag, nothing written (it was checked after ~30 s of benchmarking, with a
    traceback, exit 1 and a generated trace under runs/)."""
    import pytest

    bench = load_benchmark("sim_speed")
    monkeypatch.chdir(tmp_path)
    for bad in ("2.0", "-0.5", "500", "abc"):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--cache", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--cache" in err[0] and bad in err[0], err
    assert list(tmp_path.iterdir()) == []
