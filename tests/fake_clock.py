"""A deterministic stand-in for ``time.perf_counter`` / ``time.sleep`` (no wall-clock assertions).

Unit tests must not assert on measured time (they fail on a loaded machine; speed aims live in
``benchmarks/``). Code under test that times itself with ``time.perf_counter`` and waits with
``time.sleep`` (the emulated H2D link, the decode loop's clocks) runs against a :class:`FakeClock`
instead: ``sleep(s)`` advances the clock by exactly ``s`` (plus an optional fixed overshoot, to
stand in for a late wake-up), every ``perf_counter()`` call advances it by ``tick_s`` (so spin
loops end and stamps are strictly increasing), and nothing else takes any time. Timings then
follow from the code's logic alone and can be asserted exactly.

Use the ``fake_clock`` fixture (tests/conftest.py), which installs one for the test, or
``FakeClock().install(monkeypatch)``.
"""

from __future__ import annotations

import threading
import time


class FakeClock:
    """Fake ``perf_counter`` and ``sleep`` sharing one time line (seconds).

    Args:
        tick_s: seconds each clock read advances the clock (default 100 ns, about what a real
            read and the work around it take; a spin-wait of ``w`` seconds reads ``w / tick_s`` times).
        sleep_overshoot_s: extra seconds each ``sleep`` call lasts (default 0).
        start_s: the first reading.
    """

    def __init__(self, tick_s: float = 1e-7, sleep_overshoot_s: float = 0.0, start_s: float = 1000.0) -> None:
        self.tick_s = float(tick_s)
        self.sleep_overshoot_s = float(sleep_overshoot_s)
        self.now_s = float(start_s)
        self.reads = 0
        self.sleeps: list[float] = []
        self._lock = threading.Lock()

    def perf_counter(self) -> float:
        """Current fake time, then advance by ``tick_s``."""
        with self._lock:
            self.reads += 1
            self.now_s += self.tick_s
            return self.now_s

    def sleep(self, seconds: float) -> None:
        """Advance by ``seconds`` (negative counts as 0) plus ``sleep_overshoot_s``; record the call."""
        with self._lock:
            self.sleeps.append(float(seconds))
            self.now_s += max(float(seconds), 0.0) + self.sleep_overshoot_s

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass (a stand-in for work that takes time)."""
        with self._lock:
            self.now_s += float(seconds)

    def install(self, monkeypatch) -> FakeClock:
        """Replace ``time.perf_counter`` and ``time.sleep`` for the test (``monkeypatch`` undoes it).

        Modules that ``import time`` and call ``time.perf_counter()`` see the fake; names bound
        earlier with ``from time import ...`` (pytest's own timers) keep the real clock.
        """
        monkeypatch.setattr(time, "perf_counter", self.perf_counter)
        monkeypatch.setattr(time, "sleep", self.sleep)
        return self
