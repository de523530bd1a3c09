"""The compiled decide path (``specfit.decide_kernels``) gives the numpy forms' values bit for bit.

The live planner asks SpecFit once per drafted level; with the union-size predictor those
questions run compiled kernels (issue 14). Each kernel is checked here against the numpy code it
replaced, written out as the reference, on random trees, maps, cost models and caches:

* ``path_accept_probs`` with an edge map (with and without a runner-up map) and a path map;
* the union-size plan (nodes, predicted cycle, tokens/s, misses) against the reference scan;
* ``keep_drafting_expected`` with union-size prices (the answer and the root estimate it moves);
* ``numpy_sum``: numpy's pairwise summation, bit for bit;
* the live planner's one-call questions (``SpecFitPolicy.union_size_questions``) against
  ``keep_drafting`` and ``select`` on the contexts of the same level trees (answers, root
  estimate, the selected plan and P, bit for bit), also on an observed miss fraction the
  compiled question cleans itself (NaN, out of [0, 1]);
* ``TokenTree.to_draft_tree`` shares the drafter's arrays instead of copying them;
* the questions call the compiled entry point (no per-call type checks) only on arrays of its
  exact types (any strides, read-only or not) and numba's checking dispatcher on anything else,
  with the same answers bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from live.spec.tree import TokenTree
from specfit import bitsets
from specfit.acceptance import AcceptanceCalibration, path_accept_probs, top_child_mask
from specfit.context import PolicyContext, layer_misses, make_plan
from specfit.cost import CycleCostModel
from specfit.decide_kernels import numpy_sum
from specfit.node_experts import NodeExperts
from specfit.planner import _plan_union_size_batch, decide_kernels, plan_exact
from specfit.policies import SpecFitPolicy, _chain_gain
from specfit.predictors import clean_miss_fraction
from specfit.synthetic import random_next_layer_knots
from specfit.tree import DraftTree


def _exp(x: np.ndarray) -> np.ndarray:
    """libm's exp element by element (``math.exp``), what the compiled pass takes: ``np.exp`` gives
    the same values except in numpy's AVX-512 loops."""
    return np.array([math.exp(v) for v in x], dtype=np.float64)


def _reference_accept(tree: DraftTree, calibration: AcceptanceCalibration) -> np.ndarray:
    """The level-by-level numpy pass that ``path_accept_probs`` ran before it was compiled."""
    parents, depths = tree.parents, tree.depths
    p = np.ones(tree.num_nodes, dtype=np.float64)
    if calibration.scope == "edge":
        top = top_child_mask(parents, tree.draft_logprobs)
        edge = np.clip(calibration.apply_edges(_exp(tree.draft_logprobs), top), 0.0, 1.0)
    else:
        mapped = np.clip(calibration.apply(_exp(tree.path_logprobs)), 0.0, 1.0)
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
    (``_chain_gain``); the plan is the numpy scan (``_plan_union_size_batch``), the union-size prices
    the matrix product the rule used before (per layer, ``cost.cycle_s_layers``, in mode "on")."""
    alpha_before = policy.root_alpha
    best = _plan_union_size_batch([ctx], 0.0)[0]  # the numpy plan
    base, gain, k = _chain_gain(ctx, best, alpha_before, max_depth - int(ctx.tree.max_depth))
    nodes = base.shape[0] + k
    ne = ctx.node_experts
    miss = ne.layer_miss_fraction(ctx.cached_bits)
    if ctx.cost.per_layer_priced:  # overlap mode "on", next-layer prefetch: each chain's expected misses per layer
        rows = (ne.expected_union_table(int(nodes[-1])) * miss)[nodes.astype(np.int64) - 1]
        cycle = ctx.cost.cycle_s_layers(ctx.num_levels + k, nodes, ctx.context_len, rows)
    else:
        misses = ne.expected_union_table(int(nodes[-1]))[nodes.astype(np.int64) - 1] @ miss
        cycle = ctx.cost.cycle_s_total(ctx.num_levels + k, nodes, ctx.context_len, misses)
    keep = bool(np.any(gain > best.predicted_tokens_per_s * cycle))
    if ctx.tree.max_depth == 0 and not keep:
        alpha_before += policy.reprobe_rate * (1.0 - alpha_before)
    return keep, alpha_before


def _random_union_problem(rng: np.random.Generator, max_layers: int, fixed_fraction: bool, overlap: str):
    """A union-size prediction, cost model (``overlap`` "off", "ideal" or "on", the live engine's
    per-layer form with random compute-stream terms; "+next": next-layer prefetch priced with a
    random share and waste) and cache bitsets of random shape: ``(ne, cost, cached)``."""
    overlap, _, next_layer = overlap.partition("+")
    num_layers, num_experts = int(rng.integers(1, max_layers)), 64
    top = int(rng.integers(1, 40))
    union = np.cumsum(rng.random((num_layers, top + 1)) * 3, axis=1)
    union[:, 0] = 0.0
    ne = NodeExperts(
        num_experts, union_size=union, miss_fraction=rng.random(num_layers) if fixed_fraction else None
    )
    per_transfer_s = 1e-5 * rng.random()
    host_s = float(rng.choice([0.0, per_transfer_s * rng.random()]))
    placing_s = float(rng.choice([0.0, host_s * rng.random(), host_s]))  # after the enqueue
    cost = CycleCostModel(
        2e-3 * rng.random(), 2e-2 * rng.random(), 2e-3 * rng.random(), 1e-7 * rng.random(),
        1e9 + 5e10 * rng.random(), per_transfer_s, 98_304 * int(rng.integers(1, 100)), num_layers,
        draft_base_s=1e-3 * rng.random(), overlap_h2d=overlap != "off", overlap_mode="on" if overlap == "on" else "ideal",
        host_s_per_transfer=host_s, placing_after_enqueue_s_per_transfer=placing_s, pre_router_fraction=float(rng.random()),
        late_call_s=float(rng.choice([0.0, 1e-4 * rng.random()])),
        next_layer_prefetch=bool(next_layer), next_layer_cover_fraction=float(rng.random()),
        next_layer_waste_per_miss=float(rng.choice([0.0, 2.0 * rng.random()])), **random_next_layer_knots(rng),
    )  # fmt: skip
    cached = bitsets.pack(rng.integers(-1, num_experts, size=(num_layers, 20)), num_experts)
    return ne, cost, cached


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.sampled_from(["off", "ideal", "on", "off+next", "on+next"]), st.booleans())
def test_compiled_expected_rule_equals_the_numpy_form(seed, n, overlap, fixed_fraction) -> None:
    rng = np.random.default_rng(seed)
    tree = _random_tree(rng, n)
    ne, cost, cached = _random_union_problem(rng, 12, fixed_fraction, overlap)
    num_layers, num_experts = ne.num_layers, ne.num_experts
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
    plan, numpy_plan = plan_exact(ctx), _plan_union_size_batch([ctx], 0.0)[0]  # bit for bit
    assert plan.nodes.tolist() == numpy_plan.nodes.tolist()
    for name in ("expected_committed", "predicted_cycle_s", "predicted_tokens_per_s", "predicted_misses"):
        assert getattr(plan, name) == getattr(numpy_plan, name)
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


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 1100))
def test_numpy_sum_is_numpys_pairwise_sum(seed, n) -> None:
    rng = np.random.default_rng(seed)
    values = rng.random(n) * 10.0 ** rng.uniform(-9, 4, n)  # wide magnitudes: the order shows
    lo = int(rng.integers(0, n + 1))
    size = int(rng.integers(0, n - lo + 1))
    assert numpy_sum(values, lo, size) == values[lo : lo + size].sum()
    assert numpy_sum(values, 0, n) == values.sum()
    table = rng.random((3, max(n // 10, 1)))  # a row of a C-contiguous [rows, L] product, as sum(axis=1)
    rows = (table * table[0]).sum(axis=1)
    for r in range(3):
        assert numpy_sum(table[r] * table[0], 0, table.shape[1]) == rows[r]


@settings(max_examples=250, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 40),
    st.sampled_from(["none", "edge", "edge+runner", "path"]),
    st.sampled_from(["off", "ideal", "on", "off+next", "on+next"]),
    st.booleans(),
    st.booleans(),
)
def test_live_union_size_questions_equal_keep_drafting_and_select(seed, n, kind, overlap, guard, observed) -> None:
    rng = np.random.default_rng(seed)
    tree = _random_tree(rng, n)
    calibration = None
    if kind != "none":
        x, y = _random_map(rng)
        runner = _random_map(rng) if kind == "edge+runner" else (None, None)
        calibration = AcceptanceCalibration(
            x, y, scope="path" if kind == "path" else "edge", runner_up_knots_x=runner[0], runner_up_knots_y=runner[1]
        )
    ne, cost, cached = _random_union_problem(rng, 20, bool(rng.random() < 0.5), overlap)
    context_len = int(rng.integers(0, 500))
    max_depth = int(tree.max_depth) + int(rng.integers(0, 3))
    reference, fast = SpecFitPolicy(guard=guard), SpecFitPolicy(guard=guard)
    reference.root_alpha = fast.root_alpha = float(rng.random())
    if guard:  # the same realised cycles for both guards
        for _ in range(int(rng.integers(0, 6))):
            args = (int(rng.integers(1, 4)), float(rng.random()) + 0.1, int(rng.integers(0, 3)))
            reference.observe(*args)
            fast.observe(*args)
    questions = fast.union_size_questions(cost, calibration, max_depth, 3)  # 3 nodes: it grows its table
    questions.begin(NodeExperts(ne.num_experts, union_size=ne.union_size), cached, 0)  # an earlier cycle's
    if observed:  # the engine's observed miss fraction (NaN before a layer's first access, any float)
        raw = rng.choice([np.nan, np.inf, -0.5, 0.0, 0.3, 1.0, 1.7], size=ne.union_size.shape[0])
        raw[rng.random(raw.shape[0]) < 0.5] = rng.random()
        template = NodeExperts(ne.num_experts, union_size=ne.union_size, miss_fraction=rng.random(raw.shape[0]))
        questions.begin(template, cached, context_len, raw)  # the kernel cleans it as the predictor would
        ne = NodeExperts(ne.num_experts, union_size=ne.union_size, miss_fraction=clean_miss_fraction(raw))
    else:
        questions.begin(ne, cached, context_len)
    ctx = sub = None
    for levels in range(int(tree.max_depth) + 1):  # as the live drafter: a new tree object per level
        sub = tree.subtree(np.flatnonzero(tree.depths <= levels))
        ctx = PolicyContext(sub, path_accept_probs(sub, calibration), ne, cached, cost, context_len, levels)
        want = reference.keep_drafting(ctx, max_depth)
        assert questions.ask(sub, levels) is want
        assert fast.root_alpha == reference.root_alpha
        if not want:
            break
    want_plan = reference.select(ctx)
    got_plan = questions.select(sub, ctx.num_levels)  # from the last answer, no context built
    assert fast.root_alpha == reference.root_alpha
    assert got_plan.nodes.tolist() == want_plan.nodes.tolist()
    scored = make_plan(ctx, want_plan.nodes, "specfit", 0.0, 1)  # the numpy scores (evaluate_nodes)
    for name in ("expected_committed", "predicted_cycle_s", "predicted_tokens_per_s", "predicted_misses"):
        assert getattr(got_plan, name) == getattr(want_plan, name) == getattr(scored, name)
    fast_ctx = questions.context(sub, sub, ctx.num_levels)  # the context, its plan remembered
    assert fast_ctx.accept_probs.tobytes() == ctx.accept_probs.tobytes()
    assert fast_ctx.node_experts.layer_miss_fraction(cached).tobytes() == ne.layer_miss_fraction(cached).tobytes()
    assert plan_exact(fast_ctx).nodes.tolist() == want_plan.nodes.tolist()
    other = questions.context(tree, tree, int(tree.max_depth))  # a tree not asked about: planned here
    assert plan_exact(other).nodes.tolist() == plan_exact(
        PolicyContext(tree, path_accept_probs(tree, calibration), ne, cached, cost, context_len, int(tree.max_depth))
    ).nodes.tolist()


class _SubArray(np.ndarray):
    """A trivial ndarray subclass: not ``type(x) is np.ndarray``."""


@pytest.mark.parametrize("kind", ["none", "edge", "path"])
def test_live_questions_send_every_unchecked_type_to_the_dispatcher(kind) -> None:
    """Each of ``UnionSizeQuestions._answer``'s and ``_set_arrays``' type checks matters: float32
    values, byte-swapped or 2-D parents, ndarray subclasses (of parents or values), 2-D values and
    a 2-D observed miss fraction go to numba's checking dispatcher, which answers as for the same
    objects without the entry point (subclasses: as the plain arrays) or raises its TypingError;
    the unchecked entry point would read them as int64[N] / float64[N] (wrong values or a crash)."""
    from numba.core.errors import TypingError

    rng = np.random.default_rng(11)
    tree, ne, cached, levels, questions = _live_questions(rng, 12, kind)
    observed = rng.random(ne.union_size.shape[0])
    questions.begin(ne, cached, 40, observed)
    calls: list[str] = []
    entry, dispatcher = questions._entry, questions._kernel
    questions._entry = lambda *args: calls.append("entry") or entry(*args)
    questions._kernel = lambda *args: calls.append("dispatcher") or dispatcher(*args)

    def asked(t) -> tuple[tuple[bytes, bytes, bytes], list[str]]:
        calls.clear()
        return _answer_bytes(questions, t, levels), list(calls)

    def by_dispatcher(t) -> tuple[bytes, bytes, bytes]:
        typed, questions._typed = questions._typed, False  # the dispatcher whatever the tree
        try:
            return asked(t)[0]
        finally:
            questions._typed = typed

    def with_arrays(**arrays) -> SimpleNamespace:
        names = ("parents", "draft_logprobs", "path_logprobs")
        return SimpleNamespace(**{name: arrays.get(name, getattr(tree, name)) for name in names})

    want, path = asked(tree)
    assert set(path) == {"entry"}
    as_float32 = with_arrays(
        draft_logprobs=tree.draft_logprobs.astype(np.float32), path_logprobs=tree.path_logprobs.astype(np.float32)
    )
    assert asked(as_float32) == (by_dispatcher(as_float32), ["dispatcher"])
    for same in (
        with_arrays(parents=tree.parents.view(_SubArray)),
        with_arrays(parents=np.ma.asarray(tree.parents)),
        with_arrays(draft_logprobs=tree.draft_logprobs.view(_SubArray), path_logprobs=tree.path_logprobs.view(_SubArray)),
    ):
        assert asked(same) == (want, ["dispatcher"])
    for refused in (
        with_arrays(parents=tree.parents.astype(">i8")),  # numba types no non-native byte order
        with_arrays(parents=tree.parents.reshape(1, -1)),
        with_arrays(draft_logprobs=tree.draft_logprobs.reshape(1, -1), path_logprobs=tree.path_logprobs.reshape(1, -1)),
    ):
        calls.clear()
        with pytest.raises(TypingError):
            _answer_bytes(questions, refused, levels)
        assert calls == ["dispatcher"]
    for two_axes in (observed.reshape(-1, 1), observed.astype(np.float32).reshape(1, -1)):
        questions.begin(ne, cached, 40, two_axes)
        calls.clear()
        with pytest.raises(TypingError):
            _answer_bytes(questions, tree, levels)
        assert calls == ["dispatcher"]
    questions.begin(ne, cached, 40, observed.astype(np.float32))  # converted in begin: the entry point
    assert asked(tree)[1] == ["entry"]


def test_unpickled_questions_write_their_own_work_array() -> None:
    """``UnionSizeQuestions.__setstate__`` copies a ``work`` the entry point may not write
    (read-only out-of-band buffers of pickle protocol 5, another dtype or layout) into a writable
    C-contiguous float64 array; the loaded questions answer as the original."""
    import pickle

    rng = np.random.default_rng(5)
    tree = _random_tree(rng, 9)
    ne, cost, cached = _random_union_problem(rng, 12, False, "off")
    questions = SpecFitPolicy().union_size_questions(cost, None, int(tree.max_depth) + 1, 2)
    questions.begin(ne, cached, 30)
    want = _answer_bytes(questions, tree, int(tree.max_depth))
    buffers: list = []
    data = pickle.dumps(questions, protocol=5, buffer_callback=buffers.append)
    loaded = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])  # read-only arrays
    assert buffers and not loaded.table.flags.writeable  # the case: out-of-band, read only
    assert "_edge_map" not in questions.__getstate__() and loaded._edge_map is questions._edge_map  # derived once
    assert loaded.work.flags.writeable and _answer_bytes(loaded, tree, int(tree.max_depth)) == want
    # as loaded, strided, float32 (its constants rounded: the answers may differ, the types may not)
    for work in (loaded.work, np.repeat(loaded.work, 2)[::2], np.asarray(loaded.work, np.float32)):
        state = dict(loaded.__dict__, work=work)
        del state["_ids"], state["_kernel"], state["_entry"]
        loaded.__setstate__(state)
        assert loaded.work.dtype == np.float64 and loaded.work.flags.c_contiguous and loaded.work.flags.writeable
        assert np.shares_memory(loaded._ids, loaded.work)
        if work.dtype == np.float64:
            assert _answer_bytes(loaded, tree, int(tree.max_depth)) == want


def test_live_union_size_questions_reject_miss_fractions_of_another_length() -> None:
    """The compiled question checks the observed miss fractions' length (begin no longer does)."""
    rng = np.random.default_rng(3)
    ne, cost, cached = _random_union_problem(rng, 20, False, "off")
    questions = SpecFitPolicy().union_size_questions(cost, None, 2, 3)
    tree = _random_tree(rng, 4)
    questions.begin(ne, cached, 0, np.full(ne.union_size.shape[0] + 1, 0.5))
    with pytest.raises(ValueError, match="observed miss fraction"):
        questions.ask(tree, int(tree.max_depth))
    questions.begin(ne, cached, 0, np.full(ne.union_size.shape[0], 0.5))
    assert isinstance(questions.ask(tree, int(tree.max_depth)), bool)


def test_live_union_size_questions_reject_a_tree_without_a_root() -> None:
    """A tree of 0 nodes is refused before the compiled question touches its scratch (it wrote one
    value past the room before: numba has no bounds checks), through the unchecked entry point
    and numba's checking dispatcher alike, and nothing past the room changes."""
    rng = np.random.default_rng(5)
    ne, cost, cached = _random_union_problem(rng, 20, False, "off")
    questions = SpecFitPolicy().union_size_questions(cost, None, 2, 3)
    questions.begin(ne, cached, 0, np.full(ne.union_size.shape[0], 0.5))
    empty = SimpleNamespace(
        parents=np.zeros(0, np.int64),
        depths=np.zeros(0, np.int64),
        draft_logprobs=np.zeros(0),
        path_logprobs=np.zeros(0),
    )
    before = questions.work.copy()
    with pytest.raises(ValueError, match="no nodes"):
        questions.ask(empty, 0)
    assert np.array_equal(questions.work, before, equal_nan=True)
    kernels = decide_kernels()
    for kernel in (kernels.question_entry(), kernels.union_size_question):
        answer = kernel(empty.parents, empty.path_logprobs, questions.work, questions.table, questions.miss, 0, 0, 0.5, True)
        assert answer[6] == -3
    assert np.array_equal(questions.work, before, equal_nan=True)


def _live_questions(rng: np.random.Generator, n: int, kind: str) -> tuple:
    """``(tree, node_experts, cached_bits, levels, questions)``: a random tree of ``n`` nodes, a
    union-size problem and its live questions (``kind``: the calibration, none/edge/path; room
    for fewer nodes than ``n``: they grow)."""
    tree = _random_tree(rng, n)
    calibration = None
    if kind != "none":
        x, y = _random_map(rng)
        calibration = AcceptanceCalibration(x, y, scope=kind)
    ne, cost, cached = _random_union_problem(rng, 12, False, "off")
    levels = int(tree.max_depth)
    return tree, ne, cached, levels, SpecFitPolicy().union_size_questions(cost, calibration, levels + 1, 2)


def _answer_bytes(questions, tree, levels: int) -> tuple[bytes, bytes, bytes]:
    """One question's answer (scalars, P, the plan's ids) as bytes, NaNs included."""
    answer = questions._answer(tree, levels, True)
    n, k = answer[7], answer[6]
    at = questions.answer_at
    scalars = np.array([float(x) for x in answer], dtype=np.float64).tobytes()
    return scalars, questions.work[at : at + n].tobytes(), questions.work.view(np.int64)[at + n : at + n + k].tobytes()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 30), st.sampled_from(["none", "edge", "path"]))
def test_live_questions_take_the_entry_point_only_for_its_checked_types(seed, n, kind) -> None:
    rng = np.random.default_rng(seed)
    tree, ne, cached, levels, questions = _live_questions(rng, n, kind)
    observed = rng.random(ne.union_size.shape[0]).astype(np.float32)  # not float64: begin converts it
    questions.begin(ne, cached, int(rng.integers(0, 300)), observed)
    calls: list[str] = []
    entry, dispatcher = questions._entry, questions._kernel
    questions._entry = lambda *args: calls.append("entry") or entry(*args)
    questions._kernel = lambda *args: calls.append("dispatcher") or dispatcher(*args)

    def asked(t, lv=levels) -> tuple[tuple[bytes, bytes, bytes], list[str]]:
        calls.clear()
        return _answer_bytes(questions, t, lv), list(calls)

    want, path = asked(tree)  # a DraftTree (a TypedTree): read-only C-contiguous int64 / float64 arrays
    assert path == ["entry"] * len(path) and path
    names = ("token_ids", "parents", "depths", "draft_logprobs", "path_logprobs")
    strided = DraftTree.trusted(**{k: np.repeat(getattr(tree, k), 2)[::2] for k in names})
    assert n == 1 or not strided.parents.flags.c_contiguous
    unpickled = pickle.loads(pickle.dumps(tree))  # (today) equal dtypes, not numpy's own dtype objects
    distinct = {"<i8": np.dtype("<i8").newbyteorder("="), "<f8": np.dtype("<f8").newbyteorder("=")}
    equal_dtypes = DraftTree.trusted(**{k: np.array(getattr(tree, k)).view(distinct[getattr(tree, k).dtype.str]) for k in names})
    token_tree = TokenTree(tree.token_ids, tree.parents, tree.depths, list(tree.draft_logprobs), tree.path_logprobs)
    assert token_tree.draft_logprobs.dtype == np.float64  # converted where the tree is made
    for same_types in (strided, unpickled, equal_dtypes, token_tree):  # any strides: the entry point's layout "A"
        assert asked(same_types) == (want, ["entry"])
    writable = SimpleNamespace(**{k: np.array(getattr(tree, k)) for k in names})
    other = SimpleNamespace(  # other dtypes: numba's dispatcher checks them (and compiles for them)
        parents=tree.parents.astype(np.int32), draft_logprobs=tree.draft_logprobs, path_logprobs=tree.path_logprobs
    )
    for untyped in (writable, other):  # not a TypedTree: numba's dispatcher checks the arrays
        assert asked(untyped) == (want, ["dispatcher"])
    with pytest.raises(ValueError, match="DraftTree.trusted: parents"):  # the check moved to where trees are made
        DraftTree.trusted(**{k: other.parents if k == "parents" else getattr(tree, k) for k in names})
    assert asked(tree, np.int64(levels)) == (want, ["dispatcher"])  # levels not an int
    questions._typed = False  # as after a table or miss fraction of other types
    assert asked(tree) == (want, ["dispatcher"])
    questions._entry, questions._kernel = entry, dispatcher
    questions.begin(ne, cached, 0, np.full(ne.union_size.shape[0] + 1, 0.5))  # float64: the entry point checks the length
    with pytest.raises(ValueError, match="observed miss fraction"):
        questions.ask(tree, levels)


#: rev2's crash repros (segfaults before the fix), run in a child process so that a regression
#: fails the test instead of killing pytest. Each case prints ``name: outcome``.
_CRASH_REPROS = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_specfit_decide_kernels import _live_questions
from live.spec.tree import TokenTree
from specfit.planner import decide_kernels
from specfit.tree import DraftTree, TypedTree, is_typed_tree

rng = np.random.default_rng(1)
tree, ne, cached, levels, q = _live_questions(rng, 20, "none")
q.begin(ne, cached, 10, rng.random(ne.union_size.shape[0]))
names = ("token_ids", "parents", "depths", "draft_logprobs", "path_logprobs")

def outcome(name, call):
    try:
        print(f"{name}: ok {call()}", flush=True)
    except Exception as e:
        print(f"{name}: {type(e).__name__} {str(e).splitlines()[0][:120]}", flush=True)

class MyTree(TypedTree):  # a caller's own record marked typed, float parents (same item size)
    def __init__(self, parents, draft_logprobs, path_logprobs):
        self.parents, self.draft_logprobs, self.path_logprobs = parents, draft_logprobs, path_logprobs

class MyDraftTree(DraftTree):
    pass

print("trusted:", is_typed_tree(tree), is_typed_tree(TokenTree(*(getattr(tree, k) for k in names))),
      is_typed_tree(MyTree(None, None, None)), is_typed_tree(MyDraftTree(*(getattr(tree, k) for k in names))))
outcome("subclass", lambda: q.ask(MyTree(tree.parents.astype(np.float64), tree.draft_logprobs, tree.path_logprobs), levels))
replaced = TokenTree(*(getattr(tree, k) for k in names))
object.__setattr__(replaced, "parents", tree.parents.astype(np.float64))
outcome("replaced", lambda: q.ask(replaced, levels))
p = np.array(tree.parents)
shared = TokenTree(tree.token_ids, p, tree.depths, tree.draft_logprobs, tree.path_logprobs)
def write():
    p[-1] = 1 << 40
outcome("alias-write", write)
p.setflags(write=True)  # it owns its memory: a caller may make it writable again
p[-1] = 1 << 40
outcome("alias-ask", lambda: q.ask(shared, levels))
base = np.array(tree.parents)
viewed = TokenTree(tree.token_ids, base[:], tree.depths, tree.draft_logprobs, tree.path_logprobs)
base[-1] = 1 << 40
outcome("view", lambda: (viewed.parents.base is None, int(viewed.parents[-1]) == int(tree.parents[-1])))
short = {k: np.array(getattr(tree, k)) for k in names}
short["path_logprobs"] = short["path_logprobs"][:1].copy()
outcome("trusted-length", lambda: DraftTree.trusted(**short))
entry = decide_kernels().question_entry()
def kernel(parents, values):
    return entry(parents, values, q.work, q.table, q.miss, 10, levels, 1.0, True)[6:]
outcome("kernel-short-values", lambda: kernel(tree.parents, np.exp(tree.path_logprobs)[:1].copy()))
bad = np.array(tree.parents)
bad[-1] = len(bad) - 1  # its own parent
outcome("kernel-self-parent", lambda: kernel(bad, np.exp(tree.path_logprobs)))
bad[-1] = -7
outcome("kernel-negative-parent", lambda: kernel(bad, np.exp(tree.path_logprobs)))
root = np.array(tree.parents)
root[0] = 3
outcome("kernel-root", lambda: kernel(root, np.exp(tree.path_logprobs)))
print("done", flush=True)
"""


def test_rev2_crash_repros_raise_instead_of_crashing() -> None:
    """rev2 findings 1 and 2: a ``TypedTree`` subclass or a replaced field (float parents read as
    int64 by the unchecked entry point), a caller's array shared by a ``TokenTree`` and written
    afterwards, short arrays through ``DraftTree.trusted`` or to the kernel: each raises a
    ValueError (or numba's TypingError through the dispatcher) or is refused by the kernel with
    its error code; none crashes the process (a child process: a segfault fails the test)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(here.parent), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", _CRASH_REPROS, str(here)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stdout}\n{done.stderr[-2000:]}"
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["trusted"] == "True True False False"
    assert lines["subclass"].startswith("TypingError")  # numba's dispatcher checked the float parents
    assert lines["replaced"] == "ValueError UnionSizeQuestions: tree.parents: expected int64, got float64"
    assert lines["alias-write"] == "ValueError assignment destination is read-only"
    last = len(_random_tree(np.random.default_rng(1), 20).parents) - 1
    assert lines["alias-ask"] == f"ValueError UnionSizeQuestions: tree.parents[{last}]: expected a node id in [0, {last}), got {1 << 40}"
    assert lines["view"] == "ok (True, True)"
    assert lines["trusted-length"] == "ValueError DraftTree.trusted: path_logprobs: expected length 20 (= len(token_ids)), got 1"
    assert lines["kernel-short-values"] == "ok (-4, 20)"
    assert lines["kernel-self-parent"] == f"ok (-5, {last})"
    assert lines["kernel-negative-parent"] == f"ok (-5, {last})"
    assert lines["kernel-root"] == "ok (-5, 0)"
    assert "done" in done.stdout


def test_a_broken_parent_order_is_named_for_int32_parents_too() -> None:
    """A tree outside the trusted classes with int32 parents goes through numba's dispatcher; a
    broken parent order there names ``parents[v]`` (the int64 message is for a trusted tree whose
    field was replaced, read unchecked)."""
    rng = np.random.default_rng(11)
    ne, cost, cached = _random_union_problem(rng, 20, False, "off")
    questions = SpecFitPolicy().union_size_questions(cost, None, 2, 3)
    questions.begin(ne, cached, 0, np.full(ne.union_size.shape[0], 0.5))
    tree = _random_tree(rng, 4)
    parents = np.array(tree.parents, dtype=np.int32)
    parents[2] = 3  # a node whose parent comes after it
    broken = SimpleNamespace(
        parents=parents,
        depths=np.array(tree.depths),
        draft_logprobs=np.array(tree.draft_logprobs),
        path_logprobs=np.array(tree.path_logprobs),
    )
    with pytest.raises(ValueError, match=r"tree\.parents\[2\]: expected a node id in \[0, 2\), got 3"):
        questions.ask(broken, 1)


def test_live_question_with_an_edge_map_asks_inline_and_still_names_errors() -> None:
    """The live default (an edge map, a typed tree) takes ``ask``'s inline entry-point call: one
    call per question once the room holds the tree (a larger tree comes back unanswered, is grown
    for and asked again through ``_answer``), the same answer as ``_answer``'s, and a broken parent
    order in a trusted tree is still named (the inline call hands it to ``_answer``)."""
    rng = np.random.default_rng(7)
    tree, ne, cached, levels, questions = _live_questions(rng, 12, "edge")
    assert questions._edge_map
    questions.begin(ne, cached, 40, rng.random(ne.union_size.shape[0]))
    calls: list[str] = []
    entry, dispatcher = questions._entry, questions._kernel
    questions._entry = lambda *args: calls.append("entry") or entry(*args)
    questions._kernel = lambda *args: calls.append("dispatcher") or dispatcher(*args)
    first = questions.ask(tree, levels)  # room for 2 nodes: unanswered, grown, asked again
    assert calls == ["entry"] * 3
    calls.clear()
    assert questions.ask(tree, levels) is first and calls == ["entry"]
    asked = questions.last[2]
    assert questions.last[0] is tree and asked == questions._answer(tree, levels, True)
    names = ("token_ids", "parents", "depths", "draft_logprobs", "path_logprobs")
    parents = np.array(tree.parents)
    parents[3] = 5  # a node whose parent comes after it
    broken = DraftTree.trusted(**{k: parents if k == "parents" else np.array(getattr(tree, k)) for k in names})
    calls.clear()
    with pytest.raises(ValueError, match=r"tree\.parents\[3\]: expected a node id in \[0, 3\), got 5"):
        questions.ask(broken, levels)
    assert calls == ["entry", "entry"]  # inline, then _answer's call that names it


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["below", "at", "above"]), st.sampled_from(["off", "on", "ideal"]),
       st.sampled_from(["none", "draft", "next-layer", "both"]))  # fmt: skip
def test_compiled_cycle_price_equals_the_python_form_with_a_placing_after_the_enqueue(seed, side, overlap, prefetch) -> None:
    """rev2 finding 1: ``cost_params``' ``s_per_miss`` is ``priced_s_per_miss`` (``host +
    max(T_link - P, 0)`` where the engines run a copy stream: mode "on", or any prefetch mode
    without overlap), so the compiled union-size price (``union_cycle_s``) equals
    ``cost.cycle_s`` with ``P`` below, at and above ``T_link``, and the exact search's totals
    vector (``search_costs``) prices the serial form as ``cost.cycle_s_total`` does."""
    from specfit.planner import cost_params, search_costs

    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 8))
    link_s = 1e-5 * float(rng.uniform(0.1, 1.0))
    placing_s = {"below": 0.5, "at": 1.0, "above": 1.5}[side] * link_s
    host_s = placing_s * float(rng.uniform(1.0, 2.0))
    cost = CycleCostModel(
        1e-3 * rng.random(), 1e-2 * rng.random(), 1e-4 * rng.random(), 1e-8 * rng.random(), 1e12, host_s + link_s,
        0, num_layers, draft_base_s=1e-3 * rng.random(), overlap_h2d=overlap != "off",
        overlap_mode="on" if overlap == "on" else "ideal", host_s_per_transfer=host_s, pre_router_fraction=float(rng.random()),
        placing_after_enqueue_s_per_transfer=placing_s, late_call_s=1e-5 * rng.random(),
        draft_prefetch=prefetch in ("draft", "both"), next_layer_prefetch=prefetch in ("next-layer", "both"),
    )  # fmt: skip
    if side == "at":  # exactly at the step
        cost = dataclasses.replace(cost, placing_after_enqueue_s_per_transfer=min(cost.link_s_per_transfer, host_s))
    stream = overlap == "on" or (overlap == "off" and prefetch != "none")
    link = max(cost.link_s_per_transfer - cost.placing_after_enqueue_s_per_transfer, 0.0) if stream else cost.link_s_per_transfer
    assert cost.priced_s_per_miss == (host_s + link if stream else cost.s_per_miss)
    params = cost_params(cost)
    assert params[5] == cost.priced_s_per_miss
    scratch = np.zeros((2, num_layers))
    for _ in range(20):
        misses = rng.integers(0, 6, num_layers).astype(np.float64)
        levels, nodes, context = int(rng.integers(0, 5)), int(rng.integers(1, 40)), int(rng.integers(0, 500))
        total = float(misses.sum())
        compiled = decide_kernels().union_cycle_s(params, levels, float(nodes), context, misses[None], 0, np.ones(num_layers), total, scratch)
        assert compiled == pytest.approx(cost.cycle_s(levels, nodes, context, misses), rel=1e-12, abs=1e-18)
        if overlap == "off" and not cost.draft_prefetch:  # the search's serial totals form
            draft, verify0, per_node, per_miss = search_costs(cost, levels, context)[:4]
            assert draft + verify0 + per_node * nodes + per_miss * total == pytest.approx(
                cost.cycle_s_total(levels, nodes, context, total), rel=1e-12
            )


def test_uncalibrated_sibling_tolerance_is_one_value() -> None:
    """``path_accept_probs``' numba-free gate and the compiled pass use the same tolerance."""
    from specfit import acceptance, decide_kernels

    assert acceptance._SIBLING_MASS_TOLERANCE == decide_kernels.SIBLING_MASS_TOLERANCE
