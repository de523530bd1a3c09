"""Calibrated synthetic traces (issue 12, item 1): each figure within its stated tolerance."""

from __future__ import annotations

import json

import pytest

from traces.reader import open_run
from traces.synthcal import CALIBRATIONS, figure_rows, format_figure_table, trace_figures
from traces.synthetic import generate_dense_trace, resolve_config

# (shape, requests, positions): the Qwen3 trace is large enough for the LRU and tau figures
SIZES = {"qwen3-30b-a3b": (2, 96), "mixtral-8x7b": (2, 96), "olmoe-1b-7b": (2, 96), "deepseek-v2-lite": (2, 96)}


@pytest.mark.parametrize("shape", sorted(CALIBRATIONS))
def test_calibrated_trace_meets_every_target(tmp_path, shape):
    requests, positions = SIZES[shape]
    cfg = resolve_config(shape, num_requests=requests, positions_per_request=positions)
    generate_dense_trace(tmp_path / "t", shape, **{**cfg.__dict__})
    rows = figure_rows(CALIBRATIONS[shape], trace_figures(open_run(tmp_path / "t", validate=False)))
    targeted = [r for r in rows if r["target"] is not None]
    assert len(targeted) == len(CALIBRATIONS[shape].figures) >= 5
    bad = [r for r in targeted if not abs(r["generated"] - r["target"]) <= r["tolerance"]]
    assert not bad, format_figure_table(rows)


def test_every_figure_names_a_source_and_guesses_say_so():
    for cal in CALIBRATIONS.values():
        for f in cal.figures:
            assert f.source and f.tolerance > 0
            if "guess" in f.source.lower():
                assert f.guess, f


def test_uncalibrated_trace_misses_the_qwen3_targets(tmp_path):
    """The check can fail: generator defaults (no calibration) miss the public figures."""
    cfg = resolve_config("qwen3-30b-a3b", calibrated=False, num_requests=1, positions_per_request=48)
    generate_dense_trace(tmp_path / "t", "qwen3-30b-a3b", **cfg.__dict__)
    rows = figure_rows(CALIBRATIONS["qwen3-30b-a3b"], trace_figures(open_run(tmp_path / "t", validate=False)))
    assert any(not r["ok"] for r in rows)


def test_cli_prints_the_calibration_table(tmp_path, capsys):
    from traces.synthetic import main

    code = main(["--out", str(tmp_path / "q"), "--num-requests", "1", "--positions", "16", "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| figure | target | generated | source |" in out
    for name in ("lru_hit@24", "tau_tree", "draft_calibration", "chain_accept_1"):
        assert f"| {name} |" in out
    assert json.loads(out.strip().splitlines()[-1])["calibrated"] is True
