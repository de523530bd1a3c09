"""One hand-built cycle with overlap and a draft prefetch (and, in a second case, next-layer
prefetch too): the live engine's recorded spans and the simulator's event log agree to the
nanosecond, and no expert computes before its copy lands.

The live engine runs on a fake clock (tests/fake_clock.py) with its real CPU copy stream, an
emulated link whose only cost is a per-transfer latency (each expert copy takes ``TRANSFER_NS``
on the FIFO link clock; waiting for a copy lets the clock run to its landing). Each layer's
attention and router take ``PRE_NS`` (in the second case; 0 in the first), its first kernel call
(its resident experts) ``COMPUTE_NS`` and each later call (a group of late experts landed
together) ``LATE_NS``; everything else takes no time. The simulator gets the same cycle as a
``CyclePlan`` (the live engine's own hits, demand misses and prefetch, the next-layer copies at
the layer that issued them, the measured pre-router time) with ``overlap="on"`` (and, in a
last case, the live ``overlap=False`` with prefetch, whose demand copies still go on the copy
stream: ``overlap="off"``, ``copy_stream=True``) and
``late_call_ns=LATE_NS``. With ``PRE_NS`` the demand copies (``TRANSFER_NS`` each) are enqueued
only once the router has run and outlast the layer's remaining compute. With ``HOST_NS`` (third
case) each expert's memcpy on the CPU copy stream takes ``HOST_NS`` (the compute thread's
placing; slot bookkeeping takes no time here): the link starts at the enqueue and copies while
the rest of the layer's misses are being placed, each copy landing no sooner than its own memcpy
(``live.h2d.H2DLink._copy_ahead``), which the simulator models as ``host_ns_per_transfer`` placed
after the enqueue (``placing_ns_per_transfer``; ``sim.engine._batch_landings``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_clock import FakeClock
from live_fixtures import make_cache
from test_live_offload import PROMPT

from live.h2d import H2DLink
from live.loader import describe_moe, load_target
from live.offload import OffloadedExperts, OffloadedMoE
from sim.engine import CyclePlan, FastEngine, LinkSpec, SimPyEngine
from specfit import bitsets

TRANSFER_NS = 300_000
COMPUTE_NS = 200_000
LATE_NS = 50_000
PRE_NS = 120_000
HOST_NS = 40_000  # per expert: two tensor copies of 20 us each
CAPACITY = 8


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def _fake_clock_link() -> H2DLink:
    """The real CPU link, emulating only a per-transfer latency of ``TRANSFER_NS``; its waits
    sleep all the way (the fake clock's sleep is exact, and a spin would never end on it)."""
    link = H2DLink("cpu", latency_s=TRANSFER_NS / 1e9)
    link.spin_below_s = 0.0
    return link


class _TimedCopy:
    """A copy destination whose ``copy_`` lets ``seconds`` pass on the fake clock (the memcpy)."""

    def __init__(self, dst: torch.Tensor, clock: FakeClock, seconds: float) -> None:
        self.dst, self.clock, self.seconds = dst, clock, seconds

    def copy_(self, src: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.seconds)
        return self.dst.copy_(src)


@pytest.mark.parametrize(
    ("pre_ns", "host_ns", "overlap"),
    [(0, 0, True), (PRE_NS, 0, True), (PRE_NS, HOST_NS, True), (PRE_NS, HOST_NS, False), (0, HOST_NS, False)],
)
@pytest.mark.parametrize("prefetch", ["draft", "both"])
def test_live_spans_equal_the_simulated_event_log_to_the_nanosecond(tiny_checkpoint, monkeypatch, prefetch, pre_ns, host_ns, overlap):
    path = tiny_checkpoint("qwen3_moe")
    probe = load_target(path)
    spec = describe_moe(probe)
    probe_engine = OffloadedMoE.install(probe, make_cache("lru", spec.num_layers, spec.num_experts, CAPACITY))
    with torch.no_grad():
        probe(PROMPT)
    ids, _ = probe_engine.last_routing()  # [T, L, K]: the routing the cycle will see
    num_layers = spec.num_layers
    union = [np.unique(ids[:, layer]) for layer in range(num_layers)]
    assert all(len(u) >= 3 for u in union)

    model = load_target(path)
    clock = FakeClock(tick_s=0.0, start_s=0.0).install(monkeypatch)
    cache = make_cache("lru", num_layers, spec.num_experts, CAPACITY)
    engine = OffloadedMoE.install(
        model, cache, _fake_clock_link(), capacity_per_layer=CAPACITY, overlap=overlap, prefetch=prefetch
    )
    for layer in range(num_layers):  # half of each layer's experts resident: hits and misses
        engine.warm(layer, union[layer][: len(union[layer]) // 2])
    prefetched = int(union[1][-1])  # a miss of layer 1, prefetched from the "draft"
    predicted = np.array([[[union[0][0]] * spec.top_k, [prefetched] * spec.top_k]])  # [1 node, L, K]

    original_run = OffloadedExperts._run
    calls: dict[int, int] = {}  # kernel calls per layer

    def timed_run(self, *args, **kwargs):  # resident experts: COMPUTE_NS; each late group: LATE_NS
        calls[self.moe_index] = calls.get(self.moe_index, 0) + 1
        clock.advance((COMPUTE_NS if calls[self.moe_index] == 1 else LATE_NS) / 1e9)
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(OffloadedExperts, "_run", timed_run)
    computed_at: list[tuple[int, int, int]] = []  # (layer, expert, clock ns) each expert's call began
    original_pairs = engine._pairs_as_copies_land

    def watched(layer, work):
        for mask in original_pairs(layer, work):  # bool[T, K]; None: the whole layer in one call
            experts = np.unique(work.ids if mask is None else work.ids[mask.numpy()])
            computed_at.extend((layer, int(e), _ns(clock.now_s)) for e in experts)
            yield mask

    engine._pairs_as_copies_land = watched
    original_prepare = engine._prepare_layer

    def routed_after_pre(layer, top_k_index, top_k_weights):  # attention + router took pre_ns
        clock.advance(pre_ns / 1e9)
        return original_prepare(layer, top_k_index, top_k_weights)

    engine._prepare_layer = routed_after_pre
    original_enqueue = engine.link.enqueue

    def timed_enqueue(transfers):  # each expert's memcpy takes host_ns, split over its tensor copies
        return original_enqueue(
            [[(_TimedCopy(dst, clock, host_ns / 1e9 / len(t)), src) for dst, src in t] for t in transfers]
        )

    engine.link.enqueue = timed_enqueue
    issue_log: list[tuple[int, int]] = []  # (layer, expert) of every prefetch copy, in issue order
    original_issue = engine.ledger.issue

    def logged_issue(layer, experts, ahead=False):
        issue_log.extend((layer, int(e)) for e in experts)
        original_issue(layer, experts, ahead)

    next_layer = [[] for _ in range(num_layers)]  # per layer l: layer l+1's next-layer copies
    original_next = engine._prefetch_next_layer

    def watched_next(layer, ids):
        count = len(issue_log)
        original_next(layer, ids)
        next_layer[layer] = [e for lay, e in issue_log[count:] if lay == layer + 1]

    engine.ledger.issue = logged_issue
    engine._prefetch_next_layer = watched_next

    prefetch_at = clock.now_s  # the draft prefetch is enqueued now, then placed (host_ns)
    assert engine.prefetch_predicted(bitsets.pack(predicted, spec.num_experts)) == 1
    engine.begin_forward()
    origin = engine._state.origin  # the draft prefetch's placing ended at this very instant
    assert _ns(origin - prefetch_at) == host_ns
    shift = host_ns / 1e9  # the simulator's clock starts when the draft prefetch is enqueued
    with torch.no_grad():
        model(PROMPT)
    stats = engine.end_forward()

    log = stats.transfers
    first = np.r_[True, (log.layers[1:] != log.layers[:-1]) | (log.experts[1:] != log.experts[:-1])]
    last = np.r_[first[1:], True]
    live_copies = sorted(
        (int(lay), int(e), _ns(enq + shift), _ns(start + shift), _ns(end + shift))
        for lay, e, enq, start, end in zip(
            log.layers[first],
            log.experts[first],
            log.enqueued_at_s[first],
            log.started_at_s[first],
            log.landed_at_s[last],
        )
    )
    prefetched_copies = list(issue_log)  # draft then next-layer copies; the rest are demand
    demand = [[] for _ in range(num_layers)]
    for lay, e in zip(log.layers[first].tolist(), log.experts[first].tolist()):
        if (lay, e) in prefetched_copies:
            prefetched_copies.remove((lay, e))
        else:
            demand[lay].append(e)
    assert sum(map(len, next_layer)) == (len(issue_log) - 1)  # every next-layer copy is at its layer
    if prefetch == "both":
        assert any(next_layer)  # the case has teeth: layer 0 prefetched some of layer 1's experts
    plan = CyclePlan(
        draft_ns=0,
        decision_ns=0,
        layer_compute_ns=(pre_ns + COMPUTE_NS,) * num_layers,
        layer_pre_router_ns=(pre_ns,) * num_layers,
        hits=tuple(
            tuple(int(e) for e in np.setdiff1d(union[layer], demand[layer])) for layer in range(num_layers)
        ),
        demand=tuple(tuple(d) for d in demand),
        prefetch=((1, prefetched),),
        overlap="on" if overlap else "off",
        copy_stream=True,  # with any prefetch mode the live engine enqueues the demand copies too
        late_call_ns=LATE_NS,
        next_layer=tuple(tuple(n) for n in next_layer),
        host_ns_per_transfer=host_ns,
        placing_ns_per_transfer=host_ns,  # all of it after the enqueue: the memcpys (no bookkeeping time here)
    )
    assert stats.misses == sum(len(d) for d in demand)  # the prefetched experts are hits, no misses
    assert stats.num_prefetch_issued == len(issue_log) and stats.num_prefetch_used >= 1
    marks = engine._last_state.marks
    live_starts = tuple(_ns(marks[layer][0][0] - origin + shift) for layer in range(num_layers))
    live_ends = tuple(_ns(marks[layer][0][1] - origin + shift) for layer in range(num_layers))
    assert [_ns(s) for s in stats.layer_pre_router_s] == [pre_ns] * num_layers  # measured live
    demand_enqueued = {(c[0], c[1]): c[2] for c in live_copies if c[1] in demand[c[0]]}
    assert demand_enqueued  # each demand copy enqueued once its layer's router had run
    assert all(at == live_starts[lay] + pre_ns for (lay, _), at in demand_enqueued.items())
    for sim in (
        FastEngine(LinkSpec(latency_ns=0, wire_ns=TRANSFER_NS), num_layers),
        SimPyEngine(LinkSpec(0, TRANSFER_NS), num_layers),
    ):
        sim.record_copies = True
        timing = sim.run_cycle(plan)
        assert sorted(timing.copies) == live_copies
        assert timing.layer_start_ns == live_starts and timing.layer_end_ns == live_ends
        assert timing.layer_wait_ns == tuple(_ns(s) for s in stats.layer_stall_s)
        assert timing.end_ns == _ns(stats.wall_s + shift)
    assert sum(timing.layer_wait_ns) > 0  # the cycle did wait for copies: the test has teeth
    if pre_ns:  # the copies outlasted the layer's compute after its router: a layer waited for them
        assert any(
            landed > live_starts[lay] + pre_ns + COMPUTE_NS for lay, e, _, _, landed in live_copies if e in demand[lay]
        )
    if overlap:  # computed late experts in calls of their own, none before its copy landed
        assert sum(calls.values()) > num_layers
        landed = {(lay, e): end for lay, e, _, _, end in live_copies}
        late = [(lay, e, _ns(at / 1e9 - origin + shift)) for lay, e, at in computed_at if (lay, e) in landed]
        assert late and all(at >= landed[(lay, e)] for lay, e, at in late)
    else:  # one call per layer, after every copy the layer needs has landed
        assert sum(calls.values()) == num_layers
        needed = {(lay, e): end for lay, e, _, _, end in live_copies if e in union[lay]}
        assert all(live_ends[lay] - COMPUTE_NS >= end for (lay, _), end in needed.items())
    if host_ns:  # a layer with several misses: the link started before its last miss was placed
        batches = {}  # per layer, its demand batch: the copies enqueued once its router had run
        for lay, e, enqueued, started, landed in live_copies:
            if e in demand[lay] and enqueued == live_starts[lay] + pre_ns:
                batches.setdefault(lay, []).append((enqueued, started, landed))
        several = {lay: spans for lay, spans in batches.items() if len(spans) >= 2}
        assert any(  # copying while the layer's later misses were still being placed
            min(c[1] for c in spans) < spans[0][0] + len(spans) * host_ns for spans in several.values()
        )
        assert all(c[2] >= c[0] + host_ns for spans in several.values() for c in spans)  # none before a memcpy


def test_fake_clock_link_is_fifo(monkeypatch):
    clock = FakeClock(tick_s=0.0, start_s=0.0).install(monkeypatch)
    link = _fake_clock_link()
    a = link.enqueue([[(torch.empty(2), torch.ones(2))]])
    b = link.enqueue([[(torch.empty(2), torch.ones(2))]])
    assert not b.transfer_landed(0)
    b.wait_transfer(0)
    assert a.transfer_landed(0) and _ns(clock.now_s) == 2 * TRANSFER_NS
