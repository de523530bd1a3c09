"""live.offload with overlap: copies on the link's copy stream, fetch-before-compute per expert,
per-copy spans (enqueued, started, landed) and per-layer stall; the CUDA path on a GPU only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from live_fixtures import make_cache
from test_live_offload import PROMPT, _greedy

from live.h2d import H2DLink
from live.loader import describe_moe, load_target
from live.offload import OffloadedMoE, make_link

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _overlapped(path, capacity, link=None, implementation=None, overlap=True, prefetch="none"):
    model = load_target(path)
    if implementation is not None:
        model.set_experts_implementation(implementation)
    spec = describe_moe(model)
    cache = make_cache("lru", spec.num_layers, spec.num_experts, capacity)
    link = link or make_link("cpu", bandwidth_gb_per_s=0.05)  # 6144-byte experts: ~0.12 ms each
    engine = OffloadedMoE.install(
        model, cache, link, capacity_per_layer=capacity, overlap=overlap, prefetch=prefetch
    )
    return model, engine


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_every_upstream_kernel_matches_resident_with_overlap(tiny_checkpoint, implementation):
    path = tiny_checkpoint("qwen3_moe")
    resident = load_target(path, experts_on_device=True)
    resident.set_experts_implementation(implementation)
    model, engine = _overlapped(path, capacity=3, implementation=implementation)
    want, _, _ = _greedy(resident, None, PROMPT, steps=2)
    got, _, _ = _greedy(model, engine, PROMPT, steps=2)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_no_expert_computes_before_its_copy_lands(tiny_checkpoint):
    """Every group of pairs handed to compute: resident experts first (nothing to wait for), then
    only experts whose copies have landed (checked on the copy stream's own landed flags, no
    clock); slots poisoned with NaN would show any read before landing."""
    model, engine = _overlapped(tiny_checkpoint("qwen3_moe"), capacity=2)
    for gate_up, down in [*engine.pool.persistent, engine.pool.scratch]:
        gate_up.fill_(float("nan"))
        down.fill_(float("nan"))
    groups = []
    original = engine._pairs_as_copies_land

    def watched(layer, work):
        for mask in original(layer, work):  # bool[T, K]; None: the whole layer in one call
            experts = np.unique(work.ids if mask is None else work.ids[mask.numpy()])
            landed = [fetch.transfer_landed(i) for fetch, i, e in work.waits if e in experts]
            groups.append((layer, experts, landed))
            yield mask

    engine._pairs_as_copies_land = watched
    with torch.no_grad():
        logits = model(PROMPT).logits
    assert torch.isfinite(logits).all()
    assert groups and all(all(landed) for _, _, landed in groups)
    for layer in range(engine.num_layers):
        layer_groups = [(experts, landed) for lay, experts, landed in groups if lay == layer]
        # every expert the layer needs is computed in exactly one group
        union = np.concatenate([experts for experts, _ in layer_groups])
        assert union.size == np.unique(union).size
    stats = engine.last_stats
    assert stats.misses > 0
    log = stats.transfers
    assert len(log) == 2 * stats.misses  # gate/up and down per expert
    assert np.all(log.enqueued_at_s <= log.started_at_s) and np.all(log.started_at_s <= log.landed_at_s)
    for layer in range(engine.num_layers):  # FIFO copy stream: each copy starts after the last landed
        rows = log.layers == layer
        assert np.all(log.started_at_s[rows][1:] >= log.landed_at_s[rows][:-1])
        np.testing.assert_allclose(
            log.landed_at_s[rows] - log.started_at_s[rows], log.h2d_s[rows], rtol=1e-9, atol=1e-12
        )
    assert stats.layer_stall_s.shape == (engine.num_layers,)  # how long: a timing, benchmarks/overlap.py
    # each copy's memcpy ends after its batch's enqueue, in issue order, and the copy lands no
    # sooner (landed = max(wire clock, memcpy end)): the placing after the enqueue is measured
    placed = log.placed_at_s
    assert np.all(np.isfinite(placed)) and np.all(log.enqueued_at_s <= placed) and np.all(placed <= log.landed_at_s)
    for layer in range(engine.num_layers):
        assert np.all(np.diff(placed[log.layers == layer]) >= 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_next_layer_prefetch_is_lossless_counted_and_waited_for(tiny_checkpoint, overlap):
    """Layer l+1's router on layer l's input prefetches into the cache (its policy decides what
    leaves); outputs equal the resident model's; slots poisoned with NaN show that no prefetched
    expert is read before its copy lands; issued = used + wasted + still pending."""
    path = tiny_checkpoint("qwen3_moe")
    resident = load_target(path, experts_on_device=True)
    model, engine = _overlapped(path, capacity=4, overlap=overlap, prefetch="next-layer")
    for gate_up, down in [*engine.pool.persistent, engine.pool.scratch]:
        gate_up.fill_(float("nan"))
        down.fill_(float("nan"))
    want, _, _ = _greedy(resident, None, PROMPT, steps=4)
    got, stats, _ = _greedy(model, engine, PROMPT, steps=4)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    total = sum(stats[1:], stats[0])
    issued, used, wasted = engine.ledger.counts()
    assert issued == total.num_prefetch_issued > 0 and used == total.num_prefetch_used
    assert wasted == total.num_prefetch_wasted and total.prefetch_wasted_bytes == wasted * engine.bytes_per_expert
    assert issued == used + wasted + int(engine.ledger.pending.sum())
    assert used > 0  # the next layer's router on this layer's input predicts some experts right
    log = total.transfers
    assert int(log.num_bytes.sum()) == total.h2d_bytes  # prefetch copies are in the records
    for layer in range(engine.num_layers):  # the pool mirrors the policy's cached set
        cached = [e for e in range(engine.num_experts) if engine.cache.contains(layer, e)]
        np.testing.assert_array_equal(engine.pool.resident(layer), cached)


def test_stall_is_the_whole_h2d_time_without_overlap(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    model = load_target(path)
    cache = make_cache("lru", 2, 16, 3)
    engine = OffloadedMoE.install(model, cache, make_link("cpu", 0.05), capacity_per_layer=3)
    _, stats, _ = _greedy(model, engine, PROMPT, steps=1)
    for s in stats:
        np.testing.assert_array_equal(s.layer_stall_s, s.layer_h2d_s)
        log = s.transfers
        assert np.all(log.started_at_s <= log.landed_at_s)
        assert np.all(np.isnan(log.placed_at_s))  # synchronous copies: no placing after an enqueue


def test_link_enqueue_is_fifo_and_waits_per_transfer():
    link = H2DLink("cpu", bandwidth_bytes_per_s=4e7)  # 40 kB copies: 1 ms each
    n = 10_000
    transfers = [[(torch.empty(n), torch.full((n,), float(i)))] for i in range(4)]
    first = link.enqueue(transfers[:2])
    second = link.enqueue(transfers[2:])
    second.wait_transfer(1)
    assert first.transfer_landed(0) and first.transfer_landed(1) and second.transfer_landed(0)
    for i, transfer in enumerate(transfers):
        dst, _ = transfer[0]
        assert dst[0] == i
    # the emulated link's contract, not a speed aim: it holds each batch for at least its wire
    # time (2 copies x 1 ms each; load can only lengthen it), a difference of perf_counter
    # instants equal up to float rounding (1.999999993e-3 seen), so compared within 1 ns
    assert second.seconds() >= 2e-3 - 1e-9 and first.seconds() >= 2e-3 - 1e-9
    origin = first.enqueued_at
    _, started, landed = second.copy_spans(origin)
    _, _, first_landed = first.copy_spans(origin)
    assert started[0] >= first_landed[-1]  # the second batch waited for the first
    link.synchronize()
    link.close()
    link.close()


def test_copy_stream_errors_reach_the_compute_thread():
    link = H2DLink("cpu", bandwidth_bytes_per_s=1e9)
    with pytest.raises(RuntimeError):  # shape mismatch: copy_ raises at enqueue (the memcpy is done there)
        link.enqueue([[(torch.empty(3), torch.empty(4))]])
    link.close()


def test_cpu_copy_stream_lands_on_the_fifo_link_clock(fake_clock):
    """The CPU copy stream is a clock: each copy lands at max(previous landing + bytes /
    bandwidth + latency / copies, its memcpy's end), from max(enqueue, link free); waiting for a
    transfer lets the (fake) clock run exactly to its landing, no thread involved."""
    link = H2DLink("cpu", bandwidth_bytes_per_s=1e6, latency_s=1e-4)  # 1000 B: 1 ms + 0.1 ms
    link.spin_below_s = 0.0
    expert = [(torch.empty(250), torch.ones(250)), (torch.empty(250), torch.ones(250))]  # 2 x 1000 B
    first = link.enqueue([expert, expert])
    t0 = first.enqueued_at
    second = link.enqueue([expert])
    assert not first.transfer_landed(0) and not first.done()
    second.wait_transfer(0)
    _, started, landed = second.copy_spans(t0)
    _, first_started, first_landed = first.copy_spans(t0)
    np.testing.assert_allclose(first_landed, [0.00105, 0.0021, 0.00315, 0.0042], atol=1e-6)
    np.testing.assert_allclose(landed, [0.00525, 0.0063], atol=1e-6)
    assert started[0] == first_landed[-1]  # FIFO behind the first batch
    assert fake_clock.now_s >= t0 + 0.0063 - 1e-9 and first.done() and second.done()
    np.testing.assert_allclose(first.copy_seconds(), np.diff(first_landed, prepend=0.0), atol=1e-9)
    # each memcpy's end is one read of the fake clock (a tick of 0.1 us per read) after the last
    np.testing.assert_allclose(first.placed_at(t0), 1e-7 * np.arange(1, 5), rtol=0, atol=1e-12)
    np.testing.assert_allclose(second.placed_at(second.enqueued_at), [1e-7, 2e-7], rtol=0, atol=1e-12)
    assert np.isnan(link.fetch([expert]).placed_at(t0)).all()  # synchronous: not measured


@pytest.mark.gpu
@needs_cuda
def test_cuda_overlapped_equals_resident(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    resident = load_target(path, experts_on_device=True).to("cuda")
    model, engine = _overlapped(path, capacity=3, link=H2DLink("cuda"))
    want, _, _ = _greedy(resident, None, PROMPT.cuda(), steps=3)
    got, stats, _ = _greedy(model, engine, PROMPT.cuda(), steps=3)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    total = sum(stats[1:], stats[0])
    assert total.misses > 0 and total.layer_stall_s.shape == (engine.num_layers,)
    log = stats[0].transfers
    assert np.all(log.started_at_s <= log.landed_at_s)


def _prefetch_unneeded(engine, model, prompt, hold=None):
    """Make every expert ``prompt``'s forward needs resident (no demand copy will queue behind a
    prefetch) and draft-prefetch two experts of the last layer it does not need (after calling
    ``hold()``, if given); returns the copies enqueued."""
    from specfit import bitsets

    with torch.no_grad():
        model(prompt)
    routing = engine.last_routing()[0]  # [T, L, K]
    last = engine.num_layers - 1
    for layer in range(engine.num_layers):
        engine.warm(layer, np.unique(routing[:, layer]))
    unused = [e for e in range(engine.num_experts) if e not in routing[:, last]][:2]
    predicted = np.zeros((1, engine.num_layers, 2), dtype=np.int64)
    predicted[0, :] = routing[0, :, :2]  # resident already: nothing to copy at the other layers
    predicted[0, last] = unused
    if hold is not None:
        hold()
    return engine.prefetch_predicted(bitsets.pack(predicted, engine.num_experts))


def _capacity(tiny_checkpoint_path):
    probe = load_target(tiny_checkpoint_path)
    spec = describe_moe(probe)
    engine = OffloadedMoE.install(probe, make_cache("lru", spec.num_layers, spec.num_experts, 1))
    with torch.no_grad():
        probe(PROMPT)
    routing = engine.last_routing()[0]
    return max(np.unique(routing[:, layer]).size for layer in range(spec.num_layers)) + 2


def test_prefetch_copies_in_flight_carry_into_the_next_forward(tiny_checkpoint, monkeypatch):
    """A draft prefetch nobody waits for is still crossing the link when the forward ends (fake
    clock: it lands only when the clock reaches it): the forward's records leave it out, the next
    forward's records hold it, and nothing is lost or counted twice."""
    from fake_clock import FakeClock
    from test_live_golden_cycle import TRANSFER_NS, _fake_clock_link

    path = tiny_checkpoint("qwen3_moe")
    capacity = _capacity(path)
    model = load_target(path)
    spec = describe_moe(model)
    clock = FakeClock(tick_s=0.0, start_s=0.0).install(monkeypatch)
    cache = make_cache("lru", spec.num_layers, spec.num_experts, capacity)
    engine = OffloadedMoE.install(
        model, cache, _fake_clock_link(), capacity_per_layer=capacity, prefetch="draft"
    )
    assert _prefetch_unneeded(engine, model, PROMPT) == 2
    engine.begin_forward()
    with torch.no_grad():
        model(PROMPT)
    first = engine.end_forward()
    carried = [fetch for _, fetch, _ in engine._carried]
    assert first.misses == 0 and first.h2d_bytes == 0  # the prefetch is not in this forward's records
    assert carried and all(not fetch.done() for fetch in carried)  # still in flight at the end
    clock.now_s += 2 * TRANSFER_NS / 1e9 + 1e-9  # both copies land (1 ns: float sums of the landings)
    engine.begin_forward()
    with torch.no_grad():
        model(PROMPT)
    second = engine.end_forward()
    assert second.misses == 0
    assert second.h2d_bytes == sum(fetch.num_bytes for fetch in carried) == 2 * engine.bytes_per_expert
    assert int(second.transfers.num_bytes.sum()) == second.h2d_bytes  # the carried copies are in its log
    assert not engine._carried


class _FakeCudaEvent:
    def __init__(self, landed: bool) -> None:
        self.landed = landed

    def query(self) -> bool:
        return self.landed


def test_cuda_fetch_done_queries_its_last_event_without_waiting():
    """CUDA code path without a device: ``done`` asks the batch's last event (``Event.query``),
    so a copy still on the copy stream is carried into the next forward instead of being waited
    for at the forward's end."""
    from live.h2d import H2DFetch

    events = [_FakeCudaEvent(True), _FakeCudaEvent(True), _FakeCudaEvent(False)]
    fetch = H2DFetch(16, 1, events=events, copy_bytes=np.array([8, 8]), copies_per_transfer=np.array([2]))
    assert not fetch.done()
    events[-1].landed = True
    assert fetch.done()
    assert H2DFetch(0, 0, seconds=0.0).done()


@pytest.mark.gpu
@needs_cuda
def test_cuda_copies_in_flight_carry_across_forwards(tiny_checkpoint):
    """On CUDA the end of a forward synchronises the compute stream only: a prefetch held behind a
    long kernel on the copy stream is still in flight, moves to the next forward's records, and
    nothing is lost."""
    path = tiny_checkpoint("qwen3_moe")
    model, engine = _overlapped(path, capacity=_capacity(path), link=H2DLink("cuda"), prefetch="draft")
    prompt = PROMPT.cuda()

    def hold():  # a long kernel on the copy stream keeps the prefetch behind it (about a second)
        with torch.cuda.stream(engine.link._copy_stream):
            torch.cuda._sleep(int(2e9))

    assert _prefetch_unneeded(engine, model, prompt, hold) == 2
    engine.begin_forward()
    with torch.no_grad():
        model(prompt)
    first = engine.end_forward()
    assert first.h2d_bytes == 0 and engine._carried
    assert not all(fetch.done() for _, fetch, _ in engine._carried)
    engine.link.synchronize()
    engine.begin_forward()
    with torch.no_grad():
        model(prompt)
    second = engine.end_forward()
    assert second.h2d_bytes == int(second.transfers.num_bytes.sum()) == 2 * engine.bytes_per_expert
    assert not engine._carried
