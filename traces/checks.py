"""Run-level value checks of trace format v1: every table and the references between them.

:func:`run_checks` yields ``(table, Violation)`` lazily, so :meth:`TraceRun.validate` stops at the
first problem. Per-file checks (columns, types, expert ids, router weights) already happened in
:func:`traces.reader.read_part`; these checks need whole tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.compute as pc

from traces import validate as V
from traces.errors import TraceError
from traces.schema import MANIFEST_FILE, TABLE_NAMES, Manifest
from traces.storage import list_parts

if TYPE_CHECKING:
    from traces.reader import TraceRun

Check = Callable[[], "V.Violation | None"]


def _lists(run: TraceRun, table: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    column = run.arrow(table).column(name)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    lengths = np.nan_to_num(lengths.astype(np.float64)).astype(np.int64)  # null lists count as empty
    return lengths, pc.list_flatten(column).to_numpy(zero_copy_only=False)


def _flat_range(
    lengths: np.ndarray, values: np.ndarray, name: str, low: float, high: float | None = None
) -> Check:
    def check() -> V.Violation | None:
        found = V.check_range(values, name, low, high)
        if found is None:
            return None
        row = int(np.searchsorted(np.cumsum(lengths), found.row, side="right"))
        return V.Violation(row, found.message)

    return check


def _at_most(values: np.ndarray, limits: np.ndarray, message: str) -> Check:
    """First row with ``values > limits``; ``message`` formats (value, limit)."""

    def check() -> V.Violation | None:
        row = V.first_true(values > limits)
        return None if row is None else V.Violation(row, message.format(int(values[row]), int(limits[row])))

    return check


def _col(run: TraceRun, table: str, name: str) -> np.ndarray:
    return run.arrow(table).column(name).to_numpy(zero_copy_only=False)


def _routing_order(run: TraceRun, table: str) -> Check:
    """Each row's per-layer choices in descending router weight (docs/trace-format.md)."""

    def check() -> V.Violation | None:
        lengths, values = _lists(run, table, "router_weights")
        if not len(lengths):
            return None
        top_k = run.manifest.model.top_k
        return V.check_router_weight_order(values.reshape(len(lengths), -1), top_k)

    return check


def _references(run: TraceRun, table: str) -> Iterator[Check]:
    """Rows must name a recorded request (complete runs); context length = prompt + position."""
    request_id = _col(run, table, "request_id")
    known = run.request_ids
    if run.complete:

        def exists() -> V.Violation | None:
            row = V.first_true(~np.isin(request_id, known))
            if row is None:
                return None
            return V.Violation(
                row,
                f"request_id {int(request_id[row])} is not in table 'requests' (the run is marked complete)",
            )

        yield exists
    if table == "prefill":

        def within_prompt() -> V.Violation | None:
            lengths = run.prompt_lengths()
            prompt = np.asarray([lengths.get(int(r), np.iinfo(np.int64).max) for r in request_id.tolist()])
            token_index = _col(run, table, "token_index")
            row = V.first_true(token_index >= prompt)
            if row is None:
                return None
            return V.Violation(
                row, f"token_index {int(token_index[row])} >= prompt length {int(prompt[row])}"
            )

        yield within_prompt
    if table in ("nodes", "cycles"):

        def context() -> V.Violation | None:
            lengths = run.prompt_lengths()
            if not lengths:
                return None
            keys = np.asarray(sorted(lengths), dtype=np.int64)
            prompt = np.asarray([lengths[k] for k in keys.tolist()], dtype=np.int64)
            idx = np.clip(np.searchsorted(keys, request_id), 0, len(keys) - 1)
            has = keys[idx] == request_id
            expected = prompt[idx] + _col(run, table, "position")
            context_len = _col(run, table, "context_len")
            row = V.first_true(has & (context_len != expected))
            if row is None:
                return None
            return V.Violation(
                row,
                f"context_len {int(context_len[row])}, expected prompt length {int(prompt[idx[row]])} + position "
                f"{int(expected[row] - prompt[idx[row]])} = {int(expected[row])}",
            )

        yield context


def _requests(run: TraceRun) -> Iterator[Check]:
    yield lambda: V.check_unique([_col(run, "requests", "request_id")], "request_id")
    for name in ("prompt_token_ids", "generated_token_ids"):
        lengths, values = _lists(run, "requests", name)
        yield _flat_range(lengths, values, f"{name} value", 0)


def _prefill(run: TraceRun) -> Iterator[Check]:
    token_index = _col(run, "prefill", "token_index")
    yield lambda: V.check_range(token_index, "token_index", 0)
    yield lambda: V.check_unique(
        [_col(run, "prefill", "request_id"), token_index], "(request_id, token_index)"
    )
    yield _routing_order(run, "prefill")
    yield from _references(run, "prefill")


def _nodes(run: TraceRun) -> Iterator[Check]:
    yield lambda: V.check_range(_col(run, "nodes", "position"), "position", 0)
    yield lambda: V.check_range(_col(run, "nodes", "context_len"), "context_len", 0)
    names = (
        "request_id",
        "position",
        "node_id",
        "parent",
        "depth",
        "token_id",
        "target_token",
        "accepted",
        "draft_logprob",
        "path_logprob",
    )
    yield lambda: V.check_trees(**{n: _col(run, "nodes", n) for n in names})
    yield _level_trees(run)
    yield _routing_order(run, "nodes")
    yield from _references(run, "nodes")


def _level_trees(run: TraceRun) -> Check:
    """``last_level`` where recorded (format v2 dense trees): :func:`traces.validate.check_level_trees`
    on the rows that carry it (a resumed v1 run may hold trees without it)."""

    def check() -> V.Violation | None:
        column = run.arrow("nodes").column("last_level")
        if column.null_count == len(column):
            return None
        recorded = ~column.is_null().to_numpy(zero_copy_only=False)
        if column.null_count:
            mixed = V.check_level_tree_nulls(
                _col(run, "nodes", "request_id"), _col(run, "nodes", "position"), recorded
            )
            if mixed is not None:
                return mixed
        rows = np.flatnonzero(recorded)
        cols = {n: _col(run, "nodes", n)[rows] for n in ("request_id", "position", "parent", "depth")}
        found = V.check_level_trees(
            **cols,
            last_level=column.to_numpy(zero_copy_only=False)[rows].astype(np.int64),
            max_nodes=run.manifest.draft.max_nodes,
        )
        return None if found is None else V.Violation(int(rows[found.row]), found.message)

    return check


def _cycles(run: TraceRun) -> Iterator[Check]:
    num_layers = run.manifest.model.num_layers
    col = lambda name: _col(run, "cycles", name)  # noqa: E731
    for name in ("layer_misses", "layer_h2d_bytes", "layer_h2d_s", "layer_compute_s"):
        lengths, values = _lists(run, "cycles", name)
        yield lambda lengths=lengths, name=name: V.check_list_lengths(lengths, num_layers, name)
        yield _flat_range(lengths, values, f"{name} value", 0)
    lengths, verified = _lists(run, "cycles", "verified_nodes")
    num_verified = col("num_nodes_verified")
    yield lambda: V.check_range(num_verified, "num_nodes_verified", 1)
    yield lambda: V.check_list_lengths(lengths, num_verified, "verified_nodes")
    yield _flat_range(lengths, verified, "verified_nodes value", 0)

    def contains_root() -> V.Violation | None:
        rows_with_root = np.repeat(np.arange(len(lengths)), lengths)[verified == 0]
        row = V.first_true(~np.isin(np.arange(len(lengths)), rows_with_root))
        return None if row is None else V.Violation(row, "verified_nodes does not contain the root (node 0)")

    yield contains_root
    num_accepted = col("num_accepted")
    yield lambda: V.check_range(num_accepted, "num_accepted", 0)
    yield _at_most(num_accepted, num_verified - 1, "num_accepted {} > num_nodes_verified - 1 = {}")
    num_committed = col("num_committed")
    yield lambda: V.check_range(num_committed, "num_committed", 0)
    yield _at_most(
        num_committed, num_accepted + 1, "num_committed {} > num_accepted + 1 = {} (one bonus token)"
    )
    yield _reached_depth(run, num_accepted)
    for name in ("cycle_index", "position", "context_len", "num_draft_levels", "cache_hits", "cache_misses"):
        yield lambda name=name: V.check_range(col(name), name, 0)
    for name in ("draft_s", "verify_s", "h2d_s", "cycle_s"):
        yield lambda name=name: V.check_range(col(name), name, 0)
    for name in ("predicted_expected_committed", "predicted_cycle_s", "decision_s"):
        values = run.arrow("cycles").column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        yield lambda values=values, name=name: V.check_range(np.where(np.isnan(values), 0.0, values), name, 0)
    yield lambda: V.check_unique([col("request_id"), col("cycle_index")], "(request_id, cycle_index)")
    yield from _cache_accesses(run)
    yield from _references(run, "cycles")


def _reached_depth(run: TraceRun, num_accepted: np.ndarray) -> Check:
    """Where recorded (not null), ``num_accepted <= reached_depth <= num_accepted + 1``."""

    def check() -> V.Violation | None:
        column = run.arrow("cycles").column("reached_depth")
        recorded = ~column.is_null().to_numpy(zero_copy_only=False)
        reached = column.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        row = V.first_true(recorded & ((reached < num_accepted) | (reached > num_accepted + 1)))
        if row is None:
            return None
        return V.Violation(
            row, f"reached_depth {reached[row]}: expected num_accepted ({num_accepted[row]}) or one more"
        )

    return check


def _cache_accesses(run: TraceRun) -> Iterator[Check]:
    """Where recorded (not null), ``layer_accessed`` holds L counts adding up to the cycle's hits +
    misses, and ``accessed_experts`` that many expert ids, each in ``0..E-1``."""
    model = run.manifest.model

    def check() -> V.Violation | None:
        recorded = ~run.arrow("cycles").column("layer_accessed").is_null().to_numpy(zero_copy_only=False)
        if not recorded.any():
            return None
        lengths, values = _lists(run, "cycles", "layer_accessed")
        id_lengths, _ = _lists(run, "cycles", "accessed_experts")
        starts = np.r_[0, np.cumsum(lengths)[:-1]]
        running = np.r_[0, np.cumsum(values)]
        sums = running[starts + lengths] - running[starts]
        accesses = _col(run, "cycles", "cache_hits") + _col(run, "cycles", "cache_misses")
        per_layer = f"layer_accessed: expected {model.num_layers} values (one per layer)"
        for bad, message in (
            (lengths != model.num_layers, per_layer),
            (sums != accesses, "layer_accessed adds up to other than cache_hits + cache_misses"),
            (id_lengths != sums, "accessed_experts holds other than sum(layer_accessed) expert ids"),
        ):
            row = V.first_true(recorded & bad)
            if row is not None:
                return V.Violation(row, message)
        return None

    yield check
    id_lengths, ids = _lists(run, "cycles", "accessed_experts")
    yield _flat_range(id_lengths, ids, "accessed_experts value", 0, model.num_experts)


def _transfers(run: TraceRun) -> Iterator[Check]:
    model = run.manifest.model
    col = lambda name: _col(run, "transfers", name)  # noqa: E731
    yield lambda: V.check_range(col("layer"), "layer", 0, model.num_layers)
    yield lambda: V.check_range(col("expert"), "expert id", 0, model.num_experts)
    yield lambda: V.check_range(col("bytes"), "bytes", 0)
    yield lambda: V.check_range(col("h2d_s"), "h2d_s", 0)
    yield lambda: V.check_range(col("cycle_index"), "cycle_index", 0)
    yield from _references(run, "transfers")


_TABLE_CHECKS = {
    "requests": _requests,
    "prefill": _prefill,
    "nodes": _nodes,
    "cycles": _cycles,
    "transfers": _transfers,
}


def run_checks(run: TraceRun) -> Iterator[tuple[str, V.Violation]]:
    """Yield ``(table, violation)`` for each failed check, tables in format order."""
    for table, checks in _TABLE_CHECKS.items():
        for check in checks(run):
            found = check()
            if found is not None:
                yield table, found


# ------------------------------------------------------------------------ files and tables


def _ranges_text(values: np.ndarray, limit: int = 4) -> str:
    """``12-23, 30, 41-44`` for sorted distinct ints (first ``limit`` ranges, then ``(+N more)``)."""
    values = np.asarray(values, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    runs = [(int(chunk[0]), int(chunk[-1])) for chunk in np.split(values, breaks)]
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (f" (+{len(runs) - limit} more ranges)" if len(runs) > limit else "")


def _part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _recorded_counts(run_dir: Path, manifest: Manifest) -> dict[str, tuple[int, int]] | None:
    """``manifest.table_counts`` as ``{table: (parts, rows)}``, or ``None`` when not recorded."""
    counts = manifest.table_counts
    if counts is None:
        return None
    path = Path(run_dir) / MANIFEST_FILE
    out = {}
    for table in TABLE_NAMES:
        entry = counts.get(table)
        values = [entry.get(k) if isinstance(entry, dict) else None for k in ("parts", "rows")]
        for key, value in zip(("parts", "rows"), values):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TraceError(
                    path,
                    "manifest",
                    None,
                    f"manifest.table_counts.{table}.{key}: expected an integer >= 0, got {value!r}",
                )
        out[table] = (values[0], values[1])
    return out


def check_part_files(run_dir: str | Path, manifest: Manifest) -> None:
    """Check the part files of every table from the directory listing alone (no file is read).

    - Part numbers run ``00000, 00001, ...`` without gaps: the writer numbers parts that way and
      never deletes one (checked for every run written with ``table_counts`` and every run never
      resumed: writers before ``table_counts`` existed deleted parts emptied by a resume).
    - When the manifest records ``table_counts``, each table has exactly that many parts.

    Raises:
        TraceError: naming the table folder, the missing part(s) and what was expected.
    """
    run_dir = Path(run_dir)
    recorded = _recorded_counts(run_dir, manifest)
    gap_free = recorded is not None or not manifest.resumed_at
    for table in TABLE_NAMES:
        folder = run_dir / table
        indices = [index for index, _ in list_parts(run_dir, table)]
        if gap_free and indices and indices != list(range(len(indices))):
            expected = next(i for i, index in enumerate(indices) if index != i)
            found = indices[expected]
            missing = (
                _part_name(expected)
                if found == expected + 1
                else (f"{_part_name(expected)} .. {_part_name(found - 1)}")
            )
            after = f"jump from {expected - 1:05d} to {found:05d}" if expected else f"start at {found:05d}"
            raise TraceError(
                folder,
                table,
                None,
                f"{missing} missing: part numbers {after} (the writer numbers parts 00000, "
                "00001, ... without gaps; a part was deleted or not copied)",
            )
        if recorded is not None and len(indices) != recorded[table][0]:
            parts = recorded[table][0]
            if len(indices) < parts:
                what = f"{_part_name(len(indices))}" + (
                    f" .. {_part_name(parts - 1)}" if parts - len(indices) > 1 else ""
                )
                message = (
                    f"{what} missing: manifest.table_counts records {parts} part{'' if parts == 1 else 's'}, "
                    f"found {len(indices)}"
                )
            else:
                message = (
                    f"{len(indices)} part{'' if len(indices) == 1 else 's'}, manifest.table_counts records "
                    f"{parts}: "
                    f"{_part_name(indices[parts])} and later were not written by this run's writer"
                )
            raise TraceError(folder, table, None, message)


def _group_ends(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start index and length of each run of equal values in a sorted 1-D array."""
    if len(sorted_keys) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return starts, np.diff(np.r_[starts, len(sorted_keys)])


def consistency_errors(run: TraceRun) -> Iterator[TraceError]:
    """Cross-table checks that lost rows (a deleted part) break; exact for runs of our writer.

    Only rows of finished requests (those with a ``requests`` row) are checked: the writer flushes
    ``requests`` after every other table, so all rows of a finished request are on disk.

    - ``manifest.table_counts`` (when recorded): each table holds that many rows.
    - ``cycles``: a finished request's ``cycle_index`` values are ``0..n-1`` without gaps.
    - ``cycles``: a finished request's cycle ``i`` starts at ``position`` = tokens committed by its
      cycles ``0..i-1``, and its cycles commit ``len(generated_token_ids)`` tokens in all.
    - ``cycles``: when the run has cycles, every finished request with generated tokens has cycles
      (every generated token is committed by a cycle).
    - dense runs: every ``(request_id, position)`` of a cycle has its tree in ``nodes`` (a dense
      cycle verifies the whole tree at its position, and ``live.record`` writes both).
    - ``transfers``: each ``(request_id, cycle_index)`` names a cycle.
    """
    run_dir = run.run_dir
    recorded = _recorded_counts(run_dir, run.manifest)
    if recorded is not None:
        for table in TABLE_NAMES:
            rows = run.num_rows(table)
            if rows != recorded[table][1]:
                yield TraceError(
                    run_dir / table,
                    table,
                    None,
                    f"parts hold {rows} row{'' if rows == 1 else 's'}, manifest.table_counts records "
                    f"{recorded[table][1]} "
                    "(a part was replaced or truncated after the run was written)",
                )
                return
    finished = run.request_ids
    c_rid = _col(run, "cycles", "request_id").astype(np.int64)
    c_index = _col(run, "cycles", "cycle_index").astype(np.int64)
    c_pos = _col(run, "cycles", "position").astype(np.int64)
    keep = np.isin(c_rid, finished)
    c_rid, c_index, c_pos = c_rid[keep], c_index[keep], c_pos[keep]
    order = np.lexsort((c_index, c_rid))
    s_rid, s_index = c_rid[order], c_index[order]
    starts, sizes = _group_ends(s_rid)
    if len(starts):
        last = s_index[starts + sizes - 1]
        first = s_index[starts]
        bad = V.first_true((first != 0) | (last != sizes - 1))
        if bad is not None:
            lo, n = int(starts[bad]), int(sizes[bad])
            present = s_index[lo : lo + n]
            missing = np.setdiff1d(np.arange(int(present.max()) + 1), present)
            others = int(np.count_nonzero((first != 0) | (last != sizes - 1))) - 1
            yield TraceError(
                run_dir / "cycles",
                "cycles",
                None,
                f"request {int(s_rid[lo])} cycle_index {_ranges_text(missing)} missing "
                f"(has {n} cycles up to cycle_index {int(present.max())}; expected 0..n-1)"
                + (f"; {others} more requests have gaps" if others > 0 else ""),
            )
            return
    generated = pc.list_value_length(run.arrow("requests").column("generated_token_ids"))
    generated = np.nan_to_num(generated.to_numpy(zero_copy_only=False).astype(np.float64)).astype(np.int64)
    req_ids = _col(run, "requests", "request_id").astype(np.int64)
    if len(starts):
        committed = _col(run, "cycles", "num_committed").astype(np.int64)[keep][order]
        s_pos = c_pos[order]
        total = np.cumsum(committed)
        before = total - committed - np.repeat(total[starts] - committed[starts], sizes)
        bad = V.first_true(s_pos != before)
        if bad is not None:
            yield TraceError(
                run_dir / "cycles",
                "cycles",
                None,
                f"request {int(s_rid[bad])} cycle_index {int(s_index[bad])} has position {int(s_pos[bad])}, "
                f"expected {int(before[bad])} (tokens committed by its cycles before it): cycles are missing",
            )
            return
        sums = np.add.reduceat(committed, starts)
        lookup = dict(zip(req_ids.tolist(), generated.tolist()))
        expected = np.asarray([lookup[int(r)] for r in s_rid[starts]], dtype=np.int64)
        bad = V.first_true(sums != expected)
        if bad is not None:
            yield TraceError(
                run_dir / "cycles",
                "cycles",
                None,
                f"request {int(s_rid[starts[bad]])}: its {int(sizes[bad])} cycles commit {int(sums[bad])} "
                f"tokens, its requests row has {int(expected[bad])} generated tokens: cycles are missing",
            )
            return
    if run.num_rows("cycles"):
        lacking = np.sort(req_ids[(generated > 0) & ~np.isin(req_ids, c_rid)])
        if len(lacking):
            yield TraceError(
                run_dir / "cycles",
                "cycles",
                None,
                f"finished request(s) {_ranges_text(lacking)} have generated tokens but no cycles "
                f"({len(lacking)} of {len(req_ids)} requests; every generated token is committed by a cycle)",
            )
            return
    if run.manifest.run.mode == "dense" and len(c_rid):
        arrays = run.node_arrays()
        width = np.int64(1) << 32
        tree_keys = arrays.request_ids * width + arrays.positions
        cycle_keys = c_rid * width + c_pos
        no_tree = ~np.isin(cycle_keys, tree_keys)
        if no_tree.any():
            rids = np.unique(c_rid[no_tree])
            rid = int(rids[0])
            positions = np.unique(c_pos[no_tree & (c_rid == rid)])
            more = f"; {len(rids) - 1} more requests lack trees" if len(rids) > 1 else ""
            yield TraceError(
                run_dir / "nodes",
                "nodes",
                None,
                f"request {rid} positions {_ranges_text(positions)} have cycles but no tree "
                f"({int(no_tree.sum())} of {len(c_rid)} cycles of finished requests lack their tree{more}; "
                "a dense run records the tree of every cycle)",
            )
            return
    t_rid = _col(run, "transfers", "request_id").astype(np.int64)
    t_index = _col(run, "transfers", "cycle_index").astype(np.int64)
    width = np.int64(1) << 32
    orphan = np.isin(t_rid, finished) & ~np.isin(t_rid * width + t_index, c_rid * width + c_index)
    row = V.first_true(orphan)
    if row is not None:
        file, local = run._load("transfers").locate(row)
        yield TraceError(
            file,
            "transfers",
            local,
            f"request {int(t_rid[row])} cycle_index {int(t_index[row])} has no row in table 'cycles' "
            f"({int(orphan.sum())} transfer rows name missing cycles)",
        )
