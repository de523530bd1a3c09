"""Value checks of the trace format on numpy arrays, shared by the writer and the reader; and
``python -m traces.validate RUN_DIR``, which reads and checks every value of a run.

Every check returns the first :class:`Violation` (row index into the arrays it was given and a
message) or ``None``. The writer turns a violation into ``ValueError`` naming the argument; the
reader maps the row back to its Parquet part and raises :class:`traces.errors.TraceError`.
All checks are vectorised (no per-row Python loops), so validating a real-shape trace of
tens of thousands of nodes x 384 expert slots takes well under a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specfit.cli import ArgumentParser, cli_main, print_summary, run_main

# float32 storage of log-probs: path_logprob is checked against parent + draft within this.
LOGPROB_ATOL = 1e-3
LOGPROB_RTOL = 1e-4


@dataclass(frozen=True)
class Violation:
    """The first bad row found by a check: ``row`` indexes the checked arrays."""

    row: int
    message: str


def first_true(mask: np.ndarray) -> int | None:
    """Index of the first true entry of a 1-D mask, or ``None``."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def check_range(
    values: np.ndarray, name: str, low: float | None = None, high: float | None = None
) -> Violation | None:
    """First row whose value is non-finite, ``< low`` or ``>= high`` (``values``: shape ``[R]``)."""
    values = np.asarray(values)
    if values.dtype.kind == "f":
        row = first_true(~np.isfinite(values))
        if row is not None:
            return Violation(row, f"{name} is {values[row]}, expected a finite number")
    if low is not None:
        row = first_true(values < low)
        if row is not None:
            return Violation(row, f"{name} {values[row]} < {low}")
    if high is not None:
        row = first_true(values >= high)
        if row is not None:
            return Violation(row, f"{name} {values[row]} >= {high}")
    return None


def check_expert_ids(expert_ids: np.ndarray, num_experts: int, top_k: int) -> Violation | None:
    """Expert ids ``[R, L*K]`` (or ``[R, L, K]``): each in ``0..E-1`` and distinct within a layer."""
    ids = np.asarray(expert_ids)
    rows = ids.reshape(ids.shape[0], -1, top_k) if ids.size else ids.reshape(0, 1, top_k)
    bad = (rows < 0) | (rows >= num_experts)
    row = first_true(bad.any(axis=(1, 2)))
    if row is not None:
        layer, slot = np.argwhere(bad[row])[0]
        value = int(rows[row, layer, slot])
        limit = f">= experts per layer {num_experts}" if value >= num_experts else "< 0"
        return Violation(row, f"expert id {value} {limit} (layer {layer}, slot {slot})")
    if top_k > 1:
        ordered = np.sort(rows, axis=2)
        dup = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
        row = first_true(dup.any(axis=1))
        if row is not None:
            layer = int(np.flatnonzero(dup[row])[0])
            return Violation(row, f"expert ids repeat within layer {layer}: {rows[row, layer].tolist()}")
    return None


def check_router_weights(router_weights: np.ndarray) -> Violation | None:
    """Router weights ``[R, ...]``: finite and ``>= 0``."""
    w = np.asarray(router_weights)
    flat = w.reshape(w.shape[0], int(np.prod(w.shape[1:], dtype=np.int64)))  # also for 0 rows
    row = first_true((~np.isfinite(flat) | (flat < 0)).any(axis=1))
    if row is not None:
        value = flat[row][~np.isfinite(flat[row]) | (flat[row] < 0)][0]
        return Violation(row, f"router weight {value} is not a finite number >= 0")
    return None


def check_router_weight_order(router_weights: np.ndarray, top_k: int) -> Violation | None:
    """Router weights ``[R, L*K]`` (or ``[R, L, K]``): each layer's K choices in descending weight.

    The trace contract (docs/trace-format.md): slot ``l*K + k`` is layer l's k-th choice, choices
    in descending router weight (ties allowed). Routers that return their top-k unsorted (e.g.
    DeepSeek-V3) must be reordered at capture (``live.spec.routing.order_by_weight``).
    """
    w = np.asarray(router_weights)
    rows = w.reshape(w.shape[0], -1, top_k) if w.size else w.reshape(0, 1, top_k)
    rising = np.diff(rows, axis=2) > 0  # [R, L, K-1]
    row = first_true(rising.any(axis=(1, 2)))
    if row is None:
        return None
    layer = int(np.flatnonzero(rising[row].any(axis=1))[0])
    values = [float(v) for v in rows[row, layer]]
    return Violation(
        row,
        f"router weights of layer {layer} are not in descending order: {values} "
        "(each node's experts must be sorted by descending router weight)",
    )


def tree_starts(request_id: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Row index where each tree begins (a tree = a run of rows with one ``(request, position)``)."""
    n = len(request_id)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    change = np.ones(n, dtype=bool)
    change[1:] = (request_id[1:] != request_id[:-1]) | (position[1:] != position[:-1])
    return np.flatnonzero(change)


def tree_rows(request_id: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, sizes, start_of_row)`` of the trees in flat node rows: each tree's first row
    (:func:`tree_starts`), its row count, and for every row its tree's first row (all int64)."""
    starts = tree_starts(request_id, position)
    sizes = np.diff(np.append(starts, len(request_id)))
    return starts, sizes, np.repeat(starts, sizes)


def check_trees(
    request_id: np.ndarray,
    position: np.ndarray,
    node_id: np.ndarray,
    parent: np.ndarray,
    depth: np.ndarray,
    token_id: np.ndarray,
    target_token: np.ndarray,
    accepted: np.ndarray,
    draft_logprob: np.ndarray,
    path_logprob: np.ndarray,
) -> Violation | None:
    """Structure of the dense trees in flat node rows (all arrays shape ``[R]``).

    A tree is a contiguous run of rows sharing ``(request_id, position)``; its rows are its nodes
    ``0..N-1`` in order. Checks: node ids in order, exactly one root (node 0, parent -1),
    ``parent < node_id`` (parents precede children: no orphans), ``depth = parent depth + 1``,
    ``accepted == (token_id == target_token[parent])`` (true at the root), log-probs ``<= 0``,
    zero at the root and ``path = parent path + draft`` (DESIGN.md's tree conventions), and no
    ``(request, position)`` twice.
    """
    n = len(node_id)
    if n == 0:
        return None
    starts, sizes, start_of_row = tree_rows(request_id, position)
    local = np.arange(n) - start_of_row
    key = "tree (request {}, position {})"

    def where(row: int) -> str:
        return key.format(int(request_id[row]), int(position[row]))

    row = first_true(node_id != local)
    if row is not None and node_id[row] == 0:
        return Violation(
            row,
            f"{where(row)}: node_id 0 again at row {int(local[row])} of the tree: the tree appears twice "
            "(one tree per request and position)",
        )
    if row is not None:
        return Violation(
            row,
            f"{where(row)}: node_id {int(node_id[row])}, expected {int(local[row])} "
            "(a tree's rows are its nodes 0..N-1 in order)",
        )
    is_root = local == 0
    row = first_true(is_root & (parent != -1))
    if row is not None:
        return Violation(row, f"{where(row)}: root (node 0) has parent {int(parent[row])}, expected -1")
    row = first_true(~is_root & (parent == -1))
    if row is not None:
        return Violation(
            row, f"{where(row)}: node {int(node_id[row])} is a second root; exactly one root per tree"
        )
    row = first_true(~is_root & ((parent < 0) | (parent >= node_id)))
    if row is not None:
        return Violation(
            row,
            f"{where(row)}: orphan node {int(node_id[row])}: parent {int(parent[row])} is not an earlier node "
            "(expected 0 <= parent < node id)",
        )
    parent_row = np.where(is_root, np.arange(n), start_of_row + parent)
    expected_depth = np.where(is_root, 0, depth[parent_row] + 1)
    row = first_true(depth != expected_depth)
    if row is not None:
        return Violation(
            row,
            f"{where(row)}: node {int(node_id[row])} depth {int(depth[row])}, expected {int(expected_depth[row])} "
            "(parent depth + 1)",
        )
    expected_accept = np.where(is_root, True, token_id == target_token[parent_row])
    row = first_true(accepted.astype(bool) != expected_accept)
    if row is not None:
        return Violation(
            row,
            f"{where(row)}: node {int(node_id[row])} accepted={bool(accepted[row])}, expected "
            f"{bool(expected_accept[row])} (token_id == target_token of the parent; true at the root)",
        )
    for name, values in (("draft_logprob", draft_logprob), ("path_logprob", path_logprob)):
        bad = ~np.isfinite(values) | (values > LOGPROB_ATOL) | (is_root & (values != 0))
        row = first_true(bad)
        if row is not None:
            return Violation(
                row, f"{where(row)}: {name} {float(values[row])} must be finite, <= 0 and 0 at the root"
            )
    expected_path = np.where(is_root, 0.0, path_logprob[parent_row].astype(np.float64) + draft_logprob)
    tol = LOGPROB_ATOL + LOGPROB_RTOL * np.abs(expected_path)
    row = first_true(np.abs(path_logprob - expected_path) > tol)
    if row is not None:
        return Violation(
            row,
            f"{where(row)}: path_logprob {float(path_logprob[row])}, expected parent path + draft_logprob = "
            f"{float(expected_path[row])}",
        )
    keys = np.stack([request_id[starts].astype(np.int64), position[starts].astype(np.int64)], axis=1)
    order = np.lexsort((np.arange(len(starts)), keys[:, 1], keys[:, 0]))
    sorted_keys = keys[order]
    dup = np.flatnonzero((sorted_keys[1:] == sorted_keys[:-1]).all(axis=1))
    if dup.size:
        row = int(starts[order[dup[0] + 1]])
        return Violation(row, f"{where(row)} appears twice (one tree per request and position)")
    return None


def check_level_tree_nulls(request_id: np.ndarray, position: np.ndarray, recorded: np.ndarray) -> Violation | None:
    """First node whose ``last_level`` is null while another node of its tree has one (all arrays
    ``[R]``, ``recorded`` bool: the value is not null). A tree records its level trees on every node
    or on none (format-v1 trees, synthetic ones; a resumed v1 run may mix whole trees), so a
    partly null tree is a corrupt part, which the reader would otherwise read as a v1 trace."""
    if len(recorded) == 0:
        return None
    recorded = np.asarray(recorded, dtype=bool)
    starts, sizes, _ = tree_rows(request_id, position)
    counts = np.add.reduceat(recorded.astype(np.int64), starts)
    mixed = np.repeat((counts > 0) & (counts < sizes), sizes)
    row = first_true(mixed & ~recorded)
    if row is None:
        return None
    return Violation(
        row,
        f"tree (request {int(request_id[row])}, position {int(position[row])}): last_level null on this "
        "node but recorded on other nodes of its tree (a tree records last_level on every node or on none)",
    )


def check_level_trees(
    request_id: np.ndarray,
    position: np.ndarray,
    parent: np.ndarray,
    depth: np.ndarray,
    last_level: np.ndarray,
    max_nodes: int | None = None,
) -> Violation | None:
    """The ``last_level`` column of dense trees already checked by :func:`check_trees` (all arrays
    ``[R]``): each node's ``depth <= last_level <= the root's last_level`` (the levels drafted),
    ``last_level <= the parent's`` (every per-level tree is ancestor-closed: a node leaves the
    tree no later than its parent), and with ``max_nodes`` every per-level tree (nodes with
    ``depth <= k <= last_level``) holds at most ``max_nodes`` nodes (``live.spec.draft``'s
    EAGLE-2 reranking keeps ``max_nodes - 1`` candidates plus the root).
    """
    n = len(last_level)
    if n == 0:
        return None
    starts, sizes, start_of_row = tree_rows(request_id, position)
    is_root = np.arange(n) == start_of_row
    level = np.asarray(last_level, dtype=np.int64)
    levels = level[start_of_row]
    parent_row = np.where(is_root, np.arange(n), start_of_row + parent)

    def where(row: int) -> str:
        return f"tree (request {int(request_id[row])}, position {int(position[row])}) node {row - int(start_of_row[row])}"

    row = first_true((level < depth) | (level > levels))
    if row is not None:
        return Violation(
            row,
            f"{where(row)}: last_level {int(level[row])} outside [depth {int(depth[row])}, the root's "
            f"last_level {int(levels[row])}] (a node is in the trees of levels depth..last_level)",
        )
    row = first_true(level > level[parent_row])
    if row is not None:
        return Violation(
            row,
            f"{where(row)}: last_level {int(level[row])} > its parent's {int(level[parent_row[row]])} "
            "(a per-level tree must be ancestor-closed)",
        )
    if max_nodes is not None:
        tree_of_row = np.repeat(np.arange(len(starts)), sizes)
        for k in range(int(levels.max()) + 1):
            counts = np.bincount(tree_of_row, weights=(depth <= k) & (level >= k), minlength=len(starts))
            tree = first_true(counts > max_nodes)
            if tree is not None:
                row = int(starts[tree])
                return Violation(
                    row,
                    f"tree (request {int(request_id[row])}, position {int(position[row])}): the tree after "
                    f"level {k} holds {int(counts[tree])} nodes, more than max_nodes {max_nodes}",
                )
    return None


def check_list_lengths(lengths: np.ndarray, expected: np.ndarray | int, name: str) -> Violation | None:
    """First row whose list column ``name`` has a length other than ``expected`` (scalar or ``[R]``)."""
    expected = np.broadcast_to(np.asarray(expected), lengths.shape)
    row = first_true(lengths != expected)
    if row is not None:
        return Violation(row, f"{name} has {int(lengths[row])} values, expected {int(expected[row])}")
    return None


def check_unique(keys: list[np.ndarray], names: str) -> Violation | None:
    """First row whose key (tuple of columns) repeats an earlier row."""
    if not keys or len(keys[0]) == 0:
        return None
    order = np.lexsort([np.arange(len(keys[0]))] + [k for k in reversed(keys)])
    stacked = np.stack([k[order] for k in keys], axis=1)
    dup = np.flatnonzero((stacked[1:] == stacked[:-1]).all(axis=1))
    if dup.size:
        row = int(order[dup[0] + 1])
        values = ", ".join(str(int(k[row])) for k in keys)
        return Violation(row, f"duplicate {names} ({values})")
    return None


def first_violation(*checks: Violation | None) -> Violation | None:
    """The first non-``None`` of already computed checks."""
    for check in checks:
        if check is not None:
            return check
    return None


def part_format_versions(run_dir: str | Path, manifest_version: int) -> list[int]:
    """The trace format versions the parts of a (valid) run were written in, sorted: each part's
    ``specfit_trace_format_version`` schema metadata (``manifest_version`` for a part without
    one, as ``traces.reader.read_part`` reads it). A run resumed by a newer writer holds several."""
    import pyarrow.parquet as pq

    from traces.schema import TABLE_NAMES
    from traces.storage import list_parts

    found = set()
    for table in TABLE_NAMES:
        for _, path in list_parts(Path(run_dir), table):
            version = (pq.read_schema(path).metadata or {}).get(b"specfit_trace_format_version")
            found.add(int(version) if version is not None else manifest_version)
    return sorted(found or {manifest_version})


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Read and check every value of a trace run (``traces.reader.open_run``): exit 0 and a JSON
    line with the rows per table when it is valid; exit 2 and one stderr line naming the file, table
    and row of the first problem when not."""
    from traces.errors import TraceError
    from traces.reader import open_run
    from traces.schema import TABLE_NAMES

    parser = ArgumentParser(
        prog="python -m traces.validate",
        description="Read and check every value of a trace run directory (the checks of "
        "docs/trace-format.md, 'Validation'). Exit 2 naming the file, table and row of the first problem.",
    )
    parser.add_argument("run_dir", help="trace run directory (holds manifest.json)")
    args = parser.parse_args(argv)
    try:
        run = open_run(args.run_dir, validate=True)
    except TraceError as exc:
        parser.fail("run_dir", str(exc))
    rows = {table: run.arrow(table).num_rows for table in TABLE_NAMES}
    state = "complete" if run.manifest.complete else "incomplete (still running or killed)"
    listed = ", ".join(f"{table} {count:,}" for table, count in rows.items())
    versions = part_format_versions(args.run_dir, run.manifest.format_version)
    fmt = f"trace format v{run.manifest.format_version}"
    if versions != [run.manifest.format_version]:  # e.g. a v2 run resumed by a v3 writer
        fmt += f" (parts: {', '.join(f'v{v}' for v in versions)})"
    print(f"{args.run_dir}: valid, {fmt}, {state}; rows: {listed}")
    print_summary(
        {"ok": True, "run_dir": str(args.run_dir), "format_version": run.manifest.format_version,
         "part_format_versions": versions, "complete": run.manifest.complete, "rows": rows}
    )
    return 0


if __name__ == "__main__":
    run_main(main)
