"""Compiled form of :meth:`specfit.cache.ExpertCache.access_layers` and ``.access_nodes`` (numba,
``cache=True``), and the throughput guard's two root-alone questions on a cache's bitsets: what a
root-only cycle would copy into it (:func:`root_alone_copies`, the body of
``specfit.policies.root_alone_copies``; an id repeated in a layer's row counts once) and, without
prefetch, how many of the root's experts it lacks per layer (:func:`root_layer_misses`, the body
of ``specfit.policies.root_layer_misses``; a repeated id counts each time, as its numpy form
``root_layer_misses_numpy`` does).

One access at every layer for the ``lru``, ``lfu`` and ``static`` policies, as one pass over
plain arrays: the same rules and the same state updates as the vectorised reference
``ExpertCache._apply`` (which stays, and which ``tests/test_specfit_cache_kernels.py`` compares
this with on random access sequences), without its ``[L, E]`` temporaries. Belady's MIN keeps the
Python path. The whole cache state is one int64 buffer (:func:`layout`), the compiled access's
one state argument. Imported lazily by :mod:`specfit.cache` when the first cache is built (for
the buffer's :func:`layout`), so importing ``specfit`` loads no numba; nothing compiles before
the first batched access (numba's on-disk cache makes later processes load it in ~1 s).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from specfit.planner_kernels import _popcount

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


# The cache's state buffer (``ExpertCache._buf``, one C-contiguous int64[] per cache): one
# argument to every compiled access, where its parts as separate arrays made 17 (numba's
# dispatcher checks and unboxes each argument on every call: ~3 us per argument on this
# project's machine once its code is cold, issue 14). Header slots first, then the parts at the
# offsets the header holds (``layout``); the float64 and uint64 parts are views of their int64 words.
LAYERS, EXPERTS, WORDS, POLICY, STAMP_BASE, CLOCK, BITS_VALID, WEIGHT = range(8)  # header slots
AT_STAMP, AT_FREQ, AT_TICK, AT_COUNT, AT_CAP, AT_STATS, AT_EMA, AT_BITS, AT_OUT, AT_LINK = range(8, 18)  # offsets
VERSION = 18  # header slot: the layout's version (:data:`LAYOUT_VERSION`)
HEADER = 19
# Raise it whenever the buffer's parts, their order or their meaning change (an unpickled cache
# is checked against it, :func:`check_buffer`). 1: the first layout holding its version; the two
# before it (17 header slots, no ``link``; 18, with ``link``) hold none and differ in offsets.
LAYOUT_VERSION = 1


def layout(num_layers: int, num_experts: int, num_words: int) -> dict[str, tuple[int, int]]:
    """The parts of a state buffer for ``L`` layers, ``E`` experts, ``W`` words per bitset:
    name -> (offset, length) in int64 words, in buffer order (after the :data:`HEADER` slots).

    ``stamp``, ``freq``, ``tick``: [L, E] (``ExpertCache._stamp`` etc.); ``count``, ``cap``: [L];
    ``stats``: [3, L] running hits, misses, evictions (``CacheStats``); ``ema``: float64[L]
    miss-fraction averages; ``bits``: uint64[L, W] cached sets; ``out``: an access's result, the
    int64[3, L] per-layer hits, misses, evictions, then the ascending ``layer * E + expert`` keys
    of its hits, misses and evictions back to back (3 L E words: scratch while it runs); ``link``:
    lru's recency order, per layer a circular doubly linked list of its cached experts by
    ascending stamp (oldest first) over ``E + 1`` nodes (node ``E`` the layer's sentinel:
    its next is the oldest, its previous the newest), the next links [L, E + 1] then the
    previous ones [L, E + 1] (valid while the header's ``BITS_VALID`` is set; rebuilt from
    ``stamp`` with the bitsets otherwise).
    """
    sizes = {
        "stamp": num_layers * num_experts,
        "freq": num_layers * num_experts,
        "tick": num_layers * num_experts,
        "count": num_layers,
        "cap": num_layers,
        "stats": 3 * num_layers,
        "ema": num_layers,
        "bits": num_layers * num_words,
        "out": 3 * num_layers + 3 * num_layers * num_experts,
        "link": 2 * num_layers * (num_experts + 1),
    }
    parts, at = {}, HEADER
    for name, size in sizes.items():
        parts[name] = (at, size)
        at += size
    return parts


def buffer_words(num_layers: int, num_experts: int, num_words: int) -> int:
    """The length of a state buffer for ``L`` layers, ``E`` experts, ``W`` words per bitset, in
    int64 words: the end of :func:`layout`'s last part (header included). Raises nothing."""
    return max(at + size for at, size in layout(num_layers, num_experts, num_words).values())


def check_buffer(buf: object, num_layers: int, num_experts: int, num_words: int, policy_code: int) -> None:
    """Check that ``buf`` is a state buffer of this module's layout for ``L`` layers, ``E``
    experts, ``W`` words per bitset and the policy ``policy_code`` (``POLICY_CODES``, -1 for
    belady) before any compiled access reads it (they trust its header's offsets).

    Args:
        buf: the buffer to check (``ExpertCache._buf``, e.g. from a pickle made by older code).

    Raises:
        ValueError: not a C-contiguous int64[] of :func:`layout`'s length, or a header whose
            shape, policy, version (:data:`LAYOUT_VERSION`) or offsets are not this layout's
            (e.g. a buffer made before the ``link`` part or the version slot existed).
    """
    parts = layout(num_layers, num_experts, num_words)
    length = buffer_words(num_layers, num_experts, num_words)
    want = (num_layers, num_experts, num_words, policy_code)
    if not (
        isinstance(buf, np.ndarray) and buf.dtype == np.int64 and buf.ndim == 1 and buf.flags.c_contiguous
    ) or buf.shape[0] != length:
        got = f"{type(buf).__name__} {getattr(buf, 'dtype', '')}{list(getattr(buf, 'shape', ()))}"
        raise ValueError(
            f"ExpertCache state buffer: expected a C-contiguous int64[{length}] (layout version "
            f"{LAYOUT_VERSION}, L={num_layers}, E={num_experts}), got {got}: a cache pickled by "
            "other code cannot be loaded; build it again"
        )
    offsets = [offset for offset, _ in parts.values()]
    header = (
        tuple(int(x) for x in buf[: POLICY + 1]),
        int(buf[VERSION]),
        [int(x) for x in buf[AT_STAMP : AT_STAMP + len(offsets)]],
    )
    if header != (want, LAYOUT_VERSION, offsets):
        raise ValueError(
            f"ExpertCache state buffer: expected layout version {LAYOUT_VERSION} (L, E, W, policy "
            f"{want}, offsets {offsets}), got (L, E, W, policy {header[0]}, version {header[1]}, "
            f"offsets {header[2]}): a cache pickled by other code cannot be loaded; build it again"
        )


@njit(cache=True, error_model="numpy")
def _access(needed, ptr, buf):
    """One access at every layer (``ExpertCache._apply(slice(None), need, True)``), in place.

    Args:
        needed, ptr: the experts each layer needs, as int64 ids ascending per layer:
            ``needed[ptr[l]:ptr[l + 1]]`` for layer ``l`` (``ptr``: int64[L + 1]).
        buf: the cache's state buffer (:func:`layout`; updated): its header gives the policy
            (0 = lru, 1 = lfu, 2 = static, :data:`POLICY_CODES`), the access's first stamp
            (hits get ``base + e``, kept misses ``base + E + e``; advanced by ``2 E``), the LFU
            clock (advanced by the experts accessed, for lfu) and whether ``bits`` holds the
            cached sets before the access (else each layer's words are first rebuilt from
            ``stamp``; set after it). Parts: ``stamp`` (-1 = not cached, else recency),
            ``count``, ``freq`` and ``tick`` (lfu) are updated; ``stats`` and ``ema`` (the
            per-layer moving average of the miss fraction, NaN before a layer's first access,
            updated as ``CacheStats.record``: ``old + weight * (frac - old)``, the weight in the
            header) accumulate; ``bits`` ends as the cached sets after the access (the evicted
            and inserted experts' bits change; lfu's eviction candidates are read from it);
            ``link`` (lru) keeps the cached experts in recency order (hits and kept misses are
            moved to its newest end, victims taken off its oldest end: no search; rebuilt from
            ``stamp`` with the bitsets); ``out`` receives the result (its counts, then its keys
            back to back).

    Returns:
        ``(hits, misses, evictions)``: this access's totals over layers (the keys' lengths).

    Rules (module docstring of :mod:`specfit.cache`): hits are refreshed; misses in ascending id
    fill free slots, then replace evictable experts (cached, not in this access) in the policy's
    victim order (lru: smallest stamp; lfu: smallest ``(freq, tick, id)``); once none is left the
    remaining misses are transient; static inserts and evicts nothing.
    """
    num_layers = buf[LAYERS]
    num_experts = buf[EXPERTS]
    num_words = buf[WORDS]
    policy = buf[POLICY]
    base = buf[STAMP_BASE]
    clock = buf[CLOCK]
    bits_valid = buf[BITS_VALID] != 0
    ubuf = buf.view(np.uint64)  # the bitsets' words
    fbuf = buf.view(np.float64)  # the moving averages and their weight
    weight = fbuf[WEIGHT]
    at_stamp, at_freq, at_tick = buf[AT_STAMP], buf[AT_FREQ], buf[AT_TICK]
    at_count, at_cap, at_stats = buf[AT_COUNT], buf[AT_CAP], buf[AT_STATS]
    at_ema, at_bits, at_out = buf[AT_EMA], buf[AT_BITS], buf[AT_OUT]
    nodes = num_experts + 1  # lru's linked list: the layer's E experts and its sentinel (node E)
    at_next = buf[AT_LINK]
    at_prev = at_next + num_layers * nodes
    at_hit = at_out + 3 * num_layers  # the hits' keys, then (moved there at the end) the others
    at_miss = at_hit + num_layers * num_experts  # scratch: the misses' keys as they come
    at_evicted = at_miss + num_layers * num_experts  # scratch: the evictions' keys
    needed_bits = np.zeros(num_words, np.uint64)  # this layer's needed experts
    cand = np.empty(num_experts, np.int64)
    keys = np.empty(num_experts, np.int64)  # lru: the stamps of a rebuilt order
    order = np.empty(num_experts, np.int64)  # lfu: the victim search's scratch
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
        row = layer * num_experts  # the layer's row in [L, E] parts and its keys' base
        stamp = at_stamp + row  # buf[stamp + e]: the layer's stamp of expert e
        bits = at_bits + layer * num_words  # ubuf[bits + w]: the layer's words
        nxt = at_next + layer * nodes  # buf[nxt + e]: the node after expert e (lru), ...
        prv = at_prev + layer * nodes  # ... buf[prv + e]: the one before
        if not bits_valid:  # the layer's cached set before the access, as bitsets (and lru's order)
            for w in range(num_words):
                word = np.uint64(0)
                for b in range(min(64, num_experts - w * 64)):
                    word |= np.uint64(buf[stamp + w * 64 + b] >= 0) << np.uint64(b)
                ubuf[bits + w] = word
            if policy == 0:  # the cached experts by ascending stamp (distinct in a layer)
                n = 0
                for e in range(num_experts):
                    if buf[stamp + e] >= 0:
                        keys[n] = buf[stamp + e]
                        cand[n] = e
                        n += 1
                last = num_experts  # the sentinel
                for i in np.argsort(keys[:n]):
                    buf[nxt + last] = cand[i]
                    buf[prv + cand[i]] = last
                    last = cand[i]
                buf[nxt + last] = num_experts
                buf[prv + num_experts] = last
        for i in range(ptr[layer], ptr[layer + 1]):
            e = needed[i]
            needed_bits[e >> 6] |= np.uint64(1) << np.uint64(e & 63)
            if policy == 1:
                clock += 1
                buf[at_tick + row + e] = clock
                buf[at_freq + row + e] += 1
            if buf[stamp + e] >= 0:
                buf[stamp + e] = base + e
                buf[at_hit + total_hit + num_hit] = row + e
                num_hit += 1
                if policy == 0:  # the newest now (hits come in ascending id, as their stamps)
                    before, after = buf[prv + e], buf[nxt + e]
                    buf[nxt + before] = after
                    buf[prv + after] = before
                    newest = buf[prv + num_experts]
                    buf[nxt + newest] = e
                    buf[prv + e] = newest
                    buf[nxt + e] = num_experts
                    buf[prv + num_experts] = e
            else:
                buf[at_miss + total_miss + num_miss] = row + e
                missed[num_miss] = e
                num_miss += 1
        cached = buf[at_count + layer]
        kept_count = 0
        num_evicted = 0
        if policy != 2:
            free = buf[at_cap + layer] - cached
            kept_count = min(num_miss, free + cached - num_hit)
            num_evicted = max(kept_count - free, 0)
        evicted = at_evicted + total_evicted  # buf[evicted + i]: this layer's i-th eviction key
        if num_evicted > 0 and policy == 0:
            # lru's victims are its num_evicted oldest cached experts (the needed ones, hits, were
            # made the newest above, and at least num_evicted others are cached): unlinked off
            # the list's oldest end, then written ascending (insertion: a few)
            for i in range(num_evicted):
                e = buf[nxt + num_experts]
                after = buf[nxt + e]
                buf[nxt + num_experts] = after
                buf[prv + after] = num_experts
                buf[stamp + e] = -1
                j = i
                while j > 0 and buf[evicted + j - 1] > row + e:
                    buf[evicted + j] = buf[evicted + j - 1]
                    j -= 1
                buf[evicted + j] = row + e
        elif num_evicted > 0:
            n = 0
            for w in range(num_words):  # the evictable experts (cached, not needed), ascending
                word = ubuf[bits + w] & ~needed_bits[w]
                while word:
                    low = word & (~word + np.uint64(1))
                    cand[n] = w * 64 + _BIT_INDEX[(low * _DEBRUIJN) >> np.uint64(58)]
                    n += 1
                    word ^= low
            # lfu's victims are the num_evicted first candidates in its victim order (smallest
            # (freq, tick, id)); every key is distinct (ids are), so they are the candidates whose
            # key is at most the num_evicted-th smallest: that one is found by a partial
            # selection, then the candidates are visited in ascending id and those keys kept (the
            # victims come out ascending, no sort)
            freq, tick = at_freq + row, at_tick + row
            for i in range(n):
                order[i] = cand[i]
            for i in range(num_evicted):
                best = i
                for j in range(i + 1, n):
                    a, b = order[j], order[best]
                    fa, fb = buf[freq + a], buf[freq + b]
                    ta, tb = buf[tick + a], buf[tick + b]
                    if fa < fb or (fa == fb and (ta < tb or (ta == tb and a < b))):
                        best = j
                e = order[best]
                order[best] = order[i]
                order[i] = e
            last = order[num_evicted - 1]
            fl, tl = buf[freq + last], buf[tick + last]
            num_out = 0
            for i in range(n):
                a = cand[i]
                fa, ta = buf[freq + a], buf[tick + a]
                if fa < fl or (fa == fl and (ta < tl or (ta == tl and a <= last))):
                    buf[evicted + num_out] = row + a
                    buf[stamp + a] = -1
                    num_out += 1
        # the first kept_count misses in ascending id are inserted
        for i in range(kept_count):
            e = missed[i]
            buf[stamp + e] = base + num_experts + e
            if policy == 0:  # the newest (ascending id, as their stamps)
                newest = buf[prv + num_experts]
                buf[nxt + newest] = e
                buf[prv + e] = newest
                buf[nxt + e] = num_experts
                buf[prv + num_experts] = e
        # the cached set as bitsets (the set before the access, see above): the evicted experts'
        # bits cleared, the inserted ones' set
        for i in range(num_evicted):
            e = buf[evicted + i] - row
            ubuf[bits + (e >> 6)] &= ~(np.uint64(1) << np.uint64(e & 63))
        for i in range(kept_count):
            e = missed[i]
            ubuf[bits + (e >> 6)] |= np.uint64(1) << np.uint64(e & 63)
        buf[at_count + layer] = cached + kept_count - num_evicted
        buf[at_out + layer] = num_hit
        buf[at_out + num_layers + layer] = num_miss
        buf[at_out + 2 * num_layers + layer] = num_evicted
        buf[at_stats + layer] += num_hit
        buf[at_stats + num_layers + layer] += num_miss
        buf[at_stats + 2 * num_layers + layer] += num_evicted
        total_hit += num_hit
        total_miss += num_miss
        total_evicted += num_evicted
        for w in range(num_words):
            needed_bits[w] = 0
        if num_hit + num_miss > 0:
            frac = num_miss / (num_hit + num_miss)
            old_ema = fbuf[at_ema + layer]
            fbuf[at_ema + layer] = frac if np.isnan(old_ema) else old_ema + weight * (frac - old_ema)
    # the misses' and the evictions' keys right after the hits' (each destination is below its
    # source: a layer's hits, misses and evictions are distinct experts, at most E in all)
    for i in range(total_miss):
        buf[at_hit + total_hit + i] = buf[at_miss + i]
    for i in range(total_evicted):
        buf[at_hit + total_hit + total_miss + i] = buf[at_evicted + i]
    buf[STAMP_BASE] = base + 2 * num_experts
    buf[CLOCK] = clock
    buf[BITS_VALID] = 1
    return total_hit, total_miss, total_evicted


@njit(cache=True, error_model="numpy")
def access_layers(need, buf):
    """One access at every layer with the sets ``need`` bool[L, E] (row ``l`` = the experts layer
    ``l`` needs) on the state buffer ``buf``: ``_access`` (same returns)."""
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
    return _access(needed, ptr, buf)


@njit(cache=True, error_model="numpy")
def access_nodes(expert_ids, nodes, buf):
    """One access at every layer with the experts the tokens ``nodes`` route to: ``access_layers``
    with ``expert_mask(expert_ids, nodes, E)``; for a few routed ids per layer the mask is never
    built (per layer the routed ids are gathered, deduplicated and sorted by insertion: a few of
    E), for more it is (``access_layers`` of it).

    Args:
        expert_ids: int16 or int64 [N, L, K] routing (negative ids are padding, skipped).
        nodes: int64[] the tokens of the forward pass (rows of ``expert_ids``).
        buf: the cache's state buffer (:func:`layout`; its header gives L and E).

    Returns:
        ``_access``'s.

    Raises:
        ValueError: an expert id is ``>= E`` or a node id is not a row (``expert_mask``'s
            messages), before the cache is changed.
    """
    num_layers, num_experts = buf[LAYERS], buf[EXPERTS]
    top_k = expert_ids.shape[2]
    # a few routed ids per layer (ar, small trees): sorted by insertion as they come (~ids**2 / 4
    # moves); more (big trees): the bool[L, E] mask set in the routing's memory order, then read
    # in id order per layer (access_layers)
    if nodes.shape[0] * top_k * nodes.shape[0] * top_k > 4 * num_experts:
        return access_layers(expert_mask(expert_ids, nodes, num_experts), buf)
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
    return _access(needed, ptr, buf)


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


@njit(cache=True, error_model="numpy")
def _first_bits(words, capacity):
    """The ``capacity`` lowest set bits of the bitset ``words`` uint64[W] (in place)."""
    taken = 0
    for w in range(words.shape[0]):
        count = _popcount(words[w])
        if taken + count > capacity:
            word, keep = words[w], np.uint64(0)
            for _ in range(capacity - taken):
                low = word & (~word + np.uint64(1))
                keep |= low
                word ^= low
            words[w] = keep
            count = capacity - taken
        taken += count


@njit(cache=True, error_model="numpy")
def _id_words(ids, num_experts, words):
    """The bitset ``words`` uint64[W] of the expert ids ``ids`` int64[K] (negative ids skipped)."""
    for w in range(words.shape[0]):
        words[w] = 0
    for e in ids:
        if e >= num_experts:
            raise IndexError("root_alone_copies: an expert id is >= num_experts")
        if e >= 0:
            words[e >> 6] |= np.uint64(1) << np.uint64(e & 63)


@njit(cache=True, error_model="numpy")
def root_alone_copies(cached_bits, root_ids, num_experts, capacity, predicted_bits, next_layer_ids):
    """``specfit.policies.root_alone_copies`` on bitsets, one pass over the layers (issue 14: its
    numpy form took ~25 array operations, 73-153 us per drafting cycle with prefetch).

    Args:
        cached_bits: uint64[L, W] the cache the planner saw.
        root_ids: int64[L, K] the root's routed experts (negative ids skipped).
        num_experts, capacity: ``E`` and the experts a layer keeps.
        predicted_bits: uint64[L, W] the root's predicted experts (draft prefetch), or
            uint64[0, W] for none; bits at or above ``num_experts`` (the last word's padding) are
            not experts and are ignored.
        next_layer_ids: int64[L - 1, K] the root's next-layer guesses (row ``l`` guesses layer
            ``l + 1``), or int64[0, K] for none.

    Returns:
        ``(demand int64[L], copies int64[3, L])`` as ``specfit.policies.root_alone_copies``.

    Raises:
        IndexError: an expert id ``>= num_experts``.
    """
    num_layers, num_words = cached_bits.shape
    demand = np.zeros(num_layers, np.int64)
    copies = np.zeros((3, num_layers), np.int64)
    scratch = np.zeros((5, num_words), np.uint64)  # a layer's bitsets:
    resident, routed, draft, ahead, chosen = scratch[0], scratch[1], scratch[2], scratch[3], scratch[4]
    # the last word's experts: a predicted bit at or above num_experts is padding, not an expert
    last_word = ~np.uint64(0)
    if num_experts % 64:
        last_word = (np.uint64(1) << np.uint64(num_experts % 64)) - np.uint64(1)
    for layer in range(num_layers):
        for w in range(num_words):
            resident[w] = cached_bits[layer, w]
        _id_words(root_ids[layer], num_experts, routed)
        if predicted_bits.shape[0] > 0 and capacity > 0:  # the draft prefetch: the predicted experts
            for w in range(num_words):
                chosen[w] = predicted_bits[layer, w]
            if num_words > 0:
                chosen[num_words - 1] &= last_word
            _first_bits(chosen, capacity)
            for w in range(num_words):
                draft[w] = chosen[w] & ~resident[w]
                resident[w] |= chosen[w]
        if next_layer_ids.shape[0] > 0 and capacity > 0 and layer > 0:  # then the guesses
            _id_words(next_layer_ids[layer - 1], num_experts, chosen)
            _first_bits(chosen, capacity)
            for w in range(num_words):
                ahead[w] = chosen[w] & ~resident[w]
                resident[w] |= chosen[w]
        num_draft, num_ahead, num_demand = 0, 0, 0
        for w in range(num_words):
            num_draft += _popcount(draft[w])
            num_ahead += _popcount(ahead[w])
            num_demand += _popcount(routed[w] & ~resident[w])
        # the layer waits for its copies up to the last one it routes to: the draft copies in
        # id order, then the next-layer ones
        wait = 0
        for e in root_ids[layer]:
            if e < 0:
                continue
            w, bit = e >> 6, np.uint64(1) << np.uint64(e & 63)
            for copied, before in ((draft, 0), (ahead, num_draft)):
                if copied[w] & bit:
                    rank = before + 1 + _popcount(copied[w] & (bit - np.uint64(1)))
                    for lower in range(w):
                        rank += _popcount(copied[lower])
                    wait = max(wait, rank)
        demand[layer] = num_demand
        copies[0, layer], copies[1, layer], copies[2, layer] = num_draft, num_ahead, wait
        for w in range(num_words):
            draft[w] = 0
            ahead[w] = 0
    return demand, copies


@njit(cache=True)
def root_layer_misses(cached_bits, root_expert_ids, out):
    """Per layer ``l``, the ids ``e >= 0`` of ``root_expert_ids[l]`` whose bit ``e % 64`` of word
    ``e // 64`` is clear in ``cached_bits[l]``, counted into ``out[l]`` (each occurrence: an id
    repeated in a row counts as often as it appears, unlike :func:`root_alone_copies`). The
    throughput guard's paired price asks it in every drafting cycle (its numpy form, five array
    operations on an ``[L, K]`` array, took ~15-70 us; ``tests/test_specfit_root_alone_kernels.py``
    compares them).

    Args:
        cached_bits: uint64[L, W] cache bitsets (``ExpertCache.cached_bits``).
        root_expert_ids: int[L, K] the root's routed experts (negative ids: padding, not counted).
        out: int64[L], overwritten.

    Returns:
        -1 when every id is below ``64 * W`` (``out`` filled), else the first id at or above it
        (``out`` then partly filled): the caller raises.
    """
    num_layers, k = root_expert_ids.shape
    num_words = cached_bits.shape[1]
    for layer in range(num_layers):
        n = 0
        for j in range(k):
            e = np.int64(root_expert_ids[layer, j])
            if e < 0:
                continue
            word = e >> 6
            if word >= num_words:
                return e
            if (cached_bits[layer, word] >> np.uint64(e & 63)) & np.uint64(1) == 0:
                n += 1
        out[layer] = n
    return -1
