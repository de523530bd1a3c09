"""Expert predictors and their recall / precision against the truth."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specfit import bitsets
from specfit.node_experts import NodeExperts
from specfit.predictors import (
    PREDICTORS,
    PredictContext,
    make_predictor,
    predictor_recall_precision,
    score_predictor,
    token_table_from_routing,
    union_size_from_node_arrays,
    union_size_from_trees,
)
from specfit.tree import DraftTree

E, L = 16, 2


def _ctx(recent=None, truth=None) -> PredictContext:
    tree = DraftTree.from_parents([7, 3, 7], [-1, 0, 0], np.log([1.0, 0.6, 0.3]))
    return PredictContext(tree, E, L, 10, recent_experts=recent, true_experts=truth)


def _pack(ids) -> np.ndarray:
    return bitsets.pack(np.asarray(ids), E)


def test_oracle_is_exact() -> None:
    truth = _pack([[[1, 2], [3, 4]], [[1, 5], [3, 6]], [[2, 5], [4, 6]]])
    pred = make_predictor("oracle").predict(_ctx(truth=truth))
    assert np.array_equal(pred.bits, truth)
    assert predictor_recall_precision(pred, truth) == (1.0, 1.0)
    with pytest.raises(ValueError, match="true_experts"):
        make_predictor("oracle").predict(_ctx())


def test_recent_uses_the_last_m_committed_tokens() -> None:
    recent = _pack([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 8], [3, 9]]])  # oldest first
    pred = make_predictor("recent", window=2).predict(_ctx(recent=recent))
    assert pred.bits.shape == (3, L, 1)
    for v in range(3):
        assert bitsets.to_ids(pred.bits[v, 0], E).tolist() == [1, 4, 5, 8]
        assert bitsets.to_ids(pred.bits[v, 1], E).tolist() == [3, 6, 7, 9]
    truth = _pack([[[1, 4], [3, 6]], [[1, 2], [3, 10]], [[11, 12], [13, 14]]])
    recall, precision = predictor_recall_precision(pred, truth)
    # hits: node0 4 of 4, node1 2 of 4, node2 0 of 4; predicted 8 per node
    assert recall == pytest.approx(6 / 12) and precision == pytest.approx(6 / 24)
    empty = make_predictor("recent").predict(_ctx())
    assert bitsets.popcount(empty.bits).sum() == 0


def test_token_table_fit_and_predict() -> None:
    tokens = np.array([7, 7, 7, 3])
    experts = np.array([[[1, 2], [0, 1]], [[1, 3], [0, 2]], [[1, 2], [5, 6]], [[9, 10], [11, 12]]])
    table = token_table_from_routing(tokens, experts, E, keep_top=2)
    assert bitsets.to_ids(table[7][0], E).tolist() == [1, 2]  # 1 thrice, 2 twice, 3 once
    assert bitsets.to_ids(table[7][1], E).tolist() == [0, 1]  # 0 twice; tie 1/2/5/6 -> smaller id
    assert bitsets.to_ids(table[3][1], E).tolist() == [11, 12]
    pred = make_predictor("token-table", table=table, fallback_window=0).predict(_ctx())
    assert np.array_equal(pred.bits[0], table[7]) and np.array_equal(pred.bits[2], table[7])
    assert np.array_equal(pred.bits[1], table[3])
    unknown = make_predictor("token-table", table={}, fallback_window=0).predict(_ctx())
    assert bitsets.popcount(unknown.bits).sum() == 0


def test_union_size_measured_and_used() -> None:
    trees = [np.array([[[0], [0]], [[1], [0]], [[1], [2]]]), np.array([[[5], [5]], [[6], [6]]])]
    probs = [np.array([1.0, 0.2, 0.5]), np.array([1.0, 0.9])]
    size = union_size_from_trees(trees, probs, E, max_nodes=4)
    # tree 1 in P order: 0, 2, 1 -> layer0 {0},{0,1},{0,1}; layer1 {0},{0,2},{0,2}
    # tree 2: {5},{5,6}; sizes 3+ only from tree 1, size 4 flat
    assert size[0].tolist() == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert size[1].tolist() == [0.0, 1.0, 2.0, 2.0, 2.0]
    pred = make_predictor("union-size", union_size=size).predict(_ctx())
    assert pred.is_union_size and pred.bits is None
    cached = _pack([[0, 1, 2, 3], [-1, -1, -1, -1]])
    assert pred.expected_misses(2, cached).tolist() == [2.0 * 12 / 16, 2.0]
    truth = _pack([[[1, 2], [3, 4]], [[1, 5], [3, 6]], [[2, 5], [4, 6]]])  # 3 distinct per layer
    recall, precision = predictor_recall_precision(pred, truth)
    assert recall == pytest.approx(4 / 6) and precision == pytest.approx(1.0)


def _flat(trees, probs) -> SimpleNamespace:
    """A ``traces.reader.NodeArrays`` stand-in: the fields the union-size fit reads."""
    offsets = np.cumsum([0] + [t.shape[0] for t in trees])
    return SimpleNamespace(
        offsets=offsets, expert_ids=np.concatenate(trees), path_logprob=np.log(np.concatenate(probs))
    )


def test_union_size_from_node_arrays_pools_runs_in_draft_order() -> None:
    trees = [np.array([[[0], [0]], [[1], [0]], [[1], [2]]]), np.array([[[5], [5]], [[6], [6]]])]
    probs = [np.array([1.0, 0.2, 0.5]), np.array([1.0, 0.9])]
    three = [*trees, np.array([[[3], [4]]])]
    expected = union_size_from_trees(three, [*probs, np.array([1.0])], E, max_nodes=3)
    pooled = union_size_from_node_arrays([_flat(trees, probs), _flat(three[2:], [np.array([1.0])])], E)
    np.testing.assert_array_equal(pooled, expected)  # every tree, sizes up to the largest tree
    alone = union_size_from_node_arrays(_flat(trees, probs), E)
    np.testing.assert_array_equal(alone, union_size_from_trees(trees, probs, E, max_nodes=3))
    # other ranking probabilities: node 1 before node 2 in tree 1 -> layer 1 {0},{0},{0,2}
    reranked = union_size_from_node_arrays(_flat(trees, probs), E, [np.array([1.0, 0.5, 0.2]), probs[1]])
    assert reranked[1].tolist() == [0.0, 1.0, 1.5, 2.0]
    with pytest.raises(ValueError, match="no dense trees"):
        union_size_from_node_arrays([], E)
    with pytest.raises(ValueError, match="1 probability arrays for 2 trees"):
        union_size_from_node_arrays(_flat(trees, probs), E, [probs[0]])
    # any iterable of runs pools like a list (a generator was taken as one run: AttributeError)
    gen = union_size_from_node_arrays((r for r in [_flat(trees, probs), _flat(three[2:], [np.array([1.0])])]), E)
    np.testing.assert_array_equal(gen, expected)
    with pytest.raises(ValueError, match="item 0 is a int, expected NodeArrays"):
        union_size_from_node_arrays([3], E)
    # one probability per node, or a clear error (a shorter array silently ranked fewer nodes)
    with pytest.raises(ValueError, match=r"tree_probs\[0\] has shape \(2,\), expected \(3,\)"):
        union_size_from_node_arrays(_flat(trees, probs), E, [np.array([1.0, 0.5]), probs[1]])


def test_names_and_errors() -> None:
    assert PREDICTORS == ("oracle", "recent", "token-table", "union-size")
    with pytest.raises(ValueError, match="expected one of"):
        make_predictor("psychic")
    with pytest.raises(ValueError, match="bad arguments"):
        make_predictor("recent", table={})
    with pytest.raises(ValueError, match="recent_experts"):
        _ctx(recent=np.zeros((2, L, 2), dtype=np.uint64))
    with pytest.raises(ValueError, match="exactly one"):
        NodeExperts(E)
    with pytest.raises(ValueError, match="non-decreasing"):
        NodeExperts(E, union_size=np.array([[0.0, 2.0, 1.0]]))


def test_score_predictor_micro_averages_over_trees() -> None:
    recent = _pack([[[0, 1], [2, 3]]])
    truth_a = _pack([[[0, 1], [2, 3]], [[0, 9], [2, 9]], [[9, 10], [9, 10]]])  # 4 + 2 + 0 hits of 12
    truth_b = _pack([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]])  # 12 of 12
    cases = [(_ctx(recent=recent), truth_a), (_ctx(recent=recent), truth_b)]
    score = score_predictor(make_predictor("recent", window=1), cases)
    assert score.recall == pytest.approx(18 / 24) and score.precision == pytest.approx(18 / 24)
    oracle = score_predictor(make_predictor("oracle"), [(_ctx(truth=truth_a), truth_a)])
    assert oracle == (1.0, 1.0)


def test_clean_miss_fraction_is_clip_bit_for_bit_with_non_finite_as_one() -> None:
    from specfit.predictors import clean_miss_fraction

    x = np.array([-0.0, 0.0, 0.3, 1.0, 1.5, -0.2, np.nan, np.inf, -np.inf, 1e-300, 5e-324, 1 - 1e-16])
    want = np.where(np.isfinite(x), x.clip(0.0, 1.0), 1.0)
    assert clean_miss_fraction(x).tobytes() == want.tobytes()
    assert clean_miss_fraction(x)[6:9].tolist() == [1.0, 1.0, 1.0]
