"""Simulator-vs-live fidelity of one cell (pure pandas/numpy; conventions in docs/metrics.md).

A *cell* is one (bandwidth, cache size, tree policy) configuration run twice: live (policy-mode
cycles recorded by ``live.record``) and simulated (``sim.replay.replay_policy`` on the dense trace
of the same prompts, same cost model). :func:`compare_cell` returns one row of ``fidelity.csv``.

Targets (issue 7): cost model per-cycle median |error| <= 2 % and p90 <= 5 %; simulated vs live
throughput within 2 %; hit rate within 0.5 points; same subtree in >= 99 % of decisions. When a
target is missed, ``off_terms`` names what is off: the cost term with the largest per-cycle error
(``draft``, ``verify``, ``h2d_cycle``, from :func:`calibration.costfit.evaluate`), ``cache`` for a
hit-rate gap, ``decisions`` for differing subtrees, ``throughput`` otherwise.

Repeats and the noise floor: a live cell may be recorded R times (same inputs, same cost JSON,
so the same decisions). :func:`match_repeats` pairs the repeats' cycles on (``request_id``,
``cycle_index``) and keeps those that did the same work in every repeat (same verified nodes,
position, draft levels and per-layer misses); :func:`mean_repeat_cycles` averages their timings;
:func:`cycle_noise_pct` measures the per-cycle run-to-run coefficient of variation and
:func:`repeat_spread_pct` the spread of the repeats' throughputs. :func:`compare_cell` compares
the simulator with the pooled live throughput and the cost model with the per-cycle mean over
repeats, and reports ``within_noise``: every missed timing target is inside that measured floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from analysis import metrics
from calibration.costfit import evaluate, model_cycle_s, predict_terms, worst_term
from specfit.cost import CycleCostModel


@dataclass(frozen=True)
class Targets:
    """Fidelity targets (percent, points, fraction)."""

    cycle_median_pct: float = 2.0
    cycle_p90_pct: float = 5.0
    throughput_pct: float = 2.0
    hit_rate_points: float = 0.5
    same_subtree_fraction: float = 0.99


def live_totals(cycles: pd.DataFrame) -> dict[str, float]:
    """Live decode throughput (committed tokens / sum of ``cycle_s``) and hit rate of a cycles table."""
    summary = metrics.cycle_summary(cycles)
    return {"tokens_per_s": summary["tokens_per_s"], "hit_rate": summary["hit_rate"], "tau": summary["tau"]}


def same_subtree(live: pd.DataFrame, sim: pd.DataFrame) -> tuple[int, int]:
    """(matched cycles, cycles whose verified node sets are identical), matched on (request, position).

    Args:
        live, sim: cycles tables with ``request_id``, ``position`` and ``verified_nodes``.

    Only positions both runs reached are compared (after a different choice the runs may commit
    different lengths and visit different positions).
    """
    key = ["request_id", "position"]
    a = live[[*key, "verified_nodes"]].rename(columns={"verified_nodes": "live_nodes"})
    b = sim[[*key, "verified_nodes"]].rename(columns={"verified_nodes": "sim_nodes"})
    merged = a.merge(b, on=key, how="inner")
    same = sum(
        np.array_equal(np.sort(np.asarray(x, dtype=np.int64)), np.sort(np.asarray(y, dtype=np.int64)))
        for x, y in zip(merged["live_nodes"], merged["sim_nodes"])
    )
    return len(merged), int(same)


def cycle_errors(cost: CycleCostModel, cycles: pd.DataFrame) -> np.ndarray:
    """Per-cycle signed % error of ``cost.cycle_s`` (recorded levels, nodes, context, misses)
    against the measured model cycle (``cycle_s - decision_s``)."""
    if not len(cycles):
        return np.zeros(0)
    predicted = predict_terms(cost, cycles)["cycle"]
    measured = model_cycle_s(cycles)
    keep = measured > 0
    return metrics.percentage_error(predicted[keep], measured[keep])


def compare_cell(
    key: dict[str, Any],
    live_cycles: pd.DataFrame,
    live_transfers: pd.DataFrame,
    sim_totals: dict[str, Any],
    sim_cycles: pd.DataFrame,
    cost: CycleCostModel,
    targets: Targets | None = None,
    cost_split: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One ``fidelity.csv`` row.

    Args:
        key: the cell's configuration (``bandwidth_gb_per_s``, ``cache_experts_per_layer``,
            ``policy``), copied into the row.
        live_cycles, live_transfers: the live run's tables.
        sim_totals: ``ReplayTotals.to_dict()`` of the replay (``tokens_per_s``, ``hit_rate``).
        sim_cycles: the replay's cycle records as a DataFrame.
        cost: the cost model both used.
        targets: :class:`Targets`.
        cost_split: the non-link parts of ``cost.h2d_s_per_transfer`` when the cost was fitted
            (:meth:`calibration.costfit.CostFit.term_split`), so the per-term errors compare each
            term with what it measures; ``None`` = all link time.

    Returns:
        dict with live/sim throughput and hit rate, ``throughput_error_pct``,
        ``hit_rate_diff_points``, ``num_decisions_compared``, ``same_subtree_fraction``, per-cycle
        cost-model error median / p90 (``cycle_error_median_pct``, ``cycle_error_p90_pct``), the
        planner's own logged prediction error median (``planner_error_median_pct``), per-term
        median errors, ``ok`` and ``off_terms``.
    """
    t = targets or Targets()
    live = live_totals(live_cycles)
    sim_tps, sim_hit = float(sim_totals["tokens_per_s"]), float(sim_totals["hit_rate"])
    tp_err = float(metrics.percentage_error([sim_tps], [live["tokens_per_s"]])[0])
    hit_diff = (
        metrics.hit_rate_difference_points(sim_hit, live["hit_rate"])
        if np.isfinite(live["hit_rate"])
        else np.nan
    )
    compared, same = same_subtree(live_cycles, sim_cycles) if len(sim_cycles) else (0, 0)
    errors = cycle_errors(cost, live_cycles)
    abs_err = np.abs(errors)
    planner_err = np.nan
    planner = pd.to_numeric(live_cycles.get("predicted_cycle_s", pd.Series(dtype=float)), errors="coerce")
    if len(planner) == len(live_cycles) and planner.notna().any():
        ok = planner.notna().to_numpy()
        meas = model_cycle_s(live_cycles)[ok]
        planner_err = float(np.median(np.abs(metrics.percentage_error(planner.to_numpy()[ok], meas))))
    terms = evaluate(cost, live_cycles, live_transfers, **(cost_split or {}))
    row: dict[str, Any] = dict(key)
    row.update(
        live_tokens_per_s=live["tokens_per_s"],
        sim_tokens_per_s=sim_tps,
        throughput_error_pct=tp_err,
        live_hit_rate=live["hit_rate"],
        sim_hit_rate=sim_hit,
        hit_rate_diff_points=hit_diff,
        live_tau=live["tau"],
        sim_tau=float(sim_totals.get("tau", np.nan)),
        num_cycles_live=len(live_cycles),
        num_decisions_compared=compared,
        same_subtree_fraction=same / compared if compared else np.nan,
        cycle_error_median_pct=float(np.median(abs_err)) if abs_err.size else np.nan,
        cycle_error_p90_pct=float(np.percentile(abs_err, 90)) if abs_err.size else np.nan,
        planner_error_median_pct=planner_err,
        draft_error_median_pct=terms["draft"].median_abs_pct_error,
        verify_error_median_pct=terms["verify"].median_abs_pct_error,
        h2d_error_median_pct=terms["h2d_cycle"].median_abs_pct_error,
    )
    off: list[str] = []
    if not (
        row["cycle_error_median_pct"] <= t.cycle_median_pct and row["cycle_error_p90_pct"] <= t.cycle_p90_pct
    ):
        off.append(worst_term(terms) or "cycle")
    if not abs(hit_diff) <= t.hit_rate_points:
        off.append("cache")
    if compared and not row["same_subtree_fraction"] >= t.same_subtree_fraction:
        off.append("decisions")
    if not abs(tp_err) <= t.throughput_pct and not off:
        off.append("throughput")
    row["ok"] = not off
    row["off_terms"] = ";".join(off)
    return row


def overall(rows: Sequence[dict[str, Any]], per_cycle_errors: Sequence[np.ndarray]) -> dict[str, Any]:
    """Grid summary: pooled per-cycle |error| median / p90, worst cell figures, cells passing."""
    pooled = (
        np.abs(np.concatenate([np.asarray(e) for e in per_cycle_errors])) if per_cycle_errors else np.zeros(0)
    )
    df = pd.DataFrame(list(rows))
    out: dict[str, Any] = {
        "num_cells": len(df),
        "num_cells_ok": int(df["ok"].sum()) if len(df) else 0,
        "cycle_error_median_pct": float(np.median(pooled)) if pooled.size else np.nan,
        "cycle_error_p90_pct": float(np.percentile(pooled, 90)) if pooled.size else np.nan,
    }
    if len(df):
        out["max_abs_throughput_error_pct"] = float(df["throughput_error_pct"].abs().max())
        out["max_abs_hit_rate_diff_points"] = float(df["hit_rate_diff_points"].abs().max())
        frac = df["same_subtree_fraction"].dropna()
        out["min_same_subtree_fraction"] = float(frac.min()) if len(frac) else np.nan
    return out
