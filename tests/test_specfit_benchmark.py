"""Smoke test of benchmarks/planner.py: runs, writes its JSON, ends with the summary line."""

from __future__ import annotations

import gzip
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


def test_planner_benchmark_says_when_no_n_has_an_aim(tmp_path, capsys) -> None:
    """--nodes without an aim's N: the aims header is followed by a line per N saying it has none
    (it was a header with nothing under it)."""
    out = tmp_path / "planner.json"
    args = ["--nodes", "8", "--trees", "2", "--model-shape", "olmoe-1b-7b", "--source", "synthetic", "--no-hard"]
    assert _load().main([*args, "--out", str(out), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("aims ("))
    assert lines[header + 1] == "  N=8: no aim (issue 14 sets aims for N=64, 128)"
    assert json.loads(lines[-1])["aims"] == {}


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


def _bad_path_cases(tmp_path):
    afile = tmp_path / "afile.txt"
    afile.write_text("not gzip\n")
    malformed = tmp_path / "malformed.jsonl.gz"
    malformed.write_bytes(gzip.compress(b'{"x": 1}\n'))
    not_json = tmp_path / "not_json.jsonl.gz"
    not_json.write_bytes(gzip.compress(b"parent,path_prob\n"))
    return {
        "golden-not-gzip": (["--golden", str(afile)], "--golden", "gzipped JSON lines"),
        "golden-malformed": (["--golden", str(malformed)], "--golden", "'parent'"),
        "golden-not-json": (["--golden", str(not_json)], "--golden", "gzipped JSON lines"),
        "trace-root-a-file": (["--trace-root", str(afile)], "--trace-root", "is a file, not a folder"),
        "out-a-folder": (["--out", str(tmp_path)], "--out", "is a folder"),
        "out-under-a-file": (["--out", str(afile / "p.json")], "--out", "is a file, not a folder"),
    }


@pytest.mark.parametrize(
    "case",
    ["golden-not-gzip", "golden-malformed", "golden-not-json", "trace-root-a-file", "out-a-folder", "out-under-a-file"],
)
def test_planner_benchmark_bad_paths_exit_2_before_any_work(case, tmp_path, capsys, monkeypatch) -> None:
    """A bad --golden, --trace-root or --out exits 2 with one line naming the flag and what was
    expected, before any tree is timed (an unwritable --out used to fail after the whole run)."""
    bench = _load()

    def no_work(*args, **kwargs):
        raise AssertionError("trees were timed before the paths were checked")

    monkeypatch.setattr(bench, "_time", no_work)
    extra, flag, expected = _bad_path_cases(tmp_path)[case]
    args = ["--nodes", "8", "--trees", "2", "--no-hard", "--no-progress"]
    argv = [*args, "--trace-root", str(tmp_path / "traces"), "--out", str(tmp_path / "p.json"), *extra]
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and f"error: {flag}:" in err and expected in err
