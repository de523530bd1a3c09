"""Streaming writer of trace format v3 (see docs/trace-format.md).

Rows are buffered per table and written as complete Parquet part files
(``<table>/part-00000.parquet``, ...): each part is written to a hidden ``.tmp`` file and then
``os.replace``-d into place, so a process killed at any moment (SIGKILL included) leaves only
complete, readable parts. ``manifest.json`` is written the same way, first with
``complete: false`` and again by ``close(complete=True)``.

Every finished request is flushed (:meth:`TraceWriter.add_request`), so a killed process loses at
most the request in progress. To keep the part count of a table near ``rows / flush_every_rows``
however many requests a run has, a flush rewrites the table's last part (its *tail*, kept in
memory) with the new rows appended, atomically as above, until the tail holds
``flush_every_rows`` rows; the next flush then starts a new part.

Order of a request's rows: write its trees/prefill/cycles/transfers as they happen and call
:meth:`TraceWriter.add_request` when the request is finished. The ``requests`` table is always
flushed after every other table, so a request row on disk means all its rows are on disk.
Re-opening with ``resume=True`` keeps finished requests, drops the rows of unfinished ones
(their parts are rewritten atomically), continues the part numbering, and
:meth:`TraceWriter.recorded_request_ids` tells the caller which requests to skip.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from traces import validate as V
from traces.compact import pack_transfers
from traces.schema import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    TABLE_NAMES,
    CycleRecord,
    Manifest,
    arrow_schema,
    utc_now_iso,
)
from traces.storage import ZSTD_LEVEL, list_parts, part_path, write_manifest, write_part


def _as_int_array(name: str, values: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iub":
        raise ValueError(f"{name}: expected integers, got dtype {arr.dtype}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _nan_as_null(values: np.ndarray | None, count: int) -> list:
    """A float column's values with NaN (not measured) as None (null); all None without values."""
    if values is None:
        return [None] * count
    return [None if v != v else v for v in values.tolist()]


def _as_float_array(name: str, values: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {arr.shape}")
    return arr


def write_table_part(
    run_dir: Path, table: str, index: int, data: pa.Table, *, compression_level: int = ZSTD_LEVEL, fsync: bool = False
) -> None:
    """Atomically write part ``index`` of ``table`` in the current format: ``transfers`` in its
    compact form (:func:`traces.compact.pack_transfers`), every part with
    :func:`traces.storage.write_part`'s compression and encodings."""
    if table == "transfers":
        data = pack_transfers(data)
    write_part(part_path(run_dir, table, index), data, compression_level=compression_level, fsync=fsync)


class TraceWriter:
    """Append-only writer of one run directory.

    Args:
        run_dir: the run directory; created if missing. Must be empty (or absent) unless
            ``resume`` is true.
        manifest: the run's :class:`~traces.schema.Manifest` (``complete`` is managed here).
        resume: re-open an existing run: its model spec must equal ``manifest.model``; the
            stored manifest (creation time, command line, seed) is kept with the resume time
            appended to ``resumed_at``; rows of unfinished requests are dropped.
        flush_every_rows: rows of one table per part: buffered rows that trigger a flush of
            the table, and the size at which its tail part is closed.
        flush_every_s: seconds since the last flush after which the next ``add_*`` flushes
            everything (bounds what a killed process loses inside a long request).
        flush_every_request: flush every table when a request is finished (:meth:`add_request`),
            so a killed process loses at most the request in progress.
        compression_level: zstd level of the parts.
        fsync: fsync each part and the manifest (durability across power loss; not needed to
            survive SIGKILL).

    Raises:
        FileExistsError: ``run_dir`` holds files and ``resume`` is false.
        FileNotFoundError: ``resume`` is true and there is no ``manifest.json``.
        ValueError: on resume, a model spec that differs from the stored one (naming the field).
        traces.errors.TraceError: on resume, existing parts that do not validate, or a lost part
            (a gap in part numbering, or fewer parts than ``manifest.table_counts`` records).

    Input errors of the ``add_*`` methods raise ``ValueError`` naming the argument and row.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        manifest: Manifest,
        *,
        resume: bool = False,
        flush_every_rows: int = 8192,
        flush_every_s: float = 30.0,
        flush_every_request: bool = True,
        compression_level: int = ZSTD_LEVEL,
        fsync: bool = False,
    ) -> None:
        if flush_every_rows <= 0:
            raise ValueError(f"flush_every_rows: expected > 0, got {flush_every_rows}")
        self.run_dir = Path(run_dir)
        self.flush_every_rows = int(flush_every_rows)
        self.flush_every_s = float(flush_every_s)
        self.flush_every_request = bool(flush_every_request)
        self.compression_level = int(compression_level)
        self.fsync = bool(fsync)
        self._buffers: dict[str, list[pa.RecordBatch]] = {t: [] for t in TABLE_NAMES}
        self._buffered_rows = dict.fromkeys(TABLE_NAMES, 0)
        self._next_part = dict.fromkeys(TABLE_NAMES, 0)
        # rows of the last part written while it is below flush_every_rows (rewritten by a flush)
        self._tail: dict[str, pa.Table | None] = dict.fromkeys(TABLE_NAMES)
        self._parts_on_disk = dict.fromkeys(TABLE_NAMES, 0)  # -> manifest.table_counts at close
        self._rows_on_disk = dict.fromkeys(TABLE_NAMES, 0)
        self._request_ids: set[int] = set()
        self._tree_keys: set[tuple[int, int]] = set()  # (request_id, position) of written trees
        self._cycle_keys: set[tuple[int, int]] = set()  # (request_id, cycle_index) of written cycles
        self._closed = False
        self.dropped_rows: dict[str, int] = dict.fromkeys(TABLE_NAMES, 0)
        if resume:
            manifest = self._resume(manifest)
        else:
            self._create()
            manifest = manifest.replace(complete=False, table_counts=None)
        self.manifest = manifest
        self._schemas = {t: arrow_schema(t, manifest.model) for t in TABLE_NAMES}
        model = manifest.model
        self._num_layers, self._num_experts, self._top_k = model.num_layers, model.num_experts, model.top_k
        write_manifest(self.run_dir, self.manifest, fsync=self.fsync)
        self._last_flush_at = time.monotonic()

    # ----------------------------------------------------------------------------- setup
    def _create(self) -> None:
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise FileExistsError(
                f"{self.run_dir}: run directory is not empty; pass resume=True to continue it or choose a new one"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for table in TABLE_NAMES:
            (self.run_dir / table).mkdir(exist_ok=True)

    def _resume(self, manifest: Manifest) -> Manifest:
        from traces.reader import read_manifest, read_part

        if not (self.run_dir / MANIFEST_FILE).is_file():
            raise FileNotFoundError(f"{self.run_dir / MANIFEST_FILE}: no manifest to resume from")
        stored = read_manifest(self.run_dir)
        if stored.model != manifest.model:
            diff = [
                f"{name}: stored {getattr(stored.model, name)!r}, given {getattr(manifest.model, name)!r}"
                for name in stored.model.__dataclass_fields__
                if getattr(stored.model, name) != getattr(manifest.model, name)
            ]
            raise ValueError(f"{self.run_dir}: cannot resume, manifest.model differs ({'; '.join(diff)})")
        for table in TABLE_NAMES:
            folder = self.run_dir / table
            folder.mkdir(exist_ok=True)
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink()
        self._restore_or_check_numbering(stored)
        for _, path in list_parts(self.run_dir, "requests"):
            ids = read_part(path, "requests", stored).column("request_id").to_numpy()
            self._request_ids.update(int(r) for r in ids)
            self._parts_on_disk["requests"] += 1
            self._rows_on_disk["requests"] += len(ids)
        keep = pa.array(sorted(self._request_ids), type=pa.int64())
        for table in TABLE_NAMES:
            parts = list_parts(self.run_dir, table)
            self._next_part[table] = parts[-1][0] + 1 if parts else 0
            if table == "requests":
                continue
            for index, path in parts:
                part = read_part(path, table, stored)
                mask = pc.is_in(part.column("request_id"), value_set=keep)
                num_kept = pc.sum(mask).as_py() or 0
                self._remember_keys(table, part.filter(mask))
                self._parts_on_disk[table] += 1
                self._rows_on_disk[table] += num_kept
                if num_kept == part.num_rows:
                    continue
                self.dropped_rows[table] += part.num_rows - num_kept
                # a part left with no rows is kept as an empty part (not deleted), so part numbers
                # stay gap-free and the reader can tell a lost part from a dropped one
                self._write_part(table, index, part.filter(mask))
        return stored.replace(
            complete=False, resumed_at=(*stored.resumed_at, utc_now_iso()), table_counts=None
        )

    def _restore_or_check_numbering(self, stored: Manifest) -> None:
        """Before resuming: a run resumed by a writer from before ``table_counts`` may lack parts
        that writer deleted when a resume emptied them; they come back as empty parts so numbering
        is gap-free again. Any other run must pass :func:`traces.checks.check_part_files` (a lost
        part is refused, not built upon)."""
        from traces.checks import check_part_files

        if stored.resumed_at and stored.table_counts is None:
            for table in TABLE_NAMES:
                present = {index for index, _ in list_parts(self.run_dir, table)}
                for index in sorted(set(range(max(present, default=-1))) - present):
                    self._write_part(table, index, arrow_schema(table, stored.model).empty_table())
        check_part_files(self.run_dir, stored)

    def _write_part(self, table: str, index: int, data: pa.Table) -> None:
        write_table_part(
            self.run_dir, table, index, data, compression_level=self.compression_level, fsync=self.fsync
        )

    def _remember_keys(self, table: str, part: pa.Table) -> None:
        second = {"nodes": "position", "cycles": "cycle_index"}.get(table)
        if second is None:
            return
        keys = self._tree_keys if table == "nodes" else self._cycle_keys
        pairs = zip(part.column("request_id").to_pylist(), part.column(second).to_pylist())
        keys.update(pairs)

    # ----------------------------------------------------------------------------- queries
    def recorded_request_ids(self) -> set[int]:
        """Request ids whose ``requests`` row was added (finished requests, including resumed ones)."""
        return set(self._request_ids)

    def recorded_positions(self, request_id: int) -> set[int]:
        """Positions of the dense trees of ``request_id`` written so far (on resume: those kept)."""
        return {pos for rid, pos in self._tree_keys if rid == int(request_id)}

    @property
    def rows_buffered(self) -> dict[str, int]:
        """Rows waiting in memory per table."""
        return dict(self._buffered_rows)

    # ----------------------------------------------------------------------------- appends
    def _append(self, table: str, columns: dict[str, Any]) -> None:
        if self._closed:
            raise ValueError(f"{self.run_dir}: writer is closed")
        try:
            batch = pa.RecordBatch.from_pydict(columns, schema=self._schemas[table])
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            raise ValueError(
                f"{table}: value does not fit the column type of trace format v{FORMAT_VERSION}: {exc}"
            ) from exc
        self._buffers[table].append(batch)
        self._buffered_rows[table] += batch.num_rows
        if self._buffered_rows[table] >= self.flush_every_rows:
            if table == "requests":
                self.flush()
            else:
                self._flush_table(table)
        if time.monotonic() - self._last_flush_at >= self.flush_every_s:
            self.flush()

    def _expert_columns(
        self, name: str, expert_ids: Any, router_weights: Any, rows: int
    ) -> dict[str, pa.Array]:
        shape = (rows, self._num_layers, self._top_k)
        ids = _as_int_array(f"{name}: expert_ids", expert_ids, shape)
        weights = _as_float_array(f"{name}: router_weights", router_weights, shape)
        for check, label in (
            (V.check_expert_ids(ids, self._num_experts, self._top_k), "expert_ids"),
            (V.check_router_weights(weights), "router_weights"),
        ):
            if check is not None:
                raise ValueError(f"{name}: {label} row {check.row}: {check.message}")
        slots = self._num_layers * self._top_k
        id_type = self._schemas["nodes"].field("expert_ids").type.value_type
        ids_arr = pa.array(ids.reshape(-1).astype(id_type.to_pandas_dtype()), type=id_type)
        w_arr = pa.array(weights.reshape(-1).astype(np.float16), type=pa.float16())
        return {
            "expert_ids": pa.FixedSizeListArray.from_arrays(ids_arr, slots),
            "router_weights": pa.FixedSizeListArray.from_arrays(w_arr, slots),
        }

    def _next_layer_column(self, name: str, guesses: Any, rows: int) -> pa.Array:
        """The ``next_layer_expert_ids`` column: ``guesses`` int[rows, L-1, K] checked and packed,
        or all nulls when ``None`` (not recorded; also for a single MoE layer)."""
        field_type = self._schemas["nodes"].field("next_layer_expert_ids").type
        if guesses is None or self._num_layers < 2:
            return pa.nulls(rows, type=field_type)
        ids = _as_int_array(f"{name}: next_layer_expert_ids", guesses, (rows, self._num_layers - 1, self._top_k))
        check = V.check_expert_ids(ids, self._num_experts, self._top_k)
        if check is not None:
            raise ValueError(f"{name}: next_layer_expert_ids row {check.row}: {check.message}")
        flat = pa.array(ids.reshape(-1).astype(field_type.value_type.to_pandas_dtype()), type=field_type.value_type)
        return pa.FixedSizeListArray.from_arrays(flat, field_type.list_size)

    def add_request(
        self,
        request_id: int,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        source: str,
        category: str | None = None,
    ) -> None:
        """Record a finished request (call it last for that request; ids unique in the run).

        ``category``: the prompt's category (e.g. MT-bench's ``summarization``), ``None`` without one.
        With ``flush_every_request`` (the default) every table is flushed, ``requests`` last, so
        the request and all its rows are on disk when this returns.
        """
        request_id = int(request_id)
        if request_id in self._request_ids:
            raise ValueError(f"add_request: request_id {request_id} already recorded")
        prompt = _as_int_array("add_request: prompt_token_ids", prompt_token_ids)
        generated = _as_int_array("add_request: generated_token_ids", generated_token_ids)
        for name, arr in (("prompt_token_ids", prompt), ("generated_token_ids", generated)):
            if arr.ndim != 1 or (arr.size and arr.min() < 0):
                raise ValueError(f"add_request: {name}: expected a 1-D list of token ids >= 0")
        self._request_ids.add(request_id)
        self._append(
            "requests",
            {
                "request_id": [request_id],
                "prompt_token_ids": [prompt.tolist()],
                "generated_token_ids": [generated.tolist()],
                "source": [str(source)],
                "category": [None if category is None else str(category)],
            },
        )
        if self.flush_every_request:
            self.flush()

    def add_prefill(
        self, request_id: int, expert_ids: Any, router_weights: Any, next_layer_expert_ids: Any = None
    ) -> None:
        """Prefill routing of one request: ``expert_ids``/``router_weights`` shape ``[T, L, K]``,
        one row per prompt token in order; ``next_layer_expert_ids`` ``[T, L-1, K]``: the
        next-layer prefetch guesses (docs/trace-format.md), or None (not recorded).

        Raises:
            ValueError: wrong shapes, an expert id outside ``0..E-1`` or a bad weight.
        """
        if np.ndim(expert_ids) != 3:
            raise ValueError(f"add_prefill: expert_ids: expected shape [T, L, K], got {np.shape(expert_ids)}")
        num_tokens = int(np.shape(expert_ids)[0])
        columns: dict[str, Any] = self._expert_columns("add_prefill", expert_ids, router_weights, num_tokens)
        columns["request_id"] = np.full(num_tokens, int(request_id), dtype=np.int64)
        columns["token_index"] = np.arange(num_tokens, dtype=np.int32)
        columns["next_layer_expert_ids"] = self._next_layer_column(
            "add_prefill", next_layer_expert_ids, num_tokens
        )
        self._append("prefill", columns)

    def add_tree(
        self,
        request_id: int,
        position: int,
        context_len: int,
        tree: Any,
        target_tokens: Any,
        accepted: Any,
        expert_ids: Any,
        router_weights: Any,
        next_layer_expert_ids: Any = None,
        *,
        last_level: Any = None,
    ) -> None:
        """One dense tree: every node of ``tree`` (a ``specfit.tree.DraftTree``) with its routing.

        Args:
            request_id, position, context_len: see docs/contracts.md (``position`` = generated
                tokens committed when drafted; ``context_len`` = prompt length + position).
            tree: ``DraftTree`` with ``N`` nodes (token_ids, parents, depths, draft/path log-probs).
            target_tokens: ``int[N]``, the target's greedy token after each node.
            accepted: ``bool[N]``, ``token_ids[v] == target_tokens[parent[v]]``, true at the root.
            expert_ids: ``int[N, L, K]`` in ``0..E-1``; router_weights: ``float[N, L, K]``.
            next_layer_expert_ids: ``int[N, L-1, K]``, the next-layer prefetch guesses
                (docs/trace-format.md), or None (not recorded).
            last_level: ``int[N]``, the last draft level whose tree held each node when ``tree`` is
                the union of the draft's per-level trees (``live.spec.draft``, ``level_union``), or
                None (not recorded: readers then cut the final tree at each depth).

        Raises:
            ValueError: wrong shapes or values, naming the argument and node.
        """
        n = len(tree.token_ids)
        self.add_node_rows(
            request_id=np.full(n, int(request_id)),
            position=np.full(n, int(position)),
            context_len=np.full(n, int(context_len)),
            node_id=np.arange(n),
            parent=tree.parents,
            depth=tree.depths,
            token_id=tree.token_ids,
            draft_logprob=tree.draft_logprobs,
            path_logprob=tree.path_logprobs,
            target_token=target_tokens,
            accepted=accepted,
            expert_ids=expert_ids,
            router_weights=router_weights,
            next_layer_expert_ids=next_layer_expert_ids,
            last_level=last_level,
        )

    def add_node_rows(self, **columns: Any) -> None:
        """Bulk form of :meth:`add_tree`: flat ``[R]`` arrays of many whole trees (``[R, L, K]`` for
        ``expert_ids``/``router_weights``; the optional ``next_layer_expert_ids`` ``[R, L-1, K]``
        and ``last_level`` ``[R]``), keyword per ``nodes`` column (docs/trace-format.md).

        Raises:
            ValueError: a missing/extra column, wrong shape, or a tree that breaks the format.
        """
        names = [spec.name for spec in self._schemas["nodes"]]
        columns.setdefault("next_layer_expert_ids", None)  # optional: nulls when not recorded
        columns.setdefault("last_level", None)
        missing = sorted(set(names) - set(columns))
        extra = sorted(set(columns) - set(names))
        if missing or extra:
            raise ValueError(f"add_node_rows: missing columns {missing}, unknown columns {extra}")
        rows = len(np.asarray(columns["node_id"]))
        arrays: dict[str, Any] = {}
        for name in names:
            if name in ("expert_ids", "router_weights", "next_layer_expert_ids", "last_level"):
                continue
            if name in ("draft_logprob", "path_logprob"):
                arrays[name] = _as_float_array(f"add_tree: {name}", columns[name], (rows,))
            else:
                arrays[name] = _as_int_array(f"add_tree: {name}", columns[name], (rows,))
        check = V.check_range(arrays["position"], "position", 0) or V.check_range(
            arrays["context_len"], "context_len", 0
        )
        check = check or V.check_trees(**{k: v for k, v in arrays.items() if k != "context_len"})
        if check is None and columns["last_level"] is not None:
            arrays["last_level"] = _as_int_array("add_tree: last_level", columns["last_level"], (rows,))
            check = V.check_level_trees(
                arrays["request_id"],
                arrays["position"],
                arrays["parent"],
                arrays["depth"],
                arrays["last_level"],
                self.manifest.draft.max_nodes,
            )
        if check is not None:
            raise ValueError(f"add_tree: row {check.row}: {check.message}")
        arrays.setdefault("last_level", pa.nulls(rows, type=pa.int16()))
        starts = V.tree_starts(arrays["request_id"], arrays["position"])
        keys = list(zip(arrays["request_id"][starts].tolist(), arrays["position"][starts].tolist()))
        seen = [key for key in keys if key in self._tree_keys]
        if seen:
            raise ValueError(f"add_tree: tree (request {seen[0][0]}, position {seen[0][1]}) already recorded")
        arrays["accepted"] = arrays["accepted"].astype(bool)
        arrays.update(
            self._expert_columns("add_tree", columns["expert_ids"], columns["router_weights"], rows)
        )
        arrays["next_layer_expert_ids"] = self._next_layer_column(
            "add_tree", columns["next_layer_expert_ids"], rows
        )
        self._append("nodes", arrays)
        self._tree_keys.update(keys)

    def add_cycle(self, record: CycleRecord) -> None:
        """One executed verification cycle (:class:`~traces.schema.CycleRecord`).

        Raises:
            ValueError: per-layer lists not of length ``L``, ``verified_nodes`` not of length
                ``num_nodes_verified``, or ``reached_depth`` other than ``num_accepted`` (+ 1).
        """
        num_layers = self._num_layers
        row: dict[str, list[Any]] = {}
        for spec in self._schemas["cycles"]:
            value = getattr(record, spec.name)
            if spec.name.startswith("layer_") and value is not None:
                value = np.asarray(value).tolist()
                if len(value) != num_layers:
                    raise ValueError(
                        f"add_cycle: {spec.name}: expected {num_layers} values (one per layer), got {len(value)}"
                    )
            elif (
                spec.name in ("verified_nodes", "committed_token_ids", "accessed_experts")
                and value is not None
            ):
                value = np.asarray(value, dtype=np.int64).tolist()
            row[spec.name] = [value]
        if len(row["verified_nodes"][0]) != record.num_nodes_verified:
            raise ValueError(
                f"add_cycle: verified_nodes has {len(row['verified_nodes'][0])} ids, "
                f"num_nodes_verified is {record.num_nodes_verified}"
            )
        self._check_accesses(row["layer_accessed"][0], row["accessed_experts"][0])
        reached = record.reached_depth
        if reached is not None and not record.num_accepted <= reached <= record.num_accepted + 1:
            raise ValueError(
                f"add_cycle: reached_depth {reached}: expected num_accepted ({record.num_accepted}) or one more"
            )
        key = (int(record.request_id), int(record.cycle_index))
        if key in self._cycle_keys:
            raise ValueError(f"add_cycle: cycle (request {key[0]}, cycle_index {key[1]}) already recorded")
        self._append("cycles", row)
        self._cycle_keys.add(key)

    def _check_accesses(self, counts: list[int] | None, ids: list[int] | None) -> None:
        """``layer_accessed``/``accessed_experts`` of a cycle: both or neither, ids of each layer
        ascending, distinct and in ``0..E-1``, as many as the layer's count."""
        if counts is None and ids is None:
            return
        if counts is None or ids is None:
            raise ValueError("add_cycle: give both layer_accessed and accessed_experts, or neither")
        if sum(counts) != len(ids) or min(counts, default=0) < 0:
            raise ValueError(
                f"add_cycle: accessed_experts has {len(ids)} ids, layer_accessed counts {sum(counts)}"
            )
        start = 0
        for layer, count in enumerate(counts):
            part = ids[start : start + count]
            start += count
            if part and (part[0] < 0 or part[-1] >= self._num_experts or any(np.diff(part) <= 0)):
                raise ValueError(
                    f"add_cycle: accessed_experts of layer {layer}: expected distinct ascending ids in "
                    f"0..{self._num_experts - 1}, got {part}"
                )

    def update_config(self, **items: Any) -> None:
        """Add ``items`` to the manifest's ``config`` and rewrite ``manifest.json`` at once
        (atomically), e.g. what a resumed run continued from."""
        self.manifest = self.manifest.replace(config={**self.manifest.config, **items})
        write_manifest(self.run_dir, self.manifest, fsync=self.fsync)

    def add_transfers(
        self,
        request_id: int,
        cycle_index: int,
        layers: Any,
        experts: Any,
        num_bytes: Any,
        h2d_s: Any,
        spans: tuple[Any, Any, Any] | None = None,
        placed_at_s: Any = None,
    ) -> None:
        """Per-transfer H2D timings of one cycle: ``layers``, ``experts``, ``num_bytes`` (scalar or
        ``[M]``, bytes) and ``h2d_s`` (``[M]``, seconds); ``spans``: optional ``(enqueued_at_s,
        started_at_s, landed_at_s)``, each ``[M]`` seconds from the verification forward's start
        (null columns without it); ``placed_at_s``: optional ``[M]`` seconds from the same start to
        the end of each copy's host memcpy on the CPU copy stream (NaN or None: not measured,
        written as null).

        Raises:
            ValueError: lengths differ, or a layer/expert out of range.
        """
        layer_arr = _as_int_array("add_transfers: layers", layers)
        count = layer_arr.shape[0] if layer_arr.ndim == 1 else -1
        expert_arr = _as_int_array("add_transfers: experts", experts, (count,))
        bytes_arr = _as_int_array("add_transfers: num_bytes", np.broadcast_to(num_bytes, (count,)), (count,))
        h2d_arr = _as_float_array("add_transfers: h2d_s", h2d_s, (count,))
        for name, arr, high in (
            ("layers", layer_arr, self._num_layers),
            ("experts", expert_arr, self._num_experts),
            ("num_bytes", bytes_arr, None),
            ("h2d_s", h2d_arr, None),
        ):
            check = V.check_range(arr, name, 0, high)
            if check is not None:
                raise ValueError(f"add_transfers: row {check.row}: {check.message}")
        self._append(
            "transfers",
            {
                "request_id": np.full(count, int(request_id), dtype=np.int64),
                "cycle_index": np.full(count, int(cycle_index), dtype=np.int32),
                "layer": layer_arr,
                "expert": expert_arr,
                "bytes": bytes_arr,
                "h2d_s": h2d_arr,
                **{
                    name: [None] * count
                    if spans is None
                    else _as_float_array(f"add_transfers: {name}", values, (count,))
                    for name, values in zip(
                        ("enqueued_at_s", "started_at_s", "landed_at_s"), spans or (None,) * 3
                    )
                },
                "placed_at_s": _nan_as_null(
                    None if placed_at_s is None else _as_float_array("add_transfers: placed_at_s", placed_at_s, (count,)),
                    count,
                ),
            },
        )

    # ----------------------------------------------------------------------------- flushing
    def _flush_table(self, table: str) -> None:
        """Write the buffered rows of ``table``: appended to its tail part (rewritten atomically)
        while that holds fewer than ``flush_every_rows`` rows, else as a new part."""
        batches = self._buffers[table]
        if not batches:
            return
        new = pa.Table.from_batches(batches, schema=self._schemas[table])
        tail = self._tail[table]
        if tail is None:
            index = self._next_part[table]
            data = new
        else:
            index = self._next_part[table] - 1
            data = pa.concat_tables([tail, new])
        self._write_part(table, index, data)
        if tail is None:
            self._next_part[table] = index + 1
            self._parts_on_disk[table] += 1
        self._rows_on_disk[table] += new.num_rows
        self._tail[table] = data if data.num_rows < self.flush_every_rows else None
        self._buffers[table] = []
        self._buffered_rows[table] = 0

    def flush(self) -> None:
        """Write every buffered row as new parts (``requests`` last)."""
        for table in TABLE_NAMES:
            if table != "requests":
                self._flush_table(table)
        self._flush_table("requests")
        self._last_flush_at = time.monotonic()

    def close(self, complete: bool = True) -> None:
        """Flush and rewrite the manifest with ``complete`` and ``table_counts`` (parts and rows
        of every table on disk, checked by the reader); idempotent."""
        if self._closed:
            return
        self.flush()
        counts = {t: {"parts": self._parts_on_disk[t], "rows": self._rows_on_disk[t]} for t in TABLE_NAMES}
        self.manifest = self.manifest.replace(complete=bool(complete), table_counts=counts)
        write_manifest(self.run_dir, self.manifest, fsync=self.fsync)
        self._closed = True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(complete=exc_type is None)
