"""Run-level value checks of trace format v1: every table and the references between them.

:func:`run_checks` yields ``(table, Violation)`` lazily, so :meth:`TraceRun.validate` stops at the
first problem. Per-file checks (columns, types, expert ids, router weights) already happened in
:func:`traces.reader.read_part`; these checks need whole tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.compute as pc

from traces import validate as V

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
    yield from _references(run, "nodes")


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
    for name in ("cycle_index", "position", "context_len", "num_draft_levels", "cache_hits", "cache_misses"):
        yield lambda name=name: V.check_range(col(name), name, 0)
    for name in ("draft_s", "verify_s", "h2d_s", "cycle_s"):
        yield lambda name=name: V.check_range(col(name), name, 0)
    for name in ("predicted_expected_committed", "predicted_cycle_s", "decision_s"):
        values = run.arrow("cycles").column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        yield lambda values=values, name=name: V.check_range(np.where(np.isnan(values), 0.0, values), name, 0)
    yield lambda: V.check_unique([col("request_id"), col("cycle_index")], "(request_id, cycle_index)")
    yield from _references(run, "cycles")


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
