"""Compiled per-question loops of SpecFit's decide path (numba, ``cache=True``).

A live cycle asks the planner once per drafted level (``SpecFitPolicy.keep_drafting``) and once
to select; with the union-size predictor no search runs, so a question is a handful of small
array steps whose numpy form costs more in call overhead than in arithmetic (issue 14: ~0.7 ms
per question on the build machine). These kernels do those steps in one compiled call each,
with the same element-wise operations in the same order as the numpy code they replace
(no fast-math, so no fused multiply-adds), so every value is bit-identical to it:

* :func:`level_accept_probs`: the level-by-level pass of :func:`specfit.acceptance.path_accept_probs`
  (parent's P times the edge acceptance, or the mapped path value clamped to the parent's;
  siblings renormalised where they sum to more than the parent, summed in id order as
  ``np.bincount`` does; without a map, :func:`renormalise_uncalibrated_siblings`, only beyond a
  float tolerance);
* :func:`union_size_best_prefix`: the union-size optimum of :mod:`specfit.planner` (best top-by-P
  prefix: running gain over ``draft + verify + h2d`` or ``draft + max(verify, h2d)``);
* :func:`expected_rule_union_size`: :meth:`specfit.policies.SpecFitPolicy.keep_drafting_expected`'s
  chain test with union-size prices;
* :func:`union_size_plan_rule`: one stopping question in one call: the union-size plan, its
  expected committed tokens (summed as ``np.sum`` sums, :func:`numpy_sum`) and, when asked, the
  rule on it (what the simulator and :func:`specfit.planner.plan_exact` call);
* :func:`union_size_question`: the live planner's question in one call: the calibrated
  acceptance of the level's tree, then :func:`union_size_plan_rule` (the same compiled code).

Imported lazily by their callers (numba loads them from its on-disk cache; a fresh install
compiles them once, a few seconds), so ``specfit`` imports without numba being loaded.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _clip01(x):
    """``x`` clipped to [0, 1] as ``np.clip(x, 0, 1)`` does (float; NaN passes through)."""
    if x < 0.0:
        return 0.0
    if x > 1.0:
        return 1.0
    return x


@njit(cache=True, inline="always")
def _interp(x, xp, fp):
    """``np.interp(x, xp, fp)`` for one float and strictly increasing ``xp`` (the calibration's
    knots), numpy's operations (``arr_interp``: the end values outside, ``fp[j]`` on a knot, else
    ``slope * (x - xp[j]) + fp[j]`` with the NaN fallbacks); NaN ``x`` gives NaN (one knot: ``fp[0]``)."""
    m = xp.shape[0]
    if m == 1:
        return fp[0]
    if np.isnan(x):
        return x
    if x < xp[0]:
        return fp[0]
    if x >= xp[m - 1]:
        return fp[m - 1]
    lo = 0
    hi = m - 1  # xp[lo] <= x < xp[hi]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if xp[mid] <= x:
            lo = mid
        else:
            hi = mid
    if xp[lo] == x:
        return fp[lo]
    slope = (fp[lo + 1] - fp[lo]) / (xp[lo + 1] - xp[lo])
    r = slope * (x - xp[lo]) + fp[lo]
    if np.isnan(r):
        r = slope * (x - xp[lo + 1]) + fp[lo + 1]
        if np.isnan(r) and fp[lo] == fp[lo + 1]:
            r = fp[lo]
    return r


@njit(cache=True, error_model="numpy")
def level_accept_probs(parents, depths, max_depth, logprobs, edge, knots_x, knots_y, runner_x, runner_y,
                       draft_logprobs):  # fmt: skip
    """P(v) of :func:`specfit.acceptance.path_accept_probs` with a calibration map: float64[N].

    Args:
        parents, depths: int64[N] of the tree (``max_depth`` its largest depth).
        logprobs: float64[N] draft log-probabilities, each node's own (``edge`` True: the edge
            map) or its path's (``edge`` False: the path map); their ``exp`` (libm's, as
            ``math.exp``: the same values as ``np.exp`` where numpy calls libm, i.e. without
            AVX-512) is clipped to [0, 1] here.
        knots_x, knots_y: the map (``np.interp`` knots, as ``AcceptanceCalibration.apply``).
        runner_x, runner_y: the runner-up map, taken by every child that is not its parent's most
            probable one (highest ``draft_logprobs``, ties: lowest id, as
            :func:`specfit.acceptance.top_child_mask`), or empty arrays (no runner-up map).
        draft_logprobs: float64[N] (finite; read only with a runner-up map).

    The map is applied by :func:`_interp` (numpy's ``interp`` operations on one value), so the
    values are numpy's bit for bit (``tests/test_specfit_decide_kernels.py``).
    """
    n = parents.shape[0]
    p = np.empty(n)
    _level_accept_probs_into(parents, depths, max_depth, logprobs, edge, knots_x, knots_y, runner_x, runner_y,
                             draft_logprobs, p, np.empty(n), np.empty(n, np.int64), np.empty(n))  # fmt: skip
    return p


@njit(cache=True, error_model="numpy")
def _level_accept_probs_into(parents, depths, max_depth, logprobs, edge, knots_x, knots_y, runner_x, runner_y,
                             draft_logprobs, p, val, top, sums):  # fmt: skip
    """:func:`level_accept_probs` into ``p`` float64[>= N] with the caller's scratch ``val``,
    ``sums`` float64[>= N] and ``top`` int64[>= N] (no allocation: the live question's, issue 14)."""
    n = parents.shape[0]
    use_runner = runner_x.shape[0] > 0
    for v in range(n):
        p[v] = 1.0
        top[v] = -1  # each parent's most probable child
        sums[v] = 0.0
    if use_runner:
        for v in range(n):
            par = parents[v]
            if par >= 0 and (top[par] < 0 or draft_logprobs[v] > draft_logprobs[top[par]]):
                top[par] = v
    for v in range(n):
        q = _clip01(np.exp(logprobs[v]))  # np.clip(exp, 0, 1), NaN kept
        if use_runner and (parents[v] < 0 or top[parents[v]] != v):
            x = _interp(q, runner_x, runner_y)
        else:
            x = _interp(q, knots_x, knots_y)
        val[v] = _clip01(x)
    for d in range(1, max_depth + 1):
        _zero_level_sums(parents, depths, d, sums)
        for v in range(n):
            if depths[v] == d:
                above = p[parents[v]]
                if edge:
                    p[v] = above * val[v]
                else:
                    p[v] = val[v] if val[v] < above else above
                sums[parents[v]] += p[v]
        _scale_level(parents, depths, d, p, sums, 0.0)  # s > above * 1.0: s > above exactly


@njit(cache=True, inline="always")
def _zero_level_sums(parents, depths, d, sums):
    """``sums[parent] = 0`` for every parent of a depth-``d`` node."""
    for v in range(parents.shape[0]):
        if depths[v] == d:
            sums[parents[v]] = 0.0


@njit(cache=True, inline="always")
def _scale_level(parents, depths, d, p, sums, tol):
    """Each depth-``d`` node's P times ``P(parent) / sums[parent]`` where its family's sum exceeds
    ``P(parent) * (1 + tol)`` (``tol = 0``: any excess; ``x * 1.0`` is ``x`` exactly)."""
    for v in range(parents.shape[0]):
        if depths[v] == d:
            above = p[parents[v]]
            s = sums[parents[v]]
            if s > above * (1.0 + tol):
                p[v] *= above / s


SIBLING_MASS_TOLERANCE = 1e-9
"""Relative excess of a node's children's summed P over its own that the uncalibrated P keeps
(float rounding of a softmax's path probabilities, ``exp(a + b)`` summed, can exceed the parent by
a few ulps; those stay bit-identical): :func:`renormalise_uncalibrated_siblings`."""


@njit(cache=True, error_model="numpy")
def renormalise_uncalibrated_siblings(parents, depths, max_depth, p, sums, tol):
    """The uncalibrated P of :func:`specfit.acceptance.path_accept_probs` (clipped, each node
    clamped to its parent's), in place: where a node's children sum to more than
    ``P(node) * (1 + tol)`` (no softmax gives it: siblings are disjoint events), the calibrated
    pass's renormalisation, level by level (children clamped to their parent's value, then scaled
    by ``P(parent) / sum``, so deeper nodes build on the scaled values). Returns whether any
    family exceeded; when none does ``p`` is left untouched (bit-identical).

    Args:
        parents, depths: int64[N] of the tree (``max_depth`` its largest depth).
        p: float64[>= N] the clamped P, changed in place. sums: float64[>= N] scratch.
        tol: relative tolerance (:data:`SIBLING_MASS_TOLERANCE`).

    Sums are in id order (``np.bincount``'s), so the first check agrees with a numpy one.
    """
    n = parents.shape[0]
    for v in range(n):
        sums[v] = 0.0
    for v in range(1, n):
        sums[parents[v]] += p[v]
    excess = False
    for v in range(n):
        if sums[v] > p[v] * (1.0 + tol):
            excess = True
            break
    if not excess:
        return False
    for d in range(1, max_depth + 1):
        _zero_level_sums(parents, depths, d, sums)
        for v in range(n):
            if depths[v] == d:
                if p[parents[v]] < p[v]:  # min(p[v], p[parent]) as Python's min
                    p[v] = p[parents[v]]
                sums[parents[v]] += p[v]
        _scale_level(parents, depths, d, p, sums, tol)
    return True


@njit(cache=True, error_model="numpy")
def union_cycle_s(params, num_levels, nodes, context_len, union_table, row, miss, total, scratch):
    """Predicted cycle time (s) of a union-size subtree of ``nodes`` nodes after ``num_levels``
    levels: its expected misses per layer are ``union_table[row] * miss``, ``total`` their sum
    as the caller summed it. ``params`` float64[18 + 3 K] (:func:`specfit.planner.cost_params`):
    ``draft_base_s, draft_s_per_level, verify_base_s, verify_s_per_node,
    verify_s_per_context_token, priced_s_per_miss, overlap_h2d, per_layer (overlap mode "on"),
    overlapped_link_s_per_transfer, host_s_per_transfer, pre_router_fraction, priced_late_call_s,
    num_layers``.

    The cost model's operations in its order: ``draft + verify + h2d`` or ``draft + max(verify,
    h2d)`` (``cost.combine_s``, ``h2d = total * priced_s_per_miss``), or in mode "on"
    ``cost.cycle_s_layers``: ``draft + sum_l max(c, pre * c + m_l * after, m_l * link) + (host *
    sum_l m_l + late * #{m_l > 0})``, ``c = verify / L``, both sums as ``np.sum`` sums (:func:`numpy_sum`;
    ``scratch`` float64[2, >= L] holds the terms), one form for both per-layer cases (next-layer
    prefetch priced, ``params[13]``, or mode "on", ``params[7]``) with ``host, after, link`` of
    ``params[14:17]`` (``cost.per_layer_s_per_miss``: ``after = link = T_link`` without next-layer
    prefetch, where ``max(c, pre * c + m * link, m * link) = max(c, pre * c + m * link)``).
    With ``K = params[17]`` knots of the share per tree size those three are the share's at
    ``nodes`` (``h``, ``x`` by :func:`_interp`, numpy's ``interp``; then ``(1 + x) host_s_per_transfer,
    (1 - h) overlapped_link_s_per_transfer, (1 + x) overlapped_link_s_per_transfer``: ``cost.next_layer_s_per_miss``'s
    operations, so the values are its bit for bit). With next-layer prefetch priced layer 0 takes
    ``after = link = overlapped_link_s_per_transfer`` and adds ``(host_s_per_transfer - host) * m_0`` to the
    host term (no guess covers it: ``cost.cycle_s_layers``' operations).
    """
    levels = float(num_levels)
    draft = params[0] + params[1] * levels if levels > 0 else 0.0  # cost.draft_s
    verify = params[2] + params[3] * nodes + params[4] * float(context_len)
    if params[13] != 0.0 or params[7] != 0.0:  # next-layer prefetch or overlap mode "on", per layer
        host_s, after_s, link_s = params[14], params[15], params[16]
        knots = int(params[17])
        if knots > 0:  # the share per tree size: cost.next_layer_s_per_miss(nodes)
            h = _interp(nodes, params[18 : 18 + knots], params[18 + knots : 18 + 2 * knots])
            w = _interp(nodes, params[18 : 18 + knots], params[18 + 2 * knots : 18 + 3 * knots])
            host_s, after_s, link_s = (1.0 + w) * params[9], (1.0 - h) * params[8], (1.0 + w) * params[8]
        layers = miss.shape[0]
        c = verify / params[12]
        count = 0
        for layer in range(layers):  # np.maximum: NaN wins
            m = union_table[row, layer] * miss[layer]
            a, b = after_s, link_s
            if layer == 0 and params[13] != 0.0:  # next-layer prefetch: no guess for layer 0
                a = b = params[8]
            if params[6] != 0.0:  # mode "on": max(max(c, pre * c + m * after), m * link)
                x = params[10] * c + m * a
                x = x if x > c or np.isnan(x) else c
            else:  # max(c + m * after, m * link)
                x = c + m * a
            y = m * b
            scratch[0, layer] = x if x > y or np.isnan(x) else y
            scratch[1, layer] = m
            if m != 0.0:
                count += 1
        host = host_s * numpy_sum(scratch[1], 0, layers)
        if params[13] != 0.0:  # layer 0's placing without waste (cost.cycle_s_layers)
            host = host + (params[9] - host_s) * scratch[1, 0]
        if params[6] != 0.0:
            host = host + params[11] * float(count)
        return draft + numpy_sum(scratch[0], 0, layers) + host
    h2d = total * params[5]
    if params[6] != 0.0:
        return draft + (verify if verify >= h2d or np.isnan(verify) else h2d)
    return draft + verify + h2d


@njit(cache=True, error_model="numpy")
def union_size_best_prefix(p, union_table, miss, params, context_len, num_levels, scratch):
    """The union-size optimum over top-by-P prefixes: ``(nodes int64[k], cycle_s, misses, ok)``.

    With the nodes ordered root first, then by P descending (ties: lower id), the prefix of the
    ``k`` nodes returned (sorted by id) has the highest ratio of running gain ``1 + sum P`` to
    its cycle time (:func:`union_cycle_s`; misses of ``m`` nodes: ``sum_l union_table[m - 1, l]
    * miss[l]`` summed as ``np.sum`` sums a row, :func:`specfit.planner._union_misses`' values),
    the shortest of equal ratios; NaN ratios never win (the root alone when all are NaN).
    ``cycle_s`` and ``misses`` are the prefix's; ``ok`` is False when some cycle time is not > 0.
    """
    n = p.shape[0]
    order = np.empty(n, np.int64)
    k, cycle_s, misses, ok = _best_prefix_into(
        p, union_table, miss, params, context_len, num_levels, scratch, order, np.empty(miss.shape[0] + 2 * n)
    )
    return order[:k], cycle_s, misses, ok


@njit(cache=True, error_model="numpy")
def _best_prefix_into(p, union_table, miss, params, context_len, num_levels, scratch, order, buf):
    """:func:`union_size_best_prefix` without allocation: ``(k, cycle_s, misses, ok)``, the
    prefix's ``k`` nodes sorted by id in ``order[:k]`` (``order`` int64[>= N], ``buf``
    float64[>= L + 2 N] scratch)."""
    n = p.shape[0]
    for i in range(n):  # insertion sort, stable: P descending, ties by id (NaN last, as numpy sorts)
        key = p[i]
        j = i
        while j > 0 and (key > p[order[j - 1]] or (key == key and p[order[j - 1]] != p[order[j - 1]])):
            order[j] = order[j - 1]
            j -= 1
        order[j] = i
    if order[0] != 0:  # the root leads (it already does when P(root) = 1 = max P)
        j = 0
        while order[j] != 0:
            j += 1
        for i in range(j, 0, -1):
            order[i] = order[i - 1]
        order[0] = 0
    layers = miss.shape[0]
    prod = buf[:layers]
    cycles = buf[layers : layers + n]
    totals = buf[layers + n : layers + 2 * n]
    ok = True
    best = -1
    best_ratio = 0.0
    gain = 1.0
    for i in range(n):
        if i > 0:
            gain += p[order[i]]
        for layer in range(layers):
            prod[layer] = union_table[i, layer] * miss[layer]
        totals[i] = numpy_sum(prod, 0, layers)
        cycles[i] = union_cycle_s(params, num_levels, float(i + 1), context_len, union_table, i, miss, totals[i], scratch)
        if not cycles[i] > 0.0:
            ok = False
        ratio = gain / cycles[i]
        if not np.isnan(ratio) and (best < 0 or ratio > best_ratio):
            best, best_ratio = i, ratio
    if best < 0 or not best_ratio > -1.0:
        best = 0
    for i in range(1, best + 1):  # the prefix sorted by id in place (insertion sort: a few nodes)
        key = order[i]
        j = i
        while j > 0 and order[j - 1] > key:
            order[j] = order[j - 1]
            j -= 1
        order[j] = key
    return best + 1, cycles[best], totals[best], ok


@njit(cache=True, error_model="numpy")
def expected_rule_union_size(p, parents, depths, max_depth, chosen, root_alpha, remaining, union_table, miss,
                             num_levels, best_tokens_per_s, params, context_len, scratch):  # fmt: skip
    """The expected-value stopping rule with union-size prices: True = draft another level.

    As :meth:`specfit.policies.SpecFitPolicy.keep_drafting_expected`: ``chosen`` bool[N] holds the
    current optimum (modified: the path to the leaf is added); the leaf is the most probable
    node of the deepest level (first of equal P), ``alpha`` its edge acceptance (``root_alpha``
    on the root alone); for ``k = 1..remaining`` more levels the chain adds
    ``P(leaf) * sum_{j<=k} alpha**j`` expected tokens and ``k`` nodes, priced (:func:`union_cycle_s`)
    with ``union_table[m - 1] * miss`` expected misses per layer for ``m`` nodes (their total
    summed in layer order; ``union_table`` float64[>= m, L]).
    """
    return _expected_rule_into(p, parents, depths, max_depth, chosen, root_alpha, remaining, union_table, miss,
                               num_levels, best_tokens_per_s, params, context_len, scratch, np.empty(p.shape[0]))  # fmt: skip


@njit(cache=True, error_model="numpy")
def _expected_rule_into(p, parents, depths, max_depth, chosen, root_alpha, remaining, union_table, miss,
                        num_levels, best_tokens_per_s, params, context_len, scratch, base_p):  # fmt: skip
    """:func:`expected_rule_union_size` with the caller's scratch ``base_p`` float64[>= N]."""
    n = p.shape[0]
    if max_depth == 0:
        leaf = 0
        alpha = root_alpha
    else:
        leaf = -1
        for v in range(n):
            if depths[v] == max_depth and (leaf < 0 or p[v] > p[leaf]):
                leaf = v
        parent_p = p[parents[leaf]]
        alpha = 0.0
        if parent_p > 0:
            alpha = p[leaf] / parent_p
            if alpha > 1.0:
                alpha = 1.0
    v = leaf
    while v > 0 and not chosen[v]:
        chosen[v] = True
        v = parents[v]
    count = 0
    m = 0
    for u in range(n):  # base_p: P of the chosen non-root nodes in id order, summed as np.sum (_chain_gain)
        if chosen[u]:
            count += 1
            if u != 0:
                base_p[m] = p[u]
                m += 1
    base_gain = 1.0 + numpy_sum(base_p, 0, m)
    run = 0.0
    layers = miss.shape[0]
    for k in range(1, remaining + 1):
        # alpha ** 1 is alpha exactly (pow's error is below 1 ulp and alpha is representable),
        # so the first level, where the rule most often answers, calls no libm pow: its code
        # and tables cost ~3 us per question after a model forward (issue 14)
        run += alpha if k == 1 else alpha ** float(k)
        gain = base_gain + p[leaf] * run
        row = count + k - 1
        misses = 0.0
        for layer in range(layers):
            misses += union_table[row, layer] * miss[layer]
        cycle = union_cycle_s(params, num_levels + k, float(count + k), context_len, union_table, row, miss, misses,
                              scratch)  # fmt: skip
        if gain > best_tokens_per_s * cycle:
            return True
    return False


@njit(cache=True, inline="always")
def _pairwise_block(a, lo, n):
    """numpy's ``pairwise_sum`` of ``a[lo:lo + n]`` for ``n <= 128`` (one leaf of its recursion)."""
    if n < 8:
        res = -0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = lo + 8
    stop = lo + n - n % 8
    while i < stop:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < lo + n:
        res += a[i]
        i += 1
    return res


@njit(cache=True)
def numpy_sum(a, lo, n):
    """``a[lo:lo + n].sum()`` as numpy sums a contiguous float64 array, bit for bit (float).

    numpy's pairwise summation (``pairwise_sum`` in numpy's ``loops_utils.h.src``): fewer than 8
    values summed in order from ``-0.0``; up to 128 in 8 interleaved partial sums combined as
    ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``, then the remainder in order; a longer
    run is split in two halves (the first a multiple of 8) whose sums are added. The recursion
    runs on an explicit stack (numba does not cache recursive functions called from others).
    Checked against ``np.sum`` in ``tests/test_specfit_decide_kernels.py``.
    """
    if n <= 128:
        return _pairwise_block(a, lo, n)
    segs = np.empty((192, 3), np.int64)  # (start, length, halves summed?): depth <= 63
    vals = np.empty(64)
    top = 0
    nv = 0
    segs[0, 0], segs[0, 1], segs[0, 2] = lo, n, 0
    while top >= 0:
        start, length, done = segs[top, 0], segs[top, 1], segs[top, 2]
        top -= 1
        if length <= 128:
            vals[nv] = _pairwise_block(a, start, length)
            nv += 1
        elif done:
            vals[nv - 2] = vals[nv - 2] + vals[nv - 1]
            nv -= 1
        else:
            half = length // 2
            half -= half % 8
            segs[top + 1, 0], segs[top + 1, 1], segs[top + 1, 2] = start, length, 1
            segs[top + 2, 0], segs[top + 2, 1], segs[top + 2, 2] = start + half, length - half, 0
            segs[top + 3, 0], segs[top + 3, 1], segs[top + 3, 2] = start, half, 0
            top += 3
    return vals[0]


@njit(cache=True, error_model="numpy")
def union_size_plan_rule(p, parents, depths, union_table, miss, params, context_len, num_levels, root_alpha,
                         max_depth, ask):  # fmt: skip
    """One union-size stopping question: ``(nodes int64[k], cycle_s, expected, misses, ok, keep)``.

    The plan is :func:`union_size_best_prefix`'s (``nodes`` sorted by id, ``cycle_s`` its
    predicted cycle) on the predicted misses of the top-``k`` subtrees, ``misses[k - 1] =
    sum_l union_table[k - 1, l] * miss[l]`` (the product, then summed as ``np.sum`` sums a row:
    :func:`specfit.planner._union_misses`' values; ``misses`` returned is the plan's). ``expected
    = 1 + sum P(nodes[1:])`` summed as ``np.sum`` does (:func:`numpy_sum`), so ``expected /
    cycle_s`` is the plan's ``predicted_tokens_per_s`` bit for bit. ``ok`` is False when some
    cycle time is not > 0 (``keep`` is then False). With ``ask``, ``keep`` is
    :func:`expected_rule_union_size`'s answer on that plan for the ``max_depth - depth`` levels
    the tree can still grow (``root_alpha``: the root estimate); False when none is left.

    Args:
        p: float64[N] path acceptance; parents, depths: int64[N] of the tree.
        union_table: float64[>= N + max_depth, L] expected union sizes; miss: float64[L] miss fractions.
        params: float64[18 + 3 K] of :func:`specfit.planner.cost_params` (the cost terms, overlap
            form and next-layer terms, in its order); the context term is ``params[4] *
            context_len`` (as ``cost.verify_s``).
        context_len, num_levels, max_depth: counts (int).
    """
    n = p.shape[0]
    order = np.empty(n, np.int64)
    k, cycle_s, expected, misses, ok, keep = _plan_rule_into(
        p, parents, depths, union_table, miss, params, context_len, num_levels, root_alpha, max_depth, ask,
        np.empty((2, miss.shape[0])), order, np.empty(miss.shape[0] + 5 * n),
    )  # fmt: skip
    return order[:k], cycle_s, expected, misses, ok, keep


@njit(cache=True, error_model="numpy")
def _plan_rule_into(p, parents, depths, union_table, miss, params, context_len, num_levels, root_alpha,
                    max_depth, ask, scratch, order, buf):  # fmt: skip
    """:func:`union_size_plan_rule` without allocation: ``(k, cycle_s, expected, misses, ok,
    keep)``, the plan's nodes in ``order[:k]`` (``scratch`` float64[2, L], ``order`` int64[>= N],
    ``buf`` float64[>= L + 5 N] scratch; the live question's, issue 14)."""
    n = p.shape[0]
    layers = miss.shape[0]
    k, cycle_s, misses, ok = _best_prefix_into(p, union_table, miss, params, context_len, num_levels, scratch,
                                               order, buf)  # fmt: skip
    ids = order
    chosen_p = buf[layers + 2 * n : layers + 3 * n]
    for i in range(1, k):
        chosen_p[i - 1] = p[ids[i]]
    expected = 1.0 + numpy_sum(chosen_p, 0, k - 1)
    depth = 0
    for v in range(n):
        if depths[v] > depth:
            depth = depths[v]
    keep = False
    if ask and ok and depth < max_depth:
        chosen = buf[layers + 3 * n : layers + 4 * n]  # 1.0: chosen
        for v in range(n):
            chosen[v] = 0.0
        for i in range(k):
            chosen[ids[i]] = 1.0
        keep = _expected_rule_into(
            p, parents, depths, depth, chosen, root_alpha, max_depth - depth, union_table, miss, num_levels,
            expected / cycle_s, params, context_len, scratch, buf[layers + 4 * n : layers + 5 * n],
        )  # fmt: skip
    return k, cycle_s, expected, misses, ok, keep


@njit(cache=True, inline="always")
def _clean_fraction(x):
    """A miss fraction as ``UnionSizePredictor`` takes an observed one: 1 where not finite,
    else clipped to [0, 1] (``np.where(np.isfinite(x), x.clip(0, 1), 1.0)``; a clean value is kept)."""
    if not np.isfinite(x):
        return 1.0
    return _clip01(x)


#: Layout of :func:`union_size_question`'s per-run array (:func:`question_constants`): flags and
#: counts first, then the cost parameters, the calibration's knots and the answer's room.
_Q_CALIBRATED, _Q_EDGE, _Q_MAX_DEPTH, _Q_NUM_KNOTS, _Q_NUM_RUNNER, _Q_NUM_PARAMS, _Q_PARAMS = 0, 1, 2, 3, 4, 5, 6


def question_constants(params, calibrated, edge, max_depth, knots_x, knots_y, runner_x, runner_y, room):
    """``(work float64[6 + P + 2 K + 2 R + room], answer_at)``: what every question of a run shares
    and where it answers, in ONE array for :func:`union_size_question` (each argument of a
    compiled call costs its unboxing; issue 14): ``calibrated``, ``edge`` (0/1), ``max_depth``,
    ``K``, ``R``, ``P``, the ``P`` cost parameters (:func:`specfit.planner.cost_params`), then
    ``knots_x, knots_y`` (K each), the runner-up map's ``runner_x, runner_y`` (R each, R = 0:
    none), then ``room`` values from ``answer_at`` on for the answer and the question's scratch
    (at least :func:`question_room`)."""
    head = [float(bool(calibrated)), float(bool(edge)), float(max_depth)]
    head += [float(len(knots_x)), float(len(runner_x)), float(len(params))]
    work = np.concatenate((np.array(head), params, knots_x, knots_y, runner_x, runner_y, np.zeros(int(room))))
    return work.astype(np.float64), work.shape[0] - int(room)


@njit(cache=True, error_model="numpy")
def union_size_question(parents, values, work, union_table, miss, context_len, num_levels, root_alpha, ask):
    """The live planner's stopping question in one call:
    ``(ok, keep, cycle_s, expected, misses, depth1_max, k, N)``, with ``p`` in ``work[a:a + N]`` and
    the plan's ``k`` nodes (sorted ids, int64 in the bytes of ``work``: ``work.view(np.int64)``) in
    ``[a + N:a + N + k]`` (``a``: the ``answer_at`` of :func:`question_constants`, which made
    ``work``; scalars come back without a new array to box per question; issue 14); the rest of
    the room is the question's scratch (nothing is allocated). A tree too large for
    ``union_table`` (``N + max_depth`` rows) or for the room (:func:`question_room`) is not
    answered: ``k = -1`` and nothing else is meaningful (the caller grows them and asks again),
    so the caller needs no numpy call per question to measure the tree; ``miss`` of another
    length than the table's layers: ``k = -2``; a tree without a root (``N = 0``): ``k = -3``;
    ``values`` shorter than ``parents``: ``k = -4``; ``parents[0] != -1`` or a node ``v >= 1`` whose
    parent is not in ``[0, v)``: ``k = -5`` with that node as the last value instead of ``N``
    (the caller raises on each; these O(N) compares keep every read in bounds whatever arrays the
    unchecked entry point is handed, as long as their types are right).

    ``parents`` int64[N] (parents before children; depths follow from them). ``p`` float64[N] is
    :func:`specfit.acceptance.path_accept_probs` of the tree: calibrated, :func:`level_accept_probs`
    of ``values`` (the draft log-probs for an edge map, also the runner-up map's ranking, the
    path log-probs for a path map; ``exp`` taken there) and the map's knots; without a
    calibration, ``values`` are the path probabilities (``np.exp`` of the path log-probs, as
    ``path_accept_probs`` takes it) clipped to [0, 1], ``P(root) = 1`` and each node clamped to
    its parent's value (``min``, in id order), children renormalised only where they exceed their
    parent (:func:`renormalise_uncalibrated_siblings`). ``miss`` float64[L] are the miss fractions,
    cleaned as ``UnionSizePredictor`` cleans an observed one (:func:`_clean_fraction`; clean
    values pass unchanged). The rest is :func:`union_size_plan_rule` of ``p`` (``max_depth`` from
    ``work``). ``depth1_max`` is the largest P at depth 1 (``np.max``'s: NaN if any is NaN), -1
    when the tree is the root alone.
    """
    n = parents.shape[0]
    num_knots = int(work[_Q_NUM_KNOTS])
    num_runner = int(work[_Q_NUM_RUNNER])
    at = _Q_PARAMS + int(work[_Q_NUM_PARAMS])
    params = work[_Q_PARAMS:at]
    knots_x = work[at : at + num_knots]
    knots_y = work[at + num_knots : at + 2 * num_knots]
    runner_x = work[at + 2 * num_knots : at + 2 * num_knots + num_runner]
    runner_y = work[at + 2 * num_knots + num_runner : at + 2 * num_knots + 2 * num_runner]
    answer_at = at + 2 * num_knots + 2 * num_runner
    if miss.shape[0] != union_table.shape[1]:  # the caller's miss fractions are not float[L]
        return False, False, 0.0, 0.0, 0.0, -1.0, -2, n
    if n < 1:  # no root: the scratch below would write past the room (numba has no bounds checks)
        return False, False, 0.0, 0.0, 0.0, -1.0, -3, n
    if values.shape[0] < n:  # a shorter values array would be read past its end
        return False, False, 0.0, 0.0, 0.0, -1.0, -4, n
    if parents[0] != -1:
        return False, False, 0.0, 0.0, 0.0, -1.0, -5, 0
    for v in range(1, n):  # parents precede children: every parents[.] read below is in [0, N)
        if parents[v] < 0 or parents[v] >= v:
            return False, False, 0.0, 0.0, 0.0, -1.0, -5, v
    layers = miss.shape[0]
    if n + int(work[_Q_MAX_DEPTH]) > union_table.shape[0] or answer_at + question_room(n, layers) > work.shape[0]:
        return False, False, 0.0, 0.0, 0.0, -1.0, -1, n
    # no allocation (issue 14): the answer and every scratch array are views of ``work``
    ints = work.view(np.int64)
    p = work[answer_at : answer_at + n]  # the answer's P, computed in place
    order = ints[answer_at + n : answer_at + 2 * n]  # the answer's nodes (the first k)
    at = answer_at + 2 * n
    scratch = work[at : at + 2 * layers].reshape((2, layers))
    clean = work[at + 2 * layers : at + 3 * layers]
    buf = work[at + 3 * layers : at + 4 * layers + 5 * n]
    at += 4 * layers + 5 * n
    val, sums, top, depths = work[at : at + n], work[at + n : at + 2 * n], ints[at + 2 * n : at + 3 * n], ints[at + 3 * n : at + 4 * n]
    for layer in range(layers):
        clean[layer] = _clean_fraction(miss[layer])
    depths[0] = 0
    depth = 0
    for v in range(1, n):
        depths[v] = depths[parents[v]] + 1
        if depths[v] > depth:
            depth = depths[v]
    if n == 1:
        p[0] = 1.0
    elif work[_Q_CALIBRATED] != 0.0:
        _level_accept_probs_into(
            parents, depths, depth, values, work[_Q_EDGE] != 0.0, knots_x, knots_y, runner_x, runner_y, values,
            p, val, top, sums,
        )  # fmt: skip
    else:
        for v in range(n):
            p[v] = _clip01(values[v])
        p[0] = 1.0
        for v in range(1, n):  # min(p[v], p[parent]) as Python's min: the first unless the second is less
            if p[parents[v]] < p[v]:
                p[v] = p[parents[v]]
        renormalise_uncalibrated_siblings(parents, depths, depth, p, sums, SIBLING_MASS_TOLERANCE)
    depth1_max = -1.0
    if depth >= 1:
        depth1_max = -np.inf
        for v in range(n):
            if depths[v] == 1:
                x = p[v]
                if np.isnan(x):
                    depth1_max = x
                    break
                if x >= depth1_max:
                    depth1_max = x
    k, cycle_s, expected, misses, ok, keep = _plan_rule_into(
        p, parents, depths, union_table, clean, params, context_len, num_levels, root_alpha,
        int(work[_Q_MAX_DEPTH]), ask, scratch, order, buf,
    )  # fmt: skip
    return ok, keep, cycle_s, expected, misses, depth1_max, k, n


@njit(cache=True, inline="always")
def question_room(n, layers):
    """Values of :func:`union_size_question`'s ``work`` it needs from ``answer_at`` on for a tree of
    ``n`` nodes and ``layers`` layers: the answer (``2 n``: P and the node ids) and the question's
    scratch arrays (``4 L + 9 n``), so a question allocates nothing (issue 14)."""
    return 11 * n + 4 * layers


def question_entry(kernel=None):
    """The compiled entry point of :func:`union_size_question` (or of ``kernel``, a numba
    dispatcher taking the same arguments, e.g. the benchmark's empty call) for one fixed argument
    signature (:func:`question_signature`), loaded (or compiled) now: ``parents`` int64[N], ``values`` float64[N], ``union_table``
    float64[M, L] and ``miss`` float64[L] of any strides (layout ``"A"``; read only), ``work``
    float64[W] C-contiguous (written), ``context_len`` and ``num_levels`` int64, ``root_alpha``
    float64, ``ask`` bool.

    Calling numba's dispatcher type-checks every argument on every call (``typeof`` of each, a
    lookup of the matching specialisation): on the build machine, after a model forward, that
    costs ~15 us per question (issue 14). The entry point skips those checks and does NOT check
    the array types itself (an array of another dtype or number of axes would be read as if it
    had these: wrong values or a crash), so a caller may use it only for arguments it has checked
    to have exactly these types (:meth:`specfit.policies.UnionSizeQuestions` passes the arrays of
    an exact :class:`specfit.tree.DraftTree` or ``live.spec.tree.TokenTree``
    (:func:`specfit.tree.is_typed_tree`), whose types were checked when the tree was made, and the
    cycle's table and miss fractions, checked once per cycle; anything else goes through the
    dispatcher). The kernel's own guards (k = -4, -5) cover the lengths and the parent order,
    not the dtypes. Scalars are
    converted by Python's number protocol (a wrong type raises ``TypeError``). Same code as the
    dispatcher's specialisations, so the same values bit for bit
    (``tests/test_specfit_decide_kernels.py``).
    """
    kernel = union_size_question if kernel is None else kernel
    signature = question_signature()
    kernel.compile(signature)
    return kernel.overloads[signature].entry_point


def question_signature() -> tuple:
    """The numba argument types of :func:`question_entry` (see there), as a tuple for
    ``Dispatcher.compile``."""
    from numba import types

    def array(dtype, ndim, layout="A", readonly=True):
        return types.Array(dtype, ndim, layout, readonly=readonly)

    return (
        array(types.int64, 1), array(types.float64, 1), array(types.float64, 1, "C", readonly=False),
        array(types.float64, 2), array(types.float64, 1), types.int64, types.int64, types.float64, types.boolean,
    )  # fmt: skip
