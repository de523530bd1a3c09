"""sim.decoded: a trace's decoded arrays as one memory-mapped Arrow IPC file; spawned sweep
workers map it instead of decoding the trace (issue 14 item 4)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from tiny_shapes import tiny_shape

from sim import cells as sim_cells
from sim.cells import export_traces, make_cells, run_cell
from sim.decoded import read_node_arrays, write_node_arrays
from sim.executors import run_local
from sim.presets import DEFAULT_COST, cost_from_preset
from traces.reader import open_run
from traces.synthetic import generate_dense_trace

SHAPE = tiny_shape(12_288, "tiny")


def _trace(root: Path) -> str:
    return str(
        generate_dense_trace(
            root / "tiny",
            SHAPE,
            num_requests=2,
            positions_per_request=12,
            prompt_len=8,
            tree_depth=3,
            tree_topk=3,
            max_nodes=12,
            seed=7,
        )
    )


def test_round_trip_is_exact_read_only_and_zero_copy(tmp_path: Path) -> None:
    arrays = open_run(_trace(tmp_path)).node_arrays()
    path = write_node_arrays(arrays, tmp_path / "decoded" / "t.arrow")
    assert path.is_file() and not list(path.parent.glob(".*tmp*"))  # written atomically
    back = read_node_arrays(path)
    for field in dataclasses.fields(arrays):
        want, got = getattr(arrays, field.name), getattr(back, field.name)
        if want is None:
            assert got is None, field.name
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, field.name
        assert np.array_equal(got, want), field.name
        assert not got.flags.writeable and not got.flags.owndata, field.name  # a view of the mapped file
    assert back.accepted.dtype == np.bool_ and back.accepted.any()


def test_a_file_of_another_kind_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "other.arrow"
    table = pa.table({"x": [1, 2, 3]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(ValueError, match="other.arrow"):
        read_node_arrays(path)


def test_spawned_workers_map_the_decoded_trace_and_do_not_decode_it(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    model = open_run(trace).manifest.model
    cost = cost_from_preset(DEFAULT_COST, expert_bytes=12_288, num_layers=model.num_layers)
    cells = make_cells(
        trace_path=trace,
        cost=cost,
        bandwidths_gb_per_s=[4.0, 32.0],
        caches=[(4, 4 / model.num_experts)],
        policies=["ar", "topn", "specfit"],
    )
    expected = {c.cell_id: run_cell(c.to_dict()) for c in cells}  # in this process (decodes once here)

    # the nodes table is now unreadable: a worker that decoded the trace would fail
    for part in sorted((Path(trace) / "nodes").glob("*.parquet")):
        part.write_bytes(b"not parquet")
    got: dict[str, dict] = {}
    run_local(
        cells,
        lambda cell, row: got.__setitem__(cell.cell_id, row),
        jobs=2,
        start_method="spawn",
        scratch_dir=str(tmp_path),
    )
    assert got == expected
    assert not list(tmp_path.glob(".decoded-*"))  # the decoded copy is removed afterwards


def test_export_writes_one_file_per_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_cells, "_TRACES", {})
    trace = _trace(tmp_path)
    model = open_run(trace).manifest.model
    cost = cost_from_preset(DEFAULT_COST, expert_bytes=12_288, num_layers=model.num_layers)
    cells = make_cells(
        trace_path=trace, cost=cost, bandwidths_gb_per_s=[4.0, 8.0], caches=[(4, 0.5)], policies=["ar"]
    )
    files = export_traces(cells, tmp_path / "scratch")
    assert list(files) == [trace] and Path(files[trace]).is_file()
    assert np.array_equal(read_node_arrays(files[trace]).expert_ids, open_run(trace).node_arrays().expert_ids)
