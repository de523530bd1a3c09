"""The cache's observed miss fraction and the union-size predictor that prices with it."""

import numpy as np
import pytest

from specfit import bitsets
from specfit.cache import MISS_EMA_WEIGHT, make_expert_cache
from specfit.predictors import PredictContext, make_predictor
from specfit.tree import DraftTree


def test_miss_fraction_moving_average_follows_accesses() -> None:
    cache = make_expert_cache("lru", num_layers=2, num_experts=8, capacity_per_layer=4)
    assert np.isnan(cache.stats.layer_miss_fraction).all()
    cache.access(0, [0, 1])  # 2 misses of 2 -> 1.0 (first observation taken as is)
    cache.access(0, [0, 1, 2, 3])  # 2 misses of 4 -> 0.5
    expected = 1.0 + MISS_EMA_WEIGHT * (0.5 - 1.0)
    frac = cache.stats.layer_miss_fraction
    assert frac[0] == pytest.approx(expected)
    assert np.isnan(frac[1])
    # a copy carries the statistics along, so live and simulated caches stay in step
    assert cache.copy().stats.layer_miss_fraction[0] == pytest.approx(expected)


def test_union_size_uses_observed_miss_fraction_then_fallbacks() -> None:
    tree = DraftTree.from_parents(np.array([5, 6, 7]), np.array([-1, 0, 0]), np.array([0.0, -0.1, -0.5]))
    union = np.array([[0.0, 4.0, 6.0, 7.0], [0.0, 4.0, 7.0, 9.0]])
    pred = make_predictor("union-size", union_size=union)
    observed = np.array([0.25, np.nan])
    ne = pred.predict(PredictContext(tree=tree, num_experts=16, num_layers=2, miss_fraction=observed))
    cached = bitsets.empty((2,), 16)
    # layer 0 priced at the observed 25 %, layer 1 (never observed) as a cold cache (100 %)
    np.testing.assert_allclose(ne.expected_misses(2, cached), [6.0 * 0.25, 7.0 * 1.0])
    # without an observation: 1 - |C_l| / E
    ne2 = pred.predict(PredictContext(tree=tree, num_experts=16, num_layers=2))
    cached2 = bitsets.pack(np.array([[0, 1, 2, 3], [-1, -1, -1, -1]]), 16)
    np.testing.assert_allclose(ne2.expected_misses(2, cached2), [6.0 * 0.75, 7.0 * 1.0])
    with pytest.raises(ValueError, match="miss_fraction"):
        pred.predict(PredictContext(tree=tree, num_experts=16, num_layers=2, miss_fraction=np.zeros(3)))
