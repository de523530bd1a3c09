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

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from specfit import bitsets
from specfit.cache import miss_ema_step, miss_ema_steps

PREFETCH_MODES = ("none", "draft", "next-layer", "both")
"""``--prefetch`` of ``live.record``, ``sim.sweep`` and ``analysis.validate``: ``both`` = draft
and next-layer."""


PREFETCH_COUNT_COLUMNS = ("cache_misses", "num_prefetch_used", "num_prefetch_wasted")
"""The cycles' columns :func:`next_layer_share` takes, in its argument order (counts per cycle:
demand misses, used and wasted prefetches)."""


@dataclass(frozen=True)
class NextLayerShare:
    """Next-layer prefetch's two cost terms and the counts they come from (:func:`next_layer_share`),
    pooled and, when fitted per tree size (:func:`next_layer_share_by_nodes`), per verified-node
    count.

    Attributes:
        cover_fraction: ``CycleCostModel.next_layer_cover_fraction`` (fraction in [0, 1]), pooled.
        waste_per_miss: ``CycleCostModel.next_layer_waste_per_miss`` (copies per miss, >= 0), pooled.
        num_misses, num_used, num_wasted: summed demand misses, used and wasted prefetches (counts).
        nodes: ``CycleCostModel.next_layer_nodes``: knots over the verified nodes of a cycle
            (count, strictly increasing; empty: the pooled values at every size).
        cover_fractions, waste_per_misses: the share and waste at each knot (``CycleCostModel.
            next_layer_cover_fractions`` / ``next_layer_waste_per_misses``; same length as ``nodes``).
        num_first_layer_misses: summed demand misses of layer 0 (count), left out of the shares'
            denominator: no guess covers layer 0 (0 when not given).
    """

    cover_fraction: float
    waste_per_miss: float
    num_misses: int
    num_used: int
    num_wasted: int
    nodes: tuple[float, ...] = ()
    cover_fractions: tuple[float, ...] = ()
    waste_per_misses: tuple[float, ...] = ()
    num_first_layer_misses: int = 0

    @property
    def num_planner_misses(self) -> int:
        """The planner misses of layers 1..L-1 the shares are of (count): :func:`planner_misses`."""
        return planner_misses(self.num_misses, self.num_first_layer_misses, self.num_used)

    def knots_text(self) -> str:
        """The knots in words, e.g. ``"per tree size (nodes: covered/wasted per miss) 1: 0.53/0.02,
        60: 0.14/0.10"``; empty without knots."""
        if not self.nodes:
            return ""
        pairs = ", ".join(f"{n:.3g}: {h:.2f}/{x:.2f}" for n, h, x in zip(self.nodes, self.cover_fractions, self.waste_per_misses))
        return f"per tree size (nodes: covered/wasted per miss) {pairs}"

    def cost_fields(self) -> dict[str, Any]:
        """The ``specfit.cost.CycleCostModel`` fields of this share, for ``dataclasses.replace``
        (``calibration.fit``, ``sim.sweep``'s pilot, ``analysis.validate``)."""
        return {
            "next_layer_cover_fraction": self.cover_fraction,
            "next_layer_waste_per_miss": self.waste_per_miss,
            "next_layer_nodes": self.nodes,
            "next_layer_cover_fractions": self.cover_fractions,
            "next_layer_waste_per_misses": self.waste_per_misses,
        }


def planner_misses(num_misses: Any, num_first_layer_misses: Any, num_used: Any) -> Any:
    """The planner misses next-layer prefetch can cover: ``B = M - M_0 + U`` (counts; ints or
    int arrays, elementwise).

    A used prefetch is a miss the planner (which prices the cache as it stands when it chooses)
    counted and the prefetch covered, so the planner's misses are ``M + U``; layer 0 has no layer
    before it to guess from (its misses ``M_0`` are all demand misses), so they are left out.
    The denominator of :func:`next_layer_share`'s ratios and the count behind a knot of
    :func:`next_layer_share_by_nodes` (and ``analysis.validate``'s check of it).
    """
    return num_misses - num_first_layer_misses + num_used


def next_layer_share(num_misses: int, num_used: int, num_wasted: int, num_first_layer_misses: int = 0) -> NextLayerShare:
    """Next-layer prefetch's share of the planner's misses and its waste, from cycles' summed
    counts (:class:`PrefetchLedger`: ``M`` demand misses, ``U`` used and ``W`` wasted prefetches;
    ``M_0`` the demand misses of layer 0, part of ``M``).

    A used prefetch is a miss the planner (which prices the cache as it stands when it chooses)
    counted and the prefetch covered, so the planner's misses are ``M + U``; layer 0 has no layer
    before it to guess from (its misses are all demand misses), so the share is of the other
    layers' planner misses ``B = M - M_0 + U``: ``cover_fraction = U / B``, ``waste_per_miss = W /
    B``, ratios of totals (a prefetch is counted in the cycle that uses or evicts it, so
    per-cycle ratios would mix cycles), what ``specfit.cost.CycleCostModel`` prices on layers
    ``1..L-1`` (layer 0 without; issue 13: averaged over every layer, on the shipped sample at
    cache 8 the share read 0.52 where layers 1..5 saw 0.63 and layer 0 none). Both 0 when ``B``
    is 0. What ``calibration.costfit.fit_next_layer_terms`` fits from recorded runs and
    ``sim.sweep`` estimates from pilot replays.

    Raises:
        ValueError: a negative count, or ``M_0 > M`` (named).
    """
    counts = {"num_misses": int(num_misses), "num_used": int(num_used), "num_wasted": int(num_wasted)}
    counts["num_first_layer_misses"] = int(num_first_layer_misses)
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"next_layer_share: {name} must be >= 0, got {value}")
    if counts["num_first_layer_misses"] > counts["num_misses"]:
        raise ValueError(
            f"next_layer_share: num_first_layer_misses ({counts['num_first_layer_misses']}) must be <= "
            f"num_misses ({counts['num_misses']}): layer 0's misses are part of them"
        )
    share = NextLayerShare(0.0, 0.0, **counts)
    base = share.num_planner_misses
    if base == 0:
        return share
    return dataclasses.replace(share, cover_fraction=counts["num_used"] / base, waste_per_miss=counts["num_wasted"] / base)


NEXT_LAYER_MIN_KNOT_MISSES = 200
"""The least planner misses (``M - M_0 + U``: layer 0's demand misses left out) behind one knot
of :func:`next_layer_share_by_nodes`: its
share's binomial standard error is then at most ``0.5 / sqrt(200) = 0.035``."""
NEXT_LAYER_MAX_KNOTS = 8
"""The most knots :func:`next_layer_share_by_nodes` fits."""


def next_layer_share_by_nodes(
    num_nodes: Any, num_misses: Any, num_used: Any, num_wasted: Any,
    min_knot_misses: int = NEXT_LAYER_MIN_KNOT_MISSES, max_knots: int = NEXT_LAYER_MAX_KNOTS,
    *, first_layer_misses: Any = None,
) -> NextLayerShare:  # fmt: skip
    """Next-layer prefetch's share and waste per tree size, from per-cycle counts.

    One share for all trees under-prices big ones: on the shipped sample at cache 8 the root
    alone sees 0.53 of its misses covered, a 60-node tree 0.14 (the guesses of one token's
    hidden state cover a tree's spread of experts less, and the cache holds fewer of them), so
    the share is fitted per verified-node count ``n``: cycles are grouped by ``n`` into runs of
    consecutive counts, each closed once it holds
    ``max(min_knot_misses, (M - M_0 + U) / max_knots)``
    planner misses (a last short run joins the one before); a group's knot is its
    planner-miss-weighted mean ``n`` and its share and waste :func:`next_layer_share`'s ratios of
    its totals (planner misses of layers 1..L-1: ``first_layer_misses`` left out). ``specfit.cost.CycleCostModel`` interpolates between knots (``np.interp``: the end
    values outside). The pooled :func:`next_layer_share` is returned beside the knots; no knot
    when no cycle has a planner miss.

    Args:
        num_nodes: int[C] verified nodes per cycle (>= 1).
        num_misses, num_used, num_wasted: int[C] per cycle demand misses, used and wasted
            prefetches (``PREFETCH_COUNT_COLUMNS``).
        first_layer_misses: int[C] per cycle demand misses of layer 0 (``layer_misses[0]``, part of
            ``num_misses``); None: 0 (a share over every layer, as cost files before version 7).
        min_knot_misses, max_knots: see above (counts, >= 1).

    Raises:
        ValueError: arrays of different lengths, a negative count or a node count < 1.
    """
    nodes = np.asarray(num_nodes, dtype=np.int64).reshape(-1)
    first = np.zeros_like(nodes) if first_layer_misses is None else first_layer_misses
    counts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (num_misses, num_used, num_wasted, first)]
    if any(c.shape != nodes.shape for c in counts):
        raise ValueError(f"next_layer_share_by_nodes: expected {nodes.shape[0]} counts per column")
    if nodes.shape[0] and int(nodes.min()) < 1:
        raise ValueError(f"next_layer_share_by_nodes: num_nodes must be >= 1, got {int(nodes.min())}")
    if np.any(counts[3] > counts[0]):
        raise ValueError("next_layer_share_by_nodes: first_layer_misses must be <= num_misses in every cycle")
    pooled = next_layer_share(*(int(c.sum()) for c in counts))
    base = planner_misses(counts[0], counts[3], counts[1])
    if int(base.sum()) == 0:
        return pooled
    sizes, where = np.unique(nodes, return_inverse=True)
    per = [np.bincount(where, weights=c, minlength=sizes.shape[0]) for c in (counts[0], counts[1], counts[2], base)]
    need = max(int(min_knot_misses), float(per[3].sum()) / max(int(max_knots), 1))
    groups: list[list[int]] = [[]]
    for i in range(sizes.shape[0]):
        groups[-1].append(i)
        if per[3][groups[-1]].sum() >= need and i < sizes.shape[0] - 1:
            groups.append([])
    if len(groups) > 1 and per[3][groups[-1]].sum() < need:
        tail = groups.pop()  # a short last group joins the one before
        groups[-1] += tail
    knots, covers, wastes = [], [], []
    for group in groups:
        total = float(per[3][group].sum())
        if total <= 0.0:
            continue
        knots.append(float(np.dot(sizes[group], per[3][group]) / total))
        covers.append(float(per[1][group].sum() / total))
        wastes.append(float(per[2][group].sum() / total))
    return dataclasses.replace(pooled, nodes=tuple(knots), cover_fractions=tuple(covers), waste_per_misses=tuple(wastes))


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
    before = cache.cached_mask(layer)
    copies = [int(e) for e in chosen if not before[e]]
    cache.warm(layer, chosen)
    evicted = np.flatnonzero(before & ~cache.cached_mask(layer))
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


def planner_miss_fraction(cache, ledger: PrefetchLedger, prefetch: str) -> np.ndarray:
    """float64[L] the observed miss fraction the union-size predictor prices
    (``PredictContext.miss_fraction``), the live engine's and the simulator's alike: with
    ``prefetch`` (one of :data:`PREFETCH_MODES`) other than ``none`` the ``ledger``'s
    (:attr:`PrefetchLedger.layer_miss_fraction`: a used prefetch counts as a miss, as the cost
    model's next-layer share expects), else ``cache.stats.layer_miss_fraction`` (the ledger is
    not fed then). NaN where not yet observed."""
    if prefetch != "none":
        return ledger.layer_miss_fraction
    return cache.stats.layer_miss_fraction


class PrefetchLedger:
    """Counts of prefetched experts: issued, used (hit before leaving the cache), wasted (evicted
    first). ``pending bool[L, E]`` marks prefetched experts not yet used or evicted.
    Counters are cumulative; :meth:`counts` returns them as a tuple.

    It also keeps the planner's miss fraction per layer under prefetch
    (:attr:`layer_miss_fraction`): the cache's own moving average
    (``specfit.cache.CacheStats.layer_miss_fraction``) counts a hit on a prefetched expert as a
    hit, but the planner prices the cache as it stands when it chooses, before the cycle's
    prefetch, and the cost model takes next-layer prefetch's share off those misses itself
    (``next_layer_share``: the planner's misses are ``M + U``). Fed the cache's moving average,
    the union-size predictor took the share off twice (issue 13: on the shipped sample at cache 8
    it expected 1.58 misses per layer for the root alone where the cache the planner saw missed
    3.11).
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.pending = np.zeros((num_layers, num_experts), dtype=bool)
        self.num_issued = 0
        self.num_used = 0
        self.num_wasted = 0
        self._miss_ema = np.full(num_layers, np.nan, dtype=np.float64)
        #: int64[L] prefetch copies issued into each layer so far (a cycle's are the difference
        #: over it: the guard's realised price, ``CycleCostModel.realised_cycle_s``)
        self.layer_issued = np.zeros(num_layers, dtype=np.int64)
        #: int64[L] of them next-layer copies (issued mid-forward, ``issue(..., ahead=True)``)
        self.layer_issued_ahead = np.zeros(num_layers, dtype=np.int64)
        #: int64[L, E] each expert's latest copy's place among its layer's copies (1-based,
        #: counted as ``layer_issued``), and int64[L] the latest such place an access used
        self._issue_rank = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.layer_last_used = np.zeros(num_layers, dtype=np.int64)

    def restart(self, miss_fraction: np.ndarray) -> None:
        """A new cache content (``live.offload``'s ``set_cache``): prefetched experts leave with
        the old content, uncounted, and the planner's miss fraction starts from the new cache's
        own (float64[L], ``CacheStats.layer_miss_fraction``; NaN: not yet observed)."""
        self.pending[:] = False
        self._miss_ema = np.array(miss_fraction, dtype=np.float64)

    @property
    def layer_miss_fraction(self) -> np.ndarray:
        """float64[L] moving average over the accesses :meth:`accessed` was told the misses of,
        of ``(misses + used prefetches) / experts accessed``: the share of an access's experts the
        cache lacked before the prefetches it used (``specfit.cache.miss_ema_step``: weight ``MISS_EMA_WEIGHT`` on the
        newest, as the cache's own average; equal to it when nothing prefetched is used); NaN
        before a layer's first access. What the union-size predictor prices under prefetch
        (``PredictContext.miss_fraction``), live and simulated alike."""
        return self._miss_ema.copy()

    def issue(self, layer: int, experts, ahead: bool = False) -> None:
        """``experts`` of ``layer`` were copied ahead of need, in this order on the link (FIFO);
        ``ahead``: by next-layer prefetch (mid-forward), else by the draft prefetch (before it)."""
        if not len(experts):  # most layers of most cycles: nothing to count
            return
        ids = np.asarray(experts, dtype=np.int64)
        self.pending[layer, ids] = True
        num = len(ids)
        self.num_issued += num
        first = int(self.layer_issued[layer]) + 1
        self._issue_rank[layer, ids] = np.arange(first, first + num, dtype=np.int64)
        self.layer_issued[layer] += num
        if ahead:
            self.layer_issued_ahead[layer] += num

    def mark(self) -> tuple[np.ndarray, np.ndarray]:
        """The issued counts now, for :meth:`copies_since` at the end of a cycle: copies of
        ``(layer_issued, layer_issued_ahead)``, each int64[L] (copies per layer; draft, next-layer)."""
        return self.layer_issued.copy(), self.layer_issued_ahead.copy()

    def copies_since(self, mark: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """A cycle's prefetch copies since ``mark`` (:meth:`mark` at its start): int64[3, L], per
        layer the draft prefetch's copies (row 0), the next-layer copies (row 1: issued after the
        draft's, mid-forward) and how many of the two, in issue order, precede and include the
        last one an access used (row 2: the copies the layer waited for; 0 when it used none of
        this cycle's). What ``CycleCostModel.realised_cycle_s`` prices (issue 13: a layer waits
        only for the copies of experts it hits, as ``live.offload`` and ``sim.engine`` do)."""
        out = np.empty((3, len(self.layer_issued)), dtype=np.int64)
        np.subtract(self.layer_issued_ahead, mark[1], out=out[1])
        np.subtract(self.layer_issued, mark[0], out=out[0])
        out[0] -= out[1]
        np.subtract(self.layer_last_used, mark[0], out=out[2])
        np.maximum(out[2], 0, out=out[2])
        return out

    def accessed(self, layer: int, hits, evicted, num_misses: int | None = None) -> None:
        """An access at ``layer`` hit ``hits`` (expert ids) and evicted ``evicted``; with
        ``num_misses`` (its demand misses, count) it also moves :attr:`layer_miss_fraction`
        (``CacheStats.record``'s update with the used prefetches counted as misses). Kept beside
        its batched twin :meth:`accessed_layers` (the simulator's): the live engine
        (``live.offload``) counts each layer's access as its forward reaches that layer."""
        hits = np.asarray(hits, dtype=np.int64)
        used = 0
        if len(hits):
            marks = self.pending[layer, hits]
            used = int(marks.sum())
            self.num_used += used
            if used:
                last = int(self._issue_rank[layer, hits[marks]].max())
                if last > self.layer_last_used[layer]:
                    self.layer_last_used[layer] = last
            self.pending[layer, hits] = False
        self.evicted(layer, evicted)
        if num_misses is not None and len(hits) + int(num_misses):
            frac = (int(num_misses) + used) / (len(hits) + int(num_misses))
            self._miss_ema[layer] = miss_ema_step(float(self._miss_ema[layer]), frac)

    def accessed_layers(self, hit_keys: np.ndarray, evicted_keys: np.ndarray, num_hits: np.ndarray,
                        num_misses: np.ndarray) -> None:  # fmt: skip
        """One access at every layer, as :meth:`accessed` ``(l, hits_l, evicted_l, num_misses[l])``
        for ``l = 0..L-1`` in order, in a few array operations (the simulator's per-cycle count;
        issue 14: 48 calls took ~0.5-1 ms per cycle with prefetch on). The layers' rows are
        disjoint, so the counts, marks and averages are the per-layer calls' (the averages' float64
        steps are the same IEEE operations, element-wise: bit for bit).

        Args:
            hit_keys, evicted_keys: int64[] ascending ``layer * E + expert`` keys of the access's
                hits and evictions (``specfit.cache.LayerAccesses.keys``).
            num_hits, num_misses: int64[L] per-layer hits and demand misses (counts).
        """
        num_experts = self.pending.shape[1]
        pending = self.pending.reshape(-1)  # a view: rows are layers
        marks = pending[hit_keys]
        used_keys = hit_keys[marks]
        used = np.zeros(len(num_hits), dtype=np.int64)
        if len(used_keys):
            layers = used_keys // num_experts
            used = np.bincount(layers, minlength=len(num_hits))
            self.num_used += len(used_keys)
            np.maximum.at(self.layer_last_used, layers, self._issue_rank.reshape(-1)[used_keys])
            pending[used_keys] = False
        if len(evicted_keys):
            self.num_wasted += int(np.count_nonzero(pending[evicted_keys]))
            pending[evicted_keys] = False
        accessed = num_hits + num_misses
        seen = accessed > 0
        if seen.any():
            frac = (num_misses[seen] + used[seen]) / accessed[seen]
            self._miss_ema[seen] = miss_ema_steps(self._miss_ema[seen], frac)

    def evicted(self, layer: int, evicted) -> None:
        """``evicted`` left the cache at ``layer`` (an access or another prefetch's warm)."""
        evicted = np.asarray(evicted, dtype=np.int64)
        if len(evicted):
            self.num_wasted += int(self.pending[layer, evicted].sum())
            self.pending[layer, evicted] = False

    def counts(self) -> tuple[int, int, int]:
        """``(num_issued, num_used, num_wasted)`` so far."""
        return self.num_issued, self.num_used, self.num_wasted
