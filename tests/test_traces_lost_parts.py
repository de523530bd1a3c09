"""Lost rows: a deleted, emptied or replaced part is reported by the reader, naming the run, the
table and what is missing (part numbering, ``manifest.table_counts``, cross-table consistency).

The shipped sample (``traces/samples/default``, dense, format v3): 24 requests of 48 generated
tokens, one cycle per token (cycles in one part), 5 ``nodes`` parts (the last one holds requests
20-23 whole), 25 ``transfers`` parts. Its manifest records ``table_counts``; the ``sample``
fixture drops them, as in a trace written before they existed, so the checks that need no
manifest field (part numbering, cross-table consistency) are exercised on their own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from test_traces_helpers import random_routing, small_cycle, small_manifest, tree_rows, write_small_run

from traces.errors import TraceError
from traces.inspect import main as inspect_main
from traces.reader import open_run
from traces.writer import TraceWriter

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "default"


@pytest.fixture
def sample(tmp_path) -> Path:
    run_dir = Path(shutil.copytree(SAMPLE, tmp_path / "sample"))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    del manifest["table_counts"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return run_dir


def _filter_part(path: Path, keep) -> None:
    data = pq.read_table(path)
    pq.write_table(data.filter(keep(data)), path)


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _expect(run_dir: Path, table: str, pattern: str, *, validate: bool = True) -> TraceError:
    with pytest.raises(TraceError, match=pattern) as info:
        open_run(run_dir, validate=validate)
    assert info.value.table == table
    assert str(run_dir) in str(info.value) and f"table '{table}'" in str(info.value)
    return info.value


def test_the_sample_validates_with_and_without_table_counts(sample, tmp_path):
    run = open_run(sample)
    assert run.manifest.table_counts is None and not run.manifest.resumed_at
    assert run.num_rows("cycles") == 1152 and len(run.request_ids) == 24
    shipped = open_run(SAMPLE)
    assert shipped.manifest.table_counts["nodes"] == {"parts": 5, "rows": 41259}
    assert shipped.manifest.table_counts["transfers"] == {"parts": 25, "rows": 323724}
    copy = Path(shutil.copytree(SAMPLE, tmp_path / "shipped"))
    (copy / "transfers" / "part-00024.parquet").unlink()  # the last part: only table_counts tells
    _expect(copy, "transfers", r"part-00024\.parquet missing: manifest\.table_counts records 25 parts, found 24")


def test_deleted_middle_part_is_named_even_without_validation(sample, capsys):
    (sample / "nodes" / "part-00002.parquet").unlink()
    pattern = r"part-00002\.parquet missing: part numbers jump from 00001 to 00003"
    err = _expect(sample, "nodes", pattern)
    assert err.file == str(sample / "nodes") and err.row is None
    _expect(sample, "nodes", pattern, validate=False)  # sim.cells opens lazily: it must fail too
    with pytest.raises(SystemExit) as exc:  # bad input: exit 2 naming the file (CLI contract)
        inspect_main([str(sample), "--validate"])
    assert exc.value.code == 2
    assert "part-00002.parquet missing" in capsys.readouterr().err


def test_deleted_first_parts_are_named(sample):
    for index in (0, 1):
        (sample / "transfers" / f"part-{index:05d}.parquet").unlink()
    _expect(
        sample,
        "transfers",
        r"part-00000\.parquet \.\. part-00001\.parquet missing: part numbers start at 00002",
    )


def test_deleted_last_nodes_part_leaves_cycles_without_trees(sample):
    (sample / "nodes" / "part-00004.parquet").unlink()
    err = _expect(sample, "nodes", r"request 20 positions 0-47 have cycles but no tree")
    assert "192 of 1152 cycles" in str(err) and "3 more requests" in str(err)


def test_cycles_cut_off_at_the_end_of_a_request(sample):
    _filter_part(
        sample / "cycles" / "part-00000.parquet",
        lambda t: pc.invert(pc.and_(pc.equal(t["request_id"], 5), pc.greater_equal(t["cycle_index"], 10))),
    )
    _expect(
        sample,
        "cycles",
        r"request 5: its 10 cycles commit 10 tokens, its requests row has 48 generated tokens",
    )


def test_cycles_missing_in_the_middle_of_a_request(sample):
    _filter_part(
        sample / "cycles" / "part-00000.parquet",
        lambda t: pc.invert(
            pc.and_(pc.equal(t["request_id"], 7), pc.is_in(t["cycle_index"], value_set=pa_ints([3, 4, 5, 9])))
        ),
    )
    _expect(sample, "cycles", r"request 7 cycle_index 3-5, 9 missing \(has 44 cycles up to cycle_index 47")


def test_all_cycles_of_a_request_missing(sample):
    _filter_part(
        sample / "cycles" / "part-00000.parquet",
        lambda t: pc.invert(pc.is_in(t["request_id"], value_set=pa_ints([2, 3]))),
    )
    _expect(
        sample, "cycles", r"finished request\(s\) 2-3 have generated tokens but no cycles \(2 of 24 requests"
    )


def test_position_chain_broken(sample):
    path = sample / "cycles" / "part-00000.parquet"
    data = pq.read_table(path)
    position = data["position"].to_numpy().copy()
    row = int(np.flatnonzero((data["request_id"].to_numpy() == 4) & (data["cycle_index"].to_numpy() == 6))[0])
    position[row] += 1
    context = data["context_len"].to_numpy().copy()
    context[row] += 1  # keep context_len = prompt + position so only the chain is wrong
    data = data.set_column(data.schema.get_field_index("position"), "position", pa_ints(position, "int32"))
    data = data.set_column(
        data.schema.get_field_index("context_len"), "context_len", pa_ints(context, "int32")
    )
    pq.write_table(data, path)
    _expect(sample, "cycles", r"request 4 cycle_index 6 has position 7, expected 6")


def test_transfer_naming_a_missing_cycle_points_at_its_row(tmp_path):
    with TraceWriter(tmp_path / "other", small_manifest()) as writer:  # transfers of a cycle 7 that never ran
        writer.add_cycle(small_cycle(0, 0, position=0, context_len=4))
        writer.add_transfers(0, 7, [1], [2], 768, [1e-6])
        writer.add_request(0, [1, 2, 3, 4], [5, 6, 7], "x")
    err = _expect(tmp_path / "other", "transfers", r"request 0 cycle_index 7 has no row in table 'cycles'")
    assert err.row == 0 and err.file.endswith("transfers/part-00000.parquet")


def test_writer_records_table_counts_and_lost_last_part_is_found(tmp_path):
    run_dir = write_small_run(tmp_path / "run", flush_every_rows=4)
    counts = _manifest(run_dir)["table_counts"]
    run = open_run(run_dir)
    for table, entry in counts.items():
        assert entry == {
            "parts": len(list((run_dir / table).glob("part-*.parquet"))),
            "rows": run.num_rows(table),
        }
    assert counts["transfers"]["parts"] > 1
    last = counts["transfers"]["parts"] - 1
    (run_dir / "transfers" / f"part-{last:05d}.parquet").unlink()  # no gap: only table_counts tells
    _expect(
        run_dir,
        "transfers",
        rf"part-{last:05d}\.parquet missing: manifest\.table_counts records {last + 1} parts, found {last}",
    )


def test_replaced_part_with_fewer_rows_is_found(tmp_path):
    run_dir = write_small_run(tmp_path / "run")
    _filter_part(run_dir / "prefill" / "part-00000.parquet", lambda t: pc.less(t["token_index"], 2))
    _expect(run_dir, "prefill", r"parts hold 4 rows, manifest\.table_counts records 8")


def test_bad_table_counts_field_is_named(tmp_path):
    run_dir = write_small_run(tmp_path / "run")
    manifest = _manifest(run_dir)
    manifest["table_counts"]["nodes"]["rows"] = -3
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    _expect(run_dir, "manifest", r"manifest\.table_counts\.nodes\.rows: expected an integer >= 0, got -3")


def _killed_with_request_2_in_its_own_parts(run_dir: Path) -> None:
    rng = np.random.default_rng(3)
    generated = np.arange(20, 23)
    # requests 0 and 1 fill the first nodes part (12 rows): request 2's trees go to a part of their own
    writer = TraceWriter(run_dir, small_manifest(), flush_every_rows=12)
    for rid in range(3):
        ids, w = random_routing(rng, 6)
        writer.add_tree(rid, 0, 4, expert_ids=ids, router_weights=w, **tree_rows(rng, 0, generated))
        writer.add_cycle(small_cycle(rid, 0))
        if rid < 2:
            writer.add_request(rid, [1, 2, 3, 4], generated, "r")
    writer.flush()  # no close(): killed


def test_resume_keeps_an_emptied_part_so_numbering_stays_gap_free(tmp_path):
    run_dir = tmp_path / "run"
    _killed_with_request_2_in_its_own_parts(run_dir)
    assert sorted(p.name for p in (run_dir / "nodes").glob("part-*")) == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    with TraceWriter(run_dir, small_manifest(), resume=True) as writer:
        assert writer.dropped_rows["nodes"] == 6
    assert pq.read_metadata(run_dir / "nodes" / "part-00001.parquet").num_rows == 0
    run = open_run(run_dir)
    assert run.manifest.table_counts["nodes"] == {"parts": 2, "rows": 12}
    (run_dir / "nodes" / "part-00001.parquet").unlink()
    _expect(run_dir, "nodes", r"part-00001\.parquet missing: manifest\.table_counts records 2 parts, found 1")


def test_old_resumed_run_with_a_gap_still_opens(tmp_path):
    """Writers before table_counts deleted a part that a resume emptied: such runs stay readable."""
    run_dir = write_small_run(tmp_path / "run", flush_every_rows=4)
    manifest = _manifest(run_dir)
    del manifest["table_counts"]
    manifest["resumed_at"] = ["2026-01-01T00:00:00Z"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    empty = run_dir / "nodes" / "part-00001.parquet"
    data = pq.read_table(empty)
    pq.write_table(data.slice(0, 0), empty)
    open_run(run_dir)  # the emptied part was harmless ...
    empty.unlink()
    assert open_run(run_dir).num_rows("nodes") == 30  # ... and so is its absence
    manifest["resumed_at"] = []
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    _expect(run_dir, "nodes", r"part-00001\.parquet missing")  # never resumed: a gap is a lost part


def pa_ints(values, type_name: str = "int64"):
    import pyarrow as pa

    return pa.array(np.asarray(values), type=getattr(pa, type_name)())


def test_resume_refuses_a_run_with_a_lost_part(tmp_path):
    run_dir = write_small_run(tmp_path / "run", flush_every_rows=4)
    (run_dir / "nodes" / "part-00002.parquet").unlink()
    with pytest.raises(
        TraceError, match=r"part-00002\.parquet missing: part numbers jump from 00001 to 00003"
    ):
        TraceWriter(run_dir, small_manifest(), resume=True)


def test_resume_restores_parts_an_old_writer_deleted(tmp_path):
    run_dir = write_small_run(tmp_path / "run", flush_every_rows=4)
    manifest = _manifest(run_dir)
    del manifest["table_counts"]  # an old writer resumed it and deleted the part it emptied
    manifest["resumed_at"] = ["2026-01-01T00:00:00Z"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    (run_dir / "nodes" / "part-00001.parquet").unlink()
    with TraceWriter(run_dir, small_manifest(), resume=True):
        pass
    assert pq.read_metadata(run_dir / "nodes" / "part-00001.parquet").num_rows == 0
    run = open_run(run_dir)  # gap-free again, and table_counts agree
    assert run.manifest.table_counts["nodes"] == {"parts": 6, "rows": 30}
