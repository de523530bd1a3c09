"""Malformed traces: each error names the file, the table and the row, never a bare pyarrow traceback.

The pristine run (``write_small_run``): 2 requests of 4 prompt tokens; per request 3 trees of 6
nodes (nodes rows 0..35; tree (request 0, position 1) is rows 6..11), 3 cycles and 6 transfers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_traces_helpers import edit_part, first_part, set_value, write_small_run

from traces.errors import TraceError
from traces.reader import open_run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_small_run(tmp_path_factory.mktemp("pristine") / "run")


@pytest.fixture
def run_dir(pristine, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(pristine, target)
    return target


def _expect(
    run_dir: Path, table: str | None, row: int | None, pattern: str, file_suffix: str = ""
) -> TraceError:
    with pytest.raises(TraceError, match=pattern) as info:
        open_run(run_dir)
    err = info.value
    assert err.table == table and err.row == row
    assert err.file.endswith(file_suffix)
    where = f"table '{table}' row {row}" if row is not None else (f"table '{table}'" if table else "")
    assert where in str(err) and err.file in str(err)
    return err


def _edit(run_dir: Path, table: str, column: str, row: int, value) -> None:
    edit_part(first_part(run_dir, table), lambda t: set_value(t, column, row, value))


def test_pristine_run_validates(run_dir):
    run = open_run(run_dir)
    assert run.num_rows("nodes") == 36 and run.num_rows("cycles") == 6 and run.num_rows("transfers") == 12


def test_truncated_part(run_dir):
    part = first_part(run_dir, "nodes")
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    _expect(
        run_dir,
        "nodes",
        None,
        r"cannot read Parquet data \(truncated or corrupt file\?\)",
        "part-00000.parquet",
    )


def test_empty_part_file(run_dir):
    first_part(run_dir, "cycles").write_bytes(b"")
    _expect(run_dir, "cycles", None, "cannot read Parquet data", "cycles/part-00000.parquet")


def test_missing_column(run_dir):
    edit_part(first_part(run_dir, "nodes"), lambda t: t.drop_columns(["parent"]))
    _expect(run_dir, "nodes", None, r"missing required column 'parent' \(an integer type: parent node id")


def test_wrong_column_type(run_dir):
    def to_string(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index("token_id")
        return t.set_column(i, "token_id", t.column("token_id").cast(pa.string()))

    edit_part(first_part(run_dir, "nodes"), to_string)
    _expect(run_dir, "nodes", None, "column 'token_id' has type string, expected an integer type")


def test_out_of_range_expert_id(run_dir):
    def bad_expert(t: pa.Table) -> pa.Table:
        values = t.column("expert_ids").to_pylist()
        values[17][3] = 9  # row 17, layer 1, slot 1
        i = t.schema.get_field_index("expert_ids")
        return t.set_column(i, t.schema.field(i), pa.array(values, type=t.schema.field(i).type))

    edit_part(first_part(run_dir, "nodes"), bad_expert)
    _expect(run_dir, "nodes", 17, r"expert id 9 >= experts per layer 8 \(layer 1, slot 1\)")


def test_repeated_expert_within_a_layer(run_dir):
    def repeat(t: pa.Table) -> pa.Table:
        values = t.column("expert_ids").to_pylist()
        values[2][1] = values[2][0]
        i = t.schema.get_field_index("expert_ids")
        return t.set_column(i, t.schema.field(i), pa.array(values, type=t.schema.field(i).type))

    edit_part(first_part(run_dir, "prefill"), repeat)
    _expect(run_dir, "prefill", 2, "expert ids repeat within layer 0")


def _swap_router_weights(t: pa.Table, row: int, a: int, b: int) -> pa.Table:
    values = t.column("router_weights").to_pylist()
    values[row][a], values[row][b] = values[row][b], values[row][a]
    i = t.schema.get_field_index("router_weights")
    return t.set_column(i, t.schema.field(i), pa.array(values, type=t.schema.field(i).type))


@pytest.mark.parametrize("table, row", [("nodes", 20), ("prefill", 3)])
def test_router_weights_not_descending(run_dir, table, row):
    """The format stores each layer's choices in descending router weight; the validator enforces it."""
    edit_part(first_part(run_dir, table), lambda t: _swap_router_weights(t, row, 2, 3))  # layer 1's 2 slots
    _expect(run_dir, table, row, r"router weights of layer 1 are not in descending order")


def test_inspect_validate_reports_unsorted_router_weights(run_dir, capsys):
    from traces.inspect import main

    edit_part(first_part(run_dir, "nodes"), lambda t: _swap_router_weights(t, 7, 0, 1))
    with pytest.raises(SystemExit) as info:  # bad input: exit 2 (CLI contract)
        main([str(run_dir), "--validate"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "table 'nodes' row 7" in err and "router weights of layer 0 are not in descending order" in err
    assert json.loads(out.strip().splitlines()[-1])["ok"] is False


def test_orphan_node(run_dir):
    _edit(run_dir, "nodes", "parent", 9, 5)  # node 3 of tree (0, 1) points at a later node
    _expect(
        run_dir, "nodes", 9, r"tree \(request 0, position 1\): orphan node 3: parent 5 is not an earlier node"
    )


def test_second_root(run_dir):
    _edit(run_dir, "nodes", "parent", 8, -1)
    _expect(run_dir, "nodes", 8, "node 2 is a second root; exactly one root per tree")


def test_depth_not_parent_depth_plus_one(run_dir):
    _edit(run_dir, "nodes", "depth", 10, 5)
    _expect(run_dir, "nodes", 10, r"node 4 depth 5, expected 2 \(parent depth \+ 1\)")


def test_accepted_flag_inconsistent_with_tokens(run_dir):
    _edit(run_dir, "nodes", "accepted", 14, True)  # tree (0, 2) node 2 does not carry the target's token
    _expect(run_dir, "nodes", 14, "node 2 accepted=True, expected False")


def test_duplicate_tree(run_dir):
    for row in range(12, 18):  # tree (0, 2) relabelled as position 1: two trees at (0, 1)
        _edit(run_dir, "nodes", "position", row, 1)
    _expect(
        run_dir, "nodes", 12, r"tree \(request 0, position 1\): node_id 0 again .* the tree appears twice"
    )


def test_duplicate_tree_in_another_part(run_dir):
    manifest = run_dir / "manifest.json"  # a trace from before table_counts: the value check must catch it
    manifest.write_text(
        json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "table_counts"})
    )
    part = first_part(run_dir, "nodes")
    shutil.copy(part, part.with_name("part-00001.parquet"))
    _expect(run_dir, "nodes", 0, r"tree \(request 0, position 0\) appears twice", "nodes/part-00001.parquet")


def test_wrong_manifest_version(run_dir):
    path = run_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["format_version"] = 4
    path.write_text(json.dumps(data))
    _expect(
        run_dir,
        "manifest",
        None,
        "manifest.format_version: this reader supports versions \\[1, 2, 3\\], got 4",
        "manifest.json",
    )


def test_wrong_part_version(run_dir):
    part = first_part(run_dir, "transfers")
    table = pq.read_table(part)
    table = table.replace_schema_metadata({b"specfit_trace_format_version": b"4"})
    pq.write_table(table, part)
    _expect(run_dir, "transfers", None, "written by trace format version 4, this reader supports versions \\[1, 2, 3\\]")


def test_missing_manifest(run_dir):
    (run_dir / "manifest.json").unlink()
    _expect(run_dir, "manifest", None, "manifest.json is missing; not a trace run directory")


def test_manifest_missing_field(run_dir):
    path = run_dir / "manifest.json"
    data = json.loads(path.read_text())
    del data["model"]["top_k"]
    path.write_text(json.dumps(data))
    _expect(run_dir, "manifest", None, "manifest.model.top_k: missing field")


def test_manifest_bad_field_value(run_dir):
    path = run_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["hardware"]["h2d_memory"] = "fast"
    path.write_text(json.dumps(data))
    _expect(run_dir, "manifest", None, r"manifest.hardware: h2d_memory: expected one of \['pinned'")


def test_manifest_not_json(run_dir):
    (run_dir / "manifest.json").write_text("{ not json")
    _expect(run_dir, "manifest", None, "not valid JSON")


def test_missing_run_directory(tmp_path):
    with pytest.raises(TraceError, match="run directory not found"):
        open_run(tmp_path / "nope")


def test_unknown_request_in_a_complete_run(run_dir):
    _edit(run_dir, "cycles", "request_id", 4, 7)
    _expect(run_dir, "cycles", 4, "request_id 7 is not in table 'requests' \\(the run is marked complete\\)")


def test_context_len_disagrees_with_prompt_and_position(run_dir):
    for row in range(6, 12):
        _edit(run_dir, "nodes", "context_len", row, 99)
    _expect(run_dir, "nodes", 6, r"context_len 99, expected prompt length 4 \+ position 1 = 5")


def test_prefill_token_beyond_the_prompt(run_dir):
    _edit(run_dir, "prefill", "token_index", 6, 4)  # request 1 has 4 prompt tokens: 0..3
    _expect(run_dir, "prefill", 6, "token_index 4 >= prompt length 4")


def test_cycle_layer_list_of_wrong_length(run_dir):
    _edit(run_dir, "cycles", "layer_misses", 2, [1, 0])
    _expect(run_dir, "cycles", 2, "layer_misses has 2 values, expected 3")


def test_null_in_required_column(run_dir):
    _edit(run_dir, "cycles", "draft_s", 1, None)
    _expect(run_dir, "cycles", 1, "column 'draft_s' is null; expected a value")


def test_null_inside_a_list(run_dir):
    _edit(run_dir, "cycles", "layer_h2d_s", 4, [1e-6, None, 0.0])
    _expect(run_dir, "cycles", 4, "column 'layer_h2d_s' holds a null inside its list")


def test_more_accepted_than_verified(run_dir):
    _edit(run_dir, "cycles", "num_accepted", 3, 3)
    _expect(run_dir, "cycles", 3, r"num_accepted 3 > num_nodes_verified - 1 = 2")


def test_transfer_expert_out_of_range(run_dir):
    _edit(run_dir, "transfers", "expert", 5, 9)
    _expect(run_dir, "transfers", 5, "expert id 9 >= 8")


def test_lazy_open_still_checks_columns(run_dir):
    edit_part(first_part(run_dir, "requests"), lambda t: t.drop_columns(["source"]))
    run = open_run(run_dir, validate=False)
    with pytest.raises(TraceError, match="missing required column 'source'"):
        _ = run.requests


def test_inspect_validate_exit_codes(run_dir, tmp_path, capsys):
    from traces.inspect import main

    _edit(run_dir, "nodes", "parent", 9, 5)
    with pytest.raises(SystemExit) as info:  # bad input: exit 2 naming file and row (CLI contract)
        main([str(run_dir), "--validate"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "orphan node 3" in err and "nodes/part-00000.parquet: table 'nodes' row 9" in err
    assert len(err.strip().splitlines()) == 1
    assert json.loads(out.strip().splitlines()[-1]) | {"error": None} == {"ok": False, "error": None, "exit_code": 2}
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "absent")])
    assert info.value.code == 2
    assert "run_dir" in capsys.readouterr().err
