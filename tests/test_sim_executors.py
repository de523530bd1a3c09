"""sim.executors.run_local with the "forkserver" start method: its workers run the cells (their
parent is the fork server, not the sweep) and still die with the sweep process. Waits are bounded
polls; nothing asserts how fast anything runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_shapes import tiny_sweep_trace

from sim.cells import make_cells, run_cell
from sim.executors import run_local
from sim.presets import DEFAULT_COST, cost_from_preset
from traces.reader import open_run

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 120.0  # bound of every wait (a loaded 2-core machine is slow)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="forkserver and /proc: Linux"
)


def test_forkserver_workers_run_the_cells(tmp_path: Path) -> None:
    trace = tiny_sweep_trace(tmp_path / "tiny")
    model = open_run(trace).manifest.model
    cost = cost_from_preset(DEFAULT_COST, expert_bytes=12_288, num_layers=model.num_layers)
    cells = make_cells(
        trace_path=trace, cost=cost, bandwidths_gb_per_s=[4.0, 32.0], caches=[(2, 0.125)], policies=["ar", "chain"]
    )
    expected = {c.cell_id: run_cell(c.to_dict()) for c in cells}
    rows: list[tuple[str, dict]] = []
    run_local(cells, lambda cell, row: rows.append((cell.cell_id, row)), jobs=2, start_method="forkserver")
    got = dict(rows)
    assert got == expected


# a sweep-like parent: a forkserver pool initialised as run_local's, its workers' pids on stdout,
# then every worker busy and the parent waiting (until the test kills it)
_PARENT = """
import json, multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from sim.executors import PARENT_POLL_S, init_worker

pool = ProcessPoolExecutor(
    2, mp_context=multiprocessing.get_context("forkserver"),
    initializer=init_worker, initargs=(os.getpid(), PARENT_POLL_S, True),
)
pids = sorted({pool.submit(os.getpid).result() for _ in range(4)})
busy = [pool.submit(time.sleep, 600) for _ in range(2)]
print(json.dumps(pids), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return text[text.rindex(")") + 2] != "Z"


def test_forkserver_workers_die_with_the_sweep_process() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, f"the parent ended (exit {proc.poll()}) before its workers ran: {proc.stderr.read()}"
        workers = json.loads(line)
        assert workers and all(_alive(pid) for pid in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while any(_alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"workers {workers} outlived the sweep process"
            time.sleep(0.05)
    finally:  # the whole session (the fork server and its workers too), also when an assert failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
