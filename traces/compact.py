"""Format v3's compact on-disk form of the ``transfers`` table (lossless; docs/trace-format.md).

A batch of H2D copies runs serially on the copy stream: a copy starts when the previous copy of
its batch lands, every copy of the batch shares the batch's enqueue instant, and a copy's
``h2d_s`` is its ``landed_at_s - started_at_s`` (``live.h2d.H2DFetch.copy_spans``). Format v2
stored all four numbers per copy; in the shipped sample 98 % of them repeat a value the reader can
rebuild. Format v3 stores such a value as null (Parquet keeps a null in its definition levels,
about one bit) and the reader rebuilds it; a value is left out only when the rebuilt one is the
same float64, bit for bit, so :func:`unpack_transfers` returns exactly what was written.

Left out (row ``i``, row ``i - 1`` of the same request and cycle, ``landed_at_s[i]`` measured):

- ``started_at_s[i]`` when it equals ``landed_at_s[i - 1]``;
- ``enqueued_at_s[i]`` when it equals ``enqueued_at_s[i - 1]`` (before that one was left out);
- ``h2d_s[i]`` (any row) when it equals ``landed_at_s[i] - started_at_s[i]``.

Rows without spans (``landed_at_s`` null: not measured) keep every value as written.

A null that the reader would fill (a row with ``landed_at_s`` measured but ``started_at_s``,
``enqueued_at_s`` or ``h2d_s`` null where one of the rules above applies: the writer never writes
one, a hand-made v2 run given to ``traces.rewrite`` may hold one) cannot be told from a left-out
value, so a part holding such a row is stored whole, every value as given, and marked
``specfit_transfers_packed = 0`` in its schema metadata; the reader then rebuilds nothing.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

SPAN_COLUMNS = ("enqueued_at_s", "started_at_s", "landed_at_s")
KEY_COLUMNS = ("request_id", "cycle_index")  # a copy's batch: its request and cycle
# schema metadata of a part stored whole (a null the reader would fill: module docstring)
NOT_PACKED = {b"specfit_transfers_packed": b"0"}


def _floats(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values float64[R], measured bool[R])`` of a column (nulls read as 0.0)."""
    column = table.column(name)
    measured = ~column.is_null().to_numpy(zero_copy_only=False)
    values = column.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False).astype(np.float64)
    return values, measured


def _same_cycle_as_previous(table: pa.Table) -> np.ndarray:
    """bool[R]: row ``i`` has the request and cycle of row ``i - 1`` (row 0: False)."""
    request, cycle = (table.column(name).to_numpy(zero_copy_only=False) for name in KEY_COLUMNS)
    same = np.zeros(table.num_rows, dtype=bool)
    same[1:] = (request[1:] == request[:-1]) & (cycle[1:] == cycle[:-1])
    return same


def _read(table: pa.Table) -> tuple:
    """``same_cycle_as_previous`` and ``(values, measured)`` of enqueued, started, landed, h2d_s."""
    columns = (_floats(table, name) for name in (*SPAN_COLUMNS, "h2d_s"))
    return (_same_cycle_as_previous(table), *columns)


def _bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.int64)


def _previous(values: np.ndarray) -> np.ndarray:
    return np.concatenate((values[:1], values[:-1]))


def _set(table: pa.Table, name: str, values: np.ndarray, missing: np.ndarray) -> pa.Table:
    index = table.schema.get_field_index(name)
    field = table.schema.field(index).with_nullable(True)
    return table.set_column(index, field, pa.array(values, type=pa.float64(), mask=missing))


def _has_spans(table: pa.Table) -> bool:
    return all(name in table.column_names for name in SPAN_COLUMNS) and table.num_rows > 0


def pack_transfers(table: pa.Table) -> pa.Table:
    """The compact form of a ``transfers`` table whose rows are in writing order (the module
    docstring says which values are left out).

    Args:
        table: ``transfers`` rows in the writer's schema (``traces.schema.arrow_schema``).

    Returns:
        The same columns, ``h2d_s`` and the span columns nullable, with the rebuildable values null
        (or ``table`` itself marked :data:`NOT_PACKED` when it holds a null the reader would fill);
        ``unpack_transfers(pack_transfers(t))`` equals ``t`` bit for bit, nulls included.
    """
    if not _has_spans(table):
        return table
    same, (enqueued, enqueued_ok), (started, started_ok), (landed, landed_ok), (h2d, h2d_ok) = _read(table)
    follows = same & landed_ok
    # a null where unpack_transfers' rules would rebuild a value: it would be misread
    misread = (
        (follows & ~started_ok & _previous(landed_ok)) | (follows & ~enqueued_ok) | (landed_ok & started_ok & ~h2d_ok)
    )
    if misread.any():
        return table.replace_schema_metadata({**(table.schema.metadata or {}), **NOT_PACKED})
    drop_started = follows & started_ok & _previous(landed_ok) & (_bits(started) == _bits(_previous(landed)))
    drop_enqueued = (
        follows & enqueued_ok & _previous(enqueued_ok) & (_bits(enqueued) == _bits(_previous(enqueued)))
    )
    drop_h2d = h2d_ok & started_ok & landed_ok & (_bits(h2d) == _bits(landed - started))
    table = _set(table, "h2d_s", h2d, ~h2d_ok | drop_h2d)
    table = _set(table, "started_at_s", started, ~started_ok | drop_started)
    return _set(table, "enqueued_at_s", enqueued, ~enqueued_ok | drop_enqueued)


def unpack_transfers(table: pa.Table) -> pa.Table:
    """Rebuild the values :func:`pack_transfers` left out (a table of raw part data: when a span
    or ``h2d_s`` column is missing or not floating-point, or ``request_id`` / ``cycle_index`` is
    missing or not an integer, the table is returned as it is, for the reader's checks to report).

    Args:
        table: one part's ``transfers`` rows as stored by a format-v3 writer.

    Returns:
        The table with every left-out value rebuilt; values that were not measured stay null (a
        part marked :data:`NOT_PACKED` is returned as it is).
    """
    if (table.schema.metadata or {}).get(b"specfit_transfers_packed") == NOT_PACKED[b"specfit_transfers_packed"]:
        return table
    if not _has_spans(table) or not all(
        name in table.column_names and type_check(table.column(name).type)
        for names, type_check in (((*SPAN_COLUMNS, "h2d_s"), pa.types.is_floating), (KEY_COLUMNS, pa.types.is_integer))
        for name in names
    ):
        return table
    same, (enqueued, enqueued_ok), (started, started_ok), (landed, landed_ok), (h2d, h2d_ok) = _read(table)
    fill_started = ~started_ok & landed_ok & same & _previous(landed_ok)
    started = np.where(fill_started, _previous(landed), started)
    started_ok = started_ok | fill_started
    # a left-out enqueue instant is its run's first one: the last row before it not left out
    fill_enqueued = ~enqueued_ok & landed_ok & same
    rows = np.arange(table.num_rows)
    source = np.maximum.accumulate(np.where(fill_enqueued, 0, rows))
    enqueued, enqueued_ok = enqueued[source], enqueued_ok[source]
    fill_h2d = ~h2d_ok & started_ok & landed_ok
    h2d = np.where(fill_h2d, landed - started, h2d)
    table = _set(table, "h2d_s", h2d, ~(h2d_ok | fill_h2d))
    table = _set(table, "started_at_s", started, ~started_ok)
    return _set(table, "enqueued_at_s", enqueued, ~enqueued_ok)
