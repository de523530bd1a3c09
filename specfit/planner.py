"""SpecFit's exact subtree search, a brute-force enumerator and a min-cut/Dinkelbach reference.

Problem (SpecFit, arXiv 2610.15417): over ancestor-closed subtrees S of the draft tree that
contain the root, maximise the predicted throughput

    R(S) = G(S) / T(S),   G(S) = 1 + sum_{v in S, v != 0} P(v),
    T(S) = cost.combine_s(draft_s, verify_s(|S|), transfer_s(M(S))),   M(S) = sum_l |U_l(S) minus C_l|.

Exact method (:func:`plan_exact`): depth-first branch and bound on the ratio.

* Seed. The incumbent ``lam`` starts at the best prefix of the nodes sorted by P (each prefix
  is ancestor-closed; the root alone is one), all prefixes scored at once with a cumulative OR
  of the bitsets. A subtree beats ``lam`` iff ``F_lam(S) = G(S) - lam * T(S) > 0`` (T > 0), so a
  search state is pruned when an upper bound on ``F_lam`` over its completions is <= 0
  (Dinkelbach's parametric form, used as a test).
* Prefilter (no overlap). Removing subtree(v)'s part of S changes ``F_lam`` by at least minus
  the tree max-closure value of ``P(x) - lam*(b + c*excl_x)`` over subtree(v), ``excl_x`` the
  experts only x misses; if that value is <= 0 at the seed ``lam`` (<= optimum; weights only
  fall as lam rises), some optimum avoids subtree(v), which is dropped before any set work.
* Bound. ``T`` is bounded below by a linear minorant ``alpha + beta*|S| + gamma*M(S)`` (exact
  without overlap; with ``overlap_h2d``, ``max(V, H) >= theta*V + (1-theta)*H``, theta chosen per
  state by bisection on the bound's subgradient, see ``planner_kernels.bound``; overlap mode
  "on" (the live engine's) searches its totals form ``host*M + max(V, pre*V + T_link*M) +
  late*(M > 0)`` (``cost.cycle_s_total``), a lower bound on the per-layer cycle, with the
  minorant ``host*M + (theta + (1-theta) pre) V + (1-theta) T_link M``; the chosen subtree is
  then priced per layer (``cost.cycle_s``) and ``Plan.gap`` certifies how far the best per-layer
  throughput can be above it: the search's optimum of the totals form bounds it from above). The coverage ``M`` is
  submodular; its marginal over the still-open nodes R is
  bounded below by a modular function: every uncovered missing expert i splits a unit charge
  among open nodes that miss it, first ``1/k_i`` to each of its ``k_i`` open users, then (one
  refinement) only among the users the first bound selected. Whatever subset is chosen, an
  expert collects at most 1 = what it really costs, so both bounds are valid. With modular
  weights ``w_x = P(x) - lam*(beta + gamma*f_x)`` the best closed completion is a max-weight
  closure on a TREE, solved exactly by one bottom-up pass ``val[x] = w_x + sum max(0, val[c])``.
* Probing on the frontier (open nodes whose parent is in S): if the bound with x forced in is
  <= 0, x and its subtree are dropped; if the bound without x is <= 0, x is forced in (all
  forced nodes join S in one step, no exclude branch). Branch on the frontier node whose inclusion bound is largest (include first).
* Expert groups. Experts some kept non-root node misses beyond the root's are grouped by the set
  of kept nodes that miss them; a group of ``w`` experts counts as one expert of weight ``w`` in
  every share and bound (same values, far fewer columns). The seed and the prefilter need only
  counts (each rank's new misses, each node's exclusive misses), taken on the bit words, so the
  grouping runs after the prefilter, on the kept nodes only. A state costs O(N + nonzeros of the
  node x group incidence).
* Compiled. The seed, prefilter, grouping and the depth-first search run in numba
  (:mod:`specfit.planner_kernels`, compiled once per machine and cached on disk). The search
  is an explicit stack that can stop after any number of states and resume, so
  ``plan_exact(ctx, deadline_s=...)`` checks its clock every few states; a search stopped by
  its deadline returns the incumbent with a certified bound on the optimum (``Plan.exact``,
  ``Plan.gap``).

Per-node sets are what the exact search needs. With the union-size predictor the cost depends on
|S| only, so the best subtree of each size is the top-|S| by P (ancestor-closed because P never
increases along a path, ties broken by id); :func:`plan_exact` then scans the N prefixes.

References for tests: :func:`plan_brute_force` enumerates every ancestor-closed subtree
(small trees), :func:`plan_mincut` solves each Dinkelbach step ``max_S F_lam(S)`` as a maximum
weight closure by one minimum s-t cut (project selection; networkx max-flow on integer-scaled
capacities since float capacities break its cuts), iterating lam to the optimum.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import numpy as np

from specfit.context import Plan, PolicyContext, evaluate_nodes, make_plan
from specfit.node_experts import NodeExperts

POLICY_NAME = "specfit"
_REL_TOL = 1e-11
_REFINEMENTS = 1  # share refinements per bound (see the module docstring)
_THETA_STEPS = 4  # bisection steps on the overlap minorant's theta



_CHUNK_STATES = 8  # states searched between two deadline checks (at most)
_NO_LIMIT = 2**62  # states per call without a deadline


def _search_until(kernels, problem: tuple, state: tuple, lam: float, deadline_s: float, clock, clock_start: float) -> float:
    """Run the search in chunks until it ends or the next chunk could overrun ``deadline_s``.

    The first chunk is one state; each chunk's clock time per state is measured and the slowest
    rate so far prices what is left: a chunk of ``k`` states runs only when ``k`` states plus the
    pending bound after them (one bound per stack frame, each at most a state's work; a state
    adds at most one frame) fit before the deadline (``k`` at most ``_CHUNK_STATES``, shrinking as the deadline nears); when not even
    one state fits the search stops. So the deadline is not overrun by a chunk or by the bound
    that certifies the stopped search (issue 14: one bound step past a 5 ms deadline on the hard
    set before), up to the variance of state times (and preemption, on the wall clock). The
    states searched are the same as without a deadline up to where it stops (the search resumes
    exactly), so a search the deadline does not cut returns the same plan. The first state runs
    unpriced (a deadline shorter than one state's work is overrun by it; 0 runs none).
    """
    istate = state[-1]
    per_state = 0.0  # the slowest clock time per state so far (s)
    limit = 1  # the first chunk measures the rate
    while istate[0] >= 0:
        now = clock()
        left = deadline_s - (now - clock_start)
        if per_state > 0.0:
            # k states, then the pending bound on a stack of at most istate[0] + 1 + k frames
            left -= per_state * (istate[0] + 1)
            limit = min(_CHUNK_STATES, int(left / (2.0 * per_state)))
        if left <= 0.0 or limit < 1:
            break
        explored = istate[1]
        lam = kernels.search(*problem, *state, lam, limit)
        per_state = max(per_state, (clock() - now) / max(int(istate[1] - explored), 1))
    return lam


def _search_plan(
    ctx: PolicyContext, deadline_s: float | None, clock: Callable[[], float], started: float
) -> Plan:
    """Seed, prefilter, compress, then branch and bound (compiled, :mod:`specfit.planner_kernels`).

    With ``deadline_s`` the search runs in chunks (:func:`_search_until`) that stop early enough for
    the certified bound of the unexplored part (``planner_kernels.pending_bound``) to finish
    within the deadline too; the incumbent is returned with that bound.
    The plan is scored with the cost model's terms (``combine_s`` of ``draft_s``, ``verify_s`` and
    ``transfer_s`` of the exact total misses: the values :func:`specfit.context.evaluate_nodes` gives).
    """
    from specfit import planner_kernels as kernels  # numba: imported (and compiled, cached) on first use

    clock_start = clock() if deadline_s is not None else 0.0
    n = ctx.num_nodes
    probs = ctx.accept_probs
    cost = ctx.cost
    node_bits = ctx.node_experts.bits
    costs = search_costs(cost, ctx.num_levels, ctx.context_len)
    tol = _REL_TOL * float(probs.sum())
    flat_bits = np.ascontiguousarray(node_bits.reshape(n, -1))
    flat_cached = np.ascontiguousarray(ctx.cached_bits.reshape(-1))
    ids, kparents, kprobs, knptr, kngrp, weight, seed, lam, root_misses = kernels.setup(
        flat_bits,
        flat_cached,
        probs,
        np.ascontiguousarray(ctx.tree.parents, dtype=np.int64),
        np.argsort(-probs, kind="stable"),  # P descending, ties by id: the root (P = 1) first
        costs,
        tol,
    )
    if not np.isfinite(lam):
        raise ValueError("cost model: a cycle time of 0 s makes the throughput unbounded")
    state = kernels.new_state(ids.shape[0], weight.shape[0])
    state[6][0] = root_misses  # misses of the root-only frame
    problem = (kparents, kprobs, knptr, kngrp, weight, costs, tol, _REFINEMENTS, _THETA_STEPS)
    istate = state[-1]
    if deadline_s is None:
        lam = kernels.search(*problem, *state, lam, _NO_LIMIT)
    else:
        lam = _search_until(kernels, problem, state, lam, deadline_s, clock, clock_start)
    exact = bool(istate[0] < 0)
    upper = lam
    if not exact:
        alive, covered, _, chosen, clen, gain, misses, phase, forced, _, _ = state
        upper = kernels.pending_bound(
            *problem, alive, covered, chosen, clen, gain, misses, phase, forced, istate, lam
        )
        exact = bool(upper <= lam)
    size = int(istate[2])
    nodes = np.sort(ids[state[9][:size]]) if size > 0 else seed
    if cost.per_layer_priced or cost.draft_prefetch:
        # per-layer overlap (and next-layer prefetch's per-layer form) (and the draft prefetch's pipeline) needs the misses of each layer: the chosen subtree is scored as every
        # other policy's (cost.cycle_s); the search maximised its lower bound from the total
        # (cost.cycle_s_total), whose optimum ``upper`` bounds the per-layer optimum from above
        gain, cycle, per_layer = evaluate_nodes(ctx, nodes)
        misses = float(per_layer.sum())
    else:
        misses = kernels.union_misses(flat_bits, flat_cached, nodes)
        gain = 1.0 + float(probs[nodes[1:]].sum())
        # the cost model's own terms, as evaluate_nodes combines them (cost.cycle_s of the misses)
        cycle = cost.combine_s(
            cost.draft_s(ctx.num_levels),
            cost.verify_s(int(nodes.shape[0]), ctx.context_len),
            cost.transfer_s(misses),
        )
    nodes.setflags(write=False)
    per_layer = cost.per_layer_priced or cost.draft_prefetch
    tokens_per_s = gain / cycle
    return Plan(
        nodes=nodes,
        expected_committed=gain,
        predicted_cycle_s=cycle,
        predicted_tokens_per_s=tokens_per_s,
        decision_s=time.perf_counter() - started,
        nodes_explored=int(istate[1]),
        policy=POLICY_NAME,
        predicted_misses=misses,
        exact=exact,
        gap=0.0 if exact and not per_layer else max(0.0, float(upper) / tokens_per_s - 1.0),
    )


def search_costs(cost, num_levels: int, context_len: int) -> np.ndarray:
    """The exact search's cost vector ``float64[8] = [draft, verify0, per_node, per_miss, overlap,
    host, pre, late]`` (``specfit.planner_kernels``: ``draft + max(V + host*M, pre*V +
    per_miss*M) + late*(M > 0)`` with ``overlap``, else ``draft + V + per_miss*M``): the cost
    model's totals form (:meth:`specfit.cost.CycleCostModel.plan_cycle_s_total`) for
    ``num_levels`` drafted levels at ``context_len``. Without overlap and in mode "ideal"
    ``per_miss`` is the whole per-miss cost and the last three are 0; in mode "on" ``per_miss``,
    ``host``, ``pre`` and ``late`` are ``cost.priced_s_per_miss``, ``host_s_per_transfer``,
    ``pre_router_fraction`` and ``cost.priced_late_call_s`` (a placing after the enqueue priced). A
    draft-prefetching run (``cost.draft_prefetch``) takes the prefetch pipeline's bound:
    ``per_miss`` the link's share, ``pre`` ``cost.prefetch_tail_fraction``, ``late`` 0. With next-layer
    prefetch priced (``cost.next_layer_priced``; ``host``, ``a``, ``b`` of
    ``cost.next_layer_s_per_miss()``) the totals form ``host M + max(V + a M, b M)`` without overlap is
    exactly this form (``host + a``, ``pre`` 0, ``per_miss`` ``host + b``); mode "on"'s
    ``host M + max(V, p V + a M, b M) + late`` has three branches, so the search takes one of
    its two copy branches: ``p V + a M`` when it binds where a layer turns copy-bound (``b (1 -
    p) <= a``), else ``b M`` (either gives a lower bound; the plan's gap certifies the rest). With
    the share per tree size (``cost.next_layer_nodes``) the terms are their lower bounds over
    every size (``cost.next_layer_least_s_per_miss``, ``host + a`` ``cost.least_s_per_miss``),
    so the search still maximises an upper bound on every subtree's throughput."""
    if cost.draft_prefetch:
        return np.array(
            [
                cost.draft_s(num_levels),
                cost.verify_s(0, context_len),
                cost.verify_s_per_node,
                cost.link_s_per_transfer,
                1.0,
                cost.host_s_per_transfer,
                cost.prefetch_tail_fraction,
                0.0,
            ]
        )
    if cost.next_layer_priced:  # lower bounds over every tree size (the search knows no size per miss)
        host, after, link = cost.next_layer_least_s_per_miss
        if cost.overlap_h2d:  # mode "on"
            keep = link * (1.0 - cost.pre_router_fraction) <= after
            per_miss, pre, late = cost.least_s_per_miss if keep else host + link, keep * cost.pre_router_fraction, cost.priced_late_call_s
        else:
            per_miss, pre, late, host = host + link, 0.0, 0.0, cost.least_s_per_miss
        return np.array(
            [cost.draft_s(num_levels), cost.verify_s(0, context_len), cost.verify_s_per_node, per_miss, 1.0, host, pre, late]
        )
    on = cost.per_layer_overlap
    return np.array(
        [
            cost.draft_s(num_levels),
            cost.verify_s(0, context_len),
            cost.verify_s_per_node,
            cost.priced_s_per_miss,
            1.0 if cost.overlap_h2d else 0.0,
            cost.host_s_per_transfer if on else 0.0,
            cost.pre_router_fraction if on else 0.0,
            cost.priced_late_call_s if on else 0.0,
        ]
    )


_UNION_MISSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNION_TABLES: dict[int, tuple[np.ndarray, int, np.ndarray]] = {}


def union_table(ne: NodeExperts, rows: int) -> np.ndarray:
    """``ne.expected_union_table(m)`` for some ``m >= rows`` (float64[m, L], read-only).

    Row ``k - 1`` is :meth:`NodeExperts.expected_union` ``(k)`` whatever ``m`` is, so the table is
    kept per ``union_size`` ARRAY (a predictor hands the same one to every cycle's
    ``NodeExperts``) and grown on demand: callers index rows, never rely on ``m``.
    """
    size = ne.union_size
    memo = _UNION_TABLES.get(id(size))
    if memo is not None and memo[0] is size and memo[1] == ne.num_experts and memo[2].shape[0] >= rows:
        return memo[2]
    if len(_UNION_TABLES) >= 16:  # a few predictors per process at most; never grows unbounded
        _UNION_TABLES.clear()
    table = ne.expected_union_table(max(int(rows), size.shape[1] - 1))
    table.setflags(write=False)
    _UNION_TABLES[id(size)] = (size, ne.num_experts, table)  # holds ``size``: its id stays its own
    return table


def _union_misses(ne: NodeExperts, cached_bits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Expected misses of the top-k subtrees, k = 1..n: (float64[n, L], their row sums float64[n]).

    Row ``k - 1`` is ``ne.expected_misses(k, cached_bits)`` (same operations, bit-identical) and
    each row sum is its 1-D ``sum()``. Rows do not depend on ``n``, so the table is kept per
    ``NodeExperts`` object (weakly, with the ``cached_bits`` array it was made for) and sliced:
    the planning problems of successive draft levels share one predictor output and cache state.
    """
    memo = _UNION_MISSES.get(ne)
    if memo is not None and memo[0] is cached_bits and memo[1].shape[0] >= n:
        return memo[1][:n], memo[2][:n]
    frac = ne.layer_miss_fraction(cached_bits)  # once per table, not once per size
    misses = union_table(ne, n)[:n] * frac  # C-contiguous [n, L]: only the rows asked for
    totals = misses.sum(axis=1)  # each contiguous row summed like a 1-D ``misses.sum()``
    _UNION_MISSES[ne] = (cached_bits, misses, totals)
    return misses[:n], totals[:n]


_KERNELS: list = []  # the decide kernels' module once loaded (a from-import per question costs ~1.5 us)


def decide_kernels():
    """:mod:`specfit.decide_kernels`, imported on the first call (numba loads then, not when
    ``specfit`` is imported) and kept: the decide path asks for it several times per cycle."""
    if not _KERNELS:
        from specfit import decide_kernels as kernels  # numba, loaded on first use

        _KERNELS.append(kernels)
    return _KERNELS[0]


_COST_PARAMS: dict[int, tuple[object, np.ndarray]] = {}


def cost_params(cost) -> np.ndarray:
    """float64[18 + 3 K] the compiled union-size path takes (:func:`specfit.decide_kernels.union_cycle_s`):
    ``draft_base_s, draft_s_per_level, verify_base_s, verify_s_per_node, verify_s_per_context_token,
    priced_s_per_miss, overlap_h2d, per_layer_overlap, overlapped_link_s_per_transfer, host_s_per_transfer,
    pre_router_fraction, priced_late_call_s, num_layers, next_layer_priced`` (the link and late call as
    the per-layer forms price them: ``link_s_per_transfer`` and ``late_call_s`` without a placing
    after the enqueue), ``cost.per_layer_s_per_miss()``
    (``host, after, link``: next-layer prefetch's pooled share's, or mode "on"'s without it), then
    ``K`` and the share per tree size's knots ``next_layer_nodes, next_layer_cover_fractions,
    next_layer_waste_per_misses`` (``K`` each; ``K = 0`` when next-layer prefetch is not priced
    or has one share for every size); kept per cost model (immutable) object."""
    memo = _COST_PARAMS.get(id(cost))
    if memo is not None and memo[0] is cost:
        return memo[1]
    if len(_COST_PARAMS) >= 64:  # a few cost models per process (a sweep's bandwidths); never unbounded
        _COST_PARAMS.clear()
    knots = cost.next_layer_nodes if cost.next_layer_priced else ()
    params = np.array(
        [
            cost.draft_base_s,
            cost.draft_s_per_level,
            cost.verify_base_s,
            cost.verify_s_per_node,
            cost.verify_s_per_context_token,
            cost.priced_s_per_miss,
            1.0 if cost.overlap_h2d else 0.0,
            1.0 if cost.per_layer_overlap else 0.0,
            cost.overlapped_link_s_per_transfer,
            cost.host_s_per_transfer,
            cost.pre_router_fraction,
            cost.priced_late_call_s,
            float(cost.num_layers),
            1.0 if cost.next_layer_priced else 0.0,
            *cost.per_layer_s_per_miss(),
            float(len(knots)),
            *knots,
            *cost.next_layer_cover_fractions[: len(knots)],
            *cost.next_layer_waste_per_misses[: len(knots)],
        ]
    )
    params.setflags(write=False)
    _COST_PARAMS[id(cost)] = (cost, params)  # holds ``cost``: its id stays its own
    return params


def union_size_plan(
    nodes: np.ndarray, cycle_s: float, expected: float, misses: float, ok: bool, num_nodes: int, started: float
) -> Plan:
    """The :class:`Plan` of a compiled union-size answer ``(nodes, cycle_s, expected, misses, ok)``
    (:func:`specfit.decide_kernels.union_size_plan_rule`'s first five; ``nodes`` int64[k],
    read-only: the caller makes it so, without a numpy call where it can, issue 14) on a tree of
    ``num_nodes`` nodes (int: the plan's ``nodes_explored``), its ``decision_s`` counted from
    ``started`` (``time.perf_counter`` seconds). The values come as arguments, not a tuple to
    slice: each step costs after a model forward (issue 14).

    A top-by-P prefix is ancestor-closed (P never rises along a path, parents have smaller ids),
    so the plan is built directly; its scores are :func:`specfit.context.evaluate_nodes`' (same
    operations, same order: ``expected`` is ``1 + np.sum`` of the chosen P).

    Raises:
        ValueError: ``ok`` is False (some predicted cycle time is not > 0).
    """
    if not ok:
        raise ValueError("cost model: a cycle time of 0 s makes the throughput unbounded")
    # one plan per cycle on the live decide path: built as Plan.trusted builds it, but its fields
    # as one dict literal (no classmethod frame, keyword dict or update: ~20 us less after a model
    # forward on the build machine, paired A/B; issue 14)
    plan = object.__new__(Plan)
    object.__setattr__(plan, "__dict__", {
        "nodes": nodes, "expected_committed": expected, "predicted_cycle_s": cycle_s,
        "predicted_tokens_per_s": expected / cycle_s, "decision_s": time.perf_counter() - started,
        "nodes_explored": num_nodes, "policy": POLICY_NAME, "predicted_misses": misses,
        "exact": True, "gap": 0.0,
    })  # fmt: skip
    return plan


def plan_union_size(ctx: PolicyContext, root_alpha: float = 1.0, max_depth: int = 0) -> tuple[Plan, bool]:
    """:func:`plan_exact` of a union-size context and the expected stopping rule on that plan
    (when the tree is shallower than ``max_depth``) in ONE compiled call
    (:func:`specfit.decide_kernels.union_size_plan_rule`): ``(plan, keep drafting)``.

    Exact for the union-size predictor: the best subtree of each size is a top-by-P prefix; all
    ``N`` prefix sizes are scored with the cost model's own operations, in the same order
    (per-layer expected misses summed per size, ``draft + verify + h2d`` or ``draft + max(verify,
    h2d)``, running gain), so the ratios are bit-identical to scoring each size with
    ``cost.cycle_s``; the first size of highest ratio wins, as in a scan. The plan is remembered
    for ``ctx`` as :func:`plan_exact` remembers it (a plan already remembered is returned).

    With overlap mode "on" (``cost.per_layer_overlap``) each size and chain is priced per layer
    (``cost.cycle_s_layers``' operations, :func:`specfit.decide_kernels.union_cycle_s`).

    Raises:
        ValueError: the cost model makes a cycle take 0 s.
    """
    started = time.perf_counter()
    p = ctx.accept_probs
    ne = ctx.node_experts
    answer = decide_kernels().union_size_plan_rule(
        p, ctx.tree.parents, ctx.tree.depths, union_table(ne, p.shape[0] + max(int(max_depth), 0)),
        np.asarray(ne.layer_miss_fraction(ctx.cached_bits), dtype=np.float64), cost_params(ctx.cost),
        int(ctx.context_len), int(ctx.num_levels), float(root_alpha), int(max_depth), True,
    )  # fmt: skip
    plan = _PLANS.get(ctx)
    if plan is None:
        answer[0].setflags(write=False)  # the plan's nodes, read-only as every plan's
        plan = _PLANS[ctx] = union_size_plan(*answer[:5], p.shape[0], started)
    return plan, bool(answer[5])


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CUT_AT_S: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ctx -> deadline_s its remembered plan was cut at


def remember(ctx: PolicyContext, plan: Plan) -> None:
    """Remember ``plan`` as :func:`plan_exact`'s answer for ``ctx`` (built elsewhere by the same
    computation, e.g. :class:`specfit.policies.UnionSizeQuestions`); a plan already remembered stays."""
    _PLANS.setdefault(ctx, plan)


def plan_exact(
    ctx: PolicyContext, deadline_s: float | None = None, clock: Callable[[], float] = time.perf_counter
) -> Plan:
    """SpecFit: the ancestor-closed subtree with the highest predicted throughput (exact).

    See the module docstring for the method. ``Plan.nodes`` are ids of ``ctx.tree``, sorted,
    with the root; ``nodes_explored`` counts branch-and-bound states.

    Args:
        ctx: the planning problem.
        deadline_s: stop searching before ``clock()`` advances this many seconds since the call
            began, leaving time for the bound that certifies the stopped search (the clock is read
            every few states and the next chunk is priced at the slowest rate so far:
            :func:`_search_until`; ``None``: search to the end, ``0``: only the seed prefix and
            the bound). A stopped search returns the best subtree found so far with
            ``Plan.exact = False`` and ``Plan.gap``, the certified relative gap: the optimum is at
            most ``predicted_tokens_per_s * (1 + gap)`` (see ``planner_kernels.pending_bound``).
            A stopped search whose remaining part is already pruned by its bound is exact.
        clock: seconds, monotone (tests inject a fake clock; default ``time.perf_counter``).

    A context is immutable, so the plan is remembered per context object (weakly): asking again
    for the same ``ctx`` (the stopping rule, then the selection, on the last drafted level)
    returns the same :class:`Plan` without searching again. A plan cut short by its deadline
    (``exact=False``) is returned again only to a caller whose ``deadline_s`` is not None and at
    most the deadline it was cut at (same clock units); any other caller searches again, and the
    new plan is remembered in its place. An exact plan serves every caller.

    Raises:
        ValueError: the cost model makes the root-only cycle take 0 s, or a negative deadline.
    """
    if deadline_s is not None and not deadline_s >= 0:
        raise ValueError(f"plan_exact: deadline_s must be >= 0 or None, got {deadline_s!r}")
    cached = _PLANS.get(ctx)
    if cached is not None and (
        cached.exact or (deadline_s is not None and deadline_s <= _CUT_AT_S.get(ctx, -1.0))
    ):
        return cached
    started = time.perf_counter()
    if ctx.node_experts.is_union_size:
        return plan_union_size(ctx)[0]  # remembered there
    plan = _PLANS[ctx] = _search_plan(ctx, deadline_s, clock, started)
    if not plan.exact:
        _CUT_AT_S[ctx] = deadline_s  # serves later callers with this deadline or a shorter one
    return plan


def warm_up(search: bool = True) -> float:
    """Load (or, on a fresh install, compile) the compiled decide path now; returns the seconds it took.

    The first call of a compiled kernel in a process imports numba and loads the kernels from
    numba's on-disk cache (~1 s; a first compile ~15-20 s CPU for the search, a few seconds for
    the rest): a live engine calls this before its first timed cycle so that cost is not charged
    to a cycle's decision time. Runs, on tiny inputs of the types a live cycle passes, the
    acceptance levels (no map: the sibling-mass check; edge map with and without a runner-up
    map, path map), the
    union-size plan and expected stopping rule (:mod:`specfit.decide_kernels`), the guard's
    root-alone misses and copies with and without each prefetch kind (``root_layer_misses``,
    ``root_alone_copies`` in :mod:`specfit.cache_kernels`: the live engine asks them after each
    drafting cycle, inside the run's decode time) and, with ``search``, the exact search with and
    without a deadline (:mod:`specfit.planner_kernels`).
    """
    from specfit import bitsets
    from specfit.acceptance import AcceptanceCalibration, path_accept_probs
    from specfit.cost import CycleCostModel
    from specfit.policies import SpecFitPolicy, root_alone_copies
    from specfit.tree import DraftTree

    started = time.perf_counter()
    tree = DraftTree.from_parents(np.arange(3), np.array([-1, 0, 0]), np.log([1.0, 0.5, 0.4]))
    knots = np.array([0.0, 1.0])
    for calibration in (
        None,  # without a map: the compiled sibling-mass check (specfit.decide_kernels)
        AcceptanceCalibration(knots, knots, scope="edge"),
        AcceptanceCalibration(knots, knots, scope="edge", runner_up_knots_x=knots, runner_up_knots_y=knots),
        AcceptanceCalibration(knots, knots, scope="path"),
    ):
        path_accept_probs(tree, calibration)
    cost = CycleCostModel(0.0, 1.0, 0.1, 0.0, 1e9, 1.0, 0, 1)
    probs = np.array([1.0, 0.5, 0.4])
    union = NodeExperts(64, union_size=np.array([[0.0, 1.0, 2.0]]), miss_fraction=np.array([0.5]))
    ctx = PolicyContext(tree, probs, union, bitsets.empty((1,), 64), cost, num_levels=1)
    SpecFitPolicy(guard=False).keep_drafting_expected(ctx, max_depth=2)  # the plan, then the rule
    cached, root_ids = bitsets.empty((2,), 64), np.array([[0], [1]], dtype=np.int64)  # the live types
    for predicted, guesses in ((None, None), (cached, None), (None, root_ids[1:]), (cached, root_ids[1:])):
        root_alone_copies(cached, root_ids, 64, 1, predicted, guesses)
    if search:
        bits = bitsets.pack(np.array([[[0]], [[1]], [[1]]]), 64)
        for deadline_s in (None, 0.0):  # both paths: the search and the deadline's bound
            ctx = PolicyContext(tree, probs, NodeExperts(64, bits=bits), bitsets.empty((1,), 64), cost)
            plan_exact(ctx, deadline_s=deadline_s)
    return time.perf_counter() - started


def plan_exact_many(contexts: list[PolicyContext]) -> list[Plan]:
    """:func:`plan_exact` of each context, union-size contexts that share their inputs batched.

    Union-size contexts with the same ``node_experts``, ``cached_bits`` (objects), ``cost`` and
    ``context_len`` (e.g. the planning problems of successive draft levels of one cycle) are
    scored in one vectorised pass: row ``i`` of a [contexts, sizes] matrix holds context ``i``'s
    ratios, computed with the same operations in the same order as :func:`plan_exact` (padding
    only after each row's own sizes), so every plan is identical to ``plan_exact(ctx)``; the
    plans are remembered as ``plan_exact`` remembers them. Other contexts go to
    :func:`plan_exact` one by one. ``decision_s`` of a batched plan is the batch's time.

    Raises:
        ValueError: as :func:`plan_exact`.
    """
    started = time.perf_counter()
    plans: list[Plan | None] = [_PLANS.get(ctx) for ctx in contexts]
    groups: dict[tuple, list[int]] = {}
    for i, ctx in enumerate(contexts):
        if plans[i] is None and ctx.node_experts.is_union_size:
            key = (id(ctx.node_experts), id(ctx.cached_bits), id(ctx.cost), ctx.context_len)
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        batch = [contexts[i] for i in members]
        for i, plan in zip(members, _plan_union_size_batch(batch, started)):
            plans[i] = _PLANS[contexts[i]] = plan
    return [plan if plan is not None else plan_exact(ctx) for plan, ctx in zip(plans, contexts)]


def _plan_union_size_batch(contexts: list[PolicyContext], started: float) -> list[Plan]:
    """:func:`plan_union_size` of contexts sharing node experts, cache, cost and context length."""
    first = contexts[0]
    cost = first.cost
    sizes_n = [ctx.accept_probs.shape[0] for ctx in contexts]
    width = max(sizes_n)
    misses, total_misses = _union_misses(first.node_experts, first.cached_bits, width)
    sizes = np.arange(1, width + 1, dtype=np.float64)
    verify = cost.verify_s_array(sizes, first.context_len)
    if cost.per_layer_priced:  # overlap mode "on", next-layer prefetch: each size's per-layer misses, as cost.cycle_s
        levels = np.array([ctx.num_levels for ctx in contexts])
        cycle = np.asarray(cost.cycle_s_layers(levels[:, None], sizes[None, :], first.context_len, misses[None]))
    else:
        h2d = total_misses * cost.priced_s_per_miss
        draft = np.array([cost.draft_s(ctx.num_levels) for ctx in contexts])
        cycle = cost.combine_s(draft[:, None], verify[None, :], h2d[None, :])  # [C, width]
    steps = np.zeros((len(contexts), width), dtype=np.float64)
    orders = []
    for row, ctx in enumerate(contexts):
        p, n = ctx.accept_probs, sizes_n[row]
        order = np.argsort(-p, kind="stable")  # by P descending, then id (= the lexsort)
        if order[0] != 0:  # the root leads already when P(root) = 1 = max P
            order = np.concatenate(([0], order[order != 0]))
        orders.append(order)
        steps[row, 0] = 1.0
        steps[row, 1:n] = p[order[1:]]
    valid = np.arange(width)[None, :] < np.asarray(sizes_n)[:, None]
    if not np.all(cycle[valid] > 0):
        raise ValueError("cost model: a cycle time of 0 s makes the throughput unbounded")
    ratios = np.cumsum(steps, axis=1) / cycle  # each row's running gain, as a 1-D cumsum
    ratios = np.where(valid & ~np.isnan(ratios), ratios, -np.inf)
    best_all = np.argmax(ratios, axis=1)
    elapsed = time.perf_counter() - started
    plans = []
    for row, ctx in enumerate(contexts):
        best = int(best_all[row])
        if not ratios[row, best] > -1.0:
            best = 0
        ids = np.sort(orders[row][: best + 1])
        ids.setflags(write=False)
        expected = 1.0 + float(ctx.accept_probs[ids[1:]].sum())
        cycle_s = float(cycle[row, best])
        plans.append(
            Plan(
                nodes=ids,
                expected_committed=expected,
                predicted_cycle_s=cycle_s,
                predicted_tokens_per_s=expected / cycle_s,
                decision_s=elapsed,
                nodes_explored=int(sizes_n[row]),
                policy=POLICY_NAME,
                predicted_misses=float(misses[best].sum()),
            )
        )
    return plans


def iter_closed_subtrees(parents: np.ndarray) -> list[list[int]]:
    """All ancestor-closed node sets containing the root, each as a sorted list.

    ``parents`` int[N] (root -1, parents precede children). The count grows exponentially
    (2**(N-1) for a star); meant for trees of up to ~14 nodes.
    """
    n = len(parents)
    out: list[list[int]] = []

    def rec(v: int, chosen: list[int], in_set: list[bool]) -> None:
        if v == n:
            out.append(list(chosen))
            return
        rec(v + 1, chosen, in_set)
        if in_set[int(parents[v])]:
            in_set[v] = True
            chosen.append(v)
            rec(v + 1, chosen, in_set)
            chosen.pop()
            in_set[v] = False

    flags = [False] * n
    flags[0] = True
    rec(1, [0], flags)
    return out


def plan_brute_force(ctx: PolicyContext) -> Plan:
    """Reference optimum by enumerating every ancestor-closed subtree (small trees only).

    Scores each with the public cost methods (``cost.combine_s`` of draft, verify and
    ``transfer_s`` of the exact union misses; with overlap mode "on", ``cost.cycle_s`` of the
    misses per layer, :func:`specfit.context.evaluate_nodes`); ties keep the first set in
    enumeration order.

    Raises:
        ValueError: more than 24 nodes (the enumeration would not finish).
    """
    started = time.perf_counter()
    n = ctx.num_nodes
    if n > 24:
        raise ValueError(f"plan_brute_force: {n} nodes is too many to enumerate (max 24)")
    cost = ctx.cost
    draft = cost.draft_s(ctx.num_levels)
    p = ctx.accept_probs
    if ctx.node_experts.is_union_size:
        expected = [0.0] + [
            float(ctx.node_experts.expected_misses(k, ctx.cached_bits).sum()) for k in range(1, n + 1)
        ]
        node_ints = None
    else:
        miss = ctx.missing_bits()
        node_ints = [int.from_bytes(miss[v].astype("<u8").tobytes(), "little") for v in range(n)]
    best_ratio, best_nodes, count = -1.0, [0], 0
    for nodes in iter_closed_subtrees(ctx.tree.parents):
        count += 1
        gain = 1.0 + sum(float(p[v]) for v in nodes[1:])
        if cost.per_layer_priced or (cost.draft_prefetch and node_ints is not None):  # per layer
            _, cycle, _ = evaluate_nodes(ctx, np.asarray(nodes, dtype=np.int64))
            if gain / cycle > best_ratio:
                best_ratio, best_nodes = gain / cycle, nodes
            continue
        if node_ints is None:
            misses = expected[len(nodes)]
        else:
            union = 0
            for v in nodes:
                union |= node_ints[v]
            misses = union.bit_count()
        cycle = cost.combine_s(draft, cost.verify_s(len(nodes), ctx.context_len), cost.transfer_s(misses))
        ratio = gain / cycle
        if ratio > best_ratio:
            best_ratio, best_nodes = ratio, nodes
    return make_plan(ctx, np.asarray(best_nodes), "brute-force", time.perf_counter() - started, count)


def _max_closure_mincut(ctx: PolicyContext, lam: float, scale_hint: float) -> list[int]:
    """argmax over closed S of ``G(S) - lam*T(S)`` (no overlap) by one minimum s-t cut."""
    import networkx as nx  # imported here: only the test reference needs it

    n = ctx.num_nodes
    cost = ctx.cost
    miss = ctx.missing_bits()
    p = ctx.accept_probs
    graph = nx.DiGraph()
    scale = 1e12 / max(scale_hint, 1e-300)
    root_bits = miss[0]
    per_miss = lam * cost.priced_s_per_miss
    for v in range(1, n):
        w = float(p[v]) - lam * cost.verify_s_per_node
        cap = int(round(abs(w) * scale))
        if w > 0:
            graph.add_edge("s", ("v", v), capacity=cap)
        else:
            graph.add_edge(("v", v), "t", capacity=cap)
        parent = int(ctx.tree.parents[v])
        if parent > 0:
            graph.add_edge(("v", v), ("v", parent))  # no capacity attribute = infinite
        extra = np.bitwise_and(miss[v], np.invert(root_bits))
        layers, words = np.nonzero(extra)
        for layer, word in zip(layers.tolist(), words.tolist()):
            value = int(extra[layer, word])
            while value:
                low = value & -value
                item = ("e", layer, word * 64 + low.bit_length() - 1)
                value ^= low
                graph.add_edge(("v", v), item)
                graph.add_edge(item, "t", capacity=int(round(per_miss * scale)))
    if "s" not in graph or "t" not in graph:
        return [0]
    _, (source_side, _) = nx.minimum_cut(graph, "s", "t")
    return [0] + sorted(x[1] for x in source_side if isinstance(x, tuple) and x[0] == "v")


def plan_mincut(ctx: PolicyContext, max_iterations: int = 50) -> Plan:
    """Polynomial exact reference: Dinkelbach's iteration with a min-cut max-weight closure per step.

    lam_0 = R(root); S_{k+1} = argmax F_{lam_k}; lam_{k+1} = R(S_{k+1}); stop when it stops
    improving (Dinkelbach 1967). Integer-scaled capacities (~1e12 / sum of weights) make the cut
    exact up to a relative 1e-12 per step.

    Raises:
        ValueError: ``overlap_h2d`` cost (not a closure problem) or union-size node experts.
    """
    started = time.perf_counter()
    if ctx.cost.overlap_h2d or ctx.cost.next_layer_priced or ctx.node_experts.is_union_size:
        raise ValueError("plan_mincut: needs per-node expert sets and a cost without overlap_h2d or next-layer prefetch")
    from specfit.context import evaluate_nodes

    def ratio(nodes: list[int]) -> float:
        gain, cycle, _ = evaluate_nodes(ctx, np.asarray(nodes))
        return gain / cycle

    nodes = [0]
    lam = ratio(nodes)
    scale_hint = 1.0 + float(ctx.accept_probs[1:].sum())
    steps = 0
    for steps in range(1, max_iterations + 1):  # noqa: B007 (reported as nodes_explored)
        candidate = _max_closure_mincut(ctx, lam, scale_hint)
        new_lam = ratio(candidate)
        if new_lam <= lam * (1 + 1e-12):
            break
        nodes, lam = candidate, new_lam
    return make_plan(ctx, np.asarray(nodes), "mincut", time.perf_counter() - started, steps)
