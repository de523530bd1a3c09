"""Host-to-device (H2D) expert transfers and their timing.

One :class:`H2DLink` moves expert weights from host memory into the device expert cache:

- ``cuda-pinned`` / ``cuda-pageable``: a dedicated CUDA copy stream; each fetch is bracketed by
  timing events recorded on that stream, and the compute stream waits on the end event, so a layer
  never reads an expert before its copy has landed (fetch-before-compute). Host tensors are pinned
  (page-locked) when possible; when pinning fails the link falls back to pageable memory, warns
  once and reports the kind ``cuda-pageable`` so the timings are tagged as such.
- ``cpu-memcpy``: the "device" expert cache is separate CPU memory and a fetch is a real copy timed
  with ``time.perf_counter``.
- ``cpu-emulated``: as ``cpu-memcpy``, then the link waits until each transfer has taken
  ``num_bytes / bandwidth_bytes_per_s + latency_s`` in total (sleep for the bulk, spin for the last
  millisecond; each tensor copy of the transfer waits for its own share, measured from its own
  start, so a late copy never makes the next one shorter), so PCIe-bound regimes can be reproduced and measured on a CPU. This is the same
  per-transfer model as ``specfit.cost.CycleCostModel.transfer_s`` (bytes / bandwidth + a fixed
  per-transfer term; see docs/reference-figures.md on per-transfer dispatch overhead).

One *transfer* is one expert (its gate/up and down matrices); :meth:`H2DLink.fetch` takes a list of
transfers and returns an :class:`H2DFetch` whose :meth:`H2DFetch.seconds` is the measured H2D time
(resolved lazily from CUDA events, so the host never blocks on timing inside a forward pass).

Overlap (``H2DLink.enqueue``): the copies run on the link's own *copy stream* (the resource named
``h2d`` in docs/design.md and the simulator) while the caller's *compute stream* goes on, and the
caller waits for each transfer on its own (:meth:`H2DFetch.wait_transfer`) right before computing
the expert it brings. On CUDA the copy stream is the dedicated ``torch.cuda.Stream`` and the wait is
``Stream.wait_event`` on the transfer's end event (the host does not block; PyTorch docs,
"CUDA semantics", streams and events). On the CPU links the copy stream is a *clock*, as a DMA
copy engine is to the host: :meth:`H2DLink.enqueue` does the memcpys at once (host time, recorded
by the caller as placing) and gives each copy its landing instant on a FIFO link clock,
``landed_j = max(landed_{j-1} + bytes_j / bandwidth + latency_s / copies, memcpy end_j)`` (the
same FIFO recurrence as ``sim.engine.FastEngine``); a copy counts as landed once ``perf_counter``
passes that instant, and waiting for it sleeps (then spins the last millisecond) until then. No
thread: a copy-stream thread would compete with the compute thread for the GIL and for the cores
(on 2 shared cores it made overlap slower than no overlap), and its sleep overshoot would move
the landings. Every copy records when it was enqueued, started and landed
(:meth:`H2DFetch.copy_spans`), and on the CPU copy stream also when its memcpy ended
(:meth:`H2DFetch.placed_at`): the compute stream's placing after the enqueue, which
``calibration.costfit.fit_placing_after_enqueue`` fits and ``sim.engine`` models
(``CyclePlan.placing_ns_per_transfer``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

LINK_KINDS = ("cuda-pinned", "cuda-pageable", "cpu-memcpy", "cpu-emulated")

# Below this remaining wait the emulated link spins instead of sleeping (sleep overshoots ~0.1 ms).
_SPIN_BELOW_S = 1e-3

CopyPair = tuple[torch.Tensor, torch.Tensor]
"""(dst, src): one tensor copy; a transfer is a sequence of these (an expert's matrices)."""


@dataclass(frozen=True)
class H2DLinkInfo:
    """What a run's manifest records about the link (see ``traces.schema.HardwareSpec``).

    ``device``: the device name (e.g. ``"cpu"`` or ``"NVIDIA H200"``); ``kind``: one of
    ``LINK_KINDS``; ``bandwidth_bytes_per_s`` and ``latency_s``: the emulated link's parameters
    (``None`` / 0 for real links); ``pinned``: whether host expert memory is page-locked.
    """

    device: str
    kind: str
    bandwidth_bytes_per_s: float | None
    latency_s: float
    pinned: bool

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        return asdict(self)


class H2DFetch:
    """Handle on one batch of transfers issued by :meth:`H2DLink.fetch` or :meth:`H2DLink.enqueue`.

    ``num_bytes``: bytes moved; ``num_transfers``: experts moved; ``copy_bytes int64[M]``: bytes of
    each of the M tensor copies, in issue order (an expert is ``copies_per_transfer[i]`` consecutive
    copies, e.g. its gate/up and down matrices); ``copies_per_transfer int64[num_transfers]``.
    :meth:`seconds` returns the H2D time in seconds (CPU: measured wall time of the copies plus
    emulated waiting; CUDA: elapsed time between the copy stream's start and end events, which
    synchronises on the end event); :meth:`copy_seconds` the same split per copy (float64[M],
    summing to :meth:`seconds`: on CPU the gaps between successive ``perf_counter`` stamps taken
    after each copy, on CUDA between successive events recorded on the copy stream).
    :meth:`copy_spans` gives each copy's enqueue, start and landing instants; :meth:`wait_transfer`
    and :meth:`transfer_landed` serve fetch-before-compute per expert. A batch from
    :meth:`H2DLink.fetch` has landed on return (CPU) or is waited for as a whole by the compute
    stream (CUDA); one from :meth:`H2DLink.enqueue` is waited for transfer by transfer.
    """

    __slots__ = (
        "num_bytes",
        "num_transfers",
        "copy_bytes",
        "copies_per_transfer",
        "enqueued_at",
        "_seconds",
        "_copy_s",
        "_events",
        "_start",
        "_stamps",
        "_placed_at_s",
        "_landing_s",
        "_spin_below_s",
        "_device",
    )

    def __init__(
        self,
        num_bytes: int,
        num_transfers: int,
        seconds: float | None = None,
        events: list[torch.cuda.Event] | tuple[torch.cuda.Event, ...] | None = None,
        *,
        copy_bytes: np.ndarray | None = None,
        copy_seconds: np.ndarray | None = None,
        copies_per_transfer: np.ndarray | None = None,
    ) -> None:
        self.num_bytes = int(num_bytes)
        self.num_transfers = int(num_transfers)
        self._seconds = seconds
        self._events = events
        self.copy_bytes = np.zeros(0, dtype=np.int64) if copy_bytes is None else copy_bytes
        self.copies_per_transfer = (
            np.zeros(0, dtype=np.int64) if copies_per_transfer is None else copies_per_transfer
        )
        self._copy_s = copy_seconds
        if copy_seconds is None and events is None:
            self._copy_s = np.zeros(len(self.copy_bytes), dtype=np.float64)
        # when the batch was enqueued: perf_counter seconds (CPU) or an event on the compute stream
        self.enqueued_at = None
        self._start = None  # CPU: perf_counter when the copy stream began the batch
        self._stamps = None  # CPU: float64[M] perf_counter instant each copy landed
        self._placed_at_s: list[float] | None = None  # CPU copy stream: perf_counter instant (s) each memcpy ended
        self._landing_s: np.ndarray | None = None  # CPU enqueue: float64[num_transfers] landings
        self._spin_below_s = _SPIN_BELOW_S
        self._device: torch.device | None = None  # CUDA: the device whose current stream waits

    def _resolve(self) -> None:
        events = self._events
        events[-1].synchronize()
        # CUDA events report milliseconds
        stamps = np.array([events[0].elapsed_time(e) for e in events[1:]], dtype=np.float64) / 1e3
        self._copy_s = np.diff(stamps, prepend=0.0)
        self._seconds = float(stamps[-1]) if stamps.size else 0.0

    def _last_copy_of(self, transfer: int) -> int:
        return int(self.copies_per_transfer[: transfer + 1].sum()) - 1

    def seconds(self) -> float:
        """Measured H2D seconds of this batch (0.0 for an empty batch)."""
        if self._seconds is None:
            self._resolve()
        return self._seconds

    def copy_seconds(self) -> np.ndarray:
        """float64[M]: measured seconds of each tensor copy (issue order), summing to :meth:`seconds`."""
        if self._copy_s is None:
            if self._stamps is not None:  # CPU: gaps between successive landings
                self._copy_s = np.diff(self._stamps, prepend=self._start)
            else:
                self._resolve()
        return self._copy_s

    def wait_transfer(self, transfer: int) -> None:
        """Make the compute stream wait until ``transfer`` (0-based, issue order) has landed.

        CPU: blocks the calling thread until the transfer's landing instant on the link clock
        (sleeps, then spins the last millisecond; returns at once for a batch from
        :meth:`H2DLink.fetch`). CUDA: ``current_stream.wait_event`` on the transfer's end event;
        the host does not block.
        """
        if self._landing_s is not None:
            _wait_until(self._landing_s[transfer], self._spin_below_s)
        elif self._events is not None:
            torch.cuda.current_stream(self._device).wait_event(self._events[self._last_copy_of(transfer) + 1])

    def done(self) -> bool:
        """Whether every copy of the batch has landed, without waiting: CPU, the link clock has
        passed its last landing; CUDA, ``Event.query()`` on the batch's last event (the engine
        synchronises only the compute stream at the end of a forward, so copies nobody waited for
        stay in flight into the next forward, as on the CPU copy stream)."""
        if self._landing_s is not None:
            return time.perf_counter() >= self._landing_s[-1]
        if self._events is not None and self._seconds is None:
            return bool(self._events[-1].query())
        return True

    def transfer_landed(self, transfer: int) -> bool:
        """Whether ``transfer`` has landed, without waiting. CPU: exact. CUDA: ``False`` (the host
        runs ahead of both streams, so each transfer is waited for on its own)."""
        if self._landing_s is not None:
            return time.perf_counter() >= self._landing_s[transfer]
        return self._events is None

    def landed_after_s(self, transfer: int, mark) -> float:
        """CUDA: seconds from ``mark`` (an event recorded on the compute stream) to the landing
        of ``transfer``, 0 if it landed before ``mark``: the compute stream's stall on it.
        Synchronises on the batch."""
        self.seconds()
        return max(mark.elapsed_time(self._events[self._last_copy_of(transfer) + 1]) / 1e3, 0.0)

    def copy_spans(self, origin) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(enqueued_at_s, started_at_s, landed_at_s)``, each float64[M]: seconds from ``origin``
        (a ``perf_counter`` value on CPU, a CUDA event on the compute stream on CUDA) to the
        batch's enqueue, to each copy's start on the copy stream, and to its landing. A copy
        starts when the previous one of its batch landed (the first: when the copy stream took
        the batch). Synchronises on CUDA; on CPU the instants are known at enqueue (the link
        clock), so nothing waits."""
        m = self.copy_bytes.size
        if self._events is not None:  # CUDA
            self.seconds()
            ms = np.array([origin.elapsed_time(e) for e in self._events], dtype=np.float64) / 1e3
            enq = origin.elapsed_time(self.enqueued_at) / 1e3 if self.enqueued_at is not None else ms[0]
            return np.full(m, enq), ms[:-1], ms[1:]
        if self._stamps is None or self._start is None:
            zeros = np.zeros(m, dtype=np.float64)
            return zeros, zeros, zeros
        landed = self._stamps - origin
        started = np.concatenate(([self._start - origin], landed[:-1]))
        enqueued = self.enqueued_at if self.enqueued_at is not None else self._start
        return np.full(m, enqueued - origin), started, landed


    def placed_at(self, origin: float) -> np.ndarray:
        """float64[M]: seconds from ``origin`` (a ``perf_counter`` value) to the end of each copy's
        host memcpy on the CPU copy stream (:meth:`H2DLink.enqueue`: the memcpys run on the
        compute thread after the batch's enqueue, so the last one's end minus the enqueue is the
        batch's placing after the enqueue). NaN where not measured: a batch from
        :meth:`H2DLink.fetch` (no copy stream) and CUDA (the host only queues its copies)."""
        if self._placed_at_s is None:
            return np.full(self.copy_bytes.size, np.nan)
        return np.array(self._placed_at_s, dtype=np.float64) - origin


def _wait_until(deadline_s: float, spin_below_s: float = _SPIN_BELOW_S) -> None:
    """Return once ``time.perf_counter() >= deadline_s``: sleep the bulk, spin the last
    ``spin_below_s`` (sleep overshoots by ~0.1 ms, more on a loaded machine; 0 = sleep only, for a
    fake clock whose sleep is exact)."""
    while True:
        remaining = deadline_s - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > 2 * spin_below_s:
            time.sleep(remaining - spin_below_s)


class H2DLink:
    """The link between host expert memory and the device expert cache.

    Args:
        device: where the expert cache lives (``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a
            ``torch.device``).
        bandwidth_bytes_per_s: emulated link bandwidth (CPU only; ``None`` = plain memcpy).
        latency_s: emulated fixed cost per transfer (one expert), CPU only, >= 0.
        pin_memory: on CUDA, try to page-lock host expert tensors (default ``True``).

    Raises:
        ValueError: bandwidth <= 0 or not finite, latency < 0, or an emulated link asked for on
            CUDA (the emulation sleeps on the host; on a GPU the real link is measured).
    """

    spin_below_s = _SPIN_BELOW_S  # waits for a landing spin their last ms (0: sleep only)

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        bandwidth_bytes_per_s: float | None = None,
        latency_s: float = 0.0,
        pin_memory: bool = True,
    ) -> None:
        self.device = torch.device(device)
        if bandwidth_bytes_per_s is not None:
            bw = float(bandwidth_bytes_per_s)
            if not bw > 0 or bw == float("inf"):
                raise ValueError(
                    f"bandwidth_bytes_per_s: expected a finite number > 0, got {bandwidth_bytes_per_s!r}"
                )
            bandwidth_bytes_per_s = bw
        if not float(latency_s) >= 0:
            raise ValueError(f"latency_s: expected a number >= 0, got {latency_s!r}")
        self.emulated = bandwidth_bytes_per_s is not None or float(latency_s) > 0
        if self.emulated and self.device.type != "cpu":
            raise ValueError(
                "an emulated link (bandwidth/latency) is only available with device 'cpu'; "
                f"on {self.device} the real link is measured"
            )
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {str(self.device)!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {str(self.device)!r} requested but CUDA is not available here")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = float(latency_s)
        self._want_pinned = bool(pin_memory) and self.device.type == "cuda"
        self._pinned = self._want_pinned
        self._warned_pageable = False
        self._copy_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._link_free_s = 0.0  # CPU: perf_counter instant the last copy enqueued so far lands

    # -- description ---------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """One of ``LINK_KINDS``."""
        if self.device.type == "cuda":
            return "cuda-pinned" if self._pinned else "cuda-pageable"
        return "cpu-emulated" if self.emulated else "cpu-memcpy"

    @property
    def info(self) -> H2DLinkInfo:
        """Manifest description of this link."""
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return H2DLinkInfo(
            device=name,
            kind=self.kind,
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            latency_s=self.latency_s,
            pinned=self._pinned,
        )

    def transfer_s(self, num_bytes: int) -> float:
        """Emulated duration of one transfer of ``num_bytes`` (0.0 for a real link)."""
        if not self.emulated:
            return 0.0
        bw_s = num_bytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s else 0.0
        return bw_s + self.latency_s

    # -- host memory ---------------------------------------------------------------------------
    def prepare_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return ``tensor`` in host memory suited to this link (pinned on CUDA when possible).

        On CPU links this is the CPU tensor itself (no copy when already on the CPU). On CUDA,
        pinning failures fall back to pageable memory: one ``RuntimeWarning``, and ``kind``
        becomes ``cuda-pageable`` for every later timing.
        """
        host = tensor.detach().to("cpu")
        if not self._want_pinned:
            return host.contiguous()
        if self._pinned:
            try:
                return host.contiguous().pin_memory()
            except RuntimeError as exc:
                self._pinned = False
                if not self._warned_pageable:
                    self._warned_pageable = True
                    warnings.warn(
                        f"pinning host expert memory failed ({exc}); using pageable memory, "
                        "H2D timings are tagged 'cuda-pageable'",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        return host.contiguous()

    # -- transfers -----------------------------------------------------------------------------
    def fetch(self, transfers: Sequence[Sequence[CopyPair]]) -> H2DFetch:
        """Copy each transfer's ``src`` host tensors into their ``dst`` device tensors.

        ``transfers``: one entry per expert, each a sequence of ``(dst, src)`` pairs of equal
        shape. On return (CPU) the copies are complete; on CUDA they are queued on the copy stream
        after all work already queued on the current stream (so no slot is overwritten while an
        earlier layer still reads it), and the current stream waits for them. Every copy is timed
        on its own (:meth:`H2DFetch.copy_seconds`). The emulated link charges each copy
        ``bytes / bandwidth + latency_s / copies of its expert``, so a whole expert costs exactly
        :meth:`transfer_s` of its bytes while per-copy timings of different sizes identify
        bandwidth and latency (``calibration.link.fit_link``).
        """
        fetch = self._new_fetch(transfers)
        if fetch.num_transfers == 0:
            return fetch
        if self._copy_stream is not None:
            self._enqueue_cuda(transfers, fetch)
            torch.cuda.current_stream(self.device).wait_event(fetch._events[-1])
            return fetch
        _wait_until(self._link_free_s, self.spin_below_s)  # FIFO: after the copies already in flight
        fetch.enqueued_at = time.perf_counter()
        self._copy_cpu(transfers, fetch)
        return fetch

    def enqueue(self, transfers: Sequence[Sequence[CopyPair]]) -> H2DFetch:
        """Start copying ``transfers`` on the copy stream and return at once (overlap).

        Same copies, timing and emulation as :meth:`fetch`, but the caller must call
        :meth:`H2DFetch.wait_transfer` for each transfer before reading its ``dst`` tensors.
        Batches run in FIFO order after every batch enqueued earlier. CPU: the memcpys are done
        here (host time) and each copy gets its landing instant on the link clock (see the module
        docstring); a copy that cannot be made raises here. CUDA: the dedicated copy stream,
        after the work already queued on the current stream (so no slot is overwritten while an
        earlier layer reads it).
        """
        fetch = self._new_fetch(transfers)
        if fetch.num_transfers == 0:
            return fetch
        if self._copy_stream is not None:
            self._enqueue_cuda(transfers, fetch)
            return fetch
        fetch.enqueued_at = time.perf_counter()
        self._copy_ahead(transfers, fetch)
        return fetch

    def synchronize(self) -> None:
        """Wait until every copy enqueued so far has landed (CUDA: the copy stream; CPU: the link
        clock's last landing)."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        else:
            _wait_until(self._link_free_s, self.spin_below_s)

    def close(self) -> None:
        """Release the link (nothing to stop: the CPU copy stream is a clock); idempotent."""

    def _new_fetch(self, transfers: Sequence[Sequence[CopyPair]]) -> H2DFetch:
        if not transfers:
            return H2DFetch(0, 0, seconds=0.0)
        sizes = [src.numel() * src.element_size() for t in transfers for _, src in t]
        fetch = H2DFetch(
            sum(sizes),
            len(transfers),
            copy_bytes=np.array(sizes, dtype=np.int64),
            copies_per_transfer=np.array([len(t) for t in transfers], dtype=np.int64),
        )
        fetch._copy_s = fetch._seconds = None
        return fetch

    def _wire_s(self, fetch: H2DFetch) -> np.ndarray:
        """float64[M]: emulated seconds of each copy, ``bytes / bandwidth + latency_s / copies of
        its expert`` (zeros for a real link: a copy lasts its memcpy)."""
        if not self.emulated:
            return np.zeros(fetch.copy_bytes.size, dtype=np.float64)
        bw = self.bandwidth_bytes_per_s
        wire = fetch.copy_bytes / bw if bw else np.zeros(fetch.copy_bytes.size, dtype=np.float64)
        return wire + np.repeat(self.latency_s / fetch.copies_per_transfer, fetch.copies_per_transfer)

    def _finish(self, fetch: H2DFetch, start_s: float, stamps: np.ndarray) -> None:
        fetch._start, fetch._stamps = start_s, stamps  # copy_seconds() derives the split from them
        fetch._seconds = float(stamps[-1] - start_s) if stamps.size else 0.0

    def _copy_cpu(self, transfers: Sequence[Sequence[CopyPair]], fetch: H2DFetch) -> None:
        """Synchronous copies: copy, wait out the emulated wire time (spinning the last ms), stamp
        each copy; each copy lasts max(memcpy, emulated), measured from its own start (a late
        copy never makes the next one shorter)."""
        wire_s = self._wire_s(fetch)
        stamps = np.empty(wire_s.size, dtype=np.float64)
        start_s = copy_start_s = time.perf_counter()
        i = 0
        for transfer in transfers:
            for dst, src in transfer:
                dst.copy_(src)
                if self.emulated:
                    _wait_until(copy_start_s + wire_s[i], self.spin_below_s)
                copy_start_s = stamps[i] = time.perf_counter()
                i += 1
        self._link_free_s = max(self._link_free_s, copy_start_s)
        self._finish(fetch, start_s, stamps)

    def _copy_ahead(self, transfers: Sequence[Sequence[CopyPair]], fetch: H2DFetch) -> None:
        """The CPU copy stream: memcpy every copy now, land it on the FIFO link clock,
        ``landed_j = max(landed_{j-1} + wire_j, memcpy end_j)`` from ``max(now, link free)``.
        Plain Python floats on the hot path (a few copies per layer: numpy calls cost more than
        they save)."""
        bw = self.bandwidth_bytes_per_s if self.emulated else None
        latency_s = self.latency_s if self.emulated else 0.0
        clock = time.perf_counter
        start_s = landed_s = max(fetch.enqueued_at, self._link_free_s)
        stamps, landings, placed = [], [], []
        nbytes = iter(fetch.copy_bytes.tolist())
        for transfer in transfers:
            latency_each_s = latency_s / len(transfer)
            for dst, src in transfer:
                dst.copy_(src)
                landed_s += (next(nbytes) / bw if bw else 0.0) + latency_each_s
                now_s = clock()
                placed.append(now_s)
                if now_s > landed_s:  # the memcpy outlasted the emulated wire
                    landed_s = now_s
                stamps.append(landed_s)
            landings.append(landed_s)
        self._link_free_s = landed_s
        fetch._landing_s = landings
        fetch._placed_at_s = placed
        fetch._spin_below_s = self.spin_below_s
        self._finish(fetch, start_s, np.array(stamps))

    def _enqueue_cuda(self, transfers: Sequence[Sequence[CopyPair]], fetch: H2DFetch) -> None:
        """Queue the copies on the copy stream, bracketed by timing events (one before the batch,
        one after each copy); the compute stream records the enqueue instant."""
        compute = torch.cuda.current_stream(self.device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(fetch.copy_bytes.size + 1)]
        fetch.enqueued_at = torch.cuda.Event(enable_timing=True)
        fetch.enqueued_at.record(compute)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            events[0].record(self._copy_stream)
            i = 1
            for transfer in transfers:
                for dst, src in transfer:
                    dst.copy_(src, non_blocking=True)
                    events[i].record(self._copy_stream)
                    i += 1
        fetch._events = events
        fetch._device = self.device
