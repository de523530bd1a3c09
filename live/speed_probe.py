"""A machine-speed gauge independent of the decoding: a fixed small torch workload, timed.

``live.record`` times :func:`probe_once` a few times before its first request and after each
request (``live.spec.session.RecordSession.run``), outside every timed cycle, and writes the
timings to ``summary.json`` (``speed_probe_s``: seconds per probe, in order; ``speed_probe_median_s``).
The workload looks like a decode step's compute, not like a benchmark kernel: after a
``PROBE_GAP_S`` pause (untimed; the memory it touches goes cold, as between a decode's phases:
README, issue 14's cold-page finding) a chain of ``PROBE_CHAIN`` small products ``tanh(y @ w[i])``
of a float32 ``[PROBE_ROWS, PROBE_SIZE]`` activation through ``PROBE_CHAIN`` distinct
``PROBE_SIZE x PROBE_SIZE`` weights, on the run's device with the run's torch thread count (about
1 ms on one thread of this project's CPU machine). Its data are fixed, so its time varies only
with the machine. On the embedded default at 1 GB/s (README, validate) it correlated 0.69 per run
with the runs' attention + router speed, a warm 8 x 128x128 matrix chain in the same runs 0.62.
``analysis.validate`` divides a cell's median by its cost's fit runs' median to price the cell at
the speed its runs saw (``specfit.cost.CycleCostModel.with_compute_speed``). On CUDA the chain runs
on the device and is timed between two ``torch.cuda.synchronize`` calls (launch overhead included).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

PROBE_SIZE = 64  # weight side (elements)
PROBE_ROWS = 8  # activation rows, like a small draft tree's nodes (count)
PROBE_CHAIN = 48  # distinct weights multiplied in turn (count)
PROBE_GAP_S = 0.005  # untimed pause before each probe (s)
PROBES_PER_POINT = 16  # probes at each point: before the first request, after each request (count)


def probe_inputs(device: str = "cpu") -> tuple[Any, Any]:
    """The fixed operands ``(x float32[PROBE_ROWS, PROBE_SIZE], w)`` on ``device``, ``w`` a tuple
    of ``PROBE_CHAIN`` separate float32 ``[PROBE_SIZE, PROBE_SIZE]`` tensors (distinct allocations,
    as a model's weights are): seeded, scaled by ``1/sqrt(PROBE_SIZE)`` so the chain stays bounded."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(PROBE_ROWS, PROBE_SIZE, generator=gen)
    w = tuple((torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen) / PROBE_SIZE**0.5).to(device) for _ in range(PROBE_CHAIN))
    return x.to(device), w


def probe_once(x: Any, w: Any) -> float:
    """Seconds one chain ``y = tanh(y @ w[i])`` over the ``PROBE_CHAIN`` weights takes, from
    ``y = x``, after an untimed ``PROBE_GAP_S`` pause (wall clock, ``time.perf_counter``; CUDA
    synchronised before and after)."""
    import torch

    cuda = x.is_cuda
    time.sleep(PROBE_GAP_S)
    if cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    with torch.inference_mode():
        y = x
        for weight in w:
            y = torch.tanh(y @ weight)
    if cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


@dataclass
class SpeedProbe:
    """The probe's timings of one ``live.record`` call (seconds, in the order taken)."""

    device: str = "cpu"
    seconds: list[float] = field(default_factory=list)
    _inputs: tuple[Any, Any] | None = field(default=None, init=False, repr=False)  # built on first use

    def measure(self, num_probes: int = PROBES_PER_POINT) -> None:
        """Time the workload ``num_probes`` (count) times and keep the timings (s)."""
        if self._inputs is None:
            self._inputs = probe_inputs(self.device)
        self.seconds.extend(probe_once(*self._inputs) for _ in range(num_probes))

    def summary(self) -> dict[str, Any]:
        """``speed_probe_s`` (list of s), ``speed_probe_median_s`` (s; NaN without timings) and
        the workload (``speed_probe_workload``) for ``summary.json``."""
        return {
            "speed_probe_s": list(self.seconds),
            "speed_probe_median_s": statistics.median(self.seconds) if self.seconds else float("nan"),
            "speed_probe_workload": (
                f"tanh(y @ w) through {PROBE_CHAIN} float32 {PROBE_SIZE}x{PROBE_SIZE} weights, y {PROBE_ROWS} rows, "
                f"after a {PROBE_GAP_S * 1e3:g} ms pause, on {self.device}"
            ),
        }
