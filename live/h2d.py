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
    """Handle on one batch of transfers issued by :meth:`H2DLink.fetch`.

    ``num_bytes``: bytes moved; ``num_transfers``: experts moved; ``copy_bytes int64[M]``: bytes of
    each of the M tensor copies, in issue order (an expert is ``copies_per_transfer[i]`` consecutive
    copies, e.g. its gate/up and down matrices); ``copies_per_transfer int64[num_transfers]``.
    :meth:`seconds` returns the H2D time in seconds (CPU: measured wall time of the copies plus
    emulated waiting; CUDA: elapsed time between the copy stream's start and end events, which
    synchronises on the end event); :meth:`copy_seconds` the same split per copy (float64[M],
    summing to :meth:`seconds`: on CPU the gaps between successive ``perf_counter`` stamps taken
    after each copy, on CUDA between successive events recorded on the copy stream).
    """

    __slots__ = (
        "num_bytes",
        "num_transfers",
        "copy_bytes",
        "copies_per_transfer",
        "_seconds",
        "_copy_s",
        "_events",
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

    def _resolve(self) -> None:
        events = self._events
        events[-1].synchronize()
        # CUDA events report milliseconds
        stamps = np.array([events[0].elapsed_time(e) for e in events[1:]], dtype=np.float64) / 1e3
        self._copy_s = np.diff(stamps, prepend=0.0)
        self._seconds = float(stamps[-1]) if stamps.size else 0.0
        self._events = None

    def seconds(self) -> float:
        """Measured H2D seconds of this batch (0.0 for an empty batch)."""
        if self._seconds is None:
            self._resolve()
        return self._seconds

    def copy_seconds(self) -> np.ndarray:
        """float64[M]: measured seconds of each tensor copy (issue order), summing to :meth:`seconds`."""
        if self._copy_s is None:
            self._resolve()
        return self._copy_s


def _wait_until(deadline_s: float) -> None:
    """Return once ``time.perf_counter() >= deadline_s``: sleep the bulk, spin the last ms."""
    while True:
        remaining = deadline_s - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > 2 * _SPIN_BELOW_S:
            time.sleep(remaining - _SPIN_BELOW_S)


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
        if not transfers:
            return H2DFetch(0, 0, seconds=0.0)
        counts = np.fromiter((len(t) for t in transfers), dtype=np.int64, count=len(transfers))
        copy_bytes = np.fromiter(
            (src.numel() * src.element_size() for t in transfers for _, src in t),
            dtype=np.int64,
            count=int(counts.sum()),
        )
        num_bytes = int(copy_bytes.sum())
        if self._copy_stream is not None:
            return self._fetch_cuda(transfers, num_bytes, copy_bytes, counts)
        stamps = np.empty(copy_bytes.size, dtype=np.float64)
        start_s = time.perf_counter()
        copy_start_s = start_s
        bw = self.bandwidth_bytes_per_s
        i = 0
        for transfer in transfers:
            latency_each_s = self.latency_s / len(transfer) if transfer else 0.0
            for dst, src in transfer:
                dst.copy_(src)
                if self.emulated:  # each copy lasts max(memcpy, emulated); no catching up
                    _wait_until(copy_start_s + (copy_bytes[i] / bw if bw else 0.0) + latency_each_s)
                copy_start_s = stamps[i] = time.perf_counter()
                i += 1
        copy_s = np.diff(stamps, prepend=start_s)
        return H2DFetch(
            num_bytes,
            len(transfers),
            seconds=float(stamps[-1] - start_s) if stamps.size else 0.0,
            copy_bytes=copy_bytes,
            copy_seconds=copy_s,
            copies_per_transfer=counts,
        )

    def _fetch_cuda(
        self,
        transfers: Sequence[Sequence[CopyPair]],
        num_bytes: int,
        copy_bytes: np.ndarray,
        counts: np.ndarray,
    ) -> H2DFetch:
        compute = torch.cuda.current_stream(self.device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(copy_bytes.size + 1)]
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            events[0].record(self._copy_stream)
            i = 1
            for transfer in transfers:
                for dst, src in transfer:
                    dst.copy_(src, non_blocking=True)
                    events[i].record(self._copy_stream)
                    i += 1
        compute.wait_event(events[-1])
        return H2DFetch(
            num_bytes, len(transfers), events=events, copy_bytes=copy_bytes, copies_per_transfer=counts
        )
