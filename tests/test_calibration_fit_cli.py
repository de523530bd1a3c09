"""`python -m calibration.fit` end to end on runs written through traces.writer."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from tiny_shapes import TINY_COST, TINY_MOE

from calibration import fit as fit_cli
from calibration.predictor_tables import PredictorTables
from calibration.synthetic import write_synthetic_cycles_run
from specfit.acceptance import AcceptanceCalibration
from specfit.cost import CycleCostModel
from specfit.shapes import ModelShape
from traces.synthetic import generate_dense_trace

SHAPE, TRUTH = TINY_MOE, TINY_COST


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("calib-runs")
    policy = write_synthetic_cycles_run(root / "policy", SHAPE, TRUTH, num_cycles=240, noise_rel=0.01, seed=5)
    dense = generate_dense_trace(
        root / "dense",
        SHAPE,
        num_requests=2,
        positions_per_request=40,
        prompt_len=8,
        tree_depth=4,
        tree_topk=3,
        max_nodes=16,
        vocab_size=50,
        seed=1,
    )
    return policy, dense


def _exit_code(main, argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether returned or raised as ``SystemExit`` (exit 2)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_fit_cli_writes_cost_acceptance_and_tables(runs, tmp_path, capsys) -> None:
    policy, dense = runs
    out = tmp_path / "calib" / "cost.json"
    rc = fit_cli.main(
        [str(policy), str(dense), "--out", str(out), "--h2d-latency-us", "40", "--model", "tiny-moe"]
    )
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    assert rc == 0, summary
    assert summary["ok"] is True
    model = CycleCostModel.load(out)
    # the fitted parameters and per-term errors are printed as tables before the JSON line
    row = next(line.split() for line in printed.splitlines() if line.strip().startswith("verify_s_per_node"))
    assert float(row[1]) == pytest.approx(model.verify_s_per_node, rel=1e-3) and row[2] == "s/node"
    assert any(line.split()[:1] == ["h2d_transfer"] for line in printed.splitlines())
    for name in ("draft_s_per_level", "verify_s_per_node", "h2d_bytes_per_s"):
        assert abs(getattr(model, name) / getattr(TRUTH, name) - 1) < 0.02, name
    assert model.h2d_s_per_transfer == pytest.approx(40e-6)
    assert summary["cycle_heldout_median_pct"] < 2.0
    report = json.loads((out.parent / fit_cli.REPORT_NAME).read_text())
    assert report["num_cycles_heldout"] == 60
    assert set(report["errors"]) == {"draft", "verify", "h2d_cycle", "h2d_transfer", "cycle"}
    assert report["errors"]["cycle"]["heldout"]["p90_abs_pct_error"] < 5.0
    cal = AcceptanceCalibration.from_dict(json.loads((out.parent / fit_cli.ACCEPTANCE_NAME).read_text()))
    assert np.all(np.diff(cal.knots_y) >= 0) and cal.knots_x.size >= 2
    assert (out.parent / fit_cli.RELIABILITY_NAME).read_text().startswith("bin_lo,")
    tables = PredictorTables.load(out.parent / fit_cli.PREDICTORS_NAME)
    assert tables.num_trees == 80
    assert tables.union_size.shape == (4, 17)
    assert np.all(np.diff(tables.union_size, axis=1) >= 0)
    assert tables.union_size[:, 1] == pytest.approx(np.full(4, 2.0))  # one node routes to top-2
    np.testing.assert_allclose(tables.layer_frequency.sum(axis=1), 2.0)
    assert tables.token_bits.shape == (tables.token_ids.size, 4, 1) and tables.token_ids.size > 0
    from specfit.predictors import make_predictor

    assert make_predictor("token-table", **tables.predictor_kwargs("token-table")).name == "token-table"
    make_predictor("union-size", **tables.predictor_kwargs("union-size"))
    rows = (out.parent / fit_cli.CYCLES_NAME).read_text().splitlines()
    assert len(rows) == 241 and "predicted_cycle_s" in rows[0]


def test_fit_cli_rejects_other_model(runs, tmp_path, capsys) -> None:
    policy, _ = runs
    rc = _exit_code(fit_cli.main, [str(policy), "--out", str(tmp_path / "c.json"), "--model", "qwen3-30b-a3b"])
    err = capsys.readouterr().err
    assert rc == 2
    assert str(policy) in err and "model.name" in err and "qwen3-30b-a3b" in err


def test_fit_cli_too_few_cycles_and_missing_dir(runs, tmp_path, capsys) -> None:
    """Readable but insufficient data is bad input too: exit 2, the message once (stderr), a JSON
    line last. A run folder that does not exist: exit 2 naming RUN_DIR, before any work."""
    policy, _ = runs
    rc = _exit_code(fit_cli.main, [str(policy), "--out", str(tmp_path / "c.json"), "--min-cycles", "1000"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.count("--min-cycles") == 1  # said once on stderr
    assert "error: RUN_DIR: " in captured.err and captured.err.count("error:") == 1
    summary = json.loads(captured.out.strip().splitlines()[-1])  # and once for scripts, in the JSON
    assert summary["ok"] is False and summary["exit_code"] == 2
    assert "--min-cycles" in summary["error"] and captured.out.count("--min-cycles") == 1
    with pytest.raises(SystemExit) as exc:
        fit_cli.main([str(policy), str(tmp_path / "nope"), "--out", str(tmp_path / "c.json")])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and json.loads(captured.out)["exit_code"] == 2
    assert f"error: RUN_DIR: {tmp_path / 'nope'}: not a directory" in captured.err
    assert captured.err.count("not a directory") == 1


@pytest.mark.parametrize("damage", ["manifest", "no-manifest", "part"])
def test_fit_cli_unreadable_trace_exits_2_naming_run_dir(runs, tmp_path, capsys, damage) -> None:
    """A run folder that is not a readable trace exits 2 naming RUN_DIR (as sim.sweep names --trace),
    with the trace error printed once and nothing fitted."""
    import shutil

    _, dense = runs
    broken = tmp_path / "broken"
    shutil.copytree(dense, broken)
    if damage == "manifest":
        (broken / "manifest.json").write_text("{")
        needle = "not valid JSON"
    elif damage == "no-manifest":
        (broken / "manifest.json").unlink()
        needle = "manifest.json"
    else:
        part = sorted((broken / "nodes").glob("part-*.parquet"))[0]
        part.write_bytes(b"not parquet")
        needle = part.name
    out = tmp_path / "cal" / "c.json"
    with pytest.raises(SystemExit) as exc:
        fit_cli.main([str(broken), "--out", str(out)])
    captured = capsys.readouterr()
    assert exc.value.code == 2, captured.err
    assert "error: RUN_DIR: " in captured.err and str(broken) in captured.err and needle in captured.err
    assert captured.err.count("error:") == 1 and json.loads(captured.out)["ok"] is False
    assert not out.exists() and not (out.parent / "acceptance.json").exists()


def test_fit_cli_dense_only_run_fits_acceptance_without_a_cost_model(runs, tmp_path, capsys) -> None:
    """A dense trace with no timed cycles (traces.synthetic) still yields the acceptance map and tables."""
    _, dense = runs
    rc = fit_cli.main([str(dense), "--out", str(tmp_path / "c.json")])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and summary["cost"] is None and "cost model not fitted" in summary["note"]
    assert not (tmp_path / "c.json").exists()
    cal = AcceptanceCalibration.from_dict(json.loads((tmp_path / "acceptance.json").read_text()))
    assert cal.scope == "edge"


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--holdout", "2"], "--holdout"),
        (["--min-cycles", "0"], "--min-cycles"),
        (["--h2d-table", "x.json"], "--h2d-table"),
    ],
)
def test_fit_cli_bad_flags_exit_2(runs, flags, flag, capsys) -> None:
    policy, _ = runs
    with pytest.raises(SystemExit) as exc:
        fit_cli.main([str(policy), *flags])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_fit_cli_help_lists_units(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        fit_cli.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "microseconds" in text and "default: 0.25" in text


def test_fit_cli_takes_latency_of_an_emulated_link(runs, tmp_path, capsys) -> None:
    policy, _ = runs  # written with an emulated link of 5 GB/s and 40 us per transfer
    out = tmp_path / "cost.json"
    assert fit_cli.main([str(policy), "--out", str(out)]) == 0
    model = CycleCostModel.load(out)
    assert model.h2d_s_per_transfer == pytest.approx(40e-6)
    assert abs(model.h2d_bytes_per_s / 5e9 - 1) < 0.02


def test_runs_of_different_models_are_refused(runs, tmp_path, capsys) -> None:
    policy, _ = runs
    other_shape = ModelShape(
        name="tiny-moe", num_layers=3, num_experts=16, top_k=2, hidden_size=64, expert_intermediate_size=32,
        bytes_per_expert=2_000_000,
    )  # fmt: skip
    other_cost = dataclasses.replace(TRUTH, num_layers=3)
    other = write_synthetic_cycles_run(
        tmp_path / "other", other_shape, other_cost, num_cycles=20, noise_rel=0.0, seed=0
    )
    rc = _exit_code(fit_cli.main, [str(policy), str(other), "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "model.num_layers" in err and str(other) in err


def test_runs_of_different_links_are_refused(runs, tmp_path, capsys) -> None:
    policy, _ = runs
    faster = dataclasses.replace(TRUTH, h2d_bytes_per_s=20e9)
    other = write_synthetic_cycles_run(tmp_path / "fast", SHAPE, faster, num_cycles=20, noise_rel=0.0, seed=0)
    rc = _exit_code(fit_cli.main, [str(policy), str(other), "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "hardware.emulated_bandwidth_bytes_per_s" in err and str(other) in err


def test_fit_cli_on_a_timed_dense_trace_fits_no_cost_model(tmp_path, capsys) -> None:
    """The shipped sample is a dense run with timed cycles: every cycle verifies the whole tree,
    so the verify term is not identifiable; the CLI says so and writes the acceptance map only."""
    sample = Path(__file__).resolve().parents[1] / "traces" / "samples" / "default"
    out = tmp_path / "cal" / "cost.json"
    rc = fit_cli.main([str(sample), "--out", str(out)])
    summary = _last_json(capsys)
    assert rc == 0 and summary["ok"] is True
    assert summary["cost"] is None and not out.exists()
    assert "dense-mode cycles only" in summary["note"] and "--policy ar" in summary["note"]
    assert (out.parent / fit_cli.ACCEPTANCE_NAME).is_file()


def test_fit_verdict_fails_loudly_on_a_noisy_fit(tmp_path, capsys) -> None:
    """Cycle times with 30 % noise cannot be predicted within 5 % / 15 %: the fit still writes
    cost.json (the input was fine) but warns on stderr, says "ok": false, "verdict": "fail" and
    exits 1; looser thresholds given as flags pass the same fit."""
    noisy = write_synthetic_cycles_run(tmp_path / "noisy", SHAPE, TRUTH, num_cycles=120, noise_rel=0.3, seed=4)
    out = tmp_path / "cal" / "cost.json"
    rc = fit_cli.main([str(noisy), "--out", str(out)])
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert rc == 1 and out.is_file()
    assert summary["ok"] is False and summary["verdict"] == "fail" and summary["verdict_on"] == "held-out"
    assert summary["thresholds"] == {"max_median_pct": 5.0, "max_p90_pct": 15.0}
    assert summary["cycle_heldout_median_pct"] > 5.0 or summary["cycle_heldout_p90_pct"] > 15.0
    assert "WARNING" in captured.err and "misses its accuracy thresholds" in captured.err
    assert "FAIL" in captured.out and "--max-median-pct" in captured.err
    # the verdict travels with the file: the tools that price cycles with it say it failed
    from specfit.cost import failed_fit_note

    note = failed_fit_note(out)
    assert note is not None and "FAILED" in note and str(out) in note
    rc = fit_cli.main([str(noisy), "--out", str(out), "--max-median-pct", "90", "--max-p90-pct", "400"])
    summary = _last_json(capsys)
    assert rc == 0 and summary["ok"] is True and summary["verdict"] == "pass"
    assert failed_fit_note(out) is None
    assert failed_fit_note(tmp_path / "no-report-here" / "cost.json") is None  # a hand-written cost


def test_fit_verdict_passes_within_thresholds_and_judges_in_sample_without_holdout() -> None:
    base = {"cycle_heldout_median_pct": 2.0, "cycle_heldout_p90_pct": 14.0}
    assert fit_cli.judge(base, 5.0, 15.0)["ok"] is True
    verdict = fit_cli.judge(base, 5.0, 10.0)
    assert verdict["ok"] is False and "p90 14.00% > 10%" in verdict["verdict_line"]
    nan = float("nan")
    in_sample = {"cycle_heldout_median_pct": nan, "cycle_heldout_p90_pct": nan}
    in_sample |= {"cycle_fit_median_pct": 1.0, "cycle_fit_p90_pct": 2.0}
    verdict = fit_cli.judge(in_sample, 5.0, 15.0, no_heldout="--holdout 0")
    assert verdict["ok"] is True and verdict["verdict_on"] == "in-sample"
    assert "no held-out cycles (--holdout 0)" in verdict["verdict_line"]
    assert fit_cli.judge({}, 5.0, 15.0)["ok"] is False


def test_fit_explains_an_unidentifiable_draft_base(tmp_path, capsys) -> None:
    """Every drafting cycle drafted one level: draft_base_s cannot be told from the per-level
    cost; the summary says so in words, names the depth and the run to add."""
    one_depth = write_synthetic_cycles_run(
        tmp_path / "d1", SHAPE, TRUTH, num_cycles=80, noise_rel=0.01, seed=6, max_levels=1
    )
    fit_cli.main([str(one_depth), "--out", str(tmp_path / "cal" / "cost.json")])
    summary = _last_json(capsys)
    assert summary["draft_base_s"] == 0.0
    note = summary["draft_base_note"]
    assert "is not identifiable" in note and "drafted 1 level(s)" in note and "--depth 2" in note


def test_fit_cli_fits_overlap_terms_on_the_overlap_on_runs(runs, tmp_path, capsys) -> None:
    """Overlap-off and overlap-on runs of one link (manifest config ``overlap``): the serial terms
    come from the off runs alone, the overlap terms from the on runs, and the model written is
    priced with overlap mode "on"."""
    policy, _ = runs
    on = write_synthetic_cycles_run(
        tmp_path / "on", SHAPE, TRUTH, num_cycles=120, noise_rel=0.01, seed=7, config={"overlap": "on"}
    )
    serial_out, out = tmp_path / "serial" / "cost.json", tmp_path / "both" / "cost.json"
    assert fit_cli.main([str(policy), "--out", str(serial_out), "--h2d-latency-us", "40"]) in (0, 1)
    capsys.readouterr()
    assert fit_cli.main([str(policy), str(on), "--out", str(out), "--h2d-latency-us", "40"]) in (0, 1)
    summary = _last_json(capsys)
    assert summary["overlap_mode"] == "on" and summary["late_call_us"] >= 0
    serial, model = CycleCostModel.load(serial_out), CycleCostModel.load(out)
    assert (model.overlap_h2d, model.overlap_mode) == (True, "on")
    assert model.verify_base_s == serial.verify_base_s and model.h2d_bytes_per_s == serial.h2d_bytes_per_s
    report = json.loads((out.parent / fit_cli.REPORT_NAME).read_text())
    assert report["overlap_fit"]["runs"] == [str(on)] and report["serial_cost"]["overlap_mode"] == "ideal"
    assert report["overlap_fit"]["host_s_per_transfer"] == report["cost"]["host_s_per_transfer"]  # the fitted term
    assert report["overlap_fit"]["placing_s_per_transfer"] >= 0  # the measured placing beside it
    assert report["overlap_fit"]["version"] == 2  # names the meaning of the two keys (M8)
    assert fit_cli.main([str(policy), str(on), "--out", str(out), "--overlap", "off"]) in (0, 1)
    assert "overlap_mode" not in _last_json(capsys)  # --overlap off: every run fitted together, as before


def report_knots(cost_path) -> list:
    """The knots ``calibration.fit`` recorded in its report beside ``cost_path``."""
    return json.loads((cost_path.parent / "cost_fit_report.json").read_text())["next_layer_fit"]["next_layer_nodes"]


def test_fit_cli_fits_next_layer_prefetch_terms_from_next_layer_runs(tmp_path, capsys) -> None:
    """A run recorded with --prefetch next-layer (manifest config ``prefetch``) beside one without:
    the cost JSON (version 6) carries the share and waste recovered from the first run's counts,
    pooled and per tree size (knots over the verified nodes: the truth's share falls from 0.6 on
    the root alone to 0.2 on big trees)."""
    truth = dataclasses.replace(
        TRUTH, next_layer_cover_fraction=0.4, next_layer_waste_per_miss=0.1, next_layer_nodes=(1, 2, 8),
        next_layer_cover_fractions=(0.6, 0.45, 0.2), next_layer_waste_per_misses=(0.2, 0.1, 0.05),
    )  # fmt: skip
    plain = write_synthetic_cycles_run(tmp_path / "plain", SHAPE, TRUTH, num_cycles=120, noise_rel=0.01, seed=5)
    nxt = write_synthetic_cycles_run(
        tmp_path / "next", SHAPE, truth, num_cycles=240, noise_rel=0.01, seed=6, config={"prefetch": "next-layer"}
    )
    out = tmp_path / "calib" / "cost.json"
    rc = fit_cli.main([str(plain), str(nxt), "--out", str(out), "--h2d-latency-us", "40", "--model", "tiny-moe"])
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    assert rc in (0, 1), summary
    model = CycleCostModel.load(out)
    assert json.loads(out.read_text())["version"] == 9
    assert model.next_layer_nodes[0] == 1.0 and len(model.next_layer_nodes) >= 3
    for n in (1, 6, 20, 40):  # the fitted curve follows the truth's
        fitted, true = model.next_layer_share_at(n), truth.next_layer_share_at(n)
        assert fitted[0] == pytest.approx(true[0], abs=0.08) and fitted[1] == pytest.approx(true[1], abs=0.06)
    assert 0.2 < model.next_layer_cover_fraction < 0.45  # pooled: mostly big trees'
    assert report_knots(out) == list(model.next_layer_nodes)
    assert summary["next_layer_cover_fraction"] == model.next_layer_cover_fraction
    assert not model.next_layer_prefetch  # a run setting: live.record / sim.sweep --prefetch set it
    report = json.loads((out.parent / "cost_fit_report.json").read_text())
    assert report["next_layer_fit"]["runs"] == [str(nxt)] and "note: next-layer prefetch:" in printed
