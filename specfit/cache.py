"""Per-layer expert caches on the device: LRU, LFU, static most-frequent and Belady (oracle).

One :class:`ExpertCache` object is driven by the live engine and by the simulator alike with
``cache.access(layer, expert_ids)`` once per forward pass per layer, so the same access sequence
gives the same hits, misses and evictions wherever it is replayed. ``cache.access_layers(mask)``
(bool[L, E]) is the batched form the simulator uses: exactly ``access(l, row l)`` for every
layer in order, as a few vectorised operations over all layers.

Semantics of one access (all policies):
* ``expert_ids`` is the SET the forward pass needs at ``layer``: deduplicated, processed in
  ascending id order. Every one of them is on the device after the call.
* hits = requested experts already cached; misses = the others (each costs one H2D transfer).
* A miss is kept if a slot is free or a cached expert outside the current access can be evicted
  (victim chosen by the policy); otherwise it is transient (transferred, used, dropped). An
  expert of the current access is never evicted.

Policies (victim rule; sources):
* ``lru``: least recently used (hits and kept misses are refreshed; within an access ascending id
  order). Classic; the policy reported for Qwen3-30B-A3B expert caches (reference-figures.md).
* ``lfu``: smallest access count (counted over all accesses, also while not cached, i.e.
  "perfect" LFU), ties by least recent, then smaller id.
* ``static``: the ``capacity`` most frequent experts of a fitted frequency table (ties: smaller
  id) stay resident; nothing is inserted or evicted; ``warm`` is a no-op.
* ``belady``: Belady's MIN with bypass (Belady 1966): given the future access sequence per layer,
  keep the experts whose next use is soonest; a miss whose next use is later than every
  evictable entry's is transient. Access k at a layer consumes the k-th future entry of that
  layer (beyond the given future nothing has a next use, so nothing new is kept); an oracle
  bound for the simulator (the live engine cannot know the future).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specfit import bitsets

CACHE_POLICIES: tuple[str, ...] = ("lru", "lfu", "static", "belady")
#: One line per cache policy for ``--help`` (see the module docstring for the exact rules).
CACHE_POLICY_HELP: dict[str, str] = {
    "lru": "evict the least recently used expert",
    "lfu": "evict the least frequently used expert",
    "static": "pin the most frequent experts (a fitted frequency table); nothing inserted or evicted",
    "belady": "Belady's MIN with bypass: keep the experts needed soonest (future-knowing oracle bound; "
    "simulator only)",
}
_NEVER = float("inf")


@dataclass(frozen=True)
class CacheAccess:
    """Result of one access: int64[] expert ids (ascending) that hit, missed and were evicted."""

    hits: np.ndarray
    misses: np.ndarray
    evicted: np.ndarray

    @property
    def num_hits(self) -> int:
        """Hits (count)."""
        return int(self.hits.shape[0])

    @property
    def num_misses(self) -> int:
        """Misses = H2D transfers (count)."""
        return int(self.misses.shape[0])


MISS_EMA_WEIGHT = 0.1
"""Weight of the newest access in :attr:`CacheStats.layer_miss_fraction` (about a 10-access memory)."""


def miss_ema_step(old: float, frac: float) -> float:
    """One access's update of a per-layer miss-fraction moving average (a fraction in [0, 1]):
    ``frac`` when ``old`` is NaN (the layer's first access), else ``old + MISS_EMA_WEIGHT * (frac -
    old)`` (an exponential moving average; the compiled cache access does the same float64
    arithmetic). Used by :meth:`CacheStats.record` and ``specfit.prefetch.PrefetchLedger.accessed``."""
    return frac if old != old else old + MISS_EMA_WEIGHT * (frac - old)


def miss_ema_steps(old: np.ndarray, frac: np.ndarray) -> np.ndarray:
    """:func:`miss_ema_step` element-wise over float64 arrays of the same shape (the same IEEE
    operations per element: bit for bit the scalar steps). Used by :meth:`CacheStats.record_layers`
    and ``specfit.prefetch.PrefetchLedger.accessed_layers``."""
    return np.where(np.isnan(old), frac, old + MISS_EMA_WEIGHT * (frac - old))


HITS, MISSES, EVICTIONS = 0, 1, 2
"""The kinds of keys :meth:`LayerAccesses.keys` returns (its ``kind`` argument): the hits, the
misses or the evictions of an access (also the compiled access's order of its counts and keys)."""


@dataclass(frozen=True, eq=False)
class LayerAccesses:
    """Result of :meth:`ExpertCache.access_layers`: one access per layer, as bool[L, E] masks.

    Attributes:
        hits, misses, evicted: bool[L, E]; row ``l`` holds what :class:`CacheAccess` of the
            access at layer ``l`` holds as id arrays (hits, misses = H2D transfers, evictions).
        num_hits, num_misses, num_evicted: int64[L] row counts.
    """

    hits: np.ndarray
    misses: np.ndarray
    evicted: np.ndarray
    num_hits: np.ndarray
    num_misses: np.ndarray
    num_evicted: np.ndarray

    def keys(self, kind: int) -> np.ndarray:
        """The ascending int64 ``layer * E + expert`` keys of the hits (``kind`` :data:`HITS`),
        misses (:data:`MISSES`) or evictions (:data:`EVICTIONS`) over all layers (what per-layer id
        lists say, as one array)."""
        return np.flatnonzero((self.hits, self.misses, self.evicted)[kind])

    def hit_ids(self) -> list[np.ndarray]:
        """Per layer, the int64[] expert ids that hit, ascending (``L`` arrays)."""
        return _rows_to_ids(self.hits, self.num_hits)

    def miss_ids(self) -> list[np.ndarray]:
        """Per layer, the int64[] expert ids that missed, ascending (``L`` arrays)."""
        return _rows_to_ids(self.misses, self.num_misses)

    def evicted_ids(self) -> list[np.ndarray]:
        """Per layer, the int64[] expert ids evicted, ascending (``L`` arrays)."""
        return _rows_to_ids(self.evicted, self.num_evicted)


def _rows_to_ids(mask: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """bool[L, E] -> ``L`` ascending int64 id arrays (one nonzero scan, split by row counts)."""
    return _keys_to_ids(np.flatnonzero(mask), counts, mask.shape[1])


def _keys_to_ids(keys: np.ndarray, counts: np.ndarray, num_experts: int) -> list[np.ndarray]:
    """Ascending ``layer * E + expert`` keys -> ``L`` ascending int64 id arrays (split by the
    per-layer ``counts``)."""
    cols = keys % num_experts
    ends = np.cumsum(counts).tolist()
    return [cols[a:b] for a, b in zip([0, *ends[:-1]], ends)]


class _KeyedLayerAccesses(LayerAccesses):
    """:class:`LayerAccesses` of the compiled access, held as the ascending ``layer * E + expert``
    keys of its hits, misses and evictions (a few of ``L * E``): the bool[L, E] masks are built
    when first read (most simulated cycles read only the counts and the id lists)."""

    @classmethod
    def of(cls, num_experts: int, out: np.ndarray, num_counts: int, hits: int, misses: int) -> _KeyedLayerAccesses:
        """From the compiled access's result ``out``: int64[3, L] per-layer counts (hits, misses,
        evictions; ``num_counts`` = 3 L words), then the keys of its ``hits`` hits, ``misses``
        misses and the evictions, back to back (``cache_kernels.layout``'s ``out``)."""
        counts = out[:num_counts].reshape(3, -1)
        out_ = object.__new__(cls)  # the frozen dataclass's fields, without its __init__
        out_.__dict__.update(
            num_hits=counts[0],
            num_misses=counts[1],
            num_evicted=counts[2],
            _out=out,
            _ends=(num_counts, num_counts + hits, num_counts + hits + misses, out.shape[0]),
            _num_experts=num_experts,
            _masks={},
        )
        return out_

    def keys(self, kind: int) -> np.ndarray:
        """The ascending int64 ``layer * E + expert`` keys of the hits (``kind`` :data:`HITS`),
        misses (:data:`MISSES`) or evictions (:data:`EVICTIONS`): a view of the compiled access's
        result, no mask built."""
        ends = self._ends
        return self._out[ends[kind] : ends[kind + 1]]

    def _mask(self, kind: int) -> np.ndarray:
        mask = self._masks.get(kind)
        if mask is None:
            num_layers = self.num_hits.shape[0]
            mask = np.zeros(num_layers * self._num_experts, dtype=bool)
            mask[self.keys(kind)] = True
            mask = self._masks[kind] = mask.reshape(num_layers, self._num_experts)
        return mask

    hits = property(lambda self: self._mask(HITS), doc="bool[L, E] hits (built on first read).")
    misses = property(lambda self: self._mask(MISSES), doc="bool[L, E] misses (built on first read).")
    evicted = property(lambda self: self._mask(EVICTIONS), doc="bool[L, E] evictions (built on first read).")

    def hit_ids(self) -> list[np.ndarray]:
        """Per layer, the int64[] expert ids that hit, ascending (``L`` arrays)."""
        return _keys_to_ids(self.keys(HITS), self.num_hits, self._num_experts)

    def miss_ids(self) -> list[np.ndarray]:
        """Per layer, the int64[] expert ids that missed, ascending (``L`` arrays)."""
        return _keys_to_ids(self.keys(MISSES), self.num_misses, self._num_experts)

    def evicted_ids(self) -> list[np.ndarray]:
        """Per layer, the int64[] expert ids evicted, ascending (``L`` arrays)."""
        return _keys_to_ids(self.keys(EVICTIONS), self.num_evicted, self._num_experts)


@dataclass
class CacheStats:
    """Running totals (counts), overall and per layer (``int64[L]`` properties).

    Also keeps, per layer, an exponential moving average of each access's miss fraction
    (misses / experts accessed, weight :data:`MISS_EMA_WEIGHT` on the newest access): the
    observed miss rate that the union-size predictor uses to price a subtree's expected
    union (see :class:`specfit.predictors.UnionSizePredictor`). Being a function of the
    access sequence alone, it is identical in the live engine and the simulator.
    """

    num_layers: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    _layer_counts: np.ndarray = field(default=None, repr=False)  # int64[3, L]: hits, misses, evictions
    _layer_miss_ema: np.ndarray = field(default=None, repr=False)  # float64[L]

    def __post_init__(self) -> None:
        if self._layer_counts is None:
            self._layer_counts = np.zeros((3, self.num_layers), dtype=np.int64)
        if self._layer_miss_ema is None:
            self._layer_miss_ema = np.full(self.num_layers, np.nan, dtype=np.float64)

    def record(self, layer: int, hits: int, misses: int, evictions: int) -> None:
        """Add one access's counts (and update the layer's miss-fraction average)."""
        self.hits += hits
        self.misses += misses
        self.evictions += evictions
        counts = self._layer_counts
        counts[0, layer] += hits
        counts[1, layer] += misses
        counts[2, layer] += evictions
        total = hits + misses
        if total:
            frac = misses / total
            self._layer_miss_ema[layer] = miss_ema_step(float(self._layer_miss_ema[layer]), frac)

    def record_layers(self, hits: np.ndarray, misses: np.ndarray, evictions: np.ndarray) -> None:
        """Add one access at EVERY layer: int64[L] counts each (same result as ``L`` :meth:`record` calls).

        Element-wise float64 arithmetic is the same IEEE operation per layer as the scalar
        update, so the moving averages are bit-identical to the per-layer path.
        """
        self.hits += int(hits.sum())
        self.misses += int(misses.sum())
        self.evictions += int(evictions.sum())
        self._layer_counts[0] += hits
        self._layer_counts[1] += misses
        self._layer_counts[2] += evictions
        total = hits + misses
        seen = total > 0
        if seen.any():
            frac = misses[seen] / total[seen]
            old = self._layer_miss_ema[seen]
            self._layer_miss_ema[seen] = miss_ema_steps(old, frac)

    @property
    def layer_miss_fraction(self) -> np.ndarray:
        """float64[L] moving average of the per-access miss fraction; NaN before a layer's first access."""
        return self._layer_miss_ema.copy()

    @property
    def layer_hits(self) -> np.ndarray:
        """int64[L] hits per layer."""
        return self._layer_counts[0].copy()

    @property
    def layer_misses(self) -> np.ndarray:
        """int64[L] misses per layer."""
        return self._layer_counts[1].copy()

    @property
    def layer_evictions(self) -> np.ndarray:
        """int64[L] evictions per layer."""
        return self._layer_counts[2].copy()

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); NaN before any access."""
        total = self.hits + self.misses
        return self.hits / total if total else float("nan")


def _header_int(slot: int, doc: str) -> property:
    """An int property of :class:`ExpertCache` held in its state buffer's header, at the slot
    ``self._slots[slot]``."""

    def get(self: ExpertCache) -> int:
        return int(self._buf[self._slots[slot]])

    def put(self: ExpertCache, value: int) -> None:
        self._buf[self._slots[slot]] = value

    return property(get, put, doc=doc)


class ExpertCache:
    """Per-layer expert caches with one policy (build with :func:`make_expert_cache`).

    State is held as arrays over all layers, so one access is a few vectorised operations and
    :meth:`access_layers` does one access at every layer in one go: ``stamp[l, e]`` is -1 when
    expert ``e`` is not cached at layer ``l``, else its recency (larger = used later; an access
    stamps its hits in ascending id order, then its kept misses in ascending id order, exactly
    the order an LRU list would hold them); LFU keeps ``freq[l, e]`` and ``tick[l, e]``. These
    arrays, the statistics' per-layer arrays and the cached sets' bitsets are views of one int64
    state buffer (``specfit.cache_kernels.layout``), which the compiled access takes as its one
    state argument (issue 14: 17 arguments before, ~3 us each in numba's dispatcher once cold).
    The buffer also holds the compiled LRU's recency list per layer (its victims are read off
    the list's oldest end, not searched: issue 14); the numpy paths leave it stale and clear
    the flag that makes the compiled access rebuild it (with the bitsets, from ``stamp``).

    Attributes:
        policy: one of :data:`CACHE_POLICIES`.
        num_layers, num_experts: ``L`` and ``E``.
        capacity: int64[L] experts kept per layer.
        stats: :class:`CacheStats`.
    """

    def __init__(
        self,
        policy: str,
        num_layers: int,
        num_experts: int,
        capacity: np.ndarray,
        *,
        frequency: np.ndarray | None = None,
        future: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> None:
        self.policy = policy
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.capacity = capacity
        self._ids = np.arange(num_experts, dtype=np.int64)
        self._words = bitsets.num_words(num_experts)  # uint64 words per layer's bitset
        kernels = _cache_kernels()  # the state buffer's layout (numba loads; nothing compiles)
        parts = kernels.layout(num_layers, num_experts, self._words)
        self._buf = np.zeros(kernels.buffer_words(num_layers, num_experts, self._words), dtype=np.int64)
        header = (num_layers, num_experts, self._words, kernels.POLICY_CODES.get(policy, -1), 0, 0, 0)
        self._buf[: len(header)] = header
        self._buf[kernels.VERSION] = kernels.LAYOUT_VERSION
        self._buf[kernels.WEIGHT : kernels.WEIGHT + 1].view(np.float64)[0] = MISS_EMA_WEIGHT
        self._buf[kernels.AT_STAMP : kernels.AT_STAMP + len(parts)] = [offset for offset, _ in parts.values()]
        self._slots = (kernels.STAMP_BASE, kernels.CLOCK, kernels.BITS_VALID)
        self._out = (parts["out"][0], 3 * num_layers)  # an access's result: (offset, its counts' length)
        self._bind()  # also makes self.stats
        self._stamp[:] = -1
        self._tick[:] = -1
        self._cap[:] = np.asarray(capacity, dtype=np.int64)
        self.stats._layer_miss_ema[:] = np.nan
        self._uses: list[dict[int, list[int]]] = []
        self._ptr: list[dict[int, int]] = []
        self._step = [0] * num_layers
        if policy == "static":
            if frequency is None:
                raise ValueError("ExpertCache: policy 'static' needs frequency (float[L, E])")
            for layer in range(num_layers):
                order = np.lexsort((np.arange(num_experts), -frequency[layer]))
                self._stamp[layer, np.sort(order[: self._cap[layer]])] = 0
            self._count[:] = self._cap
        if policy == "belady":
            if future is None:
                raise ValueError("ExpertCache: policy 'belady' needs future (per-layer access sequence)")
            for layer in range(num_layers):
                uses: dict[int, list[int]] = {}
                for k, ids in enumerate(future[layer]):
                    for e in sorted({int(x) for x in np.asarray(ids).ravel() if int(x) >= 0}):
                        uses.setdefault(e, []).append(k)
                self._uses.append(uses)
                self._ptr.append(dict.fromkeys(uses, 0))

    def _bind(self) -> None:
        """Make the state's arrays views of the buffer ``self._buf`` (:func:`cache_kernels.layout`):
        ``_stamp``, ``_freq``, ``_tick`` int64[L, E], ``_count``, ``_cap`` int64[L], the cached
        sets ``_bits_words`` uint64[L, W] and the statistics' arrays (``self.stats``, made here
        when missing)."""
        buf, shape = self._buf, (self.num_layers, self.num_experts)
        kernels = _cache_kernels()
        stamp, freq, tick, count, cap, stats, ema, bits = (
            buf[int(buf[slot]) : int(buf[slot + 1])] for slot in range(kernels.AT_STAMP, kernels.AT_OUT)
        )
        self._stamp, self._freq, self._tick = stamp.reshape(shape), freq.reshape(shape), tick.reshape(shape)
        self._count, self._cap = count, cap
        self._bits_words = bits.view(np.uint64).reshape(self.num_layers, self._words)
        if "stats" not in self.__dict__:
            self.stats = CacheStats(self.num_layers, _layer_counts=stats.reshape(3, -1), _layer_miss_ema=ema.view(np.float64))
        else:  # a copy's statistics: their counts, on this buffer
            self.stats._layer_counts = stats.reshape(3, -1)
            self.stats._layer_miss_ema = ema.view(np.float64)

    def __getstate__(self) -> dict:
        """The state without the buffer's views (``copy.deepcopy`` and pickle; made again on load)."""
        state = self.__dict__.copy()
        for name in ("_stamp", "_freq", "_tick", "_count", "_cap", "_bits_words"):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        """Load a state made by :meth:`__getstate__`; raises ValueError (``cache_kernels.check_buffer``)
        when its buffer is not of this code's layout (e.g. pickled before a layout change), so
        the compiled access never reads a buffer of another layout."""
        kernels = _cache_kernels()
        policy = state.get("policy")
        words = bitsets.num_words(int(state.get("num_experts", 0)))
        code = kernels.POLICY_CODES.get(policy, -1)
        kernels.check_buffer(state.get("_buf"), state.get("num_layers", -1), state.get("num_experts", -1), words, code)
        if not state["_buf"].flags.writeable:  # e.g. pickle protocol 5's out-of-band buffers: own a copy
            state = {**state, "_buf": state["_buf"].copy()}
        self.__dict__.update(state)
        self._bind()

    _next_stamp = _header_int(0, "The next access's first recency stamp (the buffer's header).")
    _clock = _header_int(1, "The LFU clock: experts accessed so far (the buffer's header).")

    @property
    def _bits(self) -> np.ndarray | None:
        """uint64[L, W] the cached sets as the last batched access left them, or None when the
        cache changed since (the header's flag; the compiled access then rebuilds them)."""
        return self._bits_words if self._buf[self._slots[2]] else None

    @_bits.setter
    def _bits(self, value: None) -> None:
        if value is not None:
            raise ValueError("ExpertCache._bits: only None (the cached sets changed) can be set")
        self._buf[self._slots[2]] = 0

    # ---- internals -------------------------------------------------------------------------
    def _next_use(self, layer: int, e: int, after: int) -> float:
        uses = self._uses[layer].get(e)
        if not uses:
            return _NEVER
        ptr = self._ptr[layer]
        i = ptr[e]
        while i < len(uses) and uses[i] <= after:
            i += 1
        ptr[e] = i
        return float(uses[i]) if i < len(uses) else _NEVER

    def _check(self, layer: int, expert_ids: object) -> np.ndarray:
        """int64[] ascending distinct ids of one access at ``layer`` (range-checked)."""
        if not 0 <= int(layer) < self.num_layers:
            raise ValueError(f"ExpertCache.access: layer {layer} out of range [0, {self.num_layers})")
        ids = np.asarray(expert_ids).ravel()
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            ids = np.asarray([int(x) for x in ids.tolist()], dtype=np.int64)
        ids = np.unique(ids.astype(np.int64, copy=False))
        if ids.size and (ids[0] < 0 or ids[-1] >= self.num_experts):
            bad = int(ids[0]) if ids[0] < 0 else int(ids[-1])
            raise ValueError(f"ExpertCache.access: expert id {bad} out of range [0, {self.num_experts})")
        return ids

    def _victims(self, rows: np.ndarray, evictable: np.ndarray, num_evict: np.ndarray) -> np.ndarray:
        """bool[R, E]: the first ``num_evict[r]`` evictable experts of each row by the policy's rule.

        LRU: smallest stamp (least recent; stamps are distinct within a layer). LFU: smallest
        (count, tick, id). Their keys cannot change during one access (only current experts are
        touched), so one ordering per access is exact.
        """
        big = np.iinfo(np.int64).max
        if self.policy == "lru":  # distinct stamps: the victims are the keys up to the k-th smallest
            key = np.where(evictable, self._stamp[rows], big)
            kth = np.sort(key, axis=1)[np.arange(key.shape[0]), num_evict - 1]
            return evictable & (key <= kth[:, None])
        else:
            freq = np.where(evictable, self._freq[rows], big)
            ids = np.broadcast_to(self._ids, freq.shape)
            order = np.lexsort((ids, self._tick[rows], freq), axis=-1)
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(self._ids, order.shape), axis=1)
        return evictable & (rank < num_evict[:, None])

    def _admit_belady(self, layer: int, need: np.ndarray, miss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Belady's MIN with bypass at one layer: (kept misses, evicted) as bool[E] rows."""
        cap = int(self._cap[layer])
        kept = np.zeros_like(miss)
        evicted = np.zeros_like(miss)
        if cap == 0:
            return kept, evicted
        cached = set(np.flatnonzero(self._stamp[layer] >= 0).tolist())
        step = self._step[layer]
        order: list[int] | None = None
        for e in np.flatnonzero(miss).tolist():
            if len(cached) >= cap:
                if order is None:  # farthest next use first, ties: larger id first
                    candidates = [c for c in cached if not need[c]]
                    order = sorted(
                        candidates, key=lambda c: (self._next_use(layer, c, step), c), reverse=True
                    )
                if not order:
                    break
                victim = order[0]
                if self._next_use(layer, victim, step) <= self._next_use(layer, e, step):
                    continue  # bypass: needed later than every evictable expert
                order.pop(0)
                cached.discard(victim)
                evicted[victim] = True
            cached.add(e)
            kept[e] = True
        return kept, evicted

    def _apply(self, rows: np.ndarray | slice, need: np.ndarray, count: bool) -> tuple[np.ndarray, ...]:
        """One access (``count``) or warm at each layer of ``rows`` with the sets ``need`` bool[R, E].

        ``rows``: int64[R] layer ids, or ``slice(None)`` for every layer in order.
        Returns ``(hit, miss, evicted, num_hit, num_miss, num_evicted)``: bool[R, E] masks and
        int64[R] counts. Implements the module docstring's semantics: hits are refreshed, then
        misses (ascending id) fill free slots, then replace evictable experts (cached, not in
        this access) in the policy's victim order; once none is left the remaining misses are
        transient. LFU counts every expert of an access (``count``).
        """
        num_experts = self.num_experts
        self._bits = None
        stamp = self._stamp[rows]
        cached_count = self._count[rows]
        hit = need & (stamp >= 0)
        miss = need ^ hit
        num_hit = hit.sum(axis=1)
        num_miss = need.sum(axis=1) - num_hit
        base = self._next_stamp
        self._next_stamp += 2 * num_experts
        stamp = np.where(hit, base + self._ids, stamp)
        if count and self.policy == "lfu":
            order = np.cumsum(need, axis=None).reshape(need.shape)
            tick = self._tick[rows]
            tick[need] = self._clock + order[need]
            self._tick[rows] = tick
            self._freq[rows] += need
            self._clock += int(order[-1, -1]) if order.size else 0
        evicted = np.zeros_like(need)
        if self.policy in ("lru", "lfu"):
            free = self._cap[rows] - cached_count
            kept_count = np.minimum(num_miss, free + (cached_count - num_hit))  # + evictable
            num_evicted = np.maximum(kept_count - free, 0)
            if num_evicted.any():
                sel = np.flatnonzero(num_evicted)
                evictable = (stamp[sel] >= 0) & ~need[sel]
                layers = np.arange(self.num_layers)[rows][sel]
                evicted[sel] = self._victims(layers, evictable, num_evicted[sel])
            if np.array_equal(kept_count, num_miss):
                kept = miss  # no transient miss (the usual case): skip the running count
            else:
                kept = miss & (np.cumsum(miss, axis=1) <= kept_count[:, None])
        elif self.policy == "belady":
            kept = np.zeros_like(need)
            for r, layer in enumerate(np.arange(self.num_layers)[rows].tolist()):
                kept[r], evicted[r] = self._admit_belady(layer, need[r], miss[r])
            kept_count, num_evicted = kept.sum(axis=1), evicted.sum(axis=1)
        else:  # static: nothing is inserted or evicted
            kept, kept_count = evicted, 0
            num_evicted = np.zeros_like(num_hit)
        stamp[evicted] = -1
        self._stamp[rows] = np.where(kept, base + num_experts + self._ids, stamp)
        self._count[rows] = cached_count + kept_count - num_evicted
        return hit, miss, evicted, num_hit, num_miss, num_evicted

    def _apply_one(self, layer: int, ids: np.ndarray, count: bool) -> tuple[np.ndarray, ...]:
        """:meth:`_apply` for one layer on its id list (small arrays; the live engine's path).

        Same rules, same state updates; returns ``(hits, misses, evicted)`` ascending int64 ids.
        """
        num_experts = self.num_experts
        self._bits = None
        row = self._stamp[layer]  # a view: updated in place
        cached_now = row[ids] >= 0
        hits, misses = ids[cached_now], ids[~cached_now]
        base = self._next_stamp
        self._next_stamp += 2 * num_experts
        row[hits] = base + hits
        if count and self.policy == "lfu":
            self._tick[layer, ids] = self._clock + np.arange(1, ids.size + 1)
            self._freq[layer, ids] += 1
            self._clock += int(ids.size)
        evicted = ids[:0]
        kept = misses[:0]
        cached_count = int(self._count[layer])
        if self.policy in ("lru", "lfu"):
            free = int(self._cap[layer]) - cached_count
            kept_count = min(misses.size, free + cached_count - hits.size)
            num_evicted = max(kept_count - free, 0)
            if num_evicted:
                evictable = row >= 0
                evictable[ids] = False
                cand = np.flatnonzero(evictable)
                if self.policy == "lru":
                    order = np.argsort(row[cand], kind="stable")
                else:
                    order = np.lexsort((cand, self._tick[layer, cand], self._freq[layer, cand]))
                evicted = np.sort(cand[order[:num_evicted]])
                row[evicted] = -1
            kept = misses[:kept_count]
        elif self.policy == "belady":
            need = np.zeros(num_experts, dtype=bool)
            need[ids] = True
            miss = np.zeros(num_experts, dtype=bool)
            miss[misses] = True
            kept_mask, evicted_mask = self._admit_belady(layer, need, miss)
            kept, evicted = np.flatnonzero(kept_mask), np.flatnonzero(evicted_mask)
            row[evicted] = -1
        row[kept] = base + num_experts + kept
        self._count[layer] = cached_count + kept.size - evicted.size
        return hits, misses, evicted

    # ---- public API --------------------------------------------------------------------------
    def access(self, layer: int, expert_ids: object) -> CacheAccess:
        """One forward pass at ``layer`` needs ``expert_ids`` (int[...], any order/duplicates).

        Returns:
            :class:`CacheAccess` with ascending int64 arrays of hits, misses and evicted ids.

        Raises:
            ValueError: ``layer`` or an expert id out of range (the message names it).
        """
        ids = self._check(layer, expert_ids)
        layer = int(layer)
        hits, misses, evicted = self._apply_one(layer, ids, True)
        if self.policy == "belady":
            self._step[layer] += 1
        out = CacheAccess(hits=hits, misses=misses, evicted=evicted)
        self.stats.record(layer, out.num_hits, out.num_misses, int(out.evicted.shape[0]))
        return out

    def access_layers(self, expert_mask: np.ndarray, *, reference: bool = False) -> LayerAccesses:
        """One forward pass over all layers: the same as ``access(l, ids_l)`` for ``l = 0..L-1``.

        Args:
            expert_mask: bool[L, E], row ``l`` = the experts layer ``l`` needs (an empty row is
                still an access: it advances Belady's position and changes nothing else).
            reference: use the vectorised numpy implementation (``_apply``) instead of the
                compiled one (:mod:`specfit.cache_kernels`, lru/lfu/static); both give the same
                results and state (the numpy one is the oracle of the compiled one in the tests).

        Returns:
            :class:`LayerAccesses` (bool[L, E] hits, misses, evicted and int64[L] counts); the
            statistics and the cache state end up exactly as after the ``L`` single accesses.

        Raises:
            ValueError: ``expert_mask`` is not bool[L, E].
        """
        need = np.asarray(expert_mask)
        if need.dtype != np.bool_ or need.shape != (self.num_layers, self.num_experts):
            raise ValueError(
                f"ExpertCache.access_layers: expert_mask must be bool[{self.num_layers}, "
                f"{self.num_experts}], got {need.dtype}{list(need.shape)}"
            )
        if not reference and self.policy != "belady":  # compiled once, cached by numba
            return self._compiled(_cache_kernels().access_layers, need if need.flags.c_contiguous else np.ascontiguousarray(need))
        hit, miss, evicted, num_hit, num_miss, num_evicted = self._apply(slice(None), need, True)
        if self.policy == "belady":
            self._step = [s + 1 for s in self._step]
        out = LayerAccesses(
            hits=hit,
            misses=miss,
            evicted=evicted,
            num_hits=num_hit,
            num_misses=num_miss,
            num_evicted=num_evicted,
        )
        self.stats.record_layers(out.num_hits, out.num_misses, out.num_evicted)
        return out

    def access_nodes(self, expert_ids: np.ndarray, nodes: np.ndarray) -> LayerAccesses:
        """One forward pass of the tokens ``nodes``: ``access_layers(mask)`` with ``mask[l, e]``
        true where any of them routes to expert ``e`` at layer ``l`` (the simulator's access per
        cycle); for lru, lfu and static the mask is never built (``cache_kernels.access_nodes``).

        Args:
            expert_ids: int[N, L, K] routing (ids in [0, E); negative ids are padding, skipped).
            nodes: int[] rows of ``expert_ids`` (the tokens of the forward pass).

        Returns:
            :class:`LayerAccesses`, as :meth:`access_layers` (same results and state).

        Raises:
            ValueError: ``expert_ids`` is not [N, L, K] with ``L`` layers, an expert id is ``>= E`` or a
                node id is not a row of ``expert_ids``
                (the cache is then unchanged).
        """
        ids = np.asarray(expert_ids)
        if ids.ndim != 3 or ids.shape[1] != self.num_layers:
            raise ValueError(
                f"ExpertCache.access_nodes: expert_ids must be int[N, {self.num_layers}, K], got {list(ids.shape)}"
            )
        if ids.dtype not in (np.int16, np.int64):
            ids = ids.astype(np.int64)
        nodes = np.asarray(nodes, dtype=np.int64)
        kernels = _cache_kernels()
        if self.policy == "belady":
            return self.access_layers(kernels.expert_mask(ids, nodes, self.num_experts))
        return self._compiled(kernels.access_nodes, ids, nodes)

    def _compiled(self, kernel: Any, *inputs: np.ndarray) -> LayerAccesses:
        """One compiled access (``kernel``: ``cache_kernels.access_layers`` or ``.access_nodes``
        with its ``inputs``), the cache's state, statistics and bitsets updated in place in its
        buffer; the result is one copy of the buffer's ``out`` part."""
        hits, misses, evictions = kernel(*inputs, self._buf)
        stats = self.stats
        stats.hits += hits
        stats.misses += misses
        stats.evictions += evictions
        at, num_counts = self._out
        out = self._buf[at : at + num_counts + hits + misses + evictions].copy()
        return _KeyedLayerAccesses.of(self.num_experts, out, num_counts, hits, misses)

    def warm(self, layer: int, expert_ids: object) -> None:
        """Insert ``expert_ids`` without counting hits, misses or frequencies (static: no-op).

        Fills free slots first, then evicts by the policy like an access would.
        """
        ids = self._check(layer, expert_ids)
        if self.policy == "static":
            return
        self._apply_one(int(layer), ids, False)

    def contains(self, layer: int, expert: int) -> bool:
        """Whether ``expert`` is cached at ``layer`` (False for an id outside [0, E))."""
        e = int(expert)
        return 0 <= e < self.num_experts and bool(self._stamp[int(layer), e] >= 0)

    def cached_ids(self, layer: int) -> np.ndarray:
        """int64[] cached experts at ``layer``, ascending."""
        return np.flatnonzero(self._stamp[int(layer)] >= 0).astype(np.int64, copy=False)

    def cached_mask(self, layer: int | None = None) -> np.ndarray:
        """bool[L, E]: which experts are cached at each layer (a copy); with ``layer``, its row
        bool[E] only (a copy; the prefetch's warms ask per layer)."""
        return (self._stamp if layer is None else self._stamp[layer]) >= 0

    def cached_bits(self) -> np.ndarray:
        """uint64[L, W] bitsets of the cached experts (a copy)."""
        words = self._bits  # a property: read once (the simulator asks once per cycle)
        if words is not None:  # made by the last batched access, nothing changed since
            return words.copy()
        words = bitsets.num_words(self.num_experts)
        flags = np.zeros((self.num_layers, words * bitsets.WORD_BITS), dtype=bool)
        flags[:, : self.num_experts] = self._stamp >= 0
        packed = np.packbits(flags, axis=1, bitorder="little")
        return packed.view("<u8").astype(np.uint64, copy=False).reshape(self.num_layers, words)

    def copy(self) -> ExpertCache:
        """Independent deep copy (same contents, statistics and future position)."""
        return copy.deepcopy(self)


_KERNELS: list = []  # specfit.cache_kernels once imported


def _cache_kernels() -> Any:
    """:mod:`specfit.cache_kernels`, imported on first use (when the first cache is built: numba
    loads then, not when ``specfit`` is imported) and kept: the simulator accesses the cache once
    per cycle."""
    if not _KERNELS:
        from specfit import cache_kernels

        _KERNELS.append(cache_kernels)
    return _KERNELS[0]


def make_expert_cache(
    policy: str,
    num_layers: int,
    num_experts: int,
    capacity_per_layer: int | Sequence[int] | np.ndarray,
    *,
    frequency: np.ndarray | None = None,
    future: Sequence[Sequence[Sequence[int]]] | None = None,
) -> ExpertCache:
    """Build an :class:`ExpertCache`.

    Args:
        policy: ``"lru"``, ``"lfu"``, ``"static"`` or ``"belady"``.
        num_layers: ``L`` (> 0).
        num_experts: ``E`` (> 0).
        capacity_per_layer: experts kept per layer, an int or int[L], each in [0, E].
        frequency: float[L, E] access frequencies (``"static"`` only, required).
        future: per layer, the sequence of expert-id sets of its future accesses (``"belady"``
            only, required).

    Raises:
        ValueError: unknown policy (lists the valid ones), bad sizes, capacity outside [0, E],
            missing or mis-shaped ``frequency`` / ``future``.
    """
    if policy not in CACHE_POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; expected one of {list(CACHE_POLICIES)}")
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts)):
        if isinstance(value, bool) or int(value) != value or value <= 0:
            raise ValueError(f"make_expert_cache: {name} must be a positive integer, got {value!r}")
    num_layers, num_experts = int(num_layers), int(num_experts)
    cap = np.asarray(capacity_per_layer)
    if cap.ndim == 0:
        cap = np.full(num_layers, cap)
    if cap.shape != (num_layers,) or not np.all(cap == np.round(cap)):
        raise ValueError(
            f"capacity_per_layer: expected an integer or int[{num_layers}], got {capacity_per_layer!r}"
        )
    cap = cap.astype(np.int64)
    if cap.min() < 0 or cap.max() > num_experts:
        raise ValueError(f"capacity_per_layer: expected values in [0, {num_experts}] (experts per layer)")
    if policy == "static":
        if frequency is None:
            raise ValueError("make_expert_cache: policy 'static' needs frequency (float[L, E])")
        frequency = np.asarray(frequency, dtype=np.float64)
        if frequency.shape != (num_layers, num_experts) or not np.all(np.isfinite(frequency)):
            raise ValueError(
                f"frequency: expected finite float[{num_layers}, {num_experts}], got {frequency.shape}"
            )
    if policy == "belady":
        if future is None:
            raise ValueError("make_expert_cache: policy 'belady' needs future (per-layer access sequence)")
        if len(future) != num_layers:
            raise ValueError(f"future: expected {num_layers} per-layer sequences, got {len(future)}")
    return ExpertCache(policy, num_layers, num_experts, cap, frequency=frequency, future=future)
