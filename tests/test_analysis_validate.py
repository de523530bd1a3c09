"""`python -m analysis.validate` on a tiny grid: tiny random checkpoints, one bandwidth and cache size."""

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from analysis import validate  # noqa: E402


@pytest.fixture(scope="module")
def tiny_models(tiny_checkpoint, tiny_draft, tmp_path_factory):
    from test_live_record import PROMPT_LINES

    target = tiny_checkpoint("qwen3_moe")  # with the tiny tokenizer
    prompts = tmp_path_factory.mktemp("validate-prompts") / "prompts.txt"
    prompts.write_text("\n".join(PROMPT_LINES[:2]) + "\n")
    return target, tiny_draft, prompts


def _tiny_argv(tiny_models, out, num_prompts: int, repeats: int) -> list[str]:
    """The tiny grid: one bandwidth (1 GB/s), one cache size (4 experts), depth-2 trees."""
    target, draft, prompts = tiny_models
    argv = ["--model", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    argv += ["--num-prompts", str(num_prompts), "--max-new-tokens", "6", "--bandwidth", "1"]
    argv += ["--cache-experts", "4", "--out", str(out), "--depth", "2", "--topk", "2", "--max-nodes", "5"]
    return argv + ["--min-cycles", "4", "--repeats", str(repeats)]


@pytest.mark.slow
def test_validate_tiny_grid(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "val"
    argv = _tiny_argv(tiny_models, out, num_prompts=2, repeats=2)
    rc = validate.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert rc == 0, summary
    table = pd.read_csv(out / "fidelity.csv")
    assert sorted(table["policy"]) == ["ar", "specfit", "topn"]
    assert (table["num_cycles_live"] > 0).all()
    # every policy-mode cell recorded twice, live/<cell>/r1 and r2, each a complete run
    from traces.reader import read_manifest

    for policy in ("ar", "topn", "specfit"):
        cell = out / "live" / f"bw1-c4-{policy}"
        assert sorted(p.name for p in cell.iterdir()) == ["r1", "r2"]
        assert all(read_manifest(cell / r).complete for r in ("r1", "r2"))
    assert (out / "live" / "dense" / "manifest.json").is_file()
    # the repeats decide alike cycle by cycle; their timings give the noise floor
    assert (table["num_repeats"] == 2).all() and (table["repeat_same_subtree_fraction"] == 1.0).all()
    assert (table["num_cycles_matched"] * 2 == table["num_cycles_live"]).all()
    assert (table["live_repeat_spread_pct"] >= 0).all() and (table["cycle_noise_median_pct"] > 0).all()
    assert (table["cycle_noise_median_pct"] <= table["cycle_noise_p90_pct"]).all()
    assert table["within_noise"].dtype == bool
    aims = table[["aim_throughput", "aim_cycle_median", "aim_hit_rate", "aim_same_subtree"]]
    assert (table["ok"] == aims.all(axis=1)).all()  # ok = every per-cell aim
    assert (
        table["aim_throughput"] == (table["throughput_error_pct"].abs() <= table["live_repeat_spread_pct"])
    ).all()
    split = pd.read_csv(out / "error_split.csv")  # where the error lives, per policy and bandwidth
    assert sorted(split["policy"]) == ["ar", "specfit", "topn"] and (split["cycles"] > 0).all()
    terms = [f"split_{t}_pct" for t in ("draft", "decision", "verify", "h2d", "cache", "overlap")]
    assert split[terms].notna().all().all()
    assert any(line.startswith("where the error lives") for line in lines)
    missed = [line for line in lines if line.startswith("  bw1-c4-")]
    assert len(missed) == int((~table["ok"]).sum())  # one line per cell missing an aim
    errors = pd.read_csv(out / "cycle_errors.csv")  # one row per matched cycle
    assert len(errors) == table["num_cycles_matched"].sum()
    assert {"request_id", "cycle_index", "cycle_error_pct", "cycle_noise_pct"} <= set(errors.columns)
    assert summary["repeats"] == 2 and summary["all_within_noise"] == bool(table["within_noise"].all())
    assert (
        summary["noise_cycle_median_pct"] > 0
        and summary["noise_cycle_p90_pct"] >= summary["noise_cycle_median_pct"]
    )
    assert summary["max_live_repeat_spread_pct"] == pytest.approx(table["live_repeat_spread_pct"].max())
    assert lines[-6].startswith("targets") and lines[-5].startswith("noise floor (2 repeats per cell)")
    assert lines[-4].startswith("where the per-cycle error lives: beyond the noise of the 2-repeat means")
    # the decomposition (analysis.fidelity.error_decomposition) in the summary, and the per-cycle part
    # of the noise (each run divided by its whole-run speed factor) in cycle_errors.csv
    # recomputed from cycle_errors.csv: the bias beyond the noise of the 2-repeat means, and the
    # cells' signed-median offsets (rms weighted by their cycles)
    e, n = errors["cycle_error_pct"].to_numpy(float), errors["cycle_noise_pct"].to_numpy(float)
    both = np.isfinite(e) & np.isfinite(n)
    bias = np.sqrt(max(np.mean(e[both] ** 2) - np.mean(n[both] ** 2) / 2, 0.0))
    assert summary["cycle_error_bias_rms_pct"] == pytest.approx(bias)
    cell_keys = [k for k in ("bandwidth_gb_per_s", "cache_experts_per_layer", "policy", "overlap", "prefetch") if k in errors]
    cells = errors.groupby(cell_keys, sort=False)["cycle_error_pct"]
    offsets, counts = cells.median().to_numpy(float), cells.count().to_numpy(float)
    assert len(offsets) == len(table)
    assert summary["cycle_error_cell_offset_rms_pct"] == pytest.approx(np.sqrt(np.average(offsets**2, weights=counts)))
    assert 0 <= summary["cycle_error_within_cell_median_pct"] <= summary["cycle_error_within_cell_p90_pct"]
    assert summary["repeats_for_aim_median"] >= 2
    # the floors and repeats needed come from each repeat's leave-one-out deviation, in cycle_errors.csv
    deviation = errors[["cycle_deviation_pct_1", "cycle_deviation_pct_2"]].to_numpy()
    assert np.isfinite(deviation).all()
    assert summary["cycle_error_floor_median_pct"] == pytest.approx(np.median(np.abs(deviation)) / np.sqrt(2))
    assert errors["cycle_run_noise_pct"].notna().all()
    assert lines[-3].startswith("live compute speed vs the cost's fit runs")
    assert lines[-2].startswith("speed probe (index = ")
    # what a bias-free model would show against the 2-repeat means, per cell and over the grid
    floors = table[["cycle_error_floor_median_pct", "cycle_error_floor_p90_pct"]]
    assert (floors["cycle_error_floor_median_pct"] > 0).all()
    assert (floors["cycle_error_floor_median_pct"] <= floors["cycle_error_floor_p90_pct"]).all()
    assert 0 < summary["cycle_error_floor_median_pct"] <= summary["cycle_error_floor_p90_pct"]
    # each cell's live compute speed against the cost's fit runs (ar and topn are fit runs themselves)
    assert table["live_compute_speed_pct"].notna().all() and summary["num_cells_speed_measured"] == 3
    assert summary["live_compute_speed_min_pct"] <= summary["live_compute_speed_max_pct"]
    assert "within_noise" in lines[0].split()
    # the greedy outputs are the same whatever the policy, so the replay commits as many tokens
    assert (table["live_tokens_per_s"] > 0).all() and (table["sim_tokens_per_s"] > 0).all()
    ar = table[table["policy"] == "ar"].iloc[0]
    assert ar["same_subtree_fraction"] == 1.0  # root only on both sides
    assert ar["live_tau"] == 1.0 and ar["sim_tau"] == 1.0
    assert 0.0 <= summary["cycle_error_median_pct"] <= summary["cycle_error_p90_pct"]
    assert summary["ran"] is True and "ok" not in summary
    grid = summary["aim_cycle_median"] and summary["aim_cycle_p90"]
    assert summary["all_targets_met"] == summary["all_aims_met"] == (bool(table["ok"].all()) and grid)
    assert summary["wall_s"] > 0 and len(summary["load_avg_1min"]) == 2
    assert summary["num_cells"] == 3
    for name in ("sim_vs_live_throughput.png", "cycle_error_distribution.png", "throughput_vs_bandwidth.png"):
        assert (out / "figures" / name).stat().st_size > 1000
    assert (out / "cost_1.json").is_file() and (out / "cycle_errors.csv").is_file()
    assert json.loads((out / "fidelity.json").read_text())["num_cells"] == 3
    # both sides decide from the same inputs: the sim's union-size predictor on the dense trace's
    # table, the same acceptance map and cost, so SpecFit chooses the same subtrees and caches alike
    assert read_manifest(out / "live" / "bw1-c4-specfit" / "r1").run.predictor == "union-size"
    spec = table[table["policy"] == "specfit"].iloc[0]
    assert spec["same_subtree_fraction"] == 1.0
    assert (table["hit_rate_diff_points"].abs() < 1e-9).all()
    # a rerun reuses every complete repeat (nothing re-recorded) and compares the same cycles
    manifests = sorted((out / "live").glob("*/r*/manifest.json"))
    assert len(manifests) == 7  # 3 cells x 2 repeats + the depth-1 calibration run
    calib = out / "live" / "bw1-c4-topn-d1" / "r1"
    assert read_manifest(calib).complete and read_manifest(calib).draft.tree_depth == 1
    notes = json.loads((out / "cost_1_report.json").read_text())["notes"]
    assert not any("draft_base_s is not identifiable" in n for n in notes)  # depths 1 and 2 seen
    stamps = [m.stat().st_mtime_ns for m in manifests]
    capsys.readouterr()
    assert validate.main(argv) == 0
    assert [m.stat().st_mtime_ns for m in manifests] == stamps
    again = pd.read_csv(out / "fidelity.csv")
    assert list(again["num_cycles_matched"]) == list(table["num_cycles_matched"])
    assert list(again["live_tokens_per_s"]) == pytest.approx(list(table["live_tokens_per_s"]))
    # the report reads the validation folder (fidelity rows + the runs it recorded): every figure
    from analysis import report

    capsys.readouterr()
    assert report.main([str(out), "--out", str(tmp_path / "report")]) == 0
    missing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["missing_figures"]
    assert missing == []  # incl. predicted-vs-measured and time split, from live/<cell>/r<k>
    # an interrupted repeat (manifest not complete) is finished with --resume on the next call
    cut = out / "live" / "bw1-c4-ar" / "r2"
    manifest = json.loads((cut / "manifest.json").read_text())
    (cut / "manifest.json").write_text(json.dumps(dict(manifest, complete=False)))
    assert validate.main(argv) == 0
    assert read_manifest(cut).complete
    assert len(read_manifest(cut).resumed_at) == 1  # resumed once, not re-recorded from scratch


@pytest.mark.slow
def test_validate_single_repeat_is_todays_run(tiny_models, tmp_path, capsys, monkeypatch) -> None:
    """``--repeats 1``: one run per cell under r1, no noise measured, within_noise == ok; with
    ``--overlap off,on`` a cell of each (the on cells recorded with live.record --overlap on and
    replayed with the simulator's per-layer overlap); the sim-vs-live per-cycle statistics; the
    speed-normalised columns with a faked speed probe (no wall clock)."""
    import live.speed_probe

    monkeypatch.setattr(live.speed_probe, "probe_once", lambda x, w: 1e-3)  # every run at one speed
    monkeypatch.setattr(live.speed_probe, "probe_model_once", lambda inputs: 1e-3)  # both gauges
    out = tmp_path / "val1"
    argv = _tiny_argv(tiny_models, out, num_prompts=1, repeats=1) + ["--policies", "ar,topn"]
    assert validate.main(argv + ["--overlap", "off,on"]) == 0
    assert (out / "live" / "bw1-c4-topn-ovl" / "r1").is_dir()
    manifest = json.loads((out / "live" / "bw1-c4-topn-ovl" / "r1" / "manifest.json").read_text())
    assert manifest["config"]["overlap"] == "on"
    overlap_table = pd.read_csv(out / "fidelity.csv")
    assert sorted(overlap_table["overlap"]) == ["off", "off", "on", "on"]
    for col in ("sim_cycle_mean_abs_pct_error", "cycle_ks_statistic", "cycle_ks_pvalue"):
        assert overlap_table[col].notna().all()
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert sorted(p.name for p in (out / "live" / "bw1-c4-topn").iterdir()) == ["r1"]
    table = pd.read_csv(out / "fidelity.csv")
    assert (table["num_repeats"] == 1).all() and (
        table["num_cycles_matched"] == table["num_cycles_live"]
    ).all()
    for col in ("live_repeat_spread_pct", "cycle_noise_median_pct", "repeat_same_subtree_fraction"):
        assert table[col].isna().all()
    # no noise measured: the aims fall back to the fixed 2 % throughput and 3 % per-cycle median
    assert (table["aim_throughput"] == (table["throughput_error_pct"].abs() <= 2.0)).all()
    assert (table["aim_cycle_median"] == (table["cycle_error_median_pct"] <= 3.0)).all()
    assert summary["repeats"] == 1 and summary["noise_cycle_median_pct"] is None
    assert summary["max_live_repeat_spread_pct"] is None
    assert lines[-4].startswith("noise floor: not measured")
    assert lines[-3].startswith("live compute speed vs the cost's fit runs")
    _check_speed_normalised(out, argv + ["--overlap", "off,on"], lines)


def _check_speed_normalised(out, argv, lines) -> None:
    """The speed probe's columns: every run probed at the same (faked) speed gives index 1 and
    normalised figures equal to the raw ones; a run whose probe took twice as long moves its cell's
    index (and its fit group's reference median) by exactly that, and slows its simulated cycles."""
    table = pd.read_csv(out / "fidelity.csv")
    assert (table["probe_speed_index"] == 1.0).all()
    for raw in ("sim_tokens_per_s", "throughput_error_pct", "cycle_error_median_pct", "cycle_error_p90_pct"):
        assert list(table[f"norm_{raw}"]) == pytest.approx(list(table[raw]), rel=1e-12), raw
    assert (table["norm_within_noise"] == table["within_noise"]).all()
    assert lines[-2].startswith("speed probe (index = the cell's runs' probe median / the cost's fit runs'): 1.00 .. 1.00")
    runs = pd.read_csv(out / "speed_runs.csv")  # one row per live run of a cell
    assert len(runs) == len(table) and (runs["probe_speed_index"] == 1.0).all()
    assert (runs["chain_probe_speed_index"] == 1.0).all()  # the matrix chain, recorded beside it
    assert runs["compute_speed"].notna().all()
    # topn with overlap ran "twice as slow" by its probe: the overlap fit group (ar and topn,
    # overlap on, one run each, equally many probes) pools to a median of 1.5 ms
    summary_path = out / "live" / "bw1-c4-topn-ovl" / "r1" / "summary.json"
    recorded = json.loads(summary_path.read_text())
    recorded["summary"]["speed_probe_s"] = [2e-3] * len(recorded["summary"]["speed_probe_s"])
    summary_path.write_text(json.dumps(recorded))
    assert validate.main(argv) == 0
    again = pd.read_csv(out / "fidelity.csv").set_index(["policy", "overlap"])
    assert again.loc[("topn", "on"), "probe_speed_index"] == pytest.approx(2.0 / 1.5)
    assert again.loc[("ar", "on"), "probe_speed_index"] == pytest.approx(1.0 / 1.5)
    assert (again.xs("off", level="overlap")["probe_speed_index"] == 1.0).all()
    slow, fast = again.loc[("topn", "on")], again.loc[("ar", "on")]
    assert slow["norm_sim_tokens_per_s"] < slow["sim_tokens_per_s"]
    assert fast["norm_sim_tokens_per_s"] > fast["sim_tokens_per_s"]
    for row in (slow, fast):
        err = 100.0 * (row["norm_sim_tokens_per_s"] - row["live_tokens_per_s"]) / row["live_tokens_per_s"]
        assert row["norm_throughput_error_pct"] == pytest.approx(err)
    summary = json.loads((out / "fidelity.json").read_text())
    assert summary["num_cells_probe_measured"] == 4
    assert summary["probe_speed_index_max"] == pytest.approx(2.0 / 1.5)
    assert 0 <= summary["num_cells_within_noise_normalised"] <= 4
    assert "chain_probe_compute_speed_correlation_runs" in summary


def test_validate_bad_flags_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        validate.main(["--policies", "ar,bogus"])
    assert exc.value.code == 2 and "--policy" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        validate.main(["--overlap", "off,ideal"])
    assert exc.value.code == 2 and "--overlap" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        validate.main(["--prefetch", "none,always"])
    assert exc.value.code == 2 and "--prefetch" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        validate.main(["--bandwidth", "0"])
    assert exc.value.code == 2 and "--bandwidth" in capsys.readouterr().err
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exc:
            validate.main(["--repeats", bad])
        assert exc.value.code == 2 and "--repeats" in capsys.readouterr().err


def test_validate_bad_model_cache_and_prompts_exit_2_before_any_output(tiny_models, tmp_path, capsys) -> None:
    target, draft, _ = tiny_models
    out = tmp_path / "val"
    base = ["--model", str(target), "--draft", str(draft), "--out", str(out)]
    with pytest.raises(SystemExit) as exc:
        validate.main([*base, "--cache-experts", "4,17"])  # the tiny target has 16 experts per layer
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--cache:" in err and "16" in err
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
                "live_repeat_spread_pct": 4.0, "cycle_noise_median_pct": 1.5, "cycle_noise_p90_pct": 6.5,
                "off_terms": "" if ok else "throughput", "ok": ok, "within_noise": ok, "aim_throughput": ok,
            }
        )  # fmt: skip
    table = pd.DataFrame(rows)
    noise = {
        "median_live_repeat_spread_pct": 3.0,
        "max_live_repeat_spread_pct": 5.5,
        "noise_cycle_median_pct": 1.2,
        "noise_cycle_p90_pct": 4.4,
    }
    grid = {"aim_cycle_median": True, "aim_cycle_p90": True}
    monkeypatch.setattr(
        validate.Validator,
        "run",
        lambda self, progress=True: (
            table,
            {
                "num_cells": 2,
                "num_cells_ok": int(table["ok"].sum()),
                "all_aims_met": bool(table["ok"].all()),
                **grid,
                **noise,
            },
        ),
    )
    monkeypatch.setattr(validate, "write_outputs", lambda *a, **k: [])
    assert validate.main(["--out", str(tmp_path / "v")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["ran"] is True and summary["all_targets_met"] is False and "ok" not in summary
    assert summary["all_within_noise"] is False and summary["repeats"] == 2
    header = lines[0].split()
    assert header[-2:] == ["within_noise", "ok"] and "spread%" in header
    # within_noise reads the p90 noise too: printed (short headers, mapped on the line under the table)
    assert "noise_med%" in header and "noise_p90%" in header and lines[-6].startswith("targets")
    legend = lines[3]
    assert legend.startswith("columns (fidelity.csv names):")
    assert lines[4] == "missed aims (figure > the noise it is held to):"
    assert lines[5] == "  bw1-c4-specfit: throughput error +20 % > repeat spread 4 %"
    for full in ("cycle_noise_p90_pct", "cycle_noise_median_pct", "live_repeat_spread_pct"):
        assert f"= {full}" in legend
    assert "nan" not in lines[1].split()[header.index("noise_p90%")]  # the rows carry the value
    for needle in ("median <= 3 % (met)", "p90 <= 8 % (met)", "repeat spread", "within 0.5 points", ">= 99%"):
        assert needle in lines[-6]
    assert lines[-5].startswith("noise floor (2 repeats per cell)")
    for needle in ("spread median 3 %", "(max 5.5 %)", "median 1.2 %", "p90 4.4 %"):
        assert needle in lines[-5]
    assert lines[-4].startswith("where the per-cycle error lives") and "n/a" in lines[-4]  # not in this summary
    assert lines[-3].startswith("live compute speed vs the cost's fit runs: not measured")
    assert lines[-2].startswith("speed probe: not measured")
    table["ok"] = table["within_noise"] = True
    for col in ("aim_throughput", "aim_cycle_median", "aim_hit_rate", "aim_same_subtree"):
        table[col] = True
    assert validate.main(["--out", str(tmp_path / "v2"), "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["all_targets_met"] is True and summary["all_within_noise"] is True
    assert summary["repeats"] == 1 and lines[-4].startswith("noise floor: not measured (--repeats 1)")


@pytest.mark.slow
def test_validate_prefetch_cells_count_identically_live_and_simulated(tiny_models, tmp_path, capsys) -> None:
    """Prefetch issued/used/wasted do not depend on timing: on a tiny grid every prefetch cell's
    live counts equal the simulator's, cycle by cycle, and next-layer prefetch really issues."""
    out = tmp_path / "val"
    argv = _tiny_argv(tiny_models, out, num_prompts=1, repeats=1)
    argv += ["--policies", "topn,specfit", "--prefetch", "none,draft,next-layer"]
    assert validate.main(argv) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.strip().splitlines()
    assert "pf_same" in lines[0].split() and "prefetch" in lines[0].split()
    table = pd.read_csv(out / "fidelity.csv")
    assert sorted(zip(table["policy"], table["prefetch"])) == [
        (p, f) for p in ("specfit", "topn") for f in ("draft", "next-layer", "none")
    ]
    assert table["prefetch_counts_identical"].all()
    for name in ("issued", "used", "wasted"):
        assert (table[f"live_prefetch_{name}"] == table[f"sim_prefetch_{name}"]).all()
    nl = table[table["prefetch"] == "next-layer"]
    assert (nl["live_prefetch_issued"] > 0).all() and (nl["live_prefetch_used"] > 0).all()
    # next-layer prefetch priced in the planned cells: its share fitted on the topn next-layer run,
    # the same cost on the live side (the manifest's planner cost) and the simulated one
    from specfit.cost import CycleCostModel
    from traces.reader import open_run

    cost = CycleCostModel.load(out / "cost_1_c4.json")  # the share of cache 4 (the grid's one cache)
    assert 0 < cost.next_layer_cover_fraction <= 1 and not cost.next_layer_prefetch
    topn = open_run(next((out / "live").glob("*topn-pf-next-layer/r1"))).cycles
    used, misses = int(topn["num_prefetch_used"].sum()), int(topn["cache_misses"].sum())
    misses -= int(sum(int(m[0]) for m in topn["layer_misses"]))  # layer 0: no guess, left out
    assert cost.next_layer_cover_fraction == pytest.approx(used / (used + misses))
    run = next(p for p in (out / "live").glob("*specfit-pf-next-layer/r1"))
    planner = CycleCostModel.from_dict(open_run(run).manifest.config["cost_model"])
    assert planner.next_layer_priced and planner.next_layer_cover_fraction == cost.next_layer_cover_fraction
    assert (table[table["prefetch"] == "none"]["live_prefetch_issued"] == 0).all()
    assert (out / "live" / "bw1-c4-topn-pf-next-layer" / "r1" / "manifest.json").is_file()


def test_prefetch_counts_compare_every_repeat_cycle_by_cycle() -> None:
    def cycles(issued, used, wasted):
        return pd.DataFrame(
            {
                "request_id": [0] * len(issued),
                "cycle_index": range(len(issued)),
                "num_prefetch_issued": issued,
                "num_prefetch_used": used,
                "num_prefetch_wasted": wasted,
            }
        )

    sim = cycles([2, 1], [1, None], [0, 1])  # None: a replay without prefetch writes no count
    same = validate.prefetch_counts([cycles([2, 1], [1, 0], [0, 1])] * 2, sim)
    assert (
        same["prefetch_counts_identical"] and same["live_prefetch_issued"] == same["sim_prefetch_issued"] == 3
    )
    moved = validate.prefetch_counts([cycles([2, 1], [1, 0], [0, 1]), cycles([1, 2], [1, 0], [0, 1])], sim)
    assert not moved["prefetch_counts_identical"]  # same totals, one repeat counted in another cycle


def _tensor_bytes() -> int:
    """Bytes of every torch tensor the garbage collector tracks (garbage not yet collected included)."""
    import gc

    import torch

    total = 0
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            total += obj.untyped_storage().nbytes()
    return total


def test_in_process_live_runs_do_not_keep_their_models(tiny_models, tmp_path) -> None:
    """validate runs live.record in its own process, once per cell and repeat: a finished run's
    model (held in reference cycles by its hooks) is freed before the next, so memory does not
    grow with the grid (a real-width target is 2.5 GB per run)."""
    target, draft, prompts = tiny_models
    argv = ["--model", str(target), "--draft", str(draft), "--prompts", str(prompts), "--num-prompts", "1"]
    argv += ["--max-new-tokens", "2", "--mode", "policy", "--policy", "ar", "--no-progress"]
    validate.live_record(argv + ["--out", str(tmp_path / "a")], tmp_path / "a.log")
    after_one = _tensor_bytes()
    for name in ("b", "c"):
        validate.live_record(argv + ["--out", str(tmp_path / name)], tmp_path / f"{name}.log")
    assert _tensor_bytes() <= after_one


@pytest.mark.parametrize("overlap", [["on"], ["off"], ["off", "on"]])
def test_a_pre_v4_cost_file_with_overlap_on_is_warned_about(overlap, tmp_path, capsys) -> None:
    """``--cost`` written before pre_router_fraction (version 3: loaded as 0) with an overlap-on cell
    is said on stderr, as sim.sweep and live.record say it; an overlap-off grid says nothing."""
    import argparse

    from analysis.validate import _moe_layers, check_cost
    from specfit.cost import CycleCostModel

    cost = CycleCostModel(1e-3, 2e-3, 1e-4, 0.0, 1e9, 0.0, 1_000, _moe_layers("default"))
    data = json.loads(cost.save(tmp_path / "cost.json").read_text())
    data.pop("pre_router_fraction")
    data["units"].pop("pre_router_fraction", None)
    data["version"] = 3
    (tmp_path / "cost.json").write_text(json.dumps(data))
    args = argparse.Namespace(cost=str(tmp_path / "cost.json"), overlap=overlap, model="default")
    assert check_cost(args, None).pre_router_fraction == 0.0
    err = capsys.readouterr().err
    assert ("--cost" in err and "pre_router_fraction" in err and "version-3" in err) == ("on" in overlap)


@pytest.mark.slow
def test_validate_separate_calibration_fits_on_runs_of_its_own(tiny_models, tmp_path, capsys) -> None:
    """``--calibration separate``: the cost is fitted on ``-cal`` runs (ar/topn at the first cache,
    off and on) recorded before the grid; every grid cell, ar/topn included, is compared out of
    sample, and the calibration runs are not rows of the fidelity table."""
    out = tmp_path / "sep"
    argv = _tiny_argv(tiny_models, out, num_prompts=2, repeats=1) + ["--policies", "ar,specfit"]
    assert validate.main(argv + ["--calibration", "separate", "--overlap", "off,on"]) == 0
    live = out / "live"
    for name in ("bw1-c4-ar-cal", "bw1-c4-topn-cal", "bw1-c4-ar-ovl-cal", "bw1-c4-topn-ovl-cal", "bw1-c4-topn-d1"):
        assert (live / name / "r1").is_dir(), name
    table = pd.read_csv(out / "fidelity.csv")
    assert sorted(zip(table["policy"], table["overlap"])) == [("ar", "off"), ("ar", "on"), ("specfit", "off"), ("specfit", "on")]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["calibration"] == "separate"
    # fitted on the two calibration runs and the depth-1 run only, not on the grid's ar cells
    assert "from 3 runs" in json.loads((out / "cost_1.json").read_text())["source"]


@pytest.mark.slow
def test_validate_separate_calibration_prices_next_layer_cells(tiny_models, tmp_path, capsys) -> None:
    """``--calibration separate --prefetch next-layer``: the cost the next-layer cells run with
    carries a share (from replays on the dense trace; the calibration runs prefetch nothing)."""
    from specfit.cost import CycleCostModel

    out = tmp_path / "sepnl"
    argv = _tiny_argv(tiny_models, out, num_prompts=2, repeats=1) + ["--policies", "ar,specfit"]
    assert validate.main(argv + ["--calibration", "separate", "--prefetch", "next-layer"]) == 0
    cost = CycleCostModel.load(out / "cost_1_c4.json")  # the share at the grid's cache size (4)
    assert cost.has_next_layer_share and cost.next_layer_nodes
    table = pd.read_csv(out / "fidelity.csv")
    assert sorted(zip(table["policy"], table["prefetch"])) == [("ar", "next-layer"), ("specfit", "next-layer")]
    assert "no next-layer prefetch share" not in capsys.readouterr().err


def test_validate_calibration_flag_checked() -> None:
    with pytest.raises(SystemExit) as exc:
        validate.main(["--calibration", "sometimes"])
    assert exc.value.code == 2


def test_separate_calibration_takes_the_next_layer_share_from_replays(tmp_path, monkeypatch) -> None:
    """``--calibration separate`` has no prefetch among its calibration runs: a grid with
    ``--prefetch next-layer`` gets the share per tree size from replays on the dense trace, one
    per cache size (``sim.sweep.next_layer_share_from_replays``, as the sweep's pilots), saved in
    the cost each cache's cells price with;
    with ``--cost`` or without next-layer prefetch the cost is left as it is."""
    import dataclasses
    from types import SimpleNamespace

    import sim.sweep
    from specfit.cost import CycleCostModel
    from specfit.prefetch import NextLayerShare

    cost = CycleCostModel(1e-3, 5e-3, 1e-4, 0.0, 1e9, 1e-5, 1_000_000, 2)
    shares = {  # the share depends on the cache: one per cache size, as sim.sweep's pilots
        4: NextLayerShare(0.3, 0.1, 70, 30, 10, (1.0, 9.0), (0.5, 0.2), (0.2, 0.05)),
        8: NextLayerShare(0.5, 0.05, 90, 10, 10, (1.0, 9.0), (0.6, 0.4), (0.1, 0.02)),
    }
    seen = []

    def fake(run, configs, policies=sim.sweep.PILOT_POLICIES):
        seen.append((run, [(c.cache_capacity_per_layer, c.policy, c.cache_policy, c.predictor) for c in configs], policies))
        return shares[configs[0].cache_capacity_per_layer]

    monkeypatch.setattr(sim.sweep, "next_layer_share_from_replays", fake)
    args = SimpleNamespace(cost=None, prefetch=["none", "next-layer"], seed=0)
    v = validate.Validator(args, tmp_path)
    v.dense = "dense-run"
    priced = v._with_replayed_share(cost, tmp_path / "cost.json", [4, 8])
    assert sorted(priced) == [4, 8]
    for cache, (cache_cost, path) in priced.items():
        assert cache_cost == dataclasses.replace(cost, **shares[cache].cost_fields())
        assert path == tmp_path / f"cost_c{cache}.json" and CycleCostModel.load(path) == cache_cost
    assert seen == [("dense-run", [(c, "ar", "lru", "union-size")], ("ar", "chain", "topn")) for c in (4, 8)]
    costs = {("off", c): pair for c, pair in priced.items()}
    assert validate.cell_cost(costs, validate.Cell(1.0, 8, "specfit", prefetch="next-layer")) == priced[8]
    assert validate.cell_cost({"off": "x"}, validate.Cell(1.0, 8, "ar")) == "x"
    for changed in ({"cost": "given.json"}, {"prefetch": ["none", "draft"]}):
        v.args = SimpleNamespace(**dict(vars(args), **changed))
        assert v._with_replayed_share(cost, tmp_path / "other.json", [4]) == {4: (cost, tmp_path / "other.json")}
    assert len(seen) == 2


def _probed_run(folder, seconds, workload):
    """A live run folder whose summary.json holds only the speed probe's fields."""
    folder.mkdir(parents=True)
    summary = {"speed_probe_s": seconds, "speed_probe_chain_s": [1e-3] * len(seconds)}
    if workload is not None:
        summary["speed_probe_workload"] = workload
    (folder / "summary.json").write_text(json.dumps({"summary": summary}))
    return folder


def test_probe_index_is_nan_when_the_runs_and_the_fit_runs_timed_different_gauges(tmp_path, capsys) -> None:
    """``speed_probe_s`` held the matrix chain's timings before the model gauge and holds the
    target's own attention + router since (or the chain's again when the model probe failed):
    runs reused from an older output folder must not be divided by the new gauge. Same gauge on
    both sides: the plain ratio; different gauges: NaN per cell and per run, and a warning."""
    from types import SimpleNamespace

    from live.speed_probe import MODEL_WORKLOAD

    model = f"{MODEL_WORKLOAD} (norm, ...) of 2 layers"
    fit = [_probed_run(tmp_path / "fit1", [1e-3, 1e-3], model)]
    same = [_probed_run(tmp_path / "same", [2e-3, 2e-3], model)]
    chain_old = [_probed_run(tmp_path / "old", [4e-3, 4e-3], None)]  # before the workload line
    chain_failed = [_probed_run(tmp_path / "failed", [4e-3], "tanh(y @ w) through 8 ...")]
    assert [validate.speed_probe_gauge(p[0]) for p in (fit, same, chain_old, chain_failed)] == ["model", "model", "chain", "chain"]
    v = validate.Validator(SimpleNamespace(cost=None), tmp_path)
    v._fit_run_paths = lambda cell: fit
    v._speed_reference = lambda cell: None
    cell = validate.Cell(1.0, 4, "ar")
    speeds = []

    def replay(dense, cell, cost, decision_s, compute_speed):
        speeds.append(compute_speed)
        raise validate.ValidationError("replayed")  # the figures past this point are tested above

    v.replay = replay
    with pytest.raises(validate.ValidationError, match="replayed"):
        v.normalised(None, cell, same, [None], {}, None, None, 0.0)
    assert speeds == [pytest.approx(2.0)] and v.speed_runs[-1]["probe_speed_index"] == pytest.approx(2.0)
    assert "different speed probes" not in capsys.readouterr().err
    for runs in (chain_old, chain_failed):
        out = v.normalised(None, cell, runs, [None], {}, None, None, 0.0)
        assert np.isnan(out["probe_speed_index"]) and out["norm_within_noise"] is None
        assert np.isnan(v.speed_runs[-1]["probe_speed_index"])
        assert v.speed_runs[-1]["chain_probe_speed_index"] == pytest.approx(1.0)  # the chain is on both sides
        assert "timed different speed probes (chain, model;" in capsys.readouterr().err


def test_grid_calibration_counts_planner_misses_without_layer_0(tmp_path, monkeypatch, capsys) -> None:
    """The "too few planner misses" test counts what the knots count, M - M0 + U (layer 0's
    misses have no guess): 50 cycles of 2 + 2 misses and 1 used prefetch hold 250 misses + used
    but only 150 planner misses, so the cache takes the pooled share (M12)."""
    from types import SimpleNamespace

    import calibration.runs

    table = pd.DataFrame(
        {"cache_misses": [4] * 50, "num_prefetch_used": [1] * 50, "num_prefetch_wasted": [0] * 50,
         "layer_misses": [[2, 2]] * 50}
    )  # fmt: skip
    monkeypatch.setattr(calibration.runs, "load_runs", lambda paths: SimpleNamespace(cycles=table))
    v = validate.Validator(SimpleNamespace(cost=None), tmp_path)
    v._next_layer_shares(1.0, {validate.Cell(1.0, 4, "ar", prefetch="next-layer"): [tmp_path / "c4"]}, [4])
    assert "(150 planner misses in this cache's next-layer runs" in capsys.readouterr().err


def test_grid_calibration_fits_the_next_layer_share_per_cache(tmp_path, monkeypatch, capsys) -> None:
    """Default ``--calibration grid``: each cache size's cells are priced with the next-layer share
    fitted on that cache's cost-free next-layer runs (the share depends on the cache), saved as
    ``cost_<bw>_c<cache>.json``; a cache whose runs hold too few planner misses (or none) takes the
    share pooled over every cache, with one stderr line each; ``--cost`` leaves the cost as it is."""
    from types import SimpleNamespace

    import calibration.runs
    from specfit.cost import CycleCostModel
    from specfit.prefetch import NEXT_LAYER_MIN_KNOT_MISSES

    def cycles(n: int, misses: int, used: int, wasted: int) -> pd.DataFrame:
        return pd.DataFrame(
            {"cache_misses": [misses] * n, "num_prefetch_used": [used] * n, "num_prefetch_wasted": [wasted] * n}
        )

    tables = {  # run folder -> its cycles: cache 4 has 300 planner misses, cache 8 only 50
        tmp_path / "c4-ar": cycles(50, 2, 1, 0), tmp_path / "c4-topn": cycles(50, 2, 1, 1),
        tmp_path / "c8-ar": cycles(10, 3, 2, 1), tmp_path / "c4-none": cycles(50, 9, 0, 0),
    }  # fmt: skip
    loaded = []

    def fake_load_runs(paths):
        loaded.append(sorted(p.name for p in paths))
        return SimpleNamespace(cycles=pd.concat([tables[p] for p in paths], ignore_index=True))

    monkeypatch.setattr(calibration.runs, "load_runs", fake_load_runs)
    Cell = validate.Cell
    live_paths = {
        Cell(1.0, 4, "ar", prefetch="next-layer"): [tmp_path / "c4-ar"],
        Cell(1.0, 4, "topn", prefetch="next-layer"): [tmp_path / "c4-topn"],
        Cell(1.0, 8, "ar", prefetch="next-layer"): [tmp_path / "c8-ar"],
        Cell(1.0, 4, "ar"): [tmp_path / "c4-none"],  # no prefetch: not a share's run
    }
    v = validate.Validator(SimpleNamespace(cost=None), tmp_path)
    shares = v._next_layer_shares(1.0, live_paths, [4, 8, 16])
    assert sorted(loaded) == [["c4-ar", "c4-topn"], ["c4-ar", "c4-topn", "c8-ar"], ["c8-ar"]]
    assert shares[4].cover_fraction == pytest.approx(100 / 300) and shares[4].waste_per_miss == pytest.approx(50 / 300)
    pooled = (100 + 20) / (300 + 50)
    assert shares[8].cover_fraction == pytest.approx(pooled) and shares[16].cover_fraction == pytest.approx(pooled)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"warning: 1 GB/s, cache {c}: next-layer prefetch share pooled over every cache size ({n} planner "
        f"misses in this cache's next-layer runs, < {NEXT_LAYER_MIN_KNOT_MISSES})"
        for c, n in ((8, 50), (16, 0))
    ]

    cost = CycleCostModel(1e-3, 5e-3, 1e-4, 0.0, 1e9, 1e-5, 1_000_000, 2)
    priced = v._priced_per_cache(cost, tmp_path / "cost_1.json", shares, [4, 8, 16])
    for c, (cache_cost, path) in priced.items():
        assert path == tmp_path / f"cost_1_c{c}.json" and CycleCostModel.load(path) == cache_cost
        assert cache_cost.next_layer_cover_fraction == pytest.approx(shares[c].cover_fraction)
    costs = {("off", c): pair for c, pair in priced.items()}
    assert validate.cell_cost(costs, Cell(1.0, 4, "specfit", prefetch="next-layer")) == priced[4]
    assert validate.cell_cost(costs, Cell(1.0, 8, "specfit", prefetch="next-layer")) == priced[8]

    # prefetch "both" runs when there is no next-layer run; none of either, or --cost: no share
    both = {dataclasses.replace(c, prefetch="both"): p for c, p in live_paths.items() if c.prefetch != "none"}
    assert v._next_layer_shares(1.0, both, [4])[4].cover_fraction == pytest.approx(100 / 300)
    assert v._next_layer_shares(1.0, {Cell(1.0, 4, "ar"): [tmp_path / "c4-none"]}, [4]) == {}
    assert v._priced_per_cache(cost, tmp_path / "cost_1.json", {}, [4, 8]) == {c: (cost, tmp_path / "cost_1.json") for c in (4, 8)}
    v.args = SimpleNamespace(cost="given.json")
    assert v._next_layer_shares(1.0, live_paths, [4, 8]) == {}


def test_pearson_pairs_the_finite_rows_and_needs_three_with_spread() -> None:
    """validate._pearson: scipy's Pearson r over the rows where both are finite (here the first
    three: r of (1, 2, 3) and (2, 4, 7), 0.99339 by hand); NaN below 3 such rows or for a constant."""
    x = pd.Series([1.0, 2.0, 3.0, np.nan, 5.0])
    y = pd.Series([2.0, 4.0, 7.0, 1.0, np.inf])
    assert validate._pearson(x, y) == pytest.approx(5.0 / np.sqrt(2.0 * 38.0 / 3.0))
    assert np.isnan(validate._pearson(x[:2], y[:2]))
    assert np.isnan(validate._pearson(pd.Series([1.0, 1.0, 1.0]), pd.Series([1.0, 2.0, 3.0])))
