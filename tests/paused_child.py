"""Child processes for the kill tests: a CLI that pauses at a chosen point until the test signals it.

A SIGKILL/SIGTERM test must hit its child mid-run. Waiting for a file the child writes and then
signalling races the child (a fast host could finish the run in between), so the child here runs
the CLI's ``main`` with one test-only patch that writes ``marker`` (its pid) at a known point and
then sleeps until a signal arrives (bounded: a test that died leaves no orphan behind). Nothing
depends on how fast anything runs.

- ``live.record``: pauses inside the second request, after its first cycle was handed to the trace
  writer: request 0 is finished and flushed, request 1 is in progress.
- ``sim.sweep``: pauses in the sweep process right after the first finished cell was recorded
  (``sim.executors.run_local``'s ``on_result``); pool workers stay alive, as in any running sweep.
  With workers, the sweep's stop handler terminates them and returns (it raises nothing), so the
  pause ends when they are gone and the sweep goes on to its shutdown as it would from ``wait``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

PAUSE_BOUND_S = 600.0  # the child exits by itself (code 3) after this long without a signal

_PRELUDE = f"""
import os, sys, time
from pathlib import Path

MARKER = Path(sys.argv.pop(1))

def pause(resume=lambda: False):
    MARKER.write_text(str(os.getpid()))
    deadline = time.monotonic() + {PAUSE_BOUND_S}
    while time.monotonic() < deadline:
        if resume():
            return
        time.sleep(0.05)  # a signal handler runs here; an exception it raises ends the pause
    os._exit(3)
"""

_PATCHES = {
    "live.record": """
from live.spec.engine import SpecDecoder

_generate, _calls = SpecDecoder.generate, []

def generate(self, *args, on_cycle=None, **kwargs):
    _calls.append(1)

    def on_cycle_then_pause(event):
        on_cycle(event)
        if len(_calls) == 2:
            pause()

    return _generate(self, *args, on_cycle=on_cycle_then_pause, **kwargs)

SpecDecoder.generate = generate
from live.record import main
""",
    "sim.sweep": """
import multiprocessing

import sim.executors

_run_local = sim.executors.run_local

def run_local(cells, on_result, **kwargs):
    def on_result_then_pause(cell, row):
        on_result(cell, row)
        if multiprocessing.active_children():  # the sweep's stop handler terminates the workers
            pause(resume=lambda: not multiprocessing.active_children())  # and returns: go on
        else:
            pause()

    return _run_local(cells, on_result_then_pause, **kwargs)

sim.executors.run_local = run_local
from sim.sweep import main
""",
}

_RUN = """
from specfit.cli import run_main

run_main(main)
"""


def paused_command(module: str, marker: Path, argv: list[str]) -> list[str]:
    """The command line of ``python -m MODULE ARGV`` that pauses where the module docstring says,
    writing ``marker`` when it does."""
    return [sys.executable, "-c", _PRELUDE + _PATCHES[module] + _RUN, str(marker), *argv]


def wait_for_pause(proc, marker: Path, bound_s: float = 300.0) -> None:
    """Return once the child wrote ``marker``; fail (with the child's stderr) if it ended first.
    The bound only stops a broken test from hanging; nothing is asserted about speed."""
    import pytest

    deadline = time.monotonic() + bound_s
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"the child ended (exit {proc.returncode}) before pausing: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the child did not reach its pause within {bound_s:.0f} s")
        time.sleep(0.02)
