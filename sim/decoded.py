"""A trace's decoded dense-tree arrays as one memory-mapped Arrow IPC file (issue 14 item 4).

Decoding a dense trace (``traces.reader.TraceRun.node_arrays``: reading the ``nodes`` Parquet
parts, flattening the list columns, casting) takes seconds of CPU for a 2,000-position Qwen3-shape
trace. A sweep decodes it once in its own process and then:

* forked local workers inherit the decoded arrays (copy-on-write pages; nothing to write);
* workers that do not fork (a ``spawn`` pool, Ray tasks) open the arrays from one uncompressed
  Arrow IPC file written once by the sweep (:func:`write_node_arrays`): :func:`read_node_arrays`
  maps it with ``pyarrow.memory_map`` and hands out zero-copy, read-only numpy views, so every
  worker process shares the same page-cache pages and none decodes the trace again.

File layout (``pyarrow.ipc.new_file``, no compression): one record batch of one row; each
:class:`traces.reader.NodeArrays` field that is not ``None`` is a ``large_list`` column whose one
list holds the field's array flattened in C order (booleans as uint8: Arrow packs booleans into
bits, which numpy cannot view); the schema's metadata ``specfit.node_arrays`` holds, per field, its
numpy dtype and shape (JSON). Fields absent from the file (``None``) are passed as ``None``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

_METADATA_KEY = b"specfit.node_arrays"
FORMAT_VERSION = 1


def write_node_arrays(arrays: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``arrays`` (a ``traces.reader.NodeArrays``) to ``path`` as described in the module
    docstring, atomically (a temporary sibling, then a rename). Returns ``path``.

    Raises:
        OSError: the file cannot be written (e.g. no space left).
    """
    import pyarrow as pa

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns, fields, meta = [], [], {}
    for field in dataclasses.fields(arrays):
        value = getattr(arrays, field.name)
        if value is None:
            continue
        value = np.ascontiguousarray(value)
        flat = value.reshape(-1)
        if flat.dtype == np.bool_:
            flat = flat.view(np.uint8)
        values = pa.array(flat)  # zero-copy for numeric numpy arrays
        offsets = pa.array(np.array([0, flat.shape[0]], dtype=np.int64))
        columns.append(pa.LargeListArray.from_arrays(offsets, values))
        fields.append(pa.field(field.name, columns[-1].type))
        meta[field.name] = {"dtype": value.dtype.str, "shape": list(value.shape)}
    header = {"version": FORMAT_VERSION, "fields": meta}
    schema = pa.schema(fields, metadata={_METADATA_KEY: json.dumps(header).encode()})
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            writer.write_batch(batch)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_node_arrays(path: str | os.PathLike[str]) -> Any:
    """The ``traces.reader.NodeArrays`` of a file from :func:`write_node_arrays`, memory-mapped:
    every array is a read-only numpy view of the mapped file (no copy, no decoding).

    Raises:
        ValueError: not such a file (wrong metadata, version or column types; names the file).
        OSError: the file cannot be opened.
    """
    import pyarrow as pa

    from traces.reader import NodeArrays

    path = Path(path)
    reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    raw = (reader.schema.metadata or {}).get(_METADATA_KEY)
    header = json.loads(raw) if raw else {}
    if header.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: not a decoded-trace file of version {FORMAT_VERSION} (sim.decoded.write_node_arrays)"
        )
    batch = reader.get_batch(0)
    values: dict[str, Any] = {f.name: None for f in dataclasses.fields(NodeArrays)}
    for name, info in header["fields"].items():
        if name not in values:
            raise ValueError(f"{path}: unknown field {name!r} (written by another version of NodeArrays)")
        flat = batch.column(name).values.to_numpy(zero_copy_only=True)
        dtype = np.dtype(info["dtype"])
        if dtype == np.bool_:
            flat = flat.view(np.bool_)
        if flat.dtype != dtype:
            raise ValueError(f"{path}: field {name!r} holds {flat.dtype}, expected {dtype}")
        values[name] = flat.reshape(info["shape"])
    missing = [f.name for f in dataclasses.fields(NodeArrays) if values[f.name] is None and f.default is not None]
    if missing:
        raise ValueError(f"{path}: required fields missing: {missing}")
    return NodeArrays(**values)
