"""The union-size table is fitted in the order the planner asks in (issue 13).

SpecFit's planner prices the prefix of a tree's ``n`` nodes with the largest calibrated acceptance
``P(v)`` (root first, ``specfit.decide_kernels.union_size_best_prefix``); a table fitted with the
nodes ranked by DRAFT path probability prices other node sets (on the shipped sample with its edge
map, 4 nodes: 12.09 distinct experts per layer by draft rank, 13.34 by the planner's rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_analysis_union_growth import RUNNER_UP_WINS, _one_tree  # the hand tree whose two orders differ

from calibration.predictor_tables import FORMAT_VERSION, PredictorTables, fit_predictor_tables
from specfit.acceptance import AcceptanceCalibration, path_accept_probs
from specfit.predictors import CALIBRATED_RANK, DRAFT_RANK, union_size_from_node_arrays
from traces.reader import NodeArrays

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "default"


def test_fitted_table_ranks_by_the_acceptance_map_and_says_so(tmp_path):
    arrays = _one_tree()
    draft = fit_predictor_tables([arrays], 8)
    # draft order root, A, B: A shares the root's expert, so 2 nodes bring 1 expert
    np.testing.assert_array_equal(draft.union_size, [[0.0, 1.0, 1.0, 2.0]])
    assert (draft.node_rank, draft.acceptance_json) == (DRAFT_RANK, "")
    tables = fit_predictor_tables([arrays], 8, calibration=RUNNER_UP_WINS)
    # the planner's order root, B (0.27), A (0.06): 2 nodes bring 2 experts
    np.testing.assert_array_equal(tables.union_size, [[0.0, 1.0, 2.0, 2.0]])
    assert tables.node_rank == CALIBRATED_RANK
    assert AcceptanceCalibration.from_dict(json.loads(tables.acceptance_json)).scope == "edge"
    back = PredictorTables.load(tables.save(tmp_path / "t.npz"))
    assert (back.node_rank, back.acceptance_json) == (tables.node_rank, tables.acceptance_json)
    with np.load(tmp_path / "t.npz", allow_pickle=False) as data:
        assert int(data["format_version"]) == FORMAT_VERSION == 2


def test_format_1_file_loads_as_draft_ranked(tmp_path):
    """Files written before format 2 have no rank arrays: every one of them was draft-ranked."""
    old = fit_predictor_tables([_one_tree()], 8)
    np.savez_compressed(
        tmp_path / "old.npz",
        union_size=old.union_size,
        token_ids=old.token_ids,
        token_bits=old.token_bits,
        layer_frequency=old.layer_frequency,
        num_trees=np.array(old.num_trees),
    )
    back = PredictorTables.load(tmp_path / "old.npz")
    assert (back.node_rank, back.acceptance_json) == (DRAFT_RANK, "")
    np.testing.assert_array_equal(back.union_size, old.union_size)


def _planner_ranked_union(arrays: NodeArrays, num_experts: int, calibration, n: int) -> float:
    """Mean over layers and trees (with >= n nodes) of the distinct experts of the planner's first n nodes:
    root, then P descending (ties: lower id), P = path_accept_probs with the run's map."""
    sizes = []
    for i in range(arrays.num_trees):
        dense = arrays.tree(i)
        p = path_accept_probs(dense.tree, calibration)
        if p.shape[0] < n:
            continue
        order = np.argsort(-p, kind="stable")
        order = np.concatenate(([0], order[order != 0]))[:n]
        experts = np.asarray(dense.expert_ids)[order]  # [n, L, K]
        sizes.append([np.unique(e[e >= 0]).size for e in experts.transpose(1, 0, 2)])
    return float(np.mean(sizes))


@pytest.mark.skipif(not (SAMPLE / "manifest.json").is_file(), reason="shipped sample trace not in this checkout")
def test_replay_prices_the_prefixes_its_planner_asks_about(monkeypatch):
    """sim.replay's union-size table (the sweep's, with the trace's acceptance map by default) is the
    mean union of the planner's own prefixes, not of the draft-ranked ones (12.09 at 4 nodes)."""
    from sim.config import SimConfig
    from sim.presets import cost_from_preset
    from sim.replay import replay_policy
    from specfit import predictors
    from traces.reader import open_run

    run = open_run(SAMPLE)
    model = run.manifest.model
    arrays = run.node_arrays()
    acceptance = json.loads((SAMPLE / "acceptance.json").read_text())
    calibration = AcceptanceCalibration.from_dict(acceptance)
    tables: list[np.ndarray] = []
    original = predictors.UnionSizePredictor.predict

    def predict(self, ctx):
        tables.append(self.union_size)
        return original(self, ctx)

    monkeypatch.setattr(predictors.UnionSizePredictor, "predict", predict)
    cost = cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=model.bytes_per_expert, num_layers=model.num_layers)
    config = SimConfig(
        cost=cost, policy="specfit", cache_capacity_per_layer=8, acceptance=acceptance, max_requests=1, max_positions=4
    )
    replay_policy(run, config)
    assert tables
    table = tables[0]
    for n in (4, 8):
        want = _planner_ranked_union(arrays, model.num_experts, calibration, n)
        assert table[:, n].mean() == pytest.approx(want, rel=1e-12)
    draft_ranked = union_size_from_node_arrays([arrays], model.num_experts)
    assert table[:, 4].mean() > 1.05 * draft_ranked[:, 4].mean()  # the case has teeth: +10 % at 4 nodes
    np.testing.assert_array_equal(table, union_size_from_node_arrays([arrays], model.num_experts, calibration))


@pytest.mark.skipif(not (SAMPLE / "manifest.json").is_file(), reason="shipped sample trace not in this checkout")
def test_live_table_from_a_dense_trace_uses_the_runs_map():
    from live.spec.session import union_size_from_dense_trace
    from traces.reader import open_run

    run = open_run(SAMPLE)
    model = run.manifest.model
    calibration = AcceptanceCalibration.from_dict(json.loads((SAMPLE / "acceptance.json").read_text()))
    arrays = run.node_arrays()
    got = union_size_from_dense_trace(SAMPLE, model.num_layers, model.num_experts, calibration)
    np.testing.assert_array_equal(got, union_size_from_node_arrays([arrays], model.num_experts, calibration))
    plain = union_size_from_dense_trace(SAMPLE, model.num_layers, model.num_experts)
    np.testing.assert_array_equal(plain, union_size_from_node_arrays([arrays], model.num_experts))
    assert not np.array_equal(got, plain)
