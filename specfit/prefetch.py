"""Expert prefetch: which experts to copy ahead of need, and how many of those copies paid off.

Shared by the live engine (``live.offload.OffloadedMoE``) and the simulator (``sim.replay``), so
both prefetch the same experts at the same points and count them the same way.

- Draft prefetch (SP-MoE style: prefetch from the draft): once the subtree ``S`` is chosen, the
  experts the policy's expert predictor expects the nodes of ``S`` to need at each layer, ranked
  by how many nodes share them (then ascending id), at most the cache capacity per layer, are
  made resident in the expert cache (``ExpertCache.warm``: the replacement policy decides what
  leaves); those not cached before cross the link (:func:`draft_prefetch`).
- Next-layer prefetch: layer l+1's router applied to layer l's MoE input predicts layer l+1's
  experts one layer ahead (the pre-gating idea of Pre-gated MoE, Hwang et al., ISCA 2024, arXiv
  2308.12066, there with a trained pre-gate; used training-free with the next layer's own gate by
  AdapMoE, Zhong et al., ICCAD 2024, arXiv 2408.10284, and "Speculating Experts Accelerates
  Inference for Mixture-of-Experts", arXiv 2603.19289). The live engine computes the guesses from hidden states; a dense trace records
  them per node and layer (``next_layer_expert_ids``), so the simulator replays the same guesses.
  :func:`next_layer_choice` ranks a forward's guesses for one layer the same way as the draft
  prefetch (:func:`rank_experts`), on both sides.
- :class:`PrefetchLedger`: a prefetched expert is *used* when an access hits it before it leaves
  the cache, *wasted* when it is evicted first (counted when evicted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit import bitsets

PREFETCH_MODES = ("none", "draft", "next-layer", "both")
"""``--prefetch`` of ``live.record``, ``sim.sweep`` and ``analysis.validate``: ``both`` = draft
and next-layer."""


PREFETCH_COUNT_COLUMNS = ("cache_misses", "num_prefetch_used", "num_prefetch_wasted")
"""The cycles' columns :func:`next_layer_share` takes, in its argument order (counts per cycle:
demand misses, used and wasted prefetches)."""


@dataclass(frozen=True)
class NextLayerShare:
    """Next-layer prefetch's two cost terms and the counts they come from (:func:`next_layer_share`).

    Attributes:
        cover_frac: ``CycleCostModel.next_layer_cover_frac`` (fraction in [0, 1]).
        waste_per_miss: ``CycleCostModel.next_layer_waste_per_miss`` (copies per miss, >= 0).
        num_misses, num_used, num_wasted: summed demand misses, used and wasted prefetches (counts).
    """

    cover_frac: float
    waste_per_miss: float
    num_misses: int
    num_used: int
    num_wasted: int


def next_layer_share(num_misses: int, num_used: int, num_wasted: int) -> NextLayerShare:
    """Next-layer prefetch's share of the planner's misses and its waste, from cycles' summed
    counts (:class:`PrefetchLedger`: ``M`` demand misses, ``U`` used and ``W`` wasted prefetches).

    A used prefetch is a miss the planner (which prices the cache as it stands when it chooses)
    counted and the prefetch covered, so the planner's misses are ``M + U`` and
    ``cover_frac = U / (M + U)``, ``waste_per_miss = W / (M + U)``: ratios of totals (a prefetch
    is counted in the cycle that uses or evicts it, so per-cycle ratios would mix cycles). Both 0
    when ``M + U`` is 0. What ``calibration.costfit.fit_next_layer_terms`` fits from recorded
    runs and ``sim.sweep`` estimates from pilot replays; ``specfit.cost.CycleCostModel`` prices it.

    Raises:
        ValueError: a negative count (named).
    """
    counts = {"num_misses": int(num_misses), "num_used": int(num_used), "num_wasted": int(num_wasted)}
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"next_layer_share: {name} must be >= 0, got {value}")
    base = counts["num_misses"] + counts["num_used"]
    if base == 0:
        return NextLayerShare(0.0, 0.0, **counts)
    return NextLayerShare(counts["num_used"] / base, counts["num_wasted"] / base, **counts)


def uses_draft(mode: str) -> bool:
    """Whether prefetch mode ``mode`` (one of :data:`PREFETCH_MODES`) prefetches from the draft."""
    return mode in ("draft", "both")


def uses_next_layer(mode: str) -> bool:
    """Whether prefetch mode ``mode`` prefetches one layer ahead."""
    return mode in ("next-layer", "both")


def next_layer_choice(guesses: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """The experts next-layer prefetch makes resident at one layer for one forward pass.

    Args:
        guesses: int[T, K] the next-layer guesses of the forward's T tokens for that layer
            (negative ids ignored).
        num_experts: ``E``; capacity: cache slots per layer.

    Returns:
        Sorted int64 ids: the at most ``capacity`` experts most tokens guess, ties by ascending id
        (:func:`rank_experts`).
    """
    flat = np.asarray(guesses, dtype=np.int64).reshape(-1)
    counts = np.bincount(flat[flat >= 0], minlength=num_experts)
    return rank_experts(counts, capacity)


def rank_experts(counts: np.ndarray, capacity: int) -> np.ndarray:
    """Sorted ids of the at most ``capacity`` experts with the largest ``counts int[E]`` (> 0),
    ties broken by ascending id."""
    wanted = np.flatnonzero(counts)
    if not len(wanted) or capacity <= 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((wanted, -counts[wanted]))
    return np.sort(wanted[order[:capacity]]).astype(np.int64)


def warm_layer(cache, layer: int, chosen: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Make ``chosen`` resident at ``layer`` (``cache.warm``); return ``(copies, evicted)``: the
    chosen experts that were not cached before (they cross the link, in ascending id) and the
    experts the warm evicted (int64[n])."""
    before = cache.cached_mask()[layer].copy()
    copies = [int(e) for e in chosen if not before[e]]
    cache.warm(layer, chosen)
    evicted = np.flatnonzero(before & ~cache.cached_mask()[layer])
    return copies, evicted


def draft_prefetch(
    cache, predicted_bits: np.ndarray | None, num_experts: int, capacity: int
) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
    """Warm ``cache`` with the predicted experts of the chosen nodes; return the copies and evictions.

    Args:
        cache: a ``specfit.cache.ExpertCache``.
        predicted_bits: uint64[|S|, L, W] predicted expert bitsets of the chosen nodes, or None
            (a union-size predictor names no experts: nothing is prefetched).
        num_experts: ``E``; capacity: cache slots per layer.

    Returns:
        ``(copies, evicted)``: the ``(layer, expert)`` copies to enqueue, in layer then id order,
        and per layer the int64 ids the warm evicted.
    """
    num_layers = cache.num_layers
    evicted = [np.zeros(0, dtype=np.int64) for _ in range(num_layers)]
    if predicted_bits is None or capacity == 0 or not len(predicted_bits):
        return [], evicted
    predicted = bitsets.unpack(predicted_bits, num_experts)  # bool[|S|, L, E]
    counts = np.asarray(predicted, dtype=np.int64).sum(axis=0)  # [L, E]
    copies: list[tuple[int, int]] = []
    for layer in range(num_layers):
        chosen = rank_experts(counts[layer], capacity)
        if not len(chosen):
            continue
        missing, evicted[layer] = warm_layer(cache, layer, chosen)
        copies += [(layer, e) for e in missing]
    return copies, evicted


class PrefetchLedger:
    """Counts of prefetched experts: issued, used (hit before leaving the cache), wasted (evicted
    first). ``pending bool[L, E]`` marks prefetched experts not yet used or evicted.
    Counters are cumulative; :meth:`counts` returns them as a tuple."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.pending = np.zeros((num_layers, num_experts), dtype=bool)
        self.num_issued = 0
        self.num_used = 0
        self.num_wasted = 0

    def issue(self, layer: int, experts) -> None:
        """``experts`` of ``layer`` were copied ahead of need."""
        ids = np.asarray(experts, dtype=np.int64)
        self.pending[layer, ids] = True
        self.num_issued += len(ids)

    def accessed(self, layer: int, hits, evicted) -> None:
        """An access at ``layer`` hit ``hits`` and evicted ``evicted``."""
        hits = np.asarray(hits, dtype=np.int64)
        if len(hits):
            used = self.pending[layer, hits]
            self.num_used += int(used.sum())
            self.pending[layer, hits] = False
        self.evicted(layer, evicted)

    def evicted(self, layer: int, evicted) -> None:
        """``evicted`` left the cache at ``layer`` (an access or another prefetch's warm)."""
        evicted = np.asarray(evicted, dtype=np.int64)
        if len(evicted):
            self.num_wasted += int(self.pending[layer, evicted].sum())
            self.pending[layer, evicted] = False

    def counts(self) -> tuple[int, int, int]:
        """``(num_issued, num_used, num_wasted)`` so far."""
        return self.num_issued, self.num_used, self.num_wasted
