"""Sweep results: the tidy table, speedups, the SpecFit check, the printed table and figures.

One row per cell (units in column names). ``speedup_vs_ar`` / ``speedup_vs_topn`` divide a row's
``tokens_per_s`` by that of the autoregressive / top-N row of the same cell (same bandwidth,
cache size, cache policy, predictor, overlap and prefetch). ``specfit_below_baseline`` flags
SpecFit rows whose throughput is below the best baseline run in their cell (``ar``, ``chain``,
``topn``, ``cascade``; issue 6, "Checks on results", and issue 12): SpecFit maximises the PREDICTED ratio E[committed] / T_cycle each cycle, with
predicted acceptance and predicted experts; the replay realises the recorded acceptance and the
true experts, and its cache state diverges from the planner's view, so a cell can fall below a
baseline when those predictions are off. :data:`CHECK_NOTE` says so under the table. With the
oracle variants in the sweep, SpecFit rows also carry the regret decomposition (:func:`_add_regret`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sim.cells import KEY_COLUMNS
from sim.config import BASELINE_POLICIES, ORACLE_VARIANTS

GROUP_COLUMNS = tuple(c for c in KEY_COLUMNS if c != "policy")
POLICY_ORDER = ("ar", "chain", "topn", "cascade", "specfit", *ORACLE_VARIANTS, "moespec")
# decision regret of SpecFit per cell (issue 12), each as a fraction of the best tokens/s in hindsight
REGRET_COLUMNS = ("regret_total", "regret_acceptance", "regret_experts", "regret_myopic", "regret_interaction")
CHECK_TOLERANCE = 1e-9  # relative: equal throughputs (e.g. both choose the root only) pass
NOISE_REL = 0.02
"""The sweep's seed-to-seed noise on SpecFit's tokens/s (relative), the tolerance of the SpecFit
check: measured on calibrated Qwen3-30B-A3B synthetic traces (1 request x 96 positions, seeds 0-2,
2/16/64 GB/s, caches 1/16 and 1/2, overlap off and on), the relative standard deviation over seeds
of a cell's tokens/s is at most 0.6% for SpecFit (0.6% autoregressive; 10-14% top-N and chain,
whose acceptance differs from trace to trace; re-measured 2026-12-01, the command in the README), so
2% is more than three standard deviations. A SpecFit
row below the best baseline by less than this is marked ``~`` (within noise), by more ``!``."""
CHECK_NOTE = (
    f"! = SpecFit below max(autoregressive, chain, top-N, cascade) of those run in this cell by more than "
    f"the sweep's seed-to-seed noise ({NOISE_REL:.0%}); ~ = below, but within that noise. SpecFit "
    "maximises the PREDICTED throughput of each cycle: acceptance predicted from draft probabilities "
    "(or the calibration given), experts from the chosen predictor, the cache as it stands, and the draft levels it "
    "already paid for (its stopping rule decides level by level; autoregressive never drafts). The "
    "replay realises the recorded acceptance and the true experts, so where those predictions are "
    "off, or its choices leave a different cache for later cycles, its realised throughput can fall "
    "below a baseline; mean predicted vs realised committed tokens are in the results "
    "(mean_predicted_committed, tau)."
)
VARIED_KEYS = ("cache_policy", "predictor", "overlap", "prefetch", "stopping")
"""Columns the table and figure show only when they vary (``stopping``: SpecFit rows of two
stopping rules, e.g. sweeps with each ``--stopping`` into one folder)."""
TABLE_COLUMNS = (
    ("cache_experts_per_layer", "cache exp/layer", "{:d}"),
    ("cache_fraction", "cache frac", "{:.3g}"),
    ("bandwidth_gb_per_s", "GB/s", "{:g}"),
    ("policy", "policy", "{}"),
    ("tokens_per_s", "sim tok/s", "{:.1f}"),
    ("tau", "tau", "{:.2f}"),
    ("mean_draft_levels", "levels", "{:.1f}"),
    ("mean_nodes_verified", "|S|", "{:.1f}"),
    ("hit_rate", "hit", "{:.3f}"),
    ("h2d_gb", "H2D GB", "{:.2f}"),
    ("speedup_vs_ar", "x AR", "{:.3f}"),
    ("speedup_vs_topn", "x top-N", "{:.3f}"),
)
# What each table header means, with its unit (printed under the table, one line per column shown).
TABLE_LEGEND = {
    "cache exp/layer": "expert-cache capacity, experts per MoE layer",
    "cache frac": "the same capacity as a fraction of the experts per layer",
    "GB/s": "simulated H2D link bandwidth, GB/s (1 GB = 1e9 bytes)",
    "policy": "tree policy: ar = autoregressive (root only), chain, topn = top-N nodes by path "
    "probability, cascade, specfit = exact throughput-optimal subtree; specfit-oracle-accept / "
    "-experts / specfit-oracle = SpecFit given the recorded acceptance / experts / both",
    "cache_policy": "expert-cache eviction policy",
    "predictor": "expert predictor of the planner (and of prefetch)",
    "overlap": "expert copies overlapping compute: off; on (as the live engine); ideal (a bound: every "
    "copy of a cycle enqueued when verification starts)",
    "prefetch": "expert prefetch: none, draft (the predictor's experts of the chosen subtree), "
    "next-layer (layer l+1's router on layer l's input, recorded in the trace) or both",
    "sim tok/s": "SIMULATED committed tokens per second of decode (trace replay, not a measurement)",
    "tau": "mean tokens committed per verification cycle, bonus token included",
    "levels": "mean draft levels drafted per cycle",
    "|S|": "mean nodes verified per cycle (the chosen subtree S, root included)",
    "hit": "expert-cache hit rate, hits / (hits + misses), 0..1",
    "H2D GB": "expert bytes copied host-to-device during decode, GB (1e9 bytes)",
    "x AR": "sim tok/s / that of the autoregressive row of the same cell (same bandwidth, cache, "
    "cache policy, predictor, overlap, prefetch)",
    "x top-N": "sim tok/s / that of the top-N row of the same cell",
    "stopping": "SpecFit's stopping rule (expected / bound)",
    "regret": "SpecFit's decision regret: (best tokens/s in hindsight - SpecFit's) / best, 0..1",
    "r.acc": "share of it perfect acceptance estimates recover (specfit-oracle-accept - specfit) / best",
    "r.exp": "share perfect expert predictions recover (specfit-oracle-experts - specfit) / best",
    "dl hits": "cycles whose selected plan's exact search stopped at its deadline (--planner-deadline-fraction; "
    "wall clock: depends on this machine's speed and load)",
    "dl gap": "mean certified relative gap of those plans: the optimum is at most (1 + gap) x the plan's "
    "predicted tokens/s (0 where none was cut)",
    "r.myo": "share left with both inputs perfect (best - specfit-oracle) / best: the greedy per-cycle choice",
    "!": "SpecFit below max(autoregressive, chain, top-N, cascade) in this cell beyond the seed-to-seed "
    "noise (see the note below)",
    "~": "SpecFit below that best baseline, but within the seed-to-seed noise",
}


def results_frame(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Tidy results sorted by the cell keys, with speedups and the SpecFit check added.

    Args:
        rows: result rows of :func:`sim.cells.run_cell`.

    Returns:
        DataFrame, one row per cell; adds ``speedup_vs_ar``, ``speedup_vs_topn`` (NaN where the
        cell has no such baseline), ``specfit_below_baseline`` (bool; False off SpecFit rows),
        ``specfit_vs_best_baseline`` (SpecFit's tokens/s / the best baseline's), ``best_baseline_policy``
        (that baseline's name) and ``specfit_below_baseline_beyond_noise`` (below by more than
        :data:`NOISE_REL`); SpecFit rows only, NaN / False elsewhere.
    """
    df = pd.DataFrame(list(rows))
    if df.empty:
        return df
    leading = [c for c in ("cell_id", *KEY_COLUMNS, "cache_fraction") if c in df.columns]
    df = df[leading + sorted(c for c in df.columns if c not in leading)]  # same order fresh or resumed
    order = {p: i for i, p in enumerate(POLICY_ORDER)}
    df["_policy_rank"] = df["policy"].map(lambda p: order.get(p, len(order)))
    df = df.sort_values([*GROUP_COLUMNS, "_policy_rank", "policy"], kind="mergesort").drop(
        columns="_policy_rank"
    )
    df = df.reset_index(drop=True)
    refs = [*BASELINE_POLICIES, "specfit", *ORACLE_VARIANTS]
    for base in refs:
        # SpecFit and its oracle variants pair up by stopping rule too (a folder may hold both rules)
        keys = [*GROUP_COLUMNS, *(["stopping"] if base not in BASELINE_POLICIES and "stopping" in df else [])]
        ref = df[df["policy"] == base][[*keys, "tokens_per_s"]].rename(columns={"tokens_per_s": f"_{base}_tps"})
        df = df.merge(ref, on=keys, how="left")
    for base in ("ar", "topn"):
        df[f"speedup_vs_{base}"] = df["tokens_per_s"] / df[f"_{base}_tps"]
    baseline_tps = df[[f"_{b}_tps" for b in BASELINE_POLICIES]]
    best = baseline_tps.max(axis=1, skipna=True)
    is_spec = df["policy"] == "specfit"
    has_baseline = baseline_tps.notna().any(axis=1)
    best_name = baseline_tps.fillna(-np.inf).to_numpy().argmax(axis=1)
    df["best_baseline_policy"] = pd.Series(np.asarray(BASELINE_POLICIES)[best_name], index=df.index).where(
        is_spec & has_baseline
    )
    below = (df["policy"] == "specfit") & (df["tokens_per_s"] < best * (1 - CHECK_TOLERANCE))
    df["specfit_below_baseline"] = below.fillna(False).astype(bool)
    df["specfit_vs_best_baseline"] = (df["tokens_per_s"] / best).where(df["policy"] == "specfit")
    beyond = df["specfit_below_baseline"] & (df["specfit_vs_best_baseline"] < 1.0 - NOISE_REL)
    df["specfit_below_baseline_beyond_noise"] = beyond.fillna(False).astype(bool)
    df = _add_regret(df)
    return df.drop(columns=[f"_{b}_tps" for b in refs])


def _add_regret(df: pd.DataFrame) -> pd.DataFrame:
    """SpecFit rows gain the decomposition of their gap to the best policy in hindsight.

    ``best_in_hindsight_tokens_per_s``: the highest tokens/s of any lossless policy run in the
    cell (baselines, SpecFit and its oracle variants). As fractions of it (NaN where a variant
    is missing): ``regret_total`` = best - SpecFit; ``regret_acceptance`` = specfit-oracle-accept
    - SpecFit (what perfect acceptance estimates would recover); ``regret_experts`` =
    specfit-oracle-experts - SpecFit (perfect expert predictions); ``regret_myopic`` = best -
    specfit-oracle (what remains with both inputs exact: the per-cycle objective itself, e.g.
    evictions of experts later tokens need, draft time before deciding to verify the root only);
    ``regret_interaction`` = total - the three (the two inputs' effects do not simply add).
    """
    columns = [f"_{b}_tps" for b in (*BASELINE_POLICIES, "specfit", *ORACLE_VARIANTS)]
    best = df[columns].max(axis=1, skipna=True)
    is_specfit = df["policy"] == "specfit"
    spec = df["_specfit_tps"]
    regret = {
        "regret_total": (best - spec) / best,
        "regret_acceptance": (df["_specfit-oracle-accept_tps"] - spec) / best,
        "regret_experts": (df["_specfit-oracle-experts_tps"] - spec) / best,
        "regret_myopic": (best - df["_specfit-oracle_tps"]) / best,
    }
    regret["regret_interaction"] = (
        regret["regret_total"] - regret["regret_acceptance"] - regret["regret_experts"] - regret["regret_myopic"]
    )
    df["best_in_hindsight_tokens_per_s"] = best.where(is_specfit)
    for name in REGRET_COLUMNS:
        df[name] = regret[name].where(is_specfit)
    return df


def format_table(df: pd.DataFrame, header: Sequence[str] = ()) -> str:
    """Fixed-width text table, one row per cell; extra key columns appear when they vary.

    Under the table a legend (:data:`TABLE_LEGEND`) says what every column shown means, with its
    unit. SpecFit rows failing the check end in ``!`` and :data:`CHECK_NOTE` follows, last.
    """
    columns = list(TABLE_COLUMNS)
    if "regret_myopic" in df and df["regret_myopic"].notna().any():
        columns += [
            ("regret_total", "regret", "{:.3f}"),
            ("regret_acceptance", "r.acc", "{:.3f}"),
            ("regret_experts", "r.exp", "{:.3f}"),
            ("regret_myopic", "r.myo", "{:.3f}"),
        ]
    if "planner_deadline_fraction" in df and df["planner_deadline_fraction"].notna().any():  # --planner-deadline-fraction
        columns += [("planner_deadline_hits", "dl hits", "{:d}"), ("planner_mean_gap", "dl gap", "{:.2%}")]
    varied = [k for k in VARIED_KEYS if k in df and df[k].nunique() > 1]
    columns[2:2] = [(key, key, "{}") for key in varied]
    lines = list(header)
    cells = []
    for _, row in df.iterrows():
        out = []
        for name, _, fmt in columns:
            value = row.get(name)
            if name == "policy" and row.get("lossy", False) is True:
                value = f"{value} (lossy)"  # never part of a lossless comparison
            if value is None or (isinstance(value, float) and np.isnan(value)):
                out.append("-")
            elif name in ("overlap", "prefetch"):
                out.append(_overlap_name(value) if name == "overlap" else _prefetch_name(value))
            else:
                out.append(fmt.format(int(value) if fmt == "{:d}" else value))
        below = bool(row.get("specfit_below_baseline", False))
        out.append(("!" if bool(row.get("specfit_below_baseline_beyond_noise", True)) else "~") if below else "")
        cells.append(out)
    titles = [title for _, title, _ in columns] + [""]
    widths = [max(len(t), *(len(c[i]) for c in cells)) if cells else len(t) for i, t in enumerate(titles)]
    lines.append("  ".join(t.rjust(w) for t, w in zip(titles, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths[:-1]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    check = specfit_check_line(df)
    if check:
        lines.append(check)
    flagged = bool(df.get("specfit_below_baseline", pd.Series(dtype=bool)).any())
    lines += table_legend([title for _, title, _ in columns] + (["!", "~"] if flagged else []))
    if flagged:
        lines.append(CHECK_NOTE)
    return "\n".join(lines)


def specfit_check_line(df: pd.DataFrame) -> str | None:
    """One line under the table: how many SpecFit cells fall below the best baseline of their cell
    (beyond :data:`NOISE_REL`: ``!``; within it: ``~``) and the worst cell, e.g.
    ``SpecFit check: 0 of 64 SpecFit cells below the best baseline beyond noise (2%, !); 12 within
    noise (~); lowest 0.993 of ar at 128 GB/s, cache 64, overlap off``. None without SpecFit rows
    compared with a baseline."""
    if "specfit_vs_best_baseline" not in df:
        return None
    spec = df[(df["policy"] == "specfit") & df["specfit_vs_best_baseline"].notna()]
    if spec.empty:
        return None
    beyond = int(spec["specfit_below_baseline_beyond_noise"].sum())
    within = int(spec["specfit_below_baseline"].sum()) - beyond
    worst = spec.loc[spec["specfit_vs_best_baseline"].idxmin()]
    where = (
        f"{worst['bandwidth_gb_per_s']:g} GB/s, cache {int(worst['cache_experts_per_layer'])}, "
        f"overlap {_overlap_name(worst['overlap'])}"
    )
    verdict = "FAILS" if beyond else "passes"
    return (
        f"SpecFit check {verdict}: {beyond} of {len(spec)} SpecFit cells below the best baseline run in "
        f"their cell beyond the seed-to-seed noise ({NOISE_REL:.0%}, marked !); {within} below within it "
        f"(marked ~); lowest {worst['specfit_vs_best_baseline']:.3f} of {worst['best_baseline_policy']} "
        f"at {where}"
    )


def table_legend(titles: Sequence[str]) -> list[str]:
    """Legend lines under the table: ``"  <title>  <meaning, unit>"`` for each of ``titles``."""
    width = max((len(t) for t in titles), default=0)
    return ["Legend:"] + [f"  {t.ljust(width)}  {TABLE_LEGEND[t]}" for t in titles if t in TABLE_LEGEND]


# One colour per policy in every figure (sim.sweep's and analysis.report's).
POLICY_COLORS = {
    "ar": "tab:gray",
    "chain": "tab:purple",
    "topn": "tab:red",
    "full": "tab:orange",
    "cascade": "tab:blue",
    "specfit": "tab:green",
    "specfit-oracle-accept": "tab:olive",
    "specfit-oracle-experts": "tab:cyan",
    "specfit-oracle": "tab:brown",
}
# Line style per (overlap, prefetch) pair, so `--overlap both` / `--prefetch both` pair up with
# the policy colours: colour = policy, line style = overlap/prefetch.
OVERLAP_PREFETCH_STYLES = {
    ("off", "none"): "-",
    ("on", "none"): "--",
    ("ideal", "none"): (0, (6, 2, 1, 2, 1, 2)),
    ("off", "draft"): ":",
    ("on", "draft"): "-.",
    ("ideal", "draft"): (0, (1, 4)),
    ("off", "next-layer"): (0, (8, 2)),
    ("on", "next-layer"): (0, (3, 1, 1, 1)),
    ("ideal", "next-layer"): (0, (2, 2, 6, 2)),
    ("off", "both"): (0, (4, 1, 1, 1, 1, 1)),
    ("on", "both"): (0, (10, 3, 2, 3)),
    ("ideal", "both"): (0, (1, 1)),
}
VARIANT_MARKERS = ("o", "s", "^", "D", "v", "P", "X")  # cache policy / predictor variants


def _on_off(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "on")


def _prefetch_name(value: Any) -> str:
    """A result row's prefetch as its mode name (``none``, ``draft``, ``next-layer``, ``both``;
    bools of older sweeps: on = draft)."""
    text = str(value).strip().lower()
    return text if text in ("none", "draft", "next-layer", "both") else ("draft" if _on_off(text) else "none")


def _overlap_name(value: Any) -> str:
    """A result row's overlap as its mode name: ``off``, ``on`` or ``ideal`` (bools of older sweeps:
    on/off)."""
    text = str(value).strip().lower()
    return text if text in ("off", "on", "ideal") else ("on" if _on_off(text) else "off")


def plot_throughput(df: pd.DataFrame, path: Path, title: str = "") -> Path:
    """Write :func:`throughput_figure` of ``df`` as a PNG at ``path``; returns ``path``."""
    fig = throughput_figure(df, title)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def throughput_figure(df: pd.DataFrame, title: str = "") -> Any:
    """A matplotlib figure: SIMULATED tokens/s against bandwidth, one panel per cache size.

    Colour = policy (:data:`POLICY_COLORS`); line style = overlap/prefetch
    (:data:`OVERLAP_PREFETCH_STYLES`); marker = cache policy / predictor when they vary. The
    legend has one entry per policy colour and one per style or marker in use. ``title``: the
    figure title (the sweep passes what was replayed and how it was priced).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    caches = sorted(df["cache_experts_per_layer"].unique())
    marker_keys = [k for k in ("cache_policy", "predictor", "stopping") if k in df and df[k].nunique() > 1]
    markers = {
        combo: VARIANT_MARKERS[i % len(VARIANT_MARKERS)]
        for i, combo in enumerate(dict.fromkeys(map(tuple, df[marker_keys].astype(str).to_numpy())))
    }
    styles_used: dict[tuple[str, str], Any] = {}
    policies_used: list[str] = []
    fig, axes = plt.subplots(
        1, len(caches), figsize=(max(6.0, 4.2 * len(caches)), 3.8), squeeze=False, sharey=True
    )
    for ax, cache in zip(axes[0], caches):
        part = df[df["cache_experts_per_layer"] == cache]
        for keys, series in part.groupby(
            ["policy", "overlap", "prefetch", *marker_keys], sort=False, dropna=False
        ):
            policy, overlap, prefetch = str(keys[0]), _overlap_name(keys[1]), _prefetch_name(keys[2])
            combo = tuple(str(k) for k in keys[3:])
            style = OVERLAP_PREFETCH_STYLES[(overlap, prefetch)]
            styles_used[(overlap, prefetch)] = style
            policies_used.append(policy)
            series = series.sort_values("bandwidth_gb_per_s")
            ax.plot(
                series["bandwidth_gb_per_s"],
                series["tokens_per_s"],
                linestyle=style,
                marker=markers.get(combo, "o"),
                color=POLICY_COLORS.get(policy),
            )
        frac = part["cache_fraction"].iloc[0]
        ax.set_title(f"cache {int(cache)} experts/layer ({frac * 100:.3g}% of the experts)", fontsize=9)
        ax.set_xlabel("H2D bandwidth (GB/s, 1 GB = 1e9 B)")
        ax.set_xscale("log", base=2)
        bandwidths = sorted(part["bandwidth_gb_per_s"].unique())
        ax.set_xticks(bandwidths, [f"{b:g}" for b in bandwidths])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("SIMULATED tokens/s")
    handles = [
        Line2D([], [], color=POLICY_COLORS.get(p), marker="o", label=p) for p in dict.fromkeys(policies_used)
    ]
    if len(styles_used) > 1:
        handles += [
            Line2D(
                [],
                [],
                color="black",
                linestyle=style,
                label=f"overlap {o}, prefetch {f}",
            )
            for (o, f), style in sorted(
                styles_used.items(), key=lambda item: list(OVERLAP_PREFETCH_STYLES).index(item[0])
            )
        ]
    if len(markers) > 1:
        handles += [
            Line2D(
                [],
                [],
                color="black",
                linestyle="",
                marker=m,
                label=", ".join(f"{k} {v}" for k, v in zip(marker_keys, combo) if v != "nan") or "(none)",
            )
            for combo, m in markers.items()
        ]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:  # each line wrapped to the figure's width (about 17 characters per inch at 8 pt)
        chars = max(60, int(17 * fig.get_figwidth()))
        fig.suptitle(
            "\n".join(textwrap.fill(t, chars, subsequent_indent="    ") for t in title.splitlines()),
            fontsize=8,
        )
    fig.tight_layout()
    return fig
