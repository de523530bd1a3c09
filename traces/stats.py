"""Summary statistics of a trace run, for ``python -m traces.inspect`` and quick checks.

Conventions (DESIGN.md): tau counts the bonus token (mean tokens committed per verification);
per-depth acceptance is conditional, accepted(d) / reached(d). "Full-tree" figures are those of
verifying the whole recorded dense tree at every position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.compute as pc

from specfit import bitsets
from traces.reader import NodeArrays, TraceRun

DEFAULT_UNION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
_UNION_CHUNK_TREES = 256


def accepted_lengths(arrays: NodeArrays) -> np.ndarray:
    """int64[T]: accepted draft tokens per tree when the whole tree is verified (deepest
    node whose whole path is accepted; 0 when no child of the root is accepted)."""
    if arrays.num_trees == 0:
        return np.zeros(0, dtype=np.int64)
    depth = np.where(arrays.path_accepted(), arrays.depth, 0)
    return np.maximum.reduceat(depth, arrays.offsets[:-1]).astype(np.int64)


def reached_depths(arrays: NodeArrays) -> np.ndarray:
    """int64[T]: deepest depth each full-tree verification reached.

    The accepted length, plus one when the deepest accepted node has a child in the tree (that
    child was verified and rejected). A tree whose accepted path ends at a leaf did not reach
    the next depth, so it does not count against that depth's acceptance.
    """
    if arrays.num_trees == 0:
        return np.zeros(0, dtype=np.int64)
    ok = arrays.path_accepted()
    sizes = arrays.tree_sizes
    tree = np.repeat(np.arange(arrays.num_trees), sizes)
    rows = np.arange(ok.shape[0])
    parent_rows = np.where(arrays.parent >= 0, arrays.offsets[:-1][tree] + arrays.parent, -1)
    has_child = np.zeros(ok.shape[0], dtype=bool)
    has_child[parent_rows[parent_rows >= 0]] = True
    depth = np.where(ok, arrays.depth, -1)
    deepest = np.full(arrays.num_trees, -1, dtype=np.int64)
    np.maximum.at(deepest, tree, depth)
    is_deepest = ok & (arrays.depth == deepest[tree])
    expanded = np.zeros(arrays.num_trees, dtype=bool)
    expanded[tree[is_deepest]] = has_child[rows[is_deepest]]
    return accepted_lengths(arrays) + expanded.astype(np.int64)


def cycle_reached_depths(cycles: Any) -> tuple[np.ndarray, int]:
    """int64[C]: the depth each recorded cycle's verification reached along its accepted path.

    Args:
        cycles: the ``cycles`` table as a pandas DataFrame (``TraceRun.cycles``) or any mapping
            with ``num_accepted`` and ``num_draft_levels`` columns, and ``reached_depth`` when
            recorded (a column, docs/trace-format.md).

    Returns:
        ``(reached, num_bounded)``: the ``reached_depth`` column where recorded; where it is null
        or absent (traces written before it existed) the upper bound
        ``min(num_accepted + 1, num_draft_levels)``, which assumes the verified subtree extends
        below the accepted path whenever the drafted tree does (exact when the whole tree is
        verified and every node above the last level was expanded); ``num_bounded`` counts those
        cycles, so a caller can say its figures are bounds.

    Use with ``analysis.metrics.per_depth_acceptance(num_accepted, reached)``.
    """
    accepted = np.asarray(cycles["num_accepted"], dtype=np.int64)
    bound = np.minimum(accepted + 1, np.asarray(cycles["num_draft_levels"], dtype=np.int64))
    bound = np.maximum(bound, accepted)
    if "reached_depth" not in cycles:
        return bound, int(accepted.size)
    column = cycles["reached_depth"]
    if hasattr(column, "to_numpy"):  # pandas: float64 with NaN, nullable Int32 or object with None
        recorded = column.to_numpy(dtype=np.float64, na_value=np.nan)
    else:
        recorded = np.array([np.nan if v is None else v for v in column], dtype=np.float64)
    known = ~np.isnan(recorded)
    return np.where(known, np.nan_to_num(recorded), bound).astype(np.int64), int((~known).sum())


def depth_acceptance(accepted_len: np.ndarray, max_depth: int, reached: np.ndarray | None = None) -> list[float]:
    """Conditional acceptance per depth ``d = 1..max_depth``: accepted(d) / reached(d); NaN if unreached.

    ``reached`` int[T] (:func:`reached_depths`): a tree reached depth d when ``reached >= d``
    and its path was accepted up to d - 1; ``None`` takes every tree with ``len >= d - 1`` as
    having reached d. The same convention as ``analysis.metrics.per_depth_acceptance``.
    """
    out = []
    for d in range(1, max_depth + 1):
        at = accepted_len >= d - 1
        if reached is not None:
            at &= reached >= d
        n = int(at.sum())
        out.append(float((accepted_len[at] >= d).sum() / n) if n else float("nan"))
    return out


def expert_union_growth(
    arrays: NodeArrays, num_experts: int, sizes: Sequence[int] = DEFAULT_UNION_SIZES
) -> dict[int, float]:
    """Mean distinct experts per layer touched by the ``n`` most likely nodes of a tree.

    For each tree the nodes are ranked by path log-prob (descending, ties by node id; an
    ancestor-closed prefix, since path probabilities never increase along a path); for each
    ``n`` in ``sizes`` the union of the first ``n`` nodes' experts is counted per layer and
    averaged over layers and over the trees with at least ``n`` nodes.

    Returns:
        ``{n: mean distinct experts per layer}`` for the ``n`` some tree reaches.
    """
    sizes_arr = np.asarray(sorted(set(int(s) for s in sizes if int(s) >= 1)), dtype=np.int64)
    tree_sizes = arrays.tree_sizes
    if arrays.num_trees == 0 or sizes_arr.size == 0:
        return {}
    max_n = int(tree_sizes.max())
    sizes_arr = sizes_arr[sizes_arr <= max_n]
    totals = np.zeros(len(sizes_arr))
    counts = np.zeros(len(sizes_arr))
    tree_of_row = np.repeat(np.arange(arrays.num_trees), tree_sizes)
    local = np.arange(len(tree_of_row)) - arrays.offsets[tree_of_row]
    order = np.lexsort((local, -arrays.path_logprob, tree_of_row))
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order)) - arrays.offsets[tree_of_row[order]]  # trees stay contiguous
    num_layers = arrays.expert_ids.shape[1]
    words = bitsets.num_words(num_experts)
    for lo in range(0, arrays.num_trees, _UNION_CHUNK_TREES):
        hi = min(arrays.num_trees, lo + _UNION_CHUNK_TREES)
        rows = np.arange(arrays.offsets[lo], arrays.offsets[hi])
        padded = np.zeros((hi - lo, max_n, num_layers, words), dtype=np.uint64)
        padded[tree_of_row[rows] - lo, rank[rows]] = bitsets.pack(arrays.expert_ids[rows], num_experts)
        cumulative = np.bitwise_or.accumulate(padded, axis=1)
        counts_per = bitsets.popcount(cumulative).mean(axis=2)  # [trees, max_n]
        for i, n in enumerate(sizes_arr):
            has = tree_sizes[lo:hi] >= n
            totals[i] += counts_per[has, n - 1].sum()
            counts[i] += has.sum()
    return {int(n): float(totals[i] / counts[i]) for i, n in enumerate(sizes_arr) if counts[i]}


def next_layer_guess_recall(arrays: Any) -> float:
    """Fraction of the dense-tree nodes' layer-(l+1) experts that their next-layer guess made at
    layer l names (``NodeArrays.next_layer_expert_ids``; the accuracy of next-layer prefetch's
    predictor, Pre-gated MoE style), over every node and layer 1..L-1; NaN without the guesses
    or nodes."""
    guesses = arrays.next_layer_expert_ids  # int16[R, L-1, K]
    if guesses is None or not len(guesses):
        return float("nan")
    true_next = arrays.expert_ids[:, 1:, :]  # [R, L-1, K]
    hit = (true_next[:, :, :, None] == guesses[:, :, None, :]).any(axis=3)
    return float(hit.mean())


def pushed_out_nodes(arrays: NodeArrays) -> int | None:
    """Nodes of the dense trees that only earlier draft levels' trees held (``last_level`` below
    the root's, the levels drafted; docs/trace-format.md "Dense trees and their level trees"), or
    None when the trace does not record ``last_level``."""
    if arrays.last_level is None:
        return None
    return int((arrays.last_level < np.repeat(arrays.last_level[arrays.offsets[:-1]], arrays.tree_sizes)).sum())


def summarize(run: TraceRun, union_sizes: Sequence[int] = DEFAULT_UNION_SIZES) -> dict[str, Any]:
    """Headline figures of a run as a JSON-able dict.

    Keys: ``num_requests`` (finished), ``num_unfinished_requests``, ``num_prefill_tokens``,
    ``num_trees`` (dense positions), ``num_nodes``, ``mean_nodes_per_tree``, ``full_tree_tau``
    (mean 1 + accepted length), ``depth_acceptance`` (list, depth 1..max), ``expert_union``
    (``{n: distinct experts per layer}``), ``num_cycles``, ``cycle_tau`` (mean committed per
    executed cycle), ``cache_hit_rate``, ``h2d_bytes`` (sum over cycles), ``num_transfers``,
    ``transfer_bytes``, ``bytes_on_disk`` (all files of the run), ``complete``,
    ``format_version`` (the manifest's trace format version: from 2 per-level trees are recorded),
    ``next_layer_guess_recall`` (:func:`next_layer_guess_recall`; NaN when the trace does not
    carry the next-layer guesses, which ``sim.sweep --prefetch next-layer`` then refuses),
    ``num_pushed_out_nodes`` (dense-tree nodes a later draft level pushed out of the tree, held
    by an earlier level's tree only: ``last_level`` below the root's; None when the trace has no
    per-level trees, which ``sim.replay`` then approximates).
    """
    model = run.manifest.model
    arrays = run.node_arrays()
    acc_len = accepted_lengths(arrays)
    max_depth = int(arrays.depth.max(initial=0))
    cycles = run.arrow("cycles")
    hits = int(pc.sum(cycles.column("cache_hits")).as_py() or 0)
    misses = int(pc.sum(cycles.column("cache_misses")).as_py() or 0)
    h2d_bytes = pc.sum(pc.list_flatten(cycles.column("layer_h2d_bytes"))).as_py() or 0
    transfers = run.arrow("transfers")
    return {
        "run_dir": str(run.run_dir),
        "complete": run.complete,
        "mode": run.manifest.run.mode,
        "format_version": run.manifest.format_version,
        "model": model.name,
        "num_requests": len(run.request_ids),
        "num_unfinished_requests": len(run.unfinished_request_ids),
        "num_prefill_tokens": run.num_rows("prefill"),
        "num_trees": arrays.num_trees,
        "num_nodes": len(arrays.parent),
        "mean_nodes_per_tree": float(arrays.tree_sizes.mean()) if arrays.num_trees else float("nan"),
        "full_tree_tau": float(1 + acc_len.mean()) if arrays.num_trees else float("nan"),
        "depth_acceptance": depth_acceptance(acc_len, max_depth, reached_depths(arrays)),
        "expert_union": expert_union_growth(arrays, model.num_experts, union_sizes),
        "next_layer_guess_recall": next_layer_guess_recall(arrays),
        "num_pushed_out_nodes": pushed_out_nodes(arrays),
        "num_cycles": cycles.num_rows,
        "cycle_tau": float(pc.mean(cycles.column("num_committed")).as_py())
        if cycles.num_rows
        else float("nan"),
        "cache_hit_rate": hits / (hits + misses) if hits + misses else float("nan"),
        "h2d_bytes": int(h2d_bytes),
        "num_transfers": transfers.num_rows,
        "transfer_bytes": int(pc.sum(transfers.column("bytes")).as_py() or 0),
        "bytes_on_disk": sum(p.stat().st_size for p in run.run_dir.rglob("*") if p.is_file()),
    }
