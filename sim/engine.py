"""Timeline of one verification cycle on two resources: the compute stream and the H2D link.

The cache decisions of a cycle (which experts hit, which cross the link on demand, which are
prefetched) do not depend on time, so :mod:`sim.replay` makes them first and hands the engine a
:class:`CyclePlan`; the engine then places every phase on an integer-nanosecond clock. Integer
nanoseconds make the event order exact: two events at the same instant compare equal instead of
being reordered by float round-off, and the same input gives byte-identical output.

Model (issue 6, "The discrete-event model"):

* The compute stream runs the draft levels (``draft_ns``), then the planner (``decision_ns``, a
  modelled constant), then the verification forward pass layer by layer. Layer ``l`` computes
  for ``layer_compute_ns[l]`` in all: first its part before the router (``layer_pre_router_ns[l]``:
  attention, norms, the router; ``CycleCostModel.pre_router_fraction`` of it), which needs no expert,
  then its experts, each only once it is on the device.
* The H2D link is a FIFO copy stream (a CUDA copy stream: copies run in the order they were
  enqueued). Each expert copy takes ``latency_ns`` (per-transfer dispatch cost) then ``wire_ns``
  (``expert_bytes / bandwidth``). With ``concurrency = c > 1`` up to ``c`` copies are in flight:
  their dispatch latencies overlap while the wire (the bandwidth) is shared, one copy at a time.
* Demand misses of layer ``l`` are enqueued once layer ``l``'s router has run (its pre-router
  compute done), as the live engine does (``live.offload``), and the compute stream spends
  ``host_ns_per_transfer`` per miss placing them (slot bookkeeping, and on the emulated CPU link
  the memcpy: host work a copy engine does not do; the live engine counts it as stall). A batch
  on the copy stream (the live engine's ``H2DLink.enqueue``: overlap "on", or any prefetch mode)
  is enqueued once the part of its placing that precedes the enqueue is done (``host -
  placing`` per copy: the live engine's slot bookkeeping for every miss of the layer), starts
  on the link then, and is copied while the rest is placed (``CyclePlan.placing_ns_per_transfer``
  per copy: the CPU link's memcpy): copy ``j`` lands at ``max(landed_{j-1} + transfer, enqueue
  + (j + 1) placing)`` (``_batch_landings``; the live CPU link's landing clock,
  ``live.h2d.H2DLink._copy_ahead``, is this recurrence per tensor copy;
  ``tests/test_live_golden_cycle.py`` checks it to the nanosecond). With ``placing = 0`` (the
  default, and what ``sim.replay`` uses with a cost file older than version 9) the whole placing
  precedes the enqueue; ``sim.replay`` takes ``CycleCostModel.placing_after_enqueue_s_per_transfer``
  (the live memcpy ends fitted by ``calibration.costfit.fit_placing_after_enqueue``), which the cost
  model prices in its per-layer forms. Without a copy stream (overlap "off" and no prefetch: the
  live engine's synchronous ``H2DLink.fetch``; ``CyclePlan.copy_stream``) the misses are
  placed, then copied.
  ``overlap="off"``: the compute stream blocks on them (and on the layer's prefetched experts
  still in flight) before the layer's experts compute, so with an idle link and no placing
  after the enqueue the cycle is exactly ``draft + decision + verify + sum_l misses_l * (host +
  latency + wire)``: ``specfit.cost.CycleCostModel.cycle_s`` with overlap off.
  ``overlap="on"`` (the live engine's ``--overlap on``): the layer computes its resident experts
  (those whose copies have landed included) at once, in one kernel call, while its copies are in
  flight; then, until every late expert is computed, it waits for the next copy to land and
  computes every late expert landed by then in one more kernel call of ``late_call_ns`` (the
  live engine's late-expert groups: a call's fixed cost dominates a few experts' work on the
  CPU). So on an idle link with copies landing one by one (``transfer >= late_call``) and no
  placing after the enqueue a layer with misses lasts ``host + max(compute, pre_router + h2d) +
  late_call`` (``CycleCostModel.cycle_s``, mode "on"); with all of its placing ``h`` after the
  enqueue, ``max(n h + compute, pre_router + n max(h, transfer))`` plus the late call when
  ``transfer > h``. ``overlap="ideal"`` is a BOUND no engine reaches (a
  layer's experts are known only once its router has run): as "on", but the demand misses of
  every layer are enqueued when verification starts, in layer order, so copies of later layers
  also proceed while earlier layers compute, their own attention included (placing and late
  calls as in "on"; the analytic bound ``draft + max(verify, h2d)`` leaves them out). ``True``/``False`` are read as ``"ideal"``/``"off"``.
* Prefetch: the draft prefetch's copies (``CyclePlan.prefetch``) are enqueued when the subtree is
  chosen (after ``decision_ns``), before any demand copy, layer by layer, each batch placed
  and enqueued as the demand batches. The next-layer prefetch's copies of
  layer ``l+1`` (``CyclePlan.next_layer[l]``; Pre-gated MoE, Hwang et al., ISCA 2024: layer l+1's
  router on layer l's input) are enqueued where the live engine enqueues them: right behind layer
  ``l``'s demand copies once they are placed (overlap "on"/"ideal"), or, with overlap "off", when
  layer ``l`` starts computing (the live engine issues them after the layer's wait). Each
  prefetch copy, like a demand miss, costs the compute stream ``host_ns_per_transfer`` to
  place (the live engine places and enqueues prefetches on the compute thread: the draft
  prefetch's layer by layer before the forward starts, a layer's next-layer copies before its
  first kernel call; on the emulated CPU link that includes the memcpy), its batch enqueued
  and copied as above. A prefetched expert is
  resident in the cache from its enqueue but usable only once its copy arrives; copies still in flight at the end of a cycle stay in flight into the next one (the
  engine keeps their arrival times).

Two engines compute this timeline: :class:`SimPyEngine` (SimPy processes and resources; the
reference, any ``concurrency``) and :class:`FastEngine` (the same FIFO recurrence written out,
``concurrency == 1`` only, ~20x faster). ``tests/test_sim_engine.py`` checks they agree to the
nanosecond.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from numbers import Integral
from typing import Any

import numpy as np
import simpy

ENGINES = ("auto", "fast", "simpy")
OVERLAP_MODES = ("off", "on", "ideal")
MEMO_MAX_ENTRIES = 4096  # entries a per-cycle memo keeps before it is cleared (FastEngine's pairs, sim.replay's splits: count)


@dataclass(frozen=True)
class LinkSpec:
    """The H2D link of the simulator, in integer nanoseconds.

    Attributes:
        latency_ns: per-transfer dispatch latency (``CycleCostModel.h2d_s_per_transfer``), >= 0.
        wire_ns: time one expert occupies the wire, ``expert_bytes / h2d_bytes_per_s``, >= 0.
        concurrency: copies in flight at once (copy engines), >= 1; the wire is always shared.

    Raises:
        ValueError: negative times or ``concurrency < 1``, naming the field.
    """

    latency_ns: int
    wire_ns: int
    concurrency: int = 1

    def __post_init__(self) -> None:
        for name in ("latency_ns", "wire_ns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LinkSpec.{name}: expected an integer >= 0, got {value!r}")
        if (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or self.concurrency < 1
        ):
            raise ValueError(f"LinkSpec.concurrency: expected an integer >= 1, got {self.concurrency!r}")

    @property
    def transfer_ns(self) -> int:
        """Duration of one expert copy on an idle link: ``latency_ns + wire_ns``."""
        return self.latency_ns + self.wire_ns


@dataclass(frozen=True)
class CyclePlan:
    """What one cycle does, decided before timing (see the module docstring).

    Attributes:
        draft_ns: drafting time on the compute stream (>= 0).
        decision_ns: planner time after drafting, before verification (>= 0).
        layer_compute_ns: ``L`` per-layer verification compute times.
        hits: per layer, experts the layer needs that the cache already holds (some may still
            be in flight from a prefetch; the engine knows which).
        demand: per layer, experts the layer needs that must be copied on demand (misses).
        prefetch: ``(layer, expert)`` copies enqueued at decision time, in this order.
        overlap: ``"off"``, ``"on"`` or ``"ideal"`` (see the module docstring; a bool is read as
            ``"ideal"``/``"off"``).
        host_ns_per_transfer: compute-stream time placing each demand miss before its copy is
            enqueued (``CycleCostModel.host_s_per_transfer``), >= 0.
        late_call_ns: with overlap, compute-stream time of each kernel call on late experts
            (``CycleCostModel.late_call_s``), >= 0.
        demand_counts: optional ``L`` ints (a sequence or an int array), ``len(demand[l])``: when given, :class:`FastEngine`
            reads a layer's demand ids only to record copies (``record_copies``), so ``demand``
            may build them lazily (the simulator passes rows of its miss mask).
        next_layer: empty, or per layer ``l`` the experts of layer ``l+1`` copied by the
            next-layer prefetch when layer ``l`` is reached (see the module docstring), in this
            order (the last layer's entry is empty).
        layer_pre_router_ns: empty (0 for every layer), or per layer the part of
            ``layer_compute_ns[l]`` computed before the layer's router has run (attention,
            norms, router; 0 <= it <= ``layer_compute_ns[l]``): the layer's demand copies are
            enqueued after it (``CycleCostModel.pre_router_fraction``).
        copy_stream: whether the demand copies go on the copy stream (``live.offload`` enqueues
            them with overlap or with any prefetch mode: the link starts at the enqueue and
            copies while the rest are placed, ``_batch_landings``) or, with ``False`` and overlap
            "off" (the live engine's synchronous ``H2DLink.fetch``), are copied once all are
            placed; ``None`` (default): ``overlap != "off"``. Prefetch copies always go on the
            copy stream.
        placing_ns_per_transfer: the part of ``host_ns_per_transfer`` a copy-stream batch spends
            placing AFTER its enqueue, while the link already copies (the CPU link's memcpy,
            ``live.h2d.H2DLink.enqueue``; a CUDA copy's launch), 0 <= it <= ``host_ns_per_transfer``;
            the rest (slot bookkeeping, before the enqueue) delays the enqueue. 0 (default): the
            whole placing precedes the enqueue, the model before issue 13's item 3. ``sim.replay``
            sets it from ``CycleCostModel.placing_after_enqueue_s_per_transfer`` (fitted from the
            live memcpy ends, ``calibration.costfit.fit_placing_after_enqueue``; 0 in cost files
            older than version 9).
    """

    draft_ns: int
    decision_ns: int
    layer_compute_ns: Sequence[int]
    hits: Sequence[Sequence[int]]
    demand: Sequence[Sequence[int]]
    prefetch: Sequence[tuple[int, int]] = ()
    overlap: bool | str = "off"
    host_ns_per_transfer: int = 0
    late_call_ns: int = 0
    demand_counts: Sequence[int] | None = None
    next_layer: Sequence[Sequence[int]] = ()
    layer_pre_router_ns: Sequence[int] = ()
    copy_stream: bool | None = None
    placing_ns_per_transfer: int = 0

    @classmethod
    def build(cls, **fields: object) -> CyclePlan:
        """The plan the constructor makes from ``fields`` (names as above, unset ones defaulted),
        without the frozen dataclass's per-field ``__init__`` (the simulator builds one per
        cycle). Names are not checked; the engines check the values (``run_cycle``)."""
        plan = object.__new__(cls)
        plan.__dict__.update(_CYCLE_PLAN_DEFAULTS, **fields)
        return plan

    @property
    def overlap_mode(self) -> str:
        """``"off"``, ``"on"`` or ``"ideal"``."""
        if isinstance(self.overlap, str):
            return self.overlap
        return "ideal" if self.overlap else "off"

    @property
    def num_layers(self) -> int:
        """``L``, the number of MoE layers."""
        return len(self.layer_compute_ns)


_CYCLE_PLAN_DEFAULTS = {
    "prefetch": (),
    "overlap": "off",
    "host_ns_per_transfer": 0,
    "late_call_ns": 0,
    "demand_counts": None,
    "next_layer": (),
    "layer_pre_router_ns": (),
    "copy_stream": None,
    "placing_ns_per_transfer": 0,
}


@dataclass(frozen=True)
class CycleTiming:
    """When each phase of one cycle ran (integer ns on the engine's clock).

    Attributes:
        start_ns, draft_end_ns, verify_start_ns, end_ns: cycle start, draft end, verification
            start (= subtree chosen, prefetch enqueued) and end of the last layer.
        layer_start_ns, layer_end_ns: ``L`` compute start/end per layer (the start: when the
            layer's first compute began, its pre-router part, as the live engine's decoder-layer
            span starts, also where that part is 0; with overlap "off" and a plan without
            pre-router parts, ``layer_pre_router_ns`` empty, after its copies landed).
        layer_h2d_ns: ``L``, summed duration of this cycle's copies for layer ``l`` (demand and
            prefetch; with ``concurrency == 1`` this is the link time they occupied).
        num_transfers: copies enqueued in this cycle (demand + prefetch).
        layer_wait_ns: ``L``, the layer's stall inside its span: with overlap, placing its misses
            and waiting for late copies; with ``overlap="off"``, placing and waiting for its copies
            after its pre-router compute (the live engine's ``layer_stall_s``; 0 with a plan
            without pre-router parts, where the stall is the gap between a layer's start and the
            previous layer's end).
        copies: with ``record_copies`` on the engine, each copy enqueued this cycle as
            ``(layer, expert, enqueued_ns, started_ns, landed_ns)`` in enqueue order (empty
            otherwise), the live engine's convention: a copy still in flight at the cycle's end
            (a prefetch no layer waited for) is logged here, with the instant it will land, and
            not in the cycle it lands in (both engines; :meth:`SimPyEngine.run_cycle` says how).
    """

    start_ns: int
    draft_end_ns: int
    verify_start_ns: int
    end_ns: int
    layer_start_ns: tuple[int, ...]
    layer_end_ns: tuple[int, ...]
    layer_h2d_ns: tuple[int, ...]
    num_transfers: int
    layer_wait_ns: tuple[int, ...] = ()
    copies: tuple[tuple[int, int, int, int, int], ...] = ()

    def event_log(self) -> list[tuple]:
        """The cycle as ``[(phase, start_ns, end_ns), ...]`` with the phase names of
        docs/design.md: ``("draft",)``, ``("decision",)``, ``("h2d", layer, expert)`` per copy
        (needs ``record_copies``), ``("compute", layer)``, ``("stall", layer)`` (a wait for
        copies before the layer's compute; with overlap the layer's inner stall, placing and
        waits between its kernel calls, is shown merged after its compute), sorted by start then
        phase."""
        log = [(("draft",), self.start_ns, self.draft_end_ns), (("decision",), self.draft_end_ns, self.verify_start_ns)]
        log += [(("h2d", lay, e), started, landed) for lay, e, _, started, landed in self.copies]
        previous_end = self.verify_start_ns
        waits = self.layer_wait_ns or (0,) * len(self.layer_start_ns)
        for layer, (start, end, wait) in enumerate(zip(self.layer_start_ns, self.layer_end_ns, waits)):
            if start > previous_end:
                log.append((("stall", layer), previous_end, start))
            log.append((("compute", layer), start, end - wait))
            if wait:
                log.append((("stall", layer), end - wait, end))
            previous_end = end
        return sorted(log, key=lambda row: (row[1], row[0]))

    @property
    def cycle_ns(self) -> int:
        """Wall time of the cycle, ``end_ns - start_ns``."""
        return self.end_ns - self.start_ns

    @cached_property
    def busy_ns(self) -> int:
        """The compute stream's busy time during verification: the layers' spans less the waits
        inside them, ``sum(layer_end_ns) - sum(layer_start_ns) - sum(layer_wait_ns)`` (ns; the
        fast engine's compiled cycles hand it over, summed as they are made)."""
        return sum(self.layer_end_ns) - sum(self.layer_start_ns) - sum(self.layer_wait_ns)

    @cached_property
    def h2d_ns(self) -> int:
        """The cycle's summed copy time, ``sum(layer_h2d_ns)`` (ns)."""
        return sum(self.layer_h2d_ns)

    @property
    def stall_ns(self) -> int:
        """Time the compute stream waited for copies during verification."""
        return sum(self.layer_wait_ns) + sum(
            s - e for s, e in zip(self.layer_start_ns, (self.verify_start_ns, *self.layer_end_ns[:-1]))
        )


def _check_plan(plan: CyclePlan, checked: tuple = (None, None)) -> None:
    """Raise ValueError on a malformed plan; ``checked``: a ``(layer_compute_ns,
    layer_pre_router_ns)`` pair of tuples that already passed (the simulator hands the same
    memoised pair to many cycles), whose per-layer checks are skipped."""
    n = plan.num_layers
    counts = plan.demand_counts
    if len(plan.hits) != n or len(plan.demand) != n or (counts is not None and len(counts) != n):
        raise ValueError(
            f"CyclePlan: hits ({len(plan.hits)}) and demand ({len(plan.demand)}) need one entry per "
            f"layer ({n})"
        )
    known = plan.layer_compute_ns is checked[0] and plan.layer_pre_router_ns is checked[1]
    compute = () if known else plan.layer_compute_ns
    if min(plan.draft_ns, plan.decision_ns, plan.host_ns_per_transfer, plan.late_call_ns, *compute, 0) < 0:
        raise ValueError("CyclePlan: durations must be >= 0 ns")
    placing = plan.placing_ns_per_transfer
    if (type(placing) is not int and (isinstance(placing, bool) or not isinstance(placing, Integral))) or not (
        0 <= placing <= plan.host_ns_per_transfer
    ):  # an int (not bool: the engines would take True as 1 ns, a float truncated)
        raise ValueError(
            f"CyclePlan.placing_ns_per_transfer: expected an int in [0, host_ns_per_transfer "
            f"({plan.host_ns_per_transfer})], got {placing!r}"
        )
    stream = plan.copy_stream
    if not (stream is None or stream is True or stream is False or type(stream) is np.bool_):
        raise ValueError(f"CyclePlan.copy_stream: expected True, False or None, got {stream!r}")
    if len(plan.next_layer) not in (0, n) or (n and len(plan.next_layer) and len(plan.next_layer[-1])):
        raise ValueError(
            f"CyclePlan.next_layer: expected no entry or one per layer ({n}), the last empty; "
            f"got {len(plan.next_layer)}"
        )
    pre = plan.layer_pre_router_ns
    if len(pre) not in (0, n) or (not known and any(not 0 <= p <= c for p, c in zip(pre, plan.layer_compute_ns))):
        raise ValueError(
            f"CyclePlan.layer_pre_router_ns: expected no entry or one per layer ({n}), each in "
            f"[0, layer_compute_ns]; got {list(pre)}"
        )
    if plan.overlap_mode not in OVERLAP_MODES:
        raise ValueError(f"CyclePlan.overlap: expected one of {list(OVERLAP_MODES)}, got {plan.overlap!r}")


_KERNELS: list = []  # sim.engine_kernels and the entry point of its idle_link_layers, once loaded


def _engine_kernels():
    """``(sim.engine_kernels, entry)``, imported on first use (numba loads then, not when ``sim``
    is imported) and kept: the fast engine times most simulated cycles with it.

    ``entry``: the compiled entry point of ``idle_link_layers`` for ``(bool, int64[L] counts,
    int64[L] compute, int64[L or 0] pre, int64, int64, int64, int64[4, L] C-contiguous out)``,
    arrays of any strides (layout ``"A"``). Numba's dispatcher type-checks every argument on every
    call (``typeof`` of each and a lookup of the specialisation: ~3 us of a ~7 us call, issue 14);
    the entry point skips that and does NOT check array types itself, so
    :meth:`FastEngine._idle_link_cycle` calls it only with arrays it made or checked (int64, one
    axis) and goes through the dispatcher otherwise (the pattern of
    ``specfit.decide_kernels.question_entry``). Same compiled code, so the same values.
    """
    if not _KERNELS:
        from numba import types

        from sim import engine_kernels

        def array(ndim: int, layout: str = "A", readonly: bool = True) -> Any:
            return types.Array(types.int64, ndim, layout, readonly=readonly)

        signature = (
            types.boolean, array(1), array(1), array(1), types.int64, types.int64, types.int64,
            array(2, "C", readonly=False),
        )  # fmt: skip
        engine_kernels.idle_link_layers.compile(signature)
        _KERNELS.extend((engine_kernels, engine_kernels.idle_link_layers.overloads[signature].entry_point))
    return _KERNELS


class _EngineBase:
    """State shared by both engines: the link, the clock and in-flight prefetch arrivals."""

    def __init__(self, link: LinkSpec, num_layers: int) -> None:
        self.link = link
        self.num_layers = int(num_layers)
        # pending[l][e] = arrival time (ns) of a copy of expert e of layer l still in flight
        self._pending: list[dict[int, int]] = [{} for _ in range(self.num_layers)]
        # any(self._pending), kept where entries are added and by _purge: most cycles have nothing
        # in flight, and any() over L dicts twice a cycle was ~2 us of a ~100 us simulated cycle
        self._any_pending = False

    def _purge(self, now_ns: int) -> None:
        if not self._any_pending:  # most cycles: nothing in flight
            return
        for layer_pending in self._pending:
            if layer_pending:
                for e in [e for e, t in layer_pending.items() if t <= now_ns]:
                    del layer_pending[e]
        self._any_pending = any(self._pending)

    def in_flight(self, layer: int) -> frozenset[int]:
        """Experts of ``layer`` whose prefetch copy is still crossing the link at the current time."""
        return frozenset(self._pending[layer])


class FastEngine(_EngineBase):
    """The cycle timeline as an explicit FIFO recurrence (``concurrency == 1`` only).

    A single FIFO server with deterministic service ``transfer_ns``: a copy enqueued at ``t``
    starts at ``max(t, link_free)`` and ends ``transfer_ns`` later. Layer ``l`` starts at
    ``max(end of layer l-1, arrival of each expert it needs)``. Same results as
    :class:`SimPyEngine` (tested), without the event-queue overhead.

    Raises:
        ValueError: ``link.concurrency != 1``.
    """

    def __init__(self, link: LinkSpec, num_layers: int, start_ns: int = 0) -> None:
        if link.concurrency != 1:
            raise ValueError(
                f"FastEngine: link concurrency must be 1 (got {link.concurrency}); use SimPyEngine"
            )
        super().__init__(link, num_layers)
        self.now_ns = int(start_ns)
        self._link_free_ns = int(start_ns)
        self.record_copies = False
        self.vectorised = True  # use _idle_link_cycle where it applies (False: always the loop)
        self._transfer_ns = link.transfer_ns  # the link is frozen: its copy time once
        # the (layer_compute_ns, layer_pre_router_ns) tuple pairs _check_plan passed, by the id of
        # the compute tuple: [compute, pre, their int64 arrays or None until _idle_link_cycle
        # needs them]. The simulator hands each cycle one of a few memoised pairs (one per
        # verify time: sim.replay's _splits), so a pair is checked and converted once, not once
        # per cycle; the entry holds the tuples, so their ids stay theirs. Bounded as _splits.
        self._pairs: dict[int, list] = {}
        # _idle_link_cycle's int64[4, L] output, reused cycle after cycle (read into lists at once)
        self._idle_out = np.empty((4, self.num_layers), dtype=np.int64)

    def run_cycle(self, plan: CyclePlan) -> CycleTiming:
        """Place ``plan`` on the clock starting now; advance the clock to the cycle's end."""
        compute, pre = plan.layer_compute_ns, plan.layer_pre_router_ns
        pair = self._pairs.get(id(compute))
        known = pair is not None and pair[0] is compute and pair[1] is pre
        _check_plan(plan, (compute, pre) if known else (None, None))
        if plan.num_layers != self.num_layers:
            raise ValueError(f"CyclePlan: {plan.num_layers} layers, engine has {self.num_layers}")
        if not known and type(compute) is tuple and type(pre) is tuple:  # immutable: checked once
            if len(self._pairs) >= MEMO_MAX_ENTRIES:
                self._pairs.clear()
            self._pairs[id(compute)] = [compute, pre, None]
        t_ns = self._transfer_ns
        start = self.now_ns
        self._purge(start)
        draft_end = start + int(plan.draft_ns)
        verify_start = draft_end + int(plan.decision_ns)
        mode = plan.overlap_mode
        stream = mode != "off" if plan.copy_stream is None else bool(plan.copy_stream)
        if (  # most simulated cycles: timed before any per-layer state is built
            self.vectorised
            and not self.record_copies
            and not plan.prefetch
            and not any(plan.next_layer)
            and self._link_free_ns <= verify_start
            and (mode == "off" or (mode == "on" and not int(plan.late_call_ns)))
            and not (stream and int(plan.placing_ns_per_transfer))
            and not self._any_pending
        ):
            counts = plan.demand_counts
            if counts is None:
                counts = [len(experts) for experts in plan.demand]
            host_ns = int(plan.host_ns_per_transfer)
            return self._idle_link_cycle(plan, counts, start, draft_end, verify_start, host_ns)
        layer_h2d = [0] * self.num_layers
        link_free = self._link_free_ns
        num_transfers = 0
        copies: list[tuple[int, int, int, int, int]] | None = [] if self.record_copies else None

        def log(layer: int, experts, enqueued: int, started: int, landings) -> None:  # FIFO: each starts as the last lands
            copies.extend(
                (layer, int(e), enqueued, started if k == 0 else landings[k - 1], landings[k])
                for k, e in enumerate(experts)
            )

        def enqueue(layer: int, experts, n: int, at: int, host: int | None = None, overlapped: int | None = None) -> list[int]:
            """A batch of ``n`` copies whose placing starts at ``at`` (``host`` each, default
            ``host_ns``): enqueued after the part of it the copies cannot overlap (``host -
            overlapped`` each; ``overlapped`` default ``placing_ns``), then copied while the rest
            is placed; their landings (``_batch_landings``); the link, logs and counts updated."""
            nonlocal link_free, num_transfers
            host = host_ns if host is None else host
            overlapped = placing_ns if overlapped is None else overlapped
            at += (host - overlapped) * n
            landings = _batch_landings(n, at, link_free, overlapped, t_ns)
            if copies is not None:
                log(layer, experts, at, max(at, link_free), landings)
            link_free = landings[-1]
            layer_h2d[layer] += n * t_ns
            num_transfers += n
            return landings

        def prefetch_next(layer: int, at: int) -> None:  # layer l+1's next-layer copies, placed from ``at``
            experts = next_layer[layer]
            if not experts:
                return
            arrivals = self._pending[layer + 1]
            for e, landed in zip(experts, enqueue(layer + 1, experts, len(experts), at)):
                arrivals[int(e)] = landed
            self._any_pending = True

        next_layer = plan.next_layer

        host_ns, late_ns = int(plan.host_ns_per_transfer), int(plan.late_call_ns)
        placing_ns = int(plan.placing_ns_per_transfer)
        forward_start = verify_start  # after the draft prefetch's placing
        for layer, batch in _layer_batches(plan.prefetch):  # placed and enqueued layer by layer
            for expert, landed in zip(batch, enqueue(layer, batch, len(batch), forward_start)):
                self._pending[layer][int(expert)] = landed
            self._any_pending = True
            forward_start += len(batch) * host_ns

        demand_arrival = [0] * self.num_layers
        demand_landings: list[Sequence[int]] = [()] * self.num_layers  # each demand copy's landing (replaced, never grown)
        demand = plan.demand
        counts = plan.demand_counts
        if counts is None:
            counts = [len(experts) for experts in demand]
        elif type(counts) is np.ndarray:  # Python ints on the clock
            counts = counts.tolist()
        if mode == "ideal":
            for layer, n in enumerate(counts):
                if n:  # placed later, at each layer: copied back to back from now
                    demand_landings[layer] = enqueue(layer, demand[layer], n, forward_start, 0, 0)
                    demand_arrival[layer] = link_free

        compute_free = forward_start
        starts, ends, waits = [], [], []
        hits = plan.hits
        pre_router = plan.layer_pre_router_ns
        for layer, (pending, n, compute_ns) in enumerate(zip(self._pending, counts, plan.layer_compute_ns)):
            pre = int(pre_router[layer]) if pre_router else 0  # attention + router: no expert needed
            routed = compute_free + pre
            late = 0  # last arrival among the layer's copies in flight
            if pending:
                for e in hits[layer]:
                    arrival = pending.get(int(e))
                    if arrival is not None and arrival > late:
                        late = arrival
            placed = routed + n * host_ns  # the misses placed
            if n and mode != "ideal":  # enqueued once the layer's router has run
                # the copy stream copies while the rest are placed; without one (overlap "off" and
                # no prefetch: the synchronous fetch) the misses are placed, then copied back to back
                demand_landings[layer] = enqueue(layer, demand[layer], n, routed, host_ns, placing_ns if stream else 0)
                demand_arrival[layer] = link_free
            if demand_arrival[layer] > late:
                late = demand_arrival[layer]
            if mode != "off":  # resident experts compute at once, late ones as they land
                begin = placed  # the first kernel call, after placing the next-layer prefetch
                if next_layer and next_layer[layer]:  # enqueued behind the demand copies, then placed
                    prefetch_next(layer, begin)
                    begin += len(next_layer[layer]) * host_ns
                starts.append(compute_free)
                cur = begin + int(compute_ns) - pre
                stall = placed - routed
                if late_ns and late > begin:  # one kernel call per group of late experts landed together
                    arrivals = list(demand_landings[layer])
                    if pending:
                        arrivals += [pending[int(e)] for e in hits[layer] if int(e) in pending]
                    arrivals = sorted(a for a in arrivals if a > begin)
                    i = 0
                    while i < len(arrivals):
                        if arrivals[i] > cur:
                            stall += arrivals[i] - cur
                            cur = arrivals[i]
                        while i < len(arrivals) and arrivals[i] <= cur:
                            i += 1
                        cur += late_ns
                elif late > cur:
                    stall += late - cur
                    cur = late
                waits.append(stall)
                compute_free = cur
            else:
                ready = late if late > placed else placed
                begin = ready
                if next_layer and next_layer[layer]:  # the live engine issues them after the wait
                    prefetch_next(layer, begin)
                    begin += len(next_layer[layer]) * host_ns
                # a plan with pre-router parts (a layer's 0 too): the wait inside the layer's span,
                # as the live engine records it; without: the layer starts once its copies landed
                starts.append(compute_free if pre_router else ready)
                waits.append(ready - routed if pre_router else 0)
                compute_free = begin + int(compute_ns) - pre
            ends.append(compute_free)

        times = (start, draft_end, verify_start, compute_free)
        return self._finish(times, link_free, starts, ends, layer_h2d, num_transfers, waits, copies)

    def _finish(
        self,
        times: tuple[int, int, int, int],
        link_free: int,
        starts: Sequence[int],
        ends: Sequence[int],
        layer_h2d: Sequence[int],
        num_transfers: int,
        waits: Sequence[int],
        copies: Sequence[tuple[int, int, int, int, int]] | None = None,
    ) -> CycleTiming:
        """Advance the clock to the cycle's end and return its timing; ``times`` = (start,
        draft end, verification start, end) in ns."""
        start, draft_end, verify_start, end = times
        self._link_free_ns = link_free
        self.now_ns = end
        self._purge(end)
        timing = object.__new__(CycleTiming)  # the frozen dataclass's fields, without its __init__
        timing.__dict__.update(
            start_ns=start,
            draft_end_ns=draft_end,
            verify_start_ns=verify_start,
            end_ns=end,
            layer_start_ns=tuple(starts),
            layer_end_ns=tuple(ends),
            layer_h2d_ns=tuple(layer_h2d),
            num_transfers=num_transfers,
            layer_wait_ns=tuple(waits),
            copies=tuple(copies or ()),
        )
        return timing


    def _idle_link_cycle(
        self, plan: CyclePlan, counts: Sequence[int], start: int, draft_end: int, verify_start: int, host_ns: int
    ) -> CycleTiming:
        """:meth:`run_cycle` when the link is idle at verification and nothing is in flight.

        Then every layer finds the link free once its misses are placed (by induction: its
        copies land before it ends), so no link state is needed per layer. With ``n`` misses,
        compute ``c`` of which ``p`` before the router, placing ``h`` and copy ``t`` per miss, a
        layer lasts ``n (h + t) + c`` and waits ``n (h + t)`` after ``p`` (overlap "off"; in a
        plan without pre-router parts it starts after the wait), or lasts ``n h + max(c, p + n t)``, waiting
        ``n h + max(p + n t - c, 0)`` (overlap "on" without a late-call cost): running sums of
        integers (exact). Only for "off" and such "on" cycles, without prefetch (draft or
        next-layer), recorded copies or placing after the enqueue (``placing_ns_per_transfer``
        on a copy stream); ``tests/test_sim_engine.py`` checks it against the loop.
        """
        kernels, entry = _engine_kernels()
        compute, pre = plan.layer_compute_ns, plan.layer_pre_router_ns
        pair = self._pairs.get(id(compute))  # the simulator reuses each (compute, pre) pair
        known = pair is not None and pair[0] is compute and pair[1] is pre  # tuples run_cycle checked
        arrays = pair[2] if known else None
        if arrays is None:
            arrays = (np.asarray(compute, dtype=np.int64), np.asarray(pre, dtype=np.int64).reshape(-1))
            if known:
                pair[2] = arrays
        counts = (counts if type(counts) is np.ndarray else np.asarray(counts, dtype=np.int64)).astype(np.int64, copy=False)
        out = self._idle_out  # run_cycle checked len(counts) == L
        if counts.ndim != 1 or arrays[0].ndim != 1:  # not the entry point's types: the dispatcher checks
            entry = kernels.idle_link_layers
        end, landed, num_transfers, busy, h2d = entry(
            plan.overlap_mode == "on", counts, *arrays, host_ns, self._transfer_ns, verify_start, out
        )
        starts, ends, waits, copy = out.tolist()
        link_free = self._link_free_ns if landed < 0 else landed
        timing = self._finish((start, draft_end, verify_start, end), link_free, starts, ends, copy, num_transfers, waits)
        timing.__dict__.update(busy_ns=busy, h2d_ns=h2d)  # the sums as the kernel made them (cached_property)
        return timing


class SimPyEngine(_EngineBase):
    """The cycle timeline as SimPy processes: the reference engine (any link concurrency).

    Resources: ``concurrency`` copy-engine processes pull copy jobs from one FIFO
    :class:`simpy.Store` (the copy stream); each waits its dispatch latency, then holds the
    wire (a :class:`simpy.Resource` of capacity 1) for ``wire_ns``. The cycle process runs the
    draft and decision timeouts, enqueues copies and, per layer, waits for all the layer's copies
    (:class:`simpy.AllOf`) and for the previous layer before computing. The environment persists
    across cycles, so copies still queued at a cycle's end delay the next cycle's copies.
    """

    def __init__(self, link: LinkSpec, num_layers: int, start_ns: int = 0) -> None:
        super().__init__(link, num_layers)
        self.env = simpy.Environment(initial_time=int(start_ns))
        self._jobs = simpy.Store(self.env)
        self._wire = simpy.Resource(self.env, capacity=1)
        self._events: list[dict[int, simpy.Event]] = [{} for _ in range(self.num_layers)]
        self._record_copies = False
        # this cycle's log (record_copies): one entry per copy enqueued, its number (count of
        # copies enqueued before it) until the copy lands, then its (layer, expert, enqueued,
        # started, landed)
        self._copies: list = []
        # record_copies only: each copy still in the copy stream by its number, in enqueue order:
        # [enqueued_ns, layer, expert, ready_ns, started_ns | None, wired_ns | None] (taken off
        # the queue; given the wire), what _copies_ahead replays from; _num_enqueued counts all
        self._in_stream: dict[int, list] = {}
        self._num_enqueued = 0
        self._num_in_stream = 0  # copies queued or being copied
        for _ in range(link.concurrency):
            self.env.process(self._copy_engine())

    @property
    def now_ns(self) -> int:
        """The engine's clock (ns)."""
        return int(self.env.now)

    @property
    def record_copies(self) -> bool:
        """Whether each cycle logs its copies (:attr:`CycleTiming.copies`).

        Each cycle that ends with copies in flight replays the copy stream on a fresh engine to log
        their start and landing (:meth:`_copies_ahead`), so with logging on a cycle costs time in
        proportion to the copies in the stream: a stream that never drains (unused prefetches
        issued faster than the link clears them) makes a run's logging quadratic in its length
        (rev4: 1,200 cycles, a stream of 1,670 copies, 22.7 s CPU). ``sim.replay`` leaves it off.

        Raises:
            ValueError: turned on while any copy is in the copy stream (before the first cycle or
                once it is empty), even when every copy there was enqueued with logging on: the
                check is conservative, copies enqueued without it could not be replayed for the log.
        """
        return self._record_copies

    @record_copies.setter
    def record_copies(self, on: bool) -> None:
        if on and not self._record_copies and self._num_in_stream:
            raise ValueError("SimPyEngine.record_copies: turn it on while the copy stream is empty (before the first cycle)")
        self._record_copies = bool(on)

    def _copy_engine(self):  # SimPy process generator
        link = self.link
        while True:
            layer, expert, enqueued, ready, done, log, slot, number, resume = yield self._jobs.get()
            now = int(self.env.now)
            started, wired = resume if resume is not None else (now, None)  # resume: _copies_ahead's
            state = self._in_stream.get(number) if number is not None else None
            if state is not None:
                state[4] = started
            if wired is None:
                if started + link.latency_ns > now:
                    yield self.env.timeout(started + link.latency_ns - now)
                with self._wire.request() as req:
                    yield req
                    if state is not None:
                        state[5] = int(self.env.now)
                    if link.wire_ns:
                        yield self.env.timeout(link.wire_ns)
            elif wired + link.wire_ns > now:  # resumed while holding the wire: the first to ask
                with self._wire.request() as req:
                    yield req
                    yield self.env.timeout(wired + link.wire_ns - now)
            if ready > self.env.now:  # its placing (the memcpy on the CPU link) not done yet
                yield self.env.timeout(ready - int(self.env.now))
            self._num_in_stream -= 1
            if state is not None:
                del self._in_stream[number]
            if log is not None:  # the enqueuing cycle's log (already returned when it ended earlier)
                log[slot] = (layer, expert, enqueued, started, int(self.env.now))
            done.succeed(int(self.env.now))

    def _enqueue(self, layer: int, expert: int, ready: int = 0) -> simpy.Event:
        """Put one copy on the copy stream now; it lands no sooner than ``ready`` (its placing's end)."""
        done = self.env.event()
        now = int(self.env.now)
        log, number = (self._copies, self._num_enqueued) if self._record_copies else (None, None)
        if log is not None:
            log.append(number)  # in flight: its number (_copies_ahead)
            self._in_stream[number] = [now, int(layer), int(expert), int(ready), None, None]
        self._num_enqueued += 1
        self._num_in_stream += 1
        slot = len(log) - 1 if log is not None else None
        self._jobs.put((layer, int(expert), now, int(ready), done, log, slot, number, None))
        return done

    def _copies_ahead(self) -> dict[int, tuple[int, int, int, int, int]]:
        """``(layer, expert, enqueued_ns, started_ns, landed_ns)`` of each copy still in the copy
        stream, by its number: those copies replayed alone from now on a fresh engine of the same
        link, each resumed where it is (taken off the queue or not, its wait for the dispatch
        latency, the wire, its placing), FIFO: a copy's start and landing depend only on the
        copies enqueued before it and their placing ends, not on what the cycle does next, and
        every copy ahead of those in the stream has left the wire. This engine's clock does not
        move. Costs a replay of the copies in the stream; only with ``record_copies``, for
        copies in flight at a cycle's end."""
        ahead = SimPyEngine(self.link, self.num_layers, start_ns=int(self.env.now))
        log = [None] * len(self._in_stream)
        for slot, (enqueued, layer, expert, ready, started, wired) in enumerate(self._in_stream.values()):
            resume = None if started is None else (started, wired)  # queued ones: taken from now
            ahead._jobs.put((layer, expert, enqueued, ready, ahead.env.event(), log, slot, None, resume))
        ahead.env.run()
        return dict(zip(self._in_stream, log))

    def _place_batch(self, layer: int, experts, host_ns: int, overlapped_ns: int):  # SimPy process generator
        """Place a batch from now, ``host_ns`` per copy: the part the copies cannot overlap
        (``host_ns - overlapped_ns`` each), then enqueue it and place the rest while the link
        copies (copy ``j`` lands no sooner than ``(j + 1) overlapped_ns`` after the enqueue,
        ``_batch_landings``). Returns the copies' events."""
        n = len(experts)
        if (host_ns - overlapped_ns) * n:
            yield self.env.timeout((host_ns - overlapped_ns) * n)
        now = int(self.env.now)
        events = [self._enqueue(layer, e, now + (j + 1) * overlapped_ns) for j, e in enumerate(experts)]
        if overlapped_ns * n:
            yield self.env.timeout(overlapped_ns * n)
        return events

    def _prefetch_next(self, plan: CyclePlan, layer: int, layer_h2d: list[int]):  # SimPy process generator
        """Place and enqueue the next-layer prefetch copies of layer ``layer + 1`` now
        (:meth:`_place_batch`); returns their count."""
        if not plan.next_layer or not plan.next_layer[layer]:
            return 0
        experts = plan.next_layer[layer]
        host_ns, placing_ns = int(plan.host_ns_per_transfer), int(plan.placing_ns_per_transfer)
        events = yield self.env.process(self._place_batch(layer + 1, experts, host_ns, placing_ns))
        for e, event in zip(experts, events):
            self._events[layer + 1][int(e)] = event
            layer_h2d[layer + 1] += self.link.transfer_ns
        return len(experts)

    def _cycle(self, plan: CyclePlan, out: dict):  # SimPy process generator
        env = self.env
        out["start"] = int(env.now)
        if plan.draft_ns:
            yield env.timeout(int(plan.draft_ns))
        out["draft_end"] = int(env.now)
        if plan.decision_ns:
            yield env.timeout(int(plan.decision_ns))
        out["verify_start"] = int(env.now)
        t_ns = self.link.transfer_ns
        layer_h2d = [0] * self.num_layers
        count = 0
        host_ns, late_ns = int(plan.host_ns_per_transfer), int(plan.late_call_ns)
        placing_ns = int(plan.placing_ns_per_transfer)
        for layer, batch in _layer_batches(plan.prefetch):  # placed and enqueued layer by layer
            events = yield env.process(self._place_batch(layer, batch, host_ns, placing_ns))
            for expert, event in zip(batch, events):
                self._events[layer][int(expert)] = event
                layer_h2d[layer] += t_ns
                count += 1
        demand_events: list[list[simpy.Event]] = [[] for _ in range(self.num_layers)]
        mode = plan.overlap_mode
        stream = mode != "off" if plan.copy_stream is None else bool(plan.copy_stream)
        if mode == "ideal":
            for layer, experts in enumerate(plan.demand):
                demand_events[layer] = [self._enqueue(layer, e) for e in experts]
        starts, ends, layer_waits = [], [], []
        has_pre = bool(plan.layer_pre_router_ns)  # per plan: a layer's 0 too waits inside its span
        for layer in range(self.num_layers):
            layer_start = int(env.now)
            pre = int(plan.layer_pre_router_ns[layer]) if has_pre else 0
            if pre:  # attention and the router: the layer's experts are known after it
                yield env.timeout(pre)
            routed = int(env.now)
            n = len(plan.demand[layer])
            if mode != "ideal":  # placed and enqueued once the router has run (no copy stream: then copied)
                overlapped = placing_ns if stream else 0
                demand_events[layer] = yield env.process(self._place_batch(layer, plan.demand[layer], host_ns, overlapped))
            elif n and host_ns:  # placing the misses, already enqueued
                yield env.timeout(n * host_ns)
            layer_h2d[layer] += n * t_ns
            count += n
            waits = list(demand_events[layer])
            pending = self._events[layer]
            if pending:
                waits += [pending[int(e)] for e in plan.hits[layer] if int(e) in pending]
            if mode != "off":  # the compute stream: resident experts first, then the late ones
                starts.append(layer_start)
                stall = int(env.now) - routed
                count += yield env.process(self._prefetch_next(plan, layer, layer_h2d))
                if late_ns:  # copies landing at this very instant count as landed
                    yield env.timeout(0)
                late = [w for w in waits if not w.triggered]
                if plan.layer_compute_ns[layer] - pre:
                    yield env.timeout(int(plan.layer_compute_ns[layer]) - pre)
                while late:  # wait for the next landing, then one call on every late expert landed
                    if late_ns:
                        yield env.timeout(0)
                    if not any(w.triggered for w in late):
                        waited_from = int(env.now)
                        yield simpy.AnyOf(env, late)
                        if late_ns:
                            yield env.timeout(0)
                        stall += int(env.now) - waited_from
                    late = [w for w in late if not w.triggered]
                    if late_ns:
                        yield env.timeout(late_ns)
                layer_waits.append(stall)
            else:
                waits = [w for w in waits if not w.processed]
                if waits:
                    yield simpy.AllOf(env, waits)
                starts.append(layer_start if has_pre else int(env.now))
                layer_waits.append(int(env.now) - routed if has_pre else 0)
                count += yield env.process(self._prefetch_next(plan, layer, layer_h2d))
                if plan.layer_compute_ns[layer] - pre:
                    yield env.timeout(int(plan.layer_compute_ns[layer]) - pre)
            ends.append(int(env.now))
        out.update(starts=starts, ends=ends, layer_h2d=layer_h2d, count=count, waits=layer_waits)

    def run_cycle(self, plan: CyclePlan) -> CycleTiming:
        """Run ``plan`` from the current time; the clock ends at the cycle's last layer. With
        ``record_copies``, a copy still in flight at the end is logged in this cycle with the
        start and landing that the copy stream will give it (:meth:`_copies_ahead`), as
        :class:`FastEngine` logs it."""
        _check_plan(plan)
        if plan.num_layers != self.num_layers:
            raise ValueError(f"CyclePlan: {plan.num_layers} layers, engine has {self.num_layers}")
        for layer_events in self._events:  # forget arrived copies
            for e in [e for e, ev in layer_events.items() if ev.processed]:
                del layer_events[e]
        out: dict = {}
        self._copies = []  # a new list: copies of earlier cycles still write into theirs
        proc = self.env.process(self._cycle(plan, out))
        self.env.run(until=proc)
        copies = self._copies
        if any(type(c) is int for c in copies):  # in flight at the cycle's end: when they will land
            ahead = self._copies_ahead()
            copies = [ahead[c] if type(c) is int else c for c in copies]
        for layer, layer_events in enumerate(self._events):  # mirror for in_flight()
            self._pending[layer] = {e: 0 for e, ev in layer_events.items() if not ev.triggered}
        self._any_pending = any(self._pending)
        return CycleTiming(
            start_ns=out["start"],
            draft_end_ns=out["draft_end"],
            verify_start_ns=out["verify_start"],
            end_ns=int(self.env.now),
            layer_start_ns=tuple(out["starts"]),
            layer_end_ns=tuple(out["ends"]),
            layer_h2d_ns=tuple(out["layer_h2d"]),
            num_transfers=out["count"],
            layer_wait_ns=tuple(out["waits"]),
            copies=tuple(copies),
        )


def _batch_landings(n: int, at: int, link_free: int, host_ns: int, transfer_ns: int) -> list[int]:
    """Landing instants (ns) of a batch of ``n`` copies enqueued at ``at`` on the FIFO copy
    stream, free from ``link_free``, while the compute stream places them (``host_ns`` each
    after the enqueue: ``CyclePlan.placing_ns_per_transfer``), as the live engine does
    (``live.h2d.H2DLink.enqueue``): the link takes the batch at ``b = max(at, link_free)`` and
    copy ``j`` lands once its wire time has passed and its own placing is done,
    ``landed_j = max(landed_{j-1} + transfer_ns, at + (j + 1) host_ns)`` (``landed_{-1} = b``),
    which is ``max(b + (j + 1) transfer_ns, at + (j + 1) host_ns)`` in closed form (the
    maximum over the ``k`` copies placed last of ``at + k host + (j + 1 - k) transfer`` is at
    ``k = 0`` or ``k = j + 1``, the expression being linear in ``k``)."""
    b = at if at > link_free else link_free
    return [max(b + k * transfer_ns, at + k * host_ns) for k in range(1, n + 1)]


def _layer_batches(prefetch: Sequence[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """The draft prefetch's ``(layer, expert)`` copies as ``(layer, experts)`` batches of
    consecutive copies of one layer: the live engine places and enqueues them layer by layer
    (``live.offload.OffloadedMoE.prefetch_predicted``)."""
    batches: list[tuple[int, list[int]]] = []
    for layer, expert in prefetch:
        if batches and batches[-1][0] == layer:
            batches[-1][1].append(expert)
        else:
            batches.append((layer, [expert]))
    return batches


def make_engine(name: str, link: LinkSpec, num_layers: int) -> FastEngine | SimPyEngine:
    """Build an engine: ``"fast"``, ``"simpy"`` or ``"auto"`` (fast when ``concurrency == 1``).

    Raises:
        ValueError: unknown name (listing :data:`ENGINES`), or ``"fast"`` with concurrency > 1.
    """
    if name not in ENGINES:
        raise ValueError(f"engine: expected one of {list(ENGINES)}, got {name!r}")
    if name == "simpy" or (name == "auto" and link.concurrency > 1):
        return SimPyEngine(link, num_layers)
    return FastEngine(link, num_layers)
