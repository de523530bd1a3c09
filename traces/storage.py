"""Files of a run directory: part naming, atomic writes of parts and of the manifest.

Atomicity: every file is written to a hidden ``.<name>.tmp`` sibling and moved into place with
``os.replace`` (atomic on POSIX), so readers only ever see complete files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from traces.schema import MANIFEST_FILE, Manifest

PART_PATTERN = re.compile(r"^part-(\d{5,})\.parquet$")
ZSTD_LEVEL = 3


def part_path(run_dir: Path, table: str, index: int) -> Path:
    """Path of part ``index`` of ``table``: ``run_dir/table/part-00007.parquet``."""
    return Path(run_dir) / table / f"part-{index:05d}.parquet"


def list_parts(run_dir: Path, table: str) -> list[tuple[int, Path]]:
    """Complete parts of ``table`` as ``(index, path)`` sorted by index (temp files ignored)."""
    folder = Path(run_dir) / table
    if not folder.is_dir():
        return []
    parts = []
    for path in folder.iterdir():
        match = PART_PATTERN.match(path.name)
        if match:
            parts.append((int(match.group(1)), path))
    return sorted(parts)


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` via a hidden temp file and ``os.replace`` (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_manifest(run_dir: Path, manifest: Manifest, *, fsync: bool = False) -> None:
    """Atomically (re)write ``run_dir/manifest.json``."""
    text = json.dumps(manifest.to_dict(), indent=2, default=str) + "\n"  # str(): Paths in config
    atomic_write_bytes(Path(run_dir) / MANIFEST_FILE, text.encode(), fsync=fsync)


def _leaf_paths(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    """``(Parquet column path, value type)`` of every leaf column (``name.list.element`` for lists)."""
    leaves = []
    for field in schema:
        kind = field.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            leaves.append((f"{field.name}.list.element", kind.value_type))
        else:
            leaves.append((field.name, kind))
    return leaves


def encoding_options(schema: pa.Schema) -> dict[str, object]:
    """``pyarrow.parquet.write_table`` options of a part: ``BYTE_STREAM_SPLIT`` for every
    floating-point leaf (its bytes are regrouped by significance so zstd sees the slowly varying
    sign/exponent bytes apart from the noisy low mantissa bytes: about -1/3 on the shipped sample's
    timing and log-prob columns, -19 % on its float16 router weights) and dictionary encoding for
    every other leaf (packs expert ids to ``ceil(log2 E)`` bits before compression). Lossless:
    encodings change bytes on disk, never values. Source: the Parquet format's ``BYTE_STREAM_SPLIT``
    encoding (float16 = ``FIXED_LEN_BYTE_ARRAY`` since Parquet 2.11 / Arrow 16, apache/arrow#40094;
    columns with nulls read right from Arrow 16.1, apache/arrow#41562; the project now needs
    ``pyarrow>=26`` for another reason: pyarrow 25 cannot read an all-null ``FixedSizeList``
    column such as ``next_layer_expert_ids`` written as ``pa.nulls`` by ``traces/writer.py`` in
    every trace without next-layer guesses); pyarrow's ``write_table(column_encoding=..., use_dictionary=[...])``."""
    leaves = _leaf_paths(schema)
    floats = [path for path, kind in leaves if pa.types.is_floating(kind)]
    return {
        "use_dictionary": [path for path, kind in leaves if not pa.types.is_floating(kind)],
        "column_encoding": dict.fromkeys(floats, "BYTE_STREAM_SPLIT") or None,
    }


def write_part(
    path: Path, table: pa.Table, *, compression_level: int = ZSTD_LEVEL, fsync: bool = False
) -> None:
    """Atomically write one Parquet part: zstd at ``compression_level``, the encodings of
    :func:`encoding_options` (measured by ``benchmarks/trace_size.py``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(
        table, tmp, compression="zstd", compression_level=compression_level, **encoding_options(table.schema)
    )
    if fsync:
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
    os.replace(tmp, path)
