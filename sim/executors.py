"""Run sweep cells: in-process, on a local process pool, or on a Ray cluster.

Every executor calls :func:`sim.cells.run_cell` on each cell and hands each finished row to
``on_result`` as soon as it arrives (the sweep writes it to disk at once, which makes sweeps
resumable). Each cell is a pure function of its spec, so the executors give the same rows;
the caller sorts them.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from sim.cells import CellSpec, run_cell

EXECUTORS = ("local", "ray")
OnResult = Callable[[CellSpec, dict[str, Any]], None]



class RayAddressError(ValueError):
    """No Ray cluster answered at the given ``--ray-address``."""


def run_local(
    cells: Sequence[CellSpec], on_result: OnResult, *, jobs: int = 1, cycles_dir: str | None = None
) -> None:
    """Run ``cells`` in this process (``jobs == 1``) or on a pool of ``jobs`` worker processes.

    Workers are forked (Linux) so they start without re-importing; each opens the trace once
    and reuses it for all its cells.

    Raises:
        ValueError: ``jobs < 1``. Errors of a cell propagate (remaining cells are cancelled).
    """
    if jobs < 1:
        raise ValueError(f"--jobs: expected >= 1, got {jobs}")
    if jobs == 1 or len(cells) <= 1:
        for cell in cells:
            on_result(cell, run_cell(cell.to_dict(), cycles_dir))
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(cells)), mp_context=context) as pool:
        pending = {pool.submit(run_cell, cell.to_dict(), cycles_dir): cell for cell in cells}
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
) -> None:
    """Run ``cells`` as Ray tasks (one task per cell, 1 CPU each).

    Args:
        address: ``ray.init(address=...)`` of an existing cluster (``"auto"``, ``"ray://host:10001"``);
            ``None`` starts a local Ray instance with ``jobs`` CPUs. The trace path must be
            readable from every node (shared file system).
        jobs: CPUs of a local instance (ignored with ``address``).

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
        remote = ray.remote(num_cpus=1)(run_cell)
        refs = {remote.remote(cell.to_dict(), cycles_dir): cell for cell in cells}
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
) -> None:
    """Dispatch to :func:`run_local` or :func:`run_ray`.

    Raises:
        ValueError: unknown executor (listing :data:`EXECUTORS`).
    """
    if executor == "local":
        run_local(cells, on_result, jobs=jobs, cycles_dir=cycles_dir)
    elif executor == "ray":
        run_ray(cells, on_result, address=ray_address, jobs=jobs, cycles_dir=cycles_dir)
    else:
        raise ValueError(f"--executor: expected one of {list(EXECUTORS)}, got {executor!r}")
