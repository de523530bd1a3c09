"""`python -m analysis.validate` on a tiny grid: tiny random checkpoints, one bandwidth and cache size."""

import json

import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from analysis import validate  # noqa: E402


@pytest.fixture(scope="module")
def tiny_models(tiny_checkpoint, tiny_draft, tmp_path_factory):
    from test_live_record import PROMPT_LINES, _save_tokenizer

    target = tiny_checkpoint("qwen3_moe")
    for folder in (target, tiny_draft):
        if not (folder / "tokenizer.json").is_file():
            _save_tokenizer(folder)
    prompts = tmp_path_factory.mktemp("validate-prompts") / "prompts.txt"
    prompts.write_text("\n".join(PROMPT_LINES[:2]) + "\n")
    return target, tiny_draft, prompts


@pytest.mark.slow
def test_validate_tiny_grid(tiny_models, tmp_path, capsys) -> None:
    target, draft, prompts = tiny_models
    out = tmp_path / "val"
    argv = ["--model", str(target), "--draft", str(draft), "--prompts", str(prompts), "--num-prompts", "2"]
    argv += ["--max-new-tokens", "6", "--bandwidth", "1", "--cache-experts", "4", "--out", str(out)]
    argv += ["--depth", "2", "--topk", "2", "--max-nodes", "5", "--min-cycles", "4"]
    rc = validate.main(argv)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, summary
    table = pd.read_csv(out / "fidelity.csv")
    assert sorted(table["policy"]) == ["ar", "specfit", "topn"]
    assert (table["num_cycles_live"] > 0).all()
    # the greedy outputs are the same whatever the policy, so the replay commits as many tokens
    assert (table["live_tokens_per_s"] > 0).all() and (table["sim_tokens_per_s"] > 0).all()
    ar = table[table["policy"] == "ar"].iloc[0]
    assert ar["same_subtree_fraction"] == 1.0  # root only on both sides
    assert ar["live_tau"] == 1.0 and ar["sim_tau"] == 1.0
    assert 0.0 <= summary["cycle_error_median_pct"] <= summary["cycle_error_p90_pct"]
    assert summary["ran"] is True and "ok" not in summary
    assert summary["all_targets_met"] == bool(table["ok"].all())
    assert summary["num_cells"] == 3
    for name in ("sim_vs_live_throughput.png", "cycle_error_distribution.png", "throughput_vs_bandwidth.png"):
        assert (out / "figures" / name).stat().st_size > 1000
    assert (out / "cost_1.json").is_file() and (out / "cycle_errors.csv").is_file()
    assert json.loads((out / "fidelity.json").read_text())["num_cells"] == 3
    # both sides decide from the same inputs: the sim's union-size predictor on the dense trace's
    # table, the same acceptance map and cost, so SpecFit chooses the same subtrees and caches alike
    from traces.reader import read_manifest

    assert read_manifest(out / "live" / "bw1-c4-specfit").run.predictor == "union-size"
    spec = table[table["policy"] == "specfit"].iloc[0]
    assert spec["same_subtree_fraction"] == 1.0
    assert (table["hit_rate_diff_points"].abs() < 1e-9).all()
    # the report reads the validation folder (fidelity rows + the runs it recorded): every figure
    from analysis import report

    capsys.readouterr()
    assert report.main([str(out), "--out", str(tmp_path / "report")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["missing_figures"] == []


def test_validate_bad_flags_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        validate.main(["--policies", "ar,bogus"])
    assert exc.value.code == 2 and "--policies" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        validate.main(["--bandwidth", "0"])
    assert exc.value.code == 2 and "--bandwidth" in capsys.readouterr().err


def test_validate_bad_model_cache_and_prompts_exit_2_before_any_output(tiny_models, tmp_path, capsys) -> None:
    target, draft, _ = tiny_models
    out = tmp_path / "val"
    base = ["--model", str(target), "--draft", str(draft), "--out", str(out)]
    with pytest.raises(SystemExit) as exc:
        validate.main([*base, "--cache-experts", "4,17"])  # the tiny target has 16 experts per layer
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--cache-experts" in err and "16" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(SystemExit) as exc:
        validate.main([*base, "--prompts", str(empty)])
    assert exc.value.code == 2 and "--prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        validate.main(["--model", str(tmp_path), "--out", str(out)])
    assert exc.value.code == 2 and "config.json" in capsys.readouterr().err
    assert not out.exists()


def test_validate_summary_says_ran_and_whether_targets_were_met(tmp_path, capsys, monkeypatch) -> None:
    """A grid where one cell misses a target: "ran" true, "all_targets_met" false, the targets
    printed under the table with an ok column."""
    rows = []
    for policy, ok in (("ar", True), ("specfit", False)):
        rows.append(
            {
                "bandwidth_gb_per_s": 1.0, "cache_experts_per_layer": 4, "policy": policy,
                "live_tokens_per_s": 10.0, "sim_tokens_per_s": 10.0 if ok else 12.0,
                "throughput_error_pct": 0.0 if ok else 20.0, "hit_rate_diff_points": 0.0,
                "same_subtree_fraction": 1.0, "cycle_error_median_pct": 1.0, "cycle_error_p90_pct": 3.0,
                "off_terms": "" if ok else "throughput", "ok": ok,
            }
        )  # fmt: skip
    table = pd.DataFrame(rows)
    monkeypatch.setattr(validate.Validator, "run", lambda self: (table, {"num_cells": 2, "num_cells_ok": 1}))
    monkeypatch.setattr(validate, "write_outputs", lambda *a, **k: [])
    assert validate.main(["--out", str(tmp_path / "v")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["ran"] is True and summary["all_targets_met"] is False and "ok" not in summary
    assert lines[0].split()[-1] == "ok" and lines[-2].startswith("targets")
    for needle in ("median <= 2 %", "p90 <= 5 %", "within 2 %", "within 0.5 points", ">= 99%"):
        assert needle in lines[-2]
    table["ok"] = True
    assert validate.main(["--out", str(tmp_path / "v2")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["all_targets_met"] is True
