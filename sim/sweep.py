"""``python -m sim.sweep``: replay a dense trace across bandwidths, cache sizes and policies.

The default answers one question: the trace's routing and acceptance, replayed with each expert
priced at a real model's size (Qwen3-30B-A3B, 9,437,184 bytes) and with the draft/verify compute
costs of a named hardware preset (:mod:`sim.presets`, sources stated), at each H2D bandwidth.
``--cost`` replaces the preset with a calibrated cost JSON (``python -m calibration.fit``).

Outputs under ``--out`` (default ``runs/sim/sweep-<hash of the sweep>``, so re-running the same
command resumes): ``cells/<cell_id>.json`` (one per finished cell, written as it finishes),
``results.parquet`` and ``results.csv`` (one tidy row per cell), ``table.txt``,
``throughput_vs_bandwidth.png`` and ``sweep.json`` (resolved config, command line, versions,
seed). The last stdout line is a JSON summary.

Bandwidths: ``--bandwidth`` when given (it replaces the cost's link bandwidth, and the header
says so); otherwise the link's bandwidth when ``--cost`` names one (``COMPUTE+LINK``) or is a
cost JSON (its ``h2d_bytes_per_s``, in GB/s), else 16, 32 and 64 GB/s. Ctrl-C stops the worker
processes, keeps the finished cells (re-running the same command skips them), prints a JSON
summary with ``"interrupted": true`` and exits 130; SIGTERM does the same and exits 143. Worker
processes die with the sweep whatever stops it, SIGKILL included (``sim.executors.init_worker``).

With ``--prefetch next-layer|both`` and a cost without a next-layer share (a preset, the
default), the share and waste are estimated from the trace by pilot replays
(:func:`pilot_next_layer_share`) and the header says so.

``--stopping`` picks SpecFit's stopping rule; it goes into the SpecFit cells (their id and result
row, column ``stopping``), so sweeps with different rules never reuse each other's SpecFit cells.
``--planner-deadline-fraction`` gives SpecFit's exact search the live engine's deadline (column
``planner_deadline_fraction``; every row has ``planner_deadline_hits`` and ``planner_mean_gap``);
with it, results depend on this machine's speed and load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import BrokenExecutor, InvalidStateError
from pathlib import Path
from typing import Any

import pandas as pd

from sim.cells import KEY_COLUMNS, CellSpec, make_cells, parse_cache_sizes
from sim.config import (
    DEFAULT_POLICIES,
    ORACLE_VARIANT_HELP,
    ORACLE_VARIANTS,
    POLICY_ALIASES,
    canonical_policy,
    expert_budget_or_default,
)
from sim.executors import EXECUTORS, RayAddressError, run_cells
from sim.presets import DEFAULT_COST, link_presets, preset_names, resolve_cost
from sim.report import format_table, plot_throughput, results_frame
from sim.traceselect import SyntheticSpec, resolve_trace
from specfit.cache import CACHE_POLICIES, CACHE_POLICY_HELP
from specfit.cli import (
    ArgumentParser,
    Interrupted,
    choices_help,
    cli_main,
    comma_list,
    gb_per_s,
    non_negative_float,
    non_negative_int,
    positive_int,
    print_summary,
    run_main,
    sigterm_as_interrupt,
)
from specfit.policies import LIVE_DEADLINE_FRACTION, STOPPING_RULES, TREE_POLICY_HELP
from specfit.predictors import PREDICTOR_HELP, PREDICTORS
from specfit.shapes import MODEL_SHAPES
from specfit.units import bytes_per_s_to_gb_per_s, bytes_to_gb, us_to_s

DEFAULT_MODEL_SHAPE = "qwen3-30b-a3b"
DEFAULT_BANDWIDTHS = (16.0, 32.0, 64.0)
REPEATED_SIGINT_S = 2.0  # a second SIGINT this soon after the first is the same Ctrl-C (seconds)


class _DefaultList(list):
    """A list flag's default value: told apart from the same values given on the command line."""


class _DefaultText(str):
    """A text flag's default value: told apart from the same text given on the command line."""


MODES = {"off": (False,), "on": (True,), "both": (False, True)}
OVERLAP_CHOICES = {**MODES, "ideal": ("ideal",)}  # "ideal": the bound, never the default


def _write_json(path: Path, data: Any) -> None:
    """Atomic JSON write (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, sort_keys=True, indent=1) + "\n")
    tmp.replace(path)


def _load_done(cells_dir: Path, wanted: set[str]) -> dict[str, dict[str, Any]]:
    """Finished cells already on disk (``cells/<id>.json``) among ``wanted``; unreadable ones are redone."""
    done = {}
    if cells_dir.is_dir():
        for path in sorted(cells_dir.glob("*.json")):
            if path.stem in wanted:
                try:
                    done[path.stem] = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError):
                    continue
    return done


SweepInterrupted = Interrupted
"""The sweep was stopped by a signal: SIGINT (Ctrl-C) or SIGTERM (``specfit.cli.Interrupted``)."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _workers_stop_on_interrupt:  # noqa: N801 - used as a context manager
    """While active, SIGINT (Ctrl-C) or SIGTERM stops this process's worker processes at once.

    With workers running (the local pool), the handler only terminates them and records the
    signal (:attr:`interrupted`, :attr:`signum`): raising in the main thread at an arbitrary
    point could leave a lock of the pool's futures held and hang its shutdown. The pool then
    fails with ``BrokenExecutor``, which :func:`run_sweep` turns into :class:`SweepInterrupted`.
    Without workers (``--jobs 1``, Ray) it raises :class:`SweepInterrupted` as Python raises
    ``KeyboardInterrupt``. A second signal within :data:`REPEATED_SIGINT_S` is the same Ctrl-C
    delivered twice and is ignored; a later one raises. Forked workers inherit the handler until
    their initializer (``sim.executors.init_worker``) replaces it: there SIGINT is ignored (a
    terminal's Ctrl-C reaches them too; the parent stops them) and SIGTERM ends the worker, so no
    worker prints a traceback. No-op outside the main thread.
    """

    def __enter__(self) -> _workers_stop_on_interrupt:
        self.previous: dict[int, Any] = {}
        self.previous_hook = threading.excepthook
        self.interrupted_at: float | None = None
        self.signum = int(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():
            parent = os.getpid()

            def on_signal(signum: int, frame: Any) -> None:
                if os.getpid() != parent:  # a forked worker before its initializer ran
                    if signum == signal.SIGTERM:
                        signal.signal(signum, signal.SIG_DFL)
                        os.kill(os.getpid(), signum)
                    return  # SIGINT: the parent terminates it
                now = time.monotonic()
                if self.interrupted_at is not None:
                    if now - self.interrupted_at < REPEATED_SIGINT_S:
                        return  # the same Ctrl-C again (timeout(1) signals the process and its group)
                    raise SweepInterrupted(self.signum)  # a later signal: stop waiting for the shutdown
                self.interrupted_at = now
                self.signum = int(signum)
                if not self.stop_workers():
                    raise SweepInterrupted(signum)

            def quiet_hook(hook_args: Any) -> None:
                # Python 3.11's pool manager fails on a future cancelled while it marks them broken
                if self.interrupted and hook_args.exc_type is InvalidStateError:
                    return
                self.previous_hook(hook_args)

            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, on_signal)
            threading.excepthook = quiet_hook
        return self

    @staticmethod
    def stop_workers() -> bool:
        """Terminate this process's worker processes; returns whether there were any."""
        children = multiprocessing.active_children()
        if not children:
            return False
        for child in children:
            child.terminate()
        # let the pool's manager thread mark every future broken before the executor
        # cancels the pending ones (bounded: it may need a future's lock this thread holds)
        for thread in threading.enumerate():
            if type(thread).__name__ == "_ExecutorManagerThread":
                thread.join(timeout=2.0)
        return True

    @property
    def interrupted(self) -> bool:
        """Whether SIGINT or SIGTERM arrived while active."""
        return self.interrupted_at is not None

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        if self.previous:
            threading.excepthook = self.previous_hook


GRID_FIELDS = frozenset(
    {
        "bandwidth_gb_per_s",
        "cache_experts_per_layer",
        "cache_fraction",
        "policy",
        "cache_policy",
        "predictor",
        "overlap",
        "prefetch",
        "policy_options",
    }
)
"""Cell fields that vary within one sweep's grid; the others (trace, base cost, seed, ...) are the
sweep's context, which every cell of one ``--out`` folder shares."""


def _context_fields(spec: dict[str, Any]) -> dict[str, str]:
    """The context fields of a cell dict (canonical JSON per field, for comparison); a field set
    to None is left out, as :attr:`sim.cells.CellSpec.cell_id` leaves it out, so cells recorded
    before an optional field existed (``planner_deadline_fraction``) still match cells without it."""
    return {
        k: json.dumps(v, sort_keys=True)
        for k, v in spec.items()
        if k not in GRID_FIELDS and k != "cell_id" and v is not None
    }


def _table_key(spec: dict[str, Any]) -> tuple:
    """What tells a cell's row apart in the table and figure: the key columns and the stopping rule."""
    return (*(spec.get(k) for k in KEY_COLUMNS), (spec.get("policy_options") or {}).get("stopping"))


def earlier_cells(out_dir: str | Path, cells: Sequence[CellSpec]) -> tuple[list[dict[str, Any]], str | None]:
    """Finished cells of earlier grids in ``out_dir`` that a sweep of ``cells`` keeps.

    A sweep into a folder that holds finished cells of another grid keeps them all: its results
    hold the union. That is only sound when every kept cell shares the new cells' context (all
    fields but :data:`GRID_FIELDS`: trace, base cost, seed, ...) and no kept cell has the table
    keys of a new one (``sim.cells.KEY_COLUMNS`` and the stopping rule, which the table and the
    figure show when it varies); otherwise the caller refuses (the rows could not be told apart).

    Returns:
        ``(specs, None)``: the kept cells' dicts (``CellSpec.to_dict()`` plus ``cell_id``, from
        ``sweep.json``), or ``([], message)`` when the folder cannot be extended (the message says
        why: cells without a readable ``sweep.json`` describing them, or which fields differ).
    """
    out = Path(out_dir)
    current = {c.cell_id for c in cells}
    others = sorted({p.stem for p in (out / "cells").glob("*.json")} - current)
    if not others:
        return [], None
    try:
        recorded = json.loads((out / "sweep.json").read_text())
        specs = {str(c["cell_id"]): dict(c) for c in recorded["cells"]}
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return (
            [],
            f"{out} holds {len(others)} finished cells of another sweep and no readable sweep.json ({exc})",
        )
    unknown = [cell_id for cell_id in others if cell_id not in specs]
    if unknown:
        return [], f"{out} holds {len(unknown)} finished cells that its sweep.json does not describe"
    contexts = [_context_fields(c.to_dict()) for c in cells]
    keys = {_table_key(c.to_dict()): c.to_dict() for c in cells}
    kept = []
    for cell_id in others:
        spec = specs[cell_id]
        context = _context_fields(spec)
        if context not in contexts:
            differ = sorted(
                k for k in set(context) | set(contexts[0]) if context.get(k) != contexts[0].get(k)
            )
            return [], (
                f"{out} holds {len(others)} finished cells of a sweep with another {', '.join(differ)}"
            )
        same_keys = keys.get(_table_key(spec))
        if same_keys is not None:
            mine, theirs = ({k: json.dumps(v, sort_keys=True) for k, v in d.items()} for d in (spec, same_keys))
            differ = sorted(k for k in set(mine) | set(theirs) if k != "cell_id" and mine.get(k) != theirs.get(k))
            return [], f"{out} holds finished cells with this sweep's table keys but another {', '.join(differ)}"
        kept.append(spec)
    return kept, None


def cells_done(cells: Sequence[CellSpec], out_dir: str | Path) -> int:
    """How many of ``cells`` are finished under ``out_dir`` (``cells/<cell_id>.json`` readable)."""
    return len(_load_done(Path(out_dir) / "cells", {c.cell_id for c in cells}))


def run_sweep(
    cells: Sequence[CellSpec],
    out_dir: str | Path,
    *,
    executor: str = "local",
    jobs: int = 1,
    ray_address: str | None = None,
    per_cycle: bool = False,
    progress: bool = True,
    keep: Sequence[str] = (),
) -> tuple[pd.DataFrame, int, int]:
    """Run the cells not yet finished under ``out_dir`` and return the full results table.

    Each finished cell is written at once to ``out_dir/cells/<cell_id>.json``; a re-run with the
    same ``out_dir`` skips those (resumable). Rows go through JSON either way, so fresh and
    resumed sweeps give identical tables.

    Args:
        cells: from :func:`sim.cells.make_cells`.
        out_dir: sweep directory.
        executor: ``"local"`` (process pool of ``jobs``) or ``"ray"`` (``ray_address`` or a
            local Ray instance with ``jobs`` CPUs).
        per_cycle: also write each cell's cycle records to ``out_dir/cycles/<cell_id>.parquet``.
        progress: show a progress bar over cells (stderr).
        keep: ids of finished cells of earlier grids in ``out_dir`` (:func:`earlier_cells`) whose
            rows join the results.

    Returns:
        ``(results, cells_run, cells_skipped)``; results as :func:`sim.report.results_frame`
        (the rows of ``cells`` and of ``keep``).

    Raises:
        ValueError: bad executor or jobs; errors of the replay itself propagate.
    """
    from tqdm import tqdm

    out = Path(out_dir)
    cells_dir = out / "cells"
    done = _load_done(cells_dir, {c.cell_id for c in cells})
    # longest cells first, for load balance: SpecFit plans with many exact searches per cycle, and
    # autoregressive decoding runs a cycle per token (benchmarks/sim_speed.py's 27 cells, CPU s per
    # cell: specfit 0.45-0.80, ar 0.50-0.89, topn 0.24-0.41)
    cost_rank = {"specfit": 0, "ar": 1, "cascade": 2, "topn": 3, "chain": 4}
    todo = sorted((c for c in cells if c.cell_id not in done), key=lambda c: cost_rank.get(c.policy, 0))
    bar = tqdm(
        total=len(cells), initial=len(cells) - len(todo), desc="cells", unit="cell", disable=not progress
    )

    def on_result(cell: CellSpec, row: dict[str, Any]) -> None:
        _write_json(cells_dir / f"{cell.cell_id}.json", row)
        done[cell.cell_id] = json.loads(json.dumps(row, sort_keys=True))  # exactly what a resume reads
        bar.update(1)
        if stopper.interrupted:  # a signal whose exception was swallowed (e.g. inside fork hooks)
            stopper.stop_workers()
            raise SweepInterrupted(stopper.signum)

    stopper = _workers_stop_on_interrupt()
    try:
        with stopper:
            run_cells(
                todo,
                on_result,
                executor=executor,
                jobs=jobs,
                ray_address=ray_address,
                cycles_dir=str(out / "cycles") if per_cycle else None,
                scratch_dir=str(out),  # decoded traces for workers that are not forked (removed after)
            )
    except BrokenExecutor:
        if stopper.interrupted:
            raise SweepInterrupted(stopper.signum) from None  # the workers were stopped by a signal
        raise
    finally:
        bar.close()
    kept = _load_done(cells_dir, set(keep))
    rows = [done[c.cell_id] for c in cells] + [kept[cell_id] for cell_id in keep if cell_id in kept]
    return results_frame(rows), len(todo), len(cells) - len(todo)


def build_parser() -> ArgumentParser:
    """The ``python -m sim.sweep`` argument parser."""
    p = ArgumentParser(prog="python -m sim.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--bandwidth",
        type=comma_list(gb_per_s),
        default=_DefaultList(DEFAULT_BANDWIDTHS),
        help="H2D bandwidths, GB/s (1 GB = 1e9 bytes), comma-separated, each <= 10,000; when not given and "
        "--cost names a link (COMPUTE+LINK) or a cost JSON, that link's bandwidth (the JSON's "
        "h2d_bytes_per_s)",
    )
    p.add_argument(
        "--cache",
        type=comma_list(str),
        default=["0.125", "0.25", "0.5"],
        help="expert-cache sizes per layer: counts (32) or fractions of the experts per layer "
        "(0.25 or 25%%), comma-separated",
    )
    p.add_argument(
        "--policy",
        "--policies",
        dest="policy",
        type=comma_list(str),
        default=list(DEFAULT_POLICIES),
        help="tree policies, comma-separated: "
        + choices_help(
            dict.fromkeys(POLICY_ALIASES.values()), {**TREE_POLICY_HELP, **ORACLE_VARIANT_HELP}, POLICY_ALIASES
        ),
    )
    p.add_argument(
        "--lossy",
        action="store_true",
        help="also run the lossy baseline moespec (MoE-Spec's verification expert budget: the top-B experts per "
        "layer by summed router weight; tokens routed elsewhere lose experts, so the output may differ); its "
        "rows say (lossy) and never enter the SpecFit check or the regret",
    )
    p.add_argument(
        "--expert-budget",
        type=positive_int,
        default=None,
        help="moespec's experts per layer (count); None: twice the trace's top-k",
    )
    p.add_argument(
        "--stopping",
        choices=STOPPING_RULES,
        default="expected",
        help="SpecFit's stopping rule (specfit cells only; part of their cell id): expected = draft on "
        "while the expected next levels pay, bound = stop only when no deeper tree can pay",
    )
    p.add_argument(
        "--planner-deadline-fraction",
        type=non_negative_float,
        default=None,
        help="give SpecFit's exact search the live engine's deadline: this fraction of the cycle's least "
        f"predicted time (live uses {LIVE_DEADLINE_FRACTION:g}; specfit cells only, part of their cell id); "
        "columns planner_deadline_hits, planner_mean_gap. The deadline reads the wall clock, so the results "
        "then depend on this machine's speed and load (not reproducible); the union-size predictor runs no "
        "search, so it has nothing to cut. Without the flag: no deadline, deterministic",
    )
    p.add_argument(
        "--cache-policy",
        type=comma_list(str),
        default=["lru"],
        help="expert-cache policies, comma-separated: " + choices_help(CACHE_POLICIES, CACHE_POLICY_HELP),
    )
    p.add_argument(
        "--predictor",
        type=comma_list(str),
        default=["union-size"],
        help="expert predictors used by the planner (and by prefetch), comma-separated: "
        + choices_help(PREDICTORS, PREDICTOR_HELP),
    )
    p.add_argument(
        "--overlap",
        choices=sorted(OVERLAP_CHOICES),
        default="off",
        help="on: a layer's copies, enqueued once its router has run, overlap its compute (as "
        "live.record --overlap on); off; both (a cell each); ideal: a BOUND no engine reaches "
        "(every demand copy of a cycle enqueued when verification starts)",
    )
    p.add_argument(
        "--prefetch",
        type=comma_list(str),
        default=["none"],
        help="expert prefetch modes, comma-separated, a cell each (as live.record --prefetch): none; "
        "draft = when the subtree is chosen, the experts the predictor expects its nodes to need; "
        "next-layer = after each layer's router, the experts layer l+1's router guesses from layer l's "
        "input (needs a dense trace recorded with those guesses; priced with the cost's share, or, when it "
        "has none, one estimated per cache and tree size from pilot replays of ar, chain and topn on the trace: the "
        "header says which); both = draft and next-layer. off/on are read as none/draft",
    )
    p.add_argument(
        "--cost",
        default=_DefaultText(DEFAULT_COST),
        help=f"named hardware preset COMPUTE[+LINK] ({', '.join(preset_names())}) or a calibrated cost JSON "
        "(the default's link bandwidth is replaced by --bandwidth; a named link's or a cost JSON's is "
        "swept when --bandwidth is not given)",
    )
    p.add_argument(
        "--acceptance",
        default="auto",
        help="acceptance calibration for the planner: an acceptance.json of calibration.fit, 'draft' "
        "(draft path probabilities as they are) or 'auto' (the acceptance.json beside a --cost file, else "
        "the one in the trace directory, "
        "else draft)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--model-shape",
        default=None,
        help=f"price transfers at this model's expert size, one of {', '.join(MODEL_SHAPES)}; None: "
        f"a synthetic trace's own shape (when it is one of these), else {DEFAULT_MODEL_SHAPE}, for a preset "
        "cost; the file's own for a cost JSON",
    )
    size.add_argument("--expert-bytes", type=positive_int, default=None, help="bytes per expert (bytes)")
    p.add_argument(
        "--latency-us",
        "--transfer-latency-us",
        dest="transfer_latency_us",
        type=non_negative_float,
        default=None,
        help="per-transfer H2D latency, microseconds; None: the cost's",
    )
    p.add_argument(
        "--link-concurrency", type=positive_int, default=1, help="expert copies in flight at once (count)"
    )
    p.add_argument(
        "--decision-us",
        type=non_negative_float,
        default=0.0,
        help="modelled planner time per cycle of the drafting policies (ar pays none), microseconds; "
        "live.record's summary gives the measured decision_s / num_cycles",
    )
    p.add_argument(
        "--engine",
        choices=["auto", "fast", "simpy"],
        default="auto",
        help="timeline engine, same results either way: fast = direct timeline arithmetic (needs "
        "--link-concurrency 1); simpy = the SimPy discrete-event reference; auto = fast when it applies",
    )
    p.add_argument(
        "--trace",
        default="auto",
        help="dense trace: auto (shipped sample, else synthetic), sample, synthetic[:SHAPE] (SHAPE one of "
        f"{', '.join(MODEL_SHAPES)}), or a run directory",
    )
    p.add_argument(
        "--synthetic-requests",
        type=positive_int,
        default=SyntheticSpec.num_requests,
        help="requests of a generated synthetic trace (count)",
    )
    p.add_argument(
        "--synthetic-positions",
        type=positive_int,
        default=SyntheticSpec.positions_per_request,
        help="positions per request of a generated synthetic trace (tokens)",
    )
    p.add_argument(
        "--max-requests",
        type=positive_int,
        default=None,
        help="replay at most this many requests (count); None: all",
    )
    p.add_argument(
        "--max-positions",
        type=positive_int,
        default=None,
        help="replay at most this many generated tokens per request (tokens); None: all",
    )
    p.add_argument(
        "--out",
        default=None,
        help="sweep directory; None: runs/sim/sweep-<hash of the cells> (re-running resumes)",
    )
    p.add_argument(
        "--jobs", type=positive_int, default=min(2, os.cpu_count() or 1), help="worker processes (count)"
    )
    p.add_argument(
        "--executor",
        choices=list(EXECUTORS),
        default="local",
        help="where cells run: local = --jobs worker processes here; ray = a Ray cluster (--ray-address)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster address for --executor ray; None: a local Ray instance with --jobs CPUs",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed (synthetic trace, predictors)")
    p.add_argument("--per-cycle", action="store_true", help="also write each cell's cycle records (cycles/)")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figure")
    p.add_no_progress()
    p.later_spellings("--policies", "--latency-us")  # README "Flag spellings": old abbreviations keep their flag
    return p


def _check_names(parser: ArgumentParser, args: Any) -> list[str]:
    """Validate policy / cache-policy / predictor names against specfit; return canonical policies."""
    try:
        policies = [canonical_policy(p) for p in args.policy]
    except ValueError as exc:
        parser.fail("--policy", str(exc))
    if "moespec" in policies and not args.lossy:
        parser.fail("--policy", "moespec (MoE-Spec's verification expert budget) is lossy; add --lossy to run it")
    if args.lossy and "moespec" not in policies:
        policies.append("moespec")
    if args.expert_budget is not None and not args.lossy:
        parser.fail("--expert-budget", "only the lossy moespec baseline has a budget; add --lossy")
    if args.stopping != "expected" and not any(p.startswith("specfit") for p in policies):
        parser.fail(
            "--stopping",
            f"only SpecFit has a stopping rule; --policy {','.join(policies)} has none (add specfit)",
        )
    if args.planner_deadline_fraction is not None and not any(p.startswith("specfit") for p in policies):
        parser.fail(
            "--planner-deadline-fraction",
            f"only SpecFit's planner searches; --policy {','.join(policies)} has none (add specfit)",
        )
    from specfit import cache, predictors

    valid_cache = tuple(getattr(cache, "CACHE_POLICIES", ()))
    for name in args.cache_policy:
        if valid_cache and name not in valid_cache:
            parser.fail("--cache-policy", f"expected one of {list(valid_cache)}, got {name!r}")
    valid_pred = tuple(getattr(predictors, "PREDICTORS", ()))
    for name in args.predictor:
        if valid_pred and name not in valid_pred:
            parser.fail("--predictor", f"expected one of {list(valid_pred)}, got {name!r}")
    return policies


def _resolve_acceptance(
    parser: ArgumentParser, spec: str, cost_spec: str, trace_path: Path
) -> tuple[dict[str, Any] | None, str | None]:
    """``--acceptance`` -> ``(AcceptanceCalibration dict, the file read)``, or ``(None, None)`` for
    draft probabilities.

    ``auto``: the ``acceptance.json`` beside a ``--cost`` file, else the one inside the trace
    directory (``calibration.fit TRACE --out TRACE/cost.json`` writes it; the shipped sample has
    one, fitted on itself), else draft probabilities.
    """
    if spec == "draft":
        return None, None
    if spec == "auto":
        sibling = Path(cost_spec).parent / "acceptance.json"
        in_trace = Path(trace_path) / "acceptance.json"
        if cost_spec.endswith(".json") and sibling.is_file():
            spec = str(sibling)
        elif in_trace.is_file():
            spec = str(in_trace)
        else:
            return None, None
    from specfit.acceptance import AcceptanceCalibration

    try:
        data = json.loads(Path(spec).read_text())
        return AcceptanceCalibration.from_dict(data).to_dict(), spec
    except (OSError, json.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
        parser.fail("--acceptance", f"{spec}: expected 'draft', 'auto' or an acceptance JSON file: {exc}")
    return None, None


def _is_cost_file(spec: str) -> bool:
    """Whether ``--cost`` names a file (as :func:`sim.presets.resolve_cost` decides)."""
    return spec.endswith(".json") or "/" in spec or Path(spec).is_file()


def _resolve_bandwidths(args: Any, cost: Any, cost_explicit: bool) -> tuple[list[float], str]:
    """The swept bandwidths (GB/s) and the header line saying where they come from.

    ``--bandwidth`` given: those, and the line says they replace the cost's link bandwidth.
    Not given: the link preset's bandwidth when ``--cost`` names one (``COMPUTE+LINK``), the
    file's ``h2d_bytes_per_s`` when ``--cost`` is a cost JSON (a calibrated, measured link), else
    :data:`DEFAULT_BANDWIDTHS` (the plain ``python -m sim.sweep``, priced over a replaced link).
    """
    import math

    link_gb_per_s = bytes_per_s_to_gb_per_s(cost.h2d_bytes_per_s)
    is_file = _is_cost_file(args.cost)
    link_name = None if is_file else (args.cost.partition("+")[2] or None)
    if is_file:
        link = f"the cost file's {link_gb_per_s:g} GB/s"
    elif link_name is not None:
        link = f"the {link_name} link's {link_gb_per_s:g} GB/s"
    else:
        link = f"the default {DEFAULT_COST.partition('+')[2]} link's {link_gb_per_s:g} GB/s"
    given = not isinstance(args.bandwidth, _DefaultList)
    if not given and cost_explicit and link_name is not None and link_name in link_presets():
        return [link_gb_per_s], f"bandwidth: {link} (--bandwidth not given)"
    if not given and cost_explicit and is_file:
        return [link_gb_per_s], (
            f"bandwidth: {link} (its h2d_bytes_per_s {cost.h2d_bytes_per_s:.6g} B/s; --bandwidth not given)"
        )
    bandwidths = [float(b) for b in args.bandwidth]
    shown = ", ".join(f"{b:g}" for b in bandwidths)
    origin = "--bandwidth" if given else "--bandwidth default"
    if all(math.isclose(b, link_gb_per_s, rel_tol=1e-9) for b in bandwidths):
        return bandwidths, f"bandwidth: {shown} GB/s ({origin}), equal to {link}"
    return bandwidths, (
        f"bandwidth: {shown} GB/s ({origin}) replaces {link}; the link's per-transfer latency is kept"
    )


def _resolve_cost(parser: ArgumentParser, args: Any, num_layers: int) -> tuple[Any, str]:
    """The sweep's base cost model and the name of the expert size it prices transfers at."""
    import dataclasses

    from specfit.shapes import get_model_shape

    expert_bytes, size_name = args.expert_bytes, "custom" if args.expert_bytes else None
    if args.model_shape is not None:
        try:
            expert_bytes, size_name = get_model_shape(args.model_shape).bytes_per_expert, args.model_shape
        except ValueError as exc:
            parser.fail("--model-shape", str(exc))
    try:
        cost = resolve_cost(
            args.cost,
            num_layers=num_layers,
            expert_bytes=expert_bytes,
            default_expert_bytes=get_model_shape(DEFAULT_MODEL_SHAPE).bytes_per_expert,
        )
    except ValueError as exc:
        parser.fail("--cost", str(exc))
    if args.cost.endswith(".json") or Path(args.cost).is_file():
        from specfit.cost import cost_file_warnings

        for note in cost_file_warnings(  # said, not refused: the user may want the sweep anyway
            args.cost,
            overlap=True in OVERLAP_CHOICES[args.overlap],
            consequence="the simulated tokens/s carry that error",
        ):
            print(f"warning: --cost {note}", file=sys.stderr)
    if size_name is None:
        size_name = "the cost file's" if args.cost.endswith(".json") else DEFAULT_MODEL_SHAPE
    if args.transfer_latency_us is not None:
        cost = dataclasses.replace(cost, h2d_s_per_transfer=us_to_s(args.transfer_latency_us))
    return cost, size_name


def _resolve_prefetch(parser: ArgumentParser, items: list[str], trace_run: Any, trace_path: Any) -> list[str]:
    """``--prefetch`` items as mode names (``sim.config.prefetch_mode``); exits 2 naming the flag
    for an unknown mode, or for next-layer/both on a trace without the next-layer guesses."""
    from sim.config import prefetch_mode
    from specfit.prefetch import PREFETCH_MODES, uses_next_layer

    try:
        modes = list(dict.fromkeys(prefetch_mode(item, "--prefetch") for item in items))
    except ValueError:
        parser.fail("--prefetch", f"expected modes from {list(PREFETCH_MODES)}, got {items}")
    needs = [m for m in modes if uses_next_layer(m)]
    if needs and not trace_run.has_next_layer_guesses:
        parser.fail(
            "--prefetch",
            f"{needs[0]} replays the next-layer guesses of a dense trace (column next_layer_expert_ids), "
            f"and {trace_path} was recorded without them; record one with live.record --mode dense",
        )
    return modes


PILOT_POLICIES = ("ar", "chain", "topn")
"""The policies whose replays estimate next-layer prefetch's share (:func:`pilot_next_layer_share`)."""


def pilot_next_layer_share(cell: CellSpec, policies: Sequence[str] = PILOT_POLICIES) -> Any:
    """Next-layer prefetch's share and waste on ``cell``'s trace at its cache, estimated from
    pilot replays: :func:`specfit.prefetch.next_layer_share_by_nodes` (the ratios
    ``calibration.costfit.fit_next_layer_terms`` fits from recorded runs, pooled and per tree
    size) on the per-cycle counts and verified nodes of the cycles of ``policies`` replayed with
    ``--prefetch next-layer``.

    Why these pilots, and once per cache: the used/wasted/demand-miss counts depend on the
    verified trees, the cache (size and policy) and the recorded guesses, never on timing (the
    prefetch ledger is driven by the cache's accesses, so bandwidth and overlap do not change
    them), so one estimate serves every bandwidth and overlap of a cache size. The autoregressive
    root alone, the greedy chain and the full top-N tree ask no planner, so their counts do not
    depend on the price they feed (SpecFit's own trees would: a share fitted on them changes
    them), and they span the subtrees SpecFit prices, from its root alone through a few-node
    path to its whole tree. One share for all sizes would be an average of very different
    ones (shipped sample, cache 8: the root alone sees 0.53 of its planner misses covered, the
    chain's 4-node paths 0.32, the 32-node top-N tree 0.14), so the knots keep each size's share
    and the cost model interpolates between them (the chain's knots matter: ar and topn alone
    would put 0.49 at 4 nodes). The other cell fields (trace, cache policy, request
    and position limits, seed) are ``cell``'s; overlap "off" (the counts are the same).

    Args:
        cell: a cell of the sweep (its policy, bandwidth, overlap and prefetch are not used).
        policies: pilot policies (canonical names), default :data:`PILOT_POLICIES`.

    Returns:
        ``specfit.prefetch.NextLayerShare`` (``cover_fraction`` h, ``waste_per_miss`` x, counts, knots).

    Raises:
        ReplayError / ValueError: from the replays (a trace without next-layer guesses).
    """
    from sim.cells import _open_trace

    run = _open_trace(cell.trace_path)  # the process's decoded trace: forked workers inherit it
    return next_layer_share_from_replays(run, [cell.sim_config()], policies)


def next_layer_share_from_replays(run: Any, configs: Sequence[Any], policies: Sequence[str] = PILOT_POLICIES) -> Any:
    """Next-layer prefetch's share per tree size from replays of ``policies`` on the dense trace
    ``run`` (an open ``traces.reader`` run) with each of ``configs`` (``sim.config.SimConfig``:
    their cache, cache policy, predictor, limits and seed), as ``--prefetch next-layer`` without
    overlap (the counts do not depend on timing): :func:`specfit.prefetch.next_layer_share_by_nodes`
    on all their cycles' counts and verified nodes. :func:`pilot_next_layer_share`'s replays, and
    ``analysis.validate --calibration separate``'s share (out of sample: the counts are the live
    engine's to the copy).

    Raises:
        ReplayError / ValueError: from the replays (a trace without next-layer guesses).
    """
    import numpy as np

    from sim.replay import replay_policy
    from specfit.prefetch import PREFETCH_COUNT_COLUMNS, next_layer_share_by_nodes

    columns = ("num_nodes_verified", *PREFETCH_COUNT_COLUMNS)
    rows: list[list[int]] = []
    for config in configs:
        for policy in policies:
            pilot = dataclasses.replace(
                config, policy=policy, overlap="off", prefetch="next-layer", policy_options=(), expert_budget=None,
                record_cycles=True,
            )  # fmt: skip
            for record in replay_policy(run, pilot).cycles:
                values = [getattr(record, c) for c in columns]
                if None not in values:  # a cycle without prefetch accounting counts for nothing
                    rows.append([int(v) for v in values] + [int(record.layer_misses[0])])
    table = np.array(rows, dtype=np.int64).reshape(-1, len(columns) + 1)
    return next_layer_share_by_nodes(*table.T[:-1], first_layer_misses=table[:, -1])  # layer 0: no guess


def _price_next_layer(
    cells: list[CellSpec], cost: Any, cost_file: str | None, progress: bool = False
) -> tuple[list[CellSpec], str | None]:
    """Cells whose next-layer prefetch the sweep prices, and the header line saying how.

    A cost with its own share (``next_layer_cover_fraction`` or ``next_layer_waste_per_miss`` > 0,
    e.g. ``calibration.fit`` on runs recorded with ``--prefetch next-layer``) keeps it. One
    without (a preset, the default, an older or next-layer-free fit) would price none, so the
    cells with ``--prefetch next-layer|both`` get the share :func:`pilot_next_layer_share`
    estimates per cache size and cache policy, per tree size (its knots; their cost dicts, and so
    their ids, change; the other cells keep theirs). Cells with ``--overlap ideal`` are left out:
    the bound ``max(T_verify, T_h2d)`` prices no share (``CycleCostModel.next_layer_priced``), so
    no pilot runs for them and the line says so. Returns ``(cells, None)`` when no cell prefetches
    one layer ahead. ``progress``: a bar over the pilots (stderr).
    """
    from specfit.prefetch import NextLayerShare, uses_next_layer

    def prices_share(cell: CellSpec) -> bool:
        return uses_next_layer(cell.prefetch) and cell.overlap != "ideal"

    if not any(prices_share(c) for c in cells):
        if any(uses_next_layer(c.prefetch) for c in cells):
            return cells, "next-layer prefetch: no share priced (--overlap ideal is a bound that prices none)"
        return cells, None
    if cost.has_next_layer_share:  # versions 1-4 load without one
        own = NextLayerShare(
            cost.next_layer_cover_fraction, cost.next_layer_waste_per_miss, 0, 0, 0,
            cost.next_layer_nodes, cost.next_layer_cover_fractions, cost.next_layer_waste_per_misses,
        )  # fmt: skip
        return cells, (
            f"next-layer prefetch: priced with the cost's own share {cost.next_layer_cover_fraction:.3f} of the "
            f"planner's misses covered, {cost.next_layer_waste_per_miss:.3f} wasted copies per miss"
            + (f", {own.knots_text()}" if own.nodes else " at every tree size")
            + f" ({cost_file or cost.source})"
        )
    from tqdm import tqdm

    pilots = {(c.cache_experts_per_layer, c.cache_policy): c for c in cells if prices_share(c)}
    bar = tqdm(pilots.items(), desc="next-layer share pilots", unit="cache", disable=not progress)
    fits = {key: pilot_next_layer_share(cell) for key, cell in bar}
    priced = []
    for cell in cells:
        if prices_share(cell):
            key = (cell.cache_experts_per_layer, cell.cache_policy)
            share = {k: list(v) if isinstance(v, tuple) else v for k, v in fits[key].cost_fields().items()}
            cell = dataclasses.replace(cell, cost={**cell.cost, **share})
        priced.append(cell)
    per_cache = "; ".join(
        f"cache {size} {policy}: {fit.cover_fraction:.3f} covered, {fit.waste_per_miss:.3f} wasted/miss "
        f"({fit.num_used} used, {fit.num_wasted} wasted, {fit.num_misses} demand misses)"
        + (f", {fit.knots_text()}" if fit.nodes else "")
        for (size, policy), fit in fits.items()
    )
    return priced, (
        f"next-layer prefetch: {cost_file or cost.source.split(':')[0]} has no share, so it is estimated from "
        f"this trace by pilot replays of {_listed(PILOT_POLICIES)} with --prefetch next-layer "
        f"(specfit.prefetch.next_layer_share_by_nodes on their per-cycle counts): {per_cache}"
    )


def _listed(names: Sequence[str]) -> str:
    """``"ar, chain and topn"`` (``"ar"``, ``"ar and topn"``)."""
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1]))) if names else ""


def _build_cells(
    parser: ArgumentParser, args: Any, policies: list[str], cost_explicit: bool = True
) -> tuple[list[CellSpec], list[str], Path]:
    """Resolve trace, cost, bandwidths, acceptance and cache sizes; return (cells, header lines,
    trace path). ``args.bandwidth`` is set to the swept bandwidths (GB/s).

    ``cost_explicit``: ``--cost`` was given (a link it names then sets the default bandwidth).
    """
    synthetic = SyntheticSpec(
        num_requests=args.synthetic_requests, positions_per_request=args.synthetic_positions, seed=args.seed
    )
    from traces.errors import TraceError
    from traces.reader import open_run

    try:
        trace_path, trace_desc = resolve_trace(args.trace, synthetic=synthetic, root=Path("runs/sim/traces"))
        trace_run = open_run(trace_path)
        manifest = trace_run.manifest
    except (ValueError, TraceError) as exc:
        parser.fail("--trace", str(exc))
    if manifest.run.mode != "dense":
        parser.fail(
            "--trace", f"{trace_path} is a {manifest.run.mode!r}-mode run; the simulator replays dense traces"
        )
    model = manifest.model
    prefetches = _resolve_prefetch(parser, args.prefetch, trace_run, trace_path)
    cost_file = args.cost.endswith(".json") or Path(args.cost).is_file()
    if model.architecture == "synthetic" and model.name in MODEL_SHAPES and not cost_file:
        if args.model_shape is None and args.expert_bytes is None:  # a real shape's trace: its own size
            args.model_shape = model.name
    cost, size_name = _resolve_cost(parser, args, model.num_layers)
    args.bandwidth, bandwidth_line = _resolve_bandwidths(args, cost, cost_explicit)
    acceptance, acceptance_file = _resolve_acceptance(parser, args.acceptance, args.cost, trace_path)
    try:
        caches = parse_cache_sizes(args.cache, model.num_experts)
    except ValueError as exc:
        parser.fail("--cache", str(exc).removeprefix("--cache: "))
    if args.engine == "fast" and args.link_concurrency != 1:
        parser.fail("--engine", "fast needs --link-concurrency 1")
    cells = make_cells(
        trace_path=str(Path(trace_path).resolve()),
        cost=cost,
        bandwidths_gb_per_s=args.bandwidth,
        caches=caches,
        policies=policies,
        cache_policies=args.cache_policy,
        predictors=args.predictor,
        overlaps=OVERLAP_CHOICES[args.overlap],
        prefetches=prefetches,
        engine=args.engine,
        link_concurrency=args.link_concurrency,
        decision_s=us_to_s(args.decision_us),
        max_requests=args.max_requests,
        max_positions=args.max_positions,
        seed=args.seed,
        acceptance=acceptance,
        policy_options={"specfit": {"stopping": args.stopping}},
        budget=args.expert_budget,
        planner_deadline_fraction=args.planner_deadline_fraction,
    )
    cells, next_layer_line = _price_next_layer(
        cells, cost, args.cost if cost_file else None, progress=not args.no_progress
    )
    if acceptance is None:
        accept = "draft path probabilities (uncalibrated)"
    else:
        accept = f"{acceptance['source']} (map read from {acceptance_file})"
        if Path(acceptance_file).resolve().parent != Path(trace_path).resolve():  # its source's "this trace" is another
            accept = f"from {acceptance_file}, fitted on another trace than the one swept (its source: {acceptance['source']})"
    header = [
        f"SIMULATED tokens/s: {model.name}'s recorded routing and acceptance ({model.num_layers} layers x "
        f"{model.num_experts} experts, top-{model.top_k}) replayed with each expert transfer priced at "
        f"{size_name} expert size and the cost model below",
        f"trace: {trace_desc.removeprefix('trace ')}",
        f"model shape: {size_name} expert size, {cost.expert_bytes:,} bytes/expert; routing of the trace's "
        f"model {model.name} ({model.num_layers} layers x {model.num_experts} experts, top-{model.top_k})",
        f"cost: {cost.source}",
        bandwidth_line,
        f"planner: predictor {', '.join(args.predictor)}; acceptance {accept}; planner time "
        + (
            f"{args.decision_us:g} us per cycle of every drafting policy (--decision-us; ar pays none)"
            if args.decision_us > 0
            else "not modelled (--decision-us 0: add the live engine's measured decision_s per cycle)"
        )
        + (f"; SpecFit stopping rule {args.stopping} (--stopping)" if "specfit" in policies else ""),
    ]
    if args.planner_deadline_fraction is not None:
        searched = [p for p in args.predictor if p != "union-size"] or [
            p for p in policies if ORACLE_VARIANTS.get(p, (False, False))[1]
        ]
        header.append(
            f"planner deadline: SpecFit's exact search stops at {args.planner_deadline_fraction:g} of the cycle's least "
            "predicted time (--planner-deadline-fraction), read on this machine's wall clock: results depend on its "
            "speed and load (columns planner_deadline_hits, planner_mean_gap)"
            + (
                ""
                if searched
                else "; but the union-size predictor plans without a search: nothing to cut, results deterministic"
            )
        )
    if next_layer_line is not None:
        header.append(next_layer_line)
    from sim.replay import level_tree_note

    note = level_tree_note(trace_run)  # a format-v1 dense trace: said, not refused
    if note and any(p.startswith("specfit") for p in policies):  # only a stopping rule reads level trees
        header.append(note)
    if "moespec" in policies:
        header.append(
            f"lossy baseline moespec (--lossy): MoE-Spec's verification budget of {expert_budget_or_default(args.expert_budget, model.top_k)} "
            "experts per layer; the replay keeps the recorded acceptance (an optimistic bound), never compared"
        )
    return cells, header, Path(trace_path)


def _write_results(
    results: pd.DataFrame, out: Path, header: list[str], figures: bool, cost_spec: str, cost: dict[str, Any]
) -> tuple[str, list[str]]:
    """Write results.parquet/.csv, table.txt and the figure; return (table text, file names)."""
    results.to_parquet(out / "results.parquet", index=False)
    results.to_csv(out / "results.csv", index=False)
    table = format_table(results, header)
    (out / "table.txt").write_text(table + "\n")
    files = ["results.parquet", "results.csv", "table.txt", "sweep.json"]
    if figures:
        plot_throughput(
            results, out / "throughput_vs_bandwidth.png", title=figure_title(header, cost_spec, cost)
        )
        files.append("throughput_vs_bandwidth.png")
    return table, files


def figure_title(header: Sequence[str], cost_spec: str, cost: dict[str, Any]) -> str:
    """The sweep figure's title lines: SIMULATED (not measured), the trace replayed, and how it
    was priced (bytes per expert, compute costs and their preset or file, link bandwidth and
    per-transfer latency).

    ``header``: the table's header lines (``trace:``, ``model shape:``, ``bandwidth:`` lines of
    :func:`_build_cells`); ``cost``: one cell's cost dict (:meth:`CycleCostModel.to_dict`).
    """

    def line(prefix: str) -> str:
        return next((h.removeprefix(prefix).strip() for h in header if h.startswith(prefix)), "?")

    size_name = line("model shape:").split(" expert size")[0]
    compute = (
        f"cost file {cost_spec}" if _is_cost_file(cost_spec) else f"preset {cost_spec.partition('+')[0]}"
    )
    return "\n".join(
        [
            "SIMULATED tokens/s (python -m sim.sweep: a trace replay priced by a cost model; not measured)",
            f"replayed: {line('trace:')}",
            f"priced: {cost['expert_bytes']:,} B per expert ({size_name} size); compute {compute}: draft "
            f"{cost['draft_s_per_level'] * 1e3:.3g} ms/level, verify {cost['verify_base_s'] * 1e3:.3g} ms + "
            f"{cost['verify_s_per_node'] * 1e6:.3g} us/node; link {line('bandwidth:').split(';')[0]}, "
            f"{cost['h2d_s_per_transfer'] * 1e6:.3g} us/transfer",
        ]
    )


def _earlier_command_lines(out: Path) -> list[list[str]]:
    """Command lines of the earlier sweeps into ``out`` (from its ``sweep.json``; [] if none)."""
    try:
        recorded = json.loads((out / "sweep.json").read_text())
    except (OSError, ValueError):
        return []
    lines = recorded.get("command_lines") or [recorded.get("command_line")]
    return [line for line in lines if isinstance(line, list)]


def _min_or_none(values: pd.Series) -> float | None:
    low = values.min() if len(values) else None
    return None if low is None or pd.isna(low) else float(low)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep CLI; returns the exit status (2 on bad flags, 1 if a replay fails, 130 on
    Ctrl-C, 143 on SIGTERM: finished cells are kept either way and a JSON line ends stdout)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # the default --out (runs/sim/sweep-<hash>) is named once the cells are known: check its parent now
    parser.ensure_out_dir("--out", args.out if args.out is not None else Path("runs/sim"))
    started = time.perf_counter()
    cost_explicit = not isinstance(args.cost, _DefaultText)
    args.cost = str(args.cost)
    state: dict[str, Any] = {"out": Path(args.out) if args.out else None, "cells": []}
    try:
        with sigterm_as_interrupt():  # outside the worker pool SIGTERM stops like Ctrl-C
            return _run(parser, args, argv, cost_explicit, started, state)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", int(signal.SIGINT))
        previous = {}
        with contextlib.suppress(ValueError):  # a repeated signal: the summary stays whole
            previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
        try:
            _report_interrupt(state, started, signum)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 128 + signum


def _report_interrupt(state: dict[str, Any], started: float, signum: int = signal.SIGINT) -> None:
    """The message (stderr) and JSON summary of a sweep stopped by Ctrl-C or SIGTERM."""
    out, cells = state["out"], state["cells"]
    done = cells_done(cells, out) if out is not None and cells else 0
    where = f" in {out}" if out is not None else ""
    progress = f"{done} of {len(cells)} cells finished" if cells else "before any cell ran"
    name = signal.Signals(signum).name
    sys.stderr.write(
        f"\ninterrupted ({name}): {progress}; finished cells are kept{where} and re-running the same "
        "command skips them\n"
    )
    print_summary(
        {
            "interrupted": True,
            "signal": name,
            "out": None if out is None else str(out),
            "num_cells": len(cells),
            "cells_done": done,
            "wall_s": round(time.perf_counter() - started, 3),
        }
    )


def _run(
    parser: ArgumentParser,
    args: Any,
    argv: Sequence[str] | None,
    cost_explicit: bool,
    started: float,
    state: dict[str, Any],
) -> int:
    """The body of :func:`main` (``state`` receives ``out`` and ``cells`` for the Ctrl-C summary)."""
    policies = _check_names(parser, args)
    cells, header, trace_path = _build_cells(parser, args, policies, cost_explicit)
    sweep_id = hashlib.sha256("".join(sorted(c.cell_id for c in cells)).encode()).hexdigest()[:12]
    out = Path(args.out) if args.out else Path("runs/sim") / f"sweep-{sweep_id}"
    if args.out is None:
        parser.ensure_out_dir("--out", out)
    state.update(out=out, cells=cells)
    kept, refused = earlier_cells(out, cells)
    if refused is not None:
        parser.fail(
            "--out",
            f"{refused}; its results and this sweep's could not be told apart: use another --out "
            "(nothing was changed)",
        )
    if kept:
        sys.stderr.write(
            f"{out}: keeping {len(kept)} finished cells of earlier sweeps in this folder; the results, "
            "table and figure hold them and this sweep's cells\n"
        )
        header = [
            *header,
            f"results also hold {len(kept)} cells of earlier sweeps into this folder (sweep.json)",
        ]
    from traces.schema import software_versions

    command_line = [sys.executable, "-m", "sim.sweep", *(sys.argv[1:] if argv is None else argv)]
    _write_json(
        out / "sweep.json",
        {
            "command_line": command_line,
            "command_lines": _earlier_command_lines(out) + [command_line] if kept else [command_line],
            "args": vars(args),
            "trace": str(trace_path),
            "header": header,
            "seed": args.seed,
            "software": software_versions(),
            "cells": kept + [c.to_dict() | {"cell_id": c.cell_id} for c in cells],
        },
    )
    try:
        results, num_run, num_skipped = run_sweep(
            cells,
            out,
            executor=args.executor,
            jobs=args.jobs,
            ray_address=args.ray_address,
            per_cycle=args.per_cycle,
            progress=not args.no_progress,
            keep=[spec["cell_id"] for spec in kept],
        )
    except RayAddressError as exc:
        parser.fail("--ray-address", str(exc))
    except (ValueError, RuntimeError) as exc:
        from traces.errors import TraceError

        if isinstance(exc, TraceError):  # a trace part that fails to decode when a cell reads it
            parser.fail("--trace", str(exc))
        print(f"error: {exc}", file=sys.stderr)
        print_summary({"ok": False, "error": str(exc), "exit_code": 1, "out": str(out)})
        return 1
    table, files = _write_results(
        results, out, header, figures=not args.no_figures, cost_spec=args.cost, cost=cells[0].cost
    )
    print(table)
    print(f"sweep folder: {out}  ({', '.join(files)})")
    specfit_rows = results[results["policy"] == "specfit"]
    print_summary(
        {
            "out": str(out),
            "files": files,
            "num_cells": len(cells),
            "cells_run": num_run,
            "cells_skipped": num_skipped,
            "cells_kept_from_earlier_sweeps": len(kept),
            "specfit_below_baseline": int(results["specfit_below_baseline"].sum()),
            "specfit_below_baseline_beyond_noise": int(results["specfit_below_baseline_beyond_noise"].sum()),
            "specfit_min_vs_best_baseline": _min_or_none(specfit_rows["specfit_vs_best_baseline"]),
            "specfit_min_speedup_vs_ar": _min_or_none(specfit_rows["speedup_vs_ar"]),
            "specfit_min_speedup_vs_topn": _min_or_none(specfit_rows["speedup_vs_topn"]),
            "max_tokens_per_s": float(results["tokens_per_s"].max()),
            "total_h2d_gb": bytes_to_gb(float(results["h2d_bytes"].sum())),
            "trace": str(trace_path),
            "expert_bytes": int(cells[0].cost["expert_bytes"]),
            "wall_s": round(time.perf_counter() - started, 3),
        }
    )
    return 0


if __name__ == "__main__":
    run_main(main)
