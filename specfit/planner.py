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
  state by bisection on the bound's subgradient, see ``_Search._bound``). The coverage ``M`` is submodular; its marginal over the still-open nodes R is
  bounded below by a modular function: every uncovered missing expert i splits a unit charge
  among open nodes that miss it, first ``1/k_i`` to each of its ``k_i`` open users, then (one
  refinement) only among the users the first bound selected. Whatever subset is chosen, an
  expert collects at most 1 = what it really costs, so both bounds are valid. With modular
  weights ``w_x = P(x) - lam*(beta + gamma*f_x)`` the best closed completion is a max-weight
  closure on a TREE, solved exactly by one bottom-up pass ``val[x] = w_x + sum max(0, val[c])``.
* Probing on the frontier (open nodes whose parent is in S): if the bound with x forced in is
  <= 0, x and its subtree are dropped; if the bound without x is <= 0, x is forced in (all
  forced nodes join S in one step, no exclude branch). Branch on the frontier node whose inclusion bound is largest (include first).
* A state costs a few mat-vec products over the compressed expert columns (experts some kept
  non-root node misses and the root does not bring) plus O(N) Python.

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
from dataclasses import dataclass

import numpy as np

from specfit import bitsets
from specfit.context import Plan, PolicyContext, make_plan
from specfit.cost import CycleCostModel
from specfit.node_experts import NodeExperts

POLICY_NAME = "specfit"
_REL_TOL = 1e-11


@dataclass
class _Problem:
    """The search problem on the nodes kept by the prefilter, renumbered 0..n-1 (internal)."""

    ids: list[int]  # original node id of each kept node (ascending, ids[0] == 0)
    probs: list[float]
    parents: list[int]
    descendants: list[list[int]]
    node_items: list[int]  # python-int bitset of each node's missing experts beyond the root's
    items: np.ndarray  # float64[n, D] 0/1: node uses compressed column (missing expert) d
    root_misses: int
    draft_s: float
    verify0_s: float
    per_node_s: float
    per_miss_s: float
    overlap: bool
    tol: float
    seed_ratio: float
    seed_nodes: list[int]  # original ids
    cost: CycleCostModel

    @property
    def num_nodes(self) -> int:
        return len(self.ids)

    def cycle_s(self, num_nodes: int, misses: float) -> float:
        """T(S) for |S| = num_nodes and M(S) = misses, by the cost model's own formula."""
        verify = self.verify0_s + self.per_node_s * num_nodes
        return self.cost.combine_s(self.draft_s, verify, self.per_miss_s * misses)

    def minorant(self, theta: float) -> tuple[float, float, float]:
        """Linear lower bound ``(alpha, beta, gamma)``: cycle_s(n, m) >= alpha + beta*n + gamma*m.

        Exact without overlap (theta ignored); with overlap ``max(V, H) >= theta*V + (1-theta)*H``
        for any theta in [0, 1].
        """
        if not self.overlap:
            return (self.draft_s + self.verify0_s, self.per_node_s, self.per_miss_s)
        return (self.draft_s + theta * self.verify0_s, theta * self.per_node_s, (1 - theta) * self.per_miss_s)


def _prefilter(
    parents: np.ndarray, probs: np.ndarray, exclusive: np.ndarray, lam: float, ctx: PolicyContext, tol: float
) -> np.ndarray:
    """bool[N]: nodes that may belong to a subtree beating ``lam`` (always keeps the root).

    Without overlap, removing the part of subtree(v) in S changes F_lam by at least
    ``-val[v]``, ``val`` the tree max-closure of ``w_x = P(x) - lam*(b + c*exclusive_x)``
    (exclusive_x: experts only x misses, paid iff x is chosen). If ``val[v] <= 0`` some optimum
    avoids subtree(v) (weights only fall as lam rises to the optimum). With overlap the cost is
    not additive, so nothing is dropped.
    """
    n = probs.shape[0]
    keep = np.ones(n, dtype=bool)
    if ctx.cost.overlap_h2d or n == 1:
        return keep
    w = (probs - lam * (ctx.cost.verify_s_per_node + ctx.cost.s_per_miss * exclusive)).tolist()
    par = parents.tolist()
    for v in range(n - 1, 0, -1):
        if w[v] > 0:
            w[par[v]] += w[v]
    for v in range(1, n):
        keep[v] = keep[par[v]] and w[v] > tol
    return keep


def _setup(ctx: PolicyContext) -> _Problem:
    """Seed, prefilter and compress (see the module docstring); all vectorised over nodes."""
    n = ctx.num_nodes
    probs = ctx.accept_probs
    parents = ctx.tree.parents
    miss = ctx.missing_bits().reshape(n, -1)  # uint64[N, L*W]
    extra = miss & ~miss[0]
    extra[0] = 0
    root_misses = int(bitsets.popcount(miss[0]))
    tol = _REL_TOL * float(probs.sum())
    # seed: best prefix of the nodes sorted by P (ancestor-closed)
    order = np.lexsort((np.arange(n), -probs))
    order = np.concatenate(([0], order[order != 0]))
    prefix_misses = root_misses + bitsets.popcount(np.bitwise_or.accumulate(extra[order], axis=0))
    prefix_gain = np.cumsum(np.where(order == 0, 1.0, probs[order]))
    cost = ctx.cost
    ratios = prefix_gain / cost.cycle_s_total(
        ctx.num_levels, np.arange(1, n + 1), ctx.context_len, prefix_misses
    )
    if not np.all(np.isfinite(ratios)):
        raise ValueError("cost model: a cycle time of 0 s makes the throughput unbounded")
    best_k = int(np.argmax(ratios))
    seed_ratio, seed_nodes = float(ratios[best_k]), order[: best_k + 1].tolist()
    # exclusive experts per node (missing for no other node), for the prefilter
    zero = np.zeros((1, extra.shape[1]), dtype=np.uint64)
    before = np.concatenate((zero, np.bitwise_or.accumulate(extra, axis=0)[:-1]))
    after = np.concatenate((np.bitwise_or.accumulate(extra[::-1], axis=0)[::-1][1:], zero))
    exclusive = bitsets.popcount(extra & ~(before | after)).astype(np.float64)
    keep = _prefilter(parents, probs, exclusive, seed_ratio, ctx, tol)
    ids = np.flatnonzero(keep)
    new_id = np.full(n, -1, dtype=np.int64)
    new_id[ids] = np.arange(ids.size)
    kept_parents = [int(x) for x in np.where(parents[ids] >= 0, new_id[parents[ids]], -1)]
    kept_extra = extra[ids]
    flags = np.unpackbits(kept_extra.astype("<u8", copy=False).view(np.uint8), axis=1, bitorder="little")
    cols = np.flatnonzero(np.bitwise_or.reduce(flags, axis=0))
    items = np.take(flags, cols, axis=1).astype(np.float64)
    raw = kept_extra.astype("<u8", copy=False).tobytes()
    width = kept_extra.shape[1] * 8
    node_items = [int.from_bytes(raw[i * width : (i + 1) * width], "little") for i in range(ids.size)]
    descendants: list[list[int]] = [[v] for v in range(ids.size)]
    for v in range(ids.size - 1, 0, -1):
        descendants[kept_parents[v]].extend(descendants[v])
    return _Problem(
        ids=ids.tolist(),
        probs=probs[ids].tolist(),
        parents=kept_parents,
        descendants=descendants,
        node_items=node_items,
        items=items,
        root_misses=root_misses,
        draft_s=cost.draft_s(ctx.num_levels),
        verify0_s=cost.verify_s(0, ctx.context_len),
        per_node_s=cost.verify_s_per_node,
        per_miss_s=cost.s_per_miss,
        overlap=cost.overlap_h2d,
        tol=tol,
        seed_ratio=seed_ratio,
        seed_nodes=seed_nodes,
        cost=cost,
    )


class _Search:
    """Depth-first branch and bound state (see the module docstring)."""

    def __init__(self, prob: _Problem, refinements: int = 1, theta_steps: int = 4) -> None:
        self.prob = prob
        self.explored = 0
        self.refinements = refinements
        self.theta_steps = theta_steps
        self.best_ratio = prob.seed_ratio
        self.best_nodes: list[int] = list(prob.seed_nodes)  # original ids

    def _shares(self, alive_f: np.ndarray, covered: np.ndarray, select: np.ndarray | None) -> list[float]:
        """Lower bounds ``f[x]`` on each node's marginal misses, jointly valid over open nodes.

        Every uncovered column (missing expert) splits a unit charge among its open users: all of
        them (``1/k`` each) or, when ``select`` (0/1 float[n]) is given and one of its users is
        selected, only among the selected users. Any split summing to <= 1 is a valid bound.
        """
        items = self.prob.items
        counts = alive_f @ items
        counts[covered] = 0.0
        inv = np.divide(1.0, counts, out=np.zeros_like(counts), where=counts > 0)
        if select is None:
            return (items @ inv).tolist()
        sel_counts = select @ items
        sel_counts[covered] = 0.0
        inv_sel = np.divide(1.0, sel_counts, out=np.zeros_like(counts), where=sel_counts > 0)
        inv[sel_counts > 0] = 0.0
        both = items @ np.stack((inv_sel, inv), axis=1)
        return np.where(select > 0, both[:, 0], both[:, 1]).tolist()

    def _dp(
        self, alive_list: list[int], f: list[float], lam: float, beta: float, gamma: float
    ) -> list[float]:
        """Tree max-closure values ``val[x] = w_x + sum of positive children`` over open nodes."""
        probs, parents = self.prob.probs, self.prob.parents
        val = [0.0] * self.prob.num_nodes
        for v in reversed(alive_list):
            w = probs[v] - lam * (beta + gamma * f[v]) + val[v]
            val[v] = w
            if w > 0:
                val[parents[v]] += w
        return val

    def _bound(
        self, alive: np.ndarray, in_set: list[bool], covered: np.ndarray, n: int, m: int, gain: float
    ) -> tuple[float, list[int], list[float], list[float]]:
        """Upper bound on F_lam over completions, the frontier and per-frontier probes.

        Returns ``(ub, frontier, ub_with, ub_without)`` where ``ub_with[i]`` bounds completions
        that contain ``frontier[i]`` and ``ub_without[i]`` those that do not (min over every
        minorant and share split tried; each is a valid bound).

        Without overlap the cost is linear: one pass with ``1/k`` shares, then ``refinements``
        passes with shares split among the selected users. With overlap, ``max(V, H) >=
        theta*V + (1-theta)*H``; the bound is convex in theta (a max of linear functions), so theta
        is set by bisection on the sign of ``V - H`` of the selected completion (the subgradient),
        after trying theta = 1 and 0.
        """
        prob = self.prob
        lam = self.best_ratio
        alive_list = np.flatnonzero(alive).tolist()
        frontier = [v for v in alive_list if in_set[prob.parents[v]]]
        ub = [float("inf")]
        ub_with = [float("inf")] * len(frontier)
        ub_without = [float("inf")] * len(frontier)
        alive_f = alive.astype(np.float64)
        plain = self._shares(alive_f, covered, None) if prob.per_miss_s > 0 else [0.0] * prob.num_nodes

        def evaluate(theta: float, f: list[float]) -> list[int]:
            """One bound pass at ``theta``; updates the probes, returns the selected completion."""
            alpha, beta, gamma = prob.minorant(theta)
            val = self._dp(alive_list, f, lam, beta, gamma)
            total = gain - lam * (alpha + beta * n + gamma * m) + sum(max(0.0, val[v]) for v in frontier)
            ub[0] = min(ub[0], total)
            for i, v in enumerate(frontier):
                rest = total - max(0.0, val[v])
                ub_with[i] = min(ub_with[i], rest + val[v])
                ub_without[i] = min(ub_without[i], rest)
            chosen = [False] * prob.num_nodes
            for v in alive_list:
                chosen[v] = val[v] > 0 and (in_set[prob.parents[v]] or chosen[prob.parents[v]])
            return [v for v in alive_list if chosen[v]]

        def refine(theta: float, selected: list[int]) -> None:
            for _ in range(self.refinements):
                if ub[0] <= prob.tol or not selected or prob.minorant(theta)[2] == 0:
                    return
                mask = np.zeros(prob.num_nodes)
                mask[selected] = 1.0
                selected = evaluate(theta, self._shares(alive_f, covered, mask))

        if not prob.overlap:
            refine(1.0, evaluate(1.0, plain))
            return ub[0], frontier, ub_with, ub_without

        def verify_dominates(selected: list[int]) -> bool:
            verify = prob.verify0_s + prob.per_node_s * (n + len(selected))
            return verify > prob.per_miss_s * (m + sum(plain[v] for v in selected))

        best_theta, selected = 1.0, evaluate(1.0, plain)
        if ub[0] > prob.tol and not verify_dominates(selected):
            lo, hi = 0.0, 1.0
            best_theta, selected = 0.0, evaluate(0.0, plain)
            if verify_dominates(selected):
                for _ in range(self.theta_steps):
                    if ub[0] <= prob.tol:
                        break
                    theta = 0.5 * (lo + hi)
                    before = ub[0]
                    candidate = evaluate(theta, plain)
                    if ub[0] < before:
                        best_theta, selected = theta, candidate
                    if verify_dominates(candidate):
                        lo = theta
                    else:
                        hi = theta
        refine(best_theta, selected)
        return ub[0], frontier, ub_with, ub_without

    def run(self) -> None:
        """Search from the root-only state."""
        prob = self.prob
        alive = np.ones(prob.num_nodes, dtype=bool)
        alive[0] = False
        in_set = [False] * prob.num_nodes
        in_set[0] = True
        covered = np.zeros(prob.items.shape[1], dtype=bool)
        self._dfs(alive, in_set, [0], covered, 0, 1.0)

    def _dfs(
        self,
        alive: np.ndarray,
        in_set: list[bool],
        chosen: list[int],
        covered: np.ndarray,
        covered_int: int,
        gain: float,
    ) -> None:
        prob = self.prob
        self.explored += 1
        n = len(chosen)
        m = prob.root_misses + covered_int.bit_count()
        ratio = gain / prob.cycle_s(n, m)
        if ratio > self.best_ratio:
            self.best_ratio, self.best_nodes = ratio, [prob.ids[v] for v in chosen]
        alive = alive.copy()
        while True:
            ub, frontier, ub_with, ub_without = self._bound(alive, in_set, covered, n, m, gain)
            if ub <= prob.tol or not frontier:
                return
            dropped = [v for v, u in zip(frontier, ub_with) if u <= prob.tol]
            if dropped:
                for v in dropped:
                    alive[prob.descendants[v]] = False
                continue
            forced = [v for v, u in zip(frontier, ub_without) if u <= prob.tol]
            # every improving subtree holds each forced node: take them all in one step
            branch = forced or [max(zip(frontier, ub_with), key=lambda t: (t[1], -t[0]))[0]]
            alive_in = alive.copy()
            alive_in[branch] = False
            new_cov, new_int, new_gain = covered.copy(), covered_int, gain
            for x in branch:
                in_set[x] = True
                new_cov |= prob.items[x] > 0
                new_int |= prob.node_items[x]
                new_gain += prob.probs[x]
            self._dfs(alive_in, in_set, [*chosen, *branch], new_cov, new_int, new_gain)
            for x in branch:
                in_set[x] = False
            if forced:
                return
            alive[prob.descendants[branch[0]]] = False


_UNION_MISSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    rows = max(n, ne.union_size.shape[1] - 1)  # the sizes drafting can reach, so levels share it
    frac = ne.layer_miss_fraction(cached_bits)  # once per table, not once per size
    misses = ne.expected_union_table(rows) * frac  # C-contiguous [rows, L]
    totals = misses.sum(axis=1)  # each contiguous row summed like a 1-D ``misses.sum()``
    _UNION_MISSES[ne] = (cached_bits, misses, totals)
    return misses[:n], totals[:n]


def _plan_union_size(ctx: PolicyContext, started: float) -> Plan:
    """Exact for the union-size predictor: the best subtree of each size is a top-by-P prefix.

    All ``N`` prefix sizes are scored at once with the cost model's own operations, in the same
    order (per-layer expected misses summed per size, ``draft + verify + h2d`` or ``draft +
    max(verify, h2d)``, running gain), so the ratios are bit-identical to scoring each size with
    ``cost.cycle_s``; the first size of highest ratio wins, as in a scan.
    """
    p = ctx.accept_probs
    n = p.shape[0]
    order = np.lexsort((np.arange(n), -p))  # by P descending, then id
    order = np.concatenate(([0], order[order != 0]))
    cost = ctx.cost
    misses, total_misses = _union_misses(ctx.node_experts, ctx.cached_bits, n)
    sizes = np.arange(1, n + 1, dtype=np.float64)
    verify = (
        cost.verify_base_s
        + cost.verify_s_per_node * sizes
        + cost.verify_s_per_context_token * float(ctx.context_len)
    )
    h2d = total_misses * cost.s_per_miss
    cycle = cost.combine_s(cost.draft_s(ctx.num_levels), verify, h2d)
    if not np.all(cycle > 0):
        raise ValueError("cost model: a cycle time of 0 s makes the throughput unbounded")
    gain = np.cumsum(np.concatenate(([1.0], p[order[1:]])))
    ratios = gain / cycle
    best = int(np.argmax(np.where(np.isnan(ratios), -np.inf, ratios)))
    if not ratios[best] > -1.0:
        best = 0
    # a top-by-P prefix is ancestor-closed (P never rises along a path, parents have smaller
    # ids), so the plan is built directly; its scores are evaluate_nodes' (same operations)
    ids = np.sort(order[: best + 1])
    ids.setflags(write=False)
    expected = 1.0 + float(p[ids[1:]].sum())
    cycle_s = float(cycle[best])
    return Plan(
        nodes=ids,
        expected_committed=expected,
        predicted_cycle_s=cycle_s,
        predicted_tokens_per_s=expected / cycle_s,
        decision_s=time.perf_counter() - started,
        nodes_explored=int(n),
        policy=POLICY_NAME,
        predicted_misses=float(misses[best].sum()),
    )


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_exact(ctx: PolicyContext) -> Plan:
    """SpecFit: the ancestor-closed subtree with the highest predicted throughput (exact).

    See the module docstring for the method. ``Plan.nodes`` are ids of ``ctx.tree``, sorted,
    with the root; ``nodes_explored`` counts branch-and-bound states.

    A context is immutable, so the plan is remembered per context object (weakly): asking again
    for the same ``ctx`` (the stopping rule, then the selection, on the last drafted level)
    returns the same :class:`Plan` without searching again.

    Raises:
        ValueError: the cost model makes the root-only cycle take 0 s.
    """
    cached = _PLANS.get(ctx)
    if cached is not None:
        return cached
    started = time.perf_counter()
    if ctx.node_experts.is_union_size:
        plan = _plan_union_size(ctx, started)
    else:
        search = _Search(_setup(ctx))
        search.run()
        plan = make_plan(
            ctx, np.asarray(search.best_nodes), POLICY_NAME, time.perf_counter() - started, search.explored
        )
    _PLANS[ctx] = plan
    return plan


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
    """:func:`_plan_union_size` of contexts sharing node experts, cache, cost and context length."""
    first = contexts[0]
    cost = first.cost
    sizes_n = [ctx.accept_probs.shape[0] for ctx in contexts]
    width = max(sizes_n)
    misses, total_misses = _union_misses(first.node_experts, first.cached_bits, width)
    sizes = np.arange(1, width + 1, dtype=np.float64)
    verify = (
        cost.verify_base_s
        + cost.verify_s_per_node * sizes
        + cost.verify_s_per_context_token * float(first.context_len)
    )
    h2d = total_misses * cost.s_per_miss
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
    ``transfer_s`` of the exact union misses); ties keep the first set in enumeration order.

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
    per_miss = lam * cost.s_per_miss
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
    if ctx.cost.overlap_h2d or ctx.node_experts.is_union_size:
        raise ValueError("plan_mincut: needs per-node expert sets and a cost without overlap_h2d")
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
