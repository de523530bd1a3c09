"""benchmarks/wait_step.py: the per-run figures on hand-made cycles, and one small live run end to
end (its timings are not asserted, only what the emulated link guarantees)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from bench_loader import load_benchmark


def _cycles() -> pd.DataFrame:
    # 3 layers; the first layer is left out of the steps (it also embeds)
    return pd.DataFrame(
        {
            "layer_misses": [[2, 0, 1], [0, 3, 0], [1, 0, 0]],
            "layer_compute_s": [[9e-3, 2.0e-3, 2.5e-3], [9e-3, 2.9e-3, 2.2e-3], [9e-3, 2.0e-3, 1.8e-3]],
            "layer_pre_router_s": [[1e-3, 1.0e-3, 1.0e-3], [1e-3, 1.0e-3, 1.0e-3], [1e-3, 1.0e-3, 1.0e-3]],
            "layer_stall_s": [[0.4e-3, 0.0, 0.2e-3], [0.0, 0.6e-3, 0.0], [0.2e-3, 0.0, 0.0]],
        }
    )


def test_run_steps_hand_computed() -> None:
    bench = load_benchmark("wait_step")
    out = bench.run_steps(_cycles())
    # arithmetic on the hand-made seconds of _cycles() (nothing is timed here):
    # layers 1..2 without misses: experts 1.0, 1.2, 1.0, 0.8 ms -> mean 1.0; one miss: 1.5; three: 1.9
    assert out["step_1_ms"] == pytest.approx(0.5)
    assert out["step_3_ms"] == pytest.approx(0.9)
    assert out["wait_per_miss_ms"] == pytest.approx(1.4 / 7)  # all layers' stall over all misses
    assert out["speed_ms"] == pytest.approx(1.0)
    assert (out["num_layers_0"], out["num_layers_1"], out["num_layers_3"]) == (4, 1, 1)
    no_miss = _cycles().assign(layer_misses=[[0, 0, 0]] * 3)
    assert np.isnan(bench.run_steps(no_miss)["step_1_ms"])
    with pytest.raises(ValueError, match="layer_pre_router_s"):
        bench.run_steps(_cycles().drop(columns=["layer_pre_router_s"]))
    table = bench.summarize({1.0: [out, dict(out, step_1_ms=0.7)], 0.25: [out]})
    assert table["1"]["step_1_ms"] == pytest.approx(0.6) and table["1"]["runs"] == 2
    assert set(table) == {"1", "0.25"}


def test_wait_step_bad_flags_exit_2() -> None:
    bench = load_benchmark("wait_step")
    for argv in (["--bandwidths", "0"], ["--repeats", "0"], ["--latency-us", "-1"]):
        with pytest.raises(SystemExit) as err:
            bench.main(argv)
        assert err.value.code == 2


@pytest.mark.slow
def test_wait_step_records_interleaved_runs_and_reuses_them(tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    bench = load_benchmark("wait_step")
    out = tmp_path / "ws"
    argv = ["--bandwidths", "1000,0.1", "--repeats", "1", "--num-prompts", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["benchmark"] == "wait_step" and set(summary["bandwidths_gb_per_s"]) == {"1000", "0.1"}
    slow = summary["bandwidths_gb_per_s"]["0.1"]
    # the emulated link waits at least bytes / bandwidth per expert: 98,304 B at 0.1 GB/s = 0.98 ms
    assert slow["wait_per_miss_ms"] >= 0.98 and slow["runs"] == 1
    stamps = sorted(p.stat().st_mtime_ns for p in out.glob("*/r1/manifest.json"))
    assert len(stamps) == 2
    assert bench.main(argv) == 0  # complete runs are reused, not re-recorded
    assert sorted(p.stat().st_mtime_ns for p in out.glob("*/r1/manifest.json")) == stamps
