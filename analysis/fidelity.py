"""Simulator-vs-live fidelity of one cell (pure pandas/numpy; conventions in docs/metrics.md).

A *cell* is one (bandwidth, cache size, tree policy) configuration run twice: live (policy-mode
cycles recorded by ``live.record``) and simulated (``sim.replay.replay_policy`` on the dense trace
of the same prompts, same cost model). :func:`compare_cell` returns one row of ``fidelity.csv``.

Aims (issue 13, :class:`Targets`): per cell, the simulated-vs-live throughput error within the
cell's measured repeat spread and the cost model's per-cycle median |error| within the cell's
measured per-cycle noise (the fixed 2 % / 3 % when the noise is not measured, ``--repeats 1``), hit
rate within 0.5 points, same subtree in >= 99 % of decisions (``aim_*`` columns, ``ok`` = all four);
over the grid, per-cycle median |error| <= 3 % and p90 <= 8 % (:func:`overall`). When an aim is
missed, ``off_terms`` names what is off: the cost term with the largest per-cycle error
(``draft``, ``verify``, ``h2d_cycle``, from :func:`calibration.costfit.evaluate`), ``cache`` for a
hit-rate gap, ``decisions`` for differing subtrees, ``throughput`` otherwise; and
:func:`missed_aims` says it in words with the measured noise beside each missed figure.

Where an error lives: :func:`error_split` splits the simulated-minus-live time of a cell's cycles
into its terms (draft, decision, verify compute, per-miss H2D, prefetch copies, cache effects,
overlap), each as a
share of the live time, so the split adds up to the cell's signed time error; :func:`by_policy`
pools the per-cycle errors and the split per (policy, bandwidth).

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
    """Fidelity aims (issue 13; percent, points, fraction).

    ``cycle_median_pct`` / ``cycle_p90_pct``: the grid's pooled per-cycle |error| median and p90
    (:func:`overall`); per cell, ``cycle_median_pct`` and ``throughput_pct`` are the fallbacks of
    the noise-relative aims when a cell's noise is not measured (one repeat), and the fixed
    targets whose misses ``within_noise`` checks against the measured floor.
    """

    cycle_median_pct: float = 3.0
    cycle_p90_pct: float = 8.0
    throughput_pct: float = 2.0
    hit_rate_points: float = 0.5
    same_subtree_fraction: float = 0.99


CELL_KEY = ("bandwidth_gb_per_s", "cache_experts_per_layer", "policy", "overlap", "prefetch")
"""The columns that name one validation cell in ``fidelity.csv`` and ``cycle_errors.csv``
(``analysis.validate.Cell.key``); files written before overlap and prefetch cells lack the last two."""

SPLIT_TERMS = ("draft", "decision", "verify", "h2d", "prefetch", "cache", "overlap")
"""The terms :func:`error_split` splits a cell's simulated-minus-live time into."""

# Short headers of the printed / Markdown per-cell tables (``analysis.validate`` stdout,
# ``analysis.report``); fidelity.csv keeps the full names (docs/metrics.md defines them).
SHORT_COLUMNS = {
    "bandwidth_gb_per_s": "bw_GBps",
    "cache_experts_per_layer": "cache",
    "policy": "policy",
    "live_tokens_per_s": "live_tps",
    "sim_tokens_per_s": "sim_tps",
    "throughput_error_pct": "tput_err%",
    "live_repeat_spread_pct": "spread%",
    "hit_rate_diff_points": "hit_dpts",
    "same_subtree_fraction": "same_sub",
    "cycle_error_median_pct": "err_med%",
    "cycle_error_p90_pct": "err_p90%",
    "cycle_noise_median_pct": "noise_med%",
    "cycle_noise_p90_pct": "noise_p90%",
    "planner_error_median_pct": "planner_med%",
    "aim_throughput": "tput_ok",
    "aim_cycle_median": "med_ok",
    "aim_hit_rate": "hit_ok",
    "aim_same_subtree": "sub_ok",
    "off_terms": "off_terms",
    "prefetch_counts_identical": "pf_same",
    "within_noise": "within_noise",
    "ok": "ok",
    "cycle_error_signed_median_pct": "err_signed_med%",
    "probe_speed_index": "probe_x",
    "norm_throughput_error_pct": "n_tput_err%",
    "norm_cycle_error_median_pct": "n_err_med%",
    "norm_within_noise": "n_within",
    **{f"split_{t}_pct": f"d_{t}%" for t in SPLIT_TERMS},
}


def short_table(table: pd.DataFrame, columns: Sequence[str]) -> tuple[pd.DataFrame, str]:
    """``table[columns]`` (those present) renamed to :data:`SHORT_COLUMNS`, and a legend line
    mapping every renamed header to its fidelity.csv name (``"columns: bw_GBps = ..., ..."``)."""
    cols = [c for c in columns if c in table.columns]
    renamed = {c: SHORT_COLUMNS.get(c, c) for c in cols}
    legend = ", ".join(f"{short} = {full}" for full, short in renamed.items() if short != full)
    return table[cols].rename(columns=renamed), f"columns (fidelity.csv names): {legend}"


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
    against the measured model cycle (``cycle_s - decision_s``).

    Args:
        cost: the cost model to score.
        cycles: C rows of a cycles table (``calibration.costfit.predict_terms``' columns).

    Returns:
        float64[C'] ``100 * (predicted - measured) / measured`` (%) over the C' cycles whose
        measured model cycle is > 0 (:func:`analysis.metrics.percentage_error`).
    """
    if not len(cycles):
        return np.zeros(0)
    predicted = predict_terms(cost, cycles)["cycle"]
    measured = model_cycle_s(cycles)
    keep = measured > 0
    return metrics.percentage_error(predicted[keep], measured[keep])


REPEAT_KEY = ("request_id", "cycle_index")
# columns that must agree for a cycle to count as the same work in every repeat (when present)
SAME_WORK_COLUMNS = ("position", "num_draft_levels", "layer_misses")
# timing columns averaged over repeats by :func:`mean_repeat_cycles` (seconds)
TIMING_COLUMNS = ("draft_s", "verify_s", "h2d_s", "cycle_s", "decision_s")


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in np.asarray(value, dtype=np.int64).ravel())


@dataclass(frozen=True)
class RepeatMatch:
    """Cycles of R repeats of one live cell paired cycle by cycle (:func:`match_repeats`).

    Attributes:
        tables: R cycles tables restricted to the matched cycles, sorted by (``request_id``,
            ``cycle_index``), row ``i`` of every table being the same cycle (index 0..M-1).
        num_compared: cycles (``request_id``, ``cycle_index``) present in every repeat (count).
        num_same_subtree: of those, cycles whose verified node sets agree in every repeat (count).
    """

    tables: list[pd.DataFrame]
    num_compared: int
    num_same_subtree: int

    @property
    def num_repeats(self) -> int:
        """R, the number of repeats."""
        return len(self.tables)

    @property
    def num_matched(self) -> int:
        """M, cycles that did the same work in every repeat (rows of each table)."""
        return len(self.tables[0])

    @property
    def same_subtree_fraction(self) -> float:
        """``num_same_subtree / num_compared``; NaN with one repeat or no cycle in common."""
        if self.num_repeats < 2 or not self.num_compared:
            return float("nan")
        return self.num_same_subtree / self.num_compared


def match_repeats(repeats: Sequence[pd.DataFrame]) -> RepeatMatch:
    """Pair the cycles of R repeats of one cell on (``request_id``, ``cycle_index``).

    A cycle is *matched* when it is present in every repeat with the same verified node set
    (``verified_nodes``, compared as sets) and, for the columns present, the same ``position``,
    ``num_draft_levels`` and ``layer_misses``: the same work, so its timings differ only by
    run-to-run noise. Decisions are deterministic, so normally every cycle matches; a cycle
    whose subtree differs is dropped (and the repeats may then diverge, which the misses and
    positions of the later cycles catch).

    Args:
        repeats: R >= 1 cycles tables (``live.record`` policy mode) of the same cell.

    Returns:
        :class:`RepeatMatch`. With R = 1 every cycle matches (``same_subtree_fraction`` NaN).

    Raises:
        ValueError: no table, a table missing ``request_id`` / ``cycle_index`` /
            ``verified_nodes`` (named with its repeat), or a (request, cycle) twice in one table.
    """
    if not len(repeats):
        raise ValueError("repeats: expected at least one cycles table, got none")
    indexed = []
    for r, df in enumerate(repeats, start=1):
        missing = [c for c in (*REPEAT_KEY, "verified_nodes") if c not in df.columns]
        if missing:
            raise ValueError(f"repeats: repeat {r} cycles table lacks column(s) {missing}")
        index = pd.MultiIndex.from_arrays([df[c].astype(np.int64).to_numpy() for c in REPEAT_KEY])
        if index.has_duplicates:
            raise ValueError(f"repeats: repeat {r} has a (request_id, cycle_index) more than once")
        indexed.append(df.set_axis(index, axis=0))
    common = indexed[0].index
    for t in indexed[1:]:
        common = common.intersection(t.index)
    common = common.sort_values()
    aligned = [t.loc[common] for t in indexed]
    nodes = [[tuple(sorted(_ints(v))) for v in t["verified_nodes"]] for t in aligned]
    same_nodes = np.array(
        [all(n[i] == nodes[0][i] for n in nodes[1:]) for i in range(len(common))], dtype=bool
    )
    same_work = same_nodes.copy()
    for col in SAME_WORK_COLUMNS:
        if all(col in t.columns for t in aligned):
            vals = [[_ints(v) for v in t[col]] for t in aligned]
            same_work &= np.array(
                [all(v[i] == vals[0][i] for v in vals[1:]) for i in range(len(common))], dtype=bool
            )
    tables = [t[same_work].reset_index(drop=True) for t in aligned]
    return RepeatMatch(tables=tables, num_compared=len(common), num_same_subtree=int(same_nodes.sum()))


def mean_repeat_cycles(match: RepeatMatch) -> pd.DataFrame:
    """One cycles table of the matched cycles with each timing averaged over the repeats.

    ``draft_s``, ``verify_s``, ``h2d_s``, ``cycle_s`` and ``decision_s`` (seconds) are the mean
    over the R repeats of the same cycle (a null ``decision_s`` counts as 0 s, as in
    :func:`calibration.costfit.model_cycle_s`; it stays null when null in every repeat); every
    other column (levels, nodes, context, misses, ...) comes from repeat 1, where it is the same
    in every repeat for the fields that define a match. ``stall_s`` (added when every repeat has
    ``layer_stall_s``) is the mean over the repeats of each cycle's summed ``layer_stall_s`` (the
    compute stream's waits for copies; NaN where a repeat left it null), which :func:`error_split`
    uses. With R = 1 it is repeat 1's table (plus ``stall_s``).
    """
    out = match.tables[0].copy()
    for col in TIMING_COLUMNS:
        if col not in out.columns:
            continue
        vals = np.stack(
            [pd.to_numeric(t[col], errors="coerce").to_numpy(dtype=np.float64) for t in match.tables]
        )
        if col == "decision_s":
            all_null = np.isnan(vals).all(axis=0)
            mean = np.where(all_null, np.nan, np.nan_to_num(vals, nan=0.0).mean(axis=0))
        else:
            mean = vals.mean(axis=0)
        out[col] = mean
    if all("layer_stall_s" in t.columns for t in match.tables):
        stalls = np.stack([_stall_s(t) for t in match.tables])  # NaN where a repeat did not record it
        out["stall_s"] = stalls.mean(axis=0)
    return out


def _stall_s(cycles: pd.DataFrame) -> np.ndarray:
    """float64[C]: seconds each cycle's compute stream waited for copies, the sum of its
    ``layer_stall_s`` (NaN where it is null or the column is missing)."""
    if "layer_stall_s" not in cycles.columns:
        return np.full(len(cycles), np.nan)
    return np.array(
        [np.nan if v is None or np.isscalar(v) else float(np.sum(v)) for v in cycles["layer_stall_s"]],
        dtype=np.float64,
    )


def run_speed_factors(match: RepeatMatch) -> np.ndarray:
    """float64[R]: each repeat's whole-run speed factor, the median over the matched cycles of its
    model cycle time (:func:`calibration.costfit.model_cycle_s`) divided by that cycle's mean over
    the R repeats (1.2 = the run took 20 % longer than the repeats' average on the typical cycle).

    On a machine whose speed drifts between runs (this project's 2-core microVM: 0.7-1.3 in idle
    validate runs) most of the per-cycle noise across repeats is this factor, common to every
    cycle of a run; the rest is per cycle. All 1 with R = 1; NaN with no matched cycle.
    """
    if not match.num_matched:
        return np.full(match.num_repeats, np.nan)
    measured = np.stack([model_cycle_s(t) for t in match.tables])  # R x M
    mean = measured.mean(axis=0)
    keep = mean > 0
    if not keep.any():
        return np.full(match.num_repeats, np.nan)
    return np.median(measured[:, keep] / mean[keep], axis=1)


def cycle_noise_pct(match: RepeatMatch, run_normalised: bool = False) -> np.ndarray:
    """float64[M] per matched cycle: coefficient of variation (%) of the model cycle time
    (``cycle_s - decision_s``, :func:`calibration.costfit.model_cycle_s`) across the repeats,
    ``100 * std(ddof=1) / mean``; all NaN with R = 1 (no noise measured), NaN where the mean is 0.

    ``run_normalised``: each repeat's times divided by its :func:`run_speed_factors` first, so
    what is left is the per-cycle part of the noise (the whole-run speed part removed).
    """
    if match.num_repeats < 2 or not match.num_matched:
        return np.full(match.num_matched, np.nan)
    measured = np.stack([model_cycle_s(t) for t in match.tables])
    if run_normalised:
        factors = run_speed_factors(match)
        if np.all(np.isfinite(factors)) and np.all(factors > 0):
            measured = measured / factors[:, None]
    mean = measured.mean(axis=0)
    std = measured.std(axis=0, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean > 0, 100.0 * std / mean, np.nan)


DEVIATION_PREFIX = "cycle_deviation_pct_"  # cycle_error_table's per-repeat deviation columns: <prefix><r>


def cycle_deviation_pct(match: RepeatMatch) -> np.ndarray:
    """float64[R, M]: each repeat's leave-one-out deviation per matched cycle, the error (signed %)
    that ONE repeat shows against the others, scaled to the 1-repeat error of a model without bias:
    ``100 * (x_r - mean of the other repeats) * sqrt((R - 1) / R) / mean`` (= ``100 * sqrt(R / (R -
    1)) * (x_r - mean) / mean``) of the model cycle time (:func:`calibration.costfit.model_cycle_s`).

    With Gaussian per-cycle noise of standard deviation ``s_i`` (% of the mean), each deviation is
    ``N(0, s_i)`` exactly (``x_r - mean_{-r}`` has variance ``s_i^2 R / (R - 1)``), so the pooled
    |deviations| sample the mixture of the cycles' half-normal laws without the bias that quantiles
    of per-cycle CVs estimated from R samples carry (their scatter lowers the mixture's median ~2x
    at R = 2-3; reviewer rev1's finding 2). All NaN with R = 1 or no matched cycle; NaN where a
    cycle's mean is 0.
    """
    r = match.num_repeats
    if r < 2 or not match.num_matched:
        return np.full((r, match.num_matched), np.nan)
    measured = np.stack([model_cycle_s(t) for t in match.tables])  # R x M
    mean = measured.mean(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean > 0, 100.0 * np.sqrt(r / (r - 1)) * (measured - mean) / mean, np.nan)


def _deviation_quantile(deviation_pct: np.ndarray, quantile: float) -> float:
    """The ``quantile`` of the finite |deviations| (%), NaN without one; ValueError outside (0, 1)."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile: expected a fraction in (0, 1), got {quantile!r}")
    dev = np.abs(np.asarray(deviation_pct, dtype=np.float64).ravel())
    dev = dev[np.isfinite(dev)]
    return float(np.quantile(dev, quantile)) if dev.size else float("nan")


def noise_floor_pct(deviation_pct: np.ndarray, repeats: int, quantile: float) -> float:
    """The ``quantile`` of the per-cycle |error| (%) that a model WITHOUT bias would show against
    the mean of ``repeats`` repeats, from the cycles' leave-one-out deviations (``deviation_pct``,
    :func:`cycle_deviation_pct`, any shape, pooled; NaN entries left out).

    A bias-free model misses a 1-repeat measurement by the deviation's law; the mean of R repeats
    has ``1 / sqrt(R)`` of each cycle's noise, and the quantile of a mixture of zero-centred
    laws scaled alike scales alike, so the floor is ``quantile(|deviation|) / sqrt(R)`` (exact
    for Gaussian noise, up to the sample quantile). 0 when every deviation is 0; NaN with fewer
    than 2 repeats or no finite deviation. A cell's per-cycle error median near its floor is
    noise, not bias.

    Raises:
        ValueError: ``quantile`` outside (0, 1).
    """
    value = _deviation_quantile(deviation_pct, quantile)
    return value / np.sqrt(repeats) if repeats >= 2 else float("nan")


def repeats_for_aim(deviation_pct: np.ndarray, aim_pct: float, quantile: float) -> int | None:
    """The fewest repeats per cell (at least 2, the fewest that measure noise) at which a model
    WITHOUT bias meets ``aim_pct`` at ``quantile`` of the per-cycle |error|: the smallest R with
    :func:`noise_floor_pct` ``<= aim_pct``, ``ceil((quantile(|deviation|) / aim)^2)``. Assumes the
    repeats' noise independent, which a machine drifting over minutes breaks. None without a finite
    deviation (2 when all are 0).

    Raises:
        ValueError: ``quantile`` outside (0, 1) or ``aim_pct <= 0``.
    """
    if not aim_pct > 0:
        raise ValueError(f"aim_pct: expected a percentage > 0, got {aim_pct!r}")
    value = _deviation_quantile(deviation_pct, quantile)
    if not np.isfinite(value):
        return None
    return max(2, int(np.ceil((value / aim_pct) ** 2 - 1e-9)))


def repeat_spread_pct(tokens_per_s: Sequence[float]) -> float:
    """Run-to-run spread of the repeats' throughputs: ``100 * (max - min) / mean`` (percent).

    NaN with fewer than two values or a non-finite / zero mean.
    """
    values = np.asarray(list(tokens_per_s), dtype=np.float64)
    if values.size < 2 or not np.all(np.isfinite(values)) or values.mean() <= 0:
        return float("nan")
    return float(100.0 * (values.max() - values.min()) / values.mean())


def cycle_error_table(cost: CycleCostModel, match: RepeatMatch) -> pd.DataFrame:
    """One row per matched cycle: ``request_id``, ``cycle_index``, ``measured_cycle_s`` (mean
    over repeats of the model cycle, s), ``predicted_cycle_s`` (``cost.cycle_s`` with the
    recorded levels, nodes, context, misses; s), ``cycle_error_pct`` (signed %, NaN where the
    measured mean is 0), ``cycle_noise_pct`` (:func:`cycle_noise_pct`) and ``cycle_run_noise_pct``
    (the same with each repeat divided by its :func:`run_speed_factors`: the per-cycle part), and
    per repeat r (1-based) ``cycle_deviation_pct_<r>`` (:func:`cycle_deviation_pct`: its
    leave-one-out deviation, what :func:`noise_floor_pct` and :func:`repeats_for_aim` read). Every
    column is there even when no cycle matched."""
    mean = mean_repeat_cycles(match)
    out = mean[list(REPEAT_KEY)].reset_index(drop=True).copy()
    if not len(mean):
        out = out.assign(
            measured_cycle_s=[], predicted_cycle_s=[], cycle_error_pct=[], cycle_noise_pct=[], cycle_run_noise_pct=[]
        )
        return out.assign(**{f"{DEVIATION_PREFIX}{r + 1}": [] for r in range(match.num_repeats)})
    measured = model_cycle_s(mean)
    predicted = predict_terms(cost, mean)["cycle"]
    errors = np.full(len(mean), np.nan)
    keep = measured > 0
    if keep.any():
        errors[keep] = metrics.percentage_error(predicted[keep], measured[keep])
    out["measured_cycle_s"] = measured
    out["predicted_cycle_s"] = predicted
    out["cycle_error_pct"] = errors
    out["cycle_noise_pct"] = cycle_noise_pct(match)
    out["cycle_run_noise_pct"] = cycle_noise_pct(match, run_normalised=True)
    for r, deviation in enumerate(cycle_deviation_pct(match)):
        out[f"{DEVIATION_PREFIX}{r + 1}"] = deviation
    return out


def table_deviations_pct(table: pd.DataFrame) -> np.ndarray:
    """float64[R * M]: the leave-one-out deviations (%) a :func:`cycle_error_table` (or
    ``cycle_errors.csv``) holds in its ``cycle_deviation_pct_<r>`` columns, pooled (empty without)."""
    columns = [c for c in table.columns if str(c).startswith(DEVIATION_PREFIX)]
    return table[columns].to_numpy(dtype=np.float64).ravel() if columns else np.zeros(0)


def _floor(target: float, noise: float) -> float:
    """The larger of a target and a measured noise figure (the target when noise is NaN)."""
    return max(target, noise) if np.isfinite(noise) else target


def _median(values: np.ndarray) -> float:
    values = values[np.isfinite(values)]
    return float(np.median(values)) if values.size else np.nan


def _p90(values: np.ndarray) -> float:
    values = values[np.isfinite(values)]
    return float(np.percentile(values, 90)) if values.size else np.nan


def _tables(name: str, value: pd.DataFrame | Sequence[pd.DataFrame]) -> list[pd.DataFrame]:
    tables = [value] if isinstance(value, pd.DataFrame) else list(value)
    if not tables:
        raise ValueError(f"{name}: expected a table or one table per repeat, got none")
    return tables


def sim_cycle_agreement(live_cycles: pd.DataFrame, sim_cycles: pd.DataFrame) -> dict[str, float]:
    """Per-cycle times, simulated vs live, the statistics simulator validations report.

    ``live_cycles``: one live run's cycles table; ``sim_cycles``: the replay's cycle records (both
    with ``request_id``, ``cycle_index``, ``cycle_s``). Cycles present in both (same request and
    cycle index) give the percentage errors ``100 * (sim - live) / live``; the two-sample
    Kolmogorov-Smirnov test (``scipy.stats.ks_2samp``, two-sided) compares all per-cycle times of
    the two sides as distributions.

    Returns:
        ``sim_cycle_mean_abs_pct_error`` and ``sim_cycle_mean_signed_pct_error`` (%, NaN without
        a shared cycle), ``cycle_ks_statistic`` (0..1) and ``cycle_ks_pvalue`` (NaN when a side
        has no cycle).
    """
    from scipy.stats import ks_2samp

    keys = ["request_id", "cycle_index"]
    out = dict.fromkeys(
        (
            "sim_cycle_mean_abs_pct_error",
            "sim_cycle_mean_signed_pct_error",
            "cycle_ks_statistic",
            "cycle_ks_pvalue",
        ),
        float("nan"),
    )
    if not len(live_cycles) or not len(sim_cycles):
        return out
    both = live_cycles[[*keys, "cycle_s"]].merge(
        sim_cycles[[*keys, "cycle_s"]], on=keys, suffixes=("_live", "_sim")
    )
    if len(both):
        err = metrics.percentage_error(both["cycle_s_sim"].to_numpy(), both["cycle_s_live"].to_numpy())
        out["sim_cycle_mean_abs_pct_error"] = float(np.mean(np.abs(err)))
        out["sim_cycle_mean_signed_pct_error"] = float(np.mean(err))
    ks = ks_2samp(sim_cycles["cycle_s"].to_numpy(dtype=float), live_cycles["cycle_s"].to_numpy(dtype=float))
    out["cycle_ks_statistic"], out["cycle_ks_pvalue"] = float(ks.statistic), float(ks.pvalue)
    return out


def _numeric(df: pd.DataFrame, column: str) -> np.ndarray:
    """float64[rows] column ``column`` of ``df`` (seconds or counts: per-cycle means over repeats
    may be fractional), a missing or non-numeric value read as 0."""
    return pd.to_numeric(df[column], errors="coerce").fillna(0.0).to_numpy(dtype=np.float64)


def error_split(
    live: pd.DataFrame,
    sim: pd.DataFrame,
    cost: CycleCostModel,
    compute_s_per_miss: float = 0.0,
) -> dict[str, float]:
    """Where a cell's simulated-vs-live time difference lives, term by term.

    Cycles of ``live`` (one run, or the per-cycle mean over repeats, :func:`mean_repeat_cycles`)
    and ``sim`` (the replay's cycle records) are paired on (``request_id``, ``cycle_index``) and
    kept when both verified the same subtree (same work, so the difference is the model's). With
    ``m_s`` / ``m_l`` the simulated / live demand misses (``cache_misses``), ``i_s`` / ``i_l``
    the experts they prefetched (``num_prefetch_issued``, null or absent = 0: draft and next-layer
    prefetch), ``s = cost.priced_s_per_miss`` (the one cost formula's per-miss price: ``s_per_miss``,
    or ``host + max(T_link - P, 0)`` where the engines run a copy stream with a placing after the
    enqueue ``P > 0``) and ``c = compute_s_per_miss`` (the per-miss compute folded
    into ``s`` by ``calibration.costfit``'s ``miss_compute``;
    :meth:`calibration.costfit.CostFit.term_split`), the live ``h2d_s`` (every copy of the cycle,
    demand and prefetch, and their placing) split by copy count into its demand part
    ``D_l = h2d_s * m_l / (m_l + i_l)`` and its prefetch part ``P_l = h2d_s - D_l`` (an expert's
    copies are the same size whichever asked for them; the split is per cycle and approximate:
    the live ``h2d_s`` also holds the copies of prefetches issued in the previous forward that
    land in this one, while ``num_prefetch_issued`` counts this forward's issues, so a cycle's
    ``P_l`` mixes the two), and the live stall ``w_l`` (the summed
    ``layer_stall_s``, the compute stream's waits for copies; ``h2d_s`` where not recorded, which
    is the stall without overlap and without prefetch), the difference ``sim cycle_s - live
    cycle_s`` of a cycle is the exact sum of

    - ``draft``: ``draft_s`` (sim: ``cost.draft_s(levels)``) minus the live ``draft_s``;
    - ``decision``: ``decision_s`` (sim: the live cell's mean; null = 0) minus the live one;
    - ``verify``: the verify compute, ``verify_s + c * m_l`` minus the live ``verify_s`` plus the
      live cycle's unattributed rest (bookkeeping outside the forward: ``cycle_s`` - draft -
      decision - verify - the stall ``w_l``, which the fitted verify term covers, with overlap on
      or off; it went to ``overlap`` with overlap on before the stall was recorded per layer,
      which made ``verify`` read low and ``overlap`` high by the bookkeeping share). With overlap
      mode "on" the simulator's side also holds the late-expert
      calls the model prices at the live misses, ``priced_late_call_s * (layers with m_l > 0)``: live,
      that kernel call is compute inside ``verify_s`` (wall minus stall), while the replay
      books it outside its ``verify_s``; pass ``c`` = the overlap model's per-miss term less
      the placing measured on its runs (``calibration.costfit.OverlapFit.term_split``), so the
      per-miss work live counts as compute is compared as compute too;
    - ``h2d``: the per-miss H2D at the live miss count, ``m_l * (s - c)``, minus ``D_l``;
    - ``prefetch``: the simulator's prefetch copies at the price it charges them, ``i_s * s``,
      minus ``P_l`` (0 without prefetch; a count difference shows here, a hidden copy in
      ``overlap``). The whole ``s``: ``sim.replay.link_from_cost`` puts ``h2d_s_per_transfer`` less
      ``host_s_per_transfer`` (``c`` included) on the link and the compute stream places each
      copy for ``host_s_per_transfer``; ``c`` is verify compute of a MISS, which a prefetched
      expert is not;
    - ``cache``: the cost of the miss-count difference, ``(m_s - m_l) * s`` (0 when both caches
      hold the same experts);
    - ``overlap``: the rest, ``sim cycle_s - live cycle_s`` minus the six terms above: the copy
      time each side hides behind compute, the live side's ``h2d_s - w_l`` minus the simulator's
      priced copies ``(m_s + i_s) * s`` beyond its stall. 0 without overlap and without
      prefetch (the replay's cycle is then draft + decision + ``verify_s`` + ``m_s * s``); with
      prefetch and overlap off, the prefetch copies each side does not wait for; with overlap on,
      the copies each side hides.

    Returns:
        ``split_<term>_pct`` for each of :data:`SPLIT_TERMS`: ``100 * sum over the kept cycles of
        the term / sum of their live cycle_s`` (signed %; they add up to the kept cycles' signed
        total time error, positive = the simulator slower), ``split_live_s`` (that live sum, s,
        the weight for pooling cells) and ``split_num_cycles`` (kept cycles). NaN percentages and
        0 cycles when no cycle pairs.
    """
    out: dict[str, float] = {f"split_{t}_pct": float("nan") for t in SPLIT_TERMS}
    out.update(split_live_s=0.0, split_num_cycles=0)
    keys = list(REPEAT_KEY)
    cols = ["verified_nodes", "draft_s", "verify_s", "h2d_s", "cycle_s", "decision_s", "cache_misses"]
    late_calls = cost.per_layer_overlap and cost.priced_late_call_s > 0 and "layer_misses" in live
    if not len(live) or not len(sim) or any(c not in f.columns for c in keys + cols for f in (live, sim)):
        return out
    live = live.assign(stall_s=live["stall_s"] if "stall_s" in live.columns else _stall_s(live))
    optional = ["num_prefetch_issued"]
    live, sim = (f.assign(**{c: f[c] if c in f.columns else 0 for c in optional}) for f in (live, sim))
    if late_calls:
        live = live.assign(layers_with_misses=[int(np.count_nonzero(_ints(m))) for m in live["layer_misses"]])
    extra = ["stall_s"] + (["layers_with_misses"] if late_calls else [])
    both = live[keys + cols + optional + extra].merge(
        sim[keys + cols + optional], on=keys, suffixes=("_l", "_s")
    )
    same = np.array(
        [set(_ints(a)) == set(_ints(b)) for a, b in zip(both["verified_nodes_l"], both["verified_nodes_s"])],
        dtype=bool,
    )
    both = both[same] if len(both) else both
    live_s = _numeric(both, "cycle_s_l")
    if not len(both) or live_s.sum() <= 0:
        return out
    part = {side: {c: _numeric(both, f"{c}_{side}") for c in cols[1:] + optional} for side in ("l", "s")}
    lv, sm = part["l"], part["s"]
    stall_l = pd.to_numeric(both["stall_s"], errors="coerce").to_numpy(dtype=np.float64)
    stall_l = np.where(np.isfinite(stall_l), stall_l, lv["h2d_s"])
    rest_l = lv["cycle_s"] - lv["draft_s"] - lv["decision_s"] - lv["verify_s"] - stall_l
    c, s = float(compute_s_per_miss), cost.priced_s_per_miss
    m_l, m_s = lv["cache_misses"], sm["cache_misses"]
    i_l, i_s = lv["num_prefetch_issued"], sm["num_prefetch_issued"]
    copies_l = m_l + i_l
    demand_h2d_l = np.where(copies_l > 0, lv["h2d_s"] * m_l / np.maximum(copies_l, 1), lv["h2d_s"])
    terms = {
        "draft": sm["draft_s"] - lv["draft_s"],
        "decision": sm["decision_s"] - lv["decision_s"],
        "verify": sm["verify_s"] + c * m_l - lv["verify_s"] - rest_l
        + (cost.priced_late_call_s * _numeric(both, "layers_with_misses") if late_calls else 0.0),
        "h2d": m_l * (s - c) - demand_h2d_l,
        "prefetch": i_s * s - (lv["h2d_s"] - demand_h2d_l),  # the simulator's price: the whole s
        "cache": (m_s - m_l) * s,
    }
    # the rest of the difference: 0 without overlap and prefetch (the replay's cycle is draft +
    # decision + verify + misses * s_per_miss, wherever the simulator books the per-miss placing)
    terms["overlap"] = sm["cycle_s"] - lv["cycle_s"] - sum(terms.values())
    total = float(live_s.sum())
    for term, values in terms.items():
        out[f"split_{term}_pct"] = float(100.0 * values.sum() / total)
    out.update(split_live_s=total, split_num_cycles=int(len(both)))
    return out


def missed_aims(row: dict[str, Any] | pd.Series) -> list[str]:
    """The per-cell aims a :func:`compare_cell` row misses, in words, each with the figure that
    missed and the measured repeat noise (or fixed fallback) it was held to, e.g.
    ``"throughput error +12 % > repeat spread 4.1 %"``; empty when ``ok``."""
    out = []
    if not row.get("aim_throughput", True):
        spread = row.get("live_repeat_spread_pct", np.nan)
        bound = f"repeat spread {spread:.2g} %" if np.isfinite(spread) else "2 % (noise not measured)"
        out.append(f"throughput error {row['throughput_error_pct']:+.2g} % > {bound}")
    if not row.get("aim_cycle_median", True):
        noise = row.get("cycle_noise_median_pct", np.nan)
        bound = f"per-cycle noise median {noise:.2g} %" if np.isfinite(noise) else "3 % (noise not measured)"
        floor = row.get("cycle_error_floor_median_pct", np.nan)
        floor_text = f" (an unbiased model: {floor:.2g} %)" if np.isfinite(floor) else ""
        out.append(f"per-cycle error median {row['cycle_error_median_pct']:.2g} % > {bound}{floor_text}")
    if not row.get("aim_hit_rate", True):
        out.append(f"hit rate off by {row['hit_rate_diff_points']:+.2g} points > 0.5")
    if not row.get("aim_same_subtree", True):
        out.append(f"same subtree {row['same_subtree_fraction']:.1%} < 99 %")
    return out


def _aims(row: dict[str, Any], t: Targets) -> dict[str, bool]:
    """The per-cell aims of a :func:`compare_cell` row (module docstring): throughput error within
    the repeat spread and per-cycle median within the per-cycle noise median (``t``'s fixed
    values when the noise is not measured), hit rate, same subtree."""

    def bound(noise: float, fallback: float) -> float:
        return noise if np.isfinite(noise) else fallback

    compared = row["num_decisions_compared"]
    return {
        "aim_throughput": bool(
            abs(row["throughput_error_pct"]) <= bound(row["live_repeat_spread_pct"], t.throughput_pct)
        ),
        "aim_cycle_median": bool(
            row["cycle_error_median_pct"] <= bound(row["cycle_noise_median_pct"], t.cycle_median_pct)
        ),
        "aim_hit_rate": bool(abs(row["hit_rate_diff_points"]) <= t.hit_rate_points),
        "aim_same_subtree": bool(not compared or row["same_subtree_fraction"] >= t.same_subtree_fraction),
    }


def _pre_router_per_cycle(tables: Sequence[pd.DataFrame]) -> tuple[np.ndarray, np.ndarray]:
    """``(design float64[C, 3], seconds float64[C])``: per cycle with a recorded
    ``layer_pre_router_s``, the columns 1, nodes verified, context length and the measured
    attention + router seconds summed over layers."""
    design, seconds = [], []
    for df in tables:
        if "layer_pre_router_s" not in df.columns:
            continue
        for pre, nodes, ctx in zip(df["layer_pre_router_s"], df["num_nodes_verified"], df["context_len"]):
            if pre is None or (np.ndim(pre) == 0 and pd.isna(pre)):
                continue
            total = float(np.sum(pre))
            if total > 0:
                design.append((1.0, float(nodes), float(ctx)))
                seconds.append(total)
    return np.array(design, dtype=np.float64).reshape(-1, 3), np.array(seconds, dtype=np.float64)


@dataclass(frozen=True)
class ComputeSpeedReference:
    """The attention + router line of a cost's fit runs (:func:`compute_speed`), fitted once:
    ``coef`` float64[3] (s; base, per node verified, per context token) and ``median_ratio``
    (the fit runs' median measured / predicted, dimensionless)."""

    coef: np.ndarray
    median_ratio: float

    @classmethod
    def fit(cls, reference: Sequence[pd.DataFrame]) -> ComputeSpeedReference | None:
        """The line fitted to ``reference``'s cycles (non-negative least squares,
        :func:`calibration.lsq.fit_non_negative`); None below 3 cycles with
        ``layer_pre_router_s`` or when a prediction is not positive."""
        from calibration.lsq import fit_non_negative

        ref_x, ref_y = _pre_router_per_cycle(reference)
        if len(ref_y) < 3:
            return None
        fit = fit_non_negative(ref_x, ref_y, ("base_s", "s_per_node", "s_per_context_token"))
        coef = np.asarray(fit.coef, dtype=np.float64)
        ref_pred = ref_x @ coef
        if not np.all(ref_pred > 0):
            return None
        return cls(coef, float(np.median(ref_y / ref_pred)))

    def speed(self, cycles: Sequence[pd.DataFrame]) -> float:
        """The median over ``cycles`` of measured / predicted attention + router seconds, over the
        reference's (1.2 = 20 % slower); NaN without such cycles or with a non-positive prediction."""
        x, y = _pre_router_per_cycle(cycles)
        pred = x @ self.coef
        if not len(y) or not np.all(pred > 0):
            return float("nan")
        return float(np.median(y / pred) / self.median_ratio)


def compute_speed(reference: Sequence[pd.DataFrame], cycles: Sequence[pd.DataFrame]) -> float:
    """How long the live compute of ``cycles`` took relative to the ``reference`` runs' (the cost
    model's fit runs): 1.2 = 20 % slower, NaN when either side lacks ``layer_pre_router_s``.

    Measured on each cycle's attention + router time (``layer_pre_router_s`` summed over layers,
    recorded live by ``live.offload``): compute that runs before the layer's copies are asked for,
    so its length depends on the tree and the context only, not on the policy's misses. A line
    ``a + b * nodes + c * context`` is fitted to the reference cycles (:class:`ComputeSpeedReference`,
    which callers comparing many cells against one reference fit once); the speed is the median
    over ``cycles`` of measured / predicted divided by the same median over the reference cycles.
    On the embedded default this tracks the whole compute: per-run draft seconds per level (no
    link at all) correlate 0.97 with it (README, fidelity). ``analysis.validate`` uses it to
    separate the machine's speed drift between runs from model error (a diagnostic: the cell's own
    cycles never set the simulator's speed).
    """
    ref = ComputeSpeedReference.fit(reference)
    return ref.speed(cycles) if ref is not None else float("nan")


def probe_speed_index(reference: Sequence[np.ndarray], runs: Sequence[np.ndarray]) -> float:
    """How long the speed probe took in ``runs`` relative to the ``reference`` runs (the cost
    model's fit runs): the median of the runs' pooled probe seconds over the same median of the
    reference's (1.2 = the machine ran 20 % slower; dimensionless), NaN when either side has no
    probe (runs recorded before ``live.speed_probe``, or a given ``--cost``: no fit runs).

    Each array holds one run's ``speed_probe_s`` (``live.record``'s summary: seconds of a fixed
    torch workload timed before the first request and after each, outside the cycles), so this
    gauges the machine's speed independently of the decoding being compared;
    ``analysis.validate`` times the simulator's cycles with ``CycleCostModel.with_compute_speed``
    of it (``sim.config.SimConfig.compute_speed``).
    """
    ref = np.concatenate([np.asarray(r, dtype=np.float64).ravel() for r in reference] or [np.zeros(0)])
    own = np.concatenate([np.asarray(r, dtype=np.float64).ravel() for r in runs] or [np.zeros(0)])
    ref, own = ref[np.isfinite(ref) & (ref > 0)], own[np.isfinite(own) & (own > 0)]
    if not len(ref) or not len(own):
        return float("nan")
    return float(np.median(own) / np.median(ref))


def compare_cell(
    key: dict[str, Any],
    live_cycles: pd.DataFrame | Sequence[pd.DataFrame],
    live_transfers: pd.DataFrame | Sequence[pd.DataFrame],
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
        live_cycles, live_transfers: the live run's tables, or one table per repeat (R >= 1,
            the same count for both).
        sim_totals: ``ReplayTotals.to_dict()`` of the replay (``tokens_per_s``, ``hit_rate``).
        sim_cycles: the replay's cycle records as a DataFrame.
        cost: the cost model both used.
        targets: :class:`Targets`.
        cost_split: the non-link parts of ``cost.h2d_s_per_transfer`` when the cost was fitted
            (:meth:`calibration.costfit.CostFit.term_split`), so the per-term errors compare each
            term with what it measures; ``None`` = all link time.

    With R repeats the live throughput, hit rate and tau are pooled (the concatenated cycles:
    total committed tokens / total ``cycle_s``); the same-subtree comparison with the replay uses
    repeat 1; the per-cycle cost-model error (and the planner's and per-term errors) are computed
    against the per-cycle MEAN over repeats of the matched cycles (:func:`match_repeats`,
    :func:`mean_repeat_cycles`; averaging removes part of the run-to-run noise), transfers
    pooled. With R = 1 this is the single run's table.

    Returns:
        dict with live/sim throughput and hit rate, ``throughput_error_pct``,
        ``hit_rate_diff_points``, ``num_decisions_compared``, ``same_subtree_fraction``, per-cycle
        cost-model error median / p90 (``cycle_error_median_pct``, ``cycle_error_p90_pct``) and
        signed median (``cycle_error_signed_median_pct``), the planner's own logged prediction
        error median (``planner_error_median_pct``), per-term median errors, the noise floor
        (``num_repeats``, ``num_cycles_matched``, ``repeat_same_subtree_fraction``,
        ``live_repeat_spread_pct``, ``cycle_noise_median_pct``, ``cycle_noise_p90_pct``; NaN with
        R = 1), the sim-vs-live term split (:func:`error_split`), the aims (``aim_throughput``,
        ``aim_cycle_median``, ``aim_hit_rate``, ``aim_same_subtree``; ``ok`` = all four),
        ``within_noise`` (every missed fixed target of :class:`Targets`, throughput, per-cycle
        median and p90, within the measured floor, hit-rate and same-subtree targets met) and
        ``off_terms``. ``num_cycles_live`` counts the pooled cycles.

    Raises:
        ValueError: no live table, different numbers of cycles and transfers tables, an empty
            or malformed cycles table (:func:`analysis.metrics.cycle_summary`,
            :func:`match_repeats`).
    """
    t = targets or Targets()
    cycles_r = _tables("live_cycles", live_cycles)
    transfers_r = _tables("live_transfers", live_transfers)
    if len(transfers_r) != len(cycles_r):
        raise ValueError(
            f"live_transfers: expected one table per repeat ({len(cycles_r)}), got {len(transfers_r)}"
        )
    pooled = pd.concat(cycles_r, ignore_index=True) if len(cycles_r) > 1 else cycles_r[0]
    live = live_totals(pooled)
    spread = repeat_spread_pct([live_totals(c)["tokens_per_s"] for c in cycles_r])
    match = match_repeats(cycles_r)
    mean_cycles = mean_repeat_cycles(match)
    noise = cycle_noise_pct(match)
    deviation = cycle_deviation_pct(match)
    nonempty = [x for x in transfers_r if len(x)]
    transfers = pd.concat(nonempty, ignore_index=True) if len(nonempty) > 1 else (nonempty or transfers_r)[0]
    sim_tps, sim_hit = float(sim_totals["tokens_per_s"]), float(sim_totals["hit_rate"])
    tp_err = float(metrics.percentage_error([sim_tps], [live["tokens_per_s"]])[0])
    hit_diff = (
        metrics.hit_rate_difference_points(sim_hit, live["hit_rate"])
        if np.isfinite(live["hit_rate"])
        else np.nan
    )
    compared, same = same_subtree(cycles_r[0], sim_cycles) if len(sim_cycles) else (0, 0)
    errors = cycle_errors(cost, mean_cycles)
    abs_err = np.abs(errors)
    planner_err = np.nan
    planner = pd.to_numeric(mean_cycles.get("predicted_cycle_s", pd.Series(dtype=float)), errors="coerce")
    if len(planner) == len(mean_cycles) and planner.notna().any():
        ok = planner.notna().to_numpy()
        meas = model_cycle_s(mean_cycles)[ok]
        planner_err = float(np.median(np.abs(metrics.percentage_error(planner.to_numpy()[ok], meas))))
    terms = evaluate(cost, mean_cycles, transfers, **(cost_split or {}))
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
        num_cycles_live=len(pooled),
        num_decisions_compared=compared,
        same_subtree_fraction=same / compared if compared else np.nan,
        cycle_error_median_pct=float(np.median(abs_err)) if abs_err.size else np.nan,
        cycle_error_p90_pct=float(np.percentile(abs_err, 90)) if abs_err.size else np.nan,
        cycle_error_signed_median_pct=_median(errors),
        planner_error_median_pct=planner_err,
        draft_error_median_pct=terms["draft"].median_abs_pct_error,
        verify_error_median_pct=terms["verify"].median_abs_pct_error,
        h2d_error_median_pct=terms["h2d_cycle"].median_abs_pct_error,
        num_repeats=match.num_repeats,
        num_cycles_matched=match.num_matched,
        repeat_same_subtree_fraction=match.same_subtree_fraction,
        live_repeat_spread_pct=spread,
        cycle_noise_median_pct=_median(noise),
        cycle_noise_p90_pct=_p90(noise),
        cycle_error_floor_median_pct=noise_floor_pct(deviation, match.num_repeats, 0.5),
        cycle_error_floor_p90_pct=noise_floor_pct(deviation, match.num_repeats, 0.9),
        **sim_cycle_agreement(cycles_r[0], sim_cycles),
        **error_split(mean_cycles, sim_cycles, cost, (cost_split or {}).get("compute_s_per_miss", 0.0)),
    )
    row.update(_aims(row, t))
    off: list[str] = []
    if not row["aim_cycle_median"]:
        off.append(worst_term(terms) or "cycle")
    if not row["aim_hit_rate"]:
        off.append("cache")
    if not row["aim_same_subtree"]:
        off.append("decisions")
    if not row["aim_throughput"] and not off:
        off.append("throughput")
    row["ok"] = bool(
        row["aim_throughput"] and row["aim_cycle_median"] and row["aim_hit_rate"] and row["aim_same_subtree"]
    )
    row["within_noise"] = within_noise(row, t)
    row["off_terms"] = ";".join(off)
    return row


def within_noise(row: dict[str, Any], targets: Targets | None = None) -> bool:
    """Whether every missed fixed target of ``targets`` (throughput, per-cycle median and p90) is
    within the cell's measured noise floor and the hit-rate and same-subtree targets are met, from
    a :func:`compare_cell` row's ``throughput_error_pct``, ``live_repeat_spread_pct``,
    ``cycle_error_{median,p90}_pct``, ``cycle_noise_{median,p90}_pct``, ``hit_rate_diff_points``,
    ``num_decisions_compared`` and ``same_subtree_fraction`` (NaN noise: the fixed target)."""
    t = targets or Targets()
    return bool(
        abs(row["throughput_error_pct"]) <= _floor(t.throughput_pct, row["live_repeat_spread_pct"])
        and row["cycle_error_median_pct"] <= _floor(t.cycle_median_pct, row["cycle_noise_median_pct"])
        and row["cycle_error_p90_pct"] <= _floor(t.cycle_p90_pct, row["cycle_noise_p90_pct"])
        and abs(row["hit_rate_diff_points"]) <= t.hit_rate_points
        and (not row["num_decisions_compared"] or row["same_subtree_fraction"] >= t.same_subtree_fraction)
    )


def rescored(
    row: dict[str, Any],
    sim_totals: dict[str, Any],
    cost: CycleCostModel,
    mean_cycles: pd.DataFrame,
    targets: Targets | None = None,
) -> dict[str, Any]:
    """The figures of a :func:`compare_cell` ``row`` that change when the simulator and the cost
    model are re-timed (``analysis.validate``'s speed-normalised replay: the same decisions, so
    hit rate and same subtree stay the row's), without comparing the cell again.

    Args:
        row: the cell's :func:`compare_cell` row (its live figures and measured noise are kept).
        sim_totals: ``ReplayTotals.to_dict()`` of the re-timed replay (``tokens_per_s``).
        cost: the re-timed cost model (e.g. ``CycleCostModel.with_compute_speed``).
        mean_cycles: the per-cycle mean over repeats (:func:`mean_repeat_cycles`), as
            :func:`compare_cell` took its per-cycle errors against.

    Returns:
        ``sim_tokens_per_s``, ``throughput_error_pct``, ``cycle_error_median_pct``,
        ``cycle_error_p90_pct`` and ``within_noise`` (:func:`within_noise`, same noise floor).
    """
    sim_tps = float(sim_totals["tokens_per_s"])
    abs_err = np.abs(cycle_errors(cost, mean_cycles))
    out = {
        "sim_tokens_per_s": sim_tps,
        "throughput_error_pct": float(metrics.percentage_error([sim_tps], [row["live_tokens_per_s"]])[0]),
        "cycle_error_median_pct": float(np.median(abs_err)) if abs_err.size else np.nan,
        "cycle_error_p90_pct": float(np.percentile(abs_err, 90)) if abs_err.size else np.nan,
    }
    out["within_noise"] = within_noise({**row, **out}, targets)
    return out


def overall(
    rows: Sequence[dict[str, Any]],
    per_cycle_errors: Sequence[np.ndarray],
    per_cycle_noise: Sequence[np.ndarray] | None = None,
    targets: Targets | None = None,
) -> dict[str, Any]:
    """Grid summary: pooled per-cycle |error| median / p90, worst cell figures, cells passing,
    and the grid's noise floor.

    Args:
        rows: :func:`compare_cell` rows.
        per_cycle_errors: per cell, the signed per-cycle errors (%); NaN entries are left out.
        per_cycle_noise: per cell, the per-cycle noise (:func:`cycle_noise_pct`, %); NaN left out.

    Returns:
        dict with ``num_cells``, ``num_cells_ok``, ``cycle_error_median_pct``,
        ``cycle_error_p90_pct``, ``noise_cycle_median_pct`` / ``noise_cycle_p90_pct`` (pooled
        per-cycle noise, NaN when not measured) and, for a non-empty grid, the worst throughput
        error, hit-rate difference and same-subtree fraction, ``median_live_repeat_spread_pct``
        / ``max_live_repeat_spread_pct`` (NaN with one repeat), ``num_cells_within_noise`` and
        ``all_within_noise``; the grid aims ``aim_cycle_median`` (pooled median <=
        ``targets.cycle_median_pct``), ``aim_cycle_p90`` (p90 <= ``targets.cycle_p90_pct``) and
        ``all_aims_met`` (both, and every cell's ``ok``).
    """
    pooled = (
        np.abs(np.concatenate([np.asarray(e, dtype=np.float64) for e in per_cycle_errors]))
        if per_cycle_errors
        else np.zeros(0)
    )
    noise = (
        np.concatenate([np.asarray(n, dtype=np.float64) for n in per_cycle_noise])
        if per_cycle_noise
        else np.zeros(0)
    )
    df = pd.DataFrame(list(rows))
    out: dict[str, Any] = {
        "num_cells": len(df),
        "num_cells_ok": int(df["ok"].sum()) if len(df) else 0,
        "cycle_error_median_pct": _median(pooled),
        "cycle_error_p90_pct": _p90(pooled),
        "noise_cycle_median_pct": _median(noise),
        "noise_cycle_p90_pct": _p90(noise),
    }
    if len(df):
        out["max_abs_throughput_error_pct"] = float(df["throughput_error_pct"].abs().max())
        out["max_abs_hit_rate_diff_points"] = float(df["hit_rate_diff_points"].abs().max())
        frac = df["same_subtree_fraction"].dropna()
        out["min_same_subtree_fraction"] = float(frac.min()) if len(frac) else np.nan
        spread = (
            df["live_repeat_spread_pct"].to_numpy(dtype=np.float64)
            if "live_repeat_spread_pct" in df.columns
            else np.zeros(0)
        )
        spread = spread[np.isfinite(spread)]
        out["median_live_repeat_spread_pct"] = float(np.median(spread)) if spread.size else np.nan
        out["max_live_repeat_spread_pct"] = float(spread.max()) if spread.size else np.nan
        if "within_noise" in df.columns:
            out["num_cells_within_noise"] = int(df["within_noise"].astype(bool).sum())
            out["all_within_noise"] = bool(df["within_noise"].astype(bool).all())
    t = targets or Targets()
    out["aim_cycle_median"] = bool(out["cycle_error_median_pct"] <= t.cycle_median_pct)
    out["aim_cycle_p90"] = bool(out["cycle_error_p90_pct"] <= t.cycle_p90_pct)
    out["all_aims_met"] = bool(
        len(df) and df["ok"].astype(bool).all() and out["aim_cycle_median"] and out["aim_cycle_p90"]
    )
    return out


def _pooled(arrays: Sequence[np.ndarray] | None) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64) for a in arrays]) if arrays else np.zeros(0)


MIN_CYCLES_RUN_SPEED = 10  # cells with fewer matched cycles are left out of noise_run_speed_fraction


def error_decomposition(
    per_cycle_errors: Sequence[np.ndarray],
    per_cycle_noise: Sequence[np.ndarray],
    per_cycle_run_noise: Sequence[np.ndarray] | None,
    repeats: int,
    targets: Targets | None = None,
    per_cycle_deviation: Sequence[np.ndarray] | None = None,
) -> dict[str, Any]:
    """Where the grid's per-cycle cost-model error lives: the noise of the R-repeat means, a bias
    common to a whole cell, or cycle-to-cycle structure within cells; and how many repeats the
    per-cycle aims need.

    A cycle's error against the mean of R repeats is ``e = b + n`` with ``n`` the mean's noise,
    ``E[n^2] = noise^2 / R`` (``noise`` the cycle's CV across the repeats, :func:`cycle_noise_pct`;
    ddof = 1, so ``noise^2`` is unbiased). So ``sqrt(mean(e^2) - mean(noise^2) / R)`` estimates
    the rms of the part that does NOT shrink with repeats (NaN-free cycles pooled; 0 when the
    noise explains all). Each cell's signed median error is its offset, the error common to all
    its cycles (a cost term off for that policy, or the machine running at another speed during
    the cell's runs than during the cost's fit runs); ``e`` minus its cell's offset is the
    within-cell error, where a term that is wrong for some kinds of cycle (tree size, misses,
    context) shows.

    Args:
        per_cycle_errors: per cell, signed per-cycle errors (%, :func:`cycle_error_table`'s
            ``cycle_error_pct``); NaN entries left out.
        per_cycle_noise: per cell, per-cycle noise (%, ``cycle_noise_pct``), aligned with the errors.
        per_cycle_run_noise: per cell, the run-normalised noise (%, ``cycle_run_noise_pct``) or
            None (then the run-speed figures are NaN).
        repeats: R, the repeats each error's mean was taken over.
        targets: :class:`Targets` (the per-cycle median and p90 aims).
        per_cycle_deviation: per cell, the leave-one-out deviations (%, any shape,
            :func:`cycle_deviation_pct` / :func:`table_deviations_pct`) or None (then the
            repeats needed are None).

    Returns:
        ``cycle_error_bias_rms_pct`` (NaN with R < 2), ``cycle_error_cell_offset_rms_pct`` (rms of
        the cells' signed medians, weighted by their cycles), ``cycle_error_within_cell_median_pct``
        / ``cycle_error_within_cell_p90_pct`` (pooled ``|e - offset|``), ``noise_cycle_run_normalised_median_pct``,
        ``noise_run_speed_fraction`` (the fraction of the per-cycle noise variance that is
        whole-run speed, :func:`run_speed_factors`: ``1 - mean(run_noise^2) / mean(noise^2)``,
        over the cells with at least :data:`MIN_CYCLES_RUN_SPEED` matched cycles: the speed factor
        is fitted on the cycles it normalises, so a cell of few cycles overstates it, a 1-cycle
        cell is all "run speed"; NaN without such a cell; may be < 0 when normalising raised
        the noise) and ``repeats_for_aim_median`` / ``repeats_for_aim_p90``
        (:func:`repeats_for_aim` with the pooled deviations and the per-cycle aims).
    """
    t = targets or Targets()
    errors = [np.asarray(e, dtype=np.float64) for e in per_cycle_errors]
    pooled, noise = _pooled(errors), _pooled(per_cycle_noise)
    run_noise = _pooled(per_cycle_run_noise) if per_cycle_run_noise is not None else np.full(noise.size, np.nan)
    cells = [e for e in errors if np.isfinite(e).any()]
    offsets = np.array([_median(e) for e in cells])
    counts = np.array([np.isfinite(e).sum() for e in cells])
    within = _pooled([e - o for e, o in zip(cells, offsets)])
    out: dict[str, Any] = {
        "cycle_error_bias_rms_pct": np.nan,
        "cycle_error_cell_offset_rms_pct": float(np.sqrt(np.average(offsets**2, weights=counts))) if cells else np.nan,
        "cycle_error_within_cell_median_pct": _median(np.abs(within)),
        "cycle_error_within_cell_p90_pct": _p90(np.abs(within)),
        "noise_cycle_run_normalised_median_pct": _median(run_noise),
        "noise_run_speed_fraction": np.nan,
        "repeats_for_aim_median": None,
        "repeats_for_aim_p90": None,
    }
    both = np.isfinite(pooled) & np.isfinite(noise) if pooled.size == noise.size else np.zeros(0, dtype=bool)
    if repeats >= 2 and both.any():
        excess = float(np.mean(pooled[both] ** 2) - np.mean(noise[both] ** 2) / repeats)
        out["cycle_error_bias_rms_pct"] = float(np.sqrt(max(excess, 0.0)))
    if per_cycle_run_noise is not None:
        large = [
            (np.asarray(n, dtype=np.float64), np.asarray(rn, dtype=np.float64))
            for n, rn in zip(per_cycle_noise, per_cycle_run_noise)
            if np.size(n) >= MIN_CYCLES_RUN_SPEED and np.size(n) == np.size(rn)
        ]
        big_noise, big_run = _pooled([n for n, _ in large]), _pooled([rn for _, rn in large])
        paired = np.isfinite(big_noise) & np.isfinite(big_run)
        if paired.any() and np.mean(big_noise[paired] ** 2) > 0:
            out["noise_run_speed_fraction"] = float(
                1.0 - np.mean(big_run[paired] ** 2) / np.mean(big_noise[paired] ** 2)
            )
    if per_cycle_deviation is not None:
        deviation = _pooled([np.ravel(d) for d in per_cycle_deviation])
        for name, q, aim in (("median", 0.5, t.cycle_median_pct), ("p90", 0.9, t.cycle_p90_pct)):
            out[f"repeats_for_aim_{name}"] = repeats_for_aim(deviation, aim, q)
    return out


def by_policy(table: pd.DataFrame, errors: pd.DataFrame) -> pd.DataFrame:
    """Per-cycle errors and the :func:`error_split` pooled per (policy, bandwidth[, overlap]).

    Args:
        table: ``fidelity.csv`` rows (:func:`compare_cell`) with the ``split_*`` columns.
        errors: ``cycle_errors.csv`` rows (key columns and ``cycle_error_pct``, signed %).

    Returns:
        One row per group (``overlap`` only when the table has more than one value): ``cells``,
        ``cycles`` (matched), the pooled per-cycle |error| median / p90
        (``cycle_error_median_pct``, ``cycle_error_p90_pct``) and signed median
        (``cycle_error_signed_median_pct``: a bias shows as a clear sign), the mean throughput
        error of the cells, and each ``split_<term>_pct`` pooled over the cells weighted by their
        live seconds (``split_live_s``).
    """
    keys = ["policy", "bandwidth_gb_per_s"]
    if "overlap" in table.columns and table["overlap"].nunique() > 1:
        keys.append("overlap")
    rows = []
    for group, cells in table.groupby(keys, sort=False):
        values = dict(zip(keys, group if isinstance(group, tuple) else (group,)))
        mask = np.ones(len(errors), dtype=bool)
        for k, v in values.items():
            if k in errors.columns:
                mask &= (errors[k] == v).to_numpy()
        err = errors.loc[mask, "cycle_error_pct"].to_numpy(dtype=np.float64) if len(errors) else np.zeros(0)
        weight = cells["split_live_s"].to_numpy(dtype=np.float64) if "split_live_s" in cells else np.zeros(0)
        row = dict(values, cells=len(cells), cycles=int(np.isfinite(err).sum()))
        row.update(
            cycle_error_median_pct=_median(np.abs(err)),
            cycle_error_p90_pct=_p90(np.abs(err)),
            cycle_error_signed_median_pct=_median(err),
            throughput_error_pct=float(cells["throughput_error_pct"].mean()),
        )
        for term in SPLIT_TERMS:
            col = f"split_{term}_pct"
            vals = cells[col].to_numpy(dtype=np.float64) if col in cells else np.zeros(0)
            ok = np.isfinite(vals) & (weight > 0) if vals.size else vals.astype(bool)
            row[col] = float(np.sum(vals[ok] * weight[ok]) / np.sum(weight[ok])) if ok.any() else np.nan
        rows.append(row)
    return pd.DataFrame(rows)
