"""Format v3's compact transfers (traces/compact.py), the part encodings (traces/storage.py) and
``python -m traces.rewrite``: every value comes back bit for bit, older versions still read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_traces_helpers import small_cycle, small_manifest, write_small_run

from traces.compact import pack_transfers, unpack_transfers
from traces.reader import open_run, read_manifest, read_part
from traces.rewrite import main as rewrite_main
from traces.rewrite import rewrite_run
from traces.schema import FORMAT_VERSION, arrow_schema
from traces.writer import TraceWriter

SPANS = ("enqueued_at_s", "started_at_s", "landed_at_s")


def _serial_batch(rng, count: int, origin: float) -> tuple[np.ndarray, ...]:
    """One batch of serial copies as live.h2d.H2DFetch.copy_spans makes it (CPU form)."""
    stamps = origin + np.cumsum(rng.uniform(1e-6, 5e-5, count + 1))
    landed = stamps[1:] - origin
    started = np.concatenate(([stamps[0] - origin], landed[:-1]))
    return np.full(count, rng.uniform(0, 1e-3)), started, landed, landed - started


def _transfers(rng, batches: list[tuple[int, int, int, bool]]) -> pa.Table:
    """A transfers table in the writer's schema: one serial batch per (request, cycle, copies, spans)."""
    columns: dict[str, list] = {name: [] for name in ("request_id", "cycle_index", "h2d_s", "placed_at_s", *SPANS)}
    for request, cycle, count, spans in batches:
        enqueued, started, landed, h2d = _serial_batch(rng, count, rng.uniform(10.0, 1e5))
        columns["request_id"] += [request] * count
        columns["cycle_index"] += [cycle] * count
        columns["h2d_s"] += list(h2d if spans else rng.uniform(0, 1e-4, count))
        for name, values in zip(SPANS, (enqueued, started, landed)):
            columns[name] += list(values) if spans else [None] * count
        columns["placed_at_s"] += list(enqueued + rng.uniform(0, 1e-5, count)) if spans else [None] * count
    rows = len(columns["request_id"])
    schema = arrow_schema("transfers", small_manifest().model)
    data = {
        **columns,
        "layer": np.zeros(rows, dtype=np.int16),
        "expert": np.zeros(rows, dtype=np.int16),
        "bytes": np.full(rows, 768),
    }
    return pa.table({f.name: pa.array(data[f.name], type=f.type) for f in schema}, schema=schema)


def _bits(table: pa.Table, name: str) -> list:
    """A float column as int64 bit patterns (None for null): compares -0.0, NaN bit for bit."""
    column = table.column(name).combine_chunks()
    values = column.fill_null(0.0).to_numpy(zero_copy_only=False).view(np.int64)
    return [None if column[i].as_py() is None else int(values[i]) for i in range(len(column))]


def _assert_same_values(a: pa.Table, b: pa.Table) -> None:
    assert a.column_names == b.column_names and a.num_rows == b.num_rows
    for name in a.column_names:
        if pa.types.is_floating(a.schema.field(name).type):
            assert _bits(a, name) == _bits(b, name), name
        else:
            assert a.column(name).combine_chunks().equals(b.column(name).combine_chunks()), name


batch_lists = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(1, 6), st.booleans()), min_size=1, max_size=8
)


@settings(max_examples=60, deadline=None)
@given(
    batches=batch_lists,
    seed=st.integers(0, 2**16),
    tweaks=st.lists(st.integers(0, 47), max_size=4),
    holes=st.lists(st.tuples(st.integers(0, 47), st.sampled_from(("enqueued_at_s", "started_at_s", "h2d_s"))), max_size=3),
)
def test_pack_then_unpack_gives_back_every_bit(batches, seed, tweaks, holes):
    rng = np.random.default_rng(seed)
    table = _transfers(rng, batches)
    # values that must not be left out: a copy that did not start when the previous one landed,
    # an h2d_s that is not landed - started, a -0.0 beside 0.0, a NaN
    for row in (t % table.num_rows for t in tweaks):
        for name, value in (("started_at_s", 1e9), ("h2d_s", -0.0), ("enqueued_at_s", float("nan"))):
            column = table.column(name).to_pylist()
            if column[row] is not None or name == "h2d_s":
                column[row] = value
                index = table.schema.get_field_index(name)
                table = table.set_column(index, table.schema.field(index), pa.array(column, pa.float64()))
    # partial spans (a measured landing beside a null start, enqueue or h2d_s; hand-made runs only)
    for row, name in ((r % table.num_rows, n) for r, n in holes):
        table = _with_null(table, name, row)
    packed = pack_transfers(table)
    _assert_same_values(unpack_transfers(packed), table)


def _with_null(table: pa.Table, name: str, row: int) -> pa.Table:
    column = table.column(name).to_pylist()
    column[row] = None
    index = table.schema.get_field_index(name)
    return table.set_column(index, table.schema.field(index).with_nullable(True), pa.array(column, pa.float64()))


def test_a_part_with_a_null_the_reader_would_fill_is_stored_whole(tmp_path):
    """A copy whose landing is measured but whose start is null (a hand-made run): the part is
    stored with every value as given and marked, and reads back with the null kept; the writer's
    own parts stay compact."""
    from traces.writer import write_table_part

    rng = np.random.default_rng(3)
    table = _transfers(rng, [(0, 0, 4, True)])
    manifest = small_manifest()
    for name, index in (("compact", None), ("whole", 2)):
        data = table if index is None else _with_null(table, "started_at_s", index)
        (tmp_path / name / "transfers").mkdir(parents=True)
        write_table_part(tmp_path / name, "transfers", 0, data)
        stored = pq.read_table(tmp_path / name / "transfers" / "part-00000.parquet")
        assert (stored.schema.metadata or {}).get(b"specfit_transfers_packed") == (None if index is None else b"0")
        assert stored.column("started_at_s").null_count == (3 if index is None else 1)
        _assert_same_values(read_part(tmp_path / name / "transfers" / "part-00000.parquet", "transfers", manifest), data)


def test_a_serial_batch_keeps_one_start_and_one_enqueue_and_no_h2d(tmp_path):
    rng = np.random.default_rng(0)
    table = _transfers(rng, [(0, 0, 5, True), (0, 0, 3, True), (0, 1, 4, False), (1, 1, 2, True)])
    packed = pack_transfers(table)
    # a batch stores its first start and enqueue only: later starts are the previous landings
    # (the 2nd batch of cycle 0 started later than the 1st landed: its first start is stored)
    assert packed.column("started_at_s").null_count == 4 + 2 + 4 + 1
    assert packed.column("h2d_s").null_count == 5 + 3 + 2  # rows with spans
    assert packed.column("landed_at_s").null_count == 4  # landings are never left out


def test_writer_stores_transfers_compactly_and_reads_them_back(tmp_path):
    rng = np.random.default_rng(1)
    enqueued, started, landed, h2d = _serial_batch(rng, 6, 123.456)
    with TraceWriter(tmp_path / "run", small_manifest()) as writer:
        writer.add_cycle(small_cycle(0, 0))
        writer.add_transfers(0, 0, [0] * 6, [0, 1, 2, 3, 4, 5], 768, h2d, spans=(enqueued, started, landed))
        writer.add_transfers(0, 0, [1, 1], [0, 1], 768, [1e-6, 2e-6])  # no spans measured
        writer.add_request(0, [7, 8, 9, 10], [1, 2, 3], "unit")
    part = tmp_path / "run" / "transfers" / "part-00000.parquet"
    stored = pq.read_table(part)
    assert stored.schema.metadata[b"specfit_trace_format_version"] == str(FORMAT_VERSION).encode()
    assert stored.column("started_at_s").null_count == 5 + 2 and stored.column("h2d_s").null_count == 6
    meta = pq.ParquetFile(part).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)}
    assert "BYTE_STREAM_SPLIT" in encodings["landed_at_s"] and "RLE_DICTIONARY" in encodings["expert"]
    transfers = open_run(tmp_path / "run").transfers
    assert transfers["started_at_s"].iloc[:6].tolist() == started.tolist()
    assert transfers["h2d_s"].tolist() == [*h2d.tolist(), 1e-6, 2e-6]
    assert transfers["enqueued_at_s"].iloc[:6].tolist() == enqueued.tolist()
    assert transfers["landed_at_s"].iloc[6:].isna().all()
    assert transfers["placed_at_s"].isna().all()  # not given: null


def test_memcpy_ends_are_stored_as_written_and_nan_reads_null(tmp_path):
    rng = np.random.default_rng(3)
    enqueued, started, landed, h2d = _serial_batch(rng, 4, 7.0)
    placed = enqueued + np.array([1e-5, 2e-5, 3e-5, np.nan])
    with TraceWriter(tmp_path / "run", small_manifest()) as writer:
        writer.add_cycle(small_cycle(0, 0))
        writer.add_transfers(0, 0, [0] * 4, [0, 1, 2, 3], 768, h2d, spans=(enqueued, started, landed), placed_at_s=placed)
        writer.add_request(0, [7, 8, 9, 10], [1, 2, 3], "unit")
    transfers = open_run(tmp_path / "run").transfers
    assert transfers["placed_at_s"].iloc[:3].tolist() == placed[:3].tolist()
    assert transfers["placed_at_s"].isna().tolist() == [False, False, False, True]
    assert transfers["started_at_s"].tolist() == started.tolist()  # the other spans still packed and rebuilt


def test_a_run_without_the_memcpy_column_reads_it_as_null(tmp_path):
    """Traces written before ``placed_at_s`` existed load, the column null (no placing fitted)."""
    run_dir = write_small_run(tmp_path / "old", num_requests=1, positions=2)
    parts = sorted(run_dir.glob("transfers/part-*.parquet"))
    rows = 0
    for part in parts:
        table = pq.read_table(part)
        rows += table.num_rows
        pq.write_table(table.drop(["placed_at_s"]).replace_schema_metadata(table.schema.metadata), part)
    transfers = open_run(run_dir).transfers
    assert parts and rows > 0 and len(transfers) == rows and transfers["placed_at_s"].isna().all()


def _as_format_v2(run_dir) -> None:
    """Re-write a run's parts as a format-v2 writer did (plain transfers, dictionary encoding)."""
    manifest = read_manifest(run_dir)
    for part in run_dir.glob("*/part-*.parquet"):
        table = read_part(part, part.parent.name, manifest)  # a v3 transfers part comes back whole
        table = table.replace_schema_metadata({b"specfit_trace_format_version": b"2"})
        pq.write_table(table, part, compression="zstd", use_dictionary=True)
    data = json.loads((run_dir / "manifest.json").read_text())
    (run_dir / "manifest.json").write_text(json.dumps({**data, "format_version": 2}))


def test_rewrite_of_a_format_v2_run_keeps_every_value(tmp_path):
    run_dir = write_small_run(tmp_path / "v2", num_requests=2, positions=3)
    rng = np.random.default_rng(2)
    enqueued, started, landed, h2d = _serial_batch(rng, 4, 5.0)
    with TraceWriter(run_dir, small_manifest(), resume=True) as writer:  # add spans to the run
        writer.add_cycle(small_cycle(2, 0))
        writer.add_transfers(2, 0, [0] * 4, [0, 1, 2, 3], 768, h2d, spans=(enqueued, started, landed))
        writer.add_request(2, [7, 8, 9, 10], [1, 2, 3], "unit")
    _as_format_v2(run_dir)
    (run_dir / "summary.json").write_text('{"kept": true}\n')
    old = open_run(run_dir)
    assert old.manifest.format_version == 2
    resumed_part = pq.read_table(run_dir / "transfers" / "part-00001.parquet")
    assert resumed_part.column("started_at_s").null_count == 0  # v2: every instant stored
    manifest = rewrite_run(run_dir, tmp_path / "v3")
    new = open_run(tmp_path / "v3")
    assert manifest.format_version == new.manifest.format_version == FORMAT_VERSION
    assert new.manifest.replace(format_version=2) == old.manifest
    for table in ("requests", "prefill", "nodes", "cycles", "transfers"):
        _assert_same_values(new.arrow(table), old.arrow(table))
    assert (tmp_path / "v3" / "summary.json").read_text() == '{"kept": true}\n'


def test_rewrite_cli_refuses_a_used_out_dir_and_a_missing_run(tmp_path, capsys):
    run_dir = write_small_run(tmp_path / "run")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(SystemExit) as exc:
        rewrite_main([str(run_dir), "--out", str(tmp_path / "used")])
    assert exc.value.code == 2
    assert "--out:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        rewrite_main([str(tmp_path / "nothing"), "--out", str(tmp_path / "new")])
    assert exc.value.code == 2 and "run_dir:" in capsys.readouterr().err
    assert rewrite_main([str(run_dir), "--out", str(tmp_path / "new")]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["format_version"] == FORMAT_VERSION


def test_rewrite_cli_refuses_an_out_it_cannot_use_in_one_line(tmp_path, capsys):
    """``--out`` a file, a path it cannot create, or a folder inside RUN_DIR: exit 2, one
    ``--out:`` line, no traceback, and the run is left as it was (nothing copied into itself)."""
    run_dir = write_small_run(tmp_path / "run")
    (tmp_path / "afile").write_text("x")
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    for out, needle in (
        (tmp_path / "afile", "is a file"),
        (tmp_path / "afile" / "sub", "cannot write"),
        *([(Path("/proc/specfit-rewrite"), "cannot write")] if Path("/proc/self").exists() else []),
        (run_dir / "new", "inside the run"),
        (run_dir, "inside the run"),
    ):
        with pytest.raises(SystemExit) as exc:
            rewrite_main([str(run_dir), "--out", str(out)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "error: --out:" in err and needle in err, (out, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert (tmp_path / "afile").read_text() == "x"



def test_validate_names_the_part_versions_of_a_resumed_older_run(tmp_path, capsys):
    """A format-v2 run resumed by the current writer keeps its manifest's version and gains
    v3 parts: ``traces.validate`` says both, not only the manifest's."""
    from traces.validate import main as validate_main

    run_dir = write_small_run(tmp_path / "v2", num_requests=1, positions=3)
    _as_format_v2(run_dir)
    assert validate_main([str(run_dir)]) == 0
    assert ", trace format v2, " in capsys.readouterr().out
    with TraceWriter(run_dir, small_manifest(), resume=True) as writer:
        writer.add_cycle(small_cycle(1, 0))
        writer.add_transfers(1, 0, [0], [0], 768, [1e-6])
        writer.add_request(1, [7, 8, 9, 10], [1, 2, 3], "unit")
    assert read_manifest(run_dir).format_version == 2
    assert validate_main([str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f", trace format v2 (parts: v2, v{FORMAT_VERSION}), " in out[-2]
    assert json.loads(out[-1])["part_format_versions"] == [2, FORMAT_VERSION]
