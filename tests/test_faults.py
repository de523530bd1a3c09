"""Faults (issue 15 item 3): real processes killed with SIGKILL and SIGTERM, and what survives.

``sim.sweep``: pool workers die with their parent whatever signal ends it (checked by pid), SIGTERM
keeps the finished cells like Ctrl-C, and a sweep with another grid into the same ``--out`` keeps
every finished cell or refuses (exit 2, nothing changed). A killed sweep is paused mid-run by a
test-only patch (``paused_child``), so no signal races the end of the run; waits poll files and
pids with bounds; nothing asserts how fast anything runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
from paused_child import paused_command, wait_for_pause
from tiny_shapes import tiny_sweep_trace

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 120.0  # bound of every wait for a process or file (a loaded 2-core machine is slow)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_sweep_trace(tmp_path_factory.mktemp("faults") / "tiny")


def _sweep_argv(trace: str, out: Path, bandwidths: str = "8,16", jobs: int = 1, *extra: str) -> list[str]:
    return [
        "--trace", trace, "--bandwidth", bandwidths, "--cache", "2", "--policy", "ar,chain",
        "--out", str(out), "--no-progress", "--no-figures", "--jobs", str(jobs), *extra,
    ]  # fmt: skip


def _children(pid: int) -> set[int]:
    """Pids of the live processes whose parent is ``pid`` (Linux ``/proc``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] != "Z" and int(stat[1]) == pid:
                found.add(int(entry.name))
    return found


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` fields after the command name (state, ppid, ...), None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its new parent to reap it)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _wait_until(condition, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the process ended (exit {proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _popen_sweep(trace: str, out: Path, jobs: int) -> subprocess.Popen:
    """``python -m sim.sweep`` of 40 cells that pauses once the first cell is recorded (until the
    test signals it: ``paused_child``), in its own process group (a signal to it alone is not a
    terminal's Ctrl-C)."""
    bandwidths = ",".join(str(b) for b in range(1, 21))
    return subprocess.Popen(
        paused_command(
            "sim.sweep", out.with_name(out.name + ".paused"), _sweep_argv(trace, out, bandwidths, jobs)
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _start_pool_sweep(trace: str, out: Path) -> tuple[subprocess.Popen, set[int]]:
    """A sweep of 40 cells on 2 workers, returned once it paused after its first cell with both
    workers alive."""
    proc = _popen_sweep(trace, out, jobs=2)
    wait_for_pause(proc, out.with_name(out.name + ".paused"))
    workers: set[int] = set()

    def ready() -> bool:
        workers.update(_children(proc.pid))
        return len(workers) >= 2

    _wait_until(ready, "two workers", proc)
    return proc, workers


def _assert_workers_gone(workers: set[int]) -> None:
    _wait_until(lambda: not any(_alive(pid) for pid in workers), f"workers {sorted(workers)} to end")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_sweep_workers_die_with_their_parent(trace: str, tmp_path: Path, signum: int) -> None:
    """SIGKILL or SIGTERM of the sweep process alone (not its group): no worker survives it, the
    finished cells stay readable, and the same command then skips them."""
    out = tmp_path / "pool"
    proc, workers = _start_pool_sweep(trace, out)
    os.kill(proc.pid, signum)
    stdout, stderr = proc.communicate(timeout=WAIT_S)
    _assert_workers_gone(workers)
    finished = list((out / "cells").glob("*.json"))
    assert finished and all(json.loads(p.read_text())["cell_id"] == p.stem for p in finished)
    if signum == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # handled like Ctrl-C: finished cells kept, a JSON line last, exit 128 + 15
        assert proc.returncode == 143, stderr
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert summary["interrupted"] is True and summary["signal"] == "SIGTERM"
        assert summary["cells_done"] == len(list((out / "cells").glob("*.json")))
        assert "Traceback" not in stderr and "interrupted (SIGTERM)" in stderr
    done = len(list((out / "cells").glob("*.json")))
    from sim import sweep

    argv = _sweep_argv(trace, out, "1,2,3", 1)  # a subset of the killed grid: the finished cells count
    assert sweep.main(argv) == 0
    assert len(list((out / "cells").glob("*.json"))) >= done


def test_sigterm_outside_the_pool_is_handled_like_ctrl_c(trace: str, tmp_path: Path) -> None:
    """--jobs 1: SIGTERM while a cell runs in the sweep process itself."""
    out = tmp_path / "one"
    proc = _popen_sweep(trace, out, jobs=1)
    wait_for_pause(proc, out.with_name(out.name + ".paused"))  # a cell recorded, more to run
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 143, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["signal"] == "SIGTERM"
    assert summary["cells_done"] == len(list((out / "cells").glob("*.json"))) >= 1
    assert "Traceback" not in stderr


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_another_grid_into_the_same_out_keeps_every_finished_cell(trace: str, tmp_path: Path, capsys) -> None:
    from sim import sweep

    out = tmp_path / "grid"
    assert sweep.main(_sweep_argv(trace, out, "8,16")) == 0
    first = pd.read_csv(out / "results.csv")
    assert len(first) == 4
    capsys.readouterr()
    # another grid: the 4 earlier cells and the 2 new ones are all in the results, table and sweep.json
    assert sweep.main(_sweep_argv(trace, out, "32")) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["cells_kept_from_earlier_sweeps"] == 4 and summary["cells_run"] == 2
    assert "keeping 4 finished cells of earlier sweeps" in captured.err
    union = pd.read_csv(out / "results.csv")
    assert sorted(union["bandwidth_gb_per_s"].unique()) == [8, 16, 32] and len(union) == 6
    assert set(first["cell_id"]) < set(union["cell_id"])
    assert "results also hold 4 cells of earlier sweeps" in (out / "table.txt").read_text()
    recorded = json.loads((out / "sweep.json").read_text())
    assert {c["cell_id"] for c in recorded["cells"]} == set(union["cell_id"])
    assert len(recorded["command_lines"]) == 2
    # the first grid again: nothing to run, the union stays
    assert sweep.main(_sweep_argv(trace, out, "8,16")) == 0
    assert len(pd.read_csv(out / "results.csv")) == 6
    capsys.readouterr()
    # a grid of another context (seed) cannot share the table: exit 2 naming --out, nothing changed
    before = _snapshot(out)
    with pytest.raises(SystemExit) as exc:
        sweep.main(_sweep_argv(trace, out, "8", 1, "--seed", "5"))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--out" in err and "seed" in err and "nothing was changed" in err
    assert _snapshot(out) == before
