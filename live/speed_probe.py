"""A machine-speed gauge independent of the decoding: a fixed small torch workload, timed.

``live.record`` times :func:`probe_once` a few times before its first request and after each
request (``live.spec.session.RecordSession.run``), outside every timed cycle, and writes the
timings to ``summary.json`` (``speed_probe_s``: seconds per probe, in order; ``speed_probe_median_s``).
The workload is a chain of ``PROBE_CHAIN`` float32 ``PROBE_SIZE x PROBE_SIZE`` matrix products on
the run's device with the run's torch thread count (about 0.3-1 ms on one thread of this
project's CPU machine); its data are fixed, so its time varies only with the machine's speed.
``analysis.validate`` divides a cell's median by its cost's fit runs' median to price the cell at
the speed its runs saw (``specfit.cost.CycleCostModel.with_compute_speed``; README, validate).
On CUDA the chain runs on the device and is timed between two ``torch.cuda.synchronize`` calls
(launch overhead included).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

PROBE_SIZE = 128  # matrix side (elements)
PROBE_CHAIN = 8  # matrix products per probe (count)
PROBES_PER_POINT = 16  # probes at each point: before the first request, after each request (count)


def probe_inputs(device: str = "cpu") -> tuple[Any, Any]:
    """The fixed operands ``(x float32[PROBE_SIZE, PROBE_SIZE], w float32[PROBE_SIZE, PROBE_SIZE])``
    on ``device``: seeded, ``w`` scaled by ``1/sqrt(PROBE_SIZE)`` so the chain stays bounded."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen)
    w = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen) / PROBE_SIZE**0.5
    return x.to(device), w.to(device)


def probe_once(x: Any, w: Any) -> float:
    """Seconds one chain of ``PROBE_CHAIN`` products ``x @ w @ w ...`` takes (wall clock,
    ``time.perf_counter``; CUDA synchronised before and after)."""
    import torch

    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    with torch.inference_mode():
        y = x
        for _ in range(PROBE_CHAIN):
            y = y @ w
    if cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


@dataclass
class SpeedProbe:
    """The probe's timings of one ``live.record`` call (seconds, in the order taken)."""

    device: str = "cpu"
    seconds: list[float] = field(default_factory=list)
    _inputs: tuple[Any, Any] | None = None

    def measure(self, times: int = PROBES_PER_POINT) -> None:
        """Time the workload ``times`` times and keep the timings."""
        if self._inputs is None:
            self._inputs = probe_inputs(self.device)
        self.seconds.extend(probe_once(*self._inputs) for _ in range(times))

    def summary(self) -> dict[str, Any]:
        """``speed_probe_s`` (list of s), ``speed_probe_median_s`` (s; NaN without timings) and
        the workload (``speed_probe_workload``) for ``summary.json``."""
        return {
            "speed_probe_s": list(self.seconds),
            "speed_probe_median_s": statistics.median(self.seconds) if self.seconds else float("nan"),
            "speed_probe_workload": f"{PROBE_CHAIN} float32 {PROBE_SIZE}x{PROBE_SIZE} matmuls on {self.device}",
        }
