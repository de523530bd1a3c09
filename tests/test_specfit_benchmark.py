"""Smoke test of benchmarks/planner.py: runs, writes its JSON, ends with the summary line."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_benchmark


def _load():
    return load_benchmark("planner")


def test_planner_benchmark_smoke(tmp_path, capsys) -> None:
    bench = _load()
    out = tmp_path / "planner.json"
    rc = bench.main(
        [
            "--nodes",
            "8,12",
            "--trees",
            "4",
            "--model-shape",
            "olmoe-1b-7b",
            "--out",
            str(out),
            "--trace-root",
            str(tmp_path / "traces"),
            "--no-progress",
            "--no-hard",
            "--deadline-ms",
            "0",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary) >= {"n8", "n12", "n8_deadline", "n12_deadline", "aims"}
    assert summary["n12_deadline"]["nodes_explored_max"] == 0  # a 0 ms deadline: the seed only
    assert summary["n12_deadline"]["deadline_hits"] <= 4 and summary["n12"]["deadline_hits"] == 0
    assert summary["n8"]["trees"] == 4 and summary["n12"]["nodes_explored_max"] >= 1
    assert summary["n12"]["p50_ms"] > 0
    # trees come from the generated traces, capped at N nodes
    assert 1 <= summary["n8"]["mean_tree_nodes"] <= 8 and 1 <= summary["n12"]["mean_tree_nodes"] <= 12
    assert len(list((tmp_path / "traces").iterdir())) == 2
    assert json.loads(out.read_text())["n8"] == summary["n8"]


def test_planner_benchmark_synthetic_source(tmp_path, capsys) -> None:
    out = tmp_path / "planner.json"
    args = ["--nodes", "8", "--trees", "3", "--model-shape", "olmoe-1b-7b", "--source", "synthetic", "--no-hard"]
    assert _load().main([*args, "--out", str(out), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["n8"]["trees"] == 3 and summary["n8"]["mean_tree_nodes"] == 8


def test_planner_benchmark_bad_flag_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _load().main(["--trees", "-1"])
    assert exc.value.code == 2
    assert "--trees" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_planner_benchmark_bad_deadline_exits_2(value, capsys) -> None:
    """A negative or non-finite --deadline-ms is bad input (exit 2, one line naming the flag), not a
    traceback from plan_exact after the first pass."""
    with pytest.raises(SystemExit) as exc:
        _load().main(["--deadline-ms", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--deadline-ms" in err and "Traceback" not in err
