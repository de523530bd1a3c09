"""``python -m analysis.report RUN_OR_SWEEP_DIR ...``: Markdown report with PNG figures.

Inputs may mix trace runs (dense and policy mode), ``sim.sweep`` folders, ``calibration.fit``
folders and ``analysis.validate`` folders (:mod:`analysis.inputs`). Figures (:mod:`analysis.figures`):
throughput against bandwidth per policy (the regime map: where the full tree is slower than
autoregressive, and where SpecFit sits), per-cycle predicted vs measured, per-depth acceptance,
expert-union growth against tree size per layer, hit rate against cache size, and the draft /
compute / H2D time split. The metric conventions (docs/metrics.md) are stated in the report.

Writes ``report.md`` and ``figures/*.png`` under ``--out`` (default ``runs/report``; created
before any work, exit 2 naming ``--out`` when it cannot be); exit 0 on success, 2 for a bad flag
or an unreadable, corrupt or unrecognised input (one stderr line naming the file). Stdout: a few lines saying what was written (report path,
figures written, figures missing and why), then, as the last line, a JSON summary.

For an ``analysis.validate`` folder the report adds a "Fidelity (analysis.validate)" section: its
targets and noise-floor lines (:func:`analysis.validate.targets_line`,
:func:`analysis.validate.noise_line` from ``fidelity.json``, or recomputed from ``fidelity.csv`` /
``cycle_errors.csv``), a compact per-cell table and its two fidelity figures (copied to ``figures/<folder>-<name>.png``); the
per-cycle figure draws its calibrated cost model's predictions (``cycle_errors.csv``).
"""

from __future__ import annotations

import math
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from analysis import fidelity, figures
from analysis.inputs import VALIDATE_FIGURES, ReportData, ReportInputError, collect
from specfit.cli import ArgumentParser, cli_main, print_summary, run_main

CONVENTIONS = """\
## Metric conventions

- **tau** = mean tokens committed per verification cycle **including the bonus token**, over all
  cycles (rounds with 0, 2 and 3 accepted drafts give tau = 2.67).
- **Per-depth acceptance** is conditional: accepted at depth d / reached depth d.
- **Tokens per target forward** (every cycle, root-only ones included) and **tokens per draft
  round** (cycles that drafted only) are different figures and are labelled apart.
- **Throughput** = committed tokens / wall seconds of decoding (for a live run, its recorded
  decode wall time, `summary.json` `decode_s`, as `python -m live.record` prints it; runs without
  it fall back to the sum of cycle seconds, marked in the `throughput_basis` column).
- **Hit rate** = cache hits / (hits + misses); differences are in percentage points.
- **Errors** are 100 x (predicted - measured) / measured; medians and p90 are of the absolute value.
  Measured cycle times exclude the planner's own decision time.

Full definitions: docs/metrics.md.
"""

CAPTIONS = {
    "throughput_vs_bandwidth": "Throughput against H2D bandwidth per policy, one row of panels per "
    "configuration (listed above; never averaged across configurations), one panel per cache size "
    "(colour: policy; solid: SIMULATED, dashed: MEASURED live). "
    "Hatched bands: bandwidths where the full tree (top-N) is slower than autoregressive decoding, "
    "per source: red `//` in the simulated cells, blue `\\` in the live ones (cross-hatched: both); "
    "the legend names each. Where it holds at every bandwidth of a panel nothing is hatched and the "
    "panel title says so.",
    "predicted_vs_measured": "Per-cycle predicted against measured cycle time (log-log; the line is y = x). "
    "Series: `<run> (planner)` = the planner's own logged `predicted_cycle_s` of a policy-mode run; "
    "`<folder> (calibrated, <split>)` = a calibration folder's fitted cost model; `<folder> calibrated: "
    "<policy>` = a validate folder's calibrated cost model (`cycle_errors.csv`: per matched cycle, "
    "the mean over repeats, pooled over its bandwidths and cache sizes; per-cell errors in the "
    "fidelity table). For validate folders the planner's own predictions of their live runs are "
    "not drawn (their median error is the fidelity table's `planner_med%`).",
    "acceptance_per_depth": "Per-depth conditional acceptance of the full dense trees.",
    "expert_union_growth": "Distinct experts per layer against the number of verified nodes, each "
    "tree's nodes ranked by draft path probability as the planner's union-size table is fitted "
    "(thin: each layer; bold: mean; dashed: no expert sharing); where the run has an acceptance map "
    "(`acceptance.json`), the dash-dotted mean ranks them by calibrated acceptance, the order the "
    "SpecFit planner asks in.",
    "hit_rate_vs_cache": "Expert-cache hit rate against cache size, one panel per H2D bandwidth "
    "(solid: SIMULATED, dashed: MEASURED live).",
    "time_split": "Share of decode time in drafting, verify compute, H2D copies and the rest "
    "(`live ...` rows MEASURED, `sim ...` rows SIMULATED).",
}


# Why a figure is missing: the data it draws, and which inputs provide it.
MISSING_REASONS = {
    "throughput_vs_bandwidth": "no throughput at a known bandwidth: needs a sim.sweep folder, an "
    "analysis.validate folder or a policy-mode trace run recorded with an emulated link",
    "predicted_vs_measured": "no per-cycle prediction: needs an analysis.validate folder with "
    "cycle_errors.csv, a calibration.fit folder or a policy-mode trace run recorded with a planner "
    "(cycles.predicted_cycle_s)",
    "acceptance_per_depth": "no dense trees (nodes table): needs a dense-mode trace run",
    "expert_union_growth": "no dense trees (nodes table): needs a dense-mode trace run",
    "hit_rate_vs_cache": "no hit rates: needs a sim.sweep folder with hit_rate, a validate folder or a "
    "policy-mode trace run",
    "time_split": "no time split: needs a sim.sweep folder with draft_s/verify_s/h2d_s/decode_s or a "
    "policy-mode trace run",
}

# Leading columns of the "Recorded runs" table (the rest follow in metrics.cycle_summary order).
RUN_COLUMNS = ("run", "mode", "num_requests", "num_trees", "num_cycles")

# The per-cell table of the "Fidelity (analysis.validate)" section (short headers, see
# analysis.fidelity.SHORT_COLUMNS; fidelity.csv keeps every column under its full name).
FIDELITY_COLUMNS = (
    "cell",
    "throughput_error_pct",
    "live_repeat_spread_pct",
    "cycle_error_median_pct",
    "cycle_error_p90_pct",
    "cycle_noise_median_pct",
    "cycle_noise_p90_pct",
    "hit_rate_diff_points",
    "same_subtree_fraction",
    "planner_error_median_pct",
    "within_noise",
    "ok",
    "off_terms",
)


def build_parser() -> ArgumentParser:
    """The CLI's parser."""
    p = ArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "inputs", nargs="+", metavar="DIR", help="trace run, sweep, calibration or validate folders"
    )
    p.add_argument("--out", default="runs/report", help="output folder for report.md and figures/")
    p.add_argument("--title", default="SpecFit offloading report", help="report title")
    p.add_no_progress()
    return p


def _fmt(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return "-" if not np.isfinite(value) else f"{value:.4g}"
    return str(value)


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub Markdown table of ``df`` (floats to 4 significant digits, NaN as ``-``)."""
    if df.empty:
        return "_(no rows)_\n"
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "---|" * len(df.columns)
    rows = ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *rows]) + "\n"


def throughput_config_lines(throughput: pd.DataFrame) -> list[str]:
    """Markdown lines naming the throughput configurations the regime map shows (and any left out)."""
    shown = figures.throughput_configs(throughput)
    every = figures.throughput_configs(throughput, max_configs=len(throughput) + 1)
    if not every:
        return []
    lines = [
        "Throughput configurations shown (each its own row of panels; cells are averaged only "
        "within one configuration):\n"
    ]
    lines += [f"- {c or '(unnamed)'}" for c in shown]
    left = every[len(shown) :]
    if left:
        lines.append(f"- not drawn ({len(left)} more, panel limit): " + "; ".join(left))
    lines.append("")
    return lines


def time_split_left_out_lines(split: pd.DataFrame) -> list[str]:
    """Markdown lines naming the time-split rows the figure leaves out (none below its bar limit)."""
    _, left_out = figures.time_split_rows(split)
    if not len(left_out):
        return []
    return [
        f"Not drawn in the time split ({len(left_out)} of {len(split)} rows, over the "
        f"{figures.MAX_TIME_SPLIT_BARS}-bar limit of one readable figure, measured rows first): "
        + "; ".join(left_out["label"].astype(str))
        + "\n"
    ]


def cell_names(table: pd.DataFrame) -> list[str]:
    """Per fidelity row, the cell's name as ``analysis.validate`` names its ``live/`` folder
    (:attr:`analysis.validate.Cell.name`: ``bw1-c16-ar``, ``bw1-c16-ar-ovl``,
    ``bw1-c16-ar-pf-next-layer``), so cells differing only in overlap, prefetch or depth get
    different names (they printed the same name before). Tables written before the ``overlap``,
    ``prefetch`` (or ``depth``) columns, and empty cells in them, read as overlap off, no
    prefetch, the grid's depth; an empty bandwidth or cache reads ``nan`` (``bwnan-c16-ar``), as
    before the overlap columns, so a hand-edited table still gets its report."""
    from analysis.validate import Cell

    def column(name: str, default: Any) -> list[Any]:
        values = table[name].tolist() if name in table.columns else [default] * len(table)
        return [default if v is None or (isinstance(v, float) and np.isnan(v)) else v for v in values]

    rows = zip(
        column("bandwidth_gb_per_s", math.nan), column("cache_experts_per_layer", math.nan), column("policy", None),
        column("depth", None), column("overlap", "off"), column("prefetch", "none"),
    )  # fmt: skip
    return [
        Cell(float(bw), int(c) if float(c).is_integer() else c, str(p), None if d is None else int(d), str(o), str(pf)).name
        for bw, c, p, d, o, pf in rows
    ]


def fidelity_section(validations: list, out_dir: Path) -> tuple[list[str], list[Path]]:
    """Markdown lines of the "Fidelity (analysis.validate)" section (one block per validate folder:
    targets line, noise-floor line, where the per-cycle error lives (:func:`analysis.validate.bias_line`,
    when its ``fidelity.json`` has the figures), compact per-cell table, its two figures copied under
    ``out_dir/figures/<folder>-<name>.png``) and the copied figure paths.

    Args:
        validations: ``ReportData.validations``, one dict per ``analysis.validate`` output folder
            (``label``, ``path``, ``table`` (its fidelity.csv), ``summary``, ``repeats``, ``figures``).
        out_dir: the report folder (figures are copied under ``out_dir/figures``).

    Returns:
        ``(markdown lines, copied figure paths)``; both empty without validations.

    Raises:
        OSError: a figure cannot be copied.
    """
    from analysis.validate import bias_line, noise_line, targets_line

    if not validations:
        return [], []
    lines = ["## Fidelity (analysis.validate)\n"]
    copied: list[Path] = []
    level = "####" if len(validations) > 1 else "###"
    for v in validations:
        table = v["table"]
        if len(validations) > 1:
            lines.append(f"### {v['label']}\n")
        lines.append(f"- {targets_line(summary=v['summary'])}")
        lines.append(f"- {noise_line(v['summary'], v['repeats'])}")
        if v["repeats"] >= 2 and "cycle_error_bias_rms_pct" in v["summary"]:  # validate folders since this release
            lines.append(f"- {bias_line(v['summary'], v['repeats'])}")
        lines.append(
            f"- cells: {len(table)}; ok (every per-cell aim met): {_count(table, 'ok')}; within_noise (every "
            f"miss within the measured noise floor): {_count(table, 'within_noise')}\n"
        )
        if {"bandwidth_gb_per_s", "cache_experts_per_layer", "policy"} <= set(table.columns):
            table = table.assign(cell=cell_names(table))
        compact, legend = fidelity.short_table(table, FIDELITY_COLUMNS)
        lines.append(markdown_table(compact))
        lines.append(
            f"{legend}. `cell`: bandwidth (GB/s), cache (experts per layer) and policy, `-ovl` with "
            "overlap on and `-pf-<mode>` with a prefetch, as the validation names its `live/` folders. Errors and noise are absolute percentages except "
            "`tput_err%` and `hit_dpts` (signed, simulated minus live); every fidelity.csv column is "
            "defined in docs/metrics.md.\n"
        )
        for name in VALIDATE_FIGURES:
            src = v["figures"].get(name)
            if src is None:
                lines.append(f"- {name}: not in `{v['path']}/figures/` (not drawn by that validation).")
                continue
            dst = out_dir / "figures" / f"{v['label']}-{name}.png"
            if dst in copied:  # two validate folders of one name
                dst = dst.with_name(f"{v['label']}-{len(copied)}-{name}.png")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            copied.append(dst)
            lines.append(
                f"{level} {v['label']}: {name.replace('_', ' ')}\n\n![{name}](figures/{dst.name})\n\n"
                f"{validate_captions()[name]}\n"
            )
        lines.append("")
    return lines, copied


def _count(table: pd.DataFrame, column: str) -> str:
    if column not in table.columns:
        return "n/a"
    values = table[column].astype(str).str.lower().isin(("true", "1"))
    return f"{int(values.sum())} of {len(table)}"


def validate_captions() -> dict[str, str]:
    """The captions of validate's figures copied into the report; their aims are the default
    :class:`analysis.fidelity.Targets`', as :func:`analysis.figures.sim_vs_live_throughput` and
    :func:`analysis.figures.cycle_error_distribution` draw them."""
    t = fidelity.Targets()
    return {
        "sim_vs_live_throughput": "Simulated against live throughput per cell (live pooled over the "
        f"repeats; grey band: +/- the throughput aim, {t.throughput_pct:g} %, as figures.sim_vs_live_throughput "
        "draws it). Copied from the validate folder.",
        "cycle_error_distribution": "Per-cycle error of the calibrated cost model against the mean "
        f"measured cycle over repeats (dashed: the grid's median aim, {t.cycle_median_pct:g} %; dotted: its "
        f"p90 aim, {t.cycle_p90_pct:g} %), and, with repeats, the |error| beside the per-cycle run-to-run "
        "noise. Copied from the validate folder.",
    }


def render_figures(data: ReportData, fig_dir: Path, progress: bool = True) -> dict[str, Path | None]:
    """Draw every figure that the data allow; ``{name: path or None}`` in :data:`figures.FIGURES` order.

    Args:
        data: the collected inputs (:class:`ReportData`).
        fig_dir: folder of the PNGs (``<name>.png``; made when needed).
        progress: a bar on stderr.

    Returns:
        ``{figure name: PNG path, or None where the data allow no figure}``.

    Raises:
        OSError: a PNG cannot be written.
    """
    jobs = {
        "throughput_vs_bandwidth": lambda p: figures.throughput_vs_bandwidth(data.throughput, p),
        "predicted_vs_measured": lambda p: figures.predicted_vs_measured(data.cycle_scatter, p),
        "acceptance_per_depth": lambda p: figures.acceptance_per_depth(data.dense, p),
        "expert_union_growth": lambda p: figures.expert_union_growth(data.dense, p, data.dense_acceptance),
        "hit_rate_vs_cache": lambda p: figures.hit_rate_vs_cache(data.hit_rates, p),
        "time_split": lambda p: figures.time_split(data.time_split, p),
    }
    out: dict[str, Path | None] = {}
    for name in tqdm(figures.FIGURES, desc="figures", file=sys.stderr, disable=not progress):
        out[name] = jobs[name](fig_dir / f"{name}.png")
    return out


def write_report(
    data: ReportData, out_dir: Path, title: str, copied: list[Path] | None = None, progress: bool = True
) -> tuple[Path, dict[str, Path | None]]:
    """Render the figures and write ``report.md``; returns its path and the figure paths. The
    validate folders' fidelity figures copied next to it are appended to ``copied`` when given.

    Args:
        data: the collected inputs (:class:`ReportData`).
        out_dir: the report folder (``report.md``, ``figures/``).
        title: the report's first heading.
        copied: a list to extend with the copied fidelity figures, or None.
        progress: a bar on stderr while the figures render.

    Returns:
        ``(report.md path, {figure name: PNG path or None})``.

    Raises:
        OSError: the report or a figure cannot be written.
    """
    fig_paths = render_figures(data, out_dir / "figures", progress)
    lines = [f"# {title}\n", "## Inputs\n"]
    lines += [f"- `{p}` ({kind})" for p, kind in data.inputs]
    lines.append("")
    lines.append(CONVENTIONS)
    if data.run_summaries:
        lines.append("## Recorded runs\n")
        lines.append(
            "Every trace run in the inputs, dense and policy mode (cycle figures are `-` for a run "
            "without cycles; dense runs are listed here but not placed on the regime map). "
            "`decode_s`: seconds of the decode phase, `summary.json` `decode_s` of `live.record` (first "
            "cycle to last, without prefill and trace writing) or, where `throughput_basis` says "
            "`sum cycle_s`, the sum of the cycle times; `tokens_per_s` = committed tokens / `decode_s`.\n"
        )
        rows = pd.DataFrame([{"run": label, **s} for label, s in data.run_summaries])
        lead = [c for c in RUN_COLUMNS if c in rows.columns]
        lines.append(markdown_table(rows[lead + [c for c in rows.columns if c not in lead]]))
    slow = figures.slower_than_ar(data.throughput)
    lines.append("## Regime map\n")
    lines += throughput_config_lines(data.throughput)
    if len(slow):
        lines.append("Configurations where the full tree is slower than autoregressive decoding:\n")
        lines.append(markdown_table(slow))
    elif len(data.throughput):
        lines.append("No configuration where the full tree is slower than autoregressive decoding.\n")
    else:
        lines.append("_No throughput data in the inputs._\n")
    if len(data.categories):
        lines.append("## Prompt categories\n")
        lines.append(
            "Per prompt category (`requests.category`, e.g. the MT-bench layout of `live.record "
            "--prompts`), MEASURED: policy runs give tau, tokens/s (committed tokens / sum of cycle "
            "seconds) and the hit rate of that category's cycles; dense runs give `num_cycles` = trees "
            "and `tau` = the full tree's (mean accepted length + 1).\n"
        )
        lines.append(markdown_table(data.categories))
    if len(data.regret):
        lines.append("## Decision regret of SpecFit (simulated)\n")
        lines.append(
            "Per sweep cell, SpecFit's gap to the best policy run in that cell in hindsight, as a fraction of "
            "the best tokens/s: `regret_acceptance` is what the recorded accepted flags as acceptance "
            "recover (specfit-oracle-accept), `regret_experts` what the recorded experts recover "
            "(specfit-oracle-experts), `regret_myopic` what remains with both exact (the per-cycle "
            "objective itself: evictions it does not price, draft time before verifying the root only), "
            "`regret_interaction` the rest.\n"
        )
        lines.append(markdown_table(data.regret))
    if len(data.fit_errors):
        lines.append("## Cost-model fit (calibration)\n")
        lines.append("Per term, |% error| of the fitted cost model on fit and held-out cycles.\n")
        lines.append(markdown_table(data.fit_errors))
    fidelity_lines, fidelity_figures = fidelity_section(data.validations, out_dir)
    lines += fidelity_lines
    if copied is not None:
        copied += fidelity_figures
    lines.append("## Figures\n")
    for name in figures.FIGURES:
        path = fig_paths[name]
        if path is None:
            lines.append(f"- {name}: not drawn ({MISSING_REASONS[name]}).")
        else:
            lines.append(
                f"### {name.replace('_', ' ')}\n\n![{name}](figures/{path.name})\n\n{CAPTIONS[name]}\n"
            )
            if name == "time_split":
                lines += time_split_left_out_lines(data.time_split)
    report = out_dir / "report.md"
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines) + "\n")
    return report, fig_paths


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (see the module docstring for exit codes and outputs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in args.inputs:
        if not Path(path).exists():
            parser.fail("DIR", f"{path} does not exist")
    out_dir = parser.ensure_out_dir("--out", args.out)  # before any work: exit 2 naming --out
    try:
        data = collect(args.inputs)
    except ReportInputError as exc:
        parser.fail("DIR", str(exc))
    copied: list[Path] = []
    report, fig_paths = write_report(data, out_dir, args.title, copied, progress=not args.no_progress)
    drawn = [n for n, p in fig_paths.items() if p is not None]
    missing = {n: MISSING_REASONS[n] for n, p in fig_paths.items() if p is None}
    _, split_left_out = figures.time_split_rows(data.time_split)
    print(f"report: {report} ({len(data.inputs)} inputs, {len(data.run_summaries)} trace runs listed)")
    print(f"figures written ({len(drawn)} of {len(fig_paths)}) in {out_dir / 'figures'}:")
    for name in drawn:
        extra = ""
        if name == "time_split" and len(split_left_out):
            extra = f" ({len(split_left_out)} of {len(data.time_split)} rows left out, listed in report.md)"
        print(f"  {fig_paths[name]}{extra}")
    if copied:
        print(f"validate fidelity figures copied ({len(copied)}):")
        for path in copied:
            print(f"  {path}")
    if missing:
        print(f"figures missing ({len(missing)}):")
        for name, why in missing.items():
            print(f"  {name}: {why}")
    print_summary(
        {
            "ok": True,
            "report": str(report),
            "figures": drawn,
            "missing_figures": list(missing),
            "missing_reasons": missing,
            "time_split_rows_left_out": len(split_left_out),
            "validate_figures": [str(p) for p in copied],
            "num_inputs": len(data.inputs),
        }
    )
    return 0


if __name__ == "__main__":
    run_main(main)
