"""``python -m traces.rewrite RUN_DIR --out NEW_DIR``: re-write a trace in the current format.

Reads every part of a finished or unfinished run of any supported format version (validated as
``open_run`` does), writes it part by part through the writer's part path
(:func:`traces.writer.write_table_part`: format v3's compact ``transfers``, the current Parquet
encodings) under the same part numbers, and writes the manifest with ``format_version`` set to the
current version, everything else (creation time, command line, ``table_counts``, ``complete``)
as stored. Other files of the run directory (``summary.json``, ``README.md``, ...) are copied as
they are. Every value is kept: ``tests/test_traces_compact.py`` reads both runs and compares
them column by column.

Exit status (the CLI contract, ``specfit.cli``): 0 on success; 2 for a missing or invalid run or
an ``--out`` that is a file, a non-empty directory, inside ``RUN_DIR`` or cannot be written (one
stderr line); the last stdout line is JSON.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from specfit.cli import ArgumentParser, InputError, cli_main, print_summary, run_main
from traces.errors import TraceError
from traces.schema import FORMAT_VERSION, MANIFEST_FILE, TABLE_NAMES, Manifest
from traces.storage import ZSTD_LEVEL, list_parts, write_manifest
from traces.writer import write_table_part


def rewrite_run(
    run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, compression_level: int = ZSTD_LEVEL
) -> Manifest:
    """Re-write the run at ``run_dir`` into ``out_dir`` in trace format :data:`FORMAT_VERSION`
    (module docstring); returns the new manifest.

    Raises:
        TraceError: the run does not read or validate (naming file, table and row).
        FileExistsError: ``out_dir`` is a file, or a directory that is not empty.
        ValueError: ``out_dir`` is ``run_dir`` or inside it (checked before anything is written).
        OSError: ``out_dir`` cannot be created or written.
    """
    from traces.reader import open_run, read_part

    run = open_run(run_dir, validate=True)
    source, out = Path(run_dir), Path(out_dir)
    if out.resolve().is_relative_to(source.resolve()):
        raise ValueError(f"{out}: is inside the run being re-written ({source}); choose a directory outside it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: is a file, not a directory; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    for table in TABLE_NAMES:
        (out / table).mkdir()
        for index, path in list_parts(source, table):
            data = read_part(path, table, run.manifest)
            write_table_part(out, table, index, data, compression_level=compression_level)
    for entry in source.iterdir():
        if entry.name == MANIFEST_FILE or entry.name in TABLE_NAMES or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, out / entry.name)
        else:
            shutil.copy2(entry, out / entry.name)
    manifest = run.manifest.replace(format_version=FORMAT_VERSION)
    write_manifest(out, manifest)
    return manifest


def _bytes_on_disk(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Re-write a trace run in the current format; see the module docstring."""
    parser = ArgumentParser(
        prog="python -m traces.rewrite", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    parser.add_argument("run_dir", help="the trace run directory to read (holds manifest.json)")
    parser.add_argument("--out", required=True, help="the new run directory (absent or empty)")
    args = parser.parse_args(argv)
    before = _bytes_on_disk(Path(args.run_dir))  # before anything is written
    try:
        manifest = rewrite_run(args.run_dir, args.out)
    except TraceError as exc:
        raise InputError("run_dir", str(exc)) from None
    except (FileExistsError, ValueError) as exc:  # after TraceError, a ValueError too
        raise InputError("--out", str(exc)) from None
    except OSError as exc:  # cannot create or write it (a path under a file, /proc, no permission, disk full)
        raise InputError("--out", f"{args.out}: cannot write the new run there: {exc.strerror or exc}") from None
    after = _bytes_on_disk(Path(args.out))
    print(f"{args.run_dir} ({before:,} bytes) -> {args.out} ({after:,} bytes, format v{manifest.format_version})")
    print_summary(
        {"ok": True, "out": str(args.out), "format_version": manifest.format_version, "bytes_before": before, "bytes_after": after}
    )
    return 0


if __name__ == "__main__":
    run_main(main)
