"""Run sweep cells: in-process, on a local process pool, or on a Ray cluster.

Every executor calls :func:`sim.cells.run_cell` on each cell and hands each finished row to
``on_result`` as soon as it arrives (the sweep writes it to disk at once, which makes sweeps
resumable). Each cell is a pure function of its spec, so the executors give the same rows;
the caller sorts them.

Pool workers die with the sweep process on any signal, SIGKILL included: each worker asks the
kernel for SIGKILL when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``) and, everywhere, a
watcher thread ends it once its parent process is gone (``os.getppid()`` changes). A worker of the
``"forkserver"`` start method is the fork server's child, not the sweep's (and the fork server
lives as long as any worker: each holds its alive pipe), so its watcher polls whether the sweep
process itself still runs.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from sim.cells import CellSpec, export_traces, prepare_traces, run_cell

EXECUTORS = ("local", "ray")
OnResult = Callable[[CellSpec, dict[str, Any]], None]
PARENT_POLL_S = 0.5  # how often a worker checks that its parent is alive (fallback to PDEATHSIG)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class RayAddressError(ValueError):
    """No Ray cluster answered at the given ``--ray-address``."""


def _set_parent_death_signal(signum: int) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent dies (``prctl(2)``,
    ``PR_SET_PDEATHSIG``); returns whether the call succeeded (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_running(parent_pid: int, via_fork_server: bool) -> bool:
    """Whether the sweep process ``parent_pid`` still runs: it is this process's parent, or, with
    ``via_fork_server``, it exists and is not a zombie (Linux ``/proc/PID/stat``; elsewhere
    ``kill(pid, 0)``)."""
    if not via_fork_server:
        return os.getppid() == parent_pid
    try:
        with open(f"/proc/{parent_pid}/stat") as fh:  # closed at once: polled every PARENT_POLL_S
            stat = fh.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        pass
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit_when_orphaned(parent_pid: int, interval_s: float, via_fork_server: bool = False) -> None:
    """Watcher thread body: end this process (SIGKILL to itself) once the sweep process
    ``parent_pid`` no longer runs (:func:`_parent_running`)."""
    while _parent_running(parent_pid, via_fork_server):
        time.sleep(interval_s)
    os.kill(os.getpid(), signal.SIGKILL)


def init_worker(parent_pid: int, poll_s: float = PARENT_POLL_S, via_fork_server: bool = False) -> None:
    """Initializer of every pool worker: die with the sweep process ``parent_pid``, whatever kills it.

    SIGINT is ignored (a terminal's Ctrl-C reaches the whole process group; the parent stops the
    workers) and SIGTERM has its default action (the parent's :meth:`multiprocessing.Process.terminate`
    ends a worker), replacing the handlers a forked worker inherits from the sweep. Then
    ``PR_SET_PDEATHSIG`` (SIGKILL) on Linux plus a daemon thread polling ``os.getppid()`` every
    ``poll_s`` seconds; a parent that died before this ran is caught by the first check.

    With ``via_fork_server`` (workers of the ``"forkserver"`` start method) the worker's parent is
    the fork server, which outlives the sweep while any worker lives (``multiprocessing.forkserver``
    gives each worker its alive pipe): the thread polls whether ``parent_pid`` still runs (exists
    and is no zombie), so such a worker ends within ``poll_s`` of the sweep; ``PR_SET_PDEATHSIG``
    then only covers the fork server's death.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _set_parent_death_signal(signal.SIGKILL)
    if not _parent_running(parent_pid, via_fork_server):
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(
        target=_exit_when_orphaned,
        args=(parent_pid, poll_s, via_fork_server),
        name="exit-when-orphaned",
        daemon=True,
    ).start()


def run_local(
    cells: Sequence[CellSpec],
    on_result: OnResult,
    *,
    jobs: int = 1,
    cycles_dir: str | None = None,
    start_method: str | None = None,
    scratch_dir: str | None = None,
) -> None:
    """Run ``cells`` in this process (``jobs == 1``) or on a pool of ``jobs`` worker processes.

    The traces are decoded and validated once, in this process, before the workers start
    (:func:`sim.cells.prepare_traces`). Forked workers (the default where ``fork`` exists: they
    start without re-importing) inherit those arrays (copy-on-write) for all their cells. Spawned
    workers map them from one Arrow IPC file per trace written here
    (:func:`sim.cells.export_traces`, in a temporary folder under ``scratch_dir``, removed
    afterwards). Either way no worker decodes a trace. Workers die with this process
    (:func:`init_worker`; ``"forkserver"`` workers within :data:`PARENT_POLL_S`).

    Args:
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; ``None``: fork where available.
        scratch_dir: where the decoded traces go for workers that are not forked (``None``: the
            system's temporary folder).

    Raises:
        ValueError: ``jobs < 1`` or a start method this platform lacks. Errors of a cell
            propagate (remaining cells are cancelled).
    """
    if jobs < 1:
        raise ValueError(f"--jobs: expected >= 1, got {jobs}")
    if jobs == 1 or len(cells) <= 1:
        for cell in cells:
            on_result(cell, run_cell(cell.to_dict(), cycles_dir))
        return
    methods = multiprocessing.get_all_start_methods()
    if start_method is None:
        start_method = "fork" if "fork" in methods else "spawn"
    if start_method not in methods:
        raise ValueError(f"start_method: expected one of {methods}, got {start_method!r}")
    context, workers = multiprocessing.get_context(start_method), min(jobs, len(cells))
    if start_method == "fork":  # decoded once here; the forked workers inherit it
        prepare_traces(cells)
        # the inherited objects (decoded trees, tables) out of the workers' garbage collections,
        # which would otherwise visit, and so copy, every page holding them (gc.freeze's purpose)
        gc.freeze()
        try:
            _run_pool(cells, on_result, context, workers, cycles_dir, {})
        finally:
            gc.unfreeze()
        return
    with _scratch(scratch_dir) as scratch:
        # decoded once here, written once; the workers map it
        _run_pool(cells, on_result, context, workers, cycles_dir, export_traces(cells, scratch))


def _scratch(scratch_dir: str | None) -> tempfile.TemporaryDirectory:
    """A temporary folder (removed on exit) for the decoded traces, under ``scratch_dir`` (made
    if absent) or the system's temporary folder."""
    if scratch_dir is not None:
        os.makedirs(scratch_dir, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix=".decoded-", dir=scratch_dir)


def _run_pool(
    cells: Sequence[CellSpec],
    on_result: OnResult,
    context: Any,
    workers: int,
    cycles_dir: str | None,
    decoded: dict[str, str],
) -> None:
    """:func:`run_local`'s pool: ``run_cell`` of every cell on ``workers`` processes of ``context``."""
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=context,
        initializer=init_worker,
        initargs=(os.getpid(), PARENT_POLL_S, context.get_start_method() == "forkserver"),
    ) as pool:
        pending = {
            pool.submit(run_cell, cell.to_dict(), cycles_dir, decoded.get(cell.trace_path)): cell
            for cell in cells
        }
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    cell = pending.pop(future)
                    on_result(cell, future.result())
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def run_ray(
    cells: Sequence[CellSpec],
    on_result: OnResult,
    *,
    address: str | None = None,
    jobs: int | None = None,
    cycles_dir: str | None = None,
    scratch_dir: str | None = None,
) -> None:
    """Run ``cells`` as Ray tasks (one task per cell, 1 CPU each).

    The traces are decoded once, here, and written as Arrow IPC files to a temporary folder under
    ``scratch_dir`` (removed afterwards; :func:`sim.cells.export_traces`); each worker process
    maps them instead of decoding a trace.

    Args:
        address: ``ray.init(address=...)`` of an existing cluster (``"auto"``, ``"ray://host:10001"``);
            ``None`` starts a local Ray instance with ``jobs`` CPUs. The trace path and
            ``scratch_dir`` must be readable from every node (shared file system).
        jobs: CPUs of a local instance (ignored with ``address``).
        scratch_dir: where the decoded traces go (``None``: the system's temporary folder).

    Raises:
        RuntimeError: Ray is not installed (``pip install 'specfit-offload[ray]'``).
    """
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is a test dependency here
        raise RuntimeError("--executor ray needs Ray: pip install 'specfit-offload[ray]'") from exc
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            kwargs["address"] = address
        else:
            kwargs["num_cpus"] = jobs or 1
        try:
            ray.init(**kwargs)
        except ConnectionError as exc:
            raise RayAddressError(f"{address}: no Ray cluster answered ({exc})") from exc
        started = True
    try:
        with _scratch(scratch_dir) as scratch:
            decoded = export_traces(cells, scratch)
            remote = ray.remote(num_cpus=1)(run_cell)
            refs = {remote.remote(cell.to_dict(), cycles_dir, decoded.get(cell.trace_path)): cell for cell in cells}
            while refs:
                done, _ = ray.wait(list(refs), num_returns=1)
                for ref in done:
                    cell = refs.pop(ref)
                    on_result(cell, ray.get(ref))
    finally:
        if started:
            ray.shutdown()


def run_cells(
    cells: Sequence[CellSpec],
    on_result: OnResult,
    *,
    executor: str = "local",
    jobs: int = 1,
    ray_address: str | None = None,
    cycles_dir: str | None = None,
    scratch_dir: str | None = None,
) -> None:
    """Dispatch to :func:`run_local` or :func:`run_ray` (``scratch_dir``: where workers that are
    not forked find the decoded traces, in a temporary folder removed afterwards).

    Raises:
        ValueError: unknown executor (listing :data:`EXECUTORS`).
    """
    if executor == "local":
        run_local(cells, on_result, jobs=jobs, cycles_dir=cycles_dir, scratch_dir=scratch_dir)
    elif executor == "ray":
        run_ray(cells, on_result, address=ray_address, jobs=jobs, cycles_dir=cycles_dir, scratch_dir=scratch_dir)
    else:
        raise ValueError(f"--executor: expected one of {list(EXECUTORS)}, got {executor!r}")
