"""One hand-built cycle with overlap and a draft prefetch: the live engine's recorded spans and the
simulator's event log agree to the nanosecond, and no expert computes before its copy lands.

The live engine runs on a fake clock (tests/fake_clock.py): the copy stream is a FIFO on that
clock (each expert copy takes ``TRANSFER_NS``; waiting for a copy lets the clock run to its
landing) and each layer's resident-expert kernel call takes ``COMPUTE_NS``; everything else takes
no time. The simulator gets the same cycle as a ``CyclePlan`` (the live engine's own hits, demand
misses and prefetch) with ``overlap="on"``.
"""

from __future__ import annotations

import numpy as np
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
CAPACITY = 8


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


class _Landing:
    """``threading.Event`` stand-in: set once the fake clock reaches ``at_ns``; waiting on it
    lets the clock run to that instant."""

    def __init__(self, clock: FakeClock, at_ns: int) -> None:
        self.clock, self.at_s = clock, at_ns / 1e9

    def is_set(self) -> bool:
        return self.clock.now_s >= self.at_s

    def wait(self) -> None:
        self.clock.now_s = max(self.clock.now_s, self.at_s)


class _FakeClockLink(H2DLink):
    """The link's copy stream as a FIFO on the fake clock (no thread): a batch starts when the
    link is free, each expert takes ``TRANSFER_NS``, its copies split that time evenly."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__("cpu")
        self.clock = clock
        self.free_ns = 0

    def enqueue(self, transfers):
        fetch = self._new_fetch(transfers)
        if not fetch.num_transfers:
            return fetch
        now_ns = _ns(self.clock.now_s)
        start_ns = max(now_ns, self.free_ns)
        stamps, landings = [], []
        for i, transfer in enumerate(transfers):
            first_ns = start_ns + i * TRANSFER_NS
            for j, (dst, src) in enumerate(transfer):
                dst.copy_(src)
                stamps.append((first_ns + (j + 1) * TRANSFER_NS // len(transfer)) / 1e9)
            landings.append(_Landing(self.clock, first_ns + TRANSFER_NS))
        self.free_ns = start_ns + len(transfers) * TRANSFER_NS
        fetch._landed, fetch._done = landings, _Landing(self.clock, self.free_ns)
        fetch.enqueued_at, fetch._start, fetch._stamps = now_ns / 1e9, start_ns / 1e9, np.array(stamps)
        fetch._copy_s = np.diff(fetch._stamps, prepend=fetch._start)
        fetch._seconds = float(fetch._stamps[-1] - fetch._start)
        return fetch


def test_live_spans_equal_the_simulated_event_log_to_the_nanosecond(tiny_checkpoint, monkeypatch):
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
    clock = FakeClock(tick_s=0.0, start_s=0.0)
    cache = make_cache("lru", num_layers, spec.num_experts, CAPACITY)
    engine = OffloadedMoE.install(
        model, cache, _FakeClockLink(clock), capacity_per_layer=CAPACITY, overlap=True, prefetch="draft"
    )
    for layer in range(num_layers):  # half of each layer's experts resident: hits and misses
        engine.warm(layer, union[layer][: len(union[layer]) // 2])
    prefetched = int(union[1][-1])  # a miss of layer 1, prefetched from the "draft"
    predicted = np.array([[[union[0][0]] * spec.top_k, [prefetched] * spec.top_k]])  # [1 node, L, K]
    clock.install(monkeypatch)

    original_run = OffloadedExperts._run

    def timed_run(self, *args, **kwargs):  # the resident experts' kernel call takes COMPUTE_NS
        clock.advance(COMPUTE_NS / 1e9)
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(OffloadedExperts, "_run", timed_run)
    computed_at: list[tuple[int, int, int]] = []  # (layer, expert, clock ns) of each late expert
    original_pairs = engine._pairs_as_copies_land

    def watched(layer, work):
        flat = work.ids.reshape(-1)
        for pair_index, slot in original_pairs(layer, work):
            if slot is not None:
                computed_at.append((layer, int(flat[int(pair_index[0])]), _ns(clock.now_s)))
            yield pair_index, slot

    engine._pairs_as_copies_land = watched

    assert engine.prefetch_predicted(bitsets.pack(predicted, spec.num_experts)) == 1
    engine.begin_forward()
    with torch.no_grad():
        model(PROMPT)
    stats = engine.end_forward()

    log = stats.transfers
    first = np.r_[True, (log.layers[1:] != log.layers[:-1]) | (log.experts[1:] != log.experts[:-1])]
    last = np.r_[first[1:], True]
    live_copies = sorted(
        (int(lay), int(e), _ns(enq), _ns(start), _ns(end))
        for lay, e, enq, start, end in zip(
            log.layers[first],
            log.experts[first],
            log.enqueued_at_s[first],
            log.started_at_s[first],
            log.landed_at_s[last],
        )
    )
    demand = [
        [int(e) for e in log.experts[first & (log.layers == layer)] if (layer, int(e)) != (1, prefetched)]
        for layer in range(num_layers)
    ]
    plan = CyclePlan(
        draft_ns=0,
        decision_ns=0,
        layer_compute_ns=(COMPUTE_NS,) * num_layers,
        hits=tuple(
            tuple(int(e) for e in np.setdiff1d(union[layer], demand[layer])) for layer in range(num_layers)
        ),
        demand=tuple(tuple(d) for d in demand),
        prefetch=((1, prefetched),),
        overlap="on",
    )
    assert stats.misses == sum(len(d) for d in demand)  # the prefetched expert is a hit, no miss
    assert stats.num_prefetch_issued == 1 and stats.num_prefetch_used == 1
    marks = engine._last_state.marks
    live_starts = tuple(_ns(marks[layer][0][0]) for layer in range(num_layers))
    live_ends = tuple(_ns(marks[layer][0][1]) for layer in range(num_layers))
    for sim in (
        FastEngine(LinkSpec(latency_ns=0, wire_ns=TRANSFER_NS), num_layers),
        SimPyEngine(LinkSpec(0, TRANSFER_NS), num_layers),
    ):
        sim.record_copies = True
        timing = sim.run_cycle(plan)
        assert sorted(timing.copies) == live_copies
        assert timing.layer_start_ns == live_starts and timing.layer_end_ns == live_ends
        assert timing.layer_wait_ns == tuple(_ns(s) for s in stats.layer_stall_s)
        assert timing.end_ns == _ns(stats.wall_s)
    assert sum(timing.layer_wait_ns) > 0  # the cycle did wait for copies: the test has teeth
    landed = {(lay, e): end for lay, e, _, _, end in live_copies}
    assert computed_at and all(at >= landed[(lay, e)] for lay, e, at in computed_at)


def test_fake_clock_link_is_fifo():
    clock = FakeClock(tick_s=0.0, start_s=0.0)
    link = _FakeClockLink(clock)
    a = link.enqueue([[(torch.empty(2), torch.ones(2))]])
    b = link.enqueue([[(torch.empty(2), torch.ones(2))]])
    assert not b.transfer_landed(0)
    b.wait_transfer(0)
    assert a.transfer_landed(0) and _ns(clock.now_s) == 2 * TRANSFER_NS
