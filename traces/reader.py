"""Reader and validator of trace format v1 (see docs/trace-format.md).

``open_run(run_dir)`` reads ``manifest.json``, checks every Parquet part of every table against
the column specs of :mod:`traces.schema` (readable file, format version, required columns,
column types) and, by default, validates all values (ranges, tree structure, references
between tables) and that no rows were lost (part numbering, ``manifest.table_counts``, tables
that must agree, :mod:`traces.checks`). Any problem raises :class:`~traces.errors.TraceError` naming the file, the
table and the row; pyarrow's own exceptions never escape.

Runs whose manifest says ``complete: false`` (a writer still running, or killed) are readable:
rows of requests that have no ``requests`` row yet are kept and listed in
:attr:`TraceRun.unfinished_request_ids`; complete runs must reference only recorded requests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from traces import validate as V
from traces.compact import unpack_transfers
from traces.errors import TraceError
from traces.schema import (
    KIND_BOOL,
    KIND_EXPERT_IDS,
    KIND_FLOAT,
    KIND_FLOAT_LIST,
    KIND_INT,
    KIND_INT_LIST,
    KIND_NEXT_LAYER_IDS,
    KIND_ROUTER_WEIGHTS,
    KIND_STRING,
    MANIFEST_FILE,
    SUPPORTED_FORMAT_VERSIONS,
    TABLE_NAMES,
    TABLES,
    ColumnSpec,
    Manifest,
    arrow_schema,
)
from traces.storage import list_parts

_READ_ERRORS = (pa.ArrowException, OSError, ValueError)


def read_manifest(run_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``run_dir/manifest.json``.

    Raises:
        TraceError: missing directory or manifest, invalid JSON, wrong format version, or a
            missing/bad field (the message names it, e.g. ``manifest.model.top_k``).
    """
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST_FILE
    if not run_dir.is_dir():
        raise TraceError(run_dir, None, None, "run directory not found")
    if not path.is_file():
        raise TraceError(path, "manifest", None, "manifest.json is missing; not a trace run directory")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(path, "manifest", None, f"not valid JSON ({exc})") from exc
    try:
        return Manifest.from_dict(data)
    except ValueError as exc:
        raise TraceError(path, "manifest", None, str(exc)) from exc


# ----------------------------------------------------------------------------------- parts


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _kind_matches(kind: str, t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if kind == KIND_INT:
        return pa.types.is_integer(t)
    if kind == KIND_FLOAT:
        return pa.types.is_floating(t) or pa.types.is_integer(t)
    if kind == KIND_BOOL:
        return pa.types.is_boolean(t)
    if kind == KIND_STRING:
        return pa.types.is_string(t) or pa.types.is_large_string(t)
    if kind in (KIND_INT_LIST, KIND_EXPERT_IDS, KIND_NEXT_LAYER_IDS):
        return _is_list(t) and pa.types.is_integer(t.value_type)
    if kind in (KIND_FLOAT_LIST, KIND_ROUTER_WEIGHTS):
        return _is_list(t) and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type))
    raise ValueError(f"unknown column kind {kind!r}")  # programming error


_KIND_WORDS = {
    KIND_INT: "an integer type",
    KIND_FLOAT: "a floating-point type",
    KIND_BOOL: "bool",
    KIND_STRING: "string",
    KIND_INT_LIST: "a list of integers",
    KIND_FLOAT_LIST: "a list of floats",
    KIND_EXPERT_IDS: "a list of integer expert ids",
    KIND_NEXT_LAYER_IDS: "a list of integer expert ids",
    KIND_ROUTER_WEIGHTS: "a list of float router weights",
}


def _list_parts_of(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths int64[R], flat values)`` of a list column without nulls."""
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    return lengths, values


def read_part(path: str | os.PathLike[str], table: str, manifest: Manifest) -> pa.Table:
    """Read one part file, check it against the column specs and return it in the canonical schema.

    Checks: the file is a readable Parquet file; its format-version metadata (if any) is
    :data:`SUPPORTED_FORMAT_VERSIONS`; required columns exist, with types of the right kind; no nulls
    outside nullable columns; expert id / router weight lists hold ``L*K`` values, ids in
    ``0..E-1`` (distinct per layer) and weights finite ``>= 0``. A format-v3 ``transfers`` part's
    left-out values are rebuilt first (:func:`traces.compact.unpack_transfers`). Values are then
    cast to the writer's schema (:func:`traces.schema.arrow_schema`); extra columns are dropped.

    Raises:
        TraceError: naming the file, the table and (for value errors) the row.
    """
    path = Path(path)
    try:
        data = pq.read_table(path)
    except _READ_ERRORS as exc:
        raise TraceError(
            path, table, None, f"cannot read Parquet data (truncated or corrupt file?): {exc}"
        ) from exc
    version = (data.schema.metadata or {}).get(b"specfit_trace_format_version")
    if version is not None and version not in {str(v).encode() for v in SUPPORTED_FORMAT_VERSIONS}:
        raise TraceError(
            path,
            table,
            None,
            f"written by trace format version {version.decode(errors='replace')}, "
            f"this reader supports versions {list(SUPPORTED_FORMAT_VERSIONS)}",
        )
    written_by = int(version) if version is not None else manifest.format_version
    if table == "transfers" and written_by >= 3:
        data = unpack_transfers(data)
    schema = arrow_schema(table, manifest.model)
    model = manifest.model
    slots = model.num_layers * model.top_k
    columns = []
    for spec, target in zip(TABLES[table], schema):
        columns.append(
            _convert_column(path, table, data, spec, target, slots, model.num_experts, model.top_k)
        )
    return pa.Table.from_arrays(columns, schema=schema)


def _convert_column(
    path: Path,
    table: str,
    data: pa.Table,
    spec: ColumnSpec,
    target: pa.Field,
    slots: int,
    num_experts: int,
    top_k: int,
) -> pa.ChunkedArray:
    name = spec.name
    if name not in data.column_names:
        if spec.required:
            raise TraceError(
                path,
                table,
                None,
                f"missing required column '{name}' ({_KIND_WORDS[spec.kind]}: {spec.meaning})",
            )
        return pa.chunked_array([pa.nulls(data.num_rows, type=target.type)])
    column = data.column(name)
    if not _kind_matches(spec.kind, column.type):
        raise TraceError(
            path, table, None, f"column '{name}' has type {column.type}, expected {_KIND_WORDS[spec.kind]}"
        )
    if column.null_count and not spec.nullable:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise TraceError(path, table, row, f"column '{name}' is null; expected a value")
    if _is_list(column.type):
        inner_nulls = pc.is_null(pc.list_flatten(column)).to_numpy(zero_copy_only=False)
        if inner_nulls.any():
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            row = int(np.searchsorted(np.cumsum(lengths), int(np.flatnonzero(inner_nulls)[0]), side="right"))
            raise TraceError(path, table, row, f"column '{name}' holds a null inside its list")
    if spec.kind == KIND_NEXT_LAYER_IDS:
        if column.null_count:  # not recorded: every row null (a part holds it for all rows or none)
            if column.null_count != len(column):
                row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
                raise TraceError(
                    path, table, row, f"column '{name}' is null in some rows only; expected all or none"
                )
            return pa.chunked_array([pa.nulls(len(column), type=target.type)])
        slots = target.type.list_size
    if spec.kind in (KIND_EXPERT_IDS, KIND_ROUTER_WEIGHTS, KIND_NEXT_LAYER_IDS):
        lengths, values = _list_parts_of(column)
        check = V.check_list_lengths(lengths, slots, name)
        if check is None:
            matrix = values.reshape(len(lengths), slots)
            if spec.kind != KIND_ROUTER_WEIGHTS:
                check = V.check_expert_ids(matrix, num_experts, top_k)
            else:
                check = V.check_router_weights(matrix)
        if check is not None:
            raise TraceError(path, table, check.row, check.message)
        if column.type == target.type:
            return column
        value_type = target.type.value_type
        flat = pa.array(values.astype(value_type.to_pandas_dtype()), type=value_type)
        return pa.chunked_array([pa.FixedSizeListArray.from_arrays(flat, slots)])
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    try:
        return column.cast(target.type, safe=True)
    except _READ_ERRORS as exc:
        raise TraceError(
            path, table, None, f"column '{name}': cannot convert {column.type} to {target.type}: {exc}"
        ) from exc


# ----------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class DenseTree:
    """One recorded dense tree (views into the run's arrays; do not modify).

    Attributes:
        request_id, position, context_len: see docs/trace-format.md (``nodes`` table).
        tree: ``specfit.tree.DraftTree`` of ``N`` nodes.
        target_tokens: int64[N]; accepted: bool[N] (token == target token of the parent).
        expert_ids: int16[N, L, K]; router_weights: float32[N, L, K].
        next_layer_expert_ids: int16[N, L-1, K], the next-layer prefetch guesses (row ``l``: layer
            ``l+1``'s router on the node's layer-``l`` MoE input), or None when not recorded.
        last_level: int64[N], the last draft level whose tree held each node (the tree is then
            the union of the per-level trees: :meth:`level_nodes`), or None when not recorded
            (format v1 traces).
    """

    request_id: int
    position: int
    context_len: int
    tree: Any
    target_tokens: np.ndarray
    accepted: np.ndarray
    expert_ids: np.ndarray
    router_weights: np.ndarray
    next_layer_expert_ids: np.ndarray | None = None
    last_level: np.ndarray | None = None

    @property
    def num_levels(self) -> int:
        """Draft levels run for this tree: the root's ``last_level`` (the tree's depth when not recorded)."""
        return int(self.tree.max_depth if self.last_level is None else self.last_level[0])

    def level_nodes(self, levels: int) -> np.ndarray:
        """int64[] ascending ids of the tree the draft held after ``levels`` levels: the nodes with
        ``depth <= levels <= last_level`` (``live.spec.draft``'s per-level EAGLE-2 tree); without
        ``last_level`` (format v1), the nodes with ``depth <= levels``, an approximation (a node a
        later level pushed out is missing)."""
        depths = self.tree.depths
        if self.last_level is None:
            return np.flatnonzero(depths <= levels)
        return np.flatnonzero((depths <= levels) & (self.last_level >= levels))

    @property
    def path_accepted(self) -> np.ndarray:
        """bool[N]: every node on the path root -> v accepted (what greedy verification commits)."""
        return path_accepted(self.tree.parents, self.accepted)

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens when the whole tree is verified (deepest path-accepted node)."""
        return int(self.tree.depths[self.path_accepted].max())


def path_accepted(parents: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """bool[N]: ``accepted`` along the whole path root -> v (parents precede children)."""
    out = np.asarray(accepted, dtype=bool).copy()
    for v in range(1, len(out)):
        out[v] = out[v] and out[parents[v]]
    return out


@dataclass(frozen=True)
class NodeArrays:
    """All dense trees of a run (or of one request) as flat arrays, sorted by (request, position).

    Tree ``i`` owns rows ``offsets[i]:offsets[i+1]``; its node ``v`` is row ``offsets[i] + v``.

    Attributes:
        offsets: int64[T+1]; request_ids, positions, context_lens: int64[T] per tree.
        parent, depth, token_id, target_token: int64[R]; accepted: bool[R];
        draft_logprob, path_logprob: float64[R]; expert_ids: int16[R, L, K];
        router_weights: float32[R, L, K]; next_layer_expert_ids: int16[R, L-1, K] (the next-layer
        prefetch guesses, see docs/trace-format.md) or None when the trace does not carry them;
        last_level: int64[R] (the last draft level whose tree held each node, see
        :class:`DenseTree`) or None when any tree lacks it (format v1 traces).
    """

    offsets: np.ndarray
    request_ids: np.ndarray
    positions: np.ndarray
    context_lens: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    token_id: np.ndarray
    target_token: np.ndarray
    accepted: np.ndarray
    draft_logprob: np.ndarray
    path_logprob: np.ndarray
    expert_ids: np.ndarray
    router_weights: np.ndarray
    next_layer_expert_ids: np.ndarray | None = None
    last_level: np.ndarray | None = None

    @property
    def num_trees(self) -> int:
        """Number of trees ``T``."""
        return len(self.request_ids)

    @property
    def tree_sizes(self) -> np.ndarray:
        """int64[T] nodes per tree."""
        return np.diff(self.offsets)

    def path_accepted(self) -> np.ndarray:
        """bool[R]: node and all its ancestors accepted (vectorised over all trees, by depth)."""
        start = np.repeat(self.offsets[:-1], self.tree_sizes)
        parent_row = np.where(self.parent >= 0, start + self.parent, np.arange(len(self.parent)))
        out = self.accepted.astype(bool).copy()
        for _ in range(int(self.depth.max(initial=0))):
            out &= out[parent_row]
        return out

    def select(self, tree_indices: np.ndarray) -> NodeArrays:
        """The trees ``tree_indices`` (ascending ints) as a new ``NodeArrays``."""
        tree_indices = np.asarray(tree_indices, dtype=np.int64)
        sizes = self.tree_sizes[tree_indices]
        rows = _ranges(self.offsets[tree_indices], sizes)
        offsets = np.zeros(len(tree_indices) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        per_tree = {k: getattr(self, k)[tree_indices] for k in ("request_ids", "positions", "context_lens")}
        per_row = {
            k: getattr(self, k)[rows]
            for k in (
                "parent",
                "depth",
                "token_id",
                "target_token",
                "accepted",
                "draft_logprob",
                "path_logprob",
                "expert_ids",
                "router_weights",
            )
        }
        for name in ("next_layer_expert_ids", "last_level"):  # optional columns
            values = getattr(self, name)
            per_row[name] = None if values is None else values[rows]
        return NodeArrays(offsets=offsets, **per_tree, **per_row)

    def tree(self, i: int, draft_tree_cls: Any = None) -> DenseTree:
        """Tree ``i`` as a :class:`DenseTree` (its arrays are views)."""
        if draft_tree_cls is None:
            from specfit.tree import DraftTree as draft_tree_cls
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        tree = draft_tree_cls(
            token_ids=self.token_id[lo:hi],
            parents=self.parent[lo:hi],
            depths=self.depth[lo:hi],
            draft_logprobs=self.draft_logprob[lo:hi],
            path_logprobs=self.path_logprob[lo:hi],
        )
        return DenseTree(
            request_id=int(self.request_ids[i]),
            position=int(self.positions[i]),
            context_len=int(self.context_lens[i]),
            tree=tree,
            target_tokens=self.target_token[lo:hi],
            accepted=self.accepted[lo:hi],
            expert_ids=self.expert_ids[lo:hi],
            router_weights=self.router_weights[lo:hi],
            next_layer_expert_ids=(
                None if self.next_layer_expert_ids is None else self.next_layer_expert_ids[lo:hi]
            ),
            last_level=None if self.last_level is None else self.last_level[lo:hi],
        )


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each pair, vectorised."""
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    return offsets + np.arange(total)


def _next_layer_ids(data: pa.Table, model: Any) -> np.ndarray | None:
    """int16[R, L-1, K] of a table's ``next_layer_expert_ids`` column, or None when any row lacks
    it (or there is no next layer)."""
    column = data.column("next_layer_expert_ids")
    if column.null_count or model.num_layers < 2:
        return None
    shape = (data.num_rows, model.num_layers - 1, model.top_k)
    return pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int16).reshape(shape)


@dataclass
class _Loaded:
    """A table concatenated from its parts plus the row -> (file, row) map."""

    table: pa.Table
    files: list[Path]
    row_starts: np.ndarray  # int64[P+1]

    def locate(self, row: int) -> tuple[Path, int]:
        part = int(np.searchsorted(self.row_starts, row, side="right")) - 1
        return self.files[part], int(row - self.row_starts[part])


class TraceRun:
    """A trace run directory opened for reading (use :func:`open_run`).

    Tables are read on first use and cached. ``requests``, ``prefill``, ``nodes``, ``cycles``
    and ``transfers`` are pandas DataFrames; :meth:`arrow` gives the Arrow tables;
    :meth:`node_arrays` and :meth:`iter_trees` are the fast paths for dense trees.
    """

    def __init__(self, run_dir: str | os.PathLike[str], manifest: Manifest) -> None:
        self.run_dir = Path(run_dir)
        self.manifest = manifest
        self._loaded: dict[str, _Loaded] = {}

    # ------------------------------------------------------------------------- loading
    def _load(self, table: str) -> _Loaded:
        if table not in TABLE_NAMES:
            raise KeyError(f"unknown table {table!r}; expected one of {list(TABLE_NAMES)}")
        if table not in self._loaded:
            parts = [path for _, path in list_parts(self.run_dir, table)]
            tables = [read_part(path, table, self.manifest) for path in parts]
            schema = arrow_schema(table, self.manifest.model)
            data = pa.concat_tables(tables) if tables else schema.empty_table()
            row_starts = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum([t.num_rows for t in tables], out=row_starts[1:])
            self._loaded[table] = _Loaded(data, parts, row_starts)
        return self._loaded[table]

    def arrow(self, table: str) -> pa.Table:
        """The whole ``table`` as a pyarrow Table in the canonical schema (parts concatenated)."""
        return self._load(table).table

    def num_rows(self, table: str) -> int:
        """Rows of ``table`` over all parts."""
        return self._load(table).table.num_rows

    def _column(self, table: str, name: str) -> np.ndarray:
        return self._load(table).table.column(name).to_numpy()

    def _error(self, table: str, violation: V.Violation) -> TraceError:
        file, row = self._load(table).locate(violation.row)
        return TraceError(file, table, row, violation.message)

    @property
    def requests(self) -> Any:
        """``requests`` as a pandas DataFrame."""
        return self.arrow("requests").to_pandas()

    @property
    def prefill(self) -> Any:
        """``prefill`` as a pandas DataFrame (list columns hold numpy arrays)."""
        return self.arrow("prefill").to_pandas()

    @property
    def nodes(self) -> Any:
        """``nodes`` as a pandas DataFrame (for speed prefer :meth:`node_arrays`)."""
        return self.arrow("nodes").to_pandas()

    @property
    def cycles(self) -> Any:
        """``cycles`` as a pandas DataFrame (per-layer columns hold numpy arrays)."""
        return self.arrow("cycles").to_pandas()

    @property
    def transfers(self) -> Any:
        """``transfers`` as a pandas DataFrame."""
        return self.arrow("transfers").to_pandas()

    @property
    def complete(self) -> bool:
        """The manifest's ``complete`` flag (false: still running or killed)."""
        return self.manifest.complete

    @cached_property
    def request_ids(self) -> np.ndarray:
        """int64[] ids of the recorded (finished) requests, ascending."""
        return np.sort(self._column("requests", "request_id").astype(np.int64))

    @cached_property
    def unfinished_request_ids(self) -> np.ndarray:
        """int64[] ids referenced by other tables but with no ``requests`` row (incomplete runs)."""
        seen = [np.unique(self._column(t, "request_id")) for t in TABLE_NAMES if t != "requests"]
        referenced = np.unique(np.concatenate(seen)) if seen else np.zeros(0, dtype=np.int64)
        return np.setdiff1d(referenced.astype(np.int64), self.request_ids)

    def prompt_lengths(self) -> dict[int, int]:
        """``{request_id: prompt length}``."""
        data = self.arrow("requests")
        lengths = pc.list_value_length(data.column("prompt_token_ids")).to_numpy(zero_copy_only=False)
        return dict(zip(data.column("request_id").to_numpy().tolist(), lengths.tolist()))

    # ------------------------------------------------------------------------- dense trees
    @cached_property
    def _node_arrays(self) -> NodeArrays:
        data = self.arrow("nodes")
        model = self.manifest.model
        shape = (data.num_rows, model.num_layers, model.top_k)

        def col(name: str, dtype: Any) -> np.ndarray:
            return data.column(name).to_numpy().astype(dtype, copy=False)

        request_id, position = col("request_id", np.int64), col("position", np.int64)
        starts = V.tree_starts(request_id, position)
        sizes = np.diff(np.append(starts, data.num_rows)).astype(np.int64)
        order = np.lexsort((position[starts], request_id[starts]))
        rows = None if np.all(order == np.arange(len(order))) else _ranges(starts[order], sizes[order])

        def pick(values: np.ndarray) -> np.ndarray:
            return values if rows is None else values[rows]

        def flat(name: str, dtype: Any) -> np.ndarray:
            return (
                pc.list_flatten(data.column(name)).to_numpy(zero_copy_only=False).astype(dtype).reshape(shape)
            )

        offsets = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(sizes[order], out=offsets[1:])
        guesses = _next_layer_ids(data, model)
        levels = None if data.column("last_level").null_count else pick(col("last_level", np.int64))
        return NodeArrays(
            offsets=offsets,
            request_ids=request_id[starts][order],
            positions=position[starts][order],
            context_lens=col("context_len", np.int64)[starts][order],
            parent=pick(col("parent", np.int64)),
            depth=pick(col("depth", np.int64)),
            token_id=pick(col("token_id", np.int64)),
            target_token=pick(col("target_token", np.int64)),
            accepted=pick(col("accepted", bool)),
            draft_logprob=pick(col("draft_logprob", np.float64)),
            path_logprob=pick(col("path_logprob", np.float64)),
            expert_ids=pick(flat("expert_ids", np.int16)),
            router_weights=pick(flat("router_weights", np.float32)),
            next_layer_expert_ids=None if guesses is None else pick(guesses),
            last_level=levels,
        )

    def node_arrays(self, request_id: int | None = None) -> NodeArrays:
        """All dense trees (or those of ``request_id``) as flat arrays; see :class:`NodeArrays`."""
        arrays = self._node_arrays
        if request_id is None:
            return arrays
        return arrays.select(np.flatnonzero(arrays.request_ids == int(request_id)))

    def use_node_arrays(self, arrays: NodeArrays) -> None:
        """Serve ``arrays`` as this run's dense trees from now on, instead of decoding the
        ``nodes`` table: they must be what :meth:`node_arrays` decodes for this run (e.g. a
        sweep's memory-mapped copy, ``sim.decoded.read_node_arrays``, which its workers open so
        that none decodes the trace again)."""
        self.__dict__["_node_arrays"] = arrays  # the cached_property's slot

    def iter_trees(self, request_id: int | None = None) -> Iterator[DenseTree]:
        """Yield every dense tree (or those of ``request_id``) in (request, position) order."""
        from specfit.tree import DraftTree

        arrays = self._node_arrays
        indices = (
            range(arrays.num_trees)
            if request_id is None
            else np.flatnonzero(arrays.request_ids == request_id)
        )
        for i in indices:
            yield arrays.tree(int(i), DraftTree)

    def prefill_experts(self, request_id: int) -> np.ndarray:
        """int16[T, L, K] prefill expert ids of ``request_id`` in prompt-token order.

        Raises:
            KeyError: no prefill rows for ``request_id``.
        """
        data = self.arrow("prefill")
        model = self.manifest.model
        mask = data.column("request_id").to_numpy() == int(request_id)
        if not mask.any():
            raise KeyError(f"{self.run_dir}: no prefill rows for request {request_id}")
        rows = np.flatnonzero(mask)
        rows = rows[np.argsort(data.column("token_index").to_numpy()[rows], kind="stable")]
        ids = pc.list_flatten(data.column("expert_ids")).to_numpy(zero_copy_only=False)
        ids = ids.reshape(data.num_rows, model.num_layers, model.top_k)
        return ids[rows].astype(np.int16)

    def prefill_next_layer_experts(self, request_id: int) -> np.ndarray | None:
        """int16[T, L-1, K] next-layer prefetch guesses of ``request_id``'s prefill tokens, in
        prompt-token order (see :class:`DenseTree`), or None when the trace does not carry them.

        Raises:
            KeyError: no prefill rows for ``request_id``.
        """
        data = self.arrow("prefill")
        mask = data.column("request_id").to_numpy() == int(request_id)
        if not mask.any():
            raise KeyError(f"{self.run_dir}: no prefill rows for request {request_id}")
        guesses = _next_layer_ids(data, self.manifest.model)
        if guesses is None:
            return None
        rows = np.flatnonzero(mask)
        return guesses[rows[np.argsort(data.column("token_index").to_numpy()[rows], kind="stable")]]

    @cached_property
    def has_next_layer_guesses(self) -> bool:
        """Whether every dense-tree node and prefill token carries its next-layer prefetch guesses
        (``next_layer_expert_ids``; always true for a single MoE layer, which has no next layer).
        Traces recorded before the column existed do not."""
        if self.manifest.model.num_layers < 2:
            return True
        return all(
            not self.arrow(table).column("next_layer_expert_ids").null_count for table in ("nodes", "prefill")
        )

    @cached_property
    def has_level_trees(self) -> bool:
        """Whether every dense tree carries ``last_level`` (format v2 dense runs): the simulator
        then rebuilds the per-level trees the live engine's stopping rule sees; traces recorded
        before the column existed do not (see :meth:`DenseTree.level_nodes`)."""
        return not self.arrow("nodes").column("last_level").null_count

    # ------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Read every table and check every value (:mod:`traces.validate`, :mod:`traces.checks`),
        then that the tables agree with each other and with ``manifest.table_counts``
        (:func:`traces.checks.consistency_errors`: lost rows, e.g. a deleted part).

        Raises:
            TraceError: the first problem found, naming file (or table folder), table and row.
        """
        for table in TABLE_NAMES:
            self._load(table)
        from traces.checks import consistency_errors, run_checks

        for table, violation in run_checks(self):
            raise self._error(table, violation)
        for error in consistency_errors(self):
            raise error


def open_run(run_dir: str | os.PathLike[str], *, validate: bool = True) -> TraceRun:
    """Open a run directory for reading.

    Args:
        run_dir: directory holding ``manifest.json`` and the table folders.
        validate: read and check every table now (default), including the cross-table checks
            that find lost rows (:func:`traces.checks.consistency_errors`); ``False`` only reads
            the manifest and lists the part files (numbering without gaps, counts recorded in the
            manifest: :func:`traces.checks.check_part_files`), tables are then read (and their
            schemas checked) on first use.

    Raises:
        TraceError: missing/bad manifest, missing part file, unreadable part, missing column,
            wrong type, bad value, or tables that disagree (rows lost).
    """
    from traces.checks import check_part_files

    manifest = read_manifest(run_dir)
    check_part_files(run_dir, manifest)
    run = TraceRun(run_dir, manifest)
    if validate:
        run.validate()
    return run
