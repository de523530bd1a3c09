"""Streaming writer: SIGKILL survival, resume, input errors, the complete flag."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_traces_helpers import random_routing, small_cycle, small_manifest, tree_rows, write_small_run

from traces.reader import open_run
from traces.writer import TraceWriter

ROOT = Path(__file__).resolve().parents[1]

KILLED_WRITER = """
import sys, time
import numpy as np
sys.path.insert(0, {tests!r})
from test_traces_helpers import random_routing, small_cycle, small_manifest, tree_rows
from traces.writer import TraceWriter

rng = np.random.default_rng(0)
generated = np.arange(100, 1100)
writer = TraceWriter({run_dir!r}, small_manifest(), flush_every_rows=12, flush_every_s=1e9)
for rid in range(1000):
    for pos in range(2):
        ids, w = random_routing(rng, 6)
        writer.add_tree(rid, pos, 4 + pos, expert_ids=ids, router_weights=w, **tree_rows(rng, pos, generated))
    writer.add_request(rid, [1, 2, 3, 4], generated[:4], "killed")
    if rid == 3:
        writer.flush()
        print("FLUSHED", flush=True)
    time.sleep(0.002)
"""


def test_sigkill_leaves_every_flushed_part_readable(tmp_path):
    run_dir = tmp_path / "killed"
    script = KILLED_WRITER.format(tests=str(ROOT / "tests"), run_dir=str(run_dir))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "FLUSHED", proc.stderr.read()
        deadline = time.monotonic() + 60
        while len(list((run_dir / "nodes").glob("part-*.parquet"))) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] is False
    run = open_run(run_dir)  # validates every part that was left
    assert not run.complete
    nodes = run.num_rows("nodes")
    assert nodes >= 8 * 12 and nodes % 12 == 0  # only whole parts (2 trees of 6 nodes each)
    assert run.num_rows("requests") >= 4
    finished = set(run.request_ids.tolist())
    assert set(range(4)) <= finished
    trees = {(t.request_id, t.position) for t in run.iter_trees()}
    assert {(r, p) for r in finished for p in range(2)} <= trees  # a request row means its trees are there
    # leftover temp files (if the kill hit a write) are hidden and ignored
    assert all(p.name.startswith("part-") for p in (run_dir / "nodes").glob("*.parquet"))


def _partial_run(run_dir: Path) -> None:
    """Requests 0 and 1 finished; request 2 has trees and a cycle but no requests row (process died)."""
    rng = np.random.default_rng(1)
    generated = np.arange(20, 30)
    writer = TraceWriter(run_dir, small_manifest(), flush_every_rows=10_000)
    for rid in range(3):
        for pos in range(2):
            ids, w = random_routing(rng, 6)
            writer.add_tree(
                rid, pos, 4 + pos, expert_ids=ids, router_weights=w, **tree_rows(rng, pos, generated)
            )
        writer.add_cycle(small_cycle(rid, 0))  # commits 3 tokens
        if rid < 2:
            writer.add_request(rid, [1, 2, 3, 4], generated[:3], "r")
    writer.flush()  # no close(): like a killed process


def test_resume_drops_unfinished_requests_and_continues(tmp_path):
    run_dir = tmp_path / "run"
    _partial_run(run_dir)
    before = open_run(run_dir)
    assert before.unfinished_request_ids.tolist() == [2] and not before.complete
    with TraceWriter(run_dir, small_manifest(), resume=True) as writer:
        assert writer.recorded_request_ids() == {0, 1}
        assert writer.recorded_positions(1) == {0, 1} and writer.recorded_positions(2) == set()
        assert writer.dropped_rows["nodes"] == 12 and writer.dropped_rows["cycles"] == 1
        rng = np.random.default_rng(2)
        generated = np.arange(20, 30)
        for pos in range(2):
            ids, w = random_routing(rng, 6)
            writer.add_tree(
                2, pos, 4 + pos, expert_ids=ids, router_weights=w, **tree_rows(rng, pos, generated)
            )
        writer.add_cycle(small_cycle(2, 0))
        writer.add_request(2, [1, 2, 3, 4], generated[:3], "r")
        with pytest.raises(ValueError, match="request_id 1 already recorded"):
            writer.add_request(1, [1], [2], "dup")
    run = open_run(run_dir)
    assert run.complete
    assert run.request_ids.tolist() == [0, 1, 2]
    assert run.num_rows("nodes") == 36 and run.num_rows("cycles") == 3
    parts = sorted(p.name for p in (run_dir / "nodes").glob("part-*.parquet"))
    assert parts == ["part-00000.parquet", "part-00001.parquet"]  # numbering continued
    assert len(run.manifest.resumed_at) == 1
    assert run.manifest.created_at == before.manifest.created_at


def test_resume_refuses_another_model(tmp_path):
    run_dir = write_small_run(tmp_path / "run")
    manifest = small_manifest()
    other = manifest.replace(model=dataclasses.replace(manifest.model, num_experts=16))
    with pytest.raises(ValueError, match=r"num_experts: stored 8, given 16"):
        TraceWriter(run_dir, other, resume=True)


def test_new_writer_refuses_a_non_empty_directory_and_resume_needs_a_manifest(tmp_path):
    run_dir = write_small_run(tmp_path / "run")
    with pytest.raises(FileExistsError, match="not empty"):
        TraceWriter(run_dir, small_manifest())
    with pytest.raises(FileNotFoundError, match="no manifest"):
        TraceWriter(tmp_path / "empty", small_manifest(), resume=True)


def test_exception_in_with_block_leaves_run_incomplete(tmp_path):
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "run", small_manifest()) as writer:
            writer.add_request(0, [1], [2], "x")
            raise RuntimeError("boom")
    run = open_run(tmp_path / "run")
    assert not run.complete and run.request_ids.tolist() == [0]


def test_flush_every_rows_writes_parts_as_it_goes(tmp_path):
    rng = np.random.default_rng(0)
    writer = TraceWriter(tmp_path / "run", small_manifest(), flush_every_rows=12)
    generated = np.arange(10)
    for pos in range(5):
        ids, w = random_routing(rng, 6)
        writer.add_tree(0, pos, 4 + pos, expert_ids=ids, router_weights=w, **tree_rows(rng, pos, generated))
    assert len(list((tmp_path / "run" / "nodes").glob("part-*.parquet"))) == 2
    assert writer.rows_buffered["nodes"] == 6
    writer.close()
    assert len(list((tmp_path / "run" / "nodes").glob("part-*.parquet"))) == 3


def test_every_finished_request_is_on_disk_and_parts_stay_few(tmp_path):
    """add_request flushes (a kill loses at most the request in progress); the flushes rewrite
    each table's last part until it holds flush_every_rows rows, so parts do not pile up."""
    rng = np.random.default_rng(0)
    generated = np.arange(20, 30)
    run_dir = tmp_path / "run"
    writer = TraceWriter(run_dir, small_manifest(), flush_every_rows=30, flush_every_s=1e9)
    for rid in range(12):
        for pos in range(2):
            ids, w = random_routing(rng, 6)
            writer.add_tree(
                rid, pos, 4 + pos, expert_ids=ids, router_weights=w, **tree_rows(rng, pos, generated)
            )
        writer.add_cycle(small_cycle(rid, 0))
        writer.add_request(rid, [1, 2, 3, 4], generated[:3], "r")
        assert sum(writer.rows_buffered.values()) == 0
        on_disk = open_run(run_dir)  # no close(): what a killed process would leave
        assert on_disk.request_ids.tolist() == list(range(rid + 1))
        assert on_disk.num_rows("nodes") == 12 * (rid + 1) and on_disk.num_rows("cycles") == rid + 1
    # 144 node rows in parts of >= 30 rows (the tail part was rewritten, not multiplied): 4 parts;
    # 12 request and cycle rows: one part each
    assert len(list((run_dir / "nodes").glob("part-*.parquet"))) == 4
    assert len(list((run_dir / "requests").glob("part-*.parquet"))) == 1
    assert len(list((run_dir / "cycles").glob("part-*.parquet"))) == 1
    writer.close()
    run = open_run(run_dir)
    assert run.complete and run.manifest.table_counts["nodes"] == {"parts": 4, "rows": 144}
    # resuming starts a new part after the kept ones; the kept tail is not rewritten
    with TraceWriter(run_dir, small_manifest(), resume=True) as writer:
        assert writer.recorded_request_ids() == set(range(12))
        writer.add_request(12, [1], [], "r")
    assert len(list((run_dir / "requests").glob("part-*.parquet"))) == 2
    assert open_run(run_dir).request_ids.tolist() == list(range(13))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(expert_ids=a["expert_ids"][:, :2]), r"expert_ids: expected shape \(6, 3, 2\)"),
        (
            lambda a: a["expert_ids"].__setitem__((4, 1, 0), 8),
            r"expert_ids row 4: expert id 8 >= experts per layer 8",
        ),
        (
            lambda a: a["router_weights"].__setitem__((2, 0, 1), np.nan),
            r"router_weights row 2: router weight nan",
        ),
        (lambda a: a.update(accepted=~a["accepted"]), r"row 0: .*accepted=False, expected True"),
        (lambda a: a.update(target_tokens=a["target_tokens"][:3]), r"target_token: expected shape \(6,\)"),
    ],
)
def test_add_tree_rejects_bad_input_naming_it(tmp_path, change, message):
    rng = np.random.default_rng(0)
    args = tree_rows(rng, 0, np.arange(10))
    args["expert_ids"], args["router_weights"] = random_routing(rng, 6)
    change(args)
    with TraceWriter(tmp_path / "run", small_manifest()) as writer:
        with pytest.raises(ValueError, match=message):
            writer.add_tree(0, 0, 4, **args)


def test_duplicate_tree_and_cycle_rejected(tmp_path):
    rng = np.random.default_rng(0)
    args = tree_rows(rng, 0, np.arange(10))
    args["expert_ids"], args["router_weights"] = random_routing(rng, 6)
    with TraceWriter(tmp_path / "run", small_manifest()) as writer:
        writer.add_tree(0, 0, 4, **args)
        with pytest.raises(ValueError, match=r"tree \(request 0, position 0\) already recorded"):
            writer.add_tree(0, 0, 4, **args)
        writer.add_cycle(small_cycle(0, 0))
        with pytest.raises(ValueError, match=r"cycle \(request 0, cycle_index 0\) already recorded"):
            writer.add_cycle(small_cycle(0, 0))
        writer.add_request(0, [1, 2, 3, 4], np.arange(10), "x")
    with TraceWriter(tmp_path / "run", small_manifest(), resume=True) as writer:  # remembered on resume
        with pytest.raises(ValueError, match="already recorded"):
            writer.add_tree(0, 0, 4, **args)


def test_add_cycle_and_transfers_reject_bad_lengths(tmp_path):
    with TraceWriter(tmp_path / "run", small_manifest()) as writer:
        with pytest.raises(ValueError, match=r"layer_misses: expected 3 values \(one per layer\), got 2"):
            writer.add_cycle(small_cycle(0, 0, layer_misses=[1, 2]))
        with pytest.raises(ValueError, match="verified_nodes has 2 ids, num_nodes_verified is 3"):
            writer.add_cycle(small_cycle(0, 0, verified_nodes=[0, 1]))
        with pytest.raises(ValueError, match=r"add_transfers: row 1: experts 9 >= 8"):
            writer.add_transfers(0, 0, [0, 1], [1, 9], 768, [1e-6, 1e-6])
        with pytest.raises(ValueError, match=r"add_transfers: h2d_s: expected shape \(2,\)"):
            writer.add_transfers(0, 0, [0, 1], [1, 2], 768, [1e-6])


def test_cycle_cache_accesses_round_trip_and_bad_ones_are_refused(tmp_path):
    """cycles.layer_accessed / accessed_experts: written, read back (null when not given), checked."""
    run_dir = tmp_path / "run"
    with TraceWriter(run_dir, small_manifest()) as writer:
        writer.add_cycle(
            small_cycle(
                0, 0, layer_accessed=[2, 0, 1], accessed_experts=[1, 5, 7], cache_hits=1, cache_misses=2
            )
        )
        writer.add_cycle(small_cycle(0, 1, position=3, context_len=7))  # not recorded: null
        for changes, message in (
            ({"layer_accessed": [2, 0, 1]}, "both layer_accessed and accessed_experts"),
            ({"layer_accessed": [2, 0, 1], "accessed_experts": [1, 5]}, "has 2 ids, layer_accessed counts 3"),
            (
                {"layer_accessed": [2, 0, 1], "accessed_experts": [5, 1, 7]},
                "layer 0: expected distinct ascending",
            ),
            ({"layer_accessed": [2, 0, 1], "accessed_experts": [1, 5, 8]}, r"layer 2: .* in 0\.\.7"),
            ({"layer_accessed": [3], "accessed_experts": [1, 5, 7]}, "expected 3 values"),
        ):
            with pytest.raises(ValueError, match=message):
                writer.add_cycle(small_cycle(0, 2, **changes))
        writer.add_request(0, [1, 2, 3, 4], [5, 6, 7, 8, 9, 10], "r")
    cycles = open_run(run_dir).cycles
    assert cycles["layer_accessed"][0].tolist() == [2, 0, 1] and cycles["accessed_experts"][0].tolist() == [
        1,
        5,
        7,
    ]
    assert cycles["layer_accessed"][1] is None and cycles["accessed_experts"][1] is None


def test_validation_checks_the_recorded_cache_accesses(tmp_path):
    """A cycle whose layer_accessed does not add up to its hits + misses is reported (row named)."""
    from test_traces_helpers import edit_part, first_part, set_value

    from traces.errors import TraceError

    run_dir = tmp_path / "run"
    with TraceWriter(run_dir, small_manifest()) as writer:
        writer.add_cycle(
            small_cycle(0, 0, layer_accessed=[6, 3, 3], accessed_experts=list(range(6)) + [0, 1, 2] * 2)
        )
        writer.add_request(0, [1, 2, 3, 4], [5, 6, 7], "r")
    open_run(run_dir)  # 12 accesses = cache_hits 10 + cache_misses 2
    edit_part(first_part(run_dir, "cycles"), lambda t: set_value(t, "cache_hits", 0, 9))
    with pytest.raises(TraceError, match="row 0: layer_accessed adds up to other than cache_hits"):
        open_run(run_dir)


def test_cycle_reached_depth_round_trips_is_checked_and_read_with_a_fallback(tmp_path):
    """cycles.reached_depth: written, read back (null when not given), bounded by num_accepted (+1)
    at write and at validation, and traces.stats.cycle_reached_depths bounds the unrecorded rows."""
    from test_traces_helpers import edit_part, first_part, set_value

    from traces.errors import TraceError
    from traces.stats import cycle_reached_depths

    run_dir = tmp_path / "run"
    with TraceWriter(run_dir, small_manifest()) as writer:
        writer.add_cycle(small_cycle(0, 0, reached_depth=2))  # accepted 2: path ended at a verified leaf
        writer.add_cycle(
            small_cycle(0, 1, position=3, context_len=7, num_accepted=1, num_committed=2, reached_depth=2)
        )
        writer.add_cycle(small_cycle(0, 2, position=5, context_len=9, num_accepted=0, num_committed=1))
        for bad in (1, 4):
            with pytest.raises(
                ValueError, match=f"reached_depth {bad}: expected num_accepted \\(2\\) or one more"
            ):
                writer.add_cycle(small_cycle(0, 3, reached_depth=bad))
        writer.add_request(0, [1, 2, 3, 4], [5, 6, 7, 8, 9, 10], "r")
    cycles = open_run(run_dir).cycles
    assert cycles["reached_depth"].isna().tolist() == [False, False, True]
    reached, bounded = cycle_reached_depths(cycles)
    assert reached.tolist() == [2, 2, 1] and bounded == 1  # row 2: min(0 + 1, 2 draft levels)
    reached, bounded = cycle_reached_depths(cycles.drop(columns="reached_depth"))  # an older trace
    assert reached.tolist() == [2, 2, 1] and bounded == 3
    edit_part(first_part(run_dir, "cycles"), lambda t: set_value(t, "reached_depth", 1, 3))
    with pytest.raises(TraceError, match=r"row 1: reached_depth 3: expected num_accepted \(1\) or one more"):
        open_run(run_dir)
