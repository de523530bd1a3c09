"""DraftTree, bitsets, the cost model, model shapes and the acceptance estimate."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit import bitsets
from specfit.acceptance import AcceptanceCalibration, path_accept_probs
from specfit.cost import CycleCostModel
from specfit.shapes import MODEL_SHAPES, get_model_shape
from specfit.tree import DraftTree
from specfit.units import gb_per_s_to_bytes_per_s, s_to_ms


# ---- DraftTree ------------------------------------------------------------------------------
def _tree() -> DraftTree:
    return DraftTree.from_parents([9, 4, 5, 6, 7], [-1, 0, 0, 1, 1], np.log([1.0, 0.5, 0.25, 0.5, 0.1]))


def test_tree_derives_depths_and_path_logprobs() -> None:
    tree = _tree()
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert np.allclose(tree.path_probs, [1.0, 0.5, 0.25, 0.25, 0.05])
    assert tree.num_nodes == 5 and tree.num_nodes() == 5
    assert tree.max_depth == 2 and tree.max_depth() == 2
    assert tree.children(1).tolist() == [3, 4] and tree.children(3).tolist() == []
    assert tree.ancestors(4).tolist() == [1, 0] and tree.ancestors(0).tolist() == []
    assert tree.nodes_at_depth(1).tolist() == [1, 2]
    assert tree.is_ancestor_closed([0, 1, 4]) and not tree.is_ancestor_closed([0, 4])
    assert not tree.is_ancestor_closed([]) and not tree.is_ancestor_closed([1])
    sub = tree.subtree([4, 0, 1])
    assert sub.parents.tolist() == [-1, 0, 1] and sub.token_ids.tolist() == [9, 4, 7]
    assert np.allclose(sub.path_logprobs, tree.path_logprobs[[0, 1, 4]])
    with pytest.raises(ValueError, match="ancestor-closed"):
        tree.subtree([0, 3])
    with pytest.raises(ValueError, match="node 7 out of range"):
        tree.children(7)
    with pytest.raises(ValueError, match="read-only"):
        tree.parents[1] = 3


@pytest.mark.parametrize(
    ("parents", "logprobs", "match"),
    [
        ([0, 0], None, "node 0 is the root"),
        ([-1, 1], None, "node 1 has parent 1"),
        ([-1, 0, 3, 0], None, "node 2 has parent 3"),
        ([-1, 0], [0.0, 0.5], "log-probability <= 0"),
        ([-1, 0], [0.0, float("nan")], "not finite"),
        ([-1, 0], [-0.1, -0.1], "root"),
    ],
)
def test_tree_validation_names_field_and_node(parents, logprobs, match) -> None:
    with pytest.raises(ValueError, match=match):
        DraftTree.from_parents(np.zeros(len(parents)), parents, logprobs)


def test_tree_constructor_checks_depths_and_paths() -> None:
    good = _tree()
    with pytest.raises(ValueError, match="DraftTree.depths: node 3"):
        DraftTree(good.token_ids, good.parents, [0, 1, 1, 1, 2], good.draft_logprobs, good.path_logprobs)
    with pytest.raises(ValueError, match="DraftTree.path_logprobs: node 2"):
        DraftTree(
            good.token_ids,
            good.parents,
            good.depths,
            good.draft_logprobs,
            good.path_logprobs + [0, 0, 0.1, 0, 0],
        )
    with pytest.raises(ValueError, match="parents: expected length 4"):
        DraftTree(good.token_ids[:4], good.parents, good.depths, good.draft_logprobs, good.path_logprobs)
    with pytest.raises(ValueError, match="at least the root"):
        DraftTree.from_parents([], [])


# ---- bitsets --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.lists(st.lists(st.integers(-1, 199), max_size=10), min_size=1, max_size=6))
def test_bitsets_match_python_sets(num_experts, rows) -> None:
    width = max(1, max(len(r) for r in rows))
    ids = np.full((len(rows), width), -1)
    for i, r in enumerate(rows):
        r = [e % num_experts if e >= 0 else -1 for e in r]
        ids[i, : len(r)] = r
    bits = bitsets.pack(ids, num_experts)
    sets = [{int(e) for e in row if e >= 0} for row in ids]
    assert bits.shape == (len(rows), bitsets.num_words(num_experts)) and bits.dtype == np.uint64
    assert bitsets.popcount(bits).tolist() == [len(s) for s in sets]
    flags = bitsets.unpack(bits, num_experts)
    assert [set(np.flatnonzero(f).tolist()) for f in flags] == sets
    assert set(bitsets.to_ids(bitsets.union(bits, axis=0), num_experts).tolist()) == set().union(*sets)
    diff = bitsets.difference(bits[0], bits[-1])
    assert set(bitsets.to_ids(diff, num_experts).tolist()) == sets[0] - sets[-1]
    inter = bitsets.intersection(bits[0], bits[-1])
    assert set(bitsets.to_ids(inter, num_experts).tolist()) == sets[0] & sets[-1]


def test_bitsets_layout_and_errors() -> None:
    bits = bitsets.pack(np.array([0, 63, 64, 127]), 128)
    assert bits.tolist() == [(1 << 63) | 1, (1 << 63) | 1]
    assert bitsets.num_words(1) == 1 and bitsets.num_words(64) == 1 and bitsets.num_words(65) == 2
    with pytest.raises(ValueError, match="out of range"):
        bitsets.pack(np.array([8]), 8)
    with pytest.raises(ValueError, match="word"):
        bitsets.union(bits, axis=-1)
    with pytest.raises(ValueError, match="num_experts"):
        bitsets.num_words(0)


# ---- cost model -----------------------------------------------------------------------------
def _cost(**kw) -> CycleCostModel:
    base = {
        "draft_s_per_level": 0.002,
        "verify_base_s": 0.02,
        "verify_s_per_node": 0.001,
        "verify_s_per_context_token": 1e-6,
        "h2d_bytes_per_s": 10e9,
        "h2d_s_per_transfer": 1e-5,
        "expert_bytes": 10_000_000,
        "num_layers": 3,
    }
    base.update(kw)
    return CycleCostModel(**base)


def test_cost_formula_values() -> None:
    cost = _cost()
    assert cost.transfer_s() == pytest.approx(1e-3 + 1e-5)
    assert cost.transfer_s(3) == pytest.approx(3 * 1.01e-3)
    assert cost.draft_s(4) == pytest.approx(0.008)
    assert cost.verify_s(10, 1000) == pytest.approx(0.02 + 0.01 + 0.001)
    assert cost.layer_compute_s(10, 1000) == pytest.approx(0.031 / 3)
    assert cost.h2d_s([1, 0, 2]) == pytest.approx(3 * 1.01e-3)
    assert cost.cycle_s(4, 10, 1000, [1, 0, 2]) == pytest.approx(0.008 + 0.031 + 0.00303)
    over = _cost(overlap_h2d=True)
    assert over.cycle_s(4, 10, 1000, [1, 0, 2]) == pytest.approx(0.008 + 0.031)
    assert over.cycle_s(4, 10, 1000, [40, 0, 0]) == pytest.approx(0.008 + 40 * 1.01e-3)
    assert cost.with_bandwidth(20e9).transfer_s() == pytest.approx(0.5e-3 + 1e-5)
    assert cost.with_expert_bytes(0).transfer_s() == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="3 layers"):
        cost.h2d_s([1, 2])
    for model in (cost, over):
        batch = model.cycle_s_total(4, np.array([1, 10]), 1000, np.array([3, 40]))
        assert batch.tolist() == pytest.approx(
            [model.cycle_s(4, 1, 1000, [3, 0, 0]), model.cycle_s(4, 10, 1000, [40, 0, 0])]
        )
        assert isinstance(model.cycle_s_total(4, 10, 1000, 3), float)
    based = _cost(draft_base_s=0.003)  # paid by a cycle that drafts, whatever its depth
    assert based.draft_s(0) == 0.0 and based.draft_s(1) == pytest.approx(0.005)
    assert based.draft_s(4) == pytest.approx(0.011)
    assert based.cycle_s_total(np.array([0, 4]), 10, 1000, 0).tolist() == pytest.approx(
        [based.cycle_s(0, 10, 1000, [0, 0, 0]), based.cycle_s(4, 10, 1000, [0, 0, 0])]
    )
    assert based.cycle_s(4, 10, 1000, [0, 0, 0]) - cost.cycle_s(4, 10, 1000, [0, 0, 0]) == pytest.approx(0.003)


def test_reference_unit_check_mixtral_expert_at_32_gb_per_s() -> None:
    shape = get_model_shape("Mixtral-8x7B")
    assert shape.bytes_per_expert == 352_321_536
    cost = CycleCostModel.for_shape(shape, bandwidth_gb_per_s=32, h2d_s_per_transfer=0.0)
    assert s_to_ms(cost.transfer_s()) == pytest.approx(11.01, abs=0.005)
    assert cost.h2d_bytes_per_s == gb_per_s_to_bytes_per_s(32)


def test_model_shapes_from_reference_figures() -> None:
    expected = {
        "qwen3-30b-a3b": (48, 128, 8, 9_437_184),
        "mixtral-8x7b": (32, 8, 2, 352_321_536),
        "olmoe-1b-7b": (16, 64, 8, 12_582_912),
        "deepseek-v2-lite": (26, 64, 6, 17_301_504),
    }
    for name, (layers, experts, k, nbytes) in expected.items():
        s = MODEL_SHAPES[name]
        assert (s.num_layers, s.num_experts, s.top_k, s.bytes_per_expert) == (layers, experts, k, nbytes)
    with pytest.raises(ValueError, match="qwen3-30b-a3b"):
        get_model_shape("gpt-4")


def test_cost_json_round_trip_and_errors(tmp_path) -> None:
    cost = _cost(overlap_h2d=True, source="calibration:run1")
    path = cost.save(tmp_path / "sub" / "cost.json")
    assert CycleCostModel.load(path) == cost
    free = _cost(h2d_bytes_per_s=math.inf)
    assert CycleCostModel.from_dict(json.loads(json.dumps(free.to_dict()))) == free
    data = cost.to_dict()
    data["units"]["h2d_bytes_per_s"] = "GB/s"
    (tmp_path / "bad_unit.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad_unit.json.*h2d_bytes_per_s.*GB/s"):
        CycleCostModel.load(tmp_path / "bad_unit.json")
    version_1 = cost.to_dict()  # written before draft_base_s existed
    del version_1["draft_base_s"], version_1["units"]["draft_base_s"]
    version_1["version"] = 1
    with pytest.warns(UserWarning, match="version-1 cost model has no draft_base_s"):
        assert CycleCostModel.from_dict(version_1) == dataclasses.replace(cost, draft_base_s=0.0)
    version_2 = dict(version_1, version=2)  # from version 2 the field is required
    with pytest.raises(ValueError, match="missing field.*draft_base_s"):
        CycleCostModel.from_dict(version_2)
    with pytest.raises(ValueError, match="'version': expected 1..9.*got 10"):
        CycleCostModel.from_dict(dict(cost.to_dict(), version=10))
    # version 2, before the compute stream's share of a miss and the late-expert call: both 0
    version_2 = {k: v for k, v in cost.to_dict().items() if k not in ("host_s_per_transfer", "late_call_s")}
    assert CycleCostModel.from_dict(dict(version_2, version=2)) == cost
    with pytest.raises(ValueError, match="missing field.*host_s_per_transfer"):
        CycleCostModel.from_dict(dict(version_2, version=4))
    # version 3, before pre_router_fraction: 0 (copies enqueued at the layer's start), a warning with overlap on
    version_3 = {k: v for k, v in dataclasses.replace(cost, pre_router_fraction=0.0).to_dict().items() if k != "pre_router_fraction"}
    assert CycleCostModel.from_dict(dict(version_3, version=3)) == dataclasses.replace(cost, pre_router_fraction=0.0)
    with pytest.warns(UserWarning, match="version-3 cost model has no pre_router_fraction"):
        on = CycleCostModel.from_dict(dict(version_3, version=3, overlap_mode="on"))
    assert on.pre_router_fraction == 0.0
    # ... and a note for the tools that set overlap "on" after loading a file that does not say it
    from specfit.cost import no_pre_router_note

    (tmp_path / "v3.json").write_text(json.dumps(dict(version_3, version=3, overlap_h2d=False)))
    assert "version-3 cost model has no pre_router_fraction" in no_pre_router_note(tmp_path / "v3.json")
    (tmp_path / "v3on.json").write_text(json.dumps(dict(version_3, version=3, overlap_h2d=True, overlap_mode="on")))
    assert no_pre_router_note(tmp_path / "v3on.json") is None  # from_dict already warns
    cost.save(tmp_path / "v4.json")
    assert no_pre_router_note(tmp_path / "v4.json") is None and no_pre_router_note(tmp_path / "nope.json") is None
    # the three CLIs' --cost warnings come from one function: each note only where it applies
    from specfit.cost import COST_FIT_REPORT_NAME, cost_file_warnings

    v3 = CycleCostModel.load(tmp_path / "v3.json")
    assert cost_file_warnings(tmp_path / "v3.json", v3) == []  # overlap off, no next-layer prefetch
    notes = cost_file_warnings(tmp_path / "v3.json", v3, overlap=True, next_layer=True)
    assert len(notes) == 2 and "no pre_router_fraction" in notes[0] and "no next-layer prefetch share" in notes[1]
    assert cost_file_warnings(tmp_path / "v3.json", overlap=True, next_layer=True) == notes[:1]  # no model given
    (tmp_path / COST_FIT_REPORT_NAME).write_text(json.dumps({"verdict": {"verdict": "fail", "verdict_line": "p90 40 %"}}))
    failed = cost_file_warnings(tmp_path / "v4.json", consequence="the sweep carries it")
    assert len(failed) == 1 and "FAILED" in failed[0] and failed[0].endswith("(p90 40 %); the sweep carries it")
    with pytest.raises(ValueError, match="missing field.*pre_router_fraction"):
        CycleCostModel.from_dict(dict(version_3, version=4))
    with pytest.raises(ValueError, match="pre_router_fraction: expected a fraction"):
        dataclasses.replace(cost, pre_router_fraction=1.5)
    # version 4, before next-layer prefetch's terms: both 0 (not priced), a note where it matters
    from specfit.cost import no_next_layer_note

    fitted = dataclasses.replace(cost, next_layer_cover_fraction=0.4, next_layer_waste_per_miss=0.25, next_layer_prefetch=True)
    assert CycleCostModel.from_dict(fitted.to_dict()) == fitted
    names = ("next_layer_cover_fraction", "next_layer_waste_per_miss", "next_layer_prefetch")
    version_4 = {k: v for k, v in fitted.to_dict().items() if k not in names}
    assert CycleCostModel.from_dict(dict(version_4, version=4)) == cost
    (tmp_path / "v4old.json").write_text(json.dumps(dict(version_4, version=4)))
    assert "version-4 cost model has no next-layer prefetch share" in no_next_layer_note(tmp_path / "v4old.json")
    assert no_next_layer_note(tmp_path / "v4.json") is None and no_next_layer_note(tmp_path / "nope.json") is None
    with pytest.raises(ValueError, match="missing field.*next_layer_cover_fraction"):
        CycleCostModel.from_dict(dict(version_4, version=5))
    with pytest.raises(ValueError, match="next_layer_cover_fraction: expected a fraction"):
        dataclasses.replace(cost, next_layer_cover_fraction=1.5)
    with pytest.raises(ValueError, match="next_layer_waste_per_miss: expected a finite number >= 0"):
        dataclasses.replace(cost, next_layer_waste_per_miss=-0.1)
    with pytest.raises(ValueError, match="host_s_per_transfer: expected <= h2d_s_per_transfer"):
        dataclasses.replace(cost, host_s_per_transfer=cost.h2d_s_per_transfer + 1e-6)
    # version 8, before the placing after the enqueue: 0 (the whole placing before the enqueue)
    placed = dataclasses.replace(cost, host_s_per_transfer=2e-6, placing_after_enqueue_s_per_transfer=1e-6)
    assert CycleCostModel.from_dict(placed.to_dict()) == placed
    version_8 = {k: v for k, v in placed.to_dict().items() if k != "placing_after_enqueue_s_per_transfer"}
    assert CycleCostModel.from_dict(dict(version_8, version=8)) == dataclasses.replace(
        placed, placing_after_enqueue_s_per_transfer=0.0
    )
    with pytest.raises(ValueError, match="missing field.*placing_after_enqueue_s_per_transfer"):
        CycleCostModel.from_dict(dict(version_8, version=9))
    with pytest.raises(ValueError, match="placing_after_enqueue_s_per_transfer: expected <= host_s_per_transfer"):
        dataclasses.replace(placed, placing_after_enqueue_s_per_transfer=3e-6)
    slower = placed.with_compute_speed(1.5)  # host work: scaled with the per-miss term
    assert slower.placing_after_enqueue_s_per_transfer == pytest.approx(1.5e-6, rel=1e-12)
    data = cost.to_dict()
    data["verify_base_s"] = -1
    with pytest.raises(ValueError, match="verify_base_s"):
        CycleCostModel.from_dict(data)
    data = cost.to_dict()
    del data["num_layers"]
    with pytest.raises(ValueError, match="missing field.*num_layers"):
        CycleCostModel.from_dict(data)
    data = cost.to_dict()
    data["bandwidth"] = 3
    with pytest.raises(ValueError, match="unknown field.*bandwidth"):
        CycleCostModel.from_dict(data)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: invalid JSON"):
        CycleCostModel.load(tmp_path / "broken.json")
    # a message that ends in a dangling " at" in CPython ("Invalid control character at") says
    # where instead (the fresh-clone check found "...: Invalid control character at" and no place)
    (tmp_path / "control.json").write_text('{"a": "x\ty"}')
    with pytest.raises(ValueError) as exc:
        CycleCostModel.load(tmp_path / "control.json")
    assert str(exc.value).endswith("invalid JSON at line 1, column 9: Invalid control character"), exc.value
    with pytest.raises(ValueError, match="h2d_bytes_per_s"):
        _cost(h2d_bytes_per_s=0)
    with pytest.raises(ValueError, match="num_layers"):
        _cost(num_layers=0)


def test_cost_json_before_version_8_loads_its_frac_names(tmp_path) -> None:
    """Version 8 writes pre_router_fraction and next_layer_cover_fraction(s); a version-7 file wrote
    them as *_frac / *_fracs (fields and units) and still loads to the same model."""
    from specfit.cost import FORMER_FIELD_NAMES, no_pre_router_note

    cost = dataclasses.replace(
        _cost(overlap_h2d=True, overlap_mode="on", host_s_per_transfer=2e-6, pre_router_fraction=0.3),
        next_layer_prefetch=True,
        next_layer_cover_fraction=0.3,
        next_layer_waste_per_miss=0.1,
        next_layer_nodes=(1, 4),
        next_layer_cover_fractions=(0.5, 0.2),
        next_layer_waste_per_misses=(0.2, 0.1),
    )
    data = cost.to_dict()
    assert data["version"] == 9 and not set(FORMER_FIELD_NAMES) & (set(data) | set(data["units"]))
    old_names = {new: old for old, new in FORMER_FIELD_NAMES.items()}
    version_7 = {old_names.get(k, k): v for k, v in dict(data, version=7).items()}
    version_7["units"] = {old_names.get(k, k): v for k, v in data["units"].items()}
    assert "pre_router_frac" in version_7 and "next_layer_cover_fracs" in version_7["units"]
    (tmp_path / "v7.json").write_text(json.dumps(version_7))
    assert CycleCostModel.load(tmp_path / "v7.json") == cost
    assert no_pre_router_note(tmp_path / "v7.json") is None  # it has the pre-router share, by its old name
    with pytest.raises(ValueError, match="pre_router_fraction: expected a fraction"):
        CycleCostModel.from_dict(dict(version_7, pre_router_frac=1.5))


@pytest.mark.filterwarnings("ignore:.*version-[56] cost model:UserWarning")
def test_next_layer_share_per_tree_size_json_interpolation_and_errors(tmp_path) -> None:
    """Versions 6-8: next-layer prefetch's share per tree size (knots over verified nodes) round-trips,
    version 5 loads without knots (one share at every size; versions 5-6 scaled from every layer to
    layers 1..L-1), bad knots are named, and a cycle of ``n`` nodes is priced as a one-share model
    with the knots' ``np.interp`` at ``n``."""
    base = _cost(overlap_h2d=True, overlap_mode="on", host_s_per_transfer=2e-6, pre_router_fraction=0.3, late_call_s=1e-5)
    base = dataclasses.replace(base, next_layer_prefetch=True, next_layer_cover_fraction=0.3, next_layer_waste_per_miss=0.1)
    knots = dict(next_layer_nodes=(1, 4, 30), next_layer_cover_fractions=(0.5, 0.3, 0.1), next_layer_waste_per_misses=(0.25, 0.1, 0.0))
    cost = dataclasses.replace(base, **knots)
    assert cost.next_layer_nodes == (1.0, 4.0, 30.0)
    assert CycleCostModel.load(cost.save(tmp_path / "v6.json")) == cost
    assert json.loads((tmp_path / "v6.json").read_text())["version"] == 9
    version_5 = {k: v for k, v in base.to_dict().items() if k not in knots}
    # versions 5-6: shares of every layer, loaded as shares of layers 1..L-1 (x L / (L - 1) = 1.5)
    with pytest.warns(UserWarning, match="version-5 .*scaled by L / \\(L - 1\\) = 3/2"):  # not silent (M12)
        old = CycleCostModel.from_dict(dict(version_5, version=5))
    assert (old.next_layer_cover_fraction, old.next_layer_waste_per_miss) == pytest.approx((0.45, 0.15), rel=1e-12)
    assert dataclasses.replace(old, next_layer_cover_fraction=0.3, next_layer_waste_per_miss=0.1) == base
    old = CycleCostModel.from_dict(dict(cost.to_dict(), version=6))
    assert old.next_layer_cover_fractions == pytest.approx((0.75, 0.45, 0.15), rel=1e-12)
    assert old.next_layer_waste_per_misses == pytest.approx((0.375, 0.15, 0.0), rel=1e-12)
    full = dict(cost.to_dict(), version=6, next_layer_cover_fractions=[0.9, 0.5, 0.1])
    assert CycleCostModel.from_dict(full).next_layer_cover_fractions[0] == 1.0  # a share stays <= 1
    # an invalid share is reported as written, not scaled (M12)
    with pytest.raises(ValueError, match=r"next_layer_cover_fractions: expected fractions.*1\.3"):
        CycleCostModel.from_dict(dict(cost.to_dict(), version=6, next_layer_cover_fractions=[0.9, 1.3, 0.1]))
    with pytest.raises(ValueError, match=r"next_layer_cover_fraction\b.*1\.2"):
        CycleCostModel.from_dict(dict(version_5, version=5, next_layer_cover_fraction=1.2))
    with pytest.raises(ValueError, match="missing field.*next_layer_nodes"):
        CycleCostModel.from_dict(dict(version_5, version=6))
    for bad, match in (
        (dict(knots, next_layer_nodes=(1, 4, 4)), "next_layer_nodes: expected strictly increasing"),
        (dict(knots, next_layer_nodes=(0.5, 4, 30)), "next_layer_nodes: expected strictly increasing"),
        (dict(knots, next_layer_cover_fractions=(0.5, 0.3)), "as many knots"),
        (dict(knots, next_layer_cover_fractions=(0.5, 1.3, 0.1)), "next_layer_cover_fractions: expected fractions"),
        (dict(knots, next_layer_waste_per_misses=(0.1, -1, 0)), "next_layer_waste_per_misses: expected a list"),
        (dict(knots, next_layer_nodes="abc"), "next_layer_nodes: expected a list"),
    ):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(base, **bad)
    misses = np.array([3.0, 0.0, 7.0])
    for n in (1, 2, 4, 10, 30, 60):
        h, x = np.interp(n, (1, 4, 30), (0.5, 0.3, 0.1)), np.interp(n, (1, 4, 30), (0.25, 0.1, 0.0))
        assert cost.next_layer_share_at(n) == (h, x)
        one = dataclasses.replace(base, next_layer_cover_fraction=float(h), next_layer_waste_per_miss=float(x))
        for model, single in ((cost, one), (dataclasses.replace(cost, overlap_h2d=False), dataclasses.replace(one, overlap_h2d=False))):
            assert model.cycle_s(2, n, 100, misses) == pytest.approx(single.cycle_s(2, n, 100, misses), rel=1e-12)
            assert model.cycle_s(2, n, 100, 11.0) == pytest.approx(single.cycle_s(2, n, 100, 11.0), rel=1e-12)
            assert model.realised_cycle_s(2, n, 100, misses) == pytest.approx(single.realised_cycle_s(2, n, 100, misses), rel=1e-12)
            assert model.least_s_per_miss <= single.least_s_per_miss * (1 + 1e-12)
            least, terms = model.next_layer_least_s_per_miss, model.next_layer_s_per_miss(n)
            assert all(lo <= t * (1 + 1e-12) for lo, t in zip(least, terms))
    rows = cost.cycle_s_layers(np.array([1, 2]), np.array([1, 30]), 100, np.stack([misses, misses]))
    assert rows[0] == cost.cycle_s(1, 1, 100, misses) and rows[1] == cost.cycle_s(2, 30, 100, misses)
    # knots unused where next-layer prefetch is not priced (a run without it, mode "ideal")
    for change in ({"next_layer_prefetch": False}, {"overlap_mode": "ideal"}):
        plain = dataclasses.replace(base, next_layer_cover_fraction=0.0, next_layer_waste_per_miss=0.0, **change)
        assert dataclasses.replace(cost, **change).cycle_s(2, 4, 100, misses) == plain.cycle_s(2, 4, 100, misses)


# ---- acceptance -----------------------------------------------------------------------------
def test_path_accept_probs_identity_and_calibrated() -> None:
    tree = _tree()
    assert np.allclose(path_accept_probs(tree), [1.0, 0.5, 0.25, 0.25, 0.05])
    cal = AcceptanceCalibration(knots_x=[0.0, 0.5, 1.0], knots_y=[0.1, 0.6, 0.9])
    p = path_accept_probs(tree, cal)
    assert p[0] == 1.0
    assert np.allclose(p[1:], [0.6, 0.35, 0.35, 0.15])
    for v in range(1, tree.num_nodes):
        assert p[v] <= p[tree.parents[v]]
    assert AcceptanceCalibration.from_dict(cal.to_dict()).apply(0.25) == pytest.approx(0.35)
    assert AcceptanceCalibration.identity().apply(np.array([0.3]))[0] == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("x", "y", "match"),
    [
        ([0.0, 0.5], [0.2, 0.1], "non-decreasing"),
        ([0.5, 0.5], [0.1, 0.2], "strictly increasing"),
        ([0.0, 1.5], [0.1, 0.2], "knots_x"),
        ([0.0], [0.1, 0.2], "knots_y"),
        ([], [], "at least one"),
    ],
)
def test_calibration_validation(x, y, match) -> None:
    with pytest.raises(ValueError, match=match):
        AcceptanceCalibration(knots_x=x, knots_y=y)


def test_top_child_mask_and_runner_up_map() -> None:
    from specfit.acceptance import AcceptanceCalibration, path_accept_probs, top_child_mask

    parents = np.array([-1, 0, 0, 0, 1, 1])
    logp = np.log([1.0, 0.3, 0.5, 0.5, 0.2, 0.7])
    # node 2 and 3 tie at 0.5 under the root: the lower id wins; node 5 beats node 4 under node 1
    np.testing.assert_array_equal(top_child_mask(parents, logp), [False, False, True, False, False, True])
    cal = AcceptanceCalibration(
        [0.0, 1.0], [0.5, 1.0], scope="edge", runner_up_knots_x=[0.0, 1.0], runner_up_knots_y=[0.0, 0.2]
    )
    tree = DraftTree.from_parents(np.arange(6), parents, logp)
    p = path_accept_probs(tree, cal)
    np.testing.assert_allclose(p[[1, 2, 3]], [0.3 * 0.2, 0.5 + 0.5 * 0.5, 0.5 * 0.2])
    np.testing.assert_allclose(p[[4, 5]], [p[1] * 0.2 * 0.2, p[1] * (0.5 + 0.5 * 0.7)])
    assert AcceptanceCalibration.from_dict(cal.to_dict()).runner_up_knots_y.tolist() == [0.0, 0.2]
    with pytest.raises(ValueError, match="scope 'edge'"):
        AcceptanceCalibration(
            [0.0, 1.0], [0.0, 1.0], runner_up_knots_x=[0.0, 1.0], runner_up_knots_y=[0.0, 1.0]
        )


def test_with_compute_speed_scales_exactly_the_compute_terms():
    """CycleCostModel.with_compute_speed: every compute term times the factor, the link's wire
    time (bandwidth, the link's share of the per-transfer latency) and the rest unchanged."""
    from specfit.cost import COMPUTE_FIELDS

    cost = CycleCostModel(
        draft_s_per_level=2e-3, draft_base_s=1e-3, verify_base_s=10e-3, verify_s_per_node=0.5e-3,
        verify_s_per_context_token=1e-6, h2d_bytes_per_s=2e9, h2d_s_per_transfer=50e-6,
        expert_bytes=4096, num_layers=4, overlap_h2d=True, overlap_mode="on", host_s_per_transfer=30e-6,
        late_call_s=5e-6, pre_router_fraction=0.3, next_layer_cover_fraction=0.4, next_layer_waste_per_miss=0.2,
    )  # fmt: skip
    scaled = cost.with_compute_speed(1.5)
    for f in dataclasses.fields(cost):
        before, after = getattr(cost, f.name), getattr(scaled, f.name)
        if f.name in (*COMPUTE_FIELDS, "host_s_per_transfer"):
            assert after == pytest.approx(1.5 * before, rel=1e-12), f.name
        elif f.name == "h2d_s_per_transfer":  # the link's 20 us stay, the host's 30 us grow to 45
            assert after == pytest.approx(20e-6 + 45e-6, rel=1e-12)
        else:
            assert after == before, f.name
    assert scaled.link_s_per_transfer == pytest.approx(cost.link_s_per_transfer, rel=1e-12)
    assert scaled.verify_s(5, 100) == pytest.approx(1.5 * cost.verify_s(5, 100), rel=1e-12)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="compute speed"):
            cost.with_compute_speed(bad)
