"""Small synthetic planning problems with real shapes, for tests and the planner benchmark.

Not a trace format (that is ``traces.synthetic``): this draws one :class:`PolicyContext` at a
time. Trees grow like EAGLE-2's dynamic trees (expand the ``topk`` most probable frontier nodes
with ``topk`` children each, then keep the ``num_nodes`` most probable nodes). Routing per layer
follows a Zipf-like popularity (``routing_skew``); a child reuses each of its parent's experts
with probability ``expert_locality`` (consecutive tokens share experts); the cache holds the most
popular ``cache_fraction`` of each layer's experts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specfit import bitsets
from specfit.acceptance import path_accept_probs
from specfit.context import PolicyContext
from specfit.cost import CycleCostModel
from specfit.node_experts import NodeExperts
from specfit.shapes import ModelShape
from specfit.tree import DraftTree


def random_draft_tree(
    rng: np.random.Generator, num_nodes: int, topk: int = 4, max_depth: int = 8
) -> DraftTree:
    """An EAGLE-2-style tree of exactly ``min(num_nodes, reachable)`` nodes (root included).

    Raises:
        ValueError: ``num_nodes`` < 1 or ``topk`` < 1.
    """
    if num_nodes < 1 or topk < 1:
        raise ValueError(f"random_draft_tree: num_nodes and topk must be >= 1, got {num_nodes}, {topk}")
    parents, logp, path = [-1], [0.0], [0.0]
    frontier = [0]
    for _ in range(max_depth):
        if len(parents) >= num_nodes * 3:
            break
        best = sorted(frontier, key=lambda v: -path[v])[:topk]
        frontier = []
        for v in best:
            probs = rng.dirichlet(np.full(topk + 1, 0.6))[:topk]  # last share = other tokens
            for q in np.sort(probs)[::-1]:
                parents.append(v)
                lp = float(np.log(max(q, 1e-12)))
                logp.append(lp)
                path.append(path[v] + lp)
                frontier.append(len(parents) - 1)
    keep = np.lexsort((np.arange(len(path)), -np.asarray(path)))[:num_nodes]
    keep = np.sort(keep)  # ancestor-closed: path probabilities never increase downwards
    new_id = {int(v): i for i, v in enumerate(keep)}
    par = [-1] + [new_id[parents[int(v)]] for v in keep[1:]]
    return DraftTree.from_parents(np.arange(len(keep)), par, np.asarray(logp)[keep])


def random_routing(
    rng: np.random.Generator,
    tree: DraftTree,
    shape: ModelShape,
    routing_skew: float = 1.0,
    expert_locality: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids int64[N, L, K] for each node, and the popularity float[L, E] they were drawn from."""
    n, num_layers, num_experts, k = tree.num_nodes, shape.num_layers, shape.num_experts, shape.top_k
    popularity = np.empty((num_layers, num_experts))
    for layer in range(num_layers):
        weights = 1.0 / np.arange(1, num_experts + 1) ** routing_skew
        popularity[layer] = rng.permutation(weights / weights.sum())
    ids = np.empty((n, num_layers, k), dtype=np.int64)
    log_pop = np.log(popularity)
    rows = np.arange(num_layers)[:, None]
    for v in range(n):
        # Gumbel top-k = weighted sampling without replacement; inherited experts sort first
        scores = log_pop - np.log(-np.log(rng.random((num_layers, num_experts))))
        if v > 0:
            inherit = ids[tree.parents[v]]
            keep = rng.random(inherit.shape) < expert_locality
            scores[np.broadcast_to(rows, inherit.shape)[keep], inherit[keep]] = np.inf
        ids[v] = np.sort(np.argpartition(-scores, k - 1, axis=1)[:, :k], axis=1)
    return ids, popularity


def random_context(
    rng: np.random.Generator,
    shape: ModelShape,
    num_nodes: int,
    cost: CycleCostModel | None = None,
    *,
    cache_fraction: float = 0.5,
    routing_skew: float = 1.0,
    expert_locality: float = 0.5,
    topk: int = 4,
) -> PolicyContext:
    """A full planning problem: tree, P from path probabilities, routing, warm cache, cost."""
    tree = random_draft_tree(rng, num_nodes, topk=topk)
    ids, popularity = random_routing(rng, tree, shape, routing_skew, expert_locality)
    capacity = int(round(cache_fraction * shape.num_experts))
    cached = np.argsort(-popularity, axis=1)[:, :capacity] if capacity else np.full((shape.num_layers, 1), -1)
    cost = cost or CycleCostModel.for_shape(shape)
    return PolicyContext(
        tree=tree,
        accept_probs=path_accept_probs(tree),
        node_experts=NodeExperts(
            shape.num_experts, bits=bitsets.pack(ids, shape.num_experts), source="oracle"
        ),
        cached_bits=bitsets.pack(cached, shape.num_experts),
        cost=cost,
        context_len=0,
        num_levels=int(tree.max_depth),
    )


def random_small_context(
    rng: np.random.Generator,
    num_nodes: int,
    *,
    num_layers: int = 2,
    num_experts: int = 8,
    max_experts_per_node: int = 3,
    overlap_h2d: bool = False,
    sibling_mass: bool = False,
) -> PolicyContext:
    """A random small problem for property tests: any tree shape, random sets, cache and cost.

    Args:
        rng: the randomness.
        num_nodes: ``N`` (root included).
        num_layers, num_experts: ``L`` and ``E``.
        max_experts_per_node: each node routes to 0..this many experts per layer.
        overlap_h2d: cost model flag.
        sibling_mass: draw children's draft probabilities so siblings sum to <= 1 (real
            distributions); otherwise each child's draft probability is drawn independently.
    """
    parents = [-1] + [int(rng.integers(0, v)) for v in range(1, num_nodes)]
    logp = np.zeros(num_nodes)
    if sibling_mass:
        for v in range(num_nodes):
            kids = [c for c in range(1, num_nodes) if parents[c] == v]
            if kids:
                share = rng.dirichlet(np.ones(len(kids) + 1))[: len(kids)]
                logp[kids] = np.log(np.maximum(share, 1e-12))
    else:
        logp[1:] = np.log(rng.uniform(0.02, 1.0, size=num_nodes - 1))
    tree = DraftTree.from_parents(np.arange(num_nodes), parents, logp)
    k = max_experts_per_node
    ids = rng.integers(0, num_experts, size=(num_nodes, num_layers, k))
    ids = np.where(rng.random(ids.shape) < 0.7, ids, -1)
    cached = np.where(rng.random((num_layers, k)) < 0.5, rng.integers(0, num_experts, (num_layers, k)), -1)
    cost = CycleCostModel(
        draft_s_per_level=float(rng.uniform(0, 2e-3)),
        verify_base_s=float(rng.uniform(1e-3, 30e-3)),
        verify_s_per_node=float(rng.uniform(0, 2e-3)),
        verify_s_per_context_token=float(rng.uniform(0, 1e-6)),
        h2d_bytes_per_s=float(rng.uniform(1e9, 50e9)),
        h2d_s_per_transfer=float(rng.uniform(0, 2e-4)),
        expert_bytes=int(rng.integers(0, 20_000_000)),
        num_layers=num_layers,
        overlap_h2d=overlap_h2d,
        source="random",
    )
    context_len = int(rng.integers(0, 2000))
    # drawn last so that the earlier draws (and the contexts of existing seeds) are unchanged
    cost = dataclasses.replace(cost, draft_base_s=float(rng.uniform(0, 2e-3)))
    return PolicyContext(
        tree=tree,
        accept_probs=path_accept_probs(tree),
        node_experts=NodeExperts(num_experts, bits=bitsets.pack(ids, num_experts), source="random"),
        cached_bits=bitsets.pack(cached, num_experts),
        cost=cost,
        context_len=context_len,
        num_levels=int(tree.max_depth),
    )


def random_next_layer_knots(rng: np.random.Generator, max_knots: int = 4) -> dict:
    """Random ``CycleCostModel`` fields of next-layer prefetch's share per tree size, for
    property tests: ``{}`` (one share at every size) half the time, else 1 to ``max_knots``
    strictly increasing node knots from 1 and a share (0, 1 or uniform) and waste (0 or
    uniform in [0, 2)) at each (``CycleCostModel.next_layer_nodes``)."""
    if rng.random() < 0.5:
        return {}
    k = int(rng.integers(1, max_knots + 1))
    nodes = np.cumsum(np.r_[1.0 + rng.uniform(0.0, 3.0), rng.uniform(0.5, 12.0, k - 1)])
    covers = [float(rng.choice([0.0, 1.0, rng.uniform(0, 1)])) for _ in range(k)]
    wastes = [float(rng.choice([0.0, rng.uniform(0, 2)])) for _ in range(k)]
    return {
        "next_layer_nodes": tuple(float(n) for n in nodes),
        "next_layer_cover_fractions": tuple(covers),
        "next_layer_waste_per_misses": tuple(wastes),
    }
