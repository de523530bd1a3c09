"""The quick cost estimate of a live run prices copies at their MEAN time (live/spec/costs.py):
the cost model sums copy times, so a median, which follows the fast mode of bimodal copy times,
would price a run's copies short."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

SIZES = np.array([4096, 2048], dtype=np.int64)  # one expert: gate/up copy, down copy


class _BimodalLink:
    """A link whose fetch of one expert takes a fast time in 7 of 10 fetches and 4x it in the
    other 3 (an emulated link's late wake-ups, a copy held by another process): every fetch's
    per-copy times are recorded in ``timed``."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls = 0
        self.timed: list[np.ndarray] = []

    def fetch(self, batch):
        fast = 20e-6 / 2 + SIZES / 0.2e9  # 0.2 GB/s + 10 us per copy
        seconds = fast * (4.0 if self.calls % 10 in (3, 6, 9) else 1.0)
        self.calls += 1
        self.timed.append(seconds)
        return SimpleNamespace(copy_bytes=SIZES.copy(), copy_seconds=lambda: seconds.copy())


def test_measure_link_prices_the_timed_copies_at_their_summed_time() -> None:
    from live.spec.costs import measure_link

    link = _BimodalLink()
    store = SimpleNamespace(gate_up=[[torch.zeros(1024)]], down=[[torch.zeros(512)]])
    bytes_per_s, s_per_expert = measure_link(SimpleNamespace(store=store, link=link), repeats=20)
    timed = np.concatenate(link.timed[1:])  # the first fetch is the warm-up
    priced = np.tile(SIZES, len(link.timed) - 1) / bytes_per_s + s_per_expert / len(SIZES)
    # medians priced these copies at 0.53 of their time; means price them at exactly their sum
    assert priced.sum() / timed.sum() == pytest.approx(1.0, rel=1e-9)


def test_memcpy_bandwidth_is_bytes_over_the_summed_copy_time(monkeypatch) -> None:
    import live.spec.costs as costs

    clock = iter(np.cumsum([0.0, 1e-3, 0.0, 1e-3, 0.0, 4e-3, 0.0, 1e-3]))  # copies of 1, 1, 4, 1 ms
    monkeypatch.setattr(costs, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    assert costs.measure_copy_bytes_per_s(7000, repeats=4) == pytest.approx(7000 / 1.75e-3)  # median: 7000 / 1e-3
