"""Compiled hot loops of SpecFit's exact search (numba, ``cache=True``); driven by :mod:`specfit.planner`.

Everything here is the branch and bound that :mod:`specfit.planner`'s docstring describes, on
plain arrays so numba compiles it (no Python objects, no torch). Three steps (:func:`node_groups`
runs inside :func:`setup`):

* :func:`setup`: the node experts minus the cache, the seed (best prefix by P; each rank's new
  misses counted on the bit words), the prefilter (tree max-closure of ``P - lam*(b +
  c*exclusive)``, ``exclusive`` the experts only one node misses, also counted on the words:
  once/twice masks), the renumbering of the kept nodes, then :func:`node_groups` on the kept
  nodes only (the prefilter typically keeps ~10 of 64 nodes, so the grouping, the costly part of
  a search that ends at its first state, works on a fraction of the bits).
* :func:`node_groups`: each non-root node's missing experts beyond the root's (bit positions of
  ``miss[v] & ~miss[0]``, uint64 words), grouped by the exact SET OF NODES that miss them. Two
  experts missed by the same nodes are covered together by every subtree, so a group of ``w``
  experts behaves as one expert of weight ``w`` in every count, share and bound (the values are
  the same as with single experts, in far fewer columns).
* :func:`search`: the depth-first branch and bound as an explicit stack of frames that runs at
  most ``limit`` states per call and can be resumed (the caller checks its deadline between
  calls); :func:`pending_bound` bounds what the stack has not explored yet, which certifies the
  gap of a search stopped by its deadline. Both allocate the bound's work arrays once per call
  (:func:`bound_scratch`), not once per bound.

Cycle time inside the search is the cost model's own totals form
(``specfit.cost.CycleCostModel.plan_cycle_s_total``): ``draft + verify + h2d`` or, with
``overlap``, ``draft + max(verify + host * m, pre * verify + h2d) + late * (m > 0)``, with
``verify = verify0 + per_node * n`` and ``h2d = per_miss * m`` (mode "ideal": ``host = pre =
late = 0``, ``draft + max(verify, h2d)``; mode "on" and the draft prefetch's pipeline: lower
bounds on their per-layer forms, ``specfit.planner.search_costs``). ``costs = [draft, verify0,
per_node, per_miss, overlap, host, pre, late]``. The planner re-scores the chosen subtree with the cost
model itself (``specfit.context.make_plan``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_INDEX = np.array(
    [0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4, 62, 55, 59, 36, 53, 51, 43, 22, 45, 39,
     33, 30, 24, 18, 12, 5, 63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23, 11, 46, 26, 40,
     15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6],
    dtype=np.int64,
)  # bit index of a power of two p: _DEBRUIJN_INDEX[(p * _DEBRUIJN) >> 58]
_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_SHIFT = np.uint64(58)


@njit(cache=True, error_model="numpy")
def _copy(dst, src):
    """dst[i] = src[i] (a loop: numba compiles slice assignment slowly)."""
    for i in range(src.shape[0]):
        dst[i] = src[i]


@njit(cache=True, error_model="numpy")
def _fill(dst, value):
    """dst[i] = value."""
    for i in range(dst.shape[0]):
        dst[i] = value


@njit(cache=True, error_model="numpy")
def node_groups(miss, rank):
    """Group the experts that non-root nodes miss beyond the root's by the set of nodes missing them.

    Args:
        miss: uint64[N, W] each node's missing experts (all layers' words side by side).
        rank: int64[N] position of each node in the seed order (root first).

    Returns:
        ``(nptr int64[N+1], ngrp int64[nnz], weight float64[G], exclusive float64[N],
        prefix_add float64[N])``: node ``v``'s groups are ``ngrp[nptr[v]:nptr[v+1]]`` (ascending),
        ``weight[g]`` the experts in group ``g``, ``exclusive[v]`` the experts only ``v`` misses,
        ``prefix_add[i]`` the experts first brought by the node of seed rank ``i``.
    """
    n, words = miss.shape
    colid = np.empty(words * 64, np.int64)
    _fill(colid, -1)
    num_cols = 0
    num_bits = 0
    for v in range(1, n):
        for j in range(words):
            x = miss[v, j] & ~miss[0, j]
            while x != _ZERO:
                low = x & (~x + _ONE)
                b = _DEBRUIJN_INDEX[(low * _DEBRUIJN) >> _SHIFT]
                key = j * 64 + b
                if colid[key] < 0:
                    colid[key] = num_cols
                    num_cols += 1
                num_bits += 1
                x ^= low
    k = (n + 63) // 64
    sig = np.zeros((num_cols, k), np.uint64)
    for v in range(1, n):
        bit = _ONE << np.uint64(v & 63)
        for j in range(words):
            x = miss[v, j] & ~miss[0, j]
            while x != _ZERO:
                low = x & (~x + _ONE)
                b = _DEBRUIJN_INDEX[(low * _DEBRUIJN) >> _SHIFT]
                sig[colid[j * 64 + b], v >> 6] |= bit
                x ^= low
    size = 4
    while size < 2 * num_cols + 2:
        size *= 2
    mask = np.uint64(size - 1)
    table = np.empty(size, np.int64)
    _fill(table, -1)
    rep = np.empty(max(num_cols, 1), np.int64)
    weight = np.zeros(max(num_cols, 1), np.float64)
    num_groups = 0
    for c in range(num_cols):
        h = np.uint64(0x9E3779B97F4A7C15)
        for t in range(k):  # splitmix64's finaliser on each word (every input bit reaches the low bits)
            h = h ^ sig[c, t]
            h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            h = h ^ (h >> np.uint64(31))
        slot = h & mask
        while True:
            g = table[slot]
            if g < 0:
                g = num_groups
                table[slot] = g
                rep[g] = c
                num_groups += 1
                break
            r = rep[g]
            same = True
            for t in range(k):
                if sig[r, t] != sig[c, t]:
                    same = False
                    break
            if same:
                break
            slot = (slot + _ONE) & mask
        weight[g] += 1.0
    nptr = np.zeros(n + 1, np.int64)
    exclusive = np.zeros(n, np.float64)
    prefix_add = np.zeros(n, np.float64)
    pair_group = np.empty(num_bits, np.int64)  # (group, user) pairs, groups ascending
    pair_node = np.empty(num_bits, np.int64)
    pairs = 0
    for g in range(num_groups):
        start = pairs
        first = n
        r = rep[g]
        for t in range(k):
            x = sig[r, t]
            while x != _ZERO:
                low = x & (~x + _ONE)
                v = t * 64 + _DEBRUIJN_INDEX[(low * _DEBRUIJN) >> _SHIFT]
                pair_group[pairs] = g
                pair_node[pairs] = v
                pairs += 1
                nptr[v + 1] += 1
                if rank[v] < first:
                    first = rank[v]
                x ^= low
        if pairs - start == 1:
            exclusive[pair_node[start]] += weight[g]
        prefix_add[first] += weight[g]
    for v in range(n):
        nptr[v + 1] += nptr[v]
    ngrp = np.empty(nptr[n], np.int64)
    fill = np.empty(n, np.int64)
    for v in range(n):
        fill[v] = nptr[v]
    for i in range(pairs):
        v = pair_node[i]
        ngrp[fill[v]] = pair_group[i]
        fill[v] += 1
    weights = np.empty(num_groups, np.float64)
    for g in range(num_groups):
        weights[g] = weight[g]
    return nptr, ngrp, weights, exclusive, prefix_add


@njit(cache=True, error_model="numpy")
def _prefilter(parents, probs, exclusive, lam, per_node_s, per_miss_s, tol, prefilter):
    """bool[N]: the nodes kept by the prefilter at ``lam`` (all when not ``prefilter``) (internal).

    Removing the part of subtree(v) in S changes ``F_lam`` by at least ``-val[v]``, ``val`` the
    tree max-closure of ``P(x) - lam*(per_node + per_miss*exclusive_x)``; ``val[v] <= tol``: some
    optimum avoids subtree(v). Only valid without overlap (the caller decides). The kept set is
    ancestor-closed and holds the root.
    """
    n = parents.shape[0]
    keep = np.ones(n, np.bool_)
    if prefilter and n > 1:
        w = np.empty(n, np.float64)
        for v in range(n):
            w[v] = probs[v] - lam * (per_node_s + per_miss_s * exclusive[v])
        for v in range(n - 1, 0, -1):
            if w[v] > 0:
                w[parents[v]] += w[v]
        for v in range(1, n):
            keep[v] = keep[parents[v]] and w[v] > tol
    return keep


@njit(cache=True, error_model="numpy")
def setup(node_bits, cached, probs, parents, order, costs, tol):
    """Seed, prefilter and compress one planning problem (see ``specfit.planner``).

    Args:
        node_bits: uint64[N, W] each node's predicted experts (all layers' words side by side).
        cached: uint64[W] the cached experts, same layout.
        probs: float64[N] P(v); parents: int64[N] (parents precede children).
        order: int64[N] the nodes by P descending, ties by id (the root first: P = 1).
        costs: float64[5] ``[draft, verify0, per_node, per_miss, overlap]`` (see :func:`_cycle_s`).
        tol: absolute tolerance of the bound tests.

    Returns:
        ``(ids, parents, probs, nptr, ngrp, weight, seed, seed_ratio, root_misses)``: the kept
        nodes (original ids, ascending) with their renumbered parents, P and expert groups (node
        ``i``'s groups ``ngrp[nptr[i]:nptr[i+1]]``, ``weight[g]`` experts each), the seed subtree
        (original ids, sorted: the best prefix of the nodes by P descending then id, which is
        ancestor-closed), its ratio (``inf`` if a cycle takes 0 s) and the root's misses.
    """
    n, words = node_bits.shape
    miss = np.empty((n, words), np.uint64)
    root_misses = 0.0
    for v in range(n):
        for j in range(words):
            miss[v, j] = node_bits[v, j] & ~cached[j]
    for j in range(words):
        x = miss[0, j]
        while x != _ZERO:
            root_misses += 1.0
            x &= x - _ONE
    # the experts each seed rank brings first and each node's exclusive experts (both beyond the
    # root's misses), counted on the words: the seed and the prefilter need no expert groups
    prefix_add = np.zeros(n, np.float64)
    exclusive = np.zeros(n, np.float64)
    seen = np.empty(words, np.uint64)
    once = np.zeros(words, np.uint64)
    twice = np.zeros(words, np.uint64)
    for j in range(words):
        seen[j] = miss[0, j]
    for i in range(n):
        v = order[i]
        if v == 0:
            continue
        count = 0
        for j in range(words):
            x = miss[v, j] & ~miss[0, j]
            count += _popcount(x & ~seen[j])
            seen[j] |= x
            twice[j] |= once[j] & x
            once[j] |= x
        prefix_add[i] = count
    for v in range(1, n):
        count = 0
        for j in range(words):
            count += _popcount(miss[v, j] & ~miss[0, j] & once[j] & ~twice[j])
        exclusive[v] = count
    gain = 0.0
    misses = root_misses
    best_k = 0
    lam = -np.inf
    for i in range(n):
        gain += 1.0 if i == 0 else probs[order[i]]
        misses += prefix_add[i]
        ratio = gain / _cycle_s(costs, i + 1, misses)
        if ratio > lam:
            lam = ratio
            best_k = i
    in_seed = np.zeros(n, np.bool_)
    for i in range(best_k + 1):
        in_seed[order[i]] = True
    seed = np.empty(best_k + 1, np.int64)
    i = 0
    for v in range(n):
        if in_seed[v]:
            seed[i] = v
            i += 1
    keep = _prefilter(parents, probs, exclusive, lam, costs[2], costs[3], tol, costs[4] == 0)
    # renumber the kept nodes 0..k-1 (the root first) and group only their experts
    new_id = np.empty(n, np.int64)
    count = 0
    for v in range(n):
        new_id[v] = count
        if keep[v]:
            count += 1
    ids = np.empty(count, np.int64)
    kparents = np.empty(count, np.int64)
    kprobs = np.empty(count, np.float64)
    kmiss = np.empty((count, words), np.uint64)
    krank = np.empty(count, np.int64)
    for v in range(n):
        if keep[v]:
            i = new_id[v]
            ids[i] = v
            kparents[i] = new_id[parents[v]] if v > 0 else -1
            kprobs[i] = probs[v]
            krank[i] = i
            for j in range(words):
                kmiss[i, j] = miss[v, j]
    knptr, kngrp, weight, _, _ = node_groups(kmiss, krank)
    return ids, kparents, kprobs, knptr, kngrp, weight, seed, lam, root_misses


@njit(cache=True, error_model="numpy")
def _popcount(x):
    """Set bits of the uint64 ``x`` (SWAR)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@njit(cache=True, error_model="numpy")
def _cycle_s(costs, num_nodes, misses):
    """The cost model's cycle time; ``costs = [draft, verify0, per_node, per_miss, overlap, host,
    pre, late]`` (module docstring)."""
    verify = costs[1] + costs[2] * num_nodes
    h2d = costs[3] * misses
    if costs[4] > 0:
        if costs[5] == 0 and costs[6] == 0 and costs[7] == 0:  # mode "ideal"
            return costs[0] + max(verify, h2d)
        late = costs[7] if misses > 0 else 0.0
        return costs[0] + max(verify + costs[5] * misses, costs[6] * verify + h2d) + late
    return costs[0] + verify + h2d


@njit(cache=True, error_model="numpy")
def _kill(alive, v, parents, mark):
    """alive[subtree(v)] = False (parents precede children)."""
    n = parents.shape[0]
    alive[v] = False
    _fill(mark, False)
    mark[v] = True
    for x in range(v + 1, n):
        if mark[parents[x]]:
            mark[x] = True
            alive[x] = False


@njit(cache=True, error_model="numpy")
def _evaluate(theta, f, lam, gain, nch, m, costs, parents, probs, alive, in_set, front, val, acc, sel, ub,
              ub_with, ub_without):
    """One bound pass (tree max-closure of modular weights) at ``theta``; returns |selected|.

    Updates ``ub[0]`` and the frontier probes, writes the selected completion into ``sel``.
    """
    n = parents.shape[0]
    if costs[4] > 0:  # max(V + host m, pre V + H) >= theta (V + host m) + (1 - theta) (pre V + H)
        share = theta + (1.0 - theta) * costs[6]
        alpha = costs[0] + share * costs[1]
        beta = share * costs[2]
        gamma = theta * costs[5] + (1.0 - theta) * costs[3]
    else:
        alpha = costs[0] + costs[1]
        beta = costs[2]
        gamma = costs[3]
    for v in range(n):
        acc[v] = 0.0
    for v in range(n - 1, 0, -1):
        if alive[v]:
            w = probs[v] - lam * (beta + gamma * f[v]) + acc[v]
            val[v] = w
            if w > 0:
                acc[parents[v]] += w
    total = gain - lam * (alpha + beta * nch + gamma * m)
    for v in range(1, n):
        if front[v] and val[v] > 0:
            total += val[v]
    if total < ub[0]:
        ub[0] = total
    for v in range(1, n):
        if front[v]:
            rest = total - max(0.0, val[v])
            if rest + val[v] < ub_with[v]:
                ub_with[v] = rest + val[v]
            if rest < ub_without[v]:
                ub_without[v] = rest
    count = 0
    sel[0] = False
    for v in range(1, n):
        sel[v] = alive[v] and val[v] > 0 and (in_set[parents[v]] or sel[parents[v]])
        if sel[v]:
            count += 1
    return count


@njit(cache=True, error_model="numpy")
def _verify_dominates(sel, plain, nch, m, costs):
    count = 0
    share = 0.0
    for v in range(sel.shape[0]):
        if sel[v]:
            count += 1
            share += plain[v]
    verify = costs[1] + costs[2] * (nch + count)
    return verify + costs[5] * (m + share) > costs[6] * verify + costs[3] * (m + share)


@njit(cache=True, error_model="numpy")
def _plain_shares(nptr, ngrp, weight, alive, covered, charged, cnt, plain):
    """``cnt[q]`` (out): open users of each uncovered group; ``plain[v]`` (out): each open node's
    lower bound on its marginal misses, every uncovered group split ``1/cnt`` among its users
    (left at 0 when transfers cost nothing, ``charged`` False)."""
    n = nptr.shape[0] - 1
    for v in range(1, n):
        if alive[v]:
            for j in range(nptr[v], nptr[v + 1]):
                q = ngrp[j]
                if not covered[q]:
                    cnt[q] += 1.0
    if charged:
        for v in range(1, n):
            if alive[v]:
                s = 0.0
                for j in range(nptr[v], nptr[v + 1]):
                    q = ngrp[j]
                    if not covered[q]:
                        s += weight[q] / cnt[q]
                plain[v] = s


@njit(cache=True, error_model="numpy")
def _refined_shares(nptr, ngrp, weight, alive, covered, selected, cnt, selcnt, f):
    """Refined shares ``f`` (out): an uncovered group with a selected user is split among the
    selected users only; the others keep ``1/cnt`` (any split summing to <= 1 is a valid bound)."""
    n = nptr.shape[0] - 1
    _fill(selcnt, 0.0)
    for v in range(1, n):
        if selected[v]:
            for j in range(nptr[v], nptr[v + 1]):
                q = ngrp[j]
                if not covered[q]:
                    selcnt[q] += 1.0
    for v in range(1, n):
        if alive[v]:
            s = 0.0
            if selected[v]:
                for j in range(nptr[v], nptr[v + 1]):
                    q = ngrp[j]
                    if not covered[q]:
                        s += weight[q] / selcnt[q]
            else:
                for j in range(nptr[v], nptr[v + 1]):
                    q = ngrp[j]
                    if not covered[q] and selcnt[q] == 0:
                        s += weight[q] / cnt[q]
            f[v] = s


@njit(cache=True, error_model="numpy")
def bound_scratch(n, num_groups):
    """The work arrays of :func:`bound` for ``n`` nodes and ``num_groups`` groups: ``(cnt
    float64[G], plain, val, acc float64[n], sel, best_sel bool[n], ub float64[1], f float64[n],
    selcnt float64[G])``; :func:`bound` resets what it reads."""
    return (
        np.zeros(num_groups, np.float64),
        np.zeros(n, np.float64),
        np.zeros(n, np.float64),
        np.zeros(n, np.float64),
        np.zeros(n, np.bool_),
        np.zeros(n, np.bool_),
        np.empty(1, np.float64),
        np.zeros(n, np.float64),
        np.zeros(num_groups, np.float64),
    )


@njit(cache=True, error_model="numpy")
def bound(parents, probs, nptr, ngrp, weight, alive, in_set, covered, nch, m, gain, lam, costs, tol,
          refinements, theta_steps, ub_with, ub_without, front, scratch):
    """Upper bound on ``F_lam`` over the completions of a state, with frontier probes.

    ``front`` (out) marks the frontier (open nodes whose parent is in S); ``ub_with[v]`` /
    ``ub_without[v]`` (out) bound the completions that hold / avoid frontier node ``v``. Returns
    ``-inf`` when nothing is open on the frontier. See ``specfit.planner``'s docstring and
    notes there for the shares, the refinement and the overlap theta. ``scratch``: the work
    arrays of :func:`bound_scratch` (allocated once per search call, not once per bound).
    """
    n = parents.shape[0]
    num_groups = weight.shape[0]
    has_front = False
    for v in range(n):
        front[v] = v > 0 and alive[v] and in_set[parents[v]]
        ub_with[v] = np.inf
        ub_without[v] = np.inf
        if front[v]:
            has_front = True
    if not has_front:
        return -np.inf
    cnt, plain, val, acc, sel, best_sel, ub, f, selcnt = scratch
    for q in range(num_groups):
        cnt[q] = 0.0
    for v in range(n):
        plain[v] = 0.0
        val[v] = 0.0
        acc[v] = 0.0
        sel[v] = False
        best_sel[v] = False
    _plain_shares(nptr, ngrp, weight, alive, covered, costs[3] > 0 or costs[5] > 0, cnt, plain)
    ub[0] = np.inf
    overlap = costs[4] > 0
    # One evaluation site (compiles once) driven by a small state machine:
    # mode 0: theta = 1 with the plain shares; 1: theta = 0 (overlap, when verify does not
    # dominate at theta = 1); 2: bisection on theta (the bound is convex in theta; the sign of
    # V - H of the selected completion is its subgradient); 3: refined shares at the best theta.
    _copy(f, plain)
    mode = 0
    theta = 1.0
    best_theta = 1.0
    lo, hi = 0.0, 1.0
    before = np.inf
    steps = 0
    refined = 0
    nsel = 0
    while True:
        count = _evaluate(theta, f, lam, gain, nch, m, costs, parents, probs, alive, in_set, front, val, acc,
                          sel, ub, ub_with, ub_without)
        bisect = False
        if mode == 0:
            best_theta, nsel = 1.0, count
            _copy(best_sel, sel)
            if overlap and ub[0] > tol and not _verify_dominates(sel, plain, nch, m, costs):
                mode, theta = 1, 0.0
                continue
        elif mode == 1:
            best_theta, nsel = 0.0, count
            _copy(best_sel, sel)
            bisect = theta_steps > 0 and _verify_dominates(sel, plain, nch, m, costs)
        elif mode == 2:
            if ub[0] < before:
                best_theta, nsel = theta, count
                _copy(best_sel, sel)
            if _verify_dominates(sel, plain, nch, m, costs):
                lo = theta
            else:
                hi = theta
            steps += 1
            bisect = steps < theta_steps
        else:
            nsel = count
            _copy(best_sel, sel)
        if bisect and ub[0] > tol:
            mode, theta, before = 2, 0.5 * (lo + hi), ub[0]
            continue
        gamma = best_theta * costs[5] + (1.0 - best_theta) * costs[3] if overlap else costs[3]
        if refined >= refinements or ub[0] <= tol or nsel == 0 or gamma == 0:
            break
        # refined shares: an uncovered group is charged only to the selected users when it has one
        refined += 1
        mode, theta = 3, best_theta
        _refined_shares(nptr, ngrp, weight, alive, covered, best_sel, cnt, selcnt, f)
    return ub[0]


def new_state(n: int, num_groups: int) -> tuple[np.ndarray, ...]:
    """Search state for ``n`` kept nodes and ``num_groups`` expert groups, at the root-only frame.

    Plain numpy (allocating here is cheaper than boxing numba's arrays). Returns ``(alive
    bool[n+1, n], covered bool[n+1, G], in_set bool[n], chosen int64[n], clen int64[n+1], gain
    float64[n+1], misses float64[n+1], phase int64[n+1], forced bool[n+1], best int64[n], istate
    int64[3] = (top frame, states explored, best size or 0 = the seed))``; the caller sets
    ``misses[0]`` (the root's own misses).
    """
    alive = np.zeros((n + 1, n), np.bool_)
    alive[0, 1:] = True
    in_set = np.zeros(n, np.bool_)
    in_set[0] = True
    clen = np.zeros(n + 1, np.int64)
    clen[0] = 1
    gain = np.zeros(n + 1, np.float64)
    gain[0] = 1.0
    return (
        alive,
        np.zeros((n + 1, num_groups), np.bool_),
        in_set,
        np.zeros(n, np.int64),
        clen,
        gain,
        np.zeros(n + 1, np.float64),
        np.zeros(n + 1, np.int64),
        np.zeros(n + 1, np.bool_),
        np.zeros(n, np.int64),
        np.zeros(3, np.int64),
    )


@njit(cache=True, error_model="numpy")
def search(parents, probs, nptr, ngrp, weight, costs, tol, refinements, theta_steps, alive, covered, in_set,
           chosen, clen, gain, misses, phase, forced, best, istate, best_ratio, limit):
    """Run the branch and bound for at most ``limit`` more states; returns the incumbent ratio.

    The stack (frames ``0..istate[0]``) is kept in the state arrays, so a later call resumes where
    this one stopped; ``istate[0] < 0`` when the search is complete. A frame is a state: chosen
    set ``chosen[:clen[k]]``, open nodes ``alive[k]``, covered groups ``covered[k]``, gain and
    misses; ``phase`` 0 = not yet scored, 1 = bounding, 2 = waiting for its child (its branch
    nodes are ``chosen[clen[k]:clen[k+1]]``; ``forced``: no exclude branch follows).
    """
    n = parents.shape[0]
    ub_with = np.empty(n, np.float64)
    ub_without = np.empty(n, np.float64)
    front = np.empty(n, np.bool_)
    mark = np.empty(n, np.bool_)
    scratch = bound_scratch(n, weight.shape[0])
    sp = istate[0]
    explored = istate[1]
    stop_at = explored + limit
    while sp >= 0:
        if phase[sp] == 0:
            if explored >= stop_at:
                break
            explored += 1
            ratio = gain[sp] / _cycle_s(costs, clen[sp], misses[sp])
            if ratio > best_ratio:
                best_ratio = ratio
                for i in range(clen[sp]):
                    best[i] = chosen[i]
                istate[2] = clen[sp]
            phase[sp] = 1
        elif phase[sp] == 2:
            b0 = clen[sp]
            for i in range(b0, clen[sp + 1]):
                in_set[chosen[i]] = False
            if forced[sp]:
                sp -= 1
                continue
            _kill(alive[sp], chosen[b0], parents, mark)
            phase[sp] = 1
        while True:
            ub = bound(parents, probs, nptr, ngrp, weight, alive[sp], in_set, covered[sp], clen[sp],
                       misses[sp], gain[sp], best_ratio, costs, tol, refinements, theta_steps, ub_with,
                       ub_without, front, scratch)
            if ub <= tol:
                sp -= 1
                break
            dropped = False
            for v in range(1, n):
                if front[v] and ub_with[v] <= tol:
                    _kill(alive[sp], v, parents, mark)
                    dropped = True
            if dropped:
                continue
            c0 = clen[sp]
            c = c0
            for v in range(1, n):
                if front[v] and ub_without[v] <= tol:
                    chosen[c] = v
                    c += 1
            is_forced = c > c0
            if not is_forced:
                pick = -1
                top = -np.inf
                for v in range(1, n):
                    if front[v] and ub_with[v] > top:
                        top = ub_with[v]
                        pick = v
                chosen[c] = pick
                c += 1
            _copy(alive[sp + 1], alive[sp])
            _copy(covered[sp + 1], covered[sp])
            g = gain[sp]
            mm = misses[sp]
            for i in range(c0, c):
                x = chosen[i]
                alive[sp + 1, x] = False
                in_set[x] = True
                g += probs[x]
                for j in range(nptr[x], nptr[x + 1]):
                    q = ngrp[j]
                    if not covered[sp + 1, q]:
                        covered[sp + 1, q] = True
                        mm += weight[q]
            clen[sp + 1] = c
            gain[sp + 1] = g
            misses[sp + 1] = mm
            forced[sp] = is_forced
            phase[sp] = 2
            phase[sp + 1] = 0
            sp += 1
            break
    istate[0] = sp
    istate[1] = explored
    return best_ratio


@njit(cache=True, error_model="numpy")
def pending_bound(parents, probs, nptr, ngrp, weight, costs, tol, refinements, theta_steps, alive, covered,
                  chosen, clen, gain, misses, phase, forced, istate, best_ratio):
    """Certified upper bound on the best ratio among the subtrees a stopped search has not explored.

    Frames ``k < top`` wait for their child: what is left of them is their open nodes without
    the branch node's subtree (nothing when the branch was forced). The top frame's whole
    region is left. For a region of states holding ``chosen_k``, every ``S`` in it has
    ``F_lam(S) <= ub_k`` and ``T(S) >= T(chosen_k)``, so ``R(S) <= lam + ub_k / T(chosen_k)``.
    Returns ``lam`` itself when every region is pruned (then the incumbent is optimal).
    """
    n = parents.shape[0]
    ub_with = np.empty(n, np.float64)
    ub_without = np.empty(n, np.float64)
    front = np.empty(n, np.bool_)
    mark = np.empty(n, np.bool_)
    in_set = np.zeros(n, np.bool_)
    scratch = bound_scratch(n, weight.shape[0])
    out = best_ratio
    top = istate[0]
    for k in range(top + 1):
        if k < top and forced[k]:
            continue
        region = np.empty(n, np.bool_)
        _copy(region, alive[k])
        if k < top:
            _kill(region, chosen[clen[k]], parents, mark)
        _fill(in_set, False)
        for i in range(clen[k]):
            in_set[chosen[i]] = True
        ub = bound(parents, probs, nptr, ngrp, weight, region, in_set, covered[k], clen[k], misses[k],
                   gain[k], best_ratio, costs, tol, refinements, theta_steps, ub_with, ub_without, front,
                   scratch)
        if k == top and phase[k] == 0:  # the chosen set itself was not scored yet
            ub = max(ub, gain[k] - best_ratio * _cycle_s(costs, clen[k], misses[k]))
        if ub > tol:
            out = max(out, best_ratio + ub / _cycle_s(costs, clen[k], misses[k]))
    return out


@njit(cache=True, error_model="numpy")
def union_misses(node_bits, cached, nodes):
    """Experts the subtree ``nodes`` (int64[]) misses: popcount of the OR of their rows of
    ``node_bits`` (uint64[N, W]) minus ``cached`` (uint64[W]), as a float."""
    total = 0.0
    for j in range(cached.shape[0]):
        x = _ZERO
        for i in range(nodes.shape[0]):
            x |= node_bits[nodes[i], j]
        x &= ~cached[j]
        while x != _ZERO:
            total += 1.0
            x &= x - _ONE
    return total
