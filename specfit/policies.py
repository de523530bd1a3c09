"""Tree policies behind one interface: ``policy.select(ctx: PolicyContext) -> Plan``.

* ``ar``: autoregressive, root only (no speculation; plain decoding).
* ``chain``: the greedy path, following the most probable child ``k`` times (single-sequence
  speculative decoding: Leviathan et al. 2023, Chen et al. 2023).
* ``topn``: the ``num_draft_nodes`` non-root nodes of highest path probability plus the root
  (EAGLE-2 reranking, Li et al. 2024, kept by EAGLE-3; ancestor-closed since P never increases
  along a path, ties broken by smaller id, which a parent always has).
* ``specfit``: the exact throughput-optimal subtree (:func:`specfit.planner.plan_exact`;
  SpecFit, arXiv 2610.15417) plus the stopping rule :meth:`SpecFitPolicy.keep_drafting`.
* ``cascade``: a utility gate in the spirit of Cascade's utility-driven speculation for MoE:
  take an inner tree policy's plan (``topn`` by default) only when its predicted throughput beats
  autoregressive decoding, else fall back to the root alone.

Autoregressive plans, and the cascade fallback, are scored without draft time (the engine skips
drafting when it does not speculate).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from specfit import bitsets
from specfit.cache import _KERNELS, _cache_kernels
from specfit.context import Plan, PolicyContext, layer_misses, make_plan
from specfit.cost import CycleCostModel
from specfit.planner import (
    cost_params,
    decide_kernels,
    plan_exact,
    plan_union_size,
    union_size_plan,
    union_table,
)
from specfit.tree import TYPED_TREE_TYPES, DraftTree

TREE_POLICIES: tuple[str, ...] = ("ar", "chain", "topn", "specfit", "cascade")
#: One line per tree policy for ``--help``.
TREE_POLICY_HELP: dict[str, str] = {
    "ar": "autoregressive: the root only, no draft",
    "full": "verify the whole drafted tree (live engine; what dense trace mode verifies)",
    "chain": "the draft's most likely path",
    "topn": "the max_nodes - 1 most likely draft nodes (EAGLE-2/3's tree)",
    "specfit": "the exact throughput-optimal subtree, with a stopping rule for drafting",
    "cascade": "topn when the cost model says it beats ar, else ar",
}


class TreePolicy:
    """Base class: ``name`` and ``select(ctx) -> Plan``."""

    name = "base"

    def select(self, ctx: PolicyContext) -> Plan:  # pragma: no cover - interface
        """Choose the verified subtree for ``ctx``."""
        raise NotImplementedError


class AutoregressivePolicy(TreePolicy):
    """Root only: one token per cycle, no drafting (scored with ``num_levels = 0``)."""

    name = "ar"

    def select(self, ctx: PolicyContext) -> Plan:
        """Plan ``[0]`` scored without draft time."""
        started = time.perf_counter()
        no_draft = dataclasses.replace(ctx, num_levels=0) if ctx.num_levels else ctx
        return make_plan(no_draft, np.zeros(1, dtype=np.int64), self.name, time.perf_counter() - started, 1)


class ChainPolicy(TreePolicy):
    """The greedy path: from the root follow the child of highest P (ties: smaller id).

    Args:
        max_length: draft nodes kept on the path (``None``: until a leaf).

    Raises:
        ValueError: ``max_length`` < 0.
    """

    name = "chain"

    def __init__(self, max_length: int | None = None) -> None:
        if max_length is not None and int(max_length) < 0:
            raise ValueError(f"chain policy: max_length must be >= 0, got {max_length}")
        self.max_length = None if max_length is None else int(max_length)

    def select(self, ctx: PolicyContext) -> Plan:
        """Plan along the greedy path."""
        started = time.perf_counter()
        nodes, v = [0], 0
        p = ctx.accept_probs
        while self.max_length is None or len(nodes) <= self.max_length:
            kids = ctx.tree.children(v)
            if kids.size == 0:
                break
            v = int(kids[np.argmax(p[kids])])  # argmax keeps the first (smallest id) on ties
            nodes.append(v)
        return make_plan(ctx, np.asarray(nodes), self.name, time.perf_counter() - started, len(nodes))


def top_n_nodes(accept_probs: np.ndarray, num_draft_nodes: int) -> np.ndarray:
    """Root plus the ``num_draft_nodes`` non-root nodes of highest P (ties: smaller id), sorted.

    Ancestor-closed whenever P never increases from parent to child (parents have smaller ids).
    """
    p = np.asarray(accept_probs, dtype=np.float64)
    order = np.lexsort((np.arange(p.shape[0]), -p))
    order = order[order != 0][: max(0, int(num_draft_nodes))]
    return np.sort(np.concatenate(([0], order))).astype(np.int64)


class TopNPolicy(TreePolicy):
    """EAGLE-2/3 reranking: the root plus the top ``num_draft_nodes`` nodes by path probability.

    Args:
        num_draft_nodes: draft tokens verified besides the root (EAGLE-3 default 60).

    Raises:
        ValueError: ``num_draft_nodes`` < 0.
    """

    name = "topn"

    def __init__(self, num_draft_nodes: int = 60) -> None:
        if int(num_draft_nodes) < 0:
            raise ValueError(f"topn policy: num_draft_nodes must be >= 0, got {num_draft_nodes}")
        self.num_draft_nodes = int(num_draft_nodes)

    def select(self, ctx: PolicyContext) -> Plan:
        """Plan of the top-N nodes."""
        started = time.perf_counter()
        nodes = top_n_nodes(ctx.accept_probs, self.num_draft_nodes)
        return make_plan(ctx, nodes, self.name, time.perf_counter() - started, 1)


def _max_level_mass(ctx: PolicyContext, topk: int | None) -> tuple[float, float]:
    """(sum, max) of P over the deepest level's nodes (only the ``topk`` largest when given)."""
    deepest = ctx.tree.nodes_at_depth(ctx.tree.max_depth)
    mass = np.sort(ctx.accept_probs[deepest])[::-1]
    if topk is not None:
        mass = mass[: int(topk)]
    return float(mass.sum()), float(mass[0]) if mass.shape[0] else 0.0


def _min_added_h2d_s(ctx: PolicyContext, max_new: int) -> np.ndarray:
    """float64[max_new]: least predicted transfer seconds that ``m`` = 1..max_new more nodes add.

    Union-size mode without overlap: ``least_s_per_miss * min_{1<=n<=N} (F(n + m) - F(n))`` with
    ``F(n) = sum_l expected_union_l(n) * miss_l`` (``cost.least_s_per_miss``: ``priced_s_per_miss``, less
    with next-layer prefetch priced); with next-layer knots (overlap or not)
    :func:`_min_added_h2d_s_per_size`; zeros otherwise (see ``keep_drafting``).
    """
    ne = ctx.node_experts
    if max_new > 0 and ne.is_union_size and _h2d_price_varies_with_size(ctx.cost):
        return _min_added_h2d_s_per_size(ctx, max_new)
    if max_new <= 0 or not ne.is_union_size or ctx.cost.overlap_h2d:
        return np.zeros(max(max_new, 0))
    size = ctx.tree.num_nodes
    miss = ne.layer_miss_fraction(ctx.cached_bits)
    total = ne.expected_union_table(size + max_new) @ miss  # total[i] = F(i + 1)
    grow = np.arange(size)[:, None] + np.arange(1, max_new + 1)[None, :]  # row n - 1, column m - 1: n + m - 1
    least = (total[grow] - total[:size, None]).min(axis=0)
    return np.maximum(least, 0.0) * ctx.cost.least_s_per_miss


def _h2d_price_varies_with_size(cost: CycleCostModel) -> bool:
    """True when next-layer prefetch is priced with a share per tree size (knots): a cycle's
    per-miss terms then change with its verified nodes, and a larger subtree can be priced LOWER
    than a smaller one (a cover that rises with size), so ``cost.least_s_per_miss`` times the added
    misses is no lower bound (review finding M11)."""
    return cost.next_layer_priced and len(cost.next_layer_nodes) > 0


def _min_added_h2d_s_per_size(ctx: PolicyContext, max_new: int) -> np.ndarray:
    """float64[max_new]: :func:`_min_added_h2d_s` when the per-miss terms change with tree size
    (:func:`_h2d_price_varies_with_size`); may be NEGATIVE (more nodes, cheaper copies).

    Per layer ``l`` a subtree of ``n`` nodes with ``u_l(n)`` predicted misses lasts
    ``host_n u + max(c_n + a_n u, b_n u)`` without overlap and ``host_n u + max(c_n, p c_n + a_n u,
    b_n u) + late (u > 0)`` in mode "on" (``specfit.cost.CycleCostModel.cycle_s_layers``; ``(host,
    a, b)`` of :meth:`~specfit.cost.CycleCostModel.next_layer_s_per_miss` at ``n``, layer 0 at ``h
    = x = 0``). With ``c_{n+m} >= c_n`` and ``max(X, Y) - max(X', Y') >= min(X - X', Y - Y')``, the
    layer grows by at least ``host' u' - host u + min(a' u' - a u, b' u' - b u)`` (and ``min(0,
    ...)`` of that min in mode "on", whose ``c`` branch may absorb it; the late call never falls);
    the least of the layers' sum over ``n = 1..N`` is returned for each ``m``."""
    cost, ne = ctx.cost, ctx.node_experts
    size = ctx.tree.num_nodes
    sizes = np.arange(1, size + max_new + 1, dtype=np.float64)
    u = ne.expected_union_table(size + max_new) * ne.layer_miss_fraction(ctx.cached_bits)  # [S, L]
    host, after, link = (np.broadcast_to(np.asarray(t, dtype=np.float64), sizes.shape)[:, None] for t in cost.next_layer_s_per_miss(sizes))
    num_layers = u.shape[1]
    host = np.repeat(host, num_layers, axis=1)
    after, link = np.repeat(after, num_layers, axis=1), np.repeat(link, num_layers, axis=1)
    host[:, 0], after[:, 0], link[:, 0] = cost.layer0_s_per_miss  # no guess covers layer 0
    out = np.empty(max_new)
    small = slice(0, size)
    for m in range(1, max_new + 1):
        big = slice(m, size + m)
        grow = np.minimum(after[big] * u[big] - after[small] * u[small], link[big] * u[big] - link[small] * u[small])
        if cost.overlap_h2d:
            grow = np.minimum(grow, 0.0)
        added = (host[big] * u[big] - host[small] * u[small] + grow).sum(axis=1)
        out[m - 1] = added.min()
    return out


def _chain_gain(
    ctx: PolicyContext, best: Plan, root_alpha: float, remaining: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The expected rule's chain (:meth:`SpecFitPolicy.keep_drafting_expected`), numpy form.

    Returns ``(base int64[], gain float64[remaining], k float64[remaining])``: ``base`` is the
    optimum ``best`` plus the path to the leaf (the most probable node of the deepest level, the
    first of equal P; the root on the root alone), ``gain[j]`` the expected committed tokens of
    ``base`` plus a chain of ``k[j] = j + 1`` more levels of edge acceptance ``alpha`` (the leaf's,
    ``root_alpha`` on the root alone).
    """
    tree, probs = ctx.tree, ctx.accept_probs
    if tree.max_depth == 0:
        leaf, alpha = 0, root_alpha
    else:
        deepest = tree.nodes_at_depth(tree.max_depth)
        leaf = int(deepest[np.argmax(probs[deepest])])
        parent_p = float(probs[tree.parents[leaf]])
        alpha = min(float(probs[leaf]) / parent_p, 1.0) if parent_p > 0 else 0.0
    chosen = np.zeros(tree.num_nodes, dtype=bool)
    chosen[best.nodes] = True
    v = leaf
    while v > 0 and not chosen[v]:
        chosen[v] = True
        v = int(tree.parents[v])
    base = np.flatnonzero(chosen)
    base_gain = 1.0 + float(probs[base[base != 0]].sum())
    k = np.arange(1, remaining + 1, dtype=np.float64)
    return base, base_gain + float(probs[leaf]) * np.cumsum(alpha**k), k


STOPPING_RULES = ("expected", "bound")
LIVE_DEADLINE_FRACTION = 0.1  # live: each exact search gets 10 % of the cycle's least predicted time
_NAN = float("nan")


def root_layer_misses(cached_bits: np.ndarray, root_expert_ids: np.ndarray) -> np.ndarray:
    """Per layer, how many of the root's experts the cache lacks: int64[L].

    ``cached_bits`` uint64[L, W] (``ExpertCache.cached_bits``: bit ``e % 64`` of word ``e // 64``),
    ``root_expert_ids`` int[L, K] (the root's routed experts; negative ids are ignored). What the
    root alone would have missed in a cycle, for :class:`ThroughputGuard`'s paired comparison;
    the simulator and the live engine both call it on the cache as the planner saw it. One
    compiled call (``specfit.cache_kernels.root_layer_misses``); the same integers as
    :func:`root_layer_misses_numpy`, its numpy form, which takes any other input (a shape or
    dtype the kernel does not).

    Raises:
        IndexError: an expert id ``>= 64 * W``.
    """
    bits = cached_bits
    ids = root_expert_ids
    if (
        type(bits) is np.ndarray and type(ids) is np.ndarray and bits.dtype == np.uint64 and bits.ndim == 2
        and ids.ndim == 2 and ids.dtype.kind == "i" and ids.shape[0] == bits.shape[0]
    ):  # fmt: skip
        # specfit.cache's loaded kernels module (numba loads on the first call, not at import),
        # read without _cache_kernels' frame once loaded: +3.8 us per cold call (paired, issue 14)
        kernels = _KERNELS[0] if _KERNELS else _cache_kernels()
        out = np.empty(ids.shape[0], dtype=np.int64)
        bad = kernels.root_layer_misses(bits, ids, out)
        if bad >= 0:
            raise IndexError(f"root_layer_misses: expert id {bad} is out of range for {bits.shape[1]} bitset words")
        return out
    return root_layer_misses_numpy(cached_bits, root_expert_ids)


def root_layer_misses_numpy(cached_bits: np.ndarray, root_expert_ids: np.ndarray) -> np.ndarray:
    """:func:`root_layer_misses` in numpy (the compiled kernel's oracle; any array-like input).

    Raises:
        IndexError: an expert id ``>= 64 * W``.
    """
    ids = np.asarray(root_expert_ids, dtype=np.int64)
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    words = np.asarray(cached_bits, dtype=np.uint64)[np.arange(ids.shape[0])[:, None], safe >> 6]
    cached = (words >> (safe & 63).astype(np.uint64)) & np.uint64(1)
    return (valid & (cached == 0)).sum(axis=1).astype(np.int64)


def root_alone_copies(
    cached_bits: np.ndarray, root_expert_ids: np.ndarray, num_experts: int, capacity: int,
    predicted_bits: np.ndarray | None = None, next_layer_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """What the root alone would have copied in a cycle with prefetch, for the guard's paired
    price (:meth:`SpecFitPolicy.observe_cycle`): ``(demand int64[L], copies int64[3, L])``, the
    root's demand misses and its prefetch copies as ``PrefetchLedger.copies_since`` counts them
    (draft copies, next-layer copies, the copies its layers wait for).

    The engines' prefetch of a cycle verifying the root only, on the cache the planner saw
    (``cached_bits`` uint64[L, W]): the draft prefetch makes the root's predicted experts
    resident (``predicted_bits`` uint64[L, W], the policy's predictor's row for the root, its bits
    at or above ``num_experts`` ignored; None: no draft prefetch), at most ``capacity`` per layer,
    lowest ids first as ``specfit.prefetch.draft_prefetch`` ranks a single node's, copying those not cached in id
    order; next-layer prefetch then makes the root's guesses for layers ``1..L-1`` resident
    (``next_layer_ids`` int[L-1, K], the root's row of the forward's guesses; None: none), as
    ``specfit.prefetch.next_layer_choice``, copying those still missing; the root's routed
    experts ``root_expert_ids`` int[L, K] (negative ids ignored) not resident then are its
    demand misses, and a layer waits for its copies up to the last one it routes to.
    Evictions the warms would make are not modelled: a warm that evicts an expert the root
    routes to makes the true cycle miss once more than this counts (issue 13: the paired price
    had no prefetch copies at all while realised root-only cycles had theirs, ~1.7x its price).
    Without ``predicted_bits`` and ``next_layer_ids`` (no prefetch): ``(root_layer_misses(...),
    None)``, what :meth:`SpecFitPolicy.observe_cycle` takes for a run without prefetch (the one
    branch ``sim.replay`` and ``live.spec.engine`` share).

    Computed on bitsets, one compiled pass over the layers (``specfit.cache_kernels.root_alone_copies``;
    issue 14: its numpy form took 73-153 us per drafting cycle with prefetch).

    Raises:
        ValueError: a bitset with the wrong number of words for ``num_experts``, or arrays whose
            layers disagree (``predicted_bits`` not [L, W], ``root_expert_ids`` not [L, K],
            ``next_layer_ids`` not [L - 1, K]).
        IndexError: an expert id ``>= num_experts``.
    """
    if predicted_bits is None and next_layer_ids is None:
        return root_layer_misses(cached_bits, root_expert_ids), None
    words = bitsets.num_words(num_experts)
    cached = np.ascontiguousarray(cached_bits, dtype=np.uint64)
    ids = np.ascontiguousarray(root_expert_ids, dtype=np.int64)
    if cached.ndim != 2 or cached.shape[1] != words or ids.ndim != 2 or ids.shape[0] != cached.shape[0]:
        raise ValueError(
            f"root_alone_copies: expected cached_bits uint64[L, {words}] ({num_experts} experts) and "
            f"root_expert_ids int[L, K], got {cached.shape} and {ids.shape}"
        )
    num_layers = cached.shape[0]
    predicted = _NO_BITS[words] if predicted_bits is None else np.ascontiguousarray(predicted_bits, dtype=np.uint64)
    guesses = _NO_IDS if next_layer_ids is None else np.ascontiguousarray(next_layer_ids, dtype=np.int64)
    if (predicted_bits is not None and predicted.shape != cached.shape) or (
        next_layer_ids is not None and (guesses.ndim != 2 or guesses.shape[0] != num_layers - 1)
    ):
        raise ValueError(
            f"root_alone_copies: expected predicted_bits uint64[{num_layers}, {words}] and next_layer_ids "
            f"int[{num_layers - 1}, K], got {predicted.shape} and {guesses.shape}"
        )
    return _cache_kernels().root_alone_copies(cached, ids, int(num_experts), int(capacity), predicted, guesses)


class _NoBits(dict):
    """uint64[0, W] by ``W``: the compiled ``root_alone_copies``'s "no draft prefetch" (made once per W)."""

    def __missing__(self, words: int) -> np.ndarray:
        self[words] = np.zeros((0, words), dtype=np.uint64)
        return self[words]


_NO_BITS = _NoBits()
_NO_IDS = np.zeros((0, 1), dtype=np.int64)  # the compiled root_alone_copies's "no next-layer guesses"


class GuardWindow:
    """One :class:`ThroughputGuard` arm: its last ``maxlen`` samples ``(tokens, seconds, cycle
    index, root-alone seconds or None)``, oldest first, with the sums the guard's rates take
    (``tokens``, ``seconds``, ``root_s`` over the priced root-alone seconds; ``unpriced``: samples
    without one) kept up to date as samples come and go.

    Appending to a window that is neither full nor changed otherwise since its last sum adds the
    sample; anything that drops a sample marks the sums stale and the next read sums the window
    again, from per-field copies of the window (one C-level ``sum`` per field, no pass over the
    tuples; several drops between two reads sum once). On CPython 3.11, where ``sum`` adds floats
    left to right from 0, the sums are bit for bit ``sum(...)`` over the window, oldest first, and
    the same as the re-sum-after-every-drop this replaced; from 3.12 ``sum`` compensates its
    float additions (Neumaier), so a sum kept by additions can differ from a re-sum in the last
    bits, and from the replaced form's (a review found 271 of 3,000 random sequences differing on
    3.12.1 and 3.13.0, none on 3.11.7). The simulator and the live engine share this class, so
    on any one Python they still agree with each other bit for bit. So the
    guard's question, asked once per cycle, reads four numbers instead of summing its windows
    (issue 14: ~7 passes over up to 64 samples, each page of them cold after a model forward). A
    deque-like container: ``len``, iteration, indexing, ``append``, ``popleft``, ``clear``,
    ``extend`` (there is no other way to change it).
    """

    def __init__(self, maxlen: int) -> None:
        from collections import deque

        self.maxlen = int(maxlen)
        self._samples: Any = deque(maxlen=self.maxlen)
        self._tokens: Any = deque(maxlen=self.maxlen)  # per-field copies of the window, oldest first
        self._seconds: Any = deque(maxlen=self.maxlen)
        self._priced: Any = deque()  # the priced root-alone seconds, oldest first
        self.unpriced = 0
        self._tokens_sum = self._seconds_sum = self._root_sum = 0
        self._stale = False  # True: the three sums must be taken again before they are read

    def _sum(self) -> None:
        self._tokens_sum = sum(self._tokens)
        self._seconds_sum = sum(self._seconds)
        self._root_sum = sum(self._priced)
        self._stale = False

    @property
    def tokens(self) -> float:
        """Sum of the window's committed tokens (``sum`` over the samples, oldest first)."""
        if self._stale:
            self._sum()
        return self._tokens_sum

    @property
    def seconds(self) -> float:
        """Sum of the window's priced seconds (``sum`` over the samples, oldest first)."""
        if self._stale:
            self._sum()
        return self._seconds_sum

    @property
    def root_s(self) -> float:
        """Sum of the window's priced root-alone seconds (``sum`` over the priced ones, oldest first)."""
        if self._stale:
            self._sum()
        return self._root_sum

    def paired_rates(self, ar: GuardWindow) -> tuple[float, float, float, float, int]:
        """This window as the drafting arm against ``ar``, the non-drafting arm: ``(spec, ar_rate,
        root, reference, len(self))`` in tokens/s, the rates of
        :meth:`ThroughputGuard.rate` ``("spec")`` and ``("ar")``, :meth:`ThroughputGuard.root_rate`
        and :meth:`ThroughputGuard.reference_rate` (NaN where they are), from one read of each
        window's sums. One call, no other frame: :meth:`ThroughputGuard.allows_drafting` asks it
        once per live cycle after a model forward, where each Python frame costs microseconds
        (issue 14: ~14 frames through the properties took ~30 us per cycle). Measured against the
        guard reading the windows' private sums itself, medians of 1,000 paired cold calls:
        +0.2 and +1.0 us, as two copies of the same code differ (+0.8, +1.4); a ``sums()`` method
        per arm, read from the guard, cost +2.0 to +2.5 us.

        Raises:
            ZeroDivisionError: a drafting arm whose root prices sum to 0 (never recorded by
            :meth:`ThroughputGuard.observe`, which keeps only prices > 0).
        """
        if self._stale:
            self._sum()
        if ar._stale:
            ar._sum()
        seconds, ar_seconds = self._seconds_sum, ar._seconds_sum
        nan = _NAN  # float("nan") is a call: ~3 us after a model forward
        spec = self._tokens_sum / seconds if seconds > 0 else nan
        ar_rate = ar._tokens_sum / ar_seconds if ar_seconds > 0 else nan
        count = len(self._samples)
        if not count or self.unpriced:  # a cycle lacks its root price: no counterfactual
            return spec, ar_rate, nan, nan, count
        return spec, ar_rate, count / self._root_sum, (count + ar._tokens_sum) / (self._root_sum + ar_seconds), count

    def _drop_oldest(self) -> tuple:
        """Forget the oldest sample's root price (the caller removes the sample itself)."""
        oldest = self._samples[0]
        if oldest[3] is None:
            self.unpriced -= 1
        else:
            self._priced.popleft()
        self._stale = True
        return oldest

    def append(self, sample: tuple) -> None:
        """Add the newest sample; the oldest leaves a full window."""
        if len(self._samples) == self.maxlen:
            self._drop_oldest()  # the deques' maxlen drops it below
        self._samples.append(sample)
        self._tokens.append(sample[0])
        self._seconds.append(sample[1])
        root = sample[3]
        if root is None:
            self.unpriced += 1
        else:
            self._priced.append(root)
        if not self._stale:  # the same last addition as ``sum`` over the window
            self._tokens_sum += sample[0]
            self._seconds_sum += sample[1]
            if root is not None:
                self._root_sum += root

    def popleft(self) -> tuple:
        """Remove and return the oldest sample (IndexError when empty)."""
        if not self._samples:
            raise IndexError("pop from an empty GuardWindow")
        self._drop_oldest()
        self._tokens.popleft()
        self._seconds.popleft()
        return self._samples.popleft()

    def clear(self) -> None:
        """Remove every sample."""
        for field in (self._samples, self._tokens, self._seconds, self._priced):
            field.clear()
        self.unpriced = 0
        self._stale = True

    def extend(self, samples) -> None:
        """Append ``samples`` in order (the oldest leave a full window)."""
        for sample in list(samples):
            self.append(sample)

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self):
        return iter(self._samples)

    def __getitem__(self, i: int) -> tuple:
        return self._samples[i]

    def __repr__(self) -> str:
        return f"GuardWindow({list(self._samples)!r}, maxlen={self.maxlen})"


class ThroughputGuard:
    """Online guard: draft only while drafting cycles realise more tokens/s than non-drafting ones.

    A two-armed comparison over realised cycles (issue 12, "a planner that never loses"): arm
    ``spec`` = cycles that drafted at least one level, arm ``ar`` = cycles that drafted none. Each
    arm's realised rate is committed tokens / seconds over its last ``window`` cycles, the seconds
    being each cycle priced by the cost model on its REALISED misses (see
    :meth:`SpecFitPolicy.observe_cycle`: never wall time, so live and simulated runs decide alike). On the
    first-level question (the root alone):

    * fewer than ``min_samples`` drafting cycles: no opinion (the planner's rule decides);
    * then fewer than ``min_samples`` non-drafting cycles: no drafting (measure autoregressive);
    * else drafting is preferred unless its realised rate is more than ``margin`` below the
      non-drafting one (near a tie the exact planner keeps the say: per-cycle rates are noisy,
      and a planner that wins by a little should not be dragged to autoregressive); every ``probe_period * clip(gap / 2.5%, 1, 8)``-th
      question (``gap``: relative difference of the two rates; a clear loser is probed more
      rarely, so probing costs about ``gap / period``, at most 2.5% / ``probe_period``) takes the
      other arm, so a change of regime (cache warming, a harder text) is noticed. Preferring
      ``spec`` leaves the decision to the planner's rule (which may still decline); preferring
      ``ar`` declines.

    Evidence expires: once an arm holds ``min_samples`` samples from the last ``horizon`` cycles
    (of either arm), its older samples leave it, so a rarely played arm is judged on recent
    cycles, yet never left without evidence (no forced re-measurement). Without it the first
    drafting cycles, paid on a cold expert cache, stayed the drafting arm's evidence while probes
    were rare, and SpecFit decoded autoregressively in a cell where drafting paid (shipped trace,
    2 GB/s, cache 32 of 64, overlap off: 0.973 of chain; 1.005 with a 128-cycle horizon).

    Paired evidence: a drafting cycle also carries what the root alone would have cost in the
    same cycle (``root_s``: the cost model's price of 0 levels, 1 node, the same context and the
    root's misses against the cache the planner saw, see :func:`root_layer_misses`; with prefetch
    also the copies the root alone would have prefetched, :func:`root_alone_copies`, priced as a
    realised root-only cycle). The
    reference rate drafting must match pools the non-drafting arm with these root-alone
    counterfactuals (one token each), so a rarely played arm is never the only, noisy evidence.
    On the shipped trace at 1 GB/s, cache 8 of 64, overlap on (where the fitted acceptance makes
    SpecFit draft rarely) the non-drafting arm alone let noisy drafting through near a tie: 0.978
    of autoregressive; pooled: 0.997. Not kept: the counterfactuals ALONE as the reference (0.999
    there, but 2 cells of the 64 beyond the 2% noise: 0.971 of chain at 2 GB/s, cache 32,
    overlap off; 16 GB/s, cache 8, overlap off).

    Tried on that trace's 64-cell grid and not kept: judging an arm only after 4 samples (3 cells
    beyond the 2% noise instead of 1), and asking drafting to beat autoregressive by half a
    standard error of its rate (drafting cycles commit 1 to 5 tokens, so the error is wide; 0.85 of
    chain at 128 GB/s, cache 32): both trap SpecFit in autoregressive decoding from its first
    drafting cycles on.

    The per-cycle planner is exact for its predicted objective; the guard corrects what the
    objective cannot see (misestimated acceptance, evictions of experts later tokens need, draft
    time spent before verifying the root only) with what the cycles realised. Both the simulator
    (``sim.replay``) and the live engine (``live.spec.engine``) report each cycle through
    :meth:`SpecFitPolicy.observe_cycle`.

    Args:
        window: cycles kept per arm (count); min_samples: per arm before the arm is judged;
        probe_period: questions between probes of the preferred-against arm (count, before the
            gap scaling above); margin: relative rate gap tolerated before declining to draft;
        horizon: cycles (of either arm) after which a sample may expire (count).

    Raises:
        ValueError: a window, sample count, period or horizon below 1, a margin outside [0, 1).
    """

    def __init__(
        self,
        window: int = 64,
        min_samples: int = 2,
        probe_period: int = 32,
        margin: float = 0.01,
        horizon: int = 128,
    ) -> None:
        for name, value in (
            ("window", window),
            ("min_samples", min_samples),
            ("probe_period", probe_period),
            ("horizon", horizon),
        ):
            if int(value) < 1:
                raise ValueError(f"throughput guard: {name} must be >= 1, got {value}")
        if not 0.0 <= float(margin) < 1.0:
            raise ValueError(f"throughput guard: margin must be in [0, 1), got {margin}")
        self.margin = float(margin)
        self.window, self.min_samples, self.probe_period = int(window), int(min_samples), int(probe_period)
        self.horizon = int(horizon)
        # per arm: (tokens committed, priced seconds, index of the cycle among all observed,
        # the root alone's priced seconds in the same cycle or None), with their sums
        self.arms: dict[str, GuardWindow] = {"spec": GuardWindow(self.window), "ar": GuardWindow(self.window)}
        self.questions = 0
        self.cycles = 0  # cycles observed so far (both arms)

    def observe(self, num_committed: int, cycle_s: float, num_levels: int, root_s: float | None = None) -> None:
        """Record one realised cycle: tokens committed (bonus included), its seconds (the live engine
        and the simulator pass the cost model's price, see :meth:`SpecFitPolicy.observe_cycle`),
        levels drafted, and for a drafting cycle the root alone's price in the same cycle (seconds,
        or None: not known). Samples ``horizon`` or more cycles old leave both arms."""
        if cycle_s > 0:
            paired = float(root_s) if num_levels > 0 and root_s is not None and root_s > 0 else None
            self.arms["spec" if num_levels > 0 else "ar"].append(
                (float(num_committed), float(cycle_s), self.cycles, paired)
            )
        self.cycles += 1
        stale = self.cycles - 1 - self.horizon  # a sample of this cycle index or older is stale
        for cycles in self.arms.values():
            if not cycles or cycles[0][2] > stale:  # nothing stale (the oldest is fresh)
                continue
            fresh = sum(1 for c in cycles if c[2] > stale)
            while fresh >= self.min_samples and cycles[0][2] <= stale:
                cycles.popleft()

    def rate(self, arm: str) -> float:
        """Realised tokens/s of ``arm`` (``"spec"`` or ``"ar"``) over its window; NaN when empty."""
        return self.arms["spec"].paired_rates(self.arms["ar"])[{"spec": 0, "ar": 1}[arm]]

    def root_rate(self) -> float:
        """Counterfactual tokens/s of the root alone over the drafting arm's cycles (one token per
        cycle at its ``root_s``); NaN when empty or when a cycle lacks its root price."""
        return self.arms["spec"].paired_rates(self.arms["ar"])[2]

    def reference_rate(self) -> float:
        """The rate drafting must match: the non-drafting arm's cycles pooled with the drafting
        arm's root-alone counterfactuals (tokens over seconds of both); NaN when the drafting arm
        lacks root prices (then the caller falls back to the non-drafting arm alone)."""
        return self.arms["spec"].paired_rates(self.arms["ar"])[3]

    def allows_drafting(self) -> bool:
        """Asked once per cycle on the root alone: False = do not draft this cycle."""
        self.questions += 1
        arms = self.arms
        spec, ar_alone, _, ar, num_spec = arms["spec"].paired_rates(arms["ar"])
        if num_spec < self.min_samples:
            return True
        if ar != ar:  # no paired prices: the non-drafting arm alone is the reference
            if len(arms["ar"]) < self.min_samples:
                return False
            ar = ar_alone
        prefer_spec = spec >= ar * (1.0 - self.margin)  # near a tie the exact planner keeps the say
        # rarer probes of a clear loser: period = int(probe_period * min(8, max(1, |spec / ar - 1| / 2.5 %)))
        # written without builtins, the same values (NaN scales by 1; the product is positive, so
        # // 1.0 truncates as int() does, and the modulo of whole numbers is exact): each builtin
        # costs ~3 us after a model forward, once per live cycle (issue 14; paired, cold)
        gap = spec / ar - 1.0
        scale = (gap if gap >= 0.0 else -gap) / 0.025
        scale = scale if scale > 1.0 else 1.0
        scale = scale if scale < 8.0 else 8.0
        probe = self.questions % (self.probe_period * scale // 1.0) == 0
        return prefer_spec != probe


class SpecFitPolicy(TreePolicy):
    """SpecFit: exact throughput-optimal subtree, and when to stop drafting.

    ``select`` runs :func:`specfit.planner.plan_exact`; :meth:`keep_drafting` decides after each
    drafted level (and on the root alone, before any drafting) whether to draft another.

    Args:
        stopping: ``"expected"`` (default, :meth:`keep_drafting_expected`: continue when the
            predicted throughput of the best path extended by the expected next levels beats the
            current optimum) or ``"bound"`` (:meth:`keep_drafting_bound`: stop only when no deeper
            tree can beat it, a provable but loose test that rarely stops early).
        root_alpha_weight: weight of a new observation in the running estimate of the root's
            best-child acceptance used by the expected rule on the root alone (0 < w <= 1).
        reprobe_rate: after each cycle the expected rule declines to draft, the root estimate
            moves this fraction of the way back to 1, so a policy that stopped drafting
            eventually drafts again and re-measures (0 <= r <= 1).

        guard: keep the :class:`ThroughputGuard` (default True): once cycles are reported through
            :meth:`observe`, drafting on the root alone is allowed only while drafting cycles
            realise more tokens/s than non-drafting ones (with periodic probes of the other arm).
        deadline_fraction: give each exact search a deadline of this fraction of the predicted
            cycle time of the context (root only, no transfers: the cycle's least predicted
            time), ``plan_exact(ctx, deadline_s=...)``; a search cut short returns its incumbent
            with ``Plan.exact = False`` and its certified ``Plan.gap``. ``None`` (default): no
            deadline (deterministic; the simulator's default, ``SimConfig.planner_deadline_fraction``
            sets one). The live engine passes :data:`LIVE_DEADLINE_FRACTION`.

    The policy keeps that one running estimate (and the guard's windows) across cycles; build one
    policy per run.

    Raises:
        ValueError: unknown ``stopping`` or a weight / rate / fraction out of range.
    """

    name = "specfit"

    def __init__(
        self,
        stopping: str = "expected",
        root_alpha_weight: float = 0.25,
        reprobe_rate: float = 0.05,
        guard: bool = True,
        deadline_fraction: float | None = None,
    ) -> None:
        if stopping not in STOPPING_RULES:
            raise ValueError(f"specfit policy: stopping must be one of {list(STOPPING_RULES)}, got {stopping!r}")
        if not 0.0 < float(root_alpha_weight) <= 1.0:
            raise ValueError(f"specfit policy: root_alpha_weight must be in (0, 1], got {root_alpha_weight}")
        if not 0.0 <= float(reprobe_rate) <= 1.0:
            raise ValueError(f"specfit policy: reprobe_rate must be in [0, 1], got {reprobe_rate}")
        self.stopping = stopping
        self.root_alpha_weight = float(root_alpha_weight)
        self.reprobe_rate = float(reprobe_rate)
        self.root_alpha = 1.0  # optimistic start: the first cycle drafts, then measures
        self.guard = ThroughputGuard() if guard else None
        if deadline_fraction is not None and not 0.0 <= float(deadline_fraction) < float("inf"):
            raise ValueError(f"specfit policy: deadline_fraction must be >= 0 or None, got {deadline_fraction}")
        self.deadline_fraction = None if deadline_fraction is None else float(deadline_fraction)

    def plan(self, ctx: PolicyContext) -> Plan:
        """:func:`plan_exact` of ``ctx``, with this policy's deadline (see ``deadline_fraction``)."""
        if self.deadline_fraction is None or ctx.node_experts.is_union_size:  # no search to cut short
            return plan_exact(ctx)
        least_s = ctx.cost.cycle_s_total(ctx.num_levels, 1, ctx.context_len, 0.0)
        return plan_exact(ctx, deadline_s=self.deadline_fraction * least_s)

    def observe(self, num_committed: int, cycle_s: float, num_levels: int) -> None:
        """Report one realised cycle (tokens committed incl. bonus, its seconds, levels drafted)."""
        if self.guard is not None:
            self.guard.observe(num_committed, cycle_s, num_levels)

    def observe_cycle(
        self,
        cost: CycleCostModel,
        num_committed: int,
        num_levels: int,
        num_nodes: int,
        context_len: int,
        misses_per_layer: Any,
        root_misses_per_layer: Any = None,
        prefetched_per_layer: Any = None,
        root_prefetched_per_layer: Any = None,
    ) -> None:
        """Report one realised cycle priced by the cost model: what the live engine and the
        simulator both call, so the guard decides alike in both (the same committed tokens and
        the same cache misses give the same seconds, where wall-clock seconds would not: a
        guard fed measured time makes SpecFit's choices depend on machine noise, so a resumed
        run, a repeat or the simulator's replay of a live run would choose differently).

        The price is ``cost.realised_cycle_s(num_levels, num_nodes, context_len, misses_per_layer,
        prefetched_per_layer)`` (``cost.cycle_s``; with next-layer prefetch priced the realised
        demand misses and the prefetch copies issued per layer, ``prefetched_per_layer`` int[L],
        in place of the share's estimates) with the cycle's REALISED misses (int[L]), so the guard still sees what the per-cycle objective
        cannot: the realised acceptance and the misses caused by earlier cycles' evictions; the
        cost model's own error is calibration's to fix (``calibration.fit``). Planner time is not
        priced (it is the same order for both arms' questions).

        ``root_misses_per_layer`` (int[L], :func:`root_layer_misses` on the cache the cycle started
        from) prices what the root alone would have cost in a drafting cycle,
        ``cost.realised_cycle_s(0, 1, context_len, root_misses_per_layer,
        root_prefetched_per_layer)``, for the guard's paired comparison: with prefetch,
        :func:`root_alone_copies` gives both, so the root alone is priced with the prefetch
        copies it would have made, as realised root-only cycles are (None: ``cost.cycle_s`` of
        the misses, no copies).
        """
        if self.guard is not None:
            priced_s = cost.realised_cycle_s(
                int(num_levels), int(num_nodes), int(context_len), misses_per_layer, prefetched_per_layer
            )
            root_s = None
            if int(num_levels) > 0 and root_misses_per_layer is not None:
                root_s = float(
                    cost.realised_cycle_s(0, 1, int(context_len), root_misses_per_layer, root_prefetched_per_layer)
                )
            self.guard.observe(num_committed, float(priced_s), num_levels, root_s)

    def select(self, ctx: PolicyContext) -> Plan:
        """The exact optimum (see :mod:`specfit.planner`); a drafted tree also updates the root estimate."""
        if ctx.tree.max_depth >= 1:
            self.observe_root(float(ctx.accept_probs[ctx.tree.depths == 1].max()))  # the nodes at depth 1
        return self.plan(ctx)

    def observe_root(self, observed: float) -> None:
        """Move the root estimate ``root_alpha`` towards ``observed``, the largest P at depth 1 of
        a drafted tree (clipped to [0, 1]), by ``root_alpha_weight``."""
        w = self.root_alpha_weight
        # min(max(observed, 0.0), 1.0) without the builtins (the same value, NaN kept, the same
        # type): each costs ~3 us after a model forward, once per live cycle (issue 14)
        clipped = 0.0 if observed < 0.0 else observed
        clipped = 1.0 if clipped > 1.0 else clipped
        self.root_alpha = (1.0 - w) * self.root_alpha + w * clipped

    def union_size_questions(self, cost, calibration, max_depth: int, max_nodes: int) -> UnionSizeQuestions:
        """SpecFit's stopping questions under a union-size prediction, one compiled call each
        (:class:`UnionSizeQuestions`: what :meth:`keep_drafting` answers on contexts, expected rule),
        for a run with this ``cost`` model, ``calibration`` (or None) and maximal tree (``max_depth``
        levels, ``max_nodes`` nodes); :meth:`UnionSizeQuestions.begin` starts each cycle.

        Raises:
            ValueError: not the expected rule, or ``max_depth`` < 0.
        """
        if self.stopping != "expected":
            raise ValueError(f"union_size_questions: only the expected rule, not {self.stopping!r}")
        if int(max_depth) < 0:
            raise ValueError(f"keep_drafting: max_depth must be >= 0, got {max_depth}")
        return UnionSizeQuestions(self, cost, calibration, max_depth, max_nodes)

    def keep_drafting(self, ctx: PolicyContext, max_depth: int, topk: int | None = None) -> bool:
        """True if another draft level should be drafted (the rule chosen by ``stopping``); on the
        root alone the :class:`ThroughputGuard` may decline first.

        Raises:
            ValueError: ``max_depth`` < 0 or ``topk`` < 1.
        """
        if ctx.tree.max_depth == 0 and self.guard is not None and not self.guard.allows_drafting():
            return False
        if self.stopping == "bound":
            return self.keep_drafting_bound(ctx, max_depth, topk)
        return self.keep_drafting_expected(ctx, max_depth, topk)

    def keep_drafting_expected(self, ctx: PolicyContext, max_depth: int, topk: int | None = None) -> bool:
        """Expected-value rule: draft on while the best path, extended by the expected next levels, pays.

        Let ``S*`` be the optimum on the current tree (throughput ``R*``), ``v`` the most probable
        node of the deepest level and ``alpha`` its edge acceptance ``P(v) / P(parent(v))`` (on the
        root alone, the running estimate of the root's best child, see the class). A chain of
        ``k`` more levels below ``v`` is expected to add nodes of acceptance ``P(v) alpha^j``,
        ``j = 1..k`` (acceptance decays geometrically along a path, the usual model of draft
        acceptance: Leviathan et al. 2023, Sec. 3.5). Drafting continues when, for some ``k`` up to
        the remaining depth, ``S* + path(v) + chain(k)`` priced by the cost model (``k`` more draft
        levels, ``draft_base_s`` on the root alone, ``k`` more verified nodes, its predicted misses)
        has a higher predicted throughput than ``R*``. Chain nodes are priced with ``v``'s predicted
        experts (per-node predictors) or by subtree size (union-size). An estimate, not a bound:
        it can stop before a deeper tree that would have paid (see :meth:`keep_drafting_bound`).
        On the root alone a "no" also moves the root estimate back towards 1 (``reprobe_rate``).
        """
        if int(max_depth) < 0:
            raise ValueError(f"keep_drafting: max_depth must be >= 0, got {max_depth}")
        if topk is not None and int(topk) < 1:
            raise ValueError(f"keep_drafting: topk must be >= 1 or None, got {topk}")
        tree = ctx.tree
        depth = int(tree.max_depth)
        if depth >= int(max_depth):
            return False
        if ctx.node_experts.is_union_size:  # plan and rule in one compiled call (prices by subtree size)
            keep = plan_union_size(ctx, self.root_alpha, int(max_depth))[1]
            if depth == 0 and not keep:
                self.root_alpha += self.reprobe_rate * (1.0 - self.root_alpha)
            return keep
        best = self.plan(ctx)
        base, gain, k = _chain_gain(ctx, best, self.root_alpha, int(max_depth) - depth)
        nodes = base.shape[0] + k
        misses = np.full(k.shape, float(layer_misses(ctx, base).sum()))
        cycle = ctx.cost.plan_cycle_s_total(ctx.num_levels + k, nodes, ctx.context_len, misses)
        keep = bool(np.any(gain > best.predicted_tokens_per_s * cycle))
        if tree.max_depth == 0 and not keep:
            self.root_alpha += self.reprobe_rate * (1.0 - self.root_alpha)
        return keep

    def keep_drafting_bound(self, ctx: PolicyContext, max_depth: int, topk: int | None = None) -> bool:
        """Stopping rule as a bound, called after each drafted level: True if another level could pay.

        Let ``R*`` be the best predicted throughput on the current tree (``ctx.num_levels``
        levels drafted) and ``Q`` the total P of the deepest level (only its ``topk`` most likely
        nodes when the drafter expands the ``topk`` best frontier nodes, EAGLE-2's beam; ``None``
        = all). Every later level adds at most ``Q`` to E[committed] (a child's acceptance
        excludes its siblings', so a parent's children sum to at most its P, and P never
        increases downwards) and costs at least ``draft_s_per_level + v`` (one more draft step
        and at least one more verified node, ``v = cost.least_verify_share * verify_s_per_node``:
        all of its verify time without overlap, only what no copy can hide with it; H2D >= 0).
        For any subtree S,
        ``(G + kQ) / (T + k*delta) <= R*`` whenever ``G / T <= R*`` and ``Q <= R* * delta``, so
        drafting stops when ``Q <= R* * (draft_s_per_level + v)`` or the tree
        reached ``max_depth``; otherwise it continues.

        Refinements that keep the bound valid and make it tighter: each node of a later level
        has P at most ``P_max``, the largest P of the deepest level, so ``k`` more levels with
        ``m`` new nodes gain at most ``min(k * Q, m * P_max)``; they cost at least
        ``k * draft_s_per_level + m * v + H(m)``, where ``H(m)`` is the smallest
        predicted transfer time that ``m`` more nodes add to any subtree of the current tree. With
        a union-size prediction and no H2D overlap the predicted misses of a subtree depend only
        on its size ``n`` (``F(n) = sum_l u_l(n) * miss_l``), so
        ``H(m) = cost.least_s_per_miss * min_{1 <= n <= N} (F(n + m) - F(n))`` (with next-layer
        knots, whose per-miss terms change with size, the per-layer bound of
        :func:`_min_added_h2d_s_per_size` instead, which may be negative); with per-node sets (oracle,
        recent, token table) the next level's experts are unknown and ``H = 0``. Asked on the root
        alone (nothing drafted yet), the first level also pays ``draft_base_s`` (``b``; sunk once a
        level is drafted). Drafting stops when no ``(k, m)`` beats ``R*``:
        ``min(k Q, m P_max) <= R* (b + k d + m v + H(m))`` for every ``k`` up to the remaining depth
        and ``m`` up to ``ceil(k Q / P_max)``.

        Raises:
            ValueError: ``max_depth`` < 0 or ``topk`` < 1.
        """
        if int(max_depth) < 0:
            raise ValueError(f"keep_drafting: max_depth must be >= 0, got {max_depth}")
        if topk is not None and int(topk) < 1:
            raise ValueError(f"keep_drafting: topk must be >= 1 or None, got {topk}")
        if ctx.tree.max_depth >= int(max_depth):
            return False
        best = self.plan(ctx).predicted_tokens_per_s
        mass, p_max = _max_level_mass(ctx, topk)
        if mass <= 0.0:
            return False
        levels = np.arange(1, int(max_depth) - int(ctx.tree.max_depth) + 1, dtype=np.float64)
        max_new = int(np.ceil(levels[-1] * mass / p_max - 1e-9))
        nodes = np.arange(1, max_new + 1, dtype=np.float64)
        gain = np.minimum(levels[:, None] * mass, nodes[None, :] * p_max)
        base_s = ctx.cost.draft_base_s if ctx.num_levels == 0 else 0.0  # paid once per drafting cycle
        per_node_s = ctx.cost.least_verify_share * ctx.cost.verify_s_per_node  # what overlap cannot hide
        cost_s = base_s + levels[:, None] * ctx.cost.draft_s_per_level + (nodes * per_node_s)[None, :]
        may_fall = ctx.node_experts.is_union_size and _h2d_price_varies_with_size(ctx.cost)
        if not may_fall and not np.any(gain > best * cost_s):  # already stops without the transfer term (H >= 0)
            return False
        cost_s = cost_s + _min_added_h2d_s(ctx, max_new)[None, :]
        return bool(np.any(gain > best * cost_s))


_FLOAT64 = np.dtype(np.float64)
_INT64 = np.dtype(np.int64)  # a dtype, not the type: frombuffer converts np.int64 on each call (~8 us cold)


class UnionSizeQuestions:
    """SpecFit's expected-rule stopping questions under a union-size prediction, each one compiled
    call on the drafter's own arrays (the live planner's decide path, issue 14).

    What every question shares is gathered once per run into one array (the cost terms, the
    calibration's knots: :func:`specfit.decide_kernels.question_constants`) and once per cycle
    in :meth:`begin` (the expected union sizes and miss fractions); :meth:`ask` then runs
    :func:`specfit.decide_kernels.union_size_question`, which computes the tree's acceptance
    (:func:`specfit.acceptance.path_accept_probs`' compiled pass, ``exp`` included), the
    union-size plan and the expected rule (:func:`specfit.decide_kernels.union_size_plan_rule`:
    the code :meth:`SpecFitPolicy.keep_drafting_expected` runs on a :class:`PolicyContext`, as in
    the simulator) in one call: no numpy call, context, tree conversion or plan object per
    question. :meth:`select` ends the cycle as ``policy.select`` does on the context of the last
    tree, from the last answer. Answers, plans and the policy's state (``root_alpha``, the guard)
    are those of ``policy.keep_drafting(ctx, max_depth)`` and ``policy.select(ctx)`` on the
    context of the same tree, bit for bit (``tests/test_specfit_decide_kernels.py``).
    :meth:`context` builds that context, its plan remembered by the planner.

    The cold-page cost (issue 14): on the build machine code and data untouched for ~1 ms (a
    model forward between two questions) run several times slower on their next use, per
    distinct page, so each numpy call, Python object or compiled argument a question touches
    costs tens of microseconds live; hence one array of constants and no numpy call per question.

    Build with :meth:`SpecFitPolicy.union_size_questions`.
    """

    def __init__(self, policy, cost, calibration, max_depth: int, max_nodes: int) -> None:
        from specfit.acceptance import _NO_VALUES

        self.policy, self.cost, self.max_depth, self.max_nodes = policy, cost, int(max_depth), int(max_nodes)
        kernels = decide_kernels()  # numba loads the kernels now, not in the first question
        self.calibrated = calibration is not None
        self.edge = not self.calibrated or calibration.scope == "edge"
        knots = (_NO_VALUES,) * 4
        if self.calibrated:
            runner = (calibration.runner_up_knots_x, calibration.runner_up_knots_y)
            if runner[0] is None or not self.edge:
                runner = (_NO_VALUES, _NO_VALUES)
            knots = (calibration.knots_x, calibration.knots_y, *runner)
        room = kernels.question_room(self.max_nodes + self.max_depth, int(cost.num_layers))
        self.work, self.answer_at = kernels.question_constants(  # the last answer's P and nodes at answer_at
            cost_params(cost), self.calibrated, self.edge, self.max_depth, *knots, room
        )
        self._bind()
        self.node_experts = self.cached_bits = self.table = self.miss = None
        self._typed = False  # table and miss have the entry point's types (set with them)
        self.context_len = 0
        self.observed = False  # the miss fractions are an observed one, cleaned in the kernel
        self.last: tuple | None = None  # (tree, levels, answer) of the last question
        # the root alone: the question asked before drafting, without a tree object per cycle
        zeros = np.zeros(1)
        self.root = DraftTree.trusted(
            token_ids=np.zeros(1, np.int64), parents=np.full(1, -1, np.int64), depths=np.zeros(1, np.int64),
            draft_logprobs=zeros, path_logprobs=zeros,
        )  # fmt: skip
        self._warm_up()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_ids"], state["_id_view"]  # views of ``work``: a copy would not see the kernel's answers
        del state["_edge_map"]  # derived from calibrated and edge
        del state["_kernel"], state["_entry"], state["_room"]  # compiled code: loaded again, not pickled
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        work = self.work  # the compiled entry point writes it unchecked: float64[W], C order, writable
        if not (
            type(work) is np.ndarray and work.dtype == _FLOAT64 and work.ndim == 1
            and work.flags.c_contiguous and work.flags.writeable
        ):  # fmt: skip  (e.g. read-only from pickle protocol 5's out-of-band buffers)
            self.work = np.array(work, dtype=np.float64, order="C").reshape(-1)
        self._bind()

    def _bind(self) -> None:
        """Set what is derived, not kept in a pickle (``__getstate__`` drops it): the flag, the
        compiled code and the views of ``work`` (``__init__``, ``__setstate__``)."""
        self._edge_map = self.calibrated and self.edge  # questions take the draft log-probs as they are
        kernels = decide_kernels()
        self._kernel = kernels.union_size_question  # numba's dispatcher: checks every argument's type
        self._entry = kernels.question_entry()  # no checks: only for the types checked in _answer
        self._room = kernels.question_room  # values of work from answer_at on for (nodes, layers)
        self._bind_work()

    def _bind_work(self) -> None:
        """The views of ``work`` (after :meth:`_bind`, and when ``work`` grows)."""
        self._ids = self.work.view(np.int64)  # the answer's node ids, as the kernel writes them
        self._id_view = memoryview(self._ids)  # the same ids, for the plan's own copy (no numpy call)

    def _warm_up(self) -> None:
        """Run the kernel once through the entry point loaded in ``__init__`` (what every
        :class:`specfit.tree.TypedTree` takes) and build a plan from its answer, so the first
        cycle runs code that already ran."""
        tree = DraftTree.from_parents(np.arange(2), np.array([-1, 0]), np.log([1.0, 0.5]))
        table = np.ones((2 + self.max_depth, 1))
        table.setflags(write=False)  # as specfit.planner.union_table hands it
        self._set_arrays(table, np.ones(1))
        self._plan(tree, self._answer(tree, 1, True), 0.0)
        self.table = self.miss = self.last = None
        self._typed = False

    def _set_arrays(self, table: np.ndarray, miss: np.ndarray) -> None:
        """Keep a new ``table`` and the cycle's ``miss`` and whether they have the types of the
        compiled entry point (float64, 2 and 1 axes: :func:`specfit.decide_kernels.question_entry`),
        checked with ``==`` (an unpickled dtype is an equal but distinct object). Called only with a
        table other than ``self.table`` (:meth:`_warm_up`, :meth:`begin` on new sizes, :meth:`_answer`
        on a larger one): :meth:`begin` keeps a kept table and its check without this call."""
        self._table_typed = type(table) is np.ndarray and table.dtype == _FLOAT64 and table.ndim == 2
        self.table, self.miss = table, miss
        self._typed = (
            self._table_typed and type(miss) is np.ndarray and miss.ndim == 1
            and (miss.dtype is _FLOAT64 or miss.dtype == _FLOAT64)
        )  # fmt: skip

    def begin(
        self, node_experts, cached_bits: np.ndarray, context_len: int, observed: np.ndarray | None = None
    ) -> UnionSizeQuestions:
        """Start a cycle: ``node_experts`` (a union-size prediction), ``cached_bits`` uint64[L, W]
        (the cache as the planner sees it), ``context_len`` (tokens). ``observed``: float64[L],
        the cache's observed miss fraction per layer, to use instead of ``node_experts``' (what
        :class:`specfit.predictors.UnionSizePredictor` without a fixed fraction would have put
        there: non-finite values count as 1, the rest clipped to [0, 1], done in the compiled
        question), so a cycle needs no new prediction. Returns ``self``.

        Raises:
            ValueError: ``node_experts`` without union sizes (an ``observed`` of another length
            than ``L`` raises in the cycle's first question: the compiled call checks it).
        """
        table = self.table
        if node_experts is not self.node_experts or table is None:  # the same sizes: the same table
            if not node_experts.is_union_size:
                raise ValueError("UnionSizeQuestions.begin: node_experts is not a union-size prediction")
            table = union_table(node_experts, self.max_nodes + self.max_depth)
        # once per live cycle after a model forward (issue 14): int() only for a context length
        # that is not an int, and no _set_arrays frame for the kept table (-5 to -7 us, paired)
        self.node_experts, self.cached_bits = node_experts, cached_bits
        self.context_len = context_len if type(context_len) is int else int(context_len)
        self.observed = observed is not None
        self.last = None
        if observed is None:
            miss = np.array(node_experts.layer_miss_fraction(cached_bits), dtype=np.float64)  # own, writable
        else:  # the engine's own float64[L] copy is taken as it is (no numpy call)
            miss = observed
            if type(miss) is not np.ndarray or (miss.dtype is not _FLOAT64 and miss.dtype != _FLOAT64):
                miss = np.array(observed, dtype=np.float64)
        if table is self.table:  # the kept table, its types checked when it came: miss is a float64 ndarray here
            self.miss = miss
            self._typed = self._table_typed and miss.ndim == 1
        else:  # a new table: its types checked (miss's length is checked by the compiled question)
            self._set_arrays(table, miss)
        return self

    def _answer(self, tree, levels: int, ask: bool) -> tuple:
        """``(ok, keep, cycle_s, expected, misses, depth1_max, k, N)`` of the compiled question; P
        and the plan's nodes in ``self.work`` from ``answer_at`` on until the next question. The
        kernel measures the tree (no numpy call here): one too large for the table or the room
        comes back unanswered (``k = -1``), both grow and it is asked again."""
        if self._edge_map:  # the edge map's own log-probs (exp in the kernel)
            values = tree.draft_logprobs
        elif self.calibrated:
            values = tree.path_logprobs
        else:  # path_accept_probs' own np.exp: the simulator's values everywhere
            values = np.exp(tree.path_logprobs)
        # the compiled entry point for the types it was compiled for: the arrays of a DraftTree or
        # TokenTree, exactly (is_typed_tree: types checked where the tree was made; not any
        # subclass, whose float parents would be misread: a crash) and the cycle's table and miss
        # fractions (checked in begin); numba's dispatcher checks each argument per call, ~15 us
        # per question live (issue 14). Anything else goes through the dispatcher, which checks
        # (and may compile). The kernel checks lengths and parent order itself (k = -4, -5).
        # is_typed_tree's test inline: its call (a frame, specfit.tree's globals) costs ~8 us per
        # question after a model forward (paired, cold; issue 14)
        if self._typed and type(tree) in TYPED_TREE_TYPES and type(levels) is int:
            kernel = self._entry
        else:
            kernel = self._kernel
        while True:
            answer = kernel(
                tree.parents, values, self.work, self.table, self.miss, self.context_len, levels,
                self.policy.root_alpha, ask,
            )  # fmt: skip
            if answer[6] >= 0:
                break
            if answer[6] == -2:
                raise ValueError(
                    f"UnionSizeQuestions: observed miss fraction: expected float[{self.table.shape[1]}], "
                    f"got shape {self.miss.shape}"
                )
            if answer[6] == -3:
                raise ValueError("UnionSizeQuestions: the tree has no nodes (expected the root at least)")
            if answer[6] == -4:
                name = "draft_logprobs" if self.edge and self.calibrated else "path_logprobs"
                raise ValueError(
                    f"UnionSizeQuestions: tree.{name}: expected {answer[7]} values (= len(parents)), "
                    f"got {values.shape[0]}"
                )
            if answer[6] == -5:
                v = answer[7]
                if kernel is self._entry and tree.parents.dtype != np.int64:  # read as int64 unchecked: a field replaced
                    raise ValueError(f"UnionSizeQuestions: tree.parents: expected int64, got {tree.parents.dtype}")
                want = "-1 for the root" if v == 0 else f"a node id in [0, {v})"
                raise ValueError(f"UnionSizeQuestions: tree.parents[{v}]: expected {want}, got {tree.parents[v]}")
            n = answer[7]  # grow both to hold n nodes (and max_depth more table rows)
            room = self._room(n + self.max_depth, self.table.shape[1])
            if room > self.work.shape[0] - self.answer_at:
                self.work = np.concatenate((self.work[: self.answer_at], np.zeros(room)))
                self._bind_work()
            if n + self.max_depth > self.table.shape[0]:
                self._set_arrays(union_table(self.node_experts, n + self.max_depth), self.miss)
        self.last = (tree, levels, answer)
        return answer

    def _plan(self, tree, answer: tuple, started: float) -> Plan:
        """The :class:`Plan` of ``answer`` (the last one: its nodes are in ``self.work``) on ``tree``;
        its ``decision_s`` counts from ``started`` (``time.perf_counter`` seconds)."""
        n = answer[7]
        at = self.answer_at + n
        nodes = np.frombuffer(self._id_view[at : at + answer[6]].tobytes(), _INT64)  # its own, read-only
        return union_size_plan(nodes, answer[2], answer[3], answer[4], answer[0], n, started)

    def ask(self, tree, levels: int) -> bool:
        """``policy.keep_drafting(ctx, max_depth)`` for the context of ``tree`` after ``levels``
        (int) drafted levels. ``tree``: a ``DraftTree`` or the live ``TokenTree``
        (:func:`specfit.tree.is_typed_tree`: its arrays' types were checked when it was made, so
        the compiled entry point reads them unchecked) or anything with int ``parents`` and float
        ``draft_logprobs``, ``path_logprobs`` arrays (through numba's dispatcher, which checks
        their types per call).

        Raises:
            ValueError: the cost model makes a cycle take 0 s; the tree's ``parents`` break the
            order (``parents[0] == -1``, ``0 <= parents[v] < v``) or its log-probs are shorter
            than ``parents`` (naming the field).
        """
        policy = self.policy
        if self._typed and self._edge_map and type(tree) in TYPED_TREE_TYPES and type(levels) is int:
            # _answer's entry-point call inline for the live default (an edge map, a typed tree):
            # its frame costs ~5-8 us per question after a model forward (paired, cold; issue 14)
            answer = self._entry(
                tree.parents, tree.draft_logprobs, self.work, self.table, self.miss, self.context_len, levels,
                policy.root_alpha, True,
            )  # fmt: skip
            if answer[6] >= 0:
                self.last = (tree, levels, answer)
            else:  # a tree to grow the room for, or an error to name: _answer does both
                answer = self._answer(tree, levels, True)
        else:
            answer = self._answer(tree, levels, True)  # the plan on the tree: no side effect
        root_alone = answer[5] == -1.0  # no node at depth 1
        if root_alone and policy.guard is not None and not policy.guard.allows_drafting():
            return False
        if not answer[0]:
            raise ValueError("cost model: a cycle time of 0 s makes the throughput unbounded")
        if answer[1]:
            return True
        if root_alone and self.max_depth > 0:  # the rule's "no" on the root alone
            policy.root_alpha += policy.reprobe_rate * (1.0 - policy.root_alpha)
        return False

    def select(self, tree, levels: int, asked_s: float = 0.0) -> Plan:
        """``policy.select(ctx)`` for the context of ``tree`` after ``levels`` levels (what
        :meth:`context` would build), without building it: the plan from the last answer when it
        was about this tree (else one compiled call), and a drafted tree's largest depth-1 P
        moves the root estimate (:meth:`SpecFitPolicy.observe_root`). The plan's ``decision_s``
        is the seconds this call took plus ``asked_s`` (the cycle's questions, seconds), so the
        caller needs no second plan to stamp the cycle's decision time.

        Raises:
            ValueError: the cost model makes a cycle take 0 s.
        """
        started = time.perf_counter()
        last = self.last  # the last answer's test here, not in a method: a frame costs ~7 us live (issue 14)
        answer = last[2] if last is not None and last[0] is tree and last[1] == levels else self._answer(tree, levels, False)
        if answer[5] != -1.0:  # a drafted tree (NaN too: np.max's NaN moves it as select does)
            self.policy.observe_root(answer[5])
        at = self.answer_at + answer[7]
        # the plan's own read-only copy: one numpy call (a slice, a copy and setflags are three,
        # ~25 us more after a model forward, issue 14)
        nodes = np.frombuffer(self._id_view[at : at + answer[6]].tobytes(), _INT64)
        return union_size_plan(nodes, answer[2], answer[3], answer[4], answer[0], answer[7], started - asked_s)

    def context(self, tree, draft_tree, levels: int) -> PolicyContext:
        """The :class:`PolicyContext` of ``tree`` (``draft_tree``: it as a ``DraftTree``) after
        ``levels`` levels, its plan remembered by the planner (``select`` then returns it without
        planning again), from one compiled call without the rule (the answer of the last question
        when it was about this tree, bit for bit: a question is a function of its inputs; not on
        the live path, so it asks again rather than keep a second copy of :meth:`select`'s test).

        Raises:
            ValueError: the cost model makes a cycle take 0 s.
        """
        from specfit import planner
        from specfit.node_experts import NodeExperts
        from specfit.predictors import clean_miss_fraction

        started = time.perf_counter()
        answer = self._answer(tree, levels, False)
        p = self.work[self.answer_at : self.answer_at + tree.parents.shape[0]].copy()
        node_experts = self.node_experts
        if self.observed:  # what the predictor would have handed over for this cycle
            node_experts = NodeExperts.trusted(
                node_experts.num_experts,
                union_size=node_experts.union_size,
                miss_fraction=clean_miss_fraction(self.miss),
                source=node_experts.source,
            )
        ctx = PolicyContext.trusted(  # from checked parts: the drafter's tree, the kernel's P
            tree=draft_tree,
            accept_probs=p,
            node_experts=node_experts,
            cached_bits=self.cached_bits,
            cost=self.cost,
            context_len=self.context_len,
            num_levels=levels,
        )
        planner.remember(ctx, self._plan(tree, answer, started))
        return ctx


class CascadePolicy(TreePolicy):
    """Utility gate: the inner policy's plan if its predicted throughput beats AR, else root only.

    Args:
        inner: ``"topn"`` (default) or ``"chain"``; ``inner_kwargs`` go to its constructor.
        margin: relative margin the tree must win by (0 = any gain).

    Raises:
        ValueError: unknown inner policy or negative margin.
    """

    name = "cascade"

    def __init__(self, inner: str = "topn", margin: float = 0.0, **inner_kwargs: Any) -> None:
        if inner not in ("topn", "chain"):
            raise ValueError(f"cascade policy: inner must be 'topn' or 'chain', got {inner!r}")
        if float(margin) < 0:
            raise ValueError(f"cascade policy: margin must be >= 0, got {margin}")
        self.inner = make_tree_policy(inner, **inner_kwargs)
        self.margin = float(margin)
        self._ar = AutoregressivePolicy()

    def select(self, ctx: PolicyContext) -> Plan:
        """Inner plan when it predicts more tokens/s than AR by ``margin``, else the AR plan."""
        started = time.perf_counter()
        tree_plan = self.inner.select(ctx)
        ar_plan = self._ar.select(ctx)
        chosen = tree_plan
        if tree_plan.predicted_tokens_per_s <= ar_plan.predicted_tokens_per_s * (1.0 + self.margin):
            chosen = ar_plan
        return dataclasses.replace(
            chosen, policy=self.name, decision_s=time.perf_counter() - started, nodes_explored=2
        )


_POLICIES = {
    "ar": AutoregressivePolicy,
    "chain": ChainPolicy,
    "topn": TopNPolicy,
    "specfit": SpecFitPolicy,
    "cascade": CascadePolicy,
}


def make_tree_policy(name: str, **kwargs: Any) -> TreePolicy:
    """Build a tree policy by name (one of :data:`TREE_POLICIES`) with its keyword arguments.

    Raises:
        ValueError: unknown name (lists the valid ones) or bad arguments.
    """
    if name not in _POLICIES:
        raise ValueError(f"unknown tree policy {name!r}; expected one of {list(TREE_POLICIES)}")
    try:
        return _POLICIES[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"tree policy {name!r}: bad arguments {sorted(kwargs)}: {exc}") from None
