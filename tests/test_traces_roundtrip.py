"""Writer -> reader round trips: exact values, real-shape synthetic traces, tree access paths."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from test_traces_helpers import random_routing, small_cycle, small_manifest, tree_rows, write_small_run

from specfit.shapes import ModelShape, get_model_shape
from traces.reader import open_run, path_accepted
from traces.schema import Manifest
from traces.synthetic import generate_dense_trace
from traces.writer import TraceWriter


def test_small_run_round_trips_every_table(tmp_path):
    rng = np.random.default_rng(5)
    prompt, generated = np.arange(4), np.arange(10, 16)  # two cycles of 3 committed tokens
    rows = tree_rows(rng, 1, generated)
    ids, weights = random_routing(rng, 6)
    pre_ids, pre_w = random_routing(rng, 4)
    with TraceWriter(tmp_path / "run", small_manifest()) as writer:
        writer.add_prefill(3, pre_ids, pre_w)
        writer.add_tree(3, 1, 5, expert_ids=ids, router_weights=weights, **rows)
        writer.add_cycle(small_cycle(3, 0, position=0, context_len=4))
        writer.add_cycle(small_cycle(3, 1, position=3, context_len=7))
        writer.add_transfers(3, 0, [0, 2], [3, 5], 768, [1e-6, 2e-6])
        writer.add_request(3, prompt, generated, "unit")
    run = open_run(tmp_path / "run")
    assert run.complete
    assert run.manifest.model == small_manifest().model
    req = run.requests
    assert req["request_id"].tolist() == [3]
    assert req["prompt_token_ids"][0].tolist() == [0, 1, 2, 3]
    assert req["generated_token_ids"][0].tolist() == [10, 11, 12, 13, 14, 15]
    assert req["source"][0] == "unit"
    np.testing.assert_array_equal(run.prefill_experts(3), pre_ids)
    (dense,) = list(run.iter_trees())
    assert (dense.request_id, dense.position, dense.context_len) == (3, 1, 5)
    assert dense.tree.equals(rows["tree"])
    np.testing.assert_array_equal(dense.target_tokens, rows["target_tokens"])
    np.testing.assert_array_equal(dense.accepted, rows["accepted"])
    np.testing.assert_array_equal(dense.expert_ids, ids)
    assert dense.expert_ids.dtype == np.int16 and dense.expert_ids.shape == (6, 3, 2)
    np.testing.assert_allclose(dense.router_weights, weights, rtol=1e-3)  # stored as float16
    assert dense.num_accepted == 2  # nodes 1 and 3 carry the true tokens
    cycles = run.cycles
    assert cycles["num_committed"].tolist() == [3, 3]
    assert cycles["verified_nodes"][0].tolist() == [0, 1, 3]
    assert cycles["layer_h2d_bytes"][1].tolist() == [768, 0, 768]
    assert cycles["predicted_cycle_s"][0] == pytest.approx(5e-3)
    assert np.isnan(cycles["predicted_cycle_s"][1])  # None without a planner
    assert cycles["committed_token_ids"][0].tolist() == [1, 2, 3]
    transfers = run.transfers
    assert transfers["expert"].tolist() == [3, 5] and transfers["bytes"].tolist() == [768, 768]
    assert transfers["h2d_s"].tolist() == pytest.approx([1e-6, 2e-6])


def test_manifest_json_round_trip_and_complete_flag(tmp_path):
    run_dir = write_small_run(tmp_path / "run")
    data = json.loads((run_dir / "manifest.json").read_text())
    assert data["format"] == "specfit-trace" and data["format_version"] == 3
    assert data["complete"] is True
    assert data["hardware"]["emulated_bandwidth_bytes_per_s"] == 16e9
    assert data["run"]["tree_policy"] == "specfit" and data["run"]["cache_capacity_per_layer"] == 4
    assert data["model"]["bytes_per_expert"] == 768 and data["model"]["dtype"] == "bfloat16"
    assert {"python", "numpy", "pyarrow"} <= set(data["software"])
    assert Manifest.from_dict(data) == open_run(run_dir).manifest


@pytest.mark.parametrize(
    ("shape_name", "stored"),
    [("qwen3-30b-a3b", pa.uint8()), ("mixtral-8x7b", pa.uint8())],
)
def test_real_shape_synthetic_round_trip(tmp_path, shape_name, stored):
    shape = get_model_shape(shape_name)
    out = generate_dense_trace(
        tmp_path / shape_name,
        shape,
        num_requests=2,
        positions_per_request=6,
        prompt_len=5,
        max_nodes=16,
        seed=3,
    )
    run = open_run(out)
    assert run.complete and run.manifest.model.to_shape() == shape
    assert run.manifest.run.mode == "dense" and run.manifest.draft.max_nodes == 16
    assert run.arrow("nodes").schema.field("expert_ids").type.value_type == stored
    trees = list(run.iter_trees())
    assert [(t.request_id, t.position) for t in trees] == [(r, p) for r in range(2) for p in range(6)]
    for dense in trees:
        assert dense.tree.num_nodes == 16
        assert dense.expert_ids.shape == (16, shape.num_layers, shape.top_k)
        assert dense.expert_ids.max() < shape.num_experts
        np.testing.assert_allclose(dense.router_weights.sum(axis=2), 1.0, atol=5e-3)
        assert np.all(np.diff(dense.router_weights, axis=2) <= 1e-3)  # sorted by weight
    assert run.prefill_experts(1).shape == (5, shape.num_layers, shape.top_k)
    lengths = run.prompt_lengths()
    assert lengths == {0: 5, 1: 5}
    assert len(run.requests["generated_token_ids"][0]) == 6 + 6  # positions + tree depth


def test_int16_storage_above_256_experts(tmp_path):
    shape = ModelShape("wide", 2, 300, 4, 8, 8, 100)
    run = open_run(
        generate_dense_trace(tmp_path / "w", shape, num_requests=1, positions_per_request=3, max_nodes=8)
    )
    assert run.arrow("nodes").schema.field("expert_ids").type.value_type == pa.int16()
    assert run.node_arrays().expert_ids.max() >= 256  # ids above uint8 survive


def test_synthetic_routes_accepted_path_like_committed_tokens(tmp_path):
    """A depth-d node on the accepted path of tree p routes like the root of tree p+d."""
    out = generate_dense_trace(
        tmp_path / "s", "olmoe-1b-7b", num_requests=1, positions_per_request=30, acceptance=0.9, seed=1
    )
    trees = {t.position: t for t in open_run(out).iter_trees()}
    checked = 0
    for p, dense in trees.items():
        on_path = dense.path_accepted
        for v in np.flatnonzero(on_path)[1:]:
            d = int(dense.tree.depths[v])
            if p + d in trees:
                np.testing.assert_array_equal(dense.expert_ids[v], trees[p + d].expert_ids[0])
                assert dense.tree.token_ids[v] == trees[p + d].tree.token_ids[0]
                checked += 1
        rejected = np.flatnonzero(~dense.accepted)
        if rejected.size and p + 1 in trees:  # rejected nodes do not copy the committed routing
            assert not all(np.array_equal(dense.expert_ids[v], trees[p + 1].expert_ids[0]) for v in rejected)
    assert checked > 20


def test_synthetic_is_seeded_and_knobs_move_the_statistics(tmp_path):
    from traces.stats import accepted_lengths, expert_union_growth

    def make(name, **kw):
        params = dict(num_requests=1, positions_per_request=40, max_nodes=16, seed=7)
        params.update(kw)
        return open_run(generate_dense_trace(tmp_path / name, SMALL_SHAPE_64, **params)).node_arrays()

    a, b, c = make("a"), make("b"), make("c", seed=8)
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    np.testing.assert_array_equal(a.token_id, b.token_id)
    assert not np.array_equal(a.expert_ids, c.expert_ids)
    assert accepted_lengths(make("acc0", acceptance=0.0)).max() == 0
    assert accepted_lengths(make("acc1", acceptance=1.0)).mean() > 2.5
    uniform = expert_union_growth(make("u", routing_skew=0.0), 64, [16])[16]
    skewed = expert_union_growth(make("k", routing_skew=3.0), 64, [16])[16]
    local = expert_union_growth(make("l", expert_locality=0.95), 64, [16])[16]
    assert skewed < uniform - 5
    assert local < uniform - 5


SMALL_SHAPE_64 = ModelShape("mid", 4, 64, 4, 8, 8, 100)


def test_node_arrays_and_tree_order_when_parts_are_out_of_order(tmp_path):
    rng = np.random.default_rng(0)
    generated = np.arange(50, 60)
    with TraceWriter(tmp_path / "r", small_manifest(), flush_every_rows=1) as writer:
        for rid, pos in [(1, 0), (0, 1), (0, 0), (1, 1)]:  # written out of order, one part per tree
            ids, w = random_routing(rng, 6)
            writer.add_tree(
                rid, pos, 4 + pos, expert_ids=ids, router_weights=w, **tree_rows(rng, pos, generated)
            )
        for rid in (0, 1):
            writer.add_request(rid, [1, 2, 3, 4], generated, "t")
    run = open_run(tmp_path / "r")
    assert len(list((tmp_path / "r" / "nodes").glob("part-*.parquet"))) == 4
    order = [(t.request_id, t.position) for t in run.iter_trees()]
    assert order == [(0, 0), (0, 1), (1, 0), (1, 1)]
    arrays = run.node_arrays()
    assert arrays.offsets.tolist() == [0, 6, 12, 18, 24]
    one = run.node_arrays(request_id=1)
    assert one.num_trees == 2 and one.positions.tolist() == [0, 1]
    np.testing.assert_array_equal(one.expert_ids, arrays.expert_ids[12:])
    flat = arrays.path_accepted()
    for i, dense in enumerate(run.iter_trees()):
        np.testing.assert_array_equal(flat[arrays.offsets[i] : arrays.offsets[i + 1]], dense.path_accepted)
    assert [t.position for t in run.iter_trees(request_id=0)] == [0, 1]


def test_path_accepted_needs_every_ancestor():
    parents = np.array([-1, 0, 1, 2, 0])
    accepted = np.array([True, False, True, True, True])
    assert path_accepted(parents, accepted).tolist() == [True, False, False, False, True]


def test_inspect_summary_figures(tmp_path, capsys):
    from traces.inspect import main

    run_dir = write_small_run(tmp_path / "run")
    assert main([str(run_dir), "--validate"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["valid"] is True
    assert summary["num_requests"] == 2 and summary["num_trees"] == 6 and summary["num_nodes"] == 36
    assert summary["full_tree_tau"] == pytest.approx(3.0)  # nodes 1 and 3 accepted in every tree
    assert summary["depth_acceptance"] == [1.0, 1.0]
    assert summary["num_cycles"] == 6 and summary["cycle_tau"] == pytest.approx(3.0)
    assert summary["cache_hit_rate"] == pytest.approx(10 / 12)
    assert summary["h2d_bytes"] == 6 * 2 * 768
    assert summary["num_transfers"] == 12 and summary["transfer_bytes"] == 12 * 768
    assert summary["expert_union"]["1"] == pytest.approx(2.0)  # one node: top-k experts per layer
    assert 2.0 < summary["expert_union"]["4"] <= 8.0


def test_inspect_policy_run_without_trees(tmp_path, capsys):
    from traces.inspect import main

    with TraceWriter(tmp_path / "pol", small_manifest()) as writer:
        for i in range(3):
            writer.add_cycle(small_cycle(0, i, num_accepted=i, num_committed=i + 1))
        writer.add_request(0, [1, 2, 3, 4], [5, 6, 7, 8, 9, 10], "x")
    assert main([str(tmp_path / "pol")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_trees"] == 0 and summary["full_tree_tau"] is None and summary["expert_union"] == {}
    assert summary["cycle_tau"] == pytest.approx(2.0) and summary["num_cycles"] == 3


def test_stats_accepted_lengths_match_per_tree_walk(tmp_path):
    from traces.stats import accepted_lengths, depth_acceptance

    run = open_run(
        generate_dense_trace(tmp_path / "s", SMALL_SHAPE_64, num_requests=2, positions_per_request=20)
    )
    lengths = accepted_lengths(run.node_arrays())
    assert lengths.tolist() == [t.num_accepted for t in run.iter_trees()]
    rates = depth_acceptance(lengths, 6)
    assert rates[0] == pytest.approx((lengths >= 1).mean())
    assert all(0.0 <= r <= 1.0 for r in rates if r == r)


def _next_layer_guesses(rng, rows: int, num_layers: int = 3, top_k: int = 2, num_experts: int = 8):
    """int[rows, L-1, K] distinct ids per layer, as a router's top-k gives them."""
    return np.stack(
        [[rng.permutation(num_experts)[:top_k] for _ in range(num_layers - 1)] for _ in range(rows)]
    )


def test_next_layer_guesses_round_trip_and_old_traces_read_without_them(tmp_path):
    rng = np.random.default_rng(7)
    generated = np.arange(10, 16)
    rows = tree_rows(rng, 1, generated)
    ids, weights = random_routing(rng, 6)
    pre_ids, pre_w = random_routing(rng, 4)
    guesses, pre_guesses = _next_layer_guesses(rng, 6), _next_layer_guesses(rng, 4)
    with TraceWriter(tmp_path / "new", small_manifest("dense")) as writer:
        writer.add_prefill(3, pre_ids, pre_w, pre_guesses)
        writer.add_tree(3, 1, 5, expert_ids=ids, router_weights=weights, next_layer_expert_ids=guesses, **rows)
        writer.add_request(3, np.arange(4), generated, "unit")
    run = open_run(tmp_path / "new")
    assert run.has_next_layer_guesses
    (dense,) = list(run.iter_trees())
    np.testing.assert_array_equal(dense.next_layer_expert_ids, guesses)
    np.testing.assert_array_equal(run.prefill_next_layer_experts(3), pre_guesses)
    with TraceWriter(tmp_path / "old", small_manifest("dense")) as writer:  # written without them
        writer.add_prefill(3, pre_ids, pre_w)
        writer.add_tree(3, 1, 5, expert_ids=ids, router_weights=weights, **rows)
        writer.add_request(3, np.arange(4), generated, "unit")
    old = open_run(tmp_path / "old")
    assert not old.has_next_layer_guesses
    assert next(old.iter_trees()).next_layer_expert_ids is None
    assert old.prefill_next_layer_experts(3) is None
    bad = guesses.copy()
    bad[0, 1] = [4, 4]  # a router's top-k never repeats an expert
    with TraceWriter(tmp_path / "bad", small_manifest("dense")) as writer:
        with pytest.raises(ValueError, match="next_layer_expert_ids row 0"):
            writer.add_tree(3, 1, 5, expert_ids=ids, router_weights=weights, next_layer_expert_ids=bad, **rows)


def test_a_part_with_next_layer_guesses_for_some_rows_only_is_named(tmp_path):
    from test_traces_helpers import edit_part, first_part

    from traces.errors import TraceError

    rng = np.random.default_rng(8)
    rows = tree_rows(rng, 1, np.arange(10, 16))
    ids, weights = random_routing(rng, 6)
    with TraceWriter(tmp_path / "run", small_manifest("dense")) as writer:
        writer.add_tree(3, 1, 5, expert_ids=ids, router_weights=weights, next_layer_expert_ids=_next_layer_guesses(rng, 6), **rows)
    part = first_part(tmp_path / "run", "nodes")

    def null_row_2(table: pa.Table) -> pa.Table:
        column = table.column("next_layer_expert_ids").combine_chunks()
        values = column.to_pylist()
        values[2] = None
        index = table.schema.get_field_index("next_layer_expert_ids")
        return table.set_column(index, table.schema.field(index), pa.array(values, type=column.type))

    edit_part(part, null_row_2)
    with pytest.raises(TraceError, match="next_layer_expert_ids' is null in some rows only"):
        open_run(tmp_path / "run")
