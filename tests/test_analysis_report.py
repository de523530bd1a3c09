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
    assert "| policy | 40 |" in text  # the recorded run's summary row
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
    assert report_cli.main([str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 1
    assert "no manifest.json" in capsys.readouterr().err


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
        "sim ar 16GB/s c8",
        "sim topn 16GB/s c8",
        "sim ar 16GB/s c8 overlap",
        "sim topn 16GB/s c8 overlap",
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
    assert summary["tokens_per_s"] == pytest.approx(123 / decode_s) and summary["wall_s"] == decode_s
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
    assert [label for label, _, _ in data.dense] == ["val1/dense"]
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
    assert sorted(texts) == ["+/- 2 % target", "+/- 5 % target", "ar"]
