"""The compiled decide path (``specfit.decide_kernels``) gives the numpy forms' values bit for bit.

The live planner asks SpecFit once per drafted level; with the union-size predictor those
questions run compiled kernels (issue 14). Each kernel is checked here against the numpy code it
replaced, written out as the reference, on random trees, maps, cost models and caches:

* ``path_accept_probs`` with an edge map (with and without a runner-up map) and a path map;
* the union-size plan (nodes, predicted cycle, tokens/s, misses) against the reference scan;
* ``keep_drafting_expected`` with union-size prices (the answer and the root estimate it moves);
* ``TokenTree.to_draft_tree`` shares the drafter's arrays instead of copying them.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit import bitsets
from specfit.acceptance import AcceptanceCalibration, path_accept_probs, top_child_mask
from specfit.context import PolicyContext, layer_misses
from specfit.cost import CycleCostModel
from specfit.node_experts import NodeExperts
from specfit.planner import plan_exact
from specfit.policies import SpecFitPolicy, _chain_gain
from specfit.tree import DraftTree


def _reference_accept(tree: DraftTree, calibration: AcceptanceCalibration) -> np.ndarray:
    """The level-by-level numpy pass that ``path_accept_probs`` ran before it was compiled."""
    parents, depths = tree.parents, tree.depths
    p = np.ones(tree.num_nodes, dtype=np.float64)
    if calibration.scope == "edge":
        top = top_child_mask(parents, tree.draft_logprobs)
        edge = np.clip(calibration.apply_edges(np.exp(tree.draft_logprobs), top), 0.0, 1.0)
    else:
        mapped = np.clip(calibration.apply(np.exp(tree.path_logprobs)), 0.0, 1.0)
    for d in range(1, int(tree.max_depth) + 1):
        level = np.flatnonzero(depths == d)
        above = p[parents[level]]
        p[level] = above * edge[level] if calibration.scope == "edge" else np.minimum(mapped[level], above)
        sums = np.bincount(parents[level], weights=p[level], minlength=tree.num_nodes)[parents[level]]
        over = sums > above
        p[level[over]] *= above[over] / sums[over]
    return p


def _random_tree(rng: np.random.Generator, n: int) -> DraftTree:
    parents = [-1] + [int(rng.integers(0, v)) for v in range(1, n)]
    logp = np.concatenate(([0.0], -rng.exponential(1.0, n - 1)))
    if n > 3:  # equal siblings: ties of the top child go to the lowest id
        logp[n - 1] = logp[int(rng.integers(1, n - 1))]
    return DraftTree.from_parents(np.arange(n), parents, logp)


def _random_map(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    m = int(rng.integers(1, 8))
    x = np.sort(rng.choice(np.linspace(0.0, 1.0, 101), size=m, replace=False))
    y = np.sort(rng.random(m)) if rng.random() < 0.8 else np.ones(m)  # over-confident maps too
    return x, y


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 70), st.sampled_from(["edge", "edge+runner", "path"]))
def test_compiled_acceptance_equals_the_numpy_pass(seed, n, kind) -> None:
    rng = np.random.default_rng(seed)
    tree = _random_tree(rng, n)
    x, y = _random_map(rng)
    runner = _random_map(rng) if kind == "edge+runner" else (None, None)
    calibration = AcceptanceCalibration(
        x,
        y,
        scope="path" if kind == "path" else "edge",
        runner_up_knots_x=runner[0],
        runner_up_knots_y=runner[1],
    )
    got = path_accept_probs(tree, calibration)
    want = _reference_accept(tree, calibration)
    assert got.dtype == np.float64 and got.shape == (n,)
    assert got.tobytes() == want.tobytes()  # bit for bit


def _reference_expected_rule(policy: SpecFitPolicy, ctx: PolicyContext, max_depth: int) -> tuple[bool, float]:
    """The numpy form of the expected rule with union-size prices: (answer, root estimate after).

    The chain (leaf, edge acceptance, expected gain) is the per-node rule's own numpy code
    (``_chain_gain``); the union-size prices are the matrix product the rule used before."""
    alpha_before = policy.root_alpha
    best = plan_exact(ctx)
    base, gain, k = _chain_gain(ctx, best, alpha_before, max_depth - int(ctx.tree.max_depth))
    nodes = base.shape[0] + k
    ne = ctx.node_experts
    miss = ne.layer_miss_fraction(ctx.cached_bits)
    misses = ne.expected_union_table(int(nodes[-1]))[nodes.astype(np.int64) - 1] @ miss
    cycle = ctx.cost.cycle_s_total(ctx.num_levels + k, nodes, ctx.context_len, misses)
    keep = bool(np.any(gain > best.predicted_tokens_per_s * cycle))
    if ctx.tree.max_depth == 0 and not keep:
        alpha_before += policy.reprobe_rate * (1.0 - alpha_before)
    return keep, alpha_before


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.booleans(), st.booleans())
def test_compiled_expected_rule_equals_the_numpy_form(seed, n, overlap, fixed_fraction) -> None:
    rng = np.random.default_rng(seed)
    tree = _random_tree(rng, n)
    num_layers, num_experts = int(rng.integers(1, 12)), 64
    top = int(rng.integers(1, 40))
    union = np.cumsum(rng.random((num_layers, top + 1)) * 3, axis=1)
    union[:, 0] = 0.0
    ne = NodeExperts(
        num_experts, union_size=union, miss_fraction=rng.random(num_layers) if fixed_fraction else None
    )
    cost = CycleCostModel(
        2e-3 * rng.random(), 2e-2 * rng.random(), 2e-3 * rng.random(), 1e-7 * rng.random(),
        1e9 + 5e10 * rng.random(), 1e-5 * rng.random(), 98_304 * int(rng.integers(1, 100)), num_layers,
        draft_base_s=1e-3 * rng.random(), overlap_h2d=overlap,
    )  # fmt: skip
    cached = bitsets.pack(rng.integers(-1, num_experts, size=(num_layers, 20)), num_experts)
    ctx = PolicyContext(
        tree, np.exp(tree.path_logprobs), ne, cached, cost, int(rng.integers(0, 500)), int(tree.max_depth)
    )
    max_depth = int(tree.max_depth) + int(rng.integers(1, 6))
    alpha = float(rng.random())
    reference = SpecFitPolicy(guard=False)
    reference.root_alpha = alpha
    want, want_alpha = _reference_expected_rule(reference, ctx, max_depth)
    policy = SpecFitPolicy(guard=False)
    policy.root_alpha = alpha
    assert policy.keep_drafting_expected(ctx, max_depth) is want
    assert policy.root_alpha == want_alpha
    # the per-node form still prices the chain with the base subtree's misses (unchanged path)
    bits = bitsets.pack(rng.integers(-1, num_experts, size=(n, num_layers, 3)), num_experts)
    per_node = PolicyContext(tree, ctx.accept_probs, NodeExperts(num_experts, bits=bits), cached, cost, 0, 1)
    assert layer_misses(per_node, np.arange(n)).shape == (num_layers,)
    assert isinstance(SpecFitPolicy(guard=False).keep_drafting_expected(per_node, max_depth), bool)


def test_live_tree_conversion_shares_the_drafters_arrays() -> None:
    tree_mod = __import__("pytest").importorskip("live.spec.tree")
    token_tree = tree_mod.TokenTree.from_parents([7, 8, 9, 10], [-1, 0, 0, 1], [0.0, -0.1, -0.7, -0.2])
    draft = token_tree.to_draft_tree()
    for name in ("token_ids", "parents", "depths", "draft_logprobs", "path_logprobs"):
        assert getattr(draft, name) is getattr(token_tree, name)
        assert not getattr(draft, name).flags.writeable
    views = tree_mod.TokenTree(
        np.arange(8)[::2], np.array([-1, 0, 0, 1]), np.array([0, 1, 1, 2]), np.zeros(4), np.zeros(4)
    )
    copied = views.to_draft_tree()  # a strided view is copied (contiguous, its own memory)
    assert copied.token_ids.tolist() == [0, 2, 4, 6] and copied.token_ids.base is None
    assert copied.depths.dtype == np.int64 and copied.draft_logprobs.dtype == np.float64
