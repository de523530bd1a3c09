"""The report's figures, one function each; every function returns the PNG path or ``None`` (no data).

matplotlib is imported inside :func:`_pyplot` with the non-interactive ``Agg`` backend, so importing
this module has no side effect. Axis labels carry units; metric conventions are docs/metrics.md.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import metrics

FIGURES = (
    "throughput_vs_bandwidth",
    "predicted_vs_measured",
    "acceptance_per_depth",
    "expert_union_growth",
    "hit_rate_vs_cache",
    "time_split",
)
FULL_TREE_POLICIES = ("topn", "full")
# Where a row's numbers come from, as figure legends and titles say it.
SOURCE_NAMES = {"sim": "SIMULATED", "live": "MEASURED live"}


# Regime-map bands (a full-tree policy slower than autoregressive), one style per source so a
# band always says whose throughput it is: simulated = red "//" hatch, live = blue "\\" hatch
# (both at one bandwidth: cross-hatched).
SLOW_BAND_STYLES = {
    "sim": {"facecolor": (1.0, 0.0, 0.0, 0.08), "edgecolor": (0.8, 0.0, 0.0, 0.55), "hatch": "//"},
    "live": {"facecolor": (0.0, 0.3, 1.0, 0.08), "edgecolor": (0.0, 0.2, 0.8, 0.55), "hatch": "\\\\"},
}
OTHER_BAND_STYLE = {"facecolor": (0.5, 0.5, 0.5, 0.1), "edgecolor": (0.3, 0.3, 0.3, 0.55), "hatch": ".."}


def source_name(source: str) -> str:
    """``SIMULATED`` / ``MEASURED live`` for the ``sim`` / ``live`` sources (others as given)."""
    return SOURCE_NAMES.get(str(source), str(source))


def slow_band_label(source: str) -> str:
    """Legend label of a regime-map band of ``source`` (``sim`` / ``live``)."""
    return f"full tree slower than AR ({source_name(source).lower()})"


def informative_bands(slow_bandwidths: Any, drawn_bandwidths: Any) -> list[float]:
    """The bandwidths worth hatching: ``slow_bandwidths`` unless they are every bandwidth drawn
    (a band over the whole axis distinguishes nothing; the panel title says it instead).

    Args:
        slow_bandwidths: iterable of bandwidths (GB/s) where a full tree is slower than AR.
        drawn_bandwidths: iterable of every bandwidth (GB/s) the panel draws.

    Returns:
        The sorted, distinct ``slow_bandwidths`` (GB/s), or ``[]`` when they cover every drawn one.
    """
    slow = sorted({float(b) for b in slow_bandwidths})
    return [] if set(slow) >= {float(b) for b in drawn_bandwidths} else slow


def _color(policy: str) -> str | None:
    from sim.report import POLICY_COLORS  # one palette for the sweep's and the report's figures

    return POLICY_COLORS.get(str(policy))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    title = fig._suptitle.get_text() if fig._suptitle is not None else ""
    # leave room above the panels for a figure title (about 0.25 inch per line)
    top = 1.0 - (0.25 * (title.count("\n") + 1) + 0.1) / fig.get_figheight() if title else 1.0
    fig.tight_layout(rect=(0.0, 0.0, 1.0, top))
    fig.savefig(path, dpi=100, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def with_config(throughput: pd.DataFrame) -> pd.DataFrame:
    """``throughput`` with a ``config`` column (one unnamed configuration, ``""``, when absent).

    Cells of different ``config`` values are never averaged together (analysis.inputs.config_label).
    """
    if "config" in throughput.columns:
        return throughput.assign(config=throughput["config"].fillna("").astype(str))
    return throughput.assign(config="")


def slower_than_ar(throughput: pd.DataFrame) -> pd.DataFrame:
    """Rows (config, source, cache, bandwidth) where a full-tree policy is slower than autoregressive.

    Only cells of the same configuration (``config`` column, see :func:`with_config`) are compared.

    Returns:
        DataFrame ``config, source, cache_experts_per_layer, bandwidth_gb_per_s, ar_tokens_per_s,
        full_tokens_per_s, specfit_tokens_per_s`` (the regime map's shaded cells).
    """
    df = with_config(throughput).dropna(subset=["bandwidth_gb_per_s"])
    keys = ["config", "source", "cache_experts_per_layer", "bandwidth_gb_per_s"]
    pivot = df.pivot_table(index=keys, columns="policy", values="tokens_per_s", aggfunc="mean")
    if "ar" not in pivot.columns:
        return pd.DataFrame(columns=[*keys, "ar_tokens_per_s", "full_tokens_per_s", "specfit_tokens_per_s"])
    full_cols = [c for c in FULL_TREE_POLICIES if c in pivot.columns]
    full = pivot[full_cols].max(axis=1) if full_cols else pd.Series(np.nan, index=pivot.index)
    out = pd.DataFrame(
        {
            "ar_tokens_per_s": pivot["ar"],
            "full_tokens_per_s": full,
            "specfit_tokens_per_s": pivot["specfit"] if "specfit" in pivot.columns else np.nan,
        }
    ).reset_index()
    return out[out["full_tokens_per_s"] < out["ar_tokens_per_s"]].reset_index(drop=True)


def throughput_configs(throughput: pd.DataFrame, max_configs: int = 6) -> list[str]:
    """The configurations :func:`throughput_vs_bandwidth` draws, in order (at most ``max_configs``)."""
    df = with_config(throughput).dropna(subset=["bandwidth_gb_per_s", "tokens_per_s"])
    return list(dict.fromkeys(df["config"]))[:max_configs]


def throughput_vs_bandwidth(
    throughput: pd.DataFrame, path: Path, max_configs: int = 6, max_caches: int = 4
) -> Path | None:
    """Regime map: tokens/s against bandwidth per policy; one row of panels per configuration.

    Each configuration (``config`` column; one when absent) gets its own row of panels, one
    panel per cache size, so cells of different expert sizes, overlap, prefetch, predictor, cache
    policy or source never share a line and are never averaged (only repeated cells of one
    configuration are). Colour = policy; solid lines are SIMULATED, dashed lines MEASURED live.
    Hatched bandwidths: a full-tree policy (top-N / full) is slower than autoregressive there,
    per source (:data:`SLOW_BAND_STYLES`: red ``//`` from the simulated cells, blue ``\\`` from
    the live ones; cross-hatched when both), each band named in the legend; hatched only where it
    distinguishes (:func:`informative_bands`): when it holds at every bandwidth of the panel the
    panel title says so instead. Legends sit outside.

    Args:
        throughput: one row per cell: ``source`` (``sim`` / ``live``), ``policy``,
            ``bandwidth_gb_per_s`` (GB/s), ``cache_experts_per_layer`` (count), ``tokens_per_s``
            (committed tokens per second), optional ``config`` (``analysis.inputs``' throughput table).
        path: the PNG to write (folders made).
        max_configs: the most configurations (rows of panels) drawn, in table order.
        max_caches: the most cache sizes (panels per row) drawn, smallest first.

    Returns:
        ``path``, or ``None`` when no row has a bandwidth and a throughput.

    Raises:
        KeyError: a column named above (other than ``config``) is missing.
    """
    df = with_config(throughput).dropna(subset=["bandwidth_gb_per_s", "tokens_per_s"])
    if df.empty:
        return None
    plt = _pyplot()
    configs = throughput_configs(df, max_configs)
    panels = []
    for config in configs:
        sub = df[df["config"] == config]
        caches = sorted(sub["cache_experts_per_layer"].dropna().unique().tolist()) or [None]
        panels.append([(config, cache) for cache in caches[:max_caches]])
    ncols = max(len(row) for row in panels)
    fig, axes = plt.subplots(len(panels), ncols, figsize=(6.5 * ncols, 4.7 * len(panels)), squeeze=False)
    slow = slower_than_ar(df)
    for r, row in enumerate(panels):
        for c in range(len(row), ncols):
            axes[r][c].axis("off")
        for ax, (config, cache) in zip(axes[r], row):
            sub = df[df["config"] == config]
            if cache is not None:
                sub = sub[sub["cache_experts_per_layer"] == cache]
            for (source, policy), g in sub.groupby(["source", "policy"]):
                g = g.groupby("bandwidth_gb_per_s", as_index=False)["tokens_per_s"].mean()
                style = "-o" if source == "sim" else "--s"
                ax.plot(
                    g["bandwidth_gb_per_s"],
                    g["tokens_per_s"],
                    style,
                    color=_color(policy),
                    label=f"{policy} ({source_name(source)})",
                )
            mine = slow[(slow["config"] == config) & (slow["cache_experts_per_layer"] == cache)]
            notes = []
            for source, bands in mine.groupby("source", sort=True):
                drawn = sub.loc[sub["source"] == source, "bandwidth_gb_per_s"].unique()
                hatched = informative_bands(bands["bandwidth_gb_per_s"], drawn)
                if not hatched:
                    notes.append(f"full tree slower than AR at every bandwidth ({source_name(source)})")
                style = SLOW_BAND_STYLES.get(str(source), OTHER_BAND_STYLE)
                for i, bw in enumerate(hatched):
                    ax.axvspan(
                        bw / 1.15,
                        bw * 1.15,
                        lw=0,
                        label=slow_band_label(source) if i == 0 else None,
                        **style,
                    )
            ax.set_xscale("log")
            ticks = sorted(sub["bandwidth_gb_per_s"].unique())
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("H2D bandwidth (GB/s, 1 GB = 1e9 B)")
            ax.set_ylabel("throughput (committed tokens / s)")
            title = "\n".join([f"cache {cache} experts/layer", *notes])
            ax.set_title(f"{textwrap.fill(config, 60)}\n{title}" if config else title, fontsize=8)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(
        "Throughput against H2D bandwidth: solid = SIMULATED (sim.sweep / validate replay), "
        "dashed = MEASURED live runs",
        fontsize=10,
    )
    return _save(fig, path)


def _ms_label(value: float, _pos: Any = None) -> str:
    """Tick label in milliseconds for 1, 2 and 5 x 10^k seconds (others unlabelled: log axes
    stay uncluttered)."""
    if not value > 0:
        return ""
    lead = value / 10 ** np.floor(np.log10(value) + 1e-9)
    return f"{value * 1e3:g}" if any(abs(lead - d) < 1e-6 for d in (1, 2, 5)) else ""


def predicted_vs_measured(scatter: pd.DataFrame, path: Path) -> Path | None:
    """Per-cycle predicted vs measured cycle time (log-log, ms), y = x line, one series per ``label``
    with its median/p90 |error| in the legend, which sits below the axes (never over the points;
    the figure grows with the series). A ``"... calibrated: <policy>"`` series takes its policy's
    colour; planner series (``"(planner)"``) are drawn as crosses.

    Args:
        scatter: one row per cycle: ``label``, ``predicted_s`` and ``measured_s`` (seconds);
            rows with a missing or non-positive time are left out.
        path: the PNG to write (folders made).

    Returns:
        ``path``, or ``None`` when no row is left.

    Raises:
        KeyError: a column named above is missing.
    """
    df = scatter.dropna()
    df = df[(df["measured_s"] > 0) & (df["predicted_s"] > 0)]
    if df.empty:
        return None
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    groups = list(df.groupby("label"))
    fig, ax = plt.subplots(figsize=(6.0, 5.5 + 0.17 * len(groups)))
    for label, g in groups:
        s = metrics.error_summary(g["predicted_s"], g["measured_s"])
        policy = str(label).rsplit("calibrated: ", 1)[-1] if "calibrated: " in str(label) else None
        ax.scatter(
            g["measured_s"],
            g["predicted_s"],
            s=10 if "(planner)" in str(label) else 8,
            alpha=0.6,
            marker="x" if "(planner)" in str(label) else "o",
            color=_color(policy) if policy else None,
            label=f"{label}: median {s.median_abs_pct_error:.1f}%, p90 {s.p90_abs_pct_error:.1f}%",
        )
    lo, hi = (
        float(df[["measured_s", "predicted_s"]].min().min()),
        float(df[["measured_s", "predicted_s"]].max().max()),
    )
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    # under a decade every minor tick is labelled (else few or none would be), else 1, 2, 5 x 10^k
    minor = _ms_label if hi / lo >= 10 else (lambda v, _pos=None: f"{v * 1e3:.3g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(_ms_label))
        axis.set_minor_formatter(FuncFormatter(minor))
    ax.set_xlabel("measured cycle time (ms, planner time excluded)")
    ax.set_ylabel("predicted cycle time (ms)")
    ax.set_title("Per-cycle cycle time: cost-model PREDICTED vs MEASURED (live runs)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)  # below the axes
    return _save(fig, path)


def dense_depth_acceptance(arrays: Any) -> np.ndarray:
    """Conditional per-depth acceptance of the full dense trees of one run (see docs/metrics.md).

    A tree reached depth d when the node its accepted path ends on at depth d - 1 has a child
    (``traces.stats.reached_depths``), the definition ``python -m traces.inspect`` uses too.

    Args:
        arrays: :class:`traces.reader.NodeArrays` of a dense run (T trees).

    Returns:
        float64[D]: ``alpha_d = accepted(d) / reached(d)`` for ``d = 1..D``
        (:func:`analysis.metrics.per_depth_acceptance`).
    """
    from traces.stats import accepted_lengths, reached_depths

    return metrics.per_depth_acceptance(accepted_lengths(arrays), reached_depths(arrays))


def acceptance_per_depth(dense: list, path: Path) -> Path | None:
    """Conditional acceptance accepted(d) / reached(d) per depth, one bar series per dense run
    (:func:`dense_depth_acceptance`, docs/metrics.md).

    Args:
        dense: ``(label, NodeArrays, num_experts)`` per dense run (``analysis.inputs``).
        path: the PNG to write (folders made).

    Returns:
        ``path``, or ``None`` when ``dense`` is empty.
    """
    if not dense:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(dense)
    for i, (label, arrays, _) in enumerate(dense):
        acc = dense_depth_acceptance(arrays)
        depths = np.arange(1, acc.size + 1)
        ax.bar(depths + i * width - 0.4 + width / 2, acc, width=width, label=label)
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("acceptance at d given d reached")
    ax.set_ylim(0, 1)
    ax.set_title(
        "Per-depth conditional acceptance of the full dense trees\n(MEASURED: recorded by live.record; "
        "runs marked synthetic: generated)",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def union_growth(arrays: Any, num_experts: int, calibration: Any = None) -> np.ndarray:
    """float64[L, M+1] mean distinct experts per layer among a tree's n most likely nodes (root first).

    Args:
        arrays: :class:`traces.reader.NodeArrays` of a dense run (T trees, M = the largest tree).
        num_experts: experts per layer ``E``.
        calibration: None to rank each tree's nodes by draft path probability
            ``exp(path_logprob)``, the order the planner's union-size table is fitted in
            (``calibration.predictor_tables``, ``sim.replay`` and ``live.spec.session`` alike); or
            an :class:`specfit.acceptance.AcceptanceCalibration` to rank them by calibrated
            acceptance ``P(v)`` (:func:`specfit.acceptance.path_accept_probs`), the order in which
            SpecFit's planner takes its top-by-P prefixes of the tree (``specfit.decide_kernels``).

    Returns:
        float64[L, M+1]: column ``n`` is :func:`specfit.predictors.union_size_from_trees`'s mean
        over the trees with at least ``n`` nodes (column 0 is 0), through
        :func:`specfit.predictors.union_size_from_node_arrays` (the planner's table when
        ``calibration`` is None).

    Raises:
        ValueError: a run without dense trees.
    """
    from specfit.predictors import union_size_from_node_arrays

    probs = None
    if calibration is not None:
        from specfit.acceptance import path_accept_probs

        probs = [path_accept_probs(arrays.tree(i).tree, calibration) for i in range(arrays.num_trees)]
    return union_size_from_node_arrays(arrays, num_experts, probs)


DRAFT_RANKED = "nodes ranked by draft path probability (the planner's union-size table)"
CALIBRATED_RANKED = "nodes ranked by calibrated acceptance (the order the planner asks in)"


def expert_union_growth(dense: list, path: Path, acceptance: dict | None = None) -> Path | None:
    """Distinct experts against verified-tree size, per layer (thin) and mean (bold), with the n*K bound.

    Each panel ranks a tree's nodes by draft path probability, as the union-size table the
    planner prices with is fitted (:func:`union_growth`); where ``acceptance`` holds an
    :class:`specfit.acceptance.AcceptanceCalibration` for the run's label (its ``acceptance.json``),
    the mean over layers with the nodes ranked by calibrated acceptance, the order SpecFit's
    planner asks in, is drawn beside it. The legend says which curve ranks how.

    Args:
        dense: ``(label, NodeArrays, num_experts)`` per dense run (``analysis.inputs``), one panel each.
        path: the PNG to write (folders made).
        acceptance: ``{label: AcceptanceCalibration or None}``; None: draft ranking only.

    Returns:
        ``path``, or ``None`` when ``dense`` is empty.

    Raises:
        ValueError: a run without dense trees (:func:`union_growth`).
    """
    if not dense:
        return None
    acceptance = acceptance or {}
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(dense), figsize=(5.5 * len(dense), 4), squeeze=False)
    for ax, (label, arrays, num_experts) in zip(axes[0], dense):
        curve = union_growth(arrays, num_experts)
        n = np.arange(curve.shape[1])
        for layer in range(curve.shape[0]):
            ax.plot(n, curve[layer], color="tab:blue", alpha=0.25, lw=0.8)
        ax.plot(n, curve.mean(axis=0), color="tab:blue", lw=2.5, label=f"mean over layers, {DRAFT_RANKED}")
        if acceptance.get(label) is not None:
            calibrated = union_growth(arrays, num_experts, acceptance[label])
            ax.plot(
                n, calibrated.mean(axis=0), color="tab:orange", lw=2, ls="-.", label=f"mean, {CALIBRATED_RANKED}"
            )
        top_k = arrays.expert_ids.shape[2]
        ax.plot(n, np.minimum(n * top_k, num_experts), "k--", lw=1, label="no sharing (n x K, capped at E)")
        ax.set_xlabel("nodes in the subtree (most likely first, root included)")
        ax.set_ylabel("distinct experts per layer")
        what = "generated routing" if str(label).endswith("(synthetic)") else "MEASURED routing"
        ax.set_title(f"Expert-union growth ({what} of the dense trees): {label}", fontsize=9)
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def hit_rate_vs_cache(hit_rates: pd.DataFrame, path: Path, max_panels: int = 8) -> Path | None:
    """Expert-cache hit rate against cache size (experts per layer), per policy and source, one
    panel per bandwidth (runs at different bandwidths never share a panel or a line; rows
    without a known bandwidth get their own panel). Solid: SIMULATED, dashed: MEASURED live.
    At most ``max_panels`` bandwidths are drawn (the lowest), the title says how many of how many.

    Args:
        hit_rates: one row per cell: ``source``, ``policy``, ``cache_experts_per_layer`` (count),
            ``hit_rate`` (fraction in [0, 1]), optional ``bandwidth_gb_per_s`` (GB/s).
        path: the PNG to write (folders made).
        max_panels: the most bandwidths drawn.

    Returns:
        ``path``, or ``None`` when no row has a cache size and a hit rate.

    Raises:
        KeyError: a column named above (other than ``bandwidth_gb_per_s``) is missing.
    """
    df = hit_rates.dropna(subset=["cache_experts_per_layer", "hit_rate"])
    if df.empty:
        return None
    if "bandwidth_gb_per_s" not in df.columns:
        df = df.assign(bandwidth_gb_per_s=np.nan)
    plt = _pyplot()
    known = sorted(df["bandwidth_gb_per_s"].dropna().unique().tolist())
    bandwidths: list[float | None] = [*known, *([None] if df["bandwidth_gb_per_s"].isna().any() else [])]
    shown = bandwidths[:max_panels]
    ncols = min(len(shown), 4)
    nrows = -(-len(shown) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.8 * nrows), squeeze=False, sharey=True)
    for ax in axes.flat[len(shown) :]:
        ax.axis("off")
    for ax, bw in zip(axes.flat, shown):
        part = df[df["bandwidth_gb_per_s"].isna()] if bw is None else df[df["bandwidth_gb_per_s"] == bw]
        for (source, policy), g in part.groupby(["source", "policy"]):
            g = g.groupby("cache_experts_per_layer", as_index=False)["hit_rate"].mean()
            style = "-o" if source == "sim" else "--s"
            ax.plot(
                g["cache_experts_per_layer"],
                100 * g["hit_rate"],
                style,
                color=_color(policy),
                label=f"{policy} ({source_name(source)})",
            )
        ax.set_title("bandwidth unknown" if bw is None else f"H2D bandwidth {bw:g} GB/s", fontsize=9)
        ax.set_xlabel("cache size (experts per layer)")
        ax.set_ylabel("hit rate (%)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    more = f" (first {len(shown)} of {len(bandwidths)} bandwidths)" if len(shown) < len(bandwidths) else ""
    fig.suptitle(
        f"Expert-cache hit rate against cache size, one panel per bandwidth{more}: "
        "solid = SIMULATED, dashed = MEASURED live",
        fontsize=10,
    )
    return _save(fig, path)


MAX_TIME_SPLIT_BARS = 300  # one bar per row up to here (a 100 dpi figure about 9000 px tall)


def time_split_rows(split: pd.DataFrame, max_bars: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(drawn, left_out)`` rows of :func:`time_split`: live and validate rows first (measured),
    then simulated cells in table order; every row is drawn unless there are more than ``max_bars``
    (default :data:`MAX_TIME_SPLIT_BARS`)."""
    if split.empty:
        return split, split
    max_bars = MAX_TIME_SPLIT_BARS if max_bars is None else max_bars
    simulated = split["label"].astype(str).str.startswith("sim")
    ordered = pd.concat([split[~simulated], split[simulated]])
    return ordered.head(max_bars), ordered.iloc[max_bars:]


def time_split(split: pd.DataFrame, path: Path, max_bars: int | None = None) -> Path | None:
    """Share of decode time spent drafting, verifying (compute), in H2D copies and elsewhere.

    One bar per row of ``split`` (the figure grows with the rows), measured rows first; only past
    ``max_bars`` rows are the remaining ones left out, which the title says (and the report lists
    them, :func:`time_split_rows`). Bars sit at their own positions, so rows sharing a label are
    still drawn apart.

    Args:
        split: one row per run or cell: ``label`` (``live ...`` / ``validate ...`` measured,
            ``sim ...`` simulated), ``draft_s``, ``verify_s``, ``h2d_s``, ``other_s`` (seconds).
        path: the PNG to write (folders made).
        max_bars: the most rows drawn (default :data:`MAX_TIME_SPLIT_BARS`).

    Returns:
        ``path``, or ``None`` when ``split`` is empty.

    Raises:
        KeyError: a column named above is missing.
    """
    if split.empty:
        return None
    df, left_out = time_split_rows(split, max_bars)
    plt = _pyplot()
    total = df[["draft_s", "verify_s", "h2d_s", "other_s"]].sum(axis=1).replace(0, np.nan)
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(df) + 1.5))
    y = np.arange(len(df))
    left = np.zeros(len(df))
    for col, name in (
        ("draft_s", "draft"),
        ("verify_s", "verify compute"),
        ("h2d_s", "H2D"),
        ("other_s", "other"),
    ):
        share = (100 * df[col] / total).fillna(0).to_numpy()
        ax.barh(y, share, left=left, label=name)
        left += share
    ax.set_yticks(y, df["label"].astype(str).tolist())
    ax.set_ylim(len(df) - 0.5, -0.5)  # first row on top
    ax.set_xlabel("share of decode time (%)")
    title = f"Time split: draft / compute / H2D ({len(df)} rows)"
    if len(left_out):
        title = f"Time split: draft / compute / H2D (first {len(df)} of {len(split)} rows; rest listed in the report)"
    ax.set_title(f"{title}\nrows 'live ...': MEASURED; rows 'sim ...': SIMULATED", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.tick_params(axis="y", labelsize=7)
    return _save(fig, path)


def sim_vs_live_throughput(table: pd.DataFrame, path: Path) -> Path | None:
    """Simulated against live tokens/s per validation cell (``fidelity.csv`` rows), with a grey band of
    +/- the throughput aim (:class:`analysis.fidelity.Targets` ``throughput_pct``, 2 % by default).

    Args:
        table: one row per cell: ``policy``, ``live_tokens_per_s``, ``sim_tokens_per_s``
            (committed tokens per second).
        path: the PNG to write (folders made).

    Returns:
        ``path``, or ``None`` when ``table`` is empty.

    Raises:
        KeyError: a column named above is missing.
    """
    if table.empty:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    for policy, g in table.groupby("policy"):
        ax.scatter(g["live_tokens_per_s"], g["sim_tokens_per_s"], color=_color(policy), label=policy)
    lo = float(table[["live_tokens_per_s", "sim_tokens_per_s"]].min().min())
    hi = float(table[["live_tokens_per_s", "sim_tokens_per_s"]].max().max())
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=1)
    from analysis.fidelity import Targets

    aim_pct = Targets().throughput_pct
    band_fraction = aim_pct / 100.0
    ax.fill_between(
        xs, xs * (1.0 - band_fraction), xs * (1.0 + band_fraction), color="gray", alpha=0.2, label=f"+/- {aim_pct:g} % (aim)"
    )
    ax.set_xlabel("MEASURED live throughput (tokens/s)")
    ax.set_ylabel("SIMULATED throughput (tokens/s)")
    ax.set_title("SIMULATED vs MEASURED (live) throughput per cell")
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def cycle_error_distribution(errors: pd.DataFrame, path: Path) -> Path | None:
    """Histogram of per-cycle cost-model errors (%) per policy, with the per-cycle aims marked:
    the grid's median and p90 |error| aims of :class:`analysis.fidelity.Targets` (3 % dashed and
    8 % dotted by default).

    When ``errors`` has a ``cycle_noise_pct`` column with measured values (``analysis.validate``
    with ``--repeats`` >= 2, ``cycle_errors.csv``), a second panel sets the pooled |error| beside
    the run-to-run noise (coefficient of variation of each cycle's time across repeats, %).

    Args:
        errors: one row per cycle: ``policy``, ``cycle_error_pct`` (%, predicted - measured over
            measured), optional ``cycle_noise_pct`` (%).
        path: the PNG to write (folders made).

    Returns:
        ``path``, or ``None`` (nothing drawn) for an empty table.

    Raises:
        KeyError: a column named above (other than ``cycle_noise_pct``) is missing.
    """
    if errors.empty:
        return None
    plt = _pyplot()
    err = pd.to_numeric(errors["cycle_error_pct"], errors="coerce")
    noise = (
        pd.to_numeric(errors["cycle_noise_pct"], errors="coerce").dropna()
        if "cycle_noise_pct" in errors.columns
        else pd.Series(dtype=float)
    )
    if len(noise):
        fig, (ax, ax_noise) = plt.subplots(1, 2, figsize=(11, 4))
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
    for policy, g in errors.assign(cycle_error_pct=err).dropna(subset=["cycle_error_pct"]).groupby("policy"):
        ax.hist(g["cycle_error_pct"], bins=40, alpha=0.5, color=_color(policy), label=policy)
    from analysis.fidelity import Targets

    aims = Targets()
    marks = ((aims.cycle_median_pct, "--", "median aim"), (aims.cycle_p90_pct, ":", "p90 aim"))
    for aim, style, what in marks:
        for x in (-aim, aim):
            ax.axvline(x, color="k", lw=0.6, ls=style, label=f"+/- {aim:g} % ({what})" if x > 0 else None)
    ax.set_xlabel("per-cycle error of the cost model (%, predicted - measured)")
    ax.set_ylabel("cycles")
    ax.set_title("Per-cycle error: cost-model PREDICTED vs MEASURED cycle time")
    ax.legend(fontsize=7, loc="best")
    if len(noise):
        abs_err = err.abs().dropna()
        hi = float(max(abs_err.quantile(0.99) if len(abs_err) else 0.0, noise.quantile(0.99), 1.2 * aims.cycle_p90_pct))
        bins = np.linspace(0.0, hi, 41)
        ax_noise.hist(abs_err.clip(upper=hi), bins=bins, alpha=0.5, color="C0", label="|error| (all cells)")
        ax_noise.hist(
            noise.clip(upper=hi), bins=bins, alpha=0.5, color="C3", label="noise: CV across repeats"
        )
        for aim, style, what in marks:
            ax_noise.axvline(aim, color="k", lw=0.6, ls=style, label=f"{aim:g} % ({what})")
        ax_noise.set_xlabel("% of the cycle time (last bin: at or above)")
        ax_noise.set_ylabel("cycles")
        ax_noise.set_title("Per-cycle |error| beside the MEASURED run-to-run noise")
        ax_noise.legend(fontsize=7, loc="best")
    return _save(fig, path)
