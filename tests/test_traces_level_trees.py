"""Trace format v2's ``nodes.last_level``: dense trees as the union of the draft's per-level trees
(written, read, validated), and format-v1 runs without it still read (issue 13)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from test_traces_helpers import edit_part, first_part, random_routing, set_value, small_manifest, tree_rows

from traces.errors import TraceError
from traces.reader import open_run
from traces.schema import FORMAT_VERSION
from traces.writer import TraceWriter

# tree_rows' tree: parents [-1, 0, 0, 1, 1, 2], depths [0, 1, 1, 2, 2, 2]; 3 levels drafted, node 2
# (and its child 5) pushed out by the third level, whose candidates did not enter
LAST_LEVEL = np.array([3, 3, 2, 3, 3, 2])


def _write(run_dir, last_level, manifest=None) -> None:
    rng = np.random.default_rng(3)
    rows = tree_rows(rng, 1, np.arange(10, 16))
    ids, weights = random_routing(rng, 6)
    with TraceWriter(run_dir, manifest or small_manifest("dense")) as writer:
        writer.add_tree(3, 1, 5, expert_ids=ids, router_weights=weights, last_level=last_level, **rows)
        writer.add_request(3, np.arange(4), np.arange(10, 16), "unit")


def test_last_level_round_trips_and_gives_each_level_tree(tmp_path):
    _write(tmp_path / "run", LAST_LEVEL)
    run = open_run(tmp_path / "run")
    assert run.has_level_trees and run.manifest.format_version == FORMAT_VERSION  # 2 on
    (tree,) = list(run.iter_trees())
    np.testing.assert_array_equal(tree.last_level, LAST_LEVEL)
    np.testing.assert_array_equal(run.node_arrays().select(np.array([0])).last_level, LAST_LEVEL)
    assert tree.num_levels == 3
    levels = {k: tree.level_nodes(k).tolist() for k in range(4)}
    assert levels == {0: [0], 1: [0, 1, 2], 2: [0, 1, 2, 3, 4, 5], 3: [0, 1, 3, 4]}
    from traces.stats import summarize

    assert summarize(run)["num_pushed_out_nodes"] == 2  # nodes 2 and 5
    assert summarize(run)["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize(
    ("last_level", "message"),
    [
        ([3, 3, 2, 3, 3, 3], "last_level 3 > its parent's 2"),
        ([3, 3, 2, 1, 3, 2], "last_level 1 outside \\[depth 2"),
        ([2, 3, 2, 2, 2, 2], "outside \\[depth 1, the root's last_level 2\\]"),
    ],
)
def test_writer_refuses_a_last_level_that_breaks_the_level_trees(tmp_path, last_level, message):
    with pytest.raises(ValueError, match=message):
        _write(tmp_path / "run", np.array(last_level))


def test_a_level_tree_larger_than_max_nodes_is_refused(tmp_path):
    manifest = small_manifest("dense")
    manifest = manifest.replace(draft=dataclasses.replace(manifest.draft, max_nodes=5))
    with pytest.raises(ValueError, match="the tree after level 2 holds 6 nodes, more than max_nodes 5"):
        _write(tmp_path / "run", LAST_LEVEL, manifest)


def test_reader_names_a_bad_last_level_in_a_part(tmp_path):
    _write(tmp_path / "run", LAST_LEVEL)
    edit_part(first_part(tmp_path / "run", "nodes"), lambda t: set_value(t, "last_level", 5, 3))
    with pytest.raises(TraceError, match="row 5: .*last_level 3 > its parent's 2"):
        open_run(tmp_path / "run")


def test_reader_refuses_a_tree_with_last_level_on_some_nodes_only(tmp_path):
    """A tree carries last_level on every node or on none (a resumed v1 run may mix whole trees):
    one null inside a recorded tree is a corrupt part, not a silent fall back to the approximation."""
    _write(tmp_path / "run", LAST_LEVEL)
    edit_part(first_part(tmp_path / "run", "nodes"), lambda t: set_value(t, "last_level", 4, None))
    with pytest.raises(TraceError, match="row 4: .*last_level null .*other nodes of its tree"):
        open_run(tmp_path / "run")


def test_format_v1_runs_read_without_level_trees(tmp_path):
    """A run written before format v2 (no last_level column, version 1 in the manifest and the
    parts) still reads: its trees are the final trees, cut at each depth, and sim names that."""
    from sim.replay import LEVEL_TREE_APPROXIMATION, level_tree_note

    _write(tmp_path / "run", None)
    run_dir = tmp_path / "run"
    for table in ("requests", "prefill", "nodes", "cycles", "transfers"):
        for part in sorted((run_dir / table).glob("part-*.parquet")):

            def as_v1(t: pa.Table) -> pa.Table:
                if "last_level" in t.column_names:
                    t = t.drop_columns(["last_level"])
                return t.replace_schema_metadata({b"specfit_trace_format_version": b"1"})

            edit_part(part, as_v1)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    run = open_run(run_dir)
    assert run.manifest.format_version == 1 and not run.has_level_trees
    (tree,) = list(run.iter_trees())
    assert tree.last_level is None and run.node_arrays().last_level is None
    assert tree.num_levels == 2 and tree.level_nodes(1).tolist() == [0, 1, 2]
    from traces.stats import summarize

    assert summarize(run)["num_pushed_out_nodes"] is None
    assert summarize(run)["format_version"] == 1
    assert level_tree_note(run) == LEVEL_TREE_APPROXIMATION and "approximated" in LEVEL_TREE_APPROXIMATION
    _write(tmp_path / "v2", LAST_LEVEL)
    assert level_tree_note(open_run(tmp_path / "v2")) is None
