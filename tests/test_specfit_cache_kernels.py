"""The compiled batched cache access (``specfit.cache_kernels``) against its oracle.

The oracle is the vectorised numpy implementation ``ExpertCache.access_layers(mask,
reference=True)`` (itself checked against per-layer ``access`` and a plain OrderedDict LRU in
``test_specfit_fastpaths.py``). On random access sequences, with warm-ups and per-layer accesses
interleaved (they invalidate the compiled path's cached bitsets), both must give the same hits,
misses, evictions, statistics (bit for bit, the miss-fraction averages included), cached sets and
internal state, for lru, lfu and static.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.cache import make_expert_cache


def _state(cache) -> tuple:
    return (
        cache._stamp.tolist(),
        cache._count.tolist(),
        cache._freq.tolist(),
        cache._tick.tolist(),
        cache._clock,
        cache._next_stamp,
    )


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(["lru", "lfu", "static"]),
    st.integers(1, 4),
    st.integers(1, 140),
    st.integers(0, 2**31 - 1),
)
def test_compiled_access_layers_equals_the_numpy_reference(policy, num_layers, num_experts, seed) -> None:
    rng = np.random.default_rng(seed)
    capacity = rng.integers(0, num_experts + 1, size=num_layers)
    kwargs = {"frequency": rng.random((num_layers, num_experts))} if policy == "static" else {}
    compiled = make_expert_cache(policy, num_layers, num_experts, capacity, **kwargs)
    reference = make_expert_cache(policy, num_layers, num_experts, capacity, **kwargs)
    density = rng.uniform(0.0, 0.6)
    for _ in range(int(rng.integers(1, 25))):
        kind = rng.random()
        if kind < 0.1:  # a warm-up (prefetch) or a single-layer access between batched ones
            layer = int(rng.integers(num_layers))
            ids = rng.choice(num_experts, size=int(rng.integers(0, num_experts + 1)))
            for cache in (compiled, reference):
                cache.warm(layer, ids)
            continue
        if kind < 0.2:
            layer = int(rng.integers(num_layers))
            ids = rng.choice(num_experts, size=int(rng.integers(0, num_experts + 1)))
            one, two = compiled.access(layer, ids), reference.access(layer, ids)
            assert one.hits.tolist() == two.hits.tolist() and one.evicted.tolist() == two.evicted.tolist()
            continue
        mask = rng.random((num_layers, num_experts)) < density
        got = compiled.access_layers(mask)
        want = reference.access_layers(mask, reference=True)
        for name in ("hits", "misses", "evicted", "num_hits", "num_misses", "num_evicted"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert got.num_hits.dtype == want.num_hits.dtype == np.int64
        for ids in ("hit_ids", "miss_ids", "evicted_ids"):  # the compiled path's from its keys
            assert [a.tolist() for a in getattr(got, ids)()] == [a.tolist() for a in getattr(want, ids)()], ids
        assert np.array_equal(compiled.cached_bits(), reference.cached_bits())
        assert np.array_equal(compiled.cached_mask(), reference.cached_mask())
        assert _state(compiled) == _state(reference)
    for name in ("layer_hits", "layer_misses", "layer_evictions"):
        assert np.array_equal(getattr(compiled.stats, name), getattr(reference.stats, name))
    assert compiled.stats.layer_miss_fraction.tobytes() == reference.stats.layer_miss_fraction.tobytes()
    assert (compiled.stats.hits, compiled.stats.misses, compiled.stats.evictions) == (
        reference.stats.hits,
        reference.stats.misses,
        reference.stats.evictions,
    )


def test_cached_bits_is_a_copy_and_follows_later_changes() -> None:
    cache = make_expert_cache("lru", 2, 70, 3)
    mask = np.zeros((2, 70), dtype=bool)
    mask[0, [1, 65]] = True
    cache.access_layers(mask)
    bits = cache.cached_bits()
    bits[:] = 0  # the caller's copy: the cache is unchanged
    assert cache.cached_ids(0).tolist() == [1, 65]
    assert cache.cached_bits()[0].tolist() == [2, 2]
    cache.warm(1, [69])  # a change outside the batched path is seen
    assert cache.cached_bits()[1].tolist() == [0, 1 << 5]
