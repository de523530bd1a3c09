"""Baseline tree policies, the cascade gate and SpecFit's stopping rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit import bitsets
from specfit.context import PolicyContext
from specfit.cost import CycleCostModel
from specfit.node_experts import NodeExperts
from specfit.planner import plan_brute_force, plan_exact
from specfit.policies import TREE_POLICIES, SpecFitPolicy, make_tree_policy, top_n_nodes
from specfit.synthetic import random_next_layer_knots, random_small_context
from specfit.tree import DraftTree


def _cut(full: PolicyContext, depth: int) -> PolicyContext:
    """``full`` as the stopping rule sees it after ``depth`` levels: its tree cut at ``depth``."""
    keep = np.flatnonzero(full.tree.depths <= depth)
    return dataclasses.replace(
        full,
        tree=full.tree.subtree(keep),
        accept_probs=full.accept_probs[keep],
        node_experts=NodeExperts(full.node_experts.num_experts, bits=full.node_experts.bits[keep]),
        num_levels=depth,
    )


def _assert_bound_stop_is_safe(full: PolicyContext, cut_depth: int, plan=plan_exact) -> None:
    """If the bound rule stops after ``cut_depth`` levels of ``full``'s tree, no subtree of the
    whole tree beats the best of the cut one (``plan`` gives the optimum)."""
    if full.tree.max_depth <= cut_depth:
        return
    shallow = _cut(full, cut_depth)
    if not make_tree_policy("specfit", stopping="bound").keep_drafting(shallow, max_depth=100):
        assert plan(full).predicted_tokens_per_s <= plan(shallow).predicted_tokens_per_s * (1 + 1e-9)


def _ctx(per_miss_s: float = 0.0, num_levels: int = 2, draft_s: float = 0.0) -> PolicyContext:
    #        0
    #      /   \
    #     1     2        P: 1: .6, 2: .3
    #    / \     \
    #   3   4     5      P: 3: .42, 4: .12, 5: .27
    probs = [1.0, 0.6, 0.3, 0.42, 0.12, 0.27]
    parents = [-1, 0, 0, 1, 1, 2]
    draft = np.log([1.0, 0.6, 0.3, 0.7, 0.2, 0.9])
    tree = DraftTree.from_parents(np.arange(6), parents, draft)
    ids = np.arange(6).reshape(6, 1, 1)
    cost = CycleCostModel(draft_s, 1.0, 0.1, 0.0, 1.0, per_miss_s, 0, 1)
    return PolicyContext(
        tree,
        np.asarray(probs),
        NodeExperts(8, bits=bitsets.pack(ids, 8)),
        bitsets.empty((1,), 8),
        cost,
        0,
        num_levels,
    )


def test_policy_names_and_unknown_name() -> None:
    assert TREE_POLICIES == ("ar", "chain", "topn", "specfit", "cascade")
    with pytest.raises(ValueError, match="expected one of"):
        make_tree_policy("eagle")
    with pytest.raises(ValueError, match="bad arguments"):
        make_tree_policy("topn", depth=3)


def test_autoregressive_is_root_only_without_draft_time() -> None:
    ctx = _ctx(draft_s=0.5)
    plan = make_tree_policy("ar").select(ctx)
    assert plan.nodes.tolist() == [0]
    assert plan.expected_committed == 1.0
    assert plan.predicted_cycle_s == pytest.approx(1.1 + 0.0)  # base + one node, no drafting


def test_chain_follows_the_greedy_path() -> None:
    ctx = _ctx()
    assert make_tree_policy("chain").select(ctx).nodes.tolist() == [0, 1, 3]
    assert make_tree_policy("chain", max_length=1).select(ctx).nodes.tolist() == [0, 1]
    plan = make_tree_policy("chain", max_length=0).select(ctx)
    assert plan.nodes.tolist() == [0]


def test_top_n_is_ancestor_closed_reranking() -> None:
    ctx = _ctx()
    plan = make_tree_policy("topn", num_draft_nodes=3).select(ctx)
    assert plan.nodes.tolist() == [0, 1, 2, 3]  # .6, .42, .3
    assert plan.expected_committed == pytest.approx(1 + 0.6 + 0.42 + 0.3)
    assert plan.predicted_cycle_s == pytest.approx(1.0 + 0.1 * 4)
    assert top_n_nodes(np.array([1.0, 0.5, 0.5, 0.5]), 2).tolist() == [0, 1, 2]  # ties: smaller id


def test_cascade_gate_falls_back_when_speculation_does_not_pay() -> None:
    cheap, dear = _ctx(per_miss_s=0.0), _ctx(per_miss_s=5.0)
    gate = make_tree_policy("cascade", num_draft_nodes=5)
    assert gate.select(cheap).nodes.tolist() == [0, 1, 2, 3, 4, 5]
    fallback = gate.select(dear)
    assert fallback.nodes.tolist() == [0]
    assert fallback.policy == "cascade"
    topn = make_tree_policy("topn", num_draft_nodes=5).select(dear)
    assert fallback.predicted_tokens_per_s > topn.predicted_tokens_per_s


def test_specfit_beats_or_ties_every_baseline() -> None:
    rng = np.random.default_rng(3)
    for _ in range(30):
        ctx = random_small_context(rng, 12)
        best = make_tree_policy("specfit").select(ctx).predicted_tokens_per_s
        for name in ("chain", "topn"):
            assert best >= make_tree_policy(name).select(ctx).predicted_tokens_per_s * (1 - 1e-12)


def test_keep_drafting_rule_on_a_hand_case() -> None:
    ctx = _ctx(num_levels=2, draft_s=0.05)
    policy = make_tree_policy("specfit", stopping="bound")
    best = plan_exact(ctx).predicted_tokens_per_s
    deepest_mass = 0.42 + 0.12 + 0.27
    delta = 0.05 + 0.1
    assert (deepest_mass > best * delta) == policy.keep_drafting(ctx, max_depth=5)
    assert policy.keep_drafting(ctx, max_depth=5) is True  # 0.81 > ~0.75 * 0.15
    assert policy.keep_drafting(ctx, max_depth=2) is False  # depth limit reached
    # only the top-1 frontier node is expanded: mass .42 vs best*delta
    assert policy.keep_drafting(ctx, max_depth=5, topk=1) == (0.42 > best * delta)
    slow_draft = dataclasses.replace(ctx, cost=dataclasses.replace(ctx.cost, draft_s_per_level=10.0))
    assert policy.keep_drafting(slow_draft, max_depth=5) is False
    with pytest.raises(ValueError, match="topk"):
        policy.keep_drafting(ctx, max_depth=5, topk=0)


def test_draft_base_is_paid_by_the_first_level_only() -> None:
    """Asked on the root alone, a level also costs draft_base_s; once drafted, the base is sunk."""
    policy = make_tree_policy("specfit", stopping="bound")
    tree = _ctx().tree
    root = dataclasses.replace(
        _ctx(num_levels=0, draft_s=0.05),
        tree=tree.subtree(np.array([0])),
        accept_probs=np.array([1.0]),
        node_experts=NodeExperts(8, bits=_ctx().node_experts.bits[:1]),
    )
    best = plan_exact(root).predicted_tokens_per_s  # 1 / 1.1 s
    # one level, one node: gain <= P(root) = 1; cost >= base + 0.05 (level) + 0.1 (node)
    assert policy.keep_drafting(root, max_depth=1) is True
    for base_s, expected in ((0.8, True), (1.0, False)):
        assert (1.0 > best * (base_s + 0.15)) is expected
        priced = dataclasses.replace(root, cost=dataclasses.replace(root.cost, draft_base_s=base_s))
        assert policy.keep_drafting(priced, max_depth=1) is expected
    deep = _ctx(num_levels=2, draft_s=0.05)
    sunk = dataclasses.replace(deep, cost=dataclasses.replace(deep.cost, draft_base_s=100.0))
    assert policy.keep_drafting(sunk, max_depth=5) is policy.keep_drafting(deep, max_depth=5) is True


def test_expected_rule_on_a_hand_case() -> None:
    """S* = {0,1,2,3,5}: G = 2.59, T = 2 d + 1.0 + 5 * 0.1. The deepest best node 3 (P .42) has
    edge acceptance .42 / .6 = .7, so one more level is expected to add .294 for d + 0.1 s."""
    for draft_s, expected in ((0.05, True), (0.2, False)):
        ctx = _ctx(num_levels=2, draft_s=draft_s)
        best = plan_exact(ctx)
        assert best.nodes.tolist() == [0, 1, 2, 3, 5]
        r_star = 2.59 / (2 * draft_s + 1.5)
        one_more = (2.59 + 0.42 * 0.7) / (3 * draft_s + 1.6)
        two_more = (2.59 + 0.42 * (0.7 + 0.49)) / (4 * draft_s + 1.7)
        assert (max(one_more, two_more) > r_star) is expected
        assert make_tree_policy("specfit").keep_drafting(ctx, max_depth=4) is expected
        # the bound rule cannot rule the 0.2 s level out: Q = .81 > R* (d + v)
        assert make_tree_policy("specfit", stopping="bound").keep_drafting(ctx, max_depth=4) is True


def test_expected_rule_learns_the_root_acceptance_and_reprobes() -> None:
    policy = make_tree_policy("specfit", root_alpha_weight=0.5, reprobe_rate=0.25)
    assert policy.root_alpha == 1.0
    policy.select(_ctx())  # best depth-1 P is .6
    assert policy.root_alpha == pytest.approx(0.8)
    tree = _ctx().tree
    root = dataclasses.replace(
        _ctx(num_levels=0, draft_s=1.0),  # a 1 s draft level never pays here
        tree=tree.subtree(np.array([0])),
        accept_probs=np.array([1.0]),
        node_experts=NodeExperts(8, bits=_ctx().node_experts.bits[:1]),
    )
    assert policy.keep_drafting(root, max_depth=3) is False
    assert policy.root_alpha == pytest.approx(0.8 + 0.25 * 0.2)  # moved back towards 1
    cheap = dataclasses.replace(root, cost=dataclasses.replace(root.cost, draft_s_per_level=0.0))
    assert policy.keep_drafting(cheap, max_depth=3) is True  # free drafting: expected gain > 0
    with pytest.raises(ValueError, match="stopping"):
        make_tree_policy("specfit", stopping="oracle")
    with pytest.raises(ValueError, match="reprobe_rate"):
        make_tree_policy("specfit", reprobe_rate=2.0)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 13), st.integers(0, 4))
def test_stopping_rule_never_stops_before_a_better_tree(seed, n, cut_depth) -> None:
    """If the rule says stop at depth d, no subtree of the deeper tree beats the best at depth d."""
    _assert_bound_stop_is_safe(random_small_context(np.random.default_rng(seed), n, sibling_mass=True), cut_depth)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 13), st.integers(0, 4), st.booleans())
def test_stopping_rule_with_union_size_prices_never_stops_too_early(seed, n, cut_depth, next_layer) -> None:
    """Union-size mode: the rule's H2D term (least predicted transfers of m more nodes) keeps it
    valid, with next-layer prefetch priced too (its least per-miss seconds, no verify share)."""
    rng = np.random.default_rng(seed)
    full = random_small_context(rng, n, sibling_mass=True)
    if next_layer:
        cost = dataclasses.replace(
            full.cost,
            next_layer_prefetch=True,
            next_layer_cover_fraction=float(rng.choice([1.0, rng.uniform(0, 1)])),
            next_layer_waste_per_miss=float(rng.choice([0.0, rng.uniform(0, 2)])),
            host_s_per_transfer=float(rng.uniform(0, 1)) * full.cost.h2d_s_per_transfer,
            **random_next_layer_knots(rng),  # half the time a share per tree size
        )
        full = dataclasses.replace(full, cost=cost)
    tree, num_layers, num_experts = full.tree, full.cached_bits.shape[0], full.node_experts.num_experts
    steps = rng.uniform(0.0, 3.0, size=(num_layers, n + 1))
    steps[:, 0] = 0.0
    union = np.minimum(np.cumsum(steps, axis=1), num_experts)  # any non-decreasing table, concave or not
    sizes = NodeExperts(num_experts, union_size=union, miss_fraction=rng.uniform(0, 1, num_layers))
    full = dataclasses.replace(full, node_experts=sizes)
    if tree.max_depth <= cut_depth:
        return
    keep = np.flatnonzero(tree.depths <= cut_depth)
    shallow = dataclasses.replace(
        full, tree=tree.subtree(keep), accept_probs=full.accept_probs[keep], num_levels=cut_depth
    )
    if not make_tree_policy("specfit", stopping="bound").keep_drafting(shallow, max_depth=100):
        deeper = plan_exact(full).predicted_tokens_per_s
        assert deeper <= plan_exact(shallow).predicted_tokens_per_s * (1 + 1e-9)


def test_union_size_transfer_term_stops_drafting_when_misses_are_dear() -> None:
    ctx = _ctx(num_levels=2, draft_s=0.05)
    num_layers = ctx.cached_bits.shape[0]
    union = np.tile(
        np.arange(0.0, 8.0) * 0.5, (num_layers, 1)
    )  # each node adds half an expert a layer (below E)
    sized = dataclasses.replace(
        ctx,
        node_experts=NodeExperts(
            ctx.node_experts.num_experts, union_size=union, miss_fraction=np.ones(num_layers)
        ),
    )
    policy = make_tree_policy("specfit", stopping="bound")
    cheap = dataclasses.replace(
        sized, cost=dataclasses.replace(sized.cost, h2d_bytes_per_s=float("inf"), h2d_s_per_transfer=0.0)
    )
    assert (
        policy.keep_drafting(cheap, max_depth=5) is True
    )  # free transfers: the verify-only bound says go on
    dear = dataclasses.replace(sized, cost=dataclasses.replace(sized.cost, h2d_s_per_transfer=100.0))
    assert policy.keep_drafting(dear, max_depth=5) is False  # half a miss a layer per node at 100 s: stop


def test_policy_context_validation_names_the_field() -> None:
    ctx = _ctx()
    with pytest.raises(ValueError, match="node 3 has P=0.7 above its parent"):
        dataclasses.replace(ctx, accept_probs=np.array([1.0, 0.6, 0.3, 0.7, 0.1, 0.2]))
    with pytest.raises(ValueError, match="P\\(root\\) must be 1"):
        dataclasses.replace(ctx, accept_probs=np.array([0.9, 0.6, 0.3, 0.4, 0.1, 0.2]))
    with pytest.raises(ValueError, match="accept_probs: expected float\\[6\\]"):
        dataclasses.replace(ctx, accept_probs=np.ones(5))
    with pytest.raises(ValueError, match="cached_bits"):
        dataclasses.replace(ctx, cached_bits=np.zeros((2, 1), dtype=np.uint64))
    with pytest.raises(ValueError, match="num_levels"):
        dataclasses.replace(ctx, num_levels=-1)


def test_throughput_guard_backs_off_and_probes() -> None:
    from specfit.policies import ThroughputGuard

    guard = ThroughputGuard(window=8, min_samples=2, probe_period=4)
    assert guard.allows_drafting()  # no drafting cycle seen: the planner's rule decides
    for _ in range(2):
        guard.observe(3, 0.03, num_levels=2)  # drafting: 100 tokens/s
    assert not guard.allows_drafting()  # no autoregressive cycle yet: measure it
    for _ in range(2):
        guard.observe(1, 0.005, num_levels=0)  # autoregressive: 200 tokens/s
    answers = [guard.allows_drafting() for _ in range(32)]
    # autoregressive preferred; the drafting arm (rates 50% apart) is probed once per 4 x 8 questions
    assert sum(answers) == 1 and guard.rate("ar") == 200.0
    for _ in range(8):
        guard.observe(6, 0.02, num_levels=3)  # drafting now realises 300 tokens/s
    answers = [guard.allows_drafting() for _ in range(32)]
    assert sum(answers) == 31  # drafting preferred (300 vs 200 tokens/s), autoregressive probed once


def test_throughput_guard_forgets_cold_cycles_once_fresh_ones_replace_them() -> None:
    """Issue 12's shipped-trace cell: the first drafting cycles pay a cold expert cache; they must
    not stay the drafting arm's evidence, yet an arm is never left without evidence."""
    from specfit.policies import ThroughputGuard

    guard = ThroughputGuard(window=64, min_samples=2, probe_period=4, horizon=16)
    for _ in range(2):
        guard.observe(2, 1.0, num_levels=3)  # cold cache: drafting at 2 tokens/s
    for _ in range(40):
        guard.observe(1, 0.1, num_levels=0)  # autoregressive: 10 tokens/s
    assert not guard.allows_drafting() and len(guard.arms["spec"]) == 2  # stale, but its only evidence
    guard.observe(4, 0.2, num_levels=3)  # a warm drafting cycle (a probe): 20 tokens/s
    assert len(guard.arms["spec"]) == 3  # one fresh sample is not enough to judge on
    guard.observe(4, 0.2, num_levels=3)
    assert len(guard.arms["spec"]) == 2 and guard.rate("spec") == 20.0  # two fresh: the cold ones left
    assert guard.allows_drafting()
    assert len(guard.arms["ar"]) == 14  # the autoregressive arm too: its 14 cycles among the last 16


def test_throughput_guard_pools_root_alone_prices_with_autoregressive_cycles() -> None:
    """Paired evidence (issue 12): a drafting cycle also carries the root alone's price in the same
    cycle; drafting is judged against those counterfactuals pooled with the non-drafting cycles,
    so it needs no autoregressive cycle to be judged."""
    import pytest

    from specfit.policies import ThroughputGuard, root_layer_misses

    bits = np.zeros((2, 2), dtype=np.uint64)  # 70 experts: 2 words per layer
    bits[0, 0], bits[0, 1], bits[1, 0] = 1 << 1, 1 << 1, 1 << 3  # cached: {1, 65} and {3}
    root = np.array([[1, 2], [65, 3]])  # layer 0: 1 cached, 2 not; layer 1: 65 not, 3 cached
    assert root_layer_misses(bits, root).tolist() == [1, 1]
    assert root_layer_misses(bits, np.array([[-1, 1], [0, 3]])).tolist() == [0, 1]

    guard = ThroughputGuard(window=8, min_samples=2, probe_period=4)
    for _ in range(2):
        guard.observe(3, 0.03, num_levels=2, root_s=0.01)  # drafting 100 tokens/s, root alone 100
    assert guard.root_rate() == pytest.approx(100.0) and guard.allows_drafting()  # a tie, no AR cycle
    for _ in range(2):
        guard.observe(1, 0.01, num_levels=0)  # autoregressive: 100 tokens/s
    assert guard.reference_rate() == pytest.approx(100.0) and guard.allows_drafting()
    for _ in range(8):
        guard.observe(3, 0.03, num_levels=2, root_s=0.005)  # the root alone would realise 200
    assert guard.reference_rate() == pytest.approx(10 / 0.06)  # 8 counterfactual + 2 AR tokens
    answers = [guard.allows_drafting() for _ in range(32)]
    assert sum(answers) == 1  # declined (100 vs 167 tokens/s), drafting probed once per 4 x 8 questions


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 6),
            st.floats(1e-4, 1.0),
            st.integers(0, 3),
            st.one_of(st.none(), st.floats(1e-4, 1.0)),
        ),
        max_size=60,
    ),
    st.integers(1, 8),
    st.integers(1, 3),
    st.integers(1, 12),
    st.integers(1, 4),
)
def test_throughput_guard_window_sums_equal_summing_the_windows(
    cycles, window, min_samples, horizon, probe_period
) -> None:
    """The guard's kept sums (issue 14: no pass over its windows per question) are bit for bit
    the left-to-right sums over each arm's samples, whatever the window and horizon drop, and its
    answer is the one computed from those sums with the builtins (min, max, abs, int) it avoids."""
    from specfit.policies import ThroughputGuard

    guard = ThroughputGuard(window=window, min_samples=min_samples, horizon=horizon, probe_period=probe_period)
    reference = ThroughputGuard(window=window, min_samples=min_samples, horizon=horizon)

    def summed(arm: str) -> tuple[float, float, float | None]:  # the sums before issue 14
        samples = list(guard.arms[arm])
        seconds = sum(c[1] for c in samples)
        rate = sum(c[0] for c in samples) / seconds if seconds > 0 else float("nan")
        roots = [c[3] for c in samples]
        root = len(samples) / sum(roots) if samples and None not in roots else float("nan")
        return rate, seconds, root

    def answer(questions: int) -> bool:  # allows_drafting before issue 14's rewrite (builtins, sums)
        spec_rate, _, root = summed("spec")
        if len(guard.arms["spec"]) < min_samples:
            return True
        ar = list(guard.arms["ar"])
        reference = root
        if root == root:
            reference = (len(guard.arms["spec"]) + sum(c[0] for c in ar)) / (
                sum(c[3] for c in guard.arms["spec"]) + sum(c[1] for c in ar)
            )
        else:
            if len(ar) < min_samples:
                return False
            reference = summed("ar")[0]
        prefer_spec = spec_rate >= reference * (1.0 - guard.margin)
        gap = abs(spec_rate / reference - 1.0)
        period = int(guard.probe_period * min(8.0, max(1.0, gap / 0.025)))
        return prefer_spec != (questions % period == 0)

    for tokens, seconds, levels, root_s in cycles:
        guard.observe(tokens, seconds, levels, root_s)
        want = answer(guard.questions + 1)
        assert guard.allows_drafting() == want
        rate, _, root = summed("spec")
        assert np.array_equal([guard.rate("spec"), guard.root_rate()], [rate, root], equal_nan=True)
        assert np.array_equal([guard.rate("ar")], [summed("ar")[0]], equal_nan=True)
        if root == root:
            ar = list(guard.arms["ar"])
            want = (len(guard.arms["spec"]) + sum(c[0] for c in ar)) / (
                sum(c[3] for c in guard.arms["spec"]) + sum(c[1] for c in ar)
            )
            assert guard.reference_rate() == want
    for arm in ("spec", "ar"):  # a guard loaded sample by sample (as a resumed run) sums alike
        reference.arms[arm].extend(list(guard.arms[arm])[:1])
        reference.arms[arm].clear()
        reference.arms[arm].extend(guard.arms[arm])
        assert np.array_equal([reference.rate(arm)], [guard.rate(arm)], equal_nan=True)
    assert np.array_equal([reference.root_rate()], [guard.root_rate()], equal_nan=True)


def test_specfit_guard_declines_on_the_root_and_can_be_off() -> None:
    from specfit.policies import SpecFitPolicy

    root = random_small_context(np.random.default_rng(3), 1)  # the root alone, nothing drafted
    on, off = SpecFitPolicy(), SpecFitPolicy(guard=False)
    for policy in (on, off):
        for _ in range(8):
            policy.observe(2, 0.05, 3)  # drafting: 40 tokens/s
            policy.observe(1, 0.01, 0)  # autoregressive: 100 tokens/s
    assert off.guard is None
    assert on.keep_drafting(root, max_depth=4) is False and on.guard.questions == 1
    bigger = random_small_context(np.random.default_rng(3), 6)
    on.keep_drafting(bigger, max_depth=bigger.tree.max_depth + 2)  # after a level: the guard is not asked
    assert on.guard.questions == 1


def _issue14_contexts() -> tuple[PolicyContext, PolicyContext]:
    """Issue 14's counterexample: an over-confident edge map (four children of draft probability
    0.2 each mapped to 0.98), draft 0.5 s/level, verify 1 s + 0.05 s/node, no transfers."""
    from specfit.acceptance import AcceptanceCalibration, path_accept_probs

    cal = AcceptanceCalibration([0.0, 0.05, 0.2, 1.0], [0.0, 0.5, 0.98, 1.0], scope="edge")
    parents = [-1, 0, 1, 1, 1, 1]
    logp = np.log([1.0, 0.05, 0.2, 0.2, 0.2, 0.2])
    cost = CycleCostModel(0.5, 1.0, 0.05, 0.0, 1.0, 0.0, 0, 1)

    def level(n: int) -> PolicyContext:
        tree = DraftTree.from_parents(np.arange(n), parents[:n], logp[:n])
        bits = bitsets.pack(np.full((n, 1, 1), -1), 8)
        p = path_accept_probs(tree, cal)
        return PolicyContext(tree, p, NodeExperts(8, bits=bits), bitsets.empty((1,), 8), cost, 0, tree.max_depth)

    return level(2), level(6)


def test_bound_rule_is_a_bound_with_an_overconfident_edge_map() -> None:
    one, two = _issue14_contexts()
    p = two.accept_probs
    assert p[1] == pytest.approx(0.5)
    # before renormalising the children summed to 4 * 0.49 = 1.96 > P(1) = 0.5 and level 2 reached
    # 1.5043 tokens/s while the rule stopped at 0.9375; siblings are disjoint events, so now they
    # share P(1): 0.125 each
    assert p[2:].sum() == pytest.approx(p[1])
    assert np.allclose(p[2:], 0.125)
    best_one = plan_exact(one).predicted_tokens_per_s
    assert best_one == pytest.approx(1.5 / 1.6)  # {0, 1}: 0.9375 tokens/s
    best_two = plan_exact(two).predicted_tokens_per_s
    stop = not make_tree_policy("specfit", stopping="bound").keep_drafting(one, max_depth=2)
    assert stop and best_two <= best_one * (1 + 1e-9)  # level 2 gives at most 2.0 / 2.3 = 0.87


def _uncalibrated_level(parents: list[int], draft: list[float], n: int) -> PolicyContext:
    """The first ``n`` nodes of a tree of draft probabilities ``draft``, P without a map (issue 14's
    cost: draft 0.5 s/level, verify 1 s + 0.05 s/node, no transfers)."""
    from specfit.acceptance import path_accept_probs

    tree = DraftTree.from_parents(np.arange(n), parents[:n], np.log(draft[:n]))
    cost = CycleCostModel(0.5, 1.0, 0.05, 0.0, 1.0, 0.0, 0, 1)
    bits = bitsets.pack(np.full((n, 1, 1), -1), 8)
    return PolicyContext(
        tree, path_accept_probs(tree), NodeExperts(8, bits=bits), bitsets.empty((1,), 8), cost, 0, tree.max_depth
    )


def test_bound_rule_is_a_bound_without_a_map_when_children_outweigh_their_parent() -> None:
    """rev7's check_stopping.py, last lines: without a map, children whose path probabilities sum
    to more than their parent's (no softmax gives it) are renormalised as with a map. Before, the
    four children of P(1) = 0.5 kept 0.2 each (1.6 > 0.5): the rule stopped after level 1 (0.9375
    tokens/s) although level 2 reached 1.0."""
    parents, draft = [-1, 0, 1, 1, 1, 1], [1.0, 0.5, 0.4, 0.4, 0.4, 0.4]
    one, two = _uncalibrated_level(parents, draft, 2), _uncalibrated_level(parents, draft, 6)
    assert two.accept_probs.tolist() == [1.0, 0.5, 0.125, 0.125, 0.125, 0.125]
    best_one, best_two = plan_exact(one).predicted_tokens_per_s, plan_exact(two).predicted_tokens_per_s
    assert best_one == pytest.approx(0.9375)
    stop = not make_tree_policy("specfit", stopping="bound").keep_drafting(one, max_depth=2)
    assert stop and best_two <= best_one * (1 + 1e-9)  # 2.0 / 2.3 = 0.87
    # the root's four children of 0.5 each (2.0 > 1): a quarter each
    root = _uncalibrated_level([-1, 0, 0, 0, 0], [1.0, 0.5, 0.5, 0.5, 0.5], 5)
    assert root.accept_probs.tolist() == [1.0, 0.25, 0.25, 0.25, 0.25]


def test_uncalibrated_softmax_sums_a_few_ulps_above_their_parent_stay_bit_identical() -> None:
    """A softmax's children (shares summing to 1) whose exp'd path probabilities sum 1.4e-17 above
    their parent's (float rounding): within the tolerance, P is exp(path log-probs) unchanged."""
    from specfit.acceptance import path_accept_probs

    logp = [0.0, -2.94500921364805, -2.8391261143513105, -1.5228911431778507, -0.7571487018959467, -1.3686863152676463]
    tree = DraftTree.from_parents(np.arange(6), [-1, 0, 1, 1, 1, 1], np.asarray(logp))
    raw = np.clip(np.exp(tree.path_logprobs), 0.0, 1.0)
    assert raw[2:].sum() > raw[1]  # the case: above the parent, by rounding only
    assert path_accept_probs(tree).tobytes() == raw.tobytes()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 13), st.integers(0, 4))
def test_stopping_rule_is_safe_on_independent_draft_probabilities(seed, n, cut_depth) -> None:
    """``random_small_context(sibling_mass=False)``: each child's draft probability drawn alone, so
    siblings often outweigh their parent; renormalised, the bound rule never stops too early."""
    _assert_bound_stop_is_safe(random_small_context(np.random.default_rng(seed), n), cut_depth)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(2, 13),
    st.integers(0, 4),
    st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3),
    st.sampled_from(["edge", "path"]),
)
def test_bound_rule_stays_a_bound_with_any_calibration_map(seed, n, cut_depth, ys, scope) -> None:
    """Any monotone map, edge or path scope: children never outweigh their parent, and the bound
    rule never stops before a better deeper tree."""
    from specfit.acceptance import AcceptanceCalibration, path_accept_probs

    cal = AcceptanceCalibration([0.0, 0.1, 0.3, 1.0], [0.0, *sorted(ys)], scope=scope)
    full = random_small_context(np.random.default_rng(seed), n, sibling_mass=True)
    tree = full.tree
    p = path_accept_probs(tree, cal)
    child_sum = np.bincount(tree.parents[1:], weights=p[1:], minlength=n)
    assert np.all(child_sum <= p * (1 + 1e-12) + 1e-15)
    full = dataclasses.replace(full, accept_probs=p)
    if tree.max_depth <= cut_depth:
        return
    shallow = _cut(full, cut_depth)
    shallow = dataclasses.replace(shallow, accept_probs=path_accept_probs(shallow.tree, cal))
    assert np.allclose(shallow.accept_probs, p[tree.depths <= cut_depth])  # deeper levels do not change shallower P
    if not make_tree_policy("specfit", stopping="bound").keep_drafting(shallow, max_depth=100):
        deeper = plan_exact(dataclasses.replace(full, num_levels=tree.max_depth)).predicted_tokens_per_s
        assert deeper <= plan_exact(shallow).predicted_tokens_per_s * (1 + 1e-9)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(2, 11),
    st.integers(0, 3),
    st.sampled_from(
        ["ideal", "on", "on+prefetch", "off+prefetch", "off+next", "on+next", "on+prefetch+next", "off+unpriced-next"]
    ),
    st.floats(0.0, 1.0),
    st.sampled_from([0.0, 0.5, 1.0]),
)
def test_stopping_bound_holds_with_overlap_and_prefetch(seed, n, cut_depth, form, pre, after) -> None:
    """With overlap, draft or next-layer prefetch a copy-bound cycle hides part of an added node's
    verify time, so the bound charges only ``cost.least_verify_share`` of it: a stop is never
    before a deeper tree whose per-layer optimum (brute force, the exact price) beats the
    shallow one's; also with ``after`` of the placing after the enqueue (``P``: a copy stream's
    miss costs ``host + max(T_link - P, 0)``, with next-layer prefetch without a share too)."""
    rng = np.random.default_rng(seed)
    full = random_small_context(rng, n, sibling_mass=True)
    overlap = not form.startswith("off")
    per_transfer = float(rng.uniform(0, 2e-2))
    host = float(rng.uniform(0, 1)) * per_transfer
    unpriced = form.endswith("unpriced-next")
    cost = dataclasses.replace(
        full.cost,
        overlap_h2d=overlap,
        overlap_mode="ideal" if form == "ideal" else "on",
        pre_router_fraction=pre,
        late_call_s=float(rng.uniform(0, 1e-4)),
        draft_prefetch="+prefetch" in form,
        h2d_s_per_transfer=per_transfer,  # copies that can outlast verification
        host_s_per_transfer=host,
        placing_after_enqueue_s_per_transfer=after * host,
        next_layer_prefetch=form.endswith("next"),
        next_layer_cover_fraction=0.0 if unpriced else float(rng.choice([1.0, rng.uniform(0, 1)])),
        next_layer_waste_per_miss=0.0 if unpriced else float(rng.choice([0.0, rng.uniform(0, 2)])),
        **({} if unpriced else random_next_layer_knots(rng)),
    )
    assert cost.next_layer_priced == (cost.next_layer_prefetch and not unpriced)
    _assert_bound_stop_is_safe(dataclasses.replace(full, cost=cost), cut_depth, plan_brute_force)


def test_least_verify_share_per_cost_form() -> None:
    cost = CycleCostModel(0.0, 1.0, 0.1, 0.0, 1.0, 0.0, 0, 4, pre_router_fraction=0.4)
    assert cost.least_verify_share == 1.0
    assert dataclasses.replace(cost, overlap_h2d=True, overlap_mode="on").least_verify_share == 0.4
    assert dataclasses.replace(cost, overlap_h2d=True, overlap_mode="ideal").least_verify_share == 0.0
    assert dataclasses.replace(cost, draft_prefetch=True).least_verify_share == pytest.approx(0.6 / 4)
    # next-layer prefetch priced: a copy-bound link hides every layer's compute; each miss adds
    # at least its placing (without waste: layer 0 has no guess) and the link time of the share
    # not prefetched
    nxt = dataclasses.replace(
        cost, next_layer_prefetch=True, next_layer_cover_fraction=0.25, next_layer_waste_per_miss=0.5,
        h2d_s_per_transfer=4.0, host_s_per_transfer=1.0,
    )  # fmt: skip
    assert nxt.least_verify_share == 0.0 and nxt.least_s_per_miss == pytest.approx(1.0 + 0.75 * 3.0)
    assert dataclasses.replace(nxt, next_layer_prefetch=False).least_s_per_miss == nxt.s_per_miss == 4.0
    ideal = dataclasses.replace(nxt, overlap_h2d=True, overlap_mode="ideal")  # the bound is not priced with it
    assert not ideal.next_layer_priced and ideal.least_verify_share == 0.0


@pytest.mark.parametrize("mode, pre", [("ideal", 0.0), ("on", 0.2)])
def test_stopping_bound_continues_when_copies_hide_the_next_node(mode, pre) -> None:
    """One 10 s copy outlasts verification; a third node's 3 s of verify time hides under it
    (all of it in "ideal", 80 % in "on"), so the deeper tree pays. Charging the node its whole
    verify time (the rule before overlap-aware pricing) would stop here."""
    tree = DraftTree.from_parents(np.arange(3), [-1, 0, 1], np.log([1.0, 0.3, 0.9]))
    experts = NodeExperts(8, bits=bitsets.pack(np.zeros((3, 1, 1), dtype=np.int64), 8))
    cost = CycleCostModel(0.0, 0.01, 3.0, 0.0, 1.0, 10.0, 0, 1, overlap_h2d=True, overlap_mode=mode, pre_router_fraction=pre)
    full = PolicyContext(tree, np.array([1.0, 0.3, 0.27]), experts, bitsets.empty((1,), 8), cost, 0, num_levels=2)
    shallow = _cut(full, 1)
    assert plan_brute_force(full).predicted_tokens_per_s > plan_brute_force(shallow).predicted_tokens_per_s
    assert make_tree_policy("specfit", stopping="bound").keep_drafting(shallow, max_depth=2) is True


def test_realised_cycles_are_priced_with_their_demand_misses_and_prefetch_copies() -> None:
    """With next-layer prefetch priced, a realised cycle's price takes its demand misses as the
    copies waiting for the router and demand misses plus the prefetch copies issued into each
    layer as the link's and placing's work: the planner's per-layer form with the realised copies
    in place of the share and waste (issue 13); the same call live and in the simulator."""
    cost = CycleCostModel(
        1e-3, 5e-3, 1e-4, 0.0, 1e9, 2e-5, 6144, 2,
        next_layer_prefetch=True, next_layer_cover_fraction=0.5, next_layer_waste_per_miss=0.25,
    )  # fmt: skip
    demand, issued = np.array([1, 2]), np.array([0, 3])
    link = cost.link_s_per_transfer
    c = cost.verify_s(5, 30) / 2
    want = cost.draft_s(2) + sum(max(c + d * link, (d + i) * link) for d, i in zip(demand, issued))
    want += cost.host_s_per_transfer * 6
    assert cost.realised_cycle_s(2, 5, 30, demand, issued) == pytest.approx(want, rel=1e-12)
    same = dataclasses.replace(cost, next_layer_prefetch=False)
    assert same.realised_cycle_s(2, 5, 30, demand, issued) == same.cycle_s(2, 5, 30, demand)
    assert cost.realised_cycle_s(2, 5, 30, demand) == cost.cycle_s(2, 5, 30, demand)
    policy = SpecFitPolicy()
    policy.observe_cycle(cost, 3, 2, 5, 30, demand, np.array([0, 1]), issued)
    # the guard's sample holds the cost model's PRICE of the cycle (seconds computed, no clock read)
    tokens, priced_s, _, root_s = policy.guard.arms["spec"][0]
    assert (tokens, priced_s) == (3.0, cost.realised_cycle_s(2, 5, 30, demand, issued))
    assert root_s == cost.cycle_s(0, 1, 30, np.array([0, 1]))


@pytest.mark.parametrize("overlap", [False, True])
def test_min_added_h2d_is_a_lower_bound_when_the_next_layer_cover_rises_with_size(overlap) -> None:
    """Review finding M11: with next-layer knots whose cover RISES with tree size (nodes 1 and 10,
    cover 0 and 1) a 10-node subtree with one more miss is priced BELOW the root alone, so
    ``least_s_per_miss`` times the added misses (>= 0) was no lower bound on the added price.
    The stopping bound's ``H(m)`` must stay at or below every true difference
    ``cycle_s(n + m) - cycle_s(n)`` (no verify growth here: ``verify_s_per_node = 0``)."""
    from specfit.policies import _min_added_h2d_s

    cost = CycleCostModel(
        0.0, 2e-2, 0.0, 0.0, 1e9, 1e-3, 0, 2, host_s_per_transfer=1e-4, overlap_h2d=overlap, overlap_mode="on",
        pre_router_fraction=0.9, next_layer_prefetch=True, next_layer_cover_fraction=0.5, next_layer_nodes=(1, 10),
        next_layer_cover_fractions=(0.0, 1.0), next_layer_waste_per_misses=(0.0, 0.0),
    )  # fmt: skip
    max_nodes = 12
    union = np.zeros((2, max_nodes + 1))
    union[1, 1:] = 4.0 + (np.arange(1, max_nodes + 1) - 1) / 9.0  # 4 distinct experts at 1 node, 5 at 10
    ne = NodeExperts(8, union_size=union, miss_fraction=np.ones(2))
    assert cost.cycle_s(1, 10, 0, [0.0, 5.0]) < cost.cycle_s(1, 1, 0, [0.0, 4.0])  # the repro: more, yet cheaper
    for size in (1, 3):
        tree = DraftTree.from_parents(np.arange(size), [-1] + list(range(size - 1)), np.zeros(size))
        ctx = PolicyContext(tree, np.ones(size), ne, bitsets.empty((2,), 8), cost, 0, size)
        max_new = max_nodes - size
        bound = _min_added_h2d_s(ctx, max_new)
        for m in range(1, max_new + 1):
            true = min(
                cost.cycle_s(1, n + m, 0, ne.expected_union(n + m)) - cost.cycle_s(1, n, 0, ne.expected_union(n))
                for n in range(1, size + 1)
            )
            assert bound[m - 1] <= true + 1e-15, (size, m, bound[m - 1], true)
        assert bound.min() < 0.0  # the price can fall: a clipped 0 would not be a bound


def test_observe_root_clips_as_min_max_did() -> None:
    """``observe_root`` clips without builtins (issue 14): the same value and type as
    ``min(max(observed, 0.0), 1.0)`` for any float, numpy float, signed zero or NaN."""
    import math

    from specfit.policies import SpecFitPolicy

    for observed in (-0.5, -0.0, 0.0, 0.3, 1.0, 1.7, math.inf, -math.inf, math.nan, np.float64(0.4), np.float64(2.0)):
        for start in (0.2, 1.0):
            policy, want = SpecFitPolicy(root_alpha_weight=0.3), SpecFitPolicy(root_alpha_weight=0.3)
            policy.root_alpha = want.root_alpha = start
            policy.observe_root(observed)
            want.root_alpha = (1.0 - 0.3) * start + 0.3 * min(max(observed, 0.0), 1.0)
            got, expected = policy.root_alpha, want.root_alpha
            assert type(got) is type(expected)
            assert np.array_equal([got], [expected], equal_nan=True) and math.copysign(1, got) == math.copysign(1, expected)
