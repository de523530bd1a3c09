"""sim.engine: the cycle timeline on the compute stream and the FIFO H2D link."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from sim.engine import CyclePlan, FastEngine, LinkSpec, SimPyEngine, make_engine

LINK = LinkSpec(latency_ns=10_000, wire_ns=290_000)  # 9.4 MB expert at ~32 GB/s + 10 us


def _random_plan(
    rng: np.random.Generator,
    num_layers: int,
    *,
    overlap: bool | str,
    prefetch: bool,
    late: bool = False,
    pre_router: bool | str = False,
) -> CyclePlan:
    """A random cycle; ``pre_router``: False (no pre-router parts), True (each layer's part drawn
    in [0, 0.8) of its compute) or ``"some zero"`` (as True, then about a third of them 0)."""
    hits, demand, pre = [], [], []
    for layer in range(num_layers):
        experts = rng.permutation(32)[: rng.integers(0, 12)]
        cut = rng.integers(0, len(experts) + 1)
        hits.append(tuple(int(e) for e in experts[:cut]))
        demand.append(tuple(int(e) for e in experts[cut:]))
        if prefetch:
            pre += [(layer, int(e)) for e in rng.permutation(np.arange(32, 40))[: rng.integers(0, 3)]]
            # a prefetched expert that the layer then needs: counted as a hit that must arrive
            if pre and pre[-1][0] == layer and rng.random() < 0.7:
                hits[-1] = (*hits[-1], pre[-1][1])
    next_layer = [() for _ in range(num_layers)]
    if prefetch:  # next-layer prefetch: layer l+1's copies enqueued at layer l, some then needed
        for layer in range(num_layers - 1):
            next_layer[layer] = tuple(int(e) for e in rng.permutation(np.arange(40, 48))[: rng.integers(0, 3)])
            if next_layer[layer] and rng.random() < 0.7:
                hits[layer + 1] = (*hits[layer + 1], next_layer[layer][0])
    compute = tuple(int(x) for x in rng.integers(50_000, 400_000, num_layers))
    transfer_ns = LINK.latency_ns + LINK.wire_ns  # one copy alone on the link
    # placing (host_ns per miss) from none to twice a copy: the link idles between batches, and
    # with copy_stream the copies follow their placing (rev2 finding 4)
    host_ns = int(rng.integers(0, 2 * transfer_ns + 50_000)) if late else 0
    placing_ns = (0, host_ns, int(rng.integers(0, host_ns + 1)))[int(rng.integers(0, 3))] if late else 0
    return CyclePlan(
        host_ns_per_transfer=host_ns,
        placing_ns_per_transfer=placing_ns,
        copy_stream=bool(rng.random() < 0.5) if late else None,
        draft_ns=int(rng.integers(0, 5_000_000)),
        decision_ns=int(rng.integers(0, 50_000)),
        layer_compute_ns=compute,
        layer_pre_router_ns=_pre_router_parts(rng, compute, pre_router),
        hits=tuple(hits),
        demand=tuple(demand),
        prefetch=tuple(pre),
        overlap=overlap,
        late_call_ns=int(rng.integers(0, 600_000)) if late else 0,
        next_layer=tuple(next_layer),
    )


def _pre_router_parts(rng: np.random.Generator, compute: tuple[int, ...], how: bool | str) -> tuple[int, ...]:
    if not how:
        return ()
    parts = [int(c * rng.uniform(0.0, 0.8)) for c in compute]
    if how == "some zero":  # only some layers' parts 0: the plan still has pre-router parts
        parts = [0 if rng.random() < 0.35 else p for p in parts]
    return tuple(parts)


def test_serial_cycle_equals_the_analytic_formula_exactly() -> None:
    plan = CyclePlan(
        draft_ns=3_000_000,
        decision_ns=0,
        layer_compute_ns=(100_000, 200_000, 300_000),
        hits=((1, 2), (), (5,)),
        demand=((3,), (0, 4, 7), ()),
    )
    for engine in (FastEngine(LINK, 3), SimPyEngine(LINK, 3)):
        timing = engine.run_cycle(plan)
        assert timing.cycle_ns == 3_000_000 + 600_000 + 4 * 300_000
        assert timing.layer_h2d_ns == (300_000, 900_000, 0)
        assert timing.layer_start_ns == (3_300_000, 4_300_000, 4_500_000)
        assert timing.stall_ns == 4 * 300_000
        assert timing.num_transfers == 4


def test_overlap_pipelines_transfers_of_later_layers_behind_compute() -> None:
    # layer 0 computes 1 ms while layer 1's two copies (0.6 ms) proceed: no stall for layer 1
    plan = CyclePlan(0, 0, (1_000_000, 1_000_000), hits=((), ()), demand=((), (1, 2)), overlap=True)
    serial = CyclePlan(0, 0, (1_000_000, 1_000_000), hits=((), ()), demand=((), (1, 2)), overlap=False)
    for cls in (FastEngine, SimPyEngine):
        assert cls(LINK, 2).run_cycle(plan).cycle_ns == 2_000_000
        assert cls(LINK, 2).run_cycle(serial).cycle_ns == 2_600_000


@pytest.mark.parametrize("overlap", [False, True, "on"])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("late", [False, True])  # placing on the compute stream, late-expert calls
@pytest.mark.parametrize("pre_router", [False, True, "some zero"])  # attention + router before the copies
def test_fast_engine_matches_simpy_to_the_nanosecond(overlap: bool, prefetch: bool, late: bool, pre_router: bool | str) -> None:
    rng = np.random.default_rng(7)
    fast, ref = FastEngine(LINK, 6), SimPyEngine(LINK, 6)
    for _ in range(30):  # persistent state: prefetch copies still in flight cross cycle boundaries
        plan = _random_plan(rng, 6, overlap=overlap, prefetch=prefetch, late=late, pre_router=pre_router)
        a, b = fast.run_cycle(plan), ref.run_cycle(plan)
        assert a == b
        assert fast.now_ns == ref.now_ns


def test_overlapped_cycle_lies_between_the_bound_and_the_serial_value() -> None:
    rng = np.random.default_rng(3)
    for _ in range(40):
        plan = _random_plan(rng, 8, overlap=True, prefetch=False)
        serial = CyclePlan(**{**plan.__dict__, "overlap": False})
        t_over = FastEngine(LINK, 8).run_cycle(plan).cycle_ns
        t_serial = FastEngine(LINK, 8).run_cycle(serial).cycle_ns
        h2d = sum(len(d) for d in plan.demand) * LINK.transfer_ns
        verify = sum(plan.layer_compute_ns)
        bound = plan.draft_ns + plan.decision_ns + max(verify, h2d)
        assert bound <= t_over <= t_serial
        assert t_serial == plan.draft_ns + plan.decision_ns + verify + h2d


def test_prefetched_expert_is_usable_only_after_its_copy_arrives() -> None:
    plan = CyclePlan(
        draft_ns=0,
        decision_ns=0,
        layer_compute_ns=(100,),
        hits=((9,),),  # expert 9 is resident (prefetched) but still crossing
        demand=((),),
        prefetch=((0, 9), (0, 8)),
    )
    for cls in (FastEngine, SimPyEngine):
        engine = cls(LINK, 1)
        timing = engine.run_cycle(plan)
        assert timing.layer_start_ns == (LINK.transfer_ns,)
        # expert 8 (not needed) is still in flight at the cycle's end and delays the next copies
        assert engine.in_flight(0) == frozenset({8})
        nxt = engine.run_cycle(CyclePlan(0, 0, (100,), hits=((),), demand=((3,),)))
        assert nxt.layer_start_ns == (3 * LINK.transfer_ns,)


def test_concurrent_copies_overlap_latency_but_share_the_wire() -> None:
    link = LinkSpec(latency_ns=1_000, wire_ns=4_000, concurrency=2)
    plan = CyclePlan(0, 0, (0,), hits=((),), demand=((1, 2, 3),))
    timing = SimPyEngine(link, 1).run_cycle(plan)
    # engine A: lat 0-1k, wire 1k-5k; engine B: lat 0-1k, wire 5k-9k; A: lat 5k-6k, wire 9k-13k
    assert timing.cycle_ns == 13_000
    assert SimPyEngine(LinkSpec(1_000, 4_000), 1).run_cycle(plan).cycle_ns == 15_000


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="LinkSpec.wire_ns"):
        LinkSpec(latency_ns=0, wire_ns=-1)
    with pytest.raises(ValueError, match="concurrency"):
        FastEngine(LinkSpec(0, 1, concurrency=2), 1)
    with pytest.raises(ValueError, match="engine: expected one of"):
        make_engine("warp", LINK, 1)
    with pytest.raises(ValueError, match="one entry per layer"):
        FastEngine(LINK, 2).run_cycle(CyclePlan(0, 0, (1, 1), hits=((),), demand=((), ())))
    plan = CyclePlan(0, 0, (1,), hits=((),), demand=((3,),), host_ns_per_transfer=20)
    for placing in (10.7, True, -1, 21, "5"):  # a float was truncated, True taken as 1 ns
        bad = dataclasses.replace(plan, placing_ns_per_transfer=placing)
        for engine in (FastEngine(LINK, 1), SimPyEngine(LINK, 1)):
            with pytest.raises(ValueError, match="CyclePlan.placing_ns_per_transfer: expected an int"):
                engine.run_cycle(bad)
    for stream in ("no", 1, 0.0):  # "no" was taken as True
        bad = dataclasses.replace(plan, copy_stream=stream)
        for engine in (FastEngine(LINK, 1), SimPyEngine(LINK, 1)):
            with pytest.raises(ValueError, match="CyclePlan.copy_stream: expected True, False or None"):
                engine.run_cycle(bad)
    good = [dataclasses.replace(plan, placing_ns_per_transfer=p, copy_stream=c) for p, c in ((np.int64(10), np.bool_(True)), (10, True))]
    assert FastEngine(LINK, 1).run_cycle(good[0]) == FastEngine(LINK, 1).run_cycle(good[1])
    assert isinstance(make_engine("auto", LinkSpec(0, 1, concurrency=2), 1), SimPyEngine)
    assert isinstance(make_engine("auto", LINK, 1), FastEngine)


GOLDEN_LINK = LinkSpec(latency_ns=100, wire_ns=200)  # one expert copy: 300 ns


@pytest.mark.parametrize(
    ("mode", "starts", "ends", "waits"),
    [
        # "on" (the live engine's --overlap on): layer 0 computes its resident experts 600-800
        # while its copies land at 1200 and 1500, waits until 1500; layer 1's demand copy is
        # enqueued when it starts (its router has run): 1500-1800, its compute ends at 1700
        ("on", (600, 1500), (1500, 1800), (700, 100)),
        # "off": a layer computes only once all its copies landed; layer 1's copy starts at 1700
        ("off", (1500, 2000), (1700, 2200), (0, 0)),
        # "ideal" (bound): as "on" with every demand copy enqueued at verification start; here
        # the link is busy until 1800 either way, so it equals "on"
        ("ideal", (600, 1500), (1500, 1800), (700, 100)),
    ],
)
def test_golden_cycle_with_prefetch_per_overlap_mode(mode, starts, ends, waits) -> None:
    """A hand-built cycle: draft 0-500, decision 500-600, the prefetch of (1, 7) on the link
    600-900 (FIFO first), demand (0, 3), (0, 4) of layer 0 and (1, 5) of layer 1; each layer
    computes 200 ns. Both engines give this timeline to the nanosecond, and no layer ends before
    every copy it needs has landed."""
    plan = CyclePlan(
        draft_ns=500,
        decision_ns=100,
        layer_compute_ns=(200, 200),
        hits=((), (7,)),
        demand=((3, 4), (5,)),
        prefetch=((1, 7),),
        overlap=mode,
    )
    logs = []
    for engine in (FastEngine(GOLDEN_LINK, 2), SimPyEngine(GOLDEN_LINK, 2)):
        engine.record_copies = True
        timing = engine.run_cycle(plan)
        logs.append(timing.event_log())
        assert timing.copies[0] == (1, 7, 600, 600, 900)  # the prefetch goes first
        assert (timing.start_ns, timing.draft_end_ns, timing.verify_start_ns) == (0, 500, 600)
        assert timing.layer_start_ns == starts and timing.layer_end_ns == ends
        assert timing.layer_wait_ns == waits
        assert timing.layer_h2d_ns == (600, 600) and timing.num_transfers == 4
        assert timing.end_ns == ends[-1]
    assert logs[0] == logs[1]  # same event log from both engines, to the nanosecond
    for phase, start, _ in logs[0]:  # no layer computes before its copies land (on/ideal: the
        if phase[0] == "compute" and mode == "off":  # late experts compute at the layer's end)
            layer = phase[1]
            landed = [end for p, _, end in logs[0] if p[0] == "h2d" and p[1] == layer]
            assert all(t <= start for t in landed)


def test_bad_overlap_mode_is_refused() -> None:
    plan = CyclePlan(0, 0, (1,), hits=((),), demand=((),), overlap="sometimes")
    with pytest.raises(ValueError, match="CyclePlan.overlap"):
        FastEngine(GOLDEN_LINK, 1).run_cycle(plan)


def test_cost_model_overlap_on_equals_the_simulated_cycle_on_an_idle_link() -> None:
    """specfit.cost's overlap mode "on" (sum over layers of max(compute_l, h2d_l)) is the
    simulator's "on" timeline exactly when nothing else is on the link; "ideal" is a bound below."""
    from specfit.cost import CycleCostModel

    cost = CycleCostModel(
        draft_s_per_level=1e-4, verify_base_s=6e-4, verify_s_per_node=0.0, verify_s_per_context_token=0.0,
        h2d_bytes_per_s=1e9, h2d_s_per_transfer=1e-4, expert_bytes=200_000, num_layers=3,
        overlap_h2d=True, overlap_mode="on",
    )  # fmt: skip
    misses = (0, 1, 3)
    plan = CyclePlan(100_000, 0, (200_000,) * 3, hits=((), (), ()), demand=((), (1,), (2, 3, 4)), overlap="on")
    link = LinkSpec(latency_ns=100_000, wire_ns=200_000)
    for engine in (FastEngine(link, 3), SimPyEngine(link, 3)):
        assert engine.run_cycle(plan).cycle_ns == 1_500_000
    assert cost.cycle_s(1, 1, 0, misses) == pytest.approx(1.5e-3, rel=1e-12)
    ideal = dataclasses.replace(cost, overlap_mode="ideal")
    assert ideal.cycle_s(1, 1, 0, misses) == pytest.approx(1e-4 + 1.2e-3, rel=1e-12)
    loaded = CycleCostModel.from_dict(cost.to_dict())
    assert loaded == cost
    legacy = {k: v for k, v in cost.to_dict().items() if k != "overlap_mode"}
    assert CycleCostModel.from_dict(legacy).overlap_mode == "ideal"  # files before the field


def test_late_experts_landing_together_take_one_call_and_placing_stalls() -> None:
    """Overlap "on" with placing (20 per miss) and late-expert calls (50): layer 0 places its 3
    misses 0-60, enqueues them (land at 360, 660, 960 on a 300-per-copy link) and computes its
    resident experts 60-460; copy 1 landed: one call 460-510; wait for copy 2 (660), call
    660-710; copy 3 at 960, call 960-1010. With a compute of 1000 the three land by 1060 and one
    call takes them all: 1060-1110. The cost model's "on" form gives the second case exactly."""
    from specfit.cost import CycleCostModel

    link = LinkSpec(latency_ns=0, wire_ns=300)
    for compute, end, wait in ((400, 1010, 60 + 150 + 250), (1000, 1110, 60)):
        plan = CyclePlan(0, 0, (compute,), hits=((9,),), demand=((1, 2, 3),), overlap="on",
                         host_ns_per_transfer=20, late_call_ns=50)  # fmt: skip
        for engine in (FastEngine(link, 1), SimPyEngine(link, 1)):
            timing = engine.run_cycle(plan)
            assert timing.layer_start_ns == (0,) and timing.layer_end_ns == (end,)
            assert timing.layer_wait_ns == (wait,)
        off = CyclePlan(**{**plan.__dict__, "overlap": "off"})
        for engine in (FastEngine(link, 1), SimPyEngine(link, 1)):  # serial: placing, copies, compute
            assert engine.run_cycle(off).end_ns == 60 + 900 + compute
    cost = CycleCostModel(
        draft_s_per_level=0.0, verify_base_s=1000e-9, verify_s_per_node=0.0, verify_s_per_context_token=0.0,
        h2d_bytes_per_s=1e9, h2d_s_per_transfer=20e-9, host_s_per_transfer=20e-9, expert_bytes=300,
        num_layers=1, overlap_h2d=True, overlap_mode="on", late_call_s=50e-9,
    )  # fmt: skip
    assert cost.link_s_per_transfer == pytest.approx(300e-9, rel=1e-12)
    assert cost.cycle_s(0, 1, 0, (3,)) == pytest.approx(1110e-9, rel=1e-12)
    assert cost.cycle_s(0, 1, 0, (0,)) == pytest.approx(1000e-9, rel=1e-12)  # no miss: no late call


@pytest.mark.parametrize("mode", ["off", "on"])
def test_next_layer_copies_go_behind_the_layers_demand_at_the_live_engines_point(mode) -> None:
    """Layer 0 misses expert 1 and prefetches expert 5 of layer 1, which layer 1 then needs: the
    prefetch is enqueued right behind layer 0's demand once its router has run (overlap on) or
    when layer 0 starts computing after its copy landed (overlap off, as live.offload waits before
    issuing it); layer 1 waits for it."""
    t = LINK.transfer_ns
    plan = CyclePlan(
        draft_ns=0,
        decision_ns=0,
        layer_compute_ns=(100_000, 100_000),
        hits=((), (5,)),
        demand=((1,), ()),
        overlap=mode,
        next_layer=((5,), ()),
    )
    for engine in (FastEngine(LINK, 2), SimPyEngine(LINK, 2)):
        engine.record_copies = True
        timing = engine.run_cycle(plan)
        enqueued = 0 if mode == "on" else t
        assert timing.copies == ((0, 1, 0, 0, t), (1, 5, enqueued, t, 2 * t))
        assert timing.layer_h2d_ns == (t, t) and timing.num_transfers == 2
        assert timing.layer_start_ns[1] >= 2 * t or timing.layer_end_ns[1] >= 2 * t  # waited for it
        assert timing.end_ns == (2 * t + 100_000 if mode == "off" else 2 * t)


def test_next_layer_plan_needs_one_entry_per_layer() -> None:
    with pytest.raises(ValueError, match="next_layer"):
        FastEngine(LINK, 2).run_cycle(
            CyclePlan(0, 0, (1, 1), ((), ()), ((), ()), next_layer=((), (3,)))
        )


@pytest.mark.parametrize(
    ("mode", "enqueued", "ends"),
    [("on", 40_000, (320_000, 620_000)), ("off", 340_000, (440_000, 740_000))],
)
def test_prefetch_copies_are_placed_on_the_compute_stream_like_misses(mode, enqueued, ends) -> None:
    """With 20 us placing per copy (the live engine places and enqueues prefetches on the compute
    thread): layer 0 places its miss (0-20 us), then its next-layer copy of layer 1 (20-40 us with
    overlap on; after the wait for its miss, 320-340 us, with overlap off) before computing; a
    draft prefetch delays the forward's start by its placing."""
    link = LinkSpec(latency_ns=0, wire_ns=300_000)
    plan = CyclePlan(
        0, 0, (100_000, 100_000), hits=((), (5,)), demand=((1,), ()), overlap=mode,
        host_ns_per_transfer=20_000, next_layer=((5,), ()),
    )  # fmt: skip
    for engine in (FastEngine(link, 2), SimPyEngine(link, 2)):
        engine.record_copies = True
        timing = engine.run_cycle(plan)
        assert timing.copies[1][:3] == (1, 5, enqueued) and timing.layer_end_ns == ends
    draft = CyclePlan(0, 0, (100_000,), hits=((7,),), demand=((),), prefetch=((0, 7), (0, 8)),
                      overlap=mode, host_ns_per_transfer=20_000)  # fmt: skip
    for engine in (FastEngine(link, 1), SimPyEngine(link, 1)):
        engine.record_copies = True
        timing = engine.run_cycle(draft)
        assert timing.copies[0][:4] == (0, 7, 40_000, 40_000)  # both placed (0-40 us), then enqueued
        assert timing.end_ns == 340_000 + (0 if mode == "on" else 100_000)  # waits for expert 7


@pytest.mark.parametrize("overlap", ["off", "on", "ideal"])
@pytest.mark.parametrize("pre_router", [False, True, "some zero"])
def test_idle_link_fast_path_equals_the_loop(overlap: str, pre_router: bool | str) -> None:
    """FastEngine's closed form for cycles that start on an idle link (no prefetch, nothing in
    flight) gives the loop's timings to the nanosecond, field by field (layer starts and waits
    included, also when only some layers' pre-router parts are 0), across cycles that need the
    loop (prefetches still in flight) and with a host placing cost per miss."""
    rng = np.random.default_rng(11)
    fast, loop = FastEngine(LINK, 6), FastEngine(LINK, 6)
    loop.vectorised = False
    used = 0
    for k in range(60):
        plan = _random_plan(rng, 6, overlap=overlap, prefetch=k % 7 == 3, pre_router=pre_router)
        plan = dataclasses.replace(
            plan,
            host_ns_per_transfer=int(rng.integers(0, 40_000)) * (k % 2),
            demand_counts=[len(d) for d in plan.demand] if k % 3 else None,
        )
        used += not plan.prefetch and not any(fast._pending) and fast._link_free_ns <= fast.now_ns
        a, b = fast.run_cycle(plan), loop.run_cycle(plan)
        assert a == b
        # the sums the compiled path hands over are the timings' own (the loop's are summed)
        assert (a.busy_ns, a.h2d_ns) == (b.busy_ns, b.h2d_ns) == (
            sum(b.layer_end_ns) - sum(b.layer_start_ns) - sum(b.layer_wait_ns),
            sum(b.layer_h2d_ns),
        )
        assert (fast.now_ns, fast._link_free_ns) == (loop.now_ns, loop._link_free_ns)
        # the engines' flag for "a copy in flight" (what the fast path tests) is any(_pending)'s
        assert fast._any_pending == any(fast._pending) and loop._any_pending == any(loop._pending)
    assert used > 30


@pytest.mark.parametrize("mode", ["off", "on"])
def test_demand_copies_are_enqueued_once_the_layers_router_has_run(mode) -> None:
    """A layer computing 400 (attention + router 150 of it, then its experts 250) with two misses
    of 300 each: the copies are enqueued at 150, when the router has run, not at the layer's start
    (the live engine knows the layer's experts only then), so with overlap they land at 450 and
    750 and the layer ends at 750 (idealised "enqueued at the start": 600); serially the experts
    start after them, at 750, and end at 1000. The cost model's "on" form prices the same."""
    from specfit.cost import CycleCostModel

    link = LinkSpec(latency_ns=0, wire_ns=300)
    plan = CyclePlan(0, 0, (400,), hits=((9,),), demand=((1, 2),), overlap=mode, layer_pre_router_ns=(150,))
    for engine in (FastEngine(link, 1), SimPyEngine(link, 1)):
        engine.record_copies = True
        timing = engine.run_cycle(plan)
        assert [c[2] for c in timing.copies] == [150, 150]  # enqueued after the router
        assert [c[4] for c in timing.copies] == [450, 750]
        assert timing.layer_start_ns == (0,)
        assert timing.layer_end_ns == ((750,) if mode == "on" else (1000,))
        assert timing.layer_wait_ns == ((750 - 400,) if mode == "on" else (600,))
    at_start = CyclePlan(0, 0, (400,), hits=((9,),), demand=((1, 2),), overlap=mode)
    assert FastEngine(link, 1).run_cycle(at_start).end_ns == (600 if mode == "on" else 1000)
    cost = CycleCostModel(
        draft_s_per_level=0.0, verify_base_s=400e-9, verify_s_per_node=0.0, verify_s_per_context_token=0.0,
        h2d_bytes_per_s=1e9, h2d_s_per_transfer=0.0, expert_bytes=300, num_layers=1,
        overlap_h2d=mode == "on", overlap_mode="on", pre_router_fraction=150 / 400,
    )  # fmt: skip
    assert cost.cycle_s(0, 1, 0, (2,)) == pytest.approx((750 if mode == "on" else 1000) * 1e-9, rel=1e-12)
    with pytest.raises(ValueError, match="layer_pre_router_ns"):
        FastEngine(link, 1).run_cycle(dataclasses.replace(plan, layer_pre_router_ns=(401,)))


def test_cost_model_overlap_on_with_pre_router_equals_the_simulated_cycle_on_an_idle_link() -> None:
    """With ``pre_router_fraction`` the cost model's "on" form (per layer: placing + max(compute,
    pre-router + copies) + late call) equals the simulator's "on" timeline on an idle link to the
    nanosecond, for random miss counts (copies landing one by one: transfer >= late call)."""
    from specfit.cost import CycleCostModel

    rng = np.random.default_rng(5)
    for _ in range(20):
        frac = float(rng.choice([0.0, 0.25, 0.5, 1.0]))
        cost = CycleCostModel(
            draft_s_per_level=0.0, verify_base_s=800e-9, verify_s_per_node=0.0, verify_s_per_context_token=0.0,
            h2d_bytes_per_s=1e9, h2d_s_per_transfer=40e-9, host_s_per_transfer=20e-9, expert_bytes=100,
            num_layers=4, overlap_h2d=True, overlap_mode="on", late_call_s=10e-9, pre_router_fraction=frac,
        )  # fmt: skip
        misses = rng.integers(0, 5, 4)
        demand = tuple(tuple(range(int(m))) for m in misses)
        plan = CyclePlan(0, 0, (200,) * 4, hits=((),) * 4, demand=demand, overlap="on",
                         host_ns_per_transfer=20, late_call_ns=10, layer_pre_router_ns=(int(200 * frac),) * 4)  # fmt: skip
        link = LinkSpec(latency_ns=20, wire_ns=100)
        for engine in (FastEngine(link, 4), SimPyEngine(link, 4)):
            assert engine.run_cycle(plan).cycle_ns * 1e-9 == pytest.approx(cost.cycle_s(0, 1, 0, misses), rel=1e-9)


@pytest.mark.parametrize("placing_ns", [0, 10, 20, 120, 400])
def test_cost_model_prices_the_placing_after_the_enqueue_as_the_simulated_cycle(placing_ns) -> None:
    """Issue 13 item 3: with ``placing_after_enqueue_s_per_transfer = P`` the "on" form (per layer
    ``host m + max(c, p c + m max(T_link - P, 0))`` plus the late call while ``T_link > P``)
    equals the simulator's timeline with ``placing_ns_per_transfer = P`` on an idle link, to the
    nanosecond, either side of the late call's step at ``P = T_link`` (120 ns here); the form
    without the term (P = 0) over-prices the copy-bound layers by ``P`` per miss."""
    from specfit.cost import CycleCostModel

    rng = np.random.default_rng(7)
    host_ns = max(20, placing_ns)
    over = 0
    for _ in range(20):
        frac = float(rng.choice([0.0, 0.25, 0.5, 1.0]))
        cost = CycleCostModel(
            draft_s_per_level=0.0, verify_base_s=800e-9, verify_s_per_node=0.0, verify_s_per_context_token=0.0,
            h2d_bytes_per_s=1e9, h2d_s_per_transfer=(20 + host_ns) * 1e-9, host_s_per_transfer=host_ns * 1e-9,
            expert_bytes=100, num_layers=4, overlap_h2d=True, overlap_mode="on", late_call_s=10e-9,
            pre_router_fraction=frac, placing_after_enqueue_s_per_transfer=placing_ns * 1e-9,
        )  # fmt: skip
        misses = rng.integers(0, 5, 4)
        demand = tuple(tuple(range(int(m))) for m in misses)
        plan = CyclePlan(0, 0, (200,) * 4, hits=((),) * 4, demand=demand, overlap="on", host_ns_per_transfer=host_ns,
                         late_call_ns=10, layer_pre_router_ns=(int(200 * frac),) * 4,
                         placing_ns_per_transfer=placing_ns)  # fmt: skip
        link = LinkSpec(latency_ns=20, wire_ns=100)
        price_s = cost.cycle_s(0, 1, 0, misses)
        for engine in (FastEngine(link, 4), SimPyEngine(link, 4)):
            assert engine.run_cycle(plan).cycle_ns * 1e-9 == pytest.approx(price_s, rel=1e-9)
        without = dataclasses.replace(cost, placing_after_enqueue_s_per_transfer=0.0).cycle_s(0, 1, 0, misses)
        assert without >= price_s * (1 - 1e-12)
        over += without > price_s * (1 + 1e-9)
    assert (over > 0) == (placing_ns > 0)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_cost_models_draft_prefetch_pipeline_equals_the_simulated_cycle(mode) -> None:
    """``CycleCostModel.prefetched_cycle_s`` (the planner's price of a subtree whose predicted
    misses are prefetched from the draft) is the simulator's timeline of that prefetch on an idle
    link, every miss predicted: placing before the forward, copies in layer order from its start,
    each layer's experts after its router and its copies (without late calls: their grouping is
    the simulator's)."""
    from specfit.cost import CycleCostModel

    rng = np.random.default_rng(9)
    for _ in range(30):
        frac = float(rng.choice([0.0, 0.5, 1.0]))
        cost = CycleCostModel(
            draft_s_per_level=0.0, verify_base_s=800e-9, verify_s_per_node=0.0, verify_s_per_context_token=0.0,
            h2d_bytes_per_s=1e9, h2d_s_per_transfer=float(rng.choice([40e-9, 200e-9])), host_s_per_transfer=20e-9,
            expert_bytes=100, num_layers=4, overlap_h2d=mode == "on", overlap_mode="on", pre_router_fraction=frac,
            draft_prefetch=True,
        )  # fmt: skip
        misses = rng.integers(0, 4, 4)
        prefetch = tuple((layer, e) for layer in range(4) for e in range(int(misses[layer])))
        hits = tuple(tuple(range(int(m))) for m in misses)
        link_ns = round(cost.link_s_per_transfer * 1e9)
        plan = CyclePlan(0, 0, (200,) * 4, hits=hits, demand=((),) * 4, prefetch=prefetch, overlap=mode,
                         host_ns_per_transfer=20, layer_pre_router_ns=(int(200 * frac),) * 4)  # fmt: skip
        for engine in (FastEngine(LinkSpec(0, link_ns), 4), SimPyEngine(LinkSpec(0, link_ns), 4)):
            simulated = engine.run_cycle(plan).cycle_ns * 1e-9
            assert simulated == pytest.approx(cost.prefetched_cycle_s(0, 1, 0, misses), rel=1e-9)


@pytest.mark.parametrize(("mode", "wire_ns", "pre_ns"), [("off", 100, 0), ("on", 100, 300), ("on", 300, 300)])
def test_next_layer_price_against_the_simulated_cycle(mode, wire_ns, pre_ns) -> None:
    """The cost model's next-layer term (``cycle_s_layers`` with the share and waste fitted from
    the cycle's own counts) against the engine's timeline of next-layer prefetch: 4 layers of 1 us
    compute, 4 misses each; layers 1-3 had 2 of them and 1 wrong guess copied during the layer
    before (layer 0 has no guess). Fitted share 6/12, waste 3/12 (of layers 1-3's 12 planner
    misses; layer 0 priced without). The price is the simulated cycle exactly: without overlap
    while the guesses fit their one-layer window, with overlap compute-bound and link-bound
    alike. (With the share averaged over every layer, 6/16 and 3/16 spread over layer 0 too, it
    was 150 ns over without overlap and 75 ns over link-bound.)"""
    from calibration.costfit import fit_next_layer_terms
    from specfit.cost import CycleCostModel

    demand = ((0, 1, 2, 3),) + ((2, 3),) * 3  # layers 1-3: experts 0, 1 prefetched (hits in flight)
    hits = ((),) + ((0, 1),) * 3
    next_layer = ((0, 1, 9),) * 3 + ((),)  # layer l's guesses for layer l+1: 2 used, 1 wasted (9)
    plan = CyclePlan(0, 0, (1000,) * 4, hits=hits, demand=demand, next_layer=next_layer, overlap=mode,
                     layer_pre_router_ns=(pre_ns,) * 4)  # fmt: skip
    counts = pd.DataFrame(
        {"cache_misses": [10], "num_prefetch_used": [6], "num_prefetch_wasted": [3], "layer_misses": [[4, 2, 2, 2]]}
    )
    fit = fit_next_layer_terms(counts)
    assert (fit.cover_fraction, fit.waste_per_miss) == (6 / 12, 3 / 12)
    cost = CycleCostModel(
        0.0, 4000e-9, 0.0, 0.0, 1e9, 0.0, wire_ns, 4, overlap_h2d=mode == "on", overlap_mode="on",
        pre_router_fraction=pre_ns / 1000, next_layer_prefetch=True, next_layer_cover_fraction=fit.cover_fraction,
        next_layer_waste_per_miss=fit.waste_per_miss,
    )  # fmt: skip
    price_ns = cost.cycle_s_layers(0, 1, 0, np.full(4, 4.0)) * 1e9
    for engine in (FastEngine(LinkSpec(0, wire_ns), 4), SimPyEngine(LinkSpec(0, wire_ns), 4)):
        simulated_ns = engine.run_cycle(plan).cycle_ns
        assert price_ns == pytest.approx(simulated_ns, abs=1e-6), engine


def test_the_copy_stream_copies_while_the_rest_of_its_batch_is_placed() -> None:
    """Issue 13 item 3: the live copy stream starts at the enqueue and copies while the compute
    stream places the batch's later misses (``live.h2d.H2DLink.enqueue``: the CPU memcpys run
    after the link clock started, each copy landing no sooner than its own memcpy).
    ``placing_ns_per_transfer`` = the whole placing (20 per miss): layer 0 enqueues its 3 misses
    once its router has run (at 0) and places them 0-60 while the link copies them (land at 300,
    600, 900), computes its resident experts 60-460; copy 1 landed: one call 460-510; wait for
    copy 2 (600), call 600-650; copy 3 at 900, call 900-950 (placing before the enqueue: 1010,
    ``test_late_experts_landing_together_take_one_call_and_placing_stalls``). Overlap "off"
    without a copy stream (the live engine's synchronous fetch) places all three, then copies
    them (1360); with one (any prefetch mode live) they land 300-900, then compute (1300). A
    placing of 200 per miss, longer than a copy: each lands as its placing ends (200, 400, 600)."""
    link = LinkSpec(latency_ns=0, wire_ns=300)
    plan = CyclePlan(0, 0, (400,), hits=((9,),), demand=((1, 2, 3),), overlap="on", host_ns_per_transfer=20,
                     late_call_ns=50, placing_ns_per_transfer=20)  # fmt: skip
    for engine in (FastEngine(link, 1), SimPyEngine(link, 1)):
        engine.record_copies = True
        timing = engine.run_cycle(plan)
        assert timing.layer_end_ns == (950,) and timing.layer_wait_ns == (60 + 90 + 250,)
        assert [c[2:] for c in timing.copies] == [(0, 0, 300), (0, 300, 600), (0, 600, 900)]
    off = CyclePlan(**{**plan.__dict__, "overlap": "off"})
    streamed = CyclePlan(**{**off.__dict__, "copy_stream": True})
    slow = CyclePlan(**{**plan.__dict__, "host_ns_per_transfer": 200, "placing_ns_per_transfer": 200})
    half = CyclePlan(**{**plan.__dict__, "placing_ns_per_transfer": 10})  # 10 before the enqueue, 10 after
    for engine_cls in (FastEngine, SimPyEngine):
        assert engine_cls(link, 1).run_cycle(off).end_ns == 60 + 900 + 400
        assert engine_cls(link, 1).run_cycle(streamed).end_ns == 900 + 400
        engine = engine_cls(link, 1)
        engine.record_copies = True
        assert [c[4] for c in engine.run_cycle(slow).copies] == [300, 600, 900]
        engine = engine_cls(link, 1)
        engine.record_copies = True
        assert [c[2:] for c in engine.run_cycle(half).copies] == [(30, 30, 330), (30, 330, 630), (30, 630, 930)]
    for engine_cls in (FastEngine, SimPyEngine):  # placing longer than a copy: each lands as its placing ends
        slow = CyclePlan(0, 0, (400,), hits=((9,),), demand=((1, 2, 3),), overlap="on", host_ns_per_transfer=400,
                         placing_ns_per_transfer=400)  # fmt: skip
        engine = engine_cls(link, 1)
        engine.record_copies = True
        timing = engine.run_cycle(slow)
        assert [c[4] for c in timing.copies] == [400, 800, 1200] and timing.end_ns == 1200 + 400
    with pytest.raises(ValueError, match="placing_ns_per_transfer"):
        FastEngine(link, 1).run_cycle(CyclePlan(**{**plan.__dict__, "placing_ns_per_transfer": 21}))


@pytest.mark.parametrize("overlap", [False, "on"])
@pytest.mark.parametrize("late", [False, True])
def test_both_engines_log_each_copy_in_the_cycle_that_enqueued_it(overlap, late) -> None:
    """With record_copies both engines log each copy in the cycle that enqueued it, with its
    landing, in enqueue order: also a prefetch still in flight at the cycle's end (SimPyEngine
    logged those in the cycle they landed in, rev2 finding 3)."""
    rng = np.random.default_rng(11)
    fast, ref = FastEngine(LINK, 6), SimPyEngine(LINK, 6)
    fast.record_copies = ref.record_copies = True
    crossed = 0
    for _ in range(30):
        plan = _random_plan(rng, 6, overlap=overlap, prefetch=True, late=late, pre_router=True)
        a, b = fast.run_cycle(plan), ref.run_cycle(plan)
        assert a == b and len(a.copies) == a.num_transfers
        crossed += sum(c[4] > a.end_ns for c in a.copies)
    assert crossed  # copies landed after their cycle's end: the case the engines logged apart


@pytest.mark.parametrize("concurrency", [1, 2, 3])
@pytest.mark.parametrize("seed", [5, 6])
def test_simpy_logs_the_landing_a_copy_in_flight_will_have_on_a_concurrent_link(concurrency, seed) -> None:
    """SimPyEngine (any concurrency) logs a copy still in flight at its cycle's end with the start
    and landing the copy stream then gives it, whatever the later cycles enqueue: the replay
    resumes each copy where it is (queued, in its dispatch latency, waiting for or on the wire,
    waiting for its placing)."""
    rng = np.random.default_rng(seed)
    link = LinkSpec(latency_ns=100_000 * concurrency, wire_ns=400_000, concurrency=concurrency)
    engine = SimPyEngine(link, 6)  # slow: copies outlast cycles
    engine.record_copies = True
    logged = []
    for _ in range(20):
        timing = engine.run_cycle(_random_plan(rng, 6, overlap="on", prefetch=True, late=True, pre_router=True))
        logged.append((timing, engine._copies))  # the cycle's own list: each copy writes its landing there
        assert len(engine._in_stream) == engine._num_in_stream  # only the copies in the stream kept
    engine.env.run()  # every copy lands
    crossed = 0
    for timing, actual in logged:
        assert list(timing.copies) == actual
        crossed += sum(c[4] > timing.end_ns for c in timing.copies)
    assert crossed


def test_simpy_keeps_only_the_copies_a_replay_needs() -> None:
    """A copy stream that never empties (each cycle's unused prefetch outlasts the cycle):
    without record_copies SimPyEngine keeps no copy for the replay; with it, only the copies
    still in the stream (it kept every copy since the stream was last empty and replayed them
    all each cycle, rev1 finding 1), and still logs each copy with the start and landing the
    stream gives it. Timings are the same either way."""
    plan = CyclePlan(
        draft_ns=500_000, decision_ns=0, layer_compute_ns=(100_000,) * 4, hits=((),) * 4, demand=((),) * 4, prefetch=((1, 7),)
    )
    link = LinkSpec(latency_ns=0, wire_ns=1_000_000, concurrency=1)
    plain, recording = SimPyEngine(link, 4), SimPyEngine(link, 4)
    recording.record_copies = True
    logged = []
    for _ in range(200):
        a, b = plain.run_cycle(plan), recording.run_cycle(plan)
        assert dataclasses.replace(a, copies=b.copies) == b
        assert not plain._in_stream
        assert len(recording._in_stream) == recording._num_in_stream  # what the stream holds
        logged.append((b, recording._copies))
    assert len(recording._jobs.items) >= 15  # the queue grew: the case that kept every copy
    recording.env.run()
    for timing, actual in logged:
        assert list(timing.copies) == actual
    with pytest.raises(ValueError, match="record_copies"):
        plain.record_copies = True  # copies without a log still in the stream


def test_checked_layer_pairs_are_remembered_per_pair() -> None:
    """FastEngine checks and converts each (compute, pre-router) tuple pair once and remembers
    several (the simulator hands cycles one of a few memoised pairs): pairs used in turn time as
    on a fresh engine, the same compute tuple with another pre-router tuple is checked again, and
    a bad one is still refused."""
    compute = (100, 200, 300)
    pairs = [(compute, (10, 20, 30)), ((150, 250, 350), ()), (compute, (0, 0, 0))]
    engine = FastEngine(LINK, 3)
    for k in range(12):
        layer_compute, pre = pairs[k % 3]
        plan = CyclePlan(0, 5, layer_compute, hits=((),) * 3, demand=((1,), (), (2, 3)), layer_pre_router_ns=pre)
        fresh = FastEngine(LINK, 3, start_ns=engine.now_ns)
        assert engine.run_cycle(plan) == fresh.run_cycle(plan)
    assert len(engine._pairs) == 2  # by compute tuple: the third pair replaced the first's entry
    bad = CyclePlan(0, 5, compute, hits=((),) * 3, demand=((), (), ()), layer_pre_router_ns=(10, 300, 30))
    with pytest.raises(ValueError, match="layer_pre_router_ns"):
        engine.run_cycle(bad)
