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
import pytest
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


def _assert_same_access(got, want, one, two) -> None:
    """Two accesses' results, and their caches' bitsets, masks and state, are the same."""
    for name in ("hits", "misses", "evicted", "num_hits", "num_misses", "num_evicted"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert got.num_hits.dtype == want.num_hits.dtype == np.int64
    for ids in ("hit_ids", "miss_ids", "evicted_ids"):  # the compiled path's from its keys
        assert [a.tolist() for a in getattr(got, ids)()] == [a.tolist() for a in getattr(want, ids)()], ids
    assert np.array_equal(one.cached_bits(), two.cached_bits())
    assert np.array_equal(one.cached_mask(), two.cached_mask())
    assert _state(one) == _state(two)


def _assert_same_stats(one, two) -> None:
    """Two caches' statistics are the same, bit for bit (the miss-fraction averages included)."""
    for name in ("layer_hits", "layer_misses", "layer_evictions"):
        assert np.array_equal(getattr(one.stats, name), getattr(two.stats, name))
    assert one.stats.layer_miss_fraction.tobytes() == two.stats.layer_miss_fraction.tobytes()
    assert (one.stats.hits, one.stats.misses, one.stats.evictions) == (
        two.stats.hits,
        two.stats.misses,
        two.stats.evictions,
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
        _assert_same_access(got, want, compiled, reference)
    _assert_same_stats(compiled, reference)


def _lru_order(cache, layer: int) -> list[int]:
    """The compiled lru's recency list of ``layer`` (``cache_kernels.layout``'s ``link``), oldest first."""
    from specfit.cache_kernels import AT_LINK

    nodes = cache.num_experts + 1
    nxt = int(cache._buf[AT_LINK]) + layer * nodes
    order, e = [], int(cache._buf[nxt + cache.num_experts])
    while e != cache.num_experts and len(order) <= nodes:
        order.append(e)
        e = int(cache._buf[nxt + e])
    return order


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_compiled_lru_keeps_its_recency_list_over_long_runs(num_layers, num_experts, seed) -> None:
    """Long runs of compiled lru accesses (evictions in most; capacities 0, 1, E and random; layers
    with no access or no miss; copies, pickles, warm-ups and single-layer accesses between them,
    which make the compiled path rebuild its list) give the reference's results and state, and
    the list holds the cached experts by ascending stamp after every compiled access."""
    import copy
    import pickle

    rng = np.random.default_rng(seed)
    capacity = rng.choice([0, 1, num_experts, *rng.integers(0, num_experts + 1, size=3)], size=num_layers)
    compiled = make_expert_cache("lru", num_layers, num_experts, capacity)
    reference = make_expert_cache("lru", num_layers, num_experts, capacity)
    density = rng.uniform(0.02, 0.5)
    for step in range(120):
        kind = rng.random()
        if kind < 0.04:
            compiled = pickle.loads(pickle.dumps(compiled)) if step % 2 else copy.deepcopy(compiled)
        elif kind < 0.08:
            layer, ids = int(rng.integers(num_layers)), rng.choice(num_experts, size=int(rng.integers(0, 4)))
            compiled.warm(layer, ids)
            reference.warm(layer, ids)
        elif kind < 0.12:
            layer, ids = int(rng.integers(num_layers)), rng.choice(num_experts, size=int(rng.integers(0, 4)))
            assert compiled.access(layer, ids).evicted.tolist() == reference.access(layer, ids).evicted.tolist()
        mask = rng.random((num_layers, num_experts)) < density
        if kind > 0.9:  # the same sets again: hits only, nothing evicted
            mask = reference.cached_mask()
        got = compiled.access_layers(mask)
        want = reference.access_layers(mask, reference=True)
        _assert_same_access(got, want, compiled, reference)
        for layer in range(num_layers):
            stamps = compiled._stamp[layer]
            cached = np.flatnonzero(stamps >= 0)
            assert _lru_order(compiled, layer) == cached[np.argsort(stamps[cached])].tolist()
    _assert_same_stats(compiled, reference)


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


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["lru", "lfu", "static", "belady"]),
    st.integers(1, 4),
    st.integers(1, 140),
    st.sampled_from([np.int16, np.int32, np.int64]),
    st.integers(0, 2**31 - 1),
)
def test_access_nodes_equals_access_layers_of_the_routed_mask(policy, num_layers, num_experts, dtype, seed) -> None:
    """``access_nodes(ids, nodes)`` (the mask never built) == ``access_layers(expert_mask(ids, nodes))``:
    same results, statistics and state, duplicates and padding (-1) in the routing included."""
    from specfit.cache_kernels import expert_mask

    rng = np.random.default_rng(seed)
    capacity = rng.integers(0, num_experts + 1, size=num_layers)
    top_k = int(rng.integers(1, 5))
    steps = int(rng.integers(1, 12))
    kwargs = {}
    if policy == "static":
        kwargs = {"frequency": rng.random((num_layers, num_experts))}
    if policy == "belady":
        kwargs = {"future": [[rng.choice(num_experts, 3) for _ in range(steps)] for _ in range(num_layers)]}
    by_nodes = make_expert_cache(policy, num_layers, num_experts, capacity, **kwargs)
    by_mask = make_expert_cache(policy, num_layers, num_experts, capacity, **kwargs)
    for _ in range(steps):
        routing = rng.integers(-1, num_experts, size=(int(rng.integers(1, 9)), num_layers, top_k)).astype(dtype)
        nodes = rng.choice(routing.shape[0], size=int(rng.integers(1, routing.shape[0] + 1)), replace=False)
        got = by_nodes.access_nodes(routing, nodes)
        want = by_mask.access_layers(expert_mask(routing.astype(np.int64), nodes.astype(np.int64), num_experts))
        _assert_same_access(got, want, by_nodes, by_mask)
    _assert_same_stats(by_nodes, by_mask)


def _cache_of(policy: str):
    """A 2-layer, 8-expert cache of ``policy`` (static's frequency, belady's future given)."""
    kwargs = {}
    if policy == "static":
        kwargs = {"frequency": np.arange(16, dtype=np.float64).reshape(2, 8)}
    if policy == "belady":
        kwargs = {"future": [[np.array([1]), np.array([2, 3])], [np.array([2]), np.array([3])]]}
    return make_expert_cache(policy, 2, 8, 2, **kwargs)


def _everything(cache) -> tuple:
    return (*_state(cache), cache.cached_mask().tolist(), cache.stats._layer_counts.tolist(),
            cache.stats.layer_miss_fraction.tobytes(), cache.stats.hits, cache.stats.misses)


@pytest.mark.parametrize("policy", ["lru", "lfu", "static", "belady"])
def test_access_nodes_rejects_bad_routing_and_leaves_the_cache_unchanged(policy) -> None:
    """Every policy (belady's through ``expert_mask``) raises the same ValueError on an expert id
    ``>= E`` (few and many routed ids per layer), the cache unchanged; the bad ids sit in layer
    0, where an unchecked id would land in layer 1's row, not past the memory's end."""
    cache = _cache_of(policy)
    cache.access_nodes(np.array([[[1], [2]]]), np.array([0]))
    before = _everything(cache)
    for dtype in (np.int16, np.int64):
        with pytest.raises(ValueError, match="an expert id is >= the experts per layer"):
            cache.access_nodes(np.array([[[1, 8], [2, 3]]], dtype=dtype), np.array([0]))  # 8 >= E
        many = np.zeros((9, 2, 1), dtype=dtype)  # 9 routed ids per layer: the mask path
        many[5, 0, 0] = 8
        with pytest.raises(ValueError, match="an expert id is >= the experts per layer"):
            cache.access_nodes(many, np.arange(9))
    with pytest.raises(ValueError, match=r"int\[N, 2, K\]"):
        cache.access_nodes(np.zeros((1, 3, 1), dtype=np.int64), np.array([0]))
    assert _everything(cache) == before
    assert cache.stats.hits + cache.stats.misses == 2


_BAD_NODES = """
import numpy as np, sys
sys.path.insert(0, sys.argv[1])
from test_specfit_cache_kernels import _cache_of, _everything
from sim.replay import _layer_mask
from specfit.cache_kernels import expert_mask
for policy in ("lru", "lfu", "static", "belady"):
    cache = _cache_of(policy)
    cache.access_nodes(np.array([[[1], [2]]]), np.array([0]))
    before = _everything(cache)
    for nodes in ([5], [-1], [0, 1], [1] * 9):  # few and many routed ids per layer
        try:
            cache.access_nodes(np.array([[[3], [4]]]), np.array(nodes))
        except ValueError as err:
            assert "node id is not a row" in str(err), err
        else:
            raise AssertionError(f"{policy}: node ids {nodes} accepted")
    assert _everything(cache) == before, policy
for call in (lambda: expert_mask(np.zeros((1, 2, 1), np.int64), np.array([5]), 8),
             lambda: _layer_mask(np.zeros((1, 2, 1), np.int16), np.array([1]), 8),
             lambda: _layer_mask(np.array([[[1], [8]]]), np.array([0]), 8)):
    try:
        call()
    except ValueError:
        pass
    else:
        raise AssertionError("expert_mask accepted bad routing")
print("ok")
"""


def test_bad_node_ids_raise_for_every_policy_and_the_routed_mask() -> None:
    """A node id that is not a row of the routing raises the same ValueError for every policy
    (cache unchanged), and ``expert_mask`` (sim.replay's ``_layer_mask``) refuses bad node and
    expert ids: in a subprocess, as numba does no bounds checks (an unchecked read segfaults)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _BAD_NODES, str(here)], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
