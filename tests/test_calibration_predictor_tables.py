"""Predictor tables from dense trees: union-size curve, token table, npz round trip (no pickle)."""

import numpy as np
import pytest

from calibration.predictor_tables import PredictorTables, fit_predictor_tables
from traces.reader import NodeArrays


def _arrays() -> NodeArrays:
    # two trees of 3 nodes (root, child, grandchild), 1 layer, top-2 of 8 experts
    experts = np.array(
        [[[0, 1]], [[1, 2]], [[3, 4]], [[0, 1]], [[0, 1]], [[5, 6]]],
        dtype=np.int16,
    )
    return NodeArrays(
        offsets=np.array([0, 3, 6]),
        request_ids=np.array([0, 0]),
        positions=np.array([0, 1]),
        context_lens=np.array([4, 5]),
        parent=np.array([-1, 0, 1, -1, 0, 0]),
        depth=np.array([0, 1, 2, 0, 1, 1]),
        token_id=np.array([7, 9, 9, 9, 7, 7]),
        target_token=np.zeros(6, dtype=np.int64),
        accepted=np.ones(6, dtype=bool),
        draft_logprob=np.zeros(6),
        path_logprob=np.array([0.0, -0.1, -0.5, 0.0, -0.2, -0.3]),
        expert_ids=experts,
        router_weights=np.full((6, 1, 2), 0.5, dtype=np.float32),
    )


def test_union_size_and_token_table_hand_computed(tmp_path) -> None:
    tables = fit_predictor_tables([_arrays()], num_experts=8, min_token_count=2)
    # tree 1 by probability: {0,1} -> +{2} -> +{3,4}: 2, 3, 5; tree 2: {0,1} -> {0,1} -> +{5,6}: 2, 2, 4
    np.testing.assert_allclose(tables.union_size[0], [0.0, 2.0, 2.5, 4.5])
    assert tables.num_trees == 2
    assert tables.token_ids.tolist() == [7, 9]
    table = tables.token_table()
    # token 7 routed to {0,1}, {0,1}, {5,6}: the two most frequent are 0 and 1
    assert table[7][0, 0] == np.uint64(0b11)
    np.testing.assert_allclose(tables.layer_frequency.sum(axis=1), 2.0)
    path = tables.save(tmp_path / "t.npz")
    back = PredictorTables.load(path)
    np.testing.assert_array_equal(back.token_bits, tables.token_bits)
    np.testing.assert_allclose(back.union_size, tables.union_size)
    assert back.predictor_kwargs("union-size")["union_size"].shape == (1, 4)
    with pytest.raises(ValueError, match="tables exist for"):
        back.predictor_kwargs("oracle")


def test_load_names_missing_array(tmp_path) -> None:
    np.savez(tmp_path / "bad.npz", union_size=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="missing array 'token_ids'"):
        PredictorTables.load(tmp_path / "bad.npz")
