"""Compiled form of ``FastEngine._idle_link_cycle``'s per-layer recurrence (numba, ``cache=True``).

Imported lazily by :mod:`sim.engine` on the first idle-link cycle, so importing ``sim`` compiles
nothing (numba's on-disk cache makes later processes load it quickly). Integer nanoseconds in
int64 (exact: a cycle's instants are far below 2**63 ns), so the timings are those of the loop
(``FastEngine.run_cycle`` with ``vectorised = False``; ``tests/test_sim_engine.py`` compares them
to the nanosecond).
"""

from __future__ import annotations

from numba import njit

# rows of ``idle_link_layers``' output
STARTS, ENDS, WAITS, COPY = 0, 1, 2, 3


@njit(cache=True)
def idle_link_layers(overlap_on, counts, compute, pre, host_ns, transfer_ns, verify_start, out):
    """One cycle's layers on a link idle at verification, nothing in flight (the closed form of
    ``FastEngine._idle_link_cycle``), written into ``out``.

    A layer with ``n`` misses, compute ``c`` of which ``p`` before its router, placing ``h`` and
    copy ``t`` per miss lasts ``n (h + t) + c`` and waits ``n (h + t)`` after ``p`` (overlap "off";
    with no pre-router compute, ``pre`` empty, it starts after the wait and waits 0 inside its
    span), or lasts ``n h + max(c, p + n t)`` and waits ``n h + max(p + n t - c, 0)`` (overlap
    "on" without a late-call cost); each layer starts when the previous one ends.

    Args:
        overlap_on: overlap "on" (else "off").
        counts: int64[L] demand misses per layer. compute: int64[L] per-layer compute (ns).
        pre: int64[L] pre-router part of each layer's compute (ns), or int64[0] (none).
        host_ns, transfer_ns: placing and copy time per miss (ns). verify_start: instant (ns).
        out: int64[4, L], filled with the layers' starts, ends, inner waits and copy time
            (rows :data:`STARTS`, :data:`ENDS`, :data:`WAITS`, :data:`COPY`).

    Returns:
        ``(end_ns, link_free_ns, num_transfers, busy_ns, h2d_ns)``: the last layer's end
        (``verify_start`` without layers), when the last copy lands (-1 without misses), the
        copies enqueued, the layers' summed ``end - start - wait`` and summed copy time
        (``CycleTiming.busy_ns`` and ``.h2d_ns``).
    """
    num_layers = counts.shape[0]
    has_pre = pre.shape[0] > 0
    now = verify_start
    landed = -1
    num_transfers = 0
    busy = 0
    h2d = 0
    for layer in range(num_layers):
        n = counts[layer]
        c = compute[layer]
        p = pre[layer] if has_pre else 0
        place = n * host_ns
        copy = n * transfer_ns
        start = now
        if not overlap_on:
            wait = place + copy
            end = start + wait + c
            if has_pre:
                arrive = start + p + wait
            else:  # the layer starts computing once its last copy has landed
                start = end - c
                arrive = start
                wait = 0
        else:
            after = p + copy  # the copies start after the router
            late = after - c if after > c else 0
            end = start + place + (c if c > after else after)
            wait = place + late
            arrive = start + place + after
        if n:
            landed = arrive
        num_transfers += n
        out[0, layer] = start
        out[1, layer] = end
        out[2, layer] = wait
        out[3, layer] = copy
        busy += end - start - wait
        h2d += copy
        now = end
    return now, landed, num_transfers, busy, h2d
