"""Collect the tidy tables the report draws from, whatever mix of directories it is given.

Recognised directories (by their files):

- trace run (``manifest.json``; dense and/or policy cycles), read with ``traces.reader.open_run``;
- sim sweep (``results.parquet`` or ``results.csv`` of ``python -m sim.sweep``);
- calibration folder (``cost_fit_cycles.csv`` of ``python -m calibration.fit``);
- validation folder (``fidelity.csv`` of ``python -m analysis.validate``, with its ``fidelity.json``
  summary, ``cycle_errors.csv`` per-cycle predictions of the calibrated cost model and its two
  fidelity figures; the dense and live runs it recorded under ``live/`` are read too).

Everything is reduced to a few long-format tables (:class:`ReportData`), one row per
(source, configuration), so each figure reads one table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import metrics
from specfit.cli import json_error_text, read_table
from specfit.units import bytes_per_s_to_gb_per_s

THROUGHPUT_COLUMNS = (
    "label",
    "source",
    "config",
    "bandwidth_gb_per_s",
    "cache_experts_per_layer",
    "policy",
    "tokens_per_s",
)
HIT_COLUMNS = ("label", "source", "bandwidth_gb_per_s", "cache_experts_per_layer", "policy", "hit_rate")
SPLIT_COLUMNS = ("label", "draft_s", "verify_s", "h2d_s", "other_s")
CATEGORY_COLUMNS = (
    "run",
    "mode",
    "category",
    "num_requests",
    "num_cycles",
    "tau",
    "tokens_per_s",
    "hit_rate",
)
SCATTER_COLUMNS = ("label", "predicted_s", "measured_s")
# the fidelity figures analysis.validate writes under <folder>/figures/ (the report shows them)
VALIDATE_FIGURES = ("sim_vs_live_throughput", "cycle_error_distribution")


class ReportInputError(ValueError):
    """A directory the report cannot read (names it and what was expected)."""


@dataclass
class ReportData:
    """Long-format tables for the figures (empty DataFrames when no input provides them).

    Attributes:
        throughput: :data:`THROUGHPUT_COLUMNS` (``source`` is ``sim`` or ``live``; ``config`` names
            the configuration a row belongs to, see :func:`config_label`: rows of different
            configurations are never averaged together).
        hit_rates: :data:`HIT_COLUMNS`.
        time_split: :data:`SPLIT_COLUMNS` (seconds summed over a run or cell).
        cycle_scatter: :data:`SCATTER_COLUMNS`, one row per cycle (seconds): a policy-mode trace
            run's planner predictions (``"<run> (planner)"``), a calibration folder's fitted model
            (``"<folder> (calibrated, <split>)"``) and a validate folder's calibrated cost model
            from ``cycle_errors.csv``, one series per policy (``"<folder> calibrated: <policy>"``;
            the planner predictions of its live runs are not drawn, their median error is
            ``planner_error_median_pct`` in its fidelity table).
        dense: ``(label, NodeArrays, num_experts)`` of dense runs.
        dense_acceptance: label of a dense run -> the ``AcceptanceCalibration`` of its
            ``acceptance.json`` (inside the run, or a validate folder's), the planner's map.
        run_summaries: ``(label, dict)`` of every trace run, dense and policy: ``mode``,
            ``num_requests``, ``num_trees`` and, for runs with cycles, ``metrics.cycle_summary``
            plus ``decode_s`` (decode seconds: ``summary.json`` ``decode_s``, which leaves out the
            prefill and trace writing, or the sum of ``cycle_s``), ``tokens_per_s``,
            ``throughput_basis`` (which of the two; ``num_cycles`` 0 without cycles).
        fidelity: the rows of validation folders.
        validations: one dict per validation folder: ``label`` (folder name), ``path``,
            ``table`` (its fidelity.csv), ``summary`` (``fidelity.json``, or recomputed by
            :func:`analysis.fidelity.overall` from fidelity.csv and cycle_errors.csv when absent),
            ``repeats`` and ``figures`` (``{name: path or None}`` of :data:`VALIDATE_FIGURES`).
        fit_errors: per-term cost-fit errors of calibration folders (``cost_fit_report.json``):
            ``label, term, split, num_samples, median_abs_pct_error, p90_abs_pct_error, r2``.
        categories: :data:`CATEGORY_COLUMNS`, one row per (trace run, prompt category) for runs whose
            requests carry a category (``requests.category``, e.g. ``live.record --prompts
            spec_bench.jsonl``): policy runs give tau, tokens/s (sum of cycle seconds) and hit rate
            of that category's cycles; dense runs give ``num_cycles`` = trees and ``tau`` = the
            full tree's (mean accepted length + 1, bonus included).
        regret: SpecFit rows of sweeps run with the oracle variants: the cell keys, tokens/s, the
            best in hindsight and the ``regret_*`` decomposition (``sim.report._add_regret``).
        inputs: ``(path, kind)`` of every input.
    """

    throughput: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=THROUGHPUT_COLUMNS))
    hit_rates: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=HIT_COLUMNS))
    time_split: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=SPLIT_COLUMNS))
    cycle_scatter: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=SCATTER_COLUMNS))
    dense: list = field(default_factory=list)
    dense_acceptance: dict = field(default_factory=dict)
    run_summaries: list = field(default_factory=list)
    fidelity: pd.DataFrame = field(default_factory=pd.DataFrame)
    fit_errors: pd.DataFrame = field(default_factory=pd.DataFrame)
    regret: pd.DataFrame = field(default_factory=pd.DataFrame)
    categories: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=CATEGORY_COLUMNS))
    validations: list = field(default_factory=list)
    inputs: list = field(default_factory=list)

    def _add(self, name: str, rows: pd.DataFrame) -> None:
        if len(rows):
            current = getattr(self, name)
            setattr(self, name, pd.concat([current, rows], ignore_index=True) if len(current) else rows)


def config_label(kind: str, **fields: object) -> str:
    """One readable name for a throughput configuration, e.g. ``"sweep s1: expert 9.437 MB, overlap on"``.

    ``kind`` is the source kind (``sweep``, ``live`` or ``validate``, with the folder name where
    cells of different folders must not be mixed); ``fields`` are the settings that distinguish
    cells (expert bytes, overlap, prefetch, predictor, cache policy, depth, prompt counts...).
    ``None``/NaN fields are left out. Rows with equal labels may be averaged; others never.
    """
    parts = []
    for key, value in fields.items():
        if value is None or (isinstance(value, float) and not np.isfinite(value)):
            continue
        if isinstance(value, (bool, np.bool_)):
            parts.append(f"{key.replace('_', ' ')} {'on' if value else 'off'}")
        elif key == "expert_bytes":
            parts.append(f"expert {float(value) / 1e6:.4g} MB")
        else:
            parts.append(f"{key.replace('_', ' ')} {value}")
    return f"{kind}: {', '.join(parts)}" if parts else kind


def classify(path: Path) -> str:
    """``"trace"``, ``"sweep"``, ``"calibration"`` or ``"validate"``.

    Raises:
        ReportInputError: not a directory or none of the recognised files.
    """
    if not path.is_dir():
        raise ReportInputError(
            f"{path}: not a directory (expected a run, sweep, calibration or validate folder)"
        )
    if (path / "manifest.json").is_file():
        return "trace"
    if (path / "results.parquet").is_file() or (path / "results.csv").is_file():
        return "sweep"
    if (path / "fidelity.csv").is_file():
        return "validate"
    if (path / "cost_fit_cycles.csv").is_file():
        return "calibration"
    raise ReportInputError(
        f"{path}: no manifest.json, results.parquet/csv, fidelity.csv or cost_fit_cycles.csv found"
    )


def _sweep_results_file(path: Path) -> Path:
    """A sweep folder's results table: ``results.parquet``, else ``results.csv``."""
    return path / ("results.parquet" if (path / "results.parquet").is_file() else "results.csv")


def _read_sweep(path: Path) -> pd.DataFrame:
    return read_table(_sweep_results_file(path), expected="the results table python -m sim.sweep writes")


def _add_sweep(data: ReportData, path: Path) -> None:
    df = _read_sweep(path)
    need = ("bandwidth_gb_per_s", "cache_experts_per_layer", "policy", "tokens_per_s")
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ReportInputError(
            f"{_sweep_results_file(path)}: sweep results lack column(s) {missing} (expected the results "
            "table python -m sim.sweep writes)"
        )
    label = path.name
    expert_bytes = _sweep_expert_bytes(path, df)
    settings = [c for c in ("overlap", "prefetch", "predictor", "cache_policy") if c in df.columns]
    configs = [
        config_label(f"sweep {label}", expert_bytes=eb, **dict(zip(settings, vals)))
        for eb, *vals in zip(expert_bytes, *(df[c] for c in settings))
    ]
    tp = df[list(need)].assign(label=label, source="sim", config=configs)
    if "regret_myopic" in df.columns and df["regret_myopic"].notna().any():
        keys = [c for c in ("bandwidth_gb_per_s", "cache_experts_per_layer", *settings) if c in df.columns]
        regret_cols = [c for c in df.columns if c.startswith("regret_")]
        rows = df[(df["policy"] == "specfit") & df["regret_myopic"].notna()]
        data._add(
            "regret",
            rows[[*keys, "tokens_per_s", "best_in_hindsight_tokens_per_s", *regret_cols]].assign(sweep=label),
        )
    data._add("throughput", tp[list(THROUGHPUT_COLUMNS)])
    if "hit_rate" in df.columns:
        hr = df[["bandwidth_gb_per_s", "cache_experts_per_layer", "policy", "hit_rate"]].assign(
            label=label, source="sim"
        )
        data._add("hit_rates", hr[list(HIT_COLUMNS)])
    if {"draft_s", "verify_s", "h2d_s", "decode_s"} <= set(df.columns):
        split = pd.DataFrame(
            {
                "label": [
                    f"sim {label}: {p} {b:g}GB/s c{c}{extra}"
                    for p, b, c, extra in zip(
                        df["policy"], df["bandwidth_gb_per_s"], df["cache_experts_per_layer"], _flags(df)
                    )
                ],
                "draft_s": df["draft_s"],
                "verify_s": df["verify_s"],
                "h2d_s": df["h2d_s"],
                "other_s": (df["decode_s"] - df["draft_s"] - df["verify_s"] - df["h2d_s"]).clip(lower=0),
            }
        )
        data._add("time_split", split)


def _flags(df: pd.DataFrame) -> list[str]:
    """Per row, `` overlap`` / `` prefetch`` when the sweep cell had them on, `` prefetch <mode>``
    for a prefetch mode (draft, next-layer, both) (time-split bar labels)."""
    out = [""] * len(df)
    for col in ("overlap", "prefetch"):
        if col in df.columns:
            for i, value in enumerate(df[col].astype(str).str.lower()):
                if value in ("true", "1", "on"):
                    out[i] += f" {col}"
                elif col == "prefetch" and value in ("draft", "next-layer", "both"):
                    out[i] += f" prefetch {value}"
    return out


def _read_json(file: Path) -> Any:
    """The JSON value in ``file``.

    Raises:
        ReportInputError: invalid JSON (file, line and message named).
    """
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ReportInputError(f"{file}: invalid JSON at {json_error_text(exc)}") from None


def _sweep_expert_bytes(path: Path, df: pd.DataFrame) -> list:
    """Per row of ``df``, the expert bytes the sweep priced (``sweep.json`` cells by ``cell_id``)."""
    by_cell: dict = {}
    meta = path / "sweep.json"
    if meta.is_file():
        sweep = _read_json(meta)
        for cell in sweep.get("cells", []):
            if isinstance(cell, dict) and isinstance(cell.get("cost"), dict):
                by_cell[cell.get("cell_id")] = cell["cost"].get("expert_bytes")
    ids = df["cell_id"] if "cell_id" in df.columns else [None] * len(df)
    return [by_cell.get(i) for i in ids]


def live_throughput(path: Path, summary: dict) -> tuple[float, float, str]:
    """Tokens/s of a live run per docs/metrics.md: committed tokens / wall seconds of decoding.

    Uses ``summary.json``'s ``summary.num_tokens / summary.decode_s`` (what ``python -m
    live.record`` prints) when the run has it; otherwise ``metrics.cycle_summary``'s committed
    tokens / sum of ``cycle_s`` (``summary`` here), also when the summary covers only the prompts
    of a ``--resume`` call (``summary_covers``), so counts and time share one scope.

    Args:
        path: the live run directory (``runs/<UTC time>/``).
        summary: :func:`analysis.metrics.cycle_summary` of the run's cycles (``tokens_per_s``,
            ``wall_s``).

    Returns:
        ``(tokens_per_s, wall_s, basis)`` with ``basis`` ``"decode_s"`` or ``"sum cycle_s"``.

    Raises:
        ReportInputError: ``summary.json`` is not valid JSON.
    """
    file = path / "summary.json"
    if file.is_file():
        recorded = _read_json(file).get("summary", {})
        tokens, decode_s = recorded.get("num_tokens"), recorded.get("decode_s")
        partial = recorded.get("summary_covers", "whole run") != "whole run"  # part of a resumed run
        if (
            not partial
            and isinstance(tokens, (int, float))
            and isinstance(decode_s, (int, float))
            and decode_s > 0
        ):
            return float(tokens) / float(decode_s), float(decode_s), "decode_s"
    return float(summary["tokens_per_s"]), float(summary["wall_s"]), "sum cycle_s"


def _add_trace(
    data: ReportData,
    path: Path,
    include_rates: bool = True,
    label: str | None = None,
    include_planner: bool = True,
    acceptance: Path | None = None,
) -> None:
    """Add one trace run; ``acceptance``: the acceptance.json the planner used with its dense
    trees (default: the one inside the run, as ``sim.sweep --acceptance auto`` finds it)."""
    from traces.reader import open_run

    try:
        run = open_run(path)
    except ValueError as exc:
        raise ReportInputError(f"{path}: {exc}") from None
    manifest = run.manifest
    label = label or path.name
    num_trees = 0
    if run.num_rows("nodes"):
        arrays = run.node_arrays()
        num_trees = arrays.num_trees
        synthetic = manifest.run.prompt_source == "synthetic"  # generated, not recorded by live.record
        dense_label = f"{label} (synthetic)" if synthetic else label
        data.dense.append((dense_label, arrays, manifest.model.num_experts))
        acceptance = acceptance or path / "acceptance.json"
        if acceptance.is_file():
            data.dense_acceptance[dense_label] = _read_acceptance(acceptance)
    cycles = run.cycles
    _add_categories(data, label, run, cycles)
    listed = {"mode": manifest.run.mode, "num_requests": len(run.request_ids), "num_trees": num_trees}
    if not len(cycles):  # e.g. a synthetic dense trace: trees only
        data.run_summaries.append((label, {**listed, "num_cycles": 0}))
        return
    summary = metrics.cycle_summary(cycles)
    tokens_per_s, wall_s, basis = live_throughput(path, summary)
    # cycle_summary's wall_s (sum of cycle_s) becomes decode_s, in its place: the decode seconds
    # the throughput divides by (summary.json decode_s, or that sum per throughput_basis)
    summary = {("decode_s" if k == "wall_s" else k): v for k, v in summary.items()}
    summary = {
        **listed,
        **summary,
        "decode_s": wall_s,
        "tokens_per_s": tokens_per_s,
        "throughput_basis": basis,
    }
    data.run_summaries.append((label, summary))
    if manifest.run.mode != "policy":  # dense cycles verify whole trees: listed, not in the regime map
        return
    bw = manifest.hardware.emulated_bandwidth_bytes_per_s
    policy = manifest.run.tree_policy or str(cycles["policy"].iloc[0])
    cache = manifest.run.cache_capacity_per_layer
    bandwidth = bytes_per_s_to_gb_per_s(bw) if bw else np.nan
    row = {
        "label": label,
        "source": "live",
        "config": _live_config(manifest),
        "bandwidth_gb_per_s": bandwidth,
        "cache_experts_per_layer": cache,
        "policy": policy,
    }
    if include_rates:  # a validate folder's fidelity.csv already holds these
        data._add("throughput", pd.DataFrame([{**row, "tokens_per_s": summary["tokens_per_s"]}]))
        hit = {
            k: row[k] for k in ("label", "source", "bandwidth_gb_per_s", "cache_experts_per_layer", "policy")
        }
        data._add("hit_rates", pd.DataFrame([{**hit, "hit_rate": summary["hit_rate"]}]))
    draft, verify, h2d = (float(cycles[c].sum()) for c in ("draft_s", "verify_s", "h2d_s"))
    other = max(float(cycles["cycle_s"].sum()) - draft - verify - h2d, 0.0)
    data._add(
        "time_split",
        pd.DataFrame(
            [{"label": f"live {label}", "draft_s": draft, "verify_s": verify, "h2d_s": h2d, "other_s": other}]
        ),
    )
    predicted = pd.to_numeric(cycles["predicted_cycle_s"], errors="coerce")
    decision = pd.to_numeric(cycles["decision_s"], errors="coerce").fillna(0.0)
    ok = predicted.notna()
    if include_planner and ok.any():
        data._add(
            "cycle_scatter",
            pd.DataFrame(
                {
                    "label": f"{label} (planner)",
                    "predicted_s": predicted[ok].to_numpy(),
                    "measured_s": (cycles["cycle_s"] - decision)[ok].to_numpy(),
                }
            ),
        )


def _add_categories(data: ReportData, label: str, run: Any, cycles: pd.DataFrame) -> None:
    """Per prompt category of ``run`` (``requests.category``; nothing without one), the rows of
    :attr:`ReportData.categories`."""
    requests = run.requests
    if "category" not in requests.columns or requests["category"].isna().all():
        return
    category_of = dict(zip(requests["request_id"].astype(int), requests["category"].fillna("(none)")))
    mode = run.manifest.run.mode
    rows = []
    if mode == "dense" and run.num_rows("nodes"):
        from traces.stats import accepted_lengths

        arrays = run.node_arrays()
        trees = pd.DataFrame(
            {
                "category": [category_of.get(int(r), "(none)") for r in arrays.request_ids],
                "accepted": accepted_lengths(arrays),
            }
        )
        for category, g in trees.groupby("category", sort=True):
            rows.append(
                {"category": category, "num_cycles": len(g), "tau": float(g["accepted"].mean()) + 1.0}
            )
    elif mode == "policy" and len(cycles):
        by = cycles.assign(category=[category_of.get(int(r), "(none)") for r in cycles["request_id"]])
        for category, g in by.groupby("category", sort=True):
            s = metrics.cycle_summary(g)
            rows.append(
                {"category": category, **{k: s[k] for k in ("num_cycles", "tau", "tokens_per_s", "hit_rate")}}
            )
    counts = pd.Series(list(category_of.values())).value_counts()
    for row in rows:
        row.update(run=label, mode=mode, num_requests=int(counts.get(row["category"], 0)))
    if rows:
        data._add("categories", pd.DataFrame(rows).reindex(columns=CATEGORY_COLUMNS))


def _live_config(manifest: object) -> str:
    """The configuration of a live policy run (everything but bandwidth, cache size and policy)."""
    cfg = getattr(manifest, "config", None) or {}
    draft = getattr(manifest, "draft", None)
    run = manifest.run
    return config_label(
        "live",
        model=manifest.model.name,
        expert_bytes=manifest.model.bytes_per_expert,
        cache_policy=run.cache_policy,
        # only specfit's and cascade's choices depend on the predictor: ar / full / chain / topn runs
        # share the configuration (and the regime map's panels) of any predictor
        predictor=run.predictor if run.tree_policy in ("specfit", "cascade") else None,
        depth=cfg.get("depth", getattr(draft, "tree_depth", None)),
        max_nodes=cfg.get("max_nodes", getattr(draft, "max_nodes", None)),
        prompts=cfg.get("prompts", run.prompt_source),
        num_prompts=cfg.get("num_prompts"),
        max_new_tokens=cfg.get("max_new_tokens"),
    )


def _read_acceptance(file: Path) -> Any:
    """The :class:`specfit.acceptance.AcceptanceCalibration` in ``file``.

    Raises:
        ReportInputError: unreadable or not an acceptance map (names the file).
    """
    from specfit.acceptance import AcceptanceCalibration

    try:
        return AcceptanceCalibration.from_dict(_read_json(file))
    except (ValueError, TypeError, AttributeError) as exc:
        raise ReportInputError(f"{file}: not an acceptance map of calibration.fit: {exc}") from None


def _add_calibration(data: ReportData, path: Path) -> None:
    df = read_table(path / "cost_fit_cycles.csv", expected="the per-cycle table of python -m calibration.fit")
    report_path = path / "cost_fit_report.json"
    if report_path.is_file():
        report = _read_json(report_path)
        data._add("fit_errors", _fit_error_rows(path.name, report))
    need = ("predicted_cycle_s", "measured_cycle_s")
    if any(c not in df.columns for c in need):
        raise ReportInputError(f"{path}/cost_fit_cycles.csv: lacks columns {list(need)}")
    split = df["split"] if "split" in df.columns else "all"
    data._add(
        "cycle_scatter",
        pd.DataFrame(
            {
                "label": [f"{path.name} (calibrated, {s})" for s in np.broadcast_to(split, len(df))],
                "predicted_s": df["predicted_cycle_s"],
                "measured_s": df["measured_cycle_s"],
            }
        ),
    )


def _fit_error_rows(label: str, report: dict) -> pd.DataFrame:
    rows = [
        {"label": label, "term": term, "split": split, **summary}
        for term, splits in report.get("errors", {}).items()
        for split, summary in splits.items()
    ]
    return pd.DataFrame(rows)


def _add_validate(data: ReportData, path: Path) -> None:
    """fidelity.csv rows, plus the dense and live runs the validation recorded (``live/<cell>`` and
    its repeats ``live/<cell>/r<k>``)."""
    df = read_table(path / "fidelity.csv", expected="the fidelity table of python -m analysis.validate")
    expert_bytes = None
    live = path / "live"
    for run_dir in sorted([*live.glob("*/manifest.json"), *live.glob("*/r*/manifest.json")]):
        label = f"{path.name}/{run_dir.parent.relative_to(live).as_posix()}"
        # rates come from fidelity.csv; per-cycle predictions from cycle_errors.csv (calibrated)
        _add_trace(
            data,
            run_dir.parent,
            include_rates=False,
            label=label,
            include_planner=False,
            acceptance=path / "acceptance.json",  # fitted once from the dense trace for every cell
        )
        if expert_bytes is None:
            try:
                expert_bytes = json.loads(run_dir.read_text())["model"]["bytes_per_expert"]
            except (ValueError, KeyError, TypeError):
                expert_bytes = None
    config = config_label(f"validate {path.name}", expert_bytes=expert_bytes)
    data.fidelity = pd.concat([data.fidelity, df.assign(label=path.name)], ignore_index=True)
    errors = _read_cycle_errors(path)
    if len(errors):
        data._add(
            "cycle_scatter",
            pd.DataFrame(
                {
                    "label": [f"{path.name} calibrated: {p}" for p in errors["policy"]],
                    "predicted_s": pd.to_numeric(errors["predicted_cycle_s"], errors="coerce"),
                    "measured_s": pd.to_numeric(errors["measured_cycle_s"], errors="coerce"),
                }
            ),
        )
    summary = _validate_summary(path, df, errors)
    repeats = summary.get("repeats")
    if not isinstance(repeats, (int, float)) or not np.isfinite(repeats):
        repeats = _table_repeats(df)
    data.validations.append(
        {
            "label": path.name,
            "path": path,
            "table": df,
            "summary": summary,
            "repeats": int(repeats),
            "figures": {
                name: (
                    path / "figures" / f"{name}.png" if (path / "figures" / f"{name}.png").is_file() else None
                )
                for name in VALIDATE_FIGURES
            },
        }
    )
    for source in ("live", "sim"):
        col = f"{source}_tokens_per_s"
        if col in df.columns:
            tp = df[["bandwidth_gb_per_s", "cache_experts_per_layer", "policy", col]].rename(
                columns={col: "tokens_per_s"}
            )
            tp = tp.assign(label=path.name, source=source, config=config)
            data._add("throughput", tp[list(THROUGHPUT_COLUMNS)])
        col = f"{source}_hit_rate"
        if col in df.columns:
            hr = df[["bandwidth_gb_per_s", "cache_experts_per_layer", "policy", col]].rename(
                columns={col: "hit_rate"}
            )
            data._add("hit_rates", hr.assign(label=path.name, source=source)[list(HIT_COLUMNS)])


def _read_cycle_errors(path: Path) -> pd.DataFrame:
    """A validate folder's ``cycle_errors.csv`` (empty when absent or without rows).

    Raises:
        ReportInputError: the file lacks ``policy`` / ``measured_cycle_s`` / ``predicted_cycle_s``.
    """
    file = path / "cycle_errors.csv"
    if not file.is_file():
        return pd.DataFrame()
    try:
        df = pd.read_csv(file)
    except pd.errors.EmptyDataError:  # a grid without matched cycles writes an empty file
        return pd.DataFrame()
    need = ("policy", "measured_cycle_s", "predicted_cycle_s")
    missing = [c for c in need if c not in df.columns]
    if len(df) and missing:
        raise ReportInputError(f"{file}: lacks column(s) {missing}")
    return df


def _table_repeats(table: pd.DataFrame) -> int:
    """The largest ``num_repeats`` of a ``fidelity.csv`` table (1 without the column or a value)."""
    nr = pd.to_numeric(table.get("num_repeats", pd.Series(dtype=float)), errors="coerce").dropna()
    return int(nr.max()) if len(nr) else 1


def _validate_summary(path: Path, table: pd.DataFrame, errors: pd.DataFrame) -> dict:
    """``fidelity.json`` of a validate folder, or the same summary recomputed when the file is
    absent: :func:`analysis.fidelity.overall` and :func:`analysis.validate.cycle_noise_summary`
    from ``fidelity.csv`` and ``cycle_errors.csv``, the cycles grouped per cell by
    :data:`analysis.fidelity.CELL_KEY` (files without its ``overlap`` / ``prefetch`` columns: by
    the others), ``repeats`` the table's largest ``num_repeats`` (1 without).

    Raises:
        ReportInputError: ``fidelity.json`` is not valid JSON.
    """
    file = path / "fidelity.json"
    if file.is_file():
        summary = _read_json(file)
        if isinstance(summary, dict):
            return {k: (np.nan if v is None else v) for k, v in summary.items()}
    from analysis import fidelity
    from analysis.validate import cycle_noise_summary

    keys = [k for k in fidelity.CELL_KEY if k in errors.columns]
    cells = (
        [g for _, g in errors.groupby(keys, sort=False, dropna=False)]
        if len(errors) and set(fidelity.CELL_KEY[:3]) <= set(keys)
        else []
    )
    numeric = [g.apply(pd.to_numeric, errors="coerce") for g in cells]
    rows = (
        table.to_dict("records")
        if {"ok", "throughput_error_pct", "hit_rate_diff_points", "same_subtree_fraction"}
        <= set(table.columns)
        else []
    )
    noise = [g["cycle_noise_pct"].to_numpy(float) for g in numeric if "cycle_noise_pct" in g.columns]
    summary = fidelity.overall(rows, [g["cycle_error_pct"].to_numpy(float) for g in numeric], noise)
    summary["repeats"] = _table_repeats(table)
    summary.update(cycle_noise_summary(numeric, summary["repeats"]))
    return summary


_READERS = {
    "trace": _add_trace,
    "sweep": _add_sweep,
    "calibration": _add_calibration,
    "validate": _add_validate,
}


def collect(paths: Sequence[str | Path]) -> ReportData:
    """Read every input directory into one :class:`ReportData`.

    Raises:
        ReportInputError: an unreadable or unrecognised directory (named).
    """
    data = ReportData()
    for p in paths:
        path = Path(p)
        kind = classify(path)
        _READERS[kind](data, path)
        data.inputs.append((str(path), kind))
    return data
