"""``python -m calibration.fit RUN_DIR [RUN_DIR ...] --out cost.json``: calibrate from recorded runs.

Writes, in the folder of ``--out``:

- ``cost.json`` (the ``--out`` path): the fitted :class:`specfit.cost.CycleCostModel`, read by the
  planner, the live engine and the simulator (``CycleCostModel.load``); with runs recorded with
  ``live.record --prefetch next-layer`` among them, also next-layer prefetch's share and waste
  from their prefetch counts (``calibration.costfit.fit_next_layer_terms``; ``next_layer_fit`` in
  the report).
- ``cost_fit_report.json``: per term (draft, verify, H2D per cycle and per transfer) and for
  whole cycles, median / p90 |% error| and R^2 on fit and held-out cycles, and the notes of the
  fit (:mod:`calibration.costfit`).
- ``cost_fit_cycles.csv``: per cycle, measured and predicted seconds of each term and its split.
- from dense trees, when any run has them: ``acceptance.json`` (the
  :class:`specfit.acceptance.AcceptanceCalibration` map), ``acceptance_reliability.csv`` and
  ``predictor_tables.npz`` (:mod:`calibration.predictor_tables`).

Verdict: the fitted model is judged on its held-out per-cycle error against stated thresholds
(``--max-median-pct``, default 5 %, and ``--max-p90-pct``, default 15 %; on the fit cycles, said
so, when none are held out). A fit that misses either prints a loud ``WARNING`` block, sets
``"ok": false`` and ``"verdict": "fail"`` in the JSON line and exits 1 (the files are still written:
the fit ran, the input was fine, the model is just not accurate enough to trust). An
unidentifiable or zero ``draft_base_s`` is explained in words (``draft_base_note``).

Exit status (the CLI contract, ``specfit.cli``): 0 on success; 1 when the fit misses its
thresholds; 2 for bad input: a bad flag, a run directory that cannot be read (not a directory,
not a valid trace), or data that is readable but bad or insufficient (too few cycles, runs of
different models or links); one stderr line names the run, the field and what was expected. The
last stdout line is the JSON summary.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from calibration.acceptance_fit import AcceptanceDataError, fit_acceptance
from calibration.checks import CalibrationDataError
from calibration.costfit import (
    OVERLAP_FIT_REPORT_VERSION,
    VERIFY_TARGETS,
    WEIGHTINGS,
    FitOptions,
    cycle_predictions,
    fit_cost_model,
    fit_tables,
)
from calibration.predictor_tables import fit_predictor_tables
from calibration.runs import LoadedRuns, RunInputError, load_runs
from specfit.cli import (
    ArgumentParser,
    InputError,
    cli_main,
    non_negative_float,
    positive_float,
    positive_int,
    print_summary,
    run_main,
)
from specfit.cost import COST_FIT_REPORT_NAME
from specfit.units import s_to_us, us_to_s

DEFAULT_OUT = "runs/calibration/cost.json"
REPORT_NAME = COST_FIT_REPORT_NAME
CYCLES_NAME = "cost_fit_cycles.csv"
ACCEPTANCE_NAME = "acceptance.json"
RELIABILITY_NAME = "acceptance_reliability.csv"
PREDICTORS_NAME = "predictor_tables.npz"
DEFAULT_MAX_MEDIAN_PCT = 5.0
"""Verdict threshold: median |% error| of held-out cycle times (issue 15: <= 5 %)."""
DEFAULT_MAX_P90_PCT = 15.0
"""Verdict threshold: p90 |% error| of held-out cycle times (issue 15: <= 15 %)."""


def _fraction(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 0.9], got {text!r}") from exc
    if not 0.0 <= value <= 0.9:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 0.9], got {text!r}")
    return value


def build_parser() -> ArgumentParser:
    """The CLI's parser (flags with units and defaults in ``--help``)."""
    p = ArgumentParser(prog="python -m calibration.fit", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (policy and/or dense mode)"
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="cost-model JSON to write; siblings go in its folder")
    p.add_argument(
        "--model", default=None, help="required manifest model.name of every run (unchecked if unset)"
    )
    p.add_argument(
        "--holdout", type=_fraction, default=0.25, help="fraction of cycles held out for evaluation"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the fit / held-out split")
    p.add_argument(
        "--robust",
        action="store_true",
        help="soft-L1 robust loss instead of plain NNLS (the H2D link is still priced at its mean copy time: "
        "there the robust loss sets the bandwidth/latency split only)",
    )
    p.add_argument(
        "--miss-compute",
        action="store_true",
        help="fit a compute cost per cache miss with the verify term and move it into the per-transfer "
        "H2D cost (see calibration.costfit.FitOptions.miss_compute); default: off",
    )
    p.add_argument("--min-cycles", type=positive_int, default=16, help="fewest cycles accepted (count)")
    p.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="overlap_h2d of the fitted model; auto = manifest config 'overlap_h2d' (false if absent). "
        "Runs recorded with `live.record --overlap on` beside overlap-off runs of the same link: the "
        "serial terms are fitted on the off runs and the overlap terms (placing per miss, late-expert "
        "call) on the on runs, and the model written is priced with overlap mode 'on' (unless --overlap off)",
    )
    p.add_argument(
        "--verify-target",
        choices=VERIFY_TARGETS,
        default="residual",
        help="verify term fitted on cycle - draft - h2d - decision (residual) or on verify_s",
    )
    p.add_argument(
        "--weighting",
        choices=WEIGHTINGS,
        default="absolute",
        help="least-squares residuals: relative (percent-like) or absolute (seconds); see calibration.lsq",
    )
    p.add_argument(
        "--h2d-latency-us",
        type=non_negative_float,
        default=None,
        help="per-transfer latency in microseconds, used when transfer sizes do not identify it "
        "(unset: the emulated link's latency from the manifests, else 0)",
    )
    p.add_argument(
        "--h2d-table",
        default=None,
        help="JSON from `python -m calibration.h2d` giving the per-transfer latency (alternative to --h2d-latency-us)",
    )
    p.add_argument(
        "--max-median-pct",
        type=positive_float,
        default=DEFAULT_MAX_MEDIAN_PCT,
        help="verdict threshold: largest acceptable median |%% error| of the held-out cycle times (%%)",
    )
    p.add_argument(
        "--max-p90-pct",
        type=positive_float,
        default=DEFAULT_MAX_P90_PCT,
        help="verdict threshold: largest acceptable p90 |%% error| of the held-out cycle times (%%)",
    )
    p.add_argument(
        "--acceptance-bins", type=positive_int, default=20, help="knots of the acceptance map (count)"
    )
    p.add_argument(
        "--min-token-count", type=positive_int, default=2, help="occurrences for a token-table entry (count)"
    )
    p.add_no_progress()
    return p


def latency_from_h2d_table(path: str, kinds: Sequence[str]) -> float:
    """Per-transfer latency (s) from a ``calibration.h2d`` JSON (``path``): the first of ``kinds`` it has a fit for.

    ``kinds`` are tried in order (the run's ``hardware.link_kind``, then ``hardware.h2d_memory``).

    Raises:
        ValueError: unreadable file, no ``fits`` object, or no entry for any of ``kinds`` (lists them).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read H2D table: {exc}") from None
    fits = data.get("fits") if isinstance(data, dict) else None
    if not isinstance(fits, dict) or not fits:
        raise ValueError(f"{path}: field 'fits' missing (expected the JSON written by calibration.h2d)")
    memory_kind = next((k for k in kinds if k in fits), None)
    if memory_kind is None:
        raise ValueError(f"{path}: no fit for link kind {list(kinds)}; available: {sorted(fits)}")
    value = fits[memory_kind].get("s_per_transfer")
    if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{path}: field 'fits.{memory_kind}.s_per_transfer' must be seconds >= 0")
    return float(value)


def emulated_latency_s(loaded: LoadedRuns, labels: Sequence[str]) -> float | None:
    """The per-transfer latency (s) of the emulated link the runs ``labels`` share, else ``None``.

    ``loaded``: the runs read by :func:`calibration.runs.load_runs`; ``labels``: which of them.

    An emulated link's latency is part of its definition (``live.record --latency-us``), recorded
    in ``manifest.hardware.emulated_s_per_transfer``; a real link's is not, so ``None`` then.
    (:meth:`LoadedRuns.cost_fit_tables` has checked that these runs share one link.)
    """
    hw = dict(zip(loaded.labels, loaded.runs))[labels[0]].manifest.hardware
    if hw.h2d_memory != "emulated" or hw.emulated_s_per_transfer is None:
        return None
    return float(hw.emulated_s_per_transfer)


def _overlap(flag: str, loaded: LoadedRuns) -> bool:
    if flag != "auto":
        return flag == "on"
    return any(bool(m.config.get("overlap_h2d", False)) for m in loaded.manifests())


def _runs_with(loaded: LoadedRuns, cycles: Any, key: str, value: str) -> list[str]:
    """Sorted labels of the runs in ``cycles`` (column ``run``) whose manifest config ``key`` is
    ``value`` (``live.record``'s ``--overlap`` / ``--prefetch``)."""
    if not len(cycles) or "run" not in cycles.columns:
        return []
    present = set(cycles["run"].astype(str))
    return sorted(lbl for lbl, m in zip(loaded.labels, loaded.manifests()) if lbl in present and m.config.get(key) == value)


def _split_overlap_runs(loaded: LoadedRuns, cycles: Any, transfers: Any, args: Any) -> tuple[Any, Any, list[str]]:
    """``(cycles, transfers, labels)`` of the policy runs recorded with ``live.record --overlap
    on`` (manifest config ``overlap``), when overlap-off runs are there too and ``--overlap`` is
    not ``off``; else empty tables and ``[]`` (every run fitted as before)."""
    labels = _runs_with(loaded, cycles, "overlap", "on")
    serial = set(cycles["run"].astype(str)) - set(labels) if labels else set()
    if args.overlap == "off" or not labels or not serial:
        return cycles.iloc[0:0], transfers.iloc[0:0], []
    pick = cycles["run"].isin(labels)
    picked_transfers = transfers[transfers["run"].isin(labels)] if len(transfers) else transfers
    return cycles[pick].reset_index(drop=True), picked_transfers.reset_index(drop=True), labels


def _next_layer_runs(loaded: LoadedRuns, cycles: Any) -> tuple[Any, list[str], list[str]]:
    """``(cycles, labels, notes)`` of the policy runs recorded with ``live.record --prefetch
    next-layer`` (manifest config ``prefetch``); runs with ``both`` only when none is there, said
    in a note (their counts include the draft prefetch's)."""
    labels, notes = _runs_with(loaded, cycles, "prefetch", "next-layer"), []
    if not labels:
        labels = _runs_with(loaded, cycles, "prefetch", "both")
        if labels:
            notes.append("next-layer prefetch terms fitted on --prefetch both runs: their counts include the draft prefetch's")
    return cycles[cycles["run"].isin(labels)].reset_index(drop=True) if labels else cycles.iloc[0:0], labels, notes


def calibrate(args: Any, parser: ArgumentParser) -> dict[str, Any]:
    """Run the whole calibration for parsed ``args`` (``parser``: to exit 2 naming a bad flag);
    returns the summary dict.

    Raises:
        RunInputError, CalibrationDataError, AcceptanceDataError, ValueError: data problems.
    """
    loaded = load_runs(
        tqdm(args.run_dirs, desc="runs", disable=args.no_progress or len(args.run_dirs) < 3, file=sys.stderr),
        expected_model=args.model,
    )
    cycles, transfers, cost_labels = loaded.cost_fit_tables()
    next_layer_cycles, next_layer_labels, next_layer_notes = _next_layer_runs(loaded, cycles)
    overlap_cycles, overlap_transfers, overlap_labels = _split_overlap_runs(loaded, cycles, transfers, args)
    if overlap_labels:
        cycles = cycles[~cycles["run"].isin(overlap_labels)].reset_index(drop=True)
        if len(transfers):
            transfers = transfers[~transfers["run"].isin(overlap_labels)].reset_index(drop=True)
        cost_labels = [label for label in cost_labels if label not in overlap_labels]
    has_policy_runs = any(m.run.mode == "policy" for m in loaded.manifests())
    if len(cycles) == 0 or not has_policy_runs:
        dense = loaded.node_arrays()
        if not dense:
            raise CalibrationDataError(
                f"{', '.join(cost_labels)}: the cycles table is empty; record cycles with `python -m live.record`"
            )
        if len(cycles) == 0:  # dense trees without timed cycles (e.g. traces.synthetic)
            note = "no timed cycles: cost model not fitted (acceptance map and predictor tables only)"
        else:
            note = (
                "dense-mode cycles only: each verifies the whole tree and commits one token, so the "
                "fixed and per-node verify costs cannot be told apart: cost model not fitted "
                "(acceptance map and predictor tables only); add policy-mode runs of different tree "
                "sizes, e.g. `python -m live.record --mode policy --policy ar` and `--policy topn`"
            )
        folder = Path(args.out).parent
        folder.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {"notes": [note], "runs": list(loaded.labels), "model": loaded.model.name}
        summary: dict[str, Any] = {"cost": None, "num_cycles": 0, "note": note}
        _fit_dense(dense, loaded, args, folder, report, summary)
        (folder / REPORT_NAME).write_text(json.dumps(_json_safe(report), indent=2, sort_keys=True) + "\n")
        summary["report"] = str(folder / REPORT_NAME)
        return summary
    latency = us_to_s(args.h2d_latency_us) if args.h2d_latency_us is not None else None
    if args.h2d_table is not None:
        hw = loaded.manifests()[0].hardware
        try:
            latency = latency_from_h2d_table(args.h2d_table, [hw.link_kind, hw.h2d_memory])
        except ValueError as exc:
            raise InputError("--h2d-table", str(exc)) from None
    if latency is None:
        latency = emulated_latency_s(loaded, cost_labels)
    options = FitOptions(
        holdout_fraction=args.holdout,
        seed=args.seed,
        robust=args.robust,
        min_cycles=args.min_cycles,
        overlap_h2d=_overlap(args.overlap, loaded),
        known_s_per_transfer=latency,
        verify_target=args.verify_target,
        weighting=args.weighting,
        miss_compute=args.miss_compute,
    )
    out = Path(args.out)
    folder = out.parent
    fit = fit_cost_model(
        cycles,
        transfers,
        expert_bytes=loaded.model.bytes_per_expert,
        num_layers=loaded.model.num_layers,
        options=options,
        source=f"calibration.fit {' '.join(cost_labels)}",
    )
    overlap = None
    if overlap_labels:
        from calibration.costfit import fit_overlap_terms

        overlap = fit_overlap_terms(fit, overlap_cycles, overlap_transfers)
    model = overlap.model if overlap is not None else fit.model
    next_layer = None
    if next_layer_labels:  # next-layer prefetch's share and waste, from the runs that prefetched so
        from dataclasses import replace

        from calibration.costfit import fit_next_layer_terms

        next_layer = fit_next_layer_terms(next_layer_cycles)
        model = replace(model, **next_layer.cost_fields())
    model.save(out)
    report = fit.to_dict()
    report["cost"] = model.to_dict()
    if next_layer is not None:
        report["next_layer_fit"] = {
            "runs": next_layer_labels,
            "next_layer_cover_fraction": next_layer.cover_fraction,
            "next_layer_waste_per_miss": next_layer.waste_per_miss,
            "next_layer_nodes": list(next_layer.nodes),
            "next_layer_cover_fractions": list(next_layer.cover_fractions),
            "next_layer_waste_per_misses": list(next_layer.waste_per_misses),
            "num_cycles": next_layer.num_cycles,
            "num_misses": next_layer.num_misses,
            "num_prefetch_used": next_layer.num_used,
            "num_prefetch_wasted": next_layer.num_wasted,
            "notes": next_layer_notes + list(next_layer.notes),
        }
    if overlap is not None:
        report["serial_cost"] = fit.model.to_dict()
        report["overlap_fit"] = {
            "version": OVERLAP_FIT_REPORT_VERSION,
            "runs": overlap_labels,
            **overlap.report_fields(),
        }
    report["runs"] = list(loaded.labels)
    report["cost_fit_runs"] = cost_labels
    report["model"] = loaded.model.name
    report["options"] = {k: getattr(options, k) for k in options.__dataclass_fields__}
    predictions = cycle_predictions(
        fit.model, cycles, fit.heldout_mask, options.verify_target, fit.compute_s_per_miss
    )
    predictions.to_csv(folder / CYCLES_NAME, index=False)
    params, errors = fit_tables(fit)
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(params.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        print()
        print("absolute % error per term (fit / held-out cycles; h2d_transfer per tensor copy):")
        print(errors.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    more = (overlap.notes if overlap is not None else ()) + (
        tuple(next_layer_notes) + next_layer.notes if next_layer is not None else ()
    )
    for note in fit.notes + more:
        print(f"note: {note}")
    summary: dict[str, Any] = {
        "cost": str(out),
        "num_cycles": len(cycles),
        "cycle_heldout_median_pct": fit.errors["cycle"]["heldout"].median_abs_pct_error,
        "cycle_heldout_p90_pct": fit.errors["cycle"]["heldout"].p90_abs_pct_error,
        "cycle_fit_median_pct": fit.errors["cycle"]["fit"].median_abs_pct_error,
        "cycle_fit_p90_pct": fit.errors["cycle"]["fit"].p90_abs_pct_error,
        "draft_base_s": fit.model.draft_base_s,
        "draft_s_per_level": fit.model.draft_s_per_level,
        "draft_base_note": fit.draft_base_note,
        "h2d_bytes_per_s": fit.model.h2d_bytes_per_s,
        "h2d_us_per_transfer": s_to_us(fit.model.h2d_s_per_transfer),
        "h2d_link_us_per_transfer": s_to_us(fit.h2d_link_s_per_transfer),
        "h2d_host_us_per_transfer": s_to_us(fit.h2d_host_s_per_transfer),
        "compute_us_per_miss": s_to_us(fit.compute_s_per_miss),
        "h2d_identifiable": fit.h2d_identifiable,
    }
    if next_layer is not None:
        summary.update(next_layer_cover_fraction=next_layer.cover_fraction, next_layer_waste_per_miss=next_layer.waste_per_miss)
    if overlap is not None:
        summary.update(
            overlap_mode="on",
            late_call_us=s_to_us(overlap.late_call_s),
            host_us_per_transfer=s_to_us(overlap.model.host_s_per_transfer),
            placing_after_enqueue_us_per_transfer=s_to_us(overlap.model.placing_after_enqueue_s_per_transfer),
            overlap_cycle_median_pct=overlap.cycle_error.median_abs_pct_error,
            overlap_cycle_p90_pct=overlap.cycle_error.p90_abs_pct_error,
        )
    dense = loaded.node_arrays()
    if dense:
        _fit_dense(dense, loaded, args, folder, report, summary)
    else:
        report["notes"].append("no dense trees: acceptance map and predictor tables not fitted")
    (folder / REPORT_NAME).write_text(json.dumps(_json_safe(report), indent=2, sort_keys=True) + "\n")
    summary["report"] = str(folder / REPORT_NAME)
    return summary


def _fit_dense(
    dense: list, loaded: LoadedRuns, args: Any, folder: Path, report: dict[str, Any], summary: dict[str, Any]
) -> None:
    """Acceptance map, reliability table and predictor tables from the dense trees (files in ``folder``).

    Too few dense nodes for the acceptance map is not fatal (the cost model is already written):
    it becomes a note in the report and a warning on stderr.
    """
    try:
        acc = fit_acceptance(
            dense_nodes_frame(dense),
            num_bins=args.acceptance_bins,
            seed=args.seed,
            source=f"calibration.fit {' '.join(label for label, _ in dense)}",
        )
    except AcceptanceDataError as exc:
        report["notes"].append(f"acceptance map not fitted: {exc}")
        print(f"warning: acceptance map not fitted: {exc}", file=sys.stderr)
    else:
        (folder / ACCEPTANCE_NAME).write_text(json.dumps(acc.calibration.to_dict(), indent=2) + "\n")
        acc.reliability.to_csv(folder / RELIABILITY_NAME, index=False)
        report["acceptance"] = {
            "ece_draft": acc.ece_draft,
            "ece_calibrated": acc.ece_calibrated,
            "num_nodes_fit": acc.num_nodes_fit,
            "num_nodes_eval": acc.num_nodes_eval,
            "num_knots": int(acc.calibration.knots_x.size),
        }
        summary["acceptance"] = str(folder / ACCEPTANCE_NAME)
        summary["acceptance_ece_calibrated"] = acc.ece_calibrated
    tables = fit_predictor_tables(
        [a for _, a in dense], loaded.model.num_experts, min_token_count=args.min_token_count
    )
    tables.save(folder / PREDICTORS_NAME)
    report["predictor_tables"] = {
        "num_trees": tables.num_trees,
        "num_tokens": int(tables.token_ids.size),
        "max_nodes": int(tables.union_size.shape[1] - 1),
    }
    summary["predictor_tables"] = str(folder / PREDICTORS_NAME)


def dense_nodes_frame(dense: list) -> Any:
    """A nodes-like DataFrame (NODE_COLUMNS plus ``draft_logprob``, which the default ``edge``
    acceptance scope needs) from ``[(label, NodeArrays), ...]`` of several runs, tree keys made unique."""
    import numpy as np
    import pandas as pd

    frames = []
    for run_index, (_, na) in enumerate(dense):
        sizes = na.tree_sizes
        tree = np.repeat(np.arange(na.num_trees), sizes)
        node_id = np.arange(len(na.parent)) - np.repeat(na.offsets[:-1], sizes)
        frames.append(
            pd.DataFrame(
                {
                    "request_id": np.full(len(tree), run_index),
                    "position": tree,
                    "node_id": node_id,
                    "parent": na.parent,
                    "depth": na.depth,
                    "path_logprob": na.path_logprob,
                    "draft_logprob": na.draft_logprob,
                    "accepted": na.accepted,
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def _json_safe(obj: Any) -> Any:
    import math

    import numpy as np

    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _finite(value: Any) -> bool:
    import math

    return isinstance(value, (int, float)) and math.isfinite(value)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.h2d_latency_us is not None and args.h2d_table is not None:
        parser.fail("--h2d-table", "give either --h2d-table or --h2d-latency-us, not both")
    if args.h2d_table is not None and not Path(args.h2d_table).is_file():
        parser.fail("--h2d-table", f"no such file: {args.h2d_table}")
    # --out is a file: checked, its folder made, before the fit
    parser.ensure_out_file("--out", args.out, f"the cost JSON file to write (e.g. {DEFAULT_OUT})")
    for run_dir in args.run_dirs:  # every input folder, before any work
        if not Path(run_dir).is_dir():
            parser.fail(
                "RUN_DIR", f"{run_dir}: not a directory (expected a run directory with manifest.json)"
            )
    try:
        summary = calibrate(args, parser)
    except (RunInputError, CalibrationDataError, AcceptanceDataError, ValueError) as exc:
        # unreadable runs and readable-but-unusable data alike are bad input: exit 2 naming the run
        parser.fail("RUN_DIR", str(exc))
    if summary["cost"] is None:
        summary.update(ok=True, verdict="no cost model fitted")
        print(f"{summary['note']}: acceptance -> {summary.get('acceptance')}")
        print_summary(summary)
        return 0
    why = "--holdout 0" if args.holdout == 0 else f"too few cycles for --holdout {args.holdout:g}"
    verdict = judge(summary, args.max_median_pct, args.max_p90_pct, no_heldout=why)
    summary.update(verdict)
    _record_verdict(Path(summary["report"]), verdict)
    print(f"cost model -> {summary['cost']}: {verdict['verdict_line']}")
    if not summary["ok"]:
        print(_warning_block(verdict["verdict_line"], args), file=sys.stderr)
    print_summary(summary)
    return 0 if summary["ok"] else 1


def _record_verdict(report_path: Path, verdict: dict[str, Any]) -> None:
    """Add the verdict to ``cost_fit_report.json``, where the tools that load the cost JSON read it
    (:func:`specfit.cost.failed_fit_note`)."""
    report = json.loads(report_path.read_text(encoding="utf-8"))
    report["verdict"] = verdict
    report_path.write_text(json.dumps(_json_safe(report), indent=2, sort_keys=True) + "\n")


def judge(
    summary: dict[str, Any], max_median_pct: float, max_p90_pct: float, no_heldout: str = "none held out"
) -> dict[str, Any]:
    """The fit's verdict against the thresholds: held-out per-cycle median and p90 |% error|
    (``cycle_heldout_*_pct`` of ``summary``), or, when no cycle is held out, the fit cycles'
    (``cycle_fit_*_pct``, ``"in-sample"``; in-sample errors flatter the model and the line says so,
    with ``no_heldout``, the reason none was held out).

    Returns:
        ``{"ok", "verdict" ("pass"|"fail"), "verdict_on" ("held-out"|"in-sample"), "thresholds":
        {"max_median_pct", "max_p90_pct"}, "verdict_line"}``; ``ok`` is False when either error
        exceeds its threshold or cannot be computed.
    """
    on = "held-out"
    median, p90 = summary.get("cycle_heldout_median_pct"), summary.get("cycle_heldout_p90_pct")
    if not (_finite(median) and _finite(p90)):
        on = "in-sample"
        median, p90 = summary.get("cycle_fit_median_pct"), summary.get("cycle_fit_p90_pct")
    thresholds = {"max_median_pct": max_median_pct, "max_p90_pct": max_p90_pct}
    if not (_finite(median) and _finite(p90)):
        line = "no cycle errors to judge (FAIL)"
        return {"ok": False, "verdict": "fail", "verdict_on": None, "thresholds": thresholds, "verdict_line": line}
    misses = []
    if median > max_median_pct:
        misses.append(f"median {median:.2f}% > {max_median_pct:g}%")
    if p90 > max_p90_pct:
        misses.append(f"p90 {p90:.2f}% > {max_p90_pct:g}%")
    ok = not misses
    line = (
        f"{on} cycle error median {median:.2f}% (<= {max_median_pct:g}%), p90 {p90:.2f}% "
        f"(<= {max_p90_pct:g}%): " + ("PASS" if ok else "FAIL, " + "; ".join(misses))
    )
    if on == "in-sample":
        line += f"; no held-out cycles ({no_heldout}): judged on the fit cycles, which flatters the model"
    verdict = "pass" if ok else "fail"
    return {"ok": ok, "verdict": verdict, "verdict_on": on, "thresholds": thresholds, "verdict_line": line}


def _warning_block(line: str, args: Any) -> str:
    """The loud stderr warning of a fit that misses its thresholds (what it means, what to try)."""
    bar = "!" * 78
    return "\n".join(
        [
            bar,
            f"WARNING: the fitted cost model misses its accuracy thresholds: {line}.",
            "The planner and the simulator would price cycles with this error. cost.json is written",
            "but not to be trusted as is. Common causes: too few or too similar runs (record policy",
            "runs of several tree sizes and draft depths), a machine busy with other work while",
            "recording (timing noise), or an emulated link too fast to separate from compute.",
            f"Thresholds: --max-median-pct {args.max_median_pct:g} --max-p90-pct {args.max_p90_pct:g}.",
            bar,
        ]
    )


if __name__ == "__main__":
    run_main(main)
