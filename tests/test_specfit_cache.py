"""Expert caches: LRU, LFU, static, Belady; determinism and the access contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit import bitsets
from specfit.cache import CACHE_POLICIES, make_expert_cache


def _run(cache, layer, seq):
    return [
        (a.hits.tolist(), a.misses.tolist(), a.evicted.tolist())
        for a in (cache.access(layer, s) for s in seq)
    ]


def test_lru_known_sequence() -> None:
    cache = make_expert_cache("lru", 1, 8, 2)
    out = _run(cache, 0, [[2, 1, 1], [3], [2], [1]])
    assert out == [([], [1, 2], []), ([], [3], [1]), ([2], [], []), ([], [1], [3])]
    assert cache.stats.hits == 1 and cache.stats.misses == 4 and cache.stats.evictions == 2
    assert cache.cached_ids(0).tolist() == [1, 2]


def test_access_larger_than_capacity_keeps_extra_misses_transient() -> None:
    cache = make_expert_cache("lru", 1, 8, 2)
    a = cache.access(0, [5, 3, 4])
    assert a.misses.tolist() == [3, 4, 5] and a.evicted.size == 0
    assert cache.cached_ids(0).tolist() == [3, 4]  # ascending order: 5 is transient
    b = cache.access(0, [3, 4, 6])  # current experts are never evicted: 6 is transient
    assert b.hits.tolist() == [3, 4] and b.misses.tolist() == [6] and b.evicted.size == 0
    assert cache.cached_ids(0).tolist() == [3, 4]


def test_lfu_evicts_the_least_frequent() -> None:
    cache = make_expert_cache("lfu", 1, 8, 2)
    out = _run(cache, 0, [[1], [1], [2], [3], [2]])
    assert out[3] == ([], [3], [2])  # 1 was used twice, 2 once
    assert out[4] == ([], [2], [3])  # 2 now has 2 uses (counted while out), 3 has 1


def test_static_pins_the_most_frequent() -> None:
    freq = np.array([[0.1, 0.5, 0.2, 0.5], [1, 0, 0, 0]])
    cache = make_expert_cache("static", 2, 4, 2, frequency=freq)
    assert cache.cached_ids(0).tolist() == [1, 3]
    assert cache.cached_ids(1).tolist() == [0, 1]  # tie at 0 broken by smaller id
    a = cache.access(0, [0, 1])
    assert a.hits.tolist() == [1] and a.misses.tolist() == [0] and a.evicted.size == 0
    assert cache.cached_ids(0).tolist() == [1, 3]
    with pytest.raises(ValueError, match="frequency"):
        make_expert_cache("static", 2, 4, 2)


def test_belady_known_sequence_beats_lru() -> None:
    seq = [[1], [2], [3], [1], [2]]
    belady = make_expert_cache("belady", 1, 8, 2, future=[seq])
    lru = make_expert_cache("lru", 1, 8, 2)
    out = _run(belady, 0, seq)
    assert out[2] == ([], [3], [])  # 3 is never used again: bypassed
    _run(lru, 0, seq)
    assert belady.stats.misses == 3 and lru.stats.misses == 5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=60), st.integers(0, 8))
def test_belady_is_a_lower_bound_on_single_requests(seq, capacity) -> None:
    accesses = [[e] for e in seq]
    misses = {}
    for policy in ("lru", "lfu", "belady"):
        cache = make_expert_cache(policy, 1, 8, capacity, future=[accesses])
        _run(cache, 0, accesses)
        misses[policy] = cache.stats.misses
        assert cache.stats.hits + cache.stats.misses == len(seq)
        assert len(cache.cached_ids(0)) <= capacity
    assert misses["belady"] <= misses["lru"] and misses["belady"] <= misses["lfu"]
    assert misses["belady"] >= len(set(seq)) if capacity else misses["belady"] == len(seq)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["lru", "lfu", "belady"]),
    st.lists(st.lists(st.integers(0, 9), max_size=6), min_size=1, max_size=30),
    st.integers(0, 10),
)
def test_same_sequence_same_result_and_contract(policy, seq, capacity) -> None:
    future = [seq, seq]
    a = make_expert_cache(policy, 2, 10, capacity, future=future)
    b = make_expert_cache(policy, 2, 10, capacity, future=future)
    for layer in (0, 1):
        for ids in seq:
            before = set(a.cached_ids(layer).tolist())
            ra, rb = a.access(layer, ids), b.access(layer, ids)
            assert np.array_equal(ra.hits, rb.hits) and np.array_equal(ra.misses, rb.misses)
            assert np.array_equal(ra.evicted, rb.evicted)
            assert set(ra.hits.tolist()) | set(ra.misses.tolist()) == set(ids)
            assert set(ra.hits.tolist()) == before & set(ids)
            assert not set(ra.evicted.tolist()) & set(ids)  # never evict the current access
            after = set(a.cached_ids(layer).tolist())
            assert len(after) <= capacity
            kept = before - set(ra.evicted.tolist())
            assert kept <= after and after - kept <= set(ra.misses.tolist())
    assert a.stats.layer_misses.tolist() == b.stats.layer_misses.tolist()


def test_cached_bits_copy_and_warm() -> None:
    cache = make_expert_cache("lru", 2, 70, 3)
    cache.access(1, [69, 0, 64])
    bits = cache.cached_bits()
    assert bits.shape == (2, 2) and bits.dtype == np.uint64
    assert bitsets.to_ids(bits[1], 70).tolist() == [0, 64, 69]
    assert bitsets.popcount(bits[0]) == 0
    assert cache.contains(1, 64) and not cache.contains(0, 64)
    twin = cache.copy()
    twin.access(1, [5])
    assert cache.cached_ids(1).tolist() == [0, 64, 69]
    assert twin.cached_ids(1).tolist() == [5, 64, 69]
    stats_before = (cache.stats.hits, cache.stats.misses)
    cache.warm(0, [1, 2])
    assert (cache.stats.hits, cache.stats.misses) == stats_before
    assert cache.cached_ids(0).tolist() == [1, 2]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_copies_and_pickles_keep_their_own_state_buffer(policy: str) -> None:
    """The cache's arrays are views of one state buffer (what the compiled access takes, one
    argument): a copy or an unpickled cache gets its own buffer with its views bound to it, and
    goes on exactly as the original would, through the compiled and the per-layer paths."""
    import pickle

    rng = np.random.default_rng(7)
    cache = make_expert_cache(policy, 3, 70, 5)
    for _ in range(4):
        cache.access_layers(rng.random((3, 70)) < 0.1)
    buffers: list = []  # protocol 5's out-of-band buffers, handed back read-only (rev6: unusable)
    out_of_band = pickle.dumps(cache, protocol=5, buffer_callback=buffers.append)
    read_only = [memoryview(b).toreadonly() for b in buffers]
    twins = [cache.copy(), pickle.loads(pickle.dumps(cache)), pickle.loads(out_of_band, buffers=read_only)]
    masks = [rng.random((3, 70)) < 0.1 for _ in range(3)]
    want = []
    for mask in masks:  # the original's future, then the twins' must be the same
        got = cache.access_layers(mask)
        want.append((got.miss_ids(), got.evicted_ids(), cache.stats.layer_miss_fraction.tobytes()))
    cache.access(0, [1, 2, 3])
    for twin in twins:
        assert twin._stamp.base is not None and np.shares_memory(twin._stamp, twin._buf)
        assert not np.shares_memory(twin._buf, cache._buf)
        for mask, (misses, evicted, ema) in zip(masks, want):
            got = twin.access_layers(mask)
            assert [a.tolist() for a in got.miss_ids()] == [a.tolist() for a in misses]
            assert [a.tolist() for a in got.evicted_ids()] == [a.tolist() for a in evicted]
            assert twin.stats.layer_miss_fraction.tobytes() == ema
        twin.access(0, [1, 2, 3])
        assert twin.cached_mask().tolist() == cache.cached_mask().tolist()
        assert np.array_equal(twin.cached_bits(), cache.cached_bits())
        assert (twin.stats.hits, twin.stats.misses, twin.stats.evictions) == (
            cache.stats.hits,
            cache.stats.misses,
            cache.stats.evictions,
        )
        assert twin.stats.layer_misses.tolist() == cache.stats.layer_misses.tolist()


def _older_layout_buffer(cache, num_header: int, names: tuple[str, ...]) -> np.ndarray:
    """``cache``'s state in a buffer of an older layout: ``num_header`` header slots (the first 8
    as now, then the offsets of ``names``), then those parts, no version slot."""
    from specfit.cache_kernels import AT_STAMP, layout

    parts = layout(cache.num_layers, cache.num_experts, cache._words)
    offsets, at = [], num_header
    for name in names:
        offsets.append(at)
        at += parts[name][1]
    buf = np.zeros(at, dtype=np.int64)
    buf[:AT_STAMP] = cache._buf[:AT_STAMP]
    buf[AT_STAMP : AT_STAMP + len(names)] = offsets
    for name, offset in zip(names, offsets):
        start, size = parts[name]
        buf[offset : offset + size] = cache._buf[start : start + size]
    return buf


OLD_PARTS = ("stamp", "freq", "tick", "count", "cap", "stats", "ema", "bits", "out")


@pytest.mark.parametrize(
    "older",
    [(17, OLD_PARTS), (18, (*OLD_PARTS, "link"))],  # before the recency list (9023b59); before the version slot
    ids=["17-slot header, no link", "18-slot header, no version"],
)
def test_a_cache_pickled_in_an_older_buffer_layout_is_refused(older) -> None:
    """An ExpertCache pickled by code with another state-buffer layout is refused on load with a
    ValueError naming the layout (the compiled access trusts the header's offsets: it would read
    and write the wrong words); the current layout loads. Also a wrong version or length."""
    import pickle

    from specfit.cache_kernels import VERSION

    rng = np.random.default_rng(3)
    cache = make_expert_cache("lru", 3, 70, 5)
    cache.access_layers(rng.random((3, 70)) < 0.1)
    good, stamp = pickle.dumps(cache), cache._stamp.copy()
    old = make_expert_cache("lru", 3, 70, 5)
    old.access_layers(rng.random((3, 70)) < 0.1)
    old._buf = _older_layout_buffer(old, *older)
    with pytest.raises(ValueError, match="layout version"):
        pickle.loads(pickle.dumps(old))
    cache._buf[VERSION] += 1  # the current offsets, another version
    with pytest.raises(ValueError, match="version"):
        pickle.loads(pickle.dumps(cache))
    cache._buf = np.append(cache._buf, 0)
    with pytest.raises(ValueError, match="int64"):
        pickle.loads(pickle.dumps(cache))
    twin = pickle.loads(good)  # the current layout loads, its state as pickled
    assert np.array_equal(twin._stamp, stamp) and (twin._stamp >= 0).any()


def test_bad_arguments_name_the_problem() -> None:
    assert CACHE_POLICIES == ("lru", "lfu", "static", "belady")
    with pytest.raises(ValueError, match="expected one of"):
        make_expert_cache("fifo", 1, 8, 2)
    with pytest.raises(ValueError, match="capacity_per_layer"):
        make_expert_cache("lru", 1, 8, 9)
    with pytest.raises(ValueError, match="future"):
        make_expert_cache("belady", 1, 8, 2)
    cache = make_expert_cache("lru", 2, 8, [1, 2])
    assert cache.capacity.tolist() == [1, 2]
    with pytest.raises(ValueError, match="expert id 8"):
        cache.access(0, [8])
    with pytest.raises(ValueError, match="layer 2"):
        cache.access(2, [1])
