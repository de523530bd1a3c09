"""benchmarks/overlap.py runs end to end (its timings are not asserted: they are the benchmark's)."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_benchmark


def test_overlap_benchmark_runs_and_reports_each_bandwidth(capsys):
    pytest.importorskip("torch")
    bench = load_benchmark("overlap")
    assert bench.main(["--bandwidth", "0.5,4", "--forwards", "2", "--repeats", "1", "--threads", "1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["benchmark"] == "overlap" and summary["torch_threads"] == 1
    assert [row["bandwidth_gb_per_s"] for row in summary["rows"]] == [0.5, 4.0]
    for row in summary["rows"]:
        assert {"off_ms", "on_ms", "on_placing_share_of_stall"} <= set(row)  # figures, not asserted
    assert isinstance(summary["ok"], bool)


def test_overlap_benchmark_bad_flags_exit_2():
    with pytest.raises(SystemExit) as err:
        load_benchmark("overlap").main(["--bandwidth", "-1"])
    assert err.value.code == 2
