"""The planning problem (:class:`PolicyContext`) and its answer (:class:`Plan`).

Every tree policy maps a ``PolicyContext`` to a ``Plan``; :func:`evaluate_nodes` is the one place
that scores a subtree (SpecFit objective, arXiv 2610.15417):

    E[committed | S] = 1 + sum over non-root v in S of P(v)
    T_cycle(S)       = cost.cycle_s(num_levels, |S|, context_len, misses_per_layer(S))
    misses_l(S)      = |U_l(S) minus C_l|   (per-node bitsets)   or
                       union_size[l, |S|] * miss_fraction_l       (union-size predictor)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit import bitsets
from specfit.cost import CycleCostModel
from specfit.node_experts import NodeExperts
from specfit.tree import DraftTree


@dataclass(frozen=True, eq=False)
class PolicyContext:
    """Everything a tree policy needs to choose the verified subtree of one cycle.

    Attributes:
        tree: the drafted tree (``N`` nodes).
        accept_probs: float64[N], P(v), 1 at the root and never above the parent's value (see
            :func:`specfit.acceptance.path_accept_probs`).
        node_experts: predicted experts (per-node bitsets uint64[N, L, W] or union sizes).
        cached_bits: uint64[L, W], experts on the device per layer when verification starts.
        cost: the cycle cost model.
        context_len: tokens in the KV cache before the tree (count).
        num_levels: draft levels already drafted (count, for ``cost.draft_s``).

    Raises:
        ValueError: shapes that disagree (names the field), P outside [0, 1], P(root) != 1, or
            P increasing from a parent to a child.
    """

    tree: DraftTree
    accept_probs: np.ndarray
    node_experts: NodeExperts
    cached_bits: np.ndarray
    cost: CycleCostModel
    context_len: int = 0
    num_levels: int = 0

    def __post_init__(self) -> None:
        n = self.tree.num_nodes
        p = np.asarray(self.accept_probs, dtype=np.float64)
        if p.shape != (n,):
            raise ValueError(f"PolicyContext.accept_probs: expected float[{n}] (one per node), got {p.shape}")
        if not np.all(np.isfinite(p)) or p.min() < 0 or p.max() > 1 + 1e-12:
            raise ValueError("PolicyContext.accept_probs: expected probabilities in [0, 1]")
        if abs(p[0] - 1.0) > 1e-12:
            raise ValueError(f"PolicyContext.accept_probs: P(root) must be 1, got {p[0]}")
        if n > 1:
            rising = np.flatnonzero(p[1:] > p[self.tree.parents[1:]] * (1 + 1e-12) + 1e-15) + 1
            if rising.size:
                v = int(rising[0])
                raise ValueError(
                    f"PolicyContext.accept_probs: node {v} has P={p[v]} above its parent's "
                    f"{p[self.tree.parents[v]]}; a path cannot be likelier than its prefix"
                )
        object.__setattr__(self, "accept_probs", p)
        ne = self.node_experts
        if not ne.is_union_size and ne.num_nodes != n:
            raise ValueError(f"PolicyContext.node_experts: expected bits for {n} nodes, got {ne.num_nodes}")
        if ne.num_layers != self.cost.num_layers:
            raise ValueError(
                f"PolicyContext.node_experts: {ne.num_layers} layers but cost.num_layers is {self.cost.num_layers}"
            )
        cached = np.asarray(self.cached_bits)
        expected = (ne.num_layers, bitsets.num_words(ne.num_experts))
        if cached.dtype != np.uint64 or cached.shape != expected:
            raise ValueError(
                f"PolicyContext.cached_bits: expected uint64{list(expected)}, got {cached.dtype}{list(cached.shape)}"
            )
        for name in ("context_len", "num_levels"):
            value = getattr(self, name)
            if int(value) != value or value < 0:
                raise ValueError(f"PolicyContext.{name}: expected an integer >= 0, got {value!r}")

    @classmethod
    def trusted(
        cls,
        tree: DraftTree,
        accept_probs: np.ndarray,
        node_experts: NodeExperts,
        cached_bits: np.ndarray,
        cost: CycleCostModel,
        context_len: int = 0,
        num_levels: int = 0,
    ) -> PolicyContext:
        """Build a context WITHOUT the ``__post_init__`` checks, for trusted internal callers.

        For hot loops (the simulator builds several contexts per cycle from validated trees,
        :func:`specfit.acceptance.path_accept_probs` output and predictor output). The caller
        guarantees what the constructor would check: ``accept_probs`` is float64[N] with P(root)
        = 1 and non-increasing along paths, ``node_experts`` matches the tree and the cost
        model's layers, ``cached_bits`` is uint64[L, W], the counts are integers >= 0. Bad
        input here gives wrong plans, not errors: use the constructor for anything external.
        """
        ctx = object.__new__(cls)
        ctx.__dict__.update(  # the fields, as the frozen dataclass's __init__ stores them
            tree=tree,
            accept_probs=accept_probs,
            node_experts=node_experts,
            cached_bits=cached_bits,
            cost=cost,
            context_len=context_len,
            num_levels=num_levels,
        )
        return ctx

    @property
    def num_nodes(self) -> int:
        """Nodes ``N`` of the drafted tree."""
        return int(self.tree.num_nodes)

    def missing_bits(self) -> np.ndarray:
        """uint64[N, L, W]: each node's predicted experts not already cached (per-node mode)."""
        if self.node_experts.bits is None:
            raise ValueError(
                "PolicyContext.missing_bits: node_experts has no per-node sets (union-size mode)"
            )
        return bitsets.difference(self.node_experts.bits, self.cached_bits[None, :, :])


@dataclass(frozen=True, eq=False)
class Plan:
    """A policy's decision for one cycle.

    Attributes:
        nodes: int64[] node ids of S in the ORIGINAL tree, sorted ascending, containing 0,
            ancestor-closed.
        expected_committed: E[committed | S] including the bonus token (tokens).
        predicted_cycle_s: T_cycle(S) (s).
        predicted_tokens_per_s: expected_committed / predicted_cycle_s (tokens/s).
        decision_s: wall time the policy took (s).
        nodes_explored: search states visited (1 for fixed rules).
        policy: policy name.
        predicted_misses: total predicted expert misses over layers (experts; extension).
        exact: False when the planner stopped at its deadline (counted as a deadline hit); True
            when its search finished. A finished search proves ``nodes`` optimal only when
            ``gap`` is 0: with overlap mode "on" or next-layer prefetch priced, it maximises a
            lower bound on the per-layer cycle, so its plan can fall short of the optimum by at
            most ``gap`` (a review found 66 of 600 small random contexts with next-layer knots
            whose cover rises with size below brute force, all within their gap).
        gap: certified relative gap: the best subtree's predicted throughput is at most
            ``predicted_tokens_per_s * (1 + gap)`` (0 when exact without those two cases;
            ``specfit.planner``).
    """

    nodes: np.ndarray
    expected_committed: float
    predicted_cycle_s: float
    predicted_tokens_per_s: float
    decision_s: float
    nodes_explored: int
    policy: str
    predicted_misses: float = 0.0
    exact: bool = True
    gap: float = 0.0

    @property
    def num_nodes(self) -> int:
        """|S|."""
        return int(self.nodes.shape[0])

    @classmethod
    def trusted(cls, **fields: object) -> Plan:
        """A plan built WITHOUT the frozen dataclass's per-field ``__init__``, for the decide path.

        The live planner builds a plan per stopping question (several per cycle) and re-stamps
        its ``decision_s``; the generated ``__init__`` (one ``object.__setattr__`` per field) and
        ``dataclasses.replace`` cost more than the compiled plan itself. The caller passes the
        attributes above by name with their declared types (the last three default as in the
        class); names are not checked (a misspelt one gives a plan without that field).
        """
        plan = object.__new__(cls)
        plan.__dict__.update(_PLAN_DEFAULTS, **fields)
        return plan

    def replaced(self, **changes: object) -> Plan:
        """``dataclasses.replace(self, **changes)`` built like :meth:`trusted` (same fields, faster);
        ``changes`` are field names, not checked."""
        plan = object.__new__(Plan)
        plan.__dict__.update(self.__dict__, **changes)
        return plan


_PLAN_DEFAULTS = {"predicted_misses": 0.0, "exact": True, "gap": 0.0}


def layer_misses(ctx: PolicyContext, nodes: np.ndarray) -> np.ndarray:
    """Predicted misses per layer for subtree ``nodes``: float64[L] (integral with per-node sets)."""
    ne = ctx.node_experts
    if ne.bits is None:
        return ne.expected_misses(len(nodes), ctx.cached_bits)
    union = bitsets.union(ne.bits[np.asarray(nodes, dtype=np.int64)], axis=0)
    return bitsets.popcount(bitsets.difference(union, ctx.cached_bits)).astype(np.float64)


def evaluate_nodes(ctx: PolicyContext, nodes: np.ndarray) -> tuple[float, float, np.ndarray]:
    """Score subtree ``nodes``: ``(expected_committed, predicted_cycle_s, misses_per_layer float[L])``.

    Does not check ancestor-closure (callers guarantee it; see :func:`make_plan`). With per-node
    predictions and a draft-prefetching run (``cost.draft_prefetch``) the cycle is priced with
    the predicted misses prefetched (``cost.plan_cycle_s``); union-size predictions name no
    experts to prefetch, so they are priced as demand misses (``cost.cycle_s``).
    """
    ids = np.asarray(nodes, dtype=np.int64)
    gain = 1.0 + float(ctx.accept_probs[ids[ids != 0]].sum())
    misses = layer_misses(ctx, ids)
    price = ctx.cost.cycle_s if ctx.node_experts.bits is None else ctx.cost.plan_cycle_s
    cycle = price(ctx.num_levels, ids.shape[0], ctx.context_len, misses)
    return gain, cycle, misses


def _ancestor_closed(tree: DraftTree, ids: np.ndarray) -> bool:
    """``tree.is_ancestor_closed(ids)`` for sorted distinct ``ids`` starting at 0 (fewer checks).

    Raises:
        ValueError: an id out of range (the tree's own message).
    """
    n = tree.parents.shape[0]
    if ids[-1] >= n:
        return tree.is_ancestor_closed(ids)  # raises, naming the node
    mask = np.zeros(n, dtype=bool)
    mask[ids] = True
    return bool(mask[tree.parents[ids[1:]]].all())


def make_plan(
    ctx: PolicyContext, nodes: np.ndarray, policy: str, decision_s: float, nodes_explored: int
) -> Plan:
    """Build a :class:`Plan` for ``nodes`` (sorted, checked ancestor-closed), scoring it with :func:`evaluate_nodes`.

    Raises:
        ValueError: ``nodes`` is not ancestor-closed or lacks the root (a policy bug).
    """
    ids = np.unique(np.asarray(nodes, dtype=np.int64))
    if ids.size == 0 or ids[0] != 0 or not _ancestor_closed(ctx.tree, ids):
        raise ValueError(
            f"policy {policy!r} chose a set that is not ancestor-closed with the root: {ids.tolist()}"
        )
    gain, cycle, misses = evaluate_nodes(ctx, ids)
    ids.setflags(write=False)
    return Plan(
        nodes=ids,
        expected_committed=gain,
        predicted_cycle_s=cycle,
        predicted_tokens_per_s=gain / cycle if cycle > 0 else float("inf"),
        decision_s=decision_s,
        nodes_explored=int(nodes_explored),
        policy=policy,
        predicted_misses=float(misses.sum()),
    )
