"""`python -m analysis.report` renders every figure from a small dense run, policy run, sweep and calibration."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from tiny_shapes import TINY_COST, TINY_MOE

from analysis import figures, metrics
from analysis import report as report_cli
from calibration import fit as fit_cli
from calibration.synthetic import write_synthetic_cycles_run
from traces.reader import open_run
from traces.synthetic import generate_dense_trace

SHAPE, COST = TINY_MOE, TINY_COST


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from sim import sweep

    root = tmp_path_factory.mktemp("report-inputs")
    dense = generate_dense_trace(
        root / "dense",
        SHAPE,
        num_requests=2,
        positions_per_request=30,
        prompt_len=8,
        tree_depth=4,
        tree_topk=3,
        max_nodes=16,
        vocab_size=50,
        seed=1,
    )
    policy = write_synthetic_cycles_run(root / "policy", SHAPE, COST, num_cycles=40, noise_rel=0.02, seed=2)
    argv = [
        "--trace",
        str(dense),
        "--bandwidth",
        "2,16",
        "--cache",
        "0.25,0.5",
        "--policy",
        "ar,topn,specfit",
        "--jobs",
        "1",
        "--expert-bytes",
        str(SHAPE.bytes_per_expert),
        "--out",
        str(root / "sweep"),
    ]
    assert sweep.main(argv) == 0
    assert fit_cli.main([str(policy), str(dense), "--out", str(root / "calib" / "cost.json")]) == 0
    return {"dense": dense, "policy": policy, "sweep": root / "sweep", "calib": root / "calib"}


def test_report_renders_every_figure(inputs, tmp_path, capsys) -> None:
    capsys.readouterr()
    out = tmp_path / "report"
    rc = report_cli.main([*(str(p) for p in inputs.values()), "--out", str(out)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and summary["ok"]
    assert summary["figures"] == list(figures.FIGURES) and summary["missing_figures"] == []
    for name in figures.FIGURES:
        png = out / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
    text = (out / "report.md").read_text()
    assert "2.67" in text and "conditional" in text  # conventions stated
    assert text.count("![") == len(figures.FIGURES)
    assert "| policy | policy | 8 | 0 | 40 |" in text  # the recorded runs: run, mode, requests, trees, cycles
    assert "| dense | dense | 2 | 60 | 0 |" in text  # a dense trace (no cycles) is listed too
    header = next(line for line in text.splitlines() if line.startswith("| run | mode |"))
    assert "| decode_s |" in header and "wall_s" not in header  # decode seconds, named as such
    assert "without prefill and trace writing" in text
    assert "## Cost-model fit" in text and "| calib | cycle | heldout |" in text


def test_regime_map_flags_full_tree_slower_than_ar() -> None:
    tp = pd.DataFrame(
        {
            "label": "x",
            "source": "sim",
            "bandwidth_gb_per_s": [2, 2, 2, 32, 32, 32],
            "cache_experts_per_layer": 4,
            "policy": ["ar", "topn", "specfit"] * 2,
            "tokens_per_s": [100.0, 60.0, 101.0, 100.0, 150.0, 160.0],
        }
    )
    slow = figures.slower_than_ar(tp)
    assert slow["bandwidth_gb_per_s"].tolist() == [2]
    assert slow["specfit_tokens_per_s"].tolist() == [101.0]


def test_dense_depth_acceptance_matches_per_tree_count(inputs) -> None:
    run = open_run(inputs["dense"])
    trees = list(run.iter_trees())
    accepted = [t.num_accepted for t in trees]
    # reached: one past the accepted length when the accepted path's last node has a child
    reached = []
    for t in trees:
        ok = t.path_accepted
        last = int(np.flatnonzero(ok)[np.argmax(t.tree.depths[ok])])
        reached.append(t.num_accepted + int(np.any(t.tree.parents == last)))
    expected = metrics.per_depth_acceptance(accepted, reached)
    got = figures.dense_depth_acceptance(run.node_arrays())
    np.testing.assert_allclose(got, expected)
    assert 0.0 < expected[0] < 1.0
    # one definition: traces.inspect's summary reports the same figures
    from traces.stats import summarize

    np.testing.assert_allclose(summarize(run)["depth_acceptance"], got)


def test_report_errors(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        report_cli.main([str(tmp_path / "missing")])
    assert exc.value.code == 2 and "missing" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:  # an unrecognised folder is bad input: exit 2 naming it
        report_cli.main([str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    assert exc.value.code == 2 and "no manifest.json" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # the failed run leaves no empty --out folder


def _sweep_dir(root: Path, name: str, rows: list[dict]) -> Path:
    path = root / name
    path.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(path / "results.csv", index=False)
    return path


def test_sweep_cells_of_different_overlap_are_not_averaged(tmp_path) -> None:
    from analysis.inputs import collect

    base = {"bandwidth_gb_per_s": 16.0, "cache_experts_per_layer": 8, "cache_policy": "lru"}
    base |= {"draft_s": 1.0, "verify_s": 1.0, "h2d_s": 1.0, "decode_s": 4.0}
    rows = [
        {**base, "overlap": False, "policy": "ar", "tokens_per_s": 100.0},
        {**base, "overlap": False, "policy": "topn", "tokens_per_s": 60.0},
        {**base, "overlap": True, "policy": "ar", "tokens_per_s": 100.0},
        {**base, "overlap": True, "policy": "topn", "tokens_per_s": 150.0},
    ]
    data = collect([_sweep_dir(tmp_path, "s", rows)])
    configs = sorted(data.throughput["config"].unique())
    assert configs == ["sweep s: overlap off, cache policy lru", "sweep s: overlap on, cache policy lru"]
    # averaged, top-N would be 105 > 100 and nothing flagged; per configuration overlap off is flagged
    slow = figures.slower_than_ar(data.throughput)
    assert slow["config"].tolist() == ["sweep s: overlap off, cache policy lru"]
    assert slow["full_tokens_per_s"].tolist() == [60.0]
    assert data.time_split["label"].tolist() == [
        "sim s: ar 16GB/s c8",
        "sim s: topn 16GB/s c8",
        "sim s: ar 16GB/s c8 overlap",
        "sim s: topn 16GB/s c8 overlap",
    ]
    out = tmp_path / "report"
    report_cli.write_report(data, out, "t")
    text = (out / "report.md").read_text()
    assert (
        "- sweep s: overlap off, cache policy lru" in text
        and "- sweep s: overlap on, cache policy lru" in text
    )


def test_sweep_and_validate_cells_are_separate_configurations(tmp_path) -> None:
    from analysis.inputs import collect

    sweep = _sweep_dir(
        tmp_path,
        "s",
        [{"bandwidth_gb_per_s": 16.0, "cache_experts_per_layer": 8, "policy": "ar", "tokens_per_s": 50.0}],
    )
    val = tmp_path / "v"
    val.mkdir()
    pd.DataFrame(
        [
            {
                "bandwidth_gb_per_s": 1.0,
                "cache_experts_per_layer": 8,
                "policy": "ar",
                "live_tokens_per_s": 150.0,
                "sim_tokens_per_s": 160.0,
            }
        ]
    ).to_csv(val / "fidelity.csv", index=False)
    tp = collect([sweep, val]).throughput
    assert sorted(tp["config"].unique()) == ["sweep s", "validate v"]
    assert figures.throughput_configs(tp) == ["sweep s", "validate v"]


def _copy_run(src: Path, dst: Path, **config: object) -> Path:
    import shutil

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest.setdefault("config", {}).update(config)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_live_throughput_uses_decode_wall_seconds(inputs, tmp_path) -> None:
    from analysis.inputs import collect

    run = _copy_run(inputs["policy"], tmp_path / "run")
    cycles = open_run(run).cycles
    by_cycles = metrics.cycle_summary(cycles)
    fallback = collect([run])
    assert fallback.throughput["tokens_per_s"].iloc[0] == pytest.approx(by_cycles["tokens_per_s"])
    assert fallback.run_summaries[0][1]["throughput_basis"] == "sum cycle_s"
    decode_s = 1.13 * float(cycles["cycle_s"].sum())  # wall time includes bookkeeping between cycles
    (run / "summary.json").write_text(json.dumps({"summary": {"num_tokens": 123, "decode_s": decode_s}}))
    data = collect([run])
    assert data.throughput["tokens_per_s"].iloc[0] == pytest.approx(123 / decode_s)
    label, summary = data.run_summaries[0]
    assert summary["tokens_per_s"] == pytest.approx(123 / decode_s) and summary["decode_s"] == decode_s
    assert "wall_s" not in summary  # it is the decode phase's seconds, labelled as such
    assert summary["throughput_basis"] == "decode_s"
    # a summary of one --resume call only: counts and time would disagree in scope, so use the cycles
    partial = {"num_tokens": 12, "decode_s": 0.5, "summary_covers": "requests decoded by this --resume call"}
    (run / "summary.json").write_text(json.dumps({"summary": partial}))
    resumed = collect([run])
    assert resumed.throughput["tokens_per_s"].iloc[0] == pytest.approx(by_cycles["tokens_per_s"])
    assert resumed.run_summaries[0][1]["throughput_basis"] == "sum cycle_s"


def test_live_runs_of_different_depth_are_separate(inputs, tmp_path) -> None:
    from analysis.inputs import collect

    a = _copy_run(inputs["policy"], tmp_path / "a", depth=4, num_prompts=8)
    b = _copy_run(inputs["policy"], tmp_path / "b", depth=6, num_prompts=8)
    c = _copy_run(inputs["policy"], tmp_path / "c", depth=6, num_prompts=8)
    configs = collect([a, b, c]).throughput["config"].tolist()
    assert configs[0] != configs[1] and configs[1] == configs[2]
    assert "depth 4" in configs[0] and "num prompts 8" in configs[0] and "depth 6" in configs[1]


def test_validate_runs_are_labelled_with_their_folder(inputs, tmp_path) -> None:
    import shutil

    from analysis.inputs import collect

    val = tmp_path / "val1"
    shutil.copytree(inputs["dense"], val / "live" / "dense")
    pd.DataFrame(
        [{"bandwidth_gb_per_s": 1.0, "cache_experts_per_layer": 8, "policy": "ar", "live_tokens_per_s": 1.0}]
    ).to_csv(val / "fidelity.csv", index=False)
    data = collect([val])
    # the fixture's dense trace is synthetic (generated): its label says so
    assert [label for label, _, _ in data.dense] == ["val1/dense (synthetic)"]
    assert data.throughput["config"].tolist() == [
        f"validate val1: expert {SHAPE.bytes_per_expert / 1e6:.4g} MB"
    ]


def _capture(monkeypatch) -> list:
    figs: list = []

    def save(fig, path):
        fig.canvas.draw()
        figs.append(fig)
        return path

    monkeypatch.setattr(figures, "_save", save)
    return figs


def _legend_outside(ax) -> bool:
    leg = ax.get_legend()
    return leg.get_window_extent().x0 >= ax.get_window_extent().x1


def test_legends_do_not_cover_data(tmp_path, monkeypatch) -> None:
    figs = _capture(monkeypatch)
    split = pd.DataFrame(
        {
            "label": ["a", "b"],
            "draft_s": [1.0, 0.0],
            "verify_s": [1.0, 0.0],
            "h2d_s": [1.0, 0.0],
            "other_s": [1.0, 4.0],
        }
    )
    figures.time_split(split, tmp_path / "t.png")
    tp = pd.DataFrame(
        {
            "label": "x",
            "source": "sim",
            "config": ["c1", "c1", "c2", "c2"],
            "bandwidth_gb_per_s": [2.0, 32.0, 2.0, 32.0],
            "cache_experts_per_layer": 4,
            "policy": "ar",
            "tokens_per_s": [1.0, 2.0, 3.0, 4.0],
        }
    )
    figures.throughput_vs_bandwidth(tp, tmp_path / "tp.png")
    assert _legend_outside(figs[0].axes[0])
    panels = [ax for ax in figs[1].axes if ax.get_legend() is not None]
    assert len(panels) == 2 and all(_legend_outside(ax) for ax in panels)  # one row per configuration
    assert "c1" in panels[0].get_title() and "c2" in panels[1].get_title()
    errors = pd.DataFrame({"policy": ["ar"] * 5, "cycle_error_pct": [-3.0, -1.0, 0.0, 1.0, 4.0]})
    figures.cycle_error_distribution(errors, tmp_path / "e.png")
    texts = [t.get_text() for t in figs[2].axes[0].get_legend().get_texts()]
    assert sorted(texts) == ["+/- 3 % (median aim)", "+/- 8 % (p90 aim)", "ar"]  # fidelity.Targets' aims


def test_throughput_band_and_caption_follow_the_throughput_aim(tmp_path, monkeypatch) -> None:
    """sim_vs_live_throughput's grey band and its report caption are +/- Targets.throughput_pct
    (they were a hard-coded 2 %): with the aim set to 5 %, both say 5 % and the band spans 0.95-1.05x."""
    import functools

    from analysis import fidelity

    monkeypatch.setattr(fidelity, "Targets", functools.partial(fidelity.Targets, throughput_pct=5.0))
    figs = _capture(monkeypatch)
    table = pd.DataFrame({"policy": ["ar", "ar"], "live_tokens_per_s": [10.0, 20.0], "sim_tokens_per_s": [11.0, 19.0]})
    figures.sim_vs_live_throughput(table, tmp_path / "s.png")
    ax = figs[0].axes[0]
    assert "+/- 5 % (aim)" in [t.get_text() for t in ax.get_legend().get_texts()]
    (band,) = ax.collections[1:]  # after the scatter: the fill
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(10.0 * 0.95) and max(ys) == pytest.approx(20.0 * 1.05)
    assert "+/- the throughput aim, 5 %" in report_cli.validate_captions()["sim_vs_live_throughput"]


def _split_rows() -> pd.DataFrame:
    """39 time-split rows like a sweep of 3 policies x 4 bandwidths x 3 caches plus 3 live runs."""
    sim = [
        f"sim s: {p} {b}GB/s c{c}"
        for b in (2, 8, 16, 64)
        for c in (4, 8, 16)
        for p in ("ar", "topn", "specfit")
    ]
    labels = ["live a", "live b", "live a", *sim]  # two live runs share a label: drawn apart all the same
    n = len(labels)
    return pd.DataFrame(
        {
            "label": labels,
            "draft_s": [1.0] * n,
            "verify_s": [2.0] * n,
            "h2d_s": [3.0] * n,
            "other_s": [0.5] * n,
        }
    )


def test_time_split_draws_every_row(tmp_path, monkeypatch) -> None:
    figs = _capture(monkeypatch)
    split = _split_rows()
    assert len(split) == 39
    figures.time_split(split, tmp_path / "t.png")
    ax = figs[0].axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 39 and "sim s: specfit 64GB/s c16" in labels  # the cells past the old 24-bar cap
    assert labels[:3] == ["live a", "live b", "live a"]  # measured rows first
    assert len({round(p.get_y(), 3) for p in ax.patches}) == 39  # one bar position per row
    assert "first" not in ax.get_title() and "39 rows" in ax.get_title()
    assert report_cli.time_split_left_out_lines(split) == []


def test_time_split_past_the_bar_limit_names_what_is_left_out(tmp_path, monkeypatch) -> None:
    figs = _capture(monkeypatch)
    monkeypatch.setattr(figures, "MAX_TIME_SPLIT_BARS", 30)
    split = _split_rows()
    figures.time_split(split, tmp_path / "t.png")
    assert "first 30 of 39 rows" in figs[0].axes[0].get_title()
    (line,) = report_cli.time_split_left_out_lines(split)
    assert line.startswith("Not drawn in the time split (9 of 39 rows, over the 30-bar limit")
    assert line.count("; ") == 8 and "sim s: specfit 64GB/s c16" in line and "sim s: ar 2GB/s c4" not in line


def test_recorded_runs_list_a_dense_run_with_cycles(tmp_path) -> None:
    from analysis.inputs import collect

    sample = Path(__file__).resolve().parents[1] / "traces" / "samples" / "default"
    data = collect([sample])
    ((label, summary),) = data.run_summaries
    assert label == "default" and summary["mode"] == "dense"
    assert (summary["num_requests"], summary["num_trees"], summary["num_cycles"]) == (24, 1152, 1152)
    assert data.throughput.empty  # listed, but dense cycles stay off the regime map
    data.dense = []  # the table is the point here: skip drawing the dense figures
    report, _ = report_cli.write_report(data, tmp_path / "r", "t")
    assert "| default | dense | 24 | 1152 | 1152 |" in report.read_text()


def test_out_blocked_by_a_file_exits_2_before_any_work(inputs, tmp_path, capsys, monkeypatch) -> None:
    def no_work(paths):
        raise AssertionError("inputs were read before --out was checked")

    monkeypatch.setattr(report_cli, "collect", no_work)
    (tmp_path / "blocker").write_text("")
    with pytest.raises(SystemExit) as exc:
        report_cli.main([str(inputs["dense"]), "--out", str(tmp_path / "blocker" / "report")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--out" in err and "is a file, not a folder" in err
    assert "Traceback" not in err


def test_stdout_says_what_was_written_and_what_is_missing(inputs, tmp_path, capsys) -> None:
    capsys.readouterr()
    out = tmp_path / "r"
    assert report_cli.main([str(inputs["dense"]), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    text = "\n".join(lines[:-1])
    assert lines[0] == f"report: {out / 'report.md'} (1 inputs, 1 trace runs listed)"
    assert f"figures written (2 of 6) in {out / 'figures'}:" in text
    assert f"  {out / 'figures' / 'acceptance_per_depth.png'}" in lines
    assert "figures missing (4):" in text
    assert "  time_split: no time split: needs a sim.sweep folder" in text
    assert summary["missing_figures"] == [
        "throughput_vs_bandwidth",
        "predicted_vs_measured",
        "hit_rate_vs_cache",
        "time_split",
    ]
    assert summary["missing_reasons"]["time_split"].startswith("no time split")
    report_md = (out / "report.md").read_text()
    assert "- time_split: not drawn (no time split: needs" in report_md  # the report says why too


def _validate_dir(root: Path, policy_run: Path, with_json: bool = True) -> Path:
    """A small analysis.validate folder: fidelity.csv (2 cells, 2 repeats), cycle_errors.csv,
    fidelity.json, its two fidelity figures and one live run (with planner predictions)."""
    import shutil

    val = root / "val"
    shutil.copytree(policy_run, val / "live" / "bw1-c8-topn" / "r1")
    rows = []
    for policy, tp_err in (("ar", 0.5), ("topn", 3.0)):
        rows.append(
            {
                "bandwidth_gb_per_s": 1.0, "cache_experts_per_layer": 8, "policy": policy,
                "live_tokens_per_s": 100.0, "sim_tokens_per_s": 100.0 + tp_err,
                "throughput_error_pct": tp_err, "live_hit_rate": 0.5, "sim_hit_rate": 0.5,
                "hit_rate_diff_points": 0.0, "same_subtree_fraction": 1.0,
                "cycle_error_median_pct": 1.5, "cycle_error_p90_pct": 4.0,
                "planner_error_median_pct": np.nan if policy == "ar" else 7.25,
                "num_repeats": 2, "live_repeat_spread_pct": 4.5,
                "cycle_noise_median_pct": 2.25, "cycle_noise_p90_pct": 6.75,
                "ok": policy == "ar", "within_noise": True,
                "off_terms": "" if policy == "ar" else "throughput",
            }
        )  # fmt: skip
    table = pd.DataFrame(rows)
    table.to_csv(val / "fidelity.csv", index=False)
    rng = np.random.default_rng(0)
    measured = rng.uniform(5e-3, 20e-3, 40)
    errors = pd.DataFrame(
        {
            "bandwidth_gb_per_s": 1.0,
            "cache_experts_per_layer": 8,
            "policy": ["ar"] * 20 + ["topn"] * 20,
            "request_id": 0,
            "cycle_index": list(range(20)) * 2,
            "measured_cycle_s": measured,
            "predicted_cycle_s": measured * rng.uniform(0.97, 1.03, 40),
            "cycle_noise_pct": np.linspace(1.0, 10.0, 40),
        }
    )
    errors["cycle_error_pct"] = 100 * (errors["predicted_cycle_s"] / errors["measured_cycle_s"] - 1)
    errors.to_csv(val / "cycle_errors.csv", index=False)
    if with_json:
        summary = {
            "repeats": 2,
            "median_live_repeat_spread_pct": 4.5,
            "max_live_repeat_spread_pct": 4.5,
            "noise_cycle_median_pct": 3.25,
            "noise_cycle_p90_pct": 8.5,
            "cycle_error_bias_rms_pct": 2.5,
            "cycle_error_cell_offset_rms_pct": 1.5,
            "noise_run_speed_fraction": 0.4,
            "repeats_for_aim_median": 7,
        }
        (val / "fidelity.json").write_text(json.dumps(summary))
    figures.sim_vs_live_throughput(table, val / "figures" / "sim_vs_live_throughput.png")
    figures.cycle_error_distribution(errors, val / "figures" / "cycle_error_distribution.png")
    return val


def _legend_below(ax) -> bool:
    return ax.get_legend().get_window_extent().y1 <= ax.get_window_extent().y0


def test_validate_folder_plots_the_calibrated_model_not_the_planner(inputs, tmp_path, monkeypatch) -> None:
    """predicted_vs_measured of a validate folder draws cycle_errors.csv (the calibrated model
    validate reports), one series per policy, legend off the axes; not its runs' planner series."""
    from analysis.inputs import collect

    assert open_run(inputs["policy"]).cycles["predicted_cycle_s"].notna().any()  # a planner was logged
    val = _validate_dir(tmp_path, inputs["policy"])
    scatter = collect([val]).cycle_scatter
    assert sorted(scatter["label"].unique()) == ["val calibrated: ar", "val calibrated: topn"]
    errors = pd.read_csv(val / "cycle_errors.csv")
    mine = scatter[scatter["label"] == "val calibrated: topn"]
    assert mine["predicted_s"].tolist() == pytest.approx(errors["predicted_cycle_s"][20:].tolist())
    assert mine["measured_s"].tolist() == pytest.approx(errors["measured_cycle_s"][20:].tolist())
    # a plain policy run keeps its planner series
    assert collect([inputs["policy"]]).cycle_scatter["label"].unique().tolist() == ["policy (planner)"]
    figs = _capture(monkeypatch)
    figures.predicted_vs_measured(scatter, tmp_path / "pm.png")
    ax = figs[0].axes[0]
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("val calibrated: ar: median") for t in texts)
    assert _legend_below(ax) or _legend_outside(ax)  # never over the points


def test_report_of_a_validate_folder_has_its_fidelity_section(inputs, tmp_path, capsys) -> None:
    from analysis import fidelity
    from analysis.validate import bias_line, noise_line, targets_line

    val = _validate_dir(tmp_path, inputs["policy"])
    out = tmp_path / "report"
    assert report_cli.main([str(val), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    text = (out / "report.md").read_text()
    section = text[text.index("## Fidelity (analysis.validate)") : text.index("## Figures")]
    assert targets_line(summary=json.loads((val / "fidelity.json").read_text())) in section
    assert noise_line(json.loads((val / "fidelity.json").read_text()), 2) in section
    bias = bias_line(json.loads((val / "fidelity.json").read_text()), 2)  # where the per-cycle error lives
    assert f"- {bias}" in section and "2.5 % rms" in bias and "40 %" in bias and "from 7 / n/a" in bias
    assert "median 3.25 %" in section and "p90 8.5 %" in section  # from fidelity.json
    header = next(line for line in section.splitlines() if line.startswith("| cell |"))
    for short in ("tput_err%", "spread%", "err_med%", "err_p90%", "noise_med%", "noise_p90%"):
        assert f"| {short} |" in header
    assert header.endswith("| within_noise | ok | off_terms |")
    assert (
        "| bw1-c8-topn | 3 | 4.5 | 1.5 | 4 | 2.25 | 6.75 | 0 | 1 | 7.25 | True | False | throughput |"
        in section
    )
    assert "noise_p90% = cycle_noise_p90_pct" in section
    for name in ("sim_vs_live_throughput", "cycle_error_distribution"):
        copy = out / "figures" / f"val-{name}.png"
        assert copy.read_bytes() == (val / "figures" / f"{name}.png").read_bytes()
        assert f"](figures/val-{name}.png)" in section
        assert str(copy) in summary["validate_figures"]
    assert "## Simulator vs live fidelity" not in text  # the 29-column dump is gone
    # without fidelity.json the noise line is recomputed from fidelity.csv and cycle_errors.csv
    (val / "fidelity.json").unlink()
    assert report_cli.main([str(val), "--out", str(tmp_path / "r2")]) == 0
    text = (tmp_path / "r2" / "report.md").read_text()
    errors = pd.read_csv(val / "cycle_errors.csv")
    expected = fidelity.overall(
        pd.read_csv(val / "fidelity.csv").to_dict("records"),
        [g["cycle_error_pct"].to_numpy() for _, g in errors.groupby("policy")],
        [g["cycle_noise_pct"].to_numpy() for _, g in errors.groupby("policy")],
    )
    line = noise_line(expected, 2)
    assert line.startswith("noise floor (2 repeats per cell)") and f"- {line}" in text
    assert f"p90 {np.percentile(errors['cycle_noise_pct'], 90):.3g} %" in line


def test_recomputed_summary_keeps_overlap_and_prefetch_cells_apart(tmp_path) -> None:
    """Without fidelity.json, the summary is recomputed from cycle_errors.csv with the cycles grouped
    per full cell key (two cells that differ only in overlap or prefetch keep their own offsets; they
    were pooled by bandwidth, cache and policy) and, as validate writes it, with where the per-cycle
    error lives (cycle_noise_summary; it was missing, so the report had no bias line)."""
    from analysis import fidelity
    from analysis.inputs import _validate_summary
    from analysis.validate import cycle_noise_summary

    rng = np.random.default_rng(0)
    cells = [("off", "none", 6.0), ("on", "none", -6.0), ("off", "draft", 2.0)]
    errors = pd.concat(
        [
            pd.DataFrame(
                {
                    "bandwidth_gb_per_s": 8.0,
                    "cache_experts_per_layer": 4,
                    "policy": "specfit",
                    "overlap": overlap,
                    "prefetch": prefetch,
                    "cycle_error_pct": offset + rng.normal(0.0, 1.0, 20),
                    "cycle_noise_pct": rng.uniform(0.0, 2.0, 20),
                }
            )
            for overlap, prefetch, offset in cells
        ]
    )
    table = pd.DataFrame({"num_repeats": [2, 2, 2]})
    got = _validate_summary(tmp_path, table, errors)
    want = cycle_noise_summary([g for _, g in errors.groupby(list(fidelity.CELL_KEY), sort=False)], 2)
    pooled = cycle_noise_summary([g for _, g in errors.groupby(list(fidelity.CELL_KEY[:3]))], 2)
    name = "cycle_error_cell_offset_rms_pct"
    assert got[name] == pytest.approx(want[name]) and want[name] > 4.0 > pooled[name]
    assert got["cycle_error_bias_rms_pct"] == pytest.approx(want["cycle_error_bias_rms_pct"]) and got["repeats"] == 2
    # an older file without the overlap and prefetch columns is still read, as one cell
    old = _validate_summary(tmp_path, table, errors.drop(columns=["overlap", "prefetch"]))
    assert old[name] == pytest.approx(pooled[name])


def test_regime_map_says_which_source_is_slower(tmp_path, monkeypatch) -> None:
    """Full-tree-slower bands are styled per source and named in the legend: sim at 2 GB/s only,
    live at 32 GB/s only."""
    rows = []
    for source, slow_bw in (("sim", 2.0), ("live", 32.0)):
        for bw in (2.0, 32.0):
            rows.append({"source": source, "bandwidth_gb_per_s": bw, "policy": "ar", "tokens_per_s": 10.0})
            topn = 5.0 if bw == slow_bw else 20.0
            rows.append({"source": source, "bandwidth_gb_per_s": bw, "policy": "topn", "tokens_per_s": topn})
    tp = pd.DataFrame(rows).assign(label="x", config="c", cache_experts_per_layer=4)
    figs = _capture(monkeypatch)
    figures.throughput_vs_bandwidth(tp, tmp_path / "tp.png")
    ax = next(a for a in figs[0].axes if a.get_legend() is not None)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "full tree slower than AR (simulated)" in texts and "full tree slower than AR (measured live)" in texts
    bands = {}
    for patch in ax.patches:
        x0 = patch.get_path().vertices[:, 0].min()
        x = patch.get_transform().transform([[x0, 0]])[0, 0]
        data_x = ax.transData.inverted().transform([[x, 0]])[0, 0]
        bands[round(data_x * 1.15, 3)] = patch.get_hatch()
    assert bands == {
        2.0: figures.SLOW_BAND_STYLES["sim"]["hatch"],
        32.0: figures.SLOW_BAND_STYLES["live"]["hatch"],
    }
    assert figures.SLOW_BAND_STYLES["sim"]["hatch"] != figures.SLOW_BAND_STYLES["live"]["hatch"]
    assert "every bandwidth" not in ax.get_title()  # hatched: the bands distinguish bandwidths


def test_sweep_regret_decomposition_is_reported(tmp_path) -> None:
    from analysis.inputs import collect
    from sim.report import REGRET_COLUMNS, results_frame

    base = {"bandwidth_gb_per_s": 16.0, "cache_experts_per_layer": 8, "cache_policy": "lru"}
    base |= {"predictor": "union-size", "overlap": False, "prefetch": False}
    speeds = {"ar": 100.0, "topn": 80.0, "specfit": 90.0, "specfit-oracle-accept": 95.0}
    speeds |= {"specfit-oracle-experts": 92.0, "specfit-oracle": 110.0}
    rows = results_frame([{**base, "policy": p, "tokens_per_s": v} for p, v in speeds.items()])
    spec = rows[rows["policy"] == "specfit"].iloc[0]
    assert spec["specfit_below_baseline"] and spec["best_in_hindsight_tokens_per_s"] == 110.0
    assert spec["regret_acceptance"] == pytest.approx(5 / 110) and spec["regret_myopic"] == 0.0
    data = collect([_sweep_dir(tmp_path, "s", rows.to_dict("records"))])
    assert len(data.regret) == 1 and set(REGRET_COLUMNS) <= set(data.regret.columns)
    out = tmp_path / "report"
    report_cli.write_report(data, out, "t")
    assert "## Decision regret of SpecFit (simulated)" in (out / "report.md").read_text()


def test_time_split_labels_name_the_prefetch_mode():
    import pandas as pd

    from analysis.inputs import _flags

    df = pd.DataFrame({"overlap": ["on", "off", True], "prefetch": ["none", "next-layer", True]})
    assert _flags(df) == [" overlap", " prefetch next-layer", " overlap prefetch"]  # bools: older sweeps


def test_cell_names_tell_overlap_prefetch_and_depth_cells_apart() -> None:
    """rev2: ``cell_names`` named cells by bandwidth, cache and policy only, so the overlap-on and
    prefetch cells of one (bandwidth, cache, policy) printed the same name in the report's table.
    Now ``analysis.validate.Cell.name``; tables without the newer columns (or empty cells in them)
    keep the old names."""
    table = pd.DataFrame(
        {
            "bandwidth_gb_per_s": [1.0, 1.0, 1.0, 8.0],
            "cache_experts_per_layer": [16, 16, 16, 4],
            "policy": ["ar", "ar", "ar", "specfit"],
            "overlap": ["off", "on", "off", None],
            "prefetch": ["none", "none", "next-layer", "both"],
        }
    )
    names = report_cli.cell_names(table)
    assert names == ["bw1-c16-ar", "bw1-c16-ar-ovl", "bw1-c16-ar-pf-next-layer", "bw8-c4-specfit-pf-both"]
    old = table.drop(columns=["overlap", "prefetch"])
    assert report_cli.cell_names(old) == ["bw1-c16-ar", "bw1-c16-ar", "bw1-c16-ar", "bw8-c4-specfit"]
    with_depth = old.assign(depth=[1, None, None, None], cache_experts_per_layer=[16.0, 16.0, 16.0, 4.0])
    assert report_cli.cell_names(with_depth)[:2] == ["bw1-c16-ar-d1", "bw1-c16-ar"]


def test_cell_names_read_an_empty_bandwidth_or_cache_as_nan() -> None:
    """rev3: an empty bandwidth or cache cell in a (hand-edited) fidelity.csv crashed the report
    with a TypeError (``float(None)``); it names the cell with ``nan``, as before the overlap columns."""
    table = pd.DataFrame(
        {"bandwidth_gb_per_s": [1.0, np.nan], "cache_experts_per_layer": [16, np.nan], "policy": ["ar", "ar"]}
    )
    assert report_cli.cell_names(table) == ["bw1-c16-ar", "bwnan-cnan-ar"]
