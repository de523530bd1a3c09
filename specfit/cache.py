"""Per-layer expert caches on the device: LRU, LFU, static most-frequent and Belady (oracle).

One :class:`ExpertCache` object is driven by the live engine and by the simulator alike with
``cache.access(layer, expert_ids)`` once per forward pass per layer, so the same access sequence
gives the same hits, misses and evictions wherever it is replayed.

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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specfit import bitsets

CACHE_POLICIES: tuple[str, ...] = ("lru", "lfu", "static", "belady")
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
    _layer_hits: list[int] = field(default_factory=list)
    _layer_misses: list[int] = field(default_factory=list)
    _layer_evictions: list[int] = field(default_factory=list)
    _layer_miss_ema: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("_layer_hits", "_layer_misses", "_layer_evictions"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.num_layers)
        if not self._layer_miss_ema:
            self._layer_miss_ema = [float("nan")] * self.num_layers

    def record(self, layer: int, hits: int, misses: int, evictions: int) -> None:
        """Add one access's counts (and update the layer's miss-fraction average)."""
        self.hits += hits
        self.misses += misses
        self.evictions += evictions
        self._layer_hits[layer] += hits
        self._layer_misses[layer] += misses
        self._layer_evictions[layer] += evictions
        total = hits + misses
        if total:
            frac = misses / total
            old = self._layer_miss_ema[layer]
            self._layer_miss_ema[layer] = frac if old != old else old + MISS_EMA_WEIGHT * (frac - old)

    @property
    def layer_miss_fraction(self) -> np.ndarray:
        """float64[L] moving average of the per-access miss fraction; NaN before a layer's first access."""
        return np.asarray(self._layer_miss_ema, dtype=np.float64)

    @property
    def layer_hits(self) -> np.ndarray:
        """int64[L] hits per layer."""
        return np.asarray(self._layer_hits, dtype=np.int64)

    @property
    def layer_misses(self) -> np.ndarray:
        """int64[L] misses per layer."""
        return np.asarray(self._layer_misses, dtype=np.int64)

    @property
    def layer_evictions(self) -> np.ndarray:
        """int64[L] evictions per layer."""
        return np.asarray(self._layer_evictions, dtype=np.int64)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); NaN before any access."""
        total = self.hits + self.misses
        return self.hits / total if total else float("nan")


class ExpertCache:
    """Per-layer expert caches with one policy (build with :func:`make_expert_cache`).

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
        self._cap = [int(c) for c in capacity]
        self.stats = CacheStats(num_layers)
        self._bits = [0] * num_layers  # python-int bitset per layer
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_layers)]
        self._freq: list[dict[int, int]] = [{} for _ in range(num_layers)]
        self._tick: list[dict[int, int]] = [{} for _ in range(num_layers)]
        self._clock = 0
        self._uses: list[dict[int, list[int]]] = []
        self._ptr: list[dict[int, int]] = []
        self._step = [0] * num_layers
        if policy == "static":
            if frequency is None:
                raise ValueError("ExpertCache: policy 'static' needs frequency (float[L, E])")
            for layer in range(num_layers):
                order = np.lexsort((np.arange(num_experts), -frequency[layer]))
                for e in sorted(int(x) for x in order[: self._cap[layer]]):
                    self._insert(layer, e)
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

    # ---- internals -------------------------------------------------------------------------
    def _insert(self, layer: int, e: int) -> None:
        self._cached[layer][e] = None
        self._bits[layer] |= 1 << e

    def _remove(self, layer: int, e: int) -> None:
        del self._cached[layer][e]
        self._bits[layer] &= ~(1 << e)

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

    def _eviction_order(self, layer: int, current: set[int]) -> list[int]:
        """Evictable cached experts (not in ``current``), first to evict first (LFU / Belady).

        Their keys cannot change during one access (only current experts are touched), so the
        order is computed once per access.
        """
        candidates = [e for e in self._cached[layer] if e not in current]
        if self.policy == "lfu":
            freq, tick = self._freq[layer], self._tick[layer]
            return sorted(candidates, key=lambda e: (freq.get(e, 0), tick.get(e, -1), e))
        step = self._step[layer]  # belady: farthest next use first, ties: larger id first
        return sorted(candidates, key=lambda e: (self._next_use(layer, e, step), e), reverse=True)

    def _touch(self, layer: int, ids: list[int], hits: list[int]) -> None:
        cached = self._cached[layer]
        for e in hits:
            cached.move_to_end(e)
        if self.policy == "lfu":
            freq, tick = self._freq[layer], self._tick[layer]
            for e in ids:
                self._clock += 1
                tick[e] = self._clock
                freq[e] = freq.get(e, 0) + 1

    def _check(self, layer: int, expert_ids: object) -> list[int]:
        if not 0 <= int(layer) < self.num_layers:
            raise ValueError(f"ExpertCache.access: layer {layer} out of range [0, {self.num_layers})")
        ids = sorted({int(x) for x in np.asarray(expert_ids).ravel().tolist()})
        if ids and (ids[0] < 0 or ids[-1] >= self.num_experts):
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise ValueError(f"ExpertCache.access: expert id {bad} out of range [0, {self.num_experts})")
        return ids

    def _admit(self, layer: int, ids: list[int], misses: list[int]) -> list[int]:
        """Insert misses (ascending) where the policy allows; returns the evicted ids."""
        evicted: list[int] = []
        cap = self._cap[layer]
        if self.policy == "static" or cap == 0:
            return evicted
        current = set(ids)
        cached = self._cached[layer]
        order: list[int] | None = None
        for e in misses:
            if len(cached) >= cap:
                if self.policy == "lru":
                    victim = next(iter(cached))  # oldest; current entries were moved to the end
                    if victim in current:
                        break  # every cached expert is in use by this access
                else:
                    if order is None:
                        order = self._eviction_order(layer, current)
                    if not order:
                        break
                    victim = order[0]
                    if self.policy == "belady":
                        step = self._step[layer]
                        if self._next_use(layer, victim, step) <= self._next_use(layer, e, step):
                            continue  # bypass: needed later than every evictable expert
                    order.pop(0)
                self._remove(layer, victim)
                evicted.append(victim)
            self._insert(layer, e)
        return evicted

    # ---- public API --------------------------------------------------------------------------
    def access(self, layer: int, expert_ids: object) -> CacheAccess:
        """One forward pass at ``layer`` needs ``expert_ids`` (int[...], any order/duplicates).

        Returns:
            :class:`CacheAccess` with ascending int64 arrays of hits, misses and evicted ids.

        Raises:
            ValueError: ``layer`` or an expert id out of range (the message names it).
        """
        ids = self._check(layer, expert_ids)
        cached = self._cached[layer]
        hits = [e for e in ids if e in cached]
        misses = [e for e in ids if e not in cached]
        self._touch(layer, ids, hits)
        evicted = self._admit(layer, ids, misses)
        if self.policy == "belady":
            self._step[layer] += 1
        self.stats.record(layer, len(hits), len(misses), len(evicted))
        return CacheAccess(
            hits=np.asarray(hits, dtype=np.int64),
            misses=np.asarray(misses, dtype=np.int64),
            evicted=np.asarray(sorted(evicted), dtype=np.int64),
        )

    def warm(self, layer: int, expert_ids: object) -> None:
        """Insert ``expert_ids`` without counting hits, misses or frequencies (static: no-op).

        Fills free slots first, then evicts by the policy like an access would.
        """
        ids = self._check(layer, expert_ids)
        if self.policy == "static":
            return
        cached = self._cached[layer]
        missing = [e for e in ids if e not in cached]
        for e in ids:
            if e in cached:
                cached.move_to_end(e)
        self._admit(layer, ids, missing)

    def contains(self, layer: int, expert: int) -> bool:
        """Whether ``expert`` is cached at ``layer``."""
        return int(expert) in self._cached[int(layer)]

    def cached_ids(self, layer: int) -> np.ndarray:
        """int64[] cached experts at ``layer``, ascending."""
        return np.asarray(sorted(self._cached[int(layer)]), dtype=np.int64)

    def cached_bits(self) -> np.ndarray:
        """uint64[L, W] bitsets of the cached experts (a copy)."""
        words = bitsets.num_words(self.num_experts)
        raw = b"".join(b.to_bytes(words * 8, "little") for b in self._bits)
        return np.frombuffer(raw, dtype="<u8").astype(np.uint64).reshape(self.num_layers, words)

    def copy(self) -> ExpertCache:
        """Independent deep copy (same contents, statistics and future position)."""
        return copy.deepcopy(self)


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
