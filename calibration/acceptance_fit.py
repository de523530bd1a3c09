"""Fit the acceptance calibration map (draft probability -> observed acceptance).

Default scope ``"edge"``: the map takes a node's own draft probability ``exp(draft_logprob)`` to its
acceptance GIVEN that its parent's path was accepted (fitted on exactly those nodes); the planner
multiplies it along the path (``specfit.acceptance.path_accept_probs``). Scope ``"path"`` fits one
map from the draft path probability to path acceptance, pooling every depth.

Data: the ``nodes`` table of dense traces (every node of every maximal tree with its draft
``path_logprob`` and its ``accepted`` flag, which is local: token == parent's target token). A node's
*path* is accepted when it and all its ancestors are accepted; the planner's P(v) is the probability
of that event (``specfit.acceptance``).

Method: isotonic regression (pool-adjacent-violators, ``scipy.optimize.isotonic_regression``) of
the path-accepted indicator on the draft path probability ``exp(path_logprob)``, computed on
quantile bins (at most ``num_bins``, weights = nodes per bin) so the map has few knots; the knots are
the bins' mean draft probabilities and the isotonic bin rates. EAGLE-2 (Li et al., 2024) showed the
draft's confidence tracks acceptance; isotonic regression (Zadrozny & Elkan, 2002) corrects its
calibration without assuming a shape. Trees are split into fit and held-out sets by seed; the
reliability table is computed on the held-out trees (all trees when the hold-out is empty).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import isotonic_regression

from specfit.acceptance import AcceptanceCalibration, top_child_mask

NODE_COLUMNS = ("request_id", "position", "node_id", "parent", "depth", "path_logprob", "accepted")


class AcceptanceDataError(ValueError):
    """Bad or insufficient dense-trace data for the acceptance fit (names the field)."""


def path_accepted(nodes: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node: draft path probability, path-accepted flag and tree index.

    Args:
        nodes: the ``nodes`` table (sorted or not) with :data:`NODE_COLUMNS`.

    Returns:
        (prob float64[R], path_accepted bool[R], tree int64[R]) in the table's sorted
        (request_id, position, node_id) order; ``tree`` numbers the (request_id, position) trees.

    Raises:
        AcceptanceDataError: missing columns, a parent id not earlier in its tree, NaN log-probs.
    """
    missing = [c for c in NODE_COLUMNS if c not in nodes.columns]
    if missing:
        raise AcceptanceDataError(f"nodes table lacks column(s) {missing}")
    df = nodes.sort_values(["request_id", "position", "node_id"], kind="stable").reset_index(drop=True)
    logp = df["path_logprob"].to_numpy(dtype=np.float64)
    if not np.all(np.isfinite(logp)) or np.any(logp > 1e-6):
        raise AcceptanceDataError("nodes: field 'path_logprob' must be finite and <= 0 (a log-probability)")
    tree = df.groupby(["request_id", "position"], sort=False).ngroup().to_numpy()
    node_id = df["node_id"].to_numpy(dtype=np.int64)
    parent = df["parent"].to_numpy(dtype=np.int64)
    start = np.flatnonzero(np.r_[True, tree[1:] != tree[:-1]])
    tree_start = start[tree]
    if np.any(node_id != np.arange(len(df)) - tree_start):
        raise AcceptanceDataError(
            "nodes: field 'node_id' must run 0..N-1 within each (request_id, position) tree"
        )
    if np.any((parent >= node_id) | ((parent < 0) & (node_id > 0))):
        raise AcceptanceDataError(
            "nodes: field 'parent' must precede its node (parent < node_id, -1 at the root)"
        )
    accepted = df["accepted"].to_numpy(dtype=bool)
    parent_row = np.where(parent >= 0, tree_start + parent, -1)
    path_ok = accepted.copy()
    depth = df["depth"].to_numpy(dtype=np.int64)
    expected_depth = np.where(parent_row >= 0, depth[np.maximum(parent_row, 0)] + 1, 0)
    if np.any(depth != expected_depth):
        raise AcceptanceDataError("nodes: field 'depth' must be 0 at the root and parent depth + 1 elsewhere")
    for d in range(1, int(depth.max()) + 1 if depth.size else 0):  # parents are one level up
        rows = np.flatnonzero(depth == d)
        path_ok[rows] &= path_ok[parent_row[rows]]
    return np.exp(logp), path_ok, tree


@dataclass(frozen=True)
class AcceptanceFit:
    """Fitted acceptance calibration and its reliability table.

    Attributes:
        calibration: the :class:`specfit.acceptance.AcceptanceCalibration` map.
        reliability: DataFrame, one row per probability bin: ``bin_lo, bin_hi, num_nodes,
            mean_draft_prob, mean_calibrated_prob, observed_accept_rate``.
        ece_draft, ece_calibrated: expected calibration error (sum over bins of
            num/total * |mean prob - observed|) of the raw draft probability and of the map.
        num_nodes_fit, num_nodes_eval: non-root nodes used to fit / in the table.
    """

    calibration: AcceptanceCalibration
    reliability: pd.DataFrame
    ece_draft: float
    ece_calibrated: float
    num_nodes_fit: int
    num_nodes_eval: int


def _quantile_bins(prob: np.ndarray, num_bins: int) -> np.ndarray:
    edges = np.unique(np.quantile(prob, np.linspace(0.0, 1.0, num_bins + 1)))
    if edges.size < 2:
        edges = np.array([max(prob.min() - 1e-9, 0.0), min(prob.max() + 1e-9, 1.0)])
    return edges


def fit_acceptance(
    nodes: pd.DataFrame,
    *,
    scope: str = "edge",
    num_bins: int = 20,
    holdout_fraction: float = 0.25,
    seed: int = 0,
    min_nodes: int = 20,
    source: str = "calibration.fit",
) -> AcceptanceFit:
    """Fit the monotone acceptance map on dense-trace nodes and build its reliability table.

    Args:
        nodes: dense ``nodes`` table (:data:`NODE_COLUMNS`; ``"edge"`` also needs ``draft_logprob``).
        scope: ``"edge"`` (per-token acceptance given the parent's path; default) or ``"path"``.
        num_bins: quantile bins (knots) at most.
        holdout_fraction: share of trees held out for the reliability table.
        seed: seed of the tree split.
        min_nodes: fewest non-root nodes accepted in the fit set.
        source: provenance written into the map.

    Returns:
        :class:`AcceptanceFit`.

    Raises:
        AcceptanceDataError: bad table, unknown scope, or fewer than ``min_nodes`` non-root nodes.
    """
    if scope not in ("edge", "path"):
        raise AcceptanceDataError(f"scope: expected 'edge' or 'path', got {scope!r}")
    prob, ok, tree = path_accepted(nodes)
    ordered = nodes.sort_values(["request_id", "position", "node_id"], kind="stable")
    node_id = ordered["node_id"].to_numpy()
    non_root = node_id > 0
    if scope == "edge":
        if "draft_logprob" not in ordered.columns:
            raise AcceptanceDataError("nodes table lacks column 'draft_logprob' (needed for scope 'edge')")
        edge_prob = np.exp(ordered["draft_logprob"].to_numpy(dtype=np.float64))
        if not np.all(np.isfinite(edge_prob)):
            raise AcceptanceDataError("nodes: field 'draft_logprob' must be finite (a log-probability)")
        start = np.flatnonzero(np.r_[True, tree[1:] != tree[:-1]])
        parent = ordered["parent"].to_numpy(dtype=np.int64)
        parent_row = np.where(parent >= 0, start[tree] + parent, 0)
        parent_row_global = np.where(parent >= 0, parent_row, -1)
        local = ordered["accepted"].to_numpy(dtype=bool)
        reached = non_root & ok[parent_row]  # the parent's path was accepted
    else:
        edge_prob, local, reached = prob, ok, non_root
    num_trees = int(tree.max()) + 1 if tree.size else 0
    rng = np.random.default_rng(seed)
    held_trees = np.zeros(num_trees, dtype=bool)
    held_trees[rng.permutation(num_trees)[: int(round(holdout_fraction * num_trees))]] = True
    fit_rows = reached & ~held_trees[tree]
    eval_rows = non_root & held_trees[tree] if held_trees.any() else non_root
    if fit_rows.sum() < min_nodes:
        raise AcceptanceDataError(
            f"nodes: {int(fit_rows.sum())} non-root nodes in the fit set; need >= {min_nodes} (record more dense trees)"
        )
    runner_up = None
    if scope == "edge":  # the draft's argmax child and its siblings get separate maps
        is_top = top_child_mask(parent_row_global, ordered["draft_logprob"].to_numpy(dtype=np.float64))
        top_rows, other_rows = fit_rows & is_top, fit_rows & ~is_top
        if top_rows.sum() >= min_nodes and other_rows.sum() >= min_nodes:
            knots_x, knots_y = _isotonic_map(edge_prob[top_rows], local[top_rows], num_bins)
            runner_up = _isotonic_map(edge_prob[other_rows], local[other_rows], num_bins)
        else:
            knots_x, knots_y = _isotonic_map(edge_prob[fit_rows], local[fit_rows], num_bins)
    else:
        knots_x, knots_y = _isotonic_map(edge_prob[fit_rows], local[fit_rows], num_bins)
    calibration = AcceptanceCalibration(
        knots_x=knots_x,
        knots_y=knots_y,
        source=source,
        scope=scope,
        runner_up_knots_x=None if runner_up is None else runner_up[0],
        runner_up_knots_y=None if runner_up is None else runner_up[1],
    )
    if scope == "edge":  # P(v) = product of the mapped per-token probabilities along the path
        edge = calibration.apply_edges(edge_prob, is_top)
        calibrated = _edge_path_probs(edge, parent_row, ordered["depth"].to_numpy())
    else:
        calibrated = calibration.apply(prob)
    table, ece_raw, ece_cal = reliability_table(
        prob[eval_rows], ok[eval_rows], calibrated[eval_rows], num_bins=num_bins
    )
    return AcceptanceFit(calibration, table, ece_raw, ece_cal, int(fit_rows.sum()), int(eval_rows.sum()))


def _isotonic_map(x: np.ndarray, accepted: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(knots_x, knots_y): isotonic regression of ``accepted`` on ``x`` over quantile bins."""
    y = np.asarray(accepted, dtype=np.float64)
    edges = _quantile_bins(x, num_bins)
    idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, edges.size - 2)
    counts = np.bincount(idx, minlength=edges.size - 1).astype(np.float64)
    used = counts > 0
    mean_x = np.bincount(idx, weights=x, minlength=edges.size - 1)[used] / counts[used]
    rate = np.bincount(idx, weights=y, minlength=edges.size - 1)[used] / counts[used]
    iso = isotonic_regression(rate, weights=counts[used], increasing=True).x
    knots_x, keep = np.unique(np.clip(mean_x, 0.0, 1.0), return_index=True)
    knots_y = np.clip(np.maximum.accumulate(iso[keep]), 0.0, 1.0)
    return knots_x, knots_y


def _edge_path_probs(edge: np.ndarray, parent_row: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """float64[R]: product of ``edge`` along each node's path (roots 1), rows sorted by tree then node."""
    p = np.ones(edge.shape[0], dtype=np.float64)
    for d in range(1, int(depth.max()) + 1 if depth.size else 0):
        rows = np.flatnonzero(depth == d)
        p[rows] = p[parent_row[rows]] * edge[rows]
    return p


def reliability_table(
    draft_prob: np.ndarray,
    accepted: np.ndarray,
    calibrated: np.ndarray | AcceptanceCalibration,
    *,
    num_bins: int = 10,
) -> tuple[pd.DataFrame, float, float]:
    """Reliability table of raw and calibrated probabilities on equal-width bins of draft probability.

    Args:
        draft_prob: float[n] draft path probabilities; accepted: bool[n] path-accepted flags.
        calibrated: float[n] the calibrated P(v) of the same nodes, or a path-scope map to apply.
        num_bins: equal-width bins over [0, 1].

    Returns:
        (table, ECE of the draft probability, ECE of the calibrated probability); ECE is NaN
        without rows.
    """
    p = np.asarray(draft_prob, dtype=np.float64)
    a = np.asarray(accepted, dtype=np.float64)
    cal = (
        calibrated.apply(p)
        if isinstance(calibrated, AcceptanceCalibration)
        else np.asarray(calibrated, float)
    )
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    idx = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, num_bins - 1)
    rows = []
    ece_raw = ece_cal = 0.0
    for b in range(num_bins):
        sel = idx == b
        n = int(sel.sum())
        if n == 0:
            continue
        mp, mc, obs = float(p[sel].mean()), float(cal[sel].mean()), float(a[sel].mean())
        rows.append((edges[b], edges[b + 1], n, mp, mc, obs))
        ece_raw += n * abs(mp - obs)
        ece_cal += n * abs(mc - obs)
    cols = [
        "bin_lo",
        "bin_hi",
        "num_nodes",
        "mean_draft_prob",
        "mean_calibrated_prob",
        "observed_accept_rate",
    ]
    table = pd.DataFrame(rows, columns=cols)
    total = float(p.size)
    if total == 0:
        return table, float("nan"), float("nan")
    return table, ece_raw / total, ece_cal / total
