"""Compiled form of :meth:`specfit.cache.ExpertCache.access_layers` and ``.access_nodes`` (numba, ``cache=True``).

One access at every layer for the ``lru``, ``lfu`` and ``static`` policies, as one pass over
plain arrays: the same rules and the same state updates as the vectorised reference
``ExpertCache._apply`` (which stays, and which ``tests/test_specfit_cache_kernels.py`` compares
this with on random access sequences), without its ``[L, E]`` temporaries. Belady's MIN keeps the
Python path. Imported lazily by :mod:`specfit.cache` on the first batched access, so importing
``specfit`` never compiles anything (numba's on-disk cache makes later processes load it in ~1 s).
"""

from __future__ import annotations

import numpy as np
from numba import njit

POLICY_CODES = {"lru": 0, "lfu": 1, "static": 2}
# the messages of the ValueError the routing's checks raise (compiled code: constants)
_BAD_EXPERT = "routing: an expert id is >= the experts per layer (E)"
_BAD_NODE = "routing: a node id is not a row of expert_ids"
# a 64-bit de Bruijn sequence: the top 6 bits of ``(1 << i) * _DEBRUIJN`` (mod 2**64) are distinct
# for i in 0..63, so _BIT_INDEX maps them back to ``i`` (the lowest set bit's index of a word)
_DEBRUIJN = np.uint64(0x022FDD63CC95386D)
_BIT_INDEX = np.zeros(64, np.int64)
for _i in range(64):
    _BIT_INDEX[((1 << _i) * int(_DEBRUIJN) % (1 << 64)) >> 58] = _i
del _i


@njit(cache=True, error_model="numpy")
def _access(
    policy,
    needed,
    ptr,
    stamp,
    count,
    cap,
    freq,
    tick,
    base,
    clock,
    flat,
    counts,
    bits,
    stats,
    ema,
    weight,
    bits_valid,
):
    """One access at every layer (``ExpertCache._apply(slice(None), need, True)``), in place.

    Args:
        policy: 0 = lru, 1 = lfu, 2 = static (:data:`POLICY_CODES`).
        needed, ptr: the experts each layer needs, as int64 ids ascending per layer:
            ``needed[ptr[l]:ptr[l + 1]]`` for layer ``l`` (``ptr``: int64[L + 1]).
        stamp: int64[L, E] cache state (-1 = not cached, else recency; updated).
        count: int64[L] cached experts per layer (updated). cap: int64[L] capacities.
        freq, tick: int64[L, E] LFU access counts and last-access ticks (updated for lfu).
        base: the access's first stamp (hits get ``base + e``, kept misses ``base + E + e``).
        clock: LFU clock before the access.
        flat: int64[3, L * E] output: its rows' first entries are the ``layer * E + expert``
            keys of the hits, the misses and the evictions, each ascending (as many as the
            returned totals; the rest is left as it was: a few of ``L * E`` are written, where
            bool[L, E] masks would write all). counts: int64[3, L] outputs (hits, misses,
            evictions per layer). bits: uint64[L, W] output, the cached experts
            after the access as bitsets (``ExpertCache.cached_bits``); with ``bits_valid`` it
            holds the sets before the access (else each layer's words are first rebuilt from
            ``stamp``), the eviction candidates are read from it, and the bits of the evicted
            and inserted experts change.
        stats: int64[3, L] running hits, misses, evictions per layer (``CacheStats``; updated).
        ema: float64[L] per-layer moving average of the miss fraction (NaN before a layer's first
            access; updated as ``CacheStats.record``: ``old + weight * (frac - old)``).
        bits_valid: whether ``bits`` holds the cached sets before the access.

    Returns:
        ``(clock, hits, misses, evictions)``: the LFU clock after the access (``clock`` plus the
        experts accessed, for lfu; else ``clock``) and this access's totals over layers.

    Rules (module docstring of :mod:`specfit.cache`): hits are refreshed; misses in ascending id
    fill free slots, then replace evictable experts (cached, not in this access) in the policy's
    victim order (lru: smallest stamp; lfu: smallest ``(freq, tick, id)``); once none is left the
    remaining misses are transient; static inserts and evicts nothing.
    """
    num_layers, num_experts = stamp.shape
    num_words = bits.shape[1]
    needed_bits = np.zeros(num_words, np.uint64)  # this layer's needed experts
    cand = np.empty(num_experts, np.int64)
    keys = np.empty(num_experts, np.int64)
    order = np.empty(num_experts, np.int64)  # the victim search's scratch
    missed = np.empty(num_experts, np.int64)  # this layer's misses, ascending
    total_hit = 0
    total_miss = 0
    total_evicted = 0
    for layer in range(num_layers):
        # the needed experts only (a forward pass needs a few of E), ascending: hits are
        # refreshed (a hit is needed, so never an eviction candidate: its stamp is no victim key),
        # misses listed; lfu's ticks run over the layers in order and each layer's experts
        # ascending (the reference's flattened cumsum; a layer reads only its own ticks)
        num_hit = 0
        num_miss = 0
        row = layer * num_experts
        if not bits_valid:  # the layer's cached set before the access, as bitsets
            for w in range(num_words):
                word = np.uint64(0)
                for b in range(min(64, num_experts - w * 64)):
                    word |= np.uint64(stamp[layer, w * 64 + b] >= 0) << np.uint64(b)
                bits[layer, w] = word
        for i in range(ptr[layer], ptr[layer + 1]):
            e = needed[i]
            needed_bits[e >> 6] |= np.uint64(1) << np.uint64(e & 63)
            if policy == 1:
                clock += 1
                tick[layer, e] = clock
                freq[layer, e] += 1
            if stamp[layer, e] >= 0:
                stamp[layer, e] = base + e
                flat[0, total_hit + num_hit] = row + e
                num_hit += 1
            else:
                flat[1, total_miss + num_miss] = row + e
                missed[num_miss] = e
                num_miss += 1
        cached = count[layer]
        kept_count = 0
        num_evicted = 0
        if policy != 2:
            free = cap[layer] - cached
            kept_count = min(num_miss, free + cached - num_hit)
            num_evicted = max(kept_count - free, 0)
        if num_evicted > 0:
            n = 0
            for w in range(num_words):  # the evictable experts (cached, not needed), ascending
                word = bits[layer, w] & ~needed_bits[w]
                while word:
                    low = word & (~word + np.uint64(1))
                    cand[n] = w * 64 + _BIT_INDEX[(low * _DEBRUIJN) >> np.uint64(58)]
                    n += 1
                    word ^= low
            # the victims are the num_evicted first candidates in the policy's victim order (lru:
            # smallest stamp; lfu: smallest (freq, tick, id)); every key is distinct (stamps are,
            # ids are), so they are the candidates whose key is at most the num_evicted-th
            # smallest: that one is found by a pass keeping the smallest keys (lru) or a partial
            # selection (lfu) (a hit is needed, so no candidate's stamp was refreshed), then the
            # candidates are visited in ascending id and those keys kept (the victims come out
            # ascending, no sort)
            if policy == 0:
                # order[:filled]: the smallest stamps seen so far, ascending (insertion, one pass)
                filled = 0
                for i in range(n):
                    k = stamp[layer, cand[i]]
                    keys[i] = k
                    if filled < num_evicted:
                        j = filled
                        filled += 1
                    elif k < order[num_evicted - 1]:
                        j = num_evicted - 1
                    else:
                        continue
                    while j > 0 and order[j - 1] > k:
                        order[j] = order[j - 1]
                        j -= 1
                    order[j] = k
                limit = order[num_evicted - 1]
                num_out = 0
                for i in range(n):
                    if keys[i] <= limit:
                        e = cand[i]
                        flat[2, total_evicted + num_out] = row + e
                        stamp[layer, e] = -1
                        num_out += 1
            else:
                for i in range(n):
                    order[i] = cand[i]
                for i in range(num_evicted):
                    best = i
                    for j in range(i + 1, n):
                        a, b = order[j], order[best]
                        fa, fb = freq[layer, a], freq[layer, b]
                        ta, tb = tick[layer, a], tick[layer, b]
                        if fa < fb or (fa == fb and (ta < tb or (ta == tb and a < b))):
                            best = j
                    e = order[best]
                    order[best] = order[i]
                    order[i] = e
                last = order[num_evicted - 1]
                fl, tl = freq[layer, last], tick[layer, last]
                num_out = 0
                for i in range(n):
                    a = cand[i]
                    fa, ta = freq[layer, a], tick[layer, a]
                    if fa < fl or (fa == fl and (ta < tl or (ta == tl and a <= last))):
                        flat[2, total_evicted + num_out] = row + a
                        stamp[layer, a] = -1
                        num_out += 1
        # the first kept_count misses in ascending id are inserted
        for i in range(kept_count):
            e = missed[i]
            stamp[layer, e] = base + num_experts + e
        # the cached set as bitsets (the set before the access, see above): the evicted experts'
        # bits cleared, the inserted ones' set
        for i in range(num_evicted):
            e = flat[2, total_evicted + i] - row
            bits[layer, e >> 6] &= ~(np.uint64(1) << np.uint64(e & 63))
        for i in range(kept_count):
            e = missed[i]
            bits[layer, e >> 6] |= np.uint64(1) << np.uint64(e & 63)
        count[layer] = cached + kept_count - num_evicted
        counts[0, layer] = num_hit
        counts[1, layer] = num_miss
        counts[2, layer] = num_evicted
        stats[0, layer] += num_hit
        stats[1, layer] += num_miss
        stats[2, layer] += num_evicted
        total_hit += num_hit
        total_miss += num_miss
        total_evicted += num_evicted
        for w in range(num_words):
            needed_bits[w] = 0
        if num_hit + num_miss > 0:
            frac = num_miss / (num_hit + num_miss)
            old_ema = ema[layer]
            ema[layer] = frac if np.isnan(old_ema) else old_ema + weight * (frac - old_ema)
    return clock, total_hit, total_miss, total_evicted


@njit(cache=True, error_model="numpy")
def access_layers(policy, need, *state):
    """One access at every layer with the sets ``need`` bool[L, E] (row ``l`` = the experts layer
    ``l`` needs): ``_access`` with ``state`` = its arguments after ``ptr`` (same returns)."""
    num_layers, num_experts = need.shape
    needed = np.empty(num_layers * num_experts, np.int64)
    ptr = np.empty(num_layers + 1, np.int64)
    ptr[0] = 0
    n = 0
    for layer in range(num_layers):
        for e in range(num_experts):
            if need[layer, e]:
                needed[n] = e
                n += 1
        ptr[layer + 1] = n
    return _access(policy, needed, ptr, *state)


@njit(cache=True, error_model="numpy")
def access_nodes(policy, expert_ids, nodes, *state):
    """One access at every layer with the experts the tokens ``nodes`` route to: ``access_layers``
    with ``expert_mask(expert_ids, nodes, E)``; for a few routed ids per layer the mask is never
    built (per layer the routed ids are gathered, deduplicated and sorted by insertion: a few of
    E), for more it is (``access_layers`` of it).

    Args:
        expert_ids: int16 or int64 [N, L, K] routing (negative ids are padding, skipped).
        nodes: int64[] the tokens of the forward pass (rows of ``expert_ids``).
        state: ``_access``'s arguments after ``ptr`` (``stamp`` first: its shape gives L, E).

    Returns:
        ``_access``'s.

    Raises:
        ValueError: an expert id is ``>= E`` or a node id is not a row (``expert_mask``'s
            messages), before the cache is changed.
    """
    num_layers, num_experts = state[0].shape
    top_k = expert_ids.shape[2]
    # a few routed ids per layer (ar, small trees): sorted by insertion as they come (~ids**2 / 4
    # moves); more (big trees): the bool[L, E] mask set in the routing's memory order, then read
    # in id order per layer (access_layers)
    if nodes.shape[0] * top_k * nodes.shape[0] * top_k > 4 * num_experts:
        return access_layers(policy, expert_mask(expert_ids, nodes, num_experts), *state)
    for v in nodes:
        if v < 0 or v >= expert_ids.shape[0]:
            raise ValueError(_BAD_NODE)
    width = min(num_experts, nodes.shape[0] * top_k)
    needed = np.empty(num_layers * width, np.int64)
    ptr = np.empty(num_layers + 1, np.int64)
    seen = np.zeros(num_experts, np.bool_)
    ptr[0] = 0
    n = 0
    for layer in range(num_layers):
        start = n
        for v in nodes:
            for k in range(top_k):
                e = np.int64(expert_ids[v, layer, k])
                if e >= num_experts:
                    raise ValueError(_BAD_EXPERT)
                if e >= 0 and not seen[e]:
                    seen[e] = True
                    j = n  # into the layer's ascending list
                    while j > start and needed[j - 1] > e:
                        needed[j] = needed[j - 1]
                        j -= 1
                    needed[j] = e
                    n += 1
        for i in range(start, n):
            seen[needed[i]] = False
        ptr[layer + 1] = n
    return _access(policy, needed, ptr, *state)


@njit(cache=True, error_model="numpy")
def expert_mask(expert_ids, nodes, num_experts):
    """bool[L, E]: per layer, the experts any of ``nodes`` routes to (the input of
    :func:`access_layers` for a forward pass over those nodes).

    Args:
        expert_ids: int[N, L, K] routing of every node (negative ids are padding, skipped).
        nodes: int64[] the node ids of the forward pass.
        num_experts: ``E``.

    Raises:
        ValueError: an expert id is ``>= E`` or a node id is not a row of ``expert_ids`` (checked
            as the mask is built: numba does no bounds checks, and nothing else is changed).
    """
    num_rows, num_layers, top_k = expert_ids.shape
    mask = np.zeros((num_layers, num_experts), np.bool_)
    for v in nodes:
        if v < 0 or v >= num_rows:
            raise ValueError(_BAD_NODE)
        for layer in range(num_layers):
            for k in range(top_k):
                e = np.int64(expert_ids[v, layer, k])
                if e >= num_experts:
                    raise ValueError(_BAD_EXPERT)
                if e >= 0:
                    mask[layer, e] = True
    return mask
