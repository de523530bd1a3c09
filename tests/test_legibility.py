"""Legibility (issue 15 item 5): sim.sweep's output folder line, table legend and units, figure
titles (what was replayed, how priced, simulated vs measured), paired styles (colour = policy,
line style = overlap/prefetch), and the sweep figure's title."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sim.report import (
    OVERLAP_PREFETCH_STYLES,
    POLICY_COLORS,
    TABLE_COLUMNS,
    TABLE_LEGEND,
    format_table,
    results_frame,
    throughput_figure,
)


def _rows(overlaps=(False,), prefetches=(False,)) -> list[dict]:
    rows = []
    for overlap in overlaps:
        for prefetch in prefetches:
            for bw in (16.0, 64.0):
                for policy, tps in (("ar", 50.0), ("topn", 40.0), ("specfit", 60.0)):
                    rows.append(
                        {
                            "cell_id": f"{policy}-{bw}-{overlap}-{prefetch}",
                            "bandwidth_gb_per_s": bw,
                            "cache_experts_per_layer": 16,
                            "cache_fraction": 0.25,
                            "cache_policy": "lru",
                            "predictor": "union-size",
                            "overlap": overlap,
                            "prefetch": prefetch,
                            "policy": policy,
                            "tokens_per_s": tps * bw / 16 * (1.2 if overlap else 1.0),
                            "tau": 2.0,
                            "mean_draft_levels": 3.0,
                            "mean_nodes_verified": 4.0,
                            "hit_rate": 0.5,
                            "h2d_gb": 1.0,
                        }
                    )
    return rows


def test_table_headers_carry_units_and_a_legend_explains_every_column():
    df = results_frame(_rows(overlaps=(False, True)))
    table = format_table(df, header=["trace: t"])
    lines = table.splitlines()
    titles = lines[1]
    for header in (
        "cache exp/layer",
        "cache frac",
        "GB/s",
        "sim tok/s",
        "levels",
        "|S|",
        "hit",
        "x AR",
        "x top-N",
    ):
        assert header in titles
    assert "overlap" in titles  # varied key column shown, and explained
    legend = lines[lines.index("Legend:") + 1 :]
    explained = {line.split("  ")[1].strip() for line in legend if line.startswith("  ")}
    shown = [title for _, title, _ in TABLE_COLUMNS] + ["overlap"]
    assert set(shown) <= explained
    text = "\n".join(legend)
    assert "experts per MoE layer" in text and "fraction of the experts per layer" in text
    assert "SIMULATED" in text and "bonus token" in text and "hits / (hits + misses)" in text
    assert "1 GB = 1e9 bytes" in text
    # overlap shown as on/off, as the legend says
    assert {row.split()[2] for row in lines[3:15]} == {"off", "on"}


def test_legend_explains_the_bang_only_when_a_row_has_it():
    df = results_frame(_rows())
    assert "  !  " not in format_table(df)
    df.loc[df["policy"] == "specfit", "tokens_per_s"] = 1.0
    table = format_table(
        results_frame(
            df.drop(columns=["speedup_vs_ar", "speedup_vs_topn", "specfit_below_baseline"]).to_dict("records")
        )
    )
    assert any(line.startswith("  !") for line in table.splitlines())
    assert table.splitlines()[-1].startswith("! = SpecFit below")
    assert set(TABLE_LEGEND) >= {"!", "cache_policy", "predictor", "overlap", "prefetch"}


def test_paired_styles_colour_is_policy_line_style_is_overlap_prefetch():
    df = results_frame(_rows(overlaps=(False, True), prefetches=(False, True)))
    fig = throughput_figure(df, "SIMULATED tokens/s\nreplayed: x")
    try:
        ax = fig.axes[0]
        from matplotlib.colors import to_hex

        drawn = [(to_hex(line.get_color()), line.get_linestyle()) for line in ax.lines]
        assert len(drawn) == 3 * 4  # 3 policies x (overlap, prefetch) pairs
        assert {c for c, _ in drawn} == {to_hex(POLICY_COLORS[p]) for p in ("ar", "topn", "specfit")}
        pairs = [("off", "none"), ("on", "none"), ("off", "draft"), ("on", "draft")]
        styles = sorted(str(OVERLAP_PREFETCH_STYLES[pair]) for pair in pairs)
        assert len(set(styles)) == 4
        for colour in {c for c, _ in drawn}:  # every policy drawn once in each style
            assert sorted(str(s) for c, s in drawn if c == colour) == styles
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert labels[:3] == ["ar", "topn", "specfit"]
        assert "overlap on, prefetch none" in labels and "overlap off, prefetch draft" in labels
        assert fig._suptitle.get_text().startswith("SIMULATED tokens/s")
        assert ax.get_ylabel() == "SIMULATED tokens/s"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_sweep_prints_its_folder_and_titles_the_figure(tmp_path, capsys, monkeypatch):
    from sim import sweep

    titles = []
    real = sweep.plot_throughput
    monkeypatch.setattr(
        sweep, "plot_throughput", lambda df, path, title="": titles.append(title) or real(df, path, title)
    )
    out = tmp_path / "sw"
    argv = ["--max-requests", "1", "--max-positions", "4", "--cache", "0.25", "--bandwidth", "16,64",
            "--policy", "ar,specfit", "--out", str(out), "--jobs", "1", "--no-progress"]  # fmt: skip
    assert sweep.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith(f"sweep folder: {out}") and "results.csv" in lines[-2]
    assert json.loads(lines[-1])["out"] == str(out)
    assert "Legend:" in lines
    (title,) = titles
    assert title.startswith("SIMULATED tokens/s") and "not measured" in title
    assert "replayed: shipped sample trace" in title
    assert "9,437,184 B per expert (qwen3-30b-a3b size)" in title
    assert "compute preset qwen3-30b-a3b-2gpu: draft" in title and "us/node" in title
    assert "link 16, 64 GB/s" in title and "us/transfer" in title
    assert (out / "throughput_vs_bandwidth.png").stat().st_size > 1000


# ---------------------------------------------------------------- analysis.report figures


def _capture(monkeypatch) -> list:
    from analysis import figures

    figs: list = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: figs.append(fig) or path)
    return figs


def _regime_rows(slow_everywhere: bool) -> pd.DataFrame:
    rows = []
    for bw in (2.0, 8.0, 32.0):
        topn = 5.0 if slow_everywhere or bw == 2.0 else 20.0
        rows += [{"bandwidth_gb_per_s": bw, "policy": "ar", "tokens_per_s": 10.0}]
        rows += [{"bandwidth_gb_per_s": bw, "policy": "topn", "tokens_per_s": topn}]
    return pd.DataFrame(rows).assign(label="x", config="c", cache_experts_per_layer=4, source="sim")


def test_regime_map_hatches_only_where_it_distinguishes(tmp_path, monkeypatch):
    from analysis import figures

    figs = _capture(monkeypatch)
    figures.throughput_vs_bandwidth(_regime_rows(slow_everywhere=True), tmp_path / "a.png")
    ax = figs[0].axes[0]
    assert not ax.patches  # slower at every bandwidth: a band everywhere would say nothing
    assert "full tree slower than AR at every bandwidth (SIMULATED)" in ax.get_title()
    assert "MEASURED" in figs[0]._suptitle.get_text() and "SIMULATED" in figs[0]._suptitle.get_text()
    figures.throughput_vs_bandwidth(_regime_rows(slow_everywhere=False), tmp_path / "b.png")
    ax = figs[1].axes[0]
    assert len(ax.patches) == 1 and "every bandwidth" not in ax.get_title()
    assert figures.informative_bands([2.0, 8.0], [2.0, 8.0, 32.0]) == [2.0, 8.0]
    assert figures.informative_bands([2.0, 8.0, 32.0], [2.0, 8.0, 32.0]) == []


def test_hit_rate_figure_has_one_panel_per_bandwidth(tmp_path, monkeypatch):
    from analysis import figures

    rows = [
        {"label": "r", "source": source, "bandwidth_gb_per_s": bw, "cache_experts_per_layer": c,
         "policy": "ar", "hit_rate": 0.1 * c / bw}
        for source in ("sim", "live") for bw in (1.0, 8.0) for c in (4, 8)
    ] + [{"label": "old", "source": "live", "bandwidth_gb_per_s": None, "cache_experts_per_layer": 4,
          "policy": "ar", "hit_rate": 0.5}]  # fmt: skip
    figs = _capture(monkeypatch)
    figures.hit_rate_vs_cache(pd.DataFrame(rows), tmp_path / "h.png")
    titles = [ax.get_title() for ax in figs[0].axes if ax.get_title()]
    assert titles == ["H2D bandwidth 1 GB/s", "H2D bandwidth 8 GB/s", "bandwidth unknown"]
    first = figs[0].axes[0]
    assert [line.get_label() for line in first.lines] == ["ar (MEASURED live)", "ar (SIMULATED)"]
    assert [list(line.get_ydata()) for line in first.lines] == [[40.0, 80.0], [40.0, 80.0]]
    assert "one panel per bandwidth" in figs[0]._suptitle.get_text()


def test_every_report_figure_title_says_measured_or_simulated(tmp_path, monkeypatch):
    """Each figure of analysis.figures names where its numbers come from."""
    from analysis import figures

    figs = _capture(monkeypatch)
    figures.predicted_vs_measured(
        pd.DataFrame(
            {"label": ["a"] * 3, "predicted_s": [1e-3, 2e-3, 3e-3], "measured_s": [1e-3, 2e-3, 4e-3]}
        ),
        tmp_path / "p.png",
    )
    figures.time_split(
        pd.DataFrame([{"label": "live r", "draft_s": 1.0, "verify_s": 1.0, "h2d_s": 1.0, "other_s": 0.0}]),
        tmp_path / "t.png",
    )
    figures.sim_vs_live_throughput(
        pd.DataFrame({"policy": ["ar"], "live_tokens_per_s": [1.0], "sim_tokens_per_s": [1.1]}),
        tmp_path / "s.png",
    )
    figures.cycle_error_distribution(
        pd.DataFrame({"policy": ["ar"] * 4, "cycle_error_pct": [1.0, -2.0, 3.0, 0.5]}), tmp_path / "c.png"
    )
    assert len(figs) == 4  # one per figure function above: the loop below checks them all
    for fig in figs:
        title = " ".join(ax.get_title() for ax in fig.axes)
        assert "MEASURED" in title, title


# ---------------------------------------------------------------- --help choices, --no-progress


def _help(module: str, capsys, collapse: bool = True) -> str:
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    return " ".join(text.split()) if collapse else text


def _flag_help(text: str, flag: str) -> str:
    """The help entry of ``flag`` in argparse's ``--help`` output (whitespace collapsed)."""
    lines = text[text.index("options:") :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {flag} "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -")), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def _choices():
    from analysis.validate import GRID_POLICIES
    from live.spec.names import CACHE_POLICIES as LIVE_CACHE_POLICIES
    from live.spec.names import LIVE_POLICIES, LIVE_PREDICTORS
    from sim.config import POLICY_ALIASES
    from specfit.cache import CACHE_POLICIES
    from specfit.predictors import PREDICTORS
    from specfit.shapes import MODEL_SHAPES

    return [
        ("sim.sweep", "--policy", sorted(POLICY_ALIASES)),
        ("sim.sweep", "--cache-policy", CACHE_POLICIES),
        ("sim.sweep", "--predictor", PREDICTORS),
        ("sim.sweep", "--model-shape", list(MODEL_SHAPES)),
        ("live.record", "--policy", LIVE_POLICIES),
        ("live.record", "--cache-policy", LIVE_CACHE_POLICIES),
        ("live.record", "--predictor", LIVE_PREDICTORS),
        ("analysis.validate", "--policy", GRID_POLICIES),
    ]


@pytest.mark.parametrize(("module", "flag", "names"), _choices())
def test_help_lists_and_explains_every_choice(module, flag, names, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag: no names broken at a hyphen
    text = _flag_help(_help(module, capsys, collapse=False), flag)
    for name in names:
        assert name in text, f"{module} {flag}: {name!r} not in its help"
    if flag != "--model-shape":  # model names speak for themselves
        assert " = " in text  # the choices are explained, not only listed


def test_undocumented_eagle_alias_is_gone(capsys):
    from sim.config import canonical_policy
    from sim.sweep import main

    with pytest.raises(ValueError, match="expected one of"):
        canonical_policy("eagle")
    with pytest.raises(SystemExit) as exc:
        main(["--policy", "eagle"])
    assert exc.value.code == 2 and "--policy" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module",
    ["live.record", "analysis.validate", "analysis.report", "sim.sweep", "calibration.fit", "calibration.h2d",
     "traces.synthetic", "live.train_default", "live.train_eagle3"],
)  # fmt: skip
def test_long_running_clis_have_no_progress(module, capsys):
    assert "--no-progress" in _help(module, capsys)


def test_no_progress_silences_the_bars(tmp_path, capsys):
    from analysis.report import main as report_main
    from sim.sweep import main as sweep_main

    base = ["--max-requests", "1", "--max-positions", "4", "--cache", "0.25", "--bandwidth", "16",
            "--policy", "ar", "--jobs", "1", "--no-figures"]  # fmt: skip
    assert sweep_main([*base, "--out", str(tmp_path / "a")]) == 0
    assert "cells" in capsys.readouterr().err  # the bar shows by default
    assert sweep_main([*base, "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert report_main([str(tmp_path / "b"), "--out", str(tmp_path / "r1")]) == 0
    assert "figures" in capsys.readouterr().err
    assert report_main([str(tmp_path / "b"), "--out", str(tmp_path / "r2"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_h2d_figure_says_measured_and_pairs_fit_with_points(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from calibration import h2d

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    rows = [
        (kind, "cpu", size, r, size / bw + 1e-6, size / (size / bw + 1e-6))
        for kind, bw in (("memcpy", 1e10), ("emulated", 2e9))
        for size in (65536, 262144, 1048576)
        for r in range(2)
    ]
    table = pd.DataFrame(rows, columns=["kind", "link_kind", "bytes", "repeat", "h2d_s", "bytes_per_s"])
    h2d.plot(table, h2d.fit_table(table)["fits"], tmp_path / "h2d.png")
    (fig,) = closed
    ax = fig.axes[0]
    assert ax.get_title().startswith("MEASURED")
    points, fit = ax.lines[0], ax.lines[1]
    assert points.get_color() == fit.get_color()  # a kind's fit in its points' colour
