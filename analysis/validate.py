"""``python -m analysis.validate``: every SpecFit decision checked live against the simulator.

For a grid of (bandwidth, cache size, tree policy in autoregressive / top-N / SpecFit):

1. ``live.record --mode dense`` records the dense trace of the prompts once (routing and
   acceptance do not depend on the link or the cache).
2. Per bandwidth, the policies that do not consult the cost model (``ar``, ``topn``) run live in
   policy mode at every cache size (emulated link on CPU at that bandwidth and ``--latency-us``;
   the real link on CUDA), ``--repeats`` times: repeat 1 of every such cell, then repeat 2, ...
   (so slow drift of a shared machine spreads over the cells). The cost model is fitted from the
   cycles of all those runs (:func:`calibration.costfit.fit_cost_model`, per-transfer latency =
   the link's configured latency when emulated) unless ``--cost`` is given. Then SpecFit runs live
   with that cost, repeat 1 at every cache size, then repeat 2, ..., so its cells are
   out-of-sample for the fit. Every grid cell drafts ``--depth`` levels except SpecFit, whose
   stopping rule may draft fewer; so that the fixed per-draft cost (``draft_base_s``) is
   identifiable, the fit also reads one calibration-only run, ``topn`` at depth 1
   (``live/bw<B>-c<C>-topn-d1/r1``, not a grid cell), when ``--depth`` > 1.
3. Every cell is replayed by ``sim.replay.replay_policy`` on the dense trace with the same policy,
   cache size, cache policy (LRU), cost model and the live cell's mean planner time, and compared
   (:func:`analysis.fidelity.compare_cell`): the simulator with the live throughput pooled over
   the repeats, the cost model with the per-cycle mean over repeats of the matched cycles.

Prefetch cells (``--prefetch none,draft,next-layer,both``): each mode runs live with
``live.record --prefetch`` and replays with ``sim.replay``'s same prefetch (draft: the policy's
predictor, which names no experts with ``union-size``; next-layer: the guesses the dense trace
recorded); their prefetch issued/used/wasted counts do not depend on timing, so every repeat's
per-cycle counts must equal the simulator's (``prefetch_counts_identical``, also part of ``ok`` and
``within_noise``; totals in ``live_prefetch_*`` / ``sim_prefetch_*``). The cost model is fitted on
the runs without overlap and without prefetch; next-layer prefetch's share and waste
(``calibration.costfit.fit_next_layer_terms``) per cache size, on the cost-free policies'
``next-layer`` cells (else ``both``) of the same bandwidth and cache (the share depends strongly
on the cache, as ``sim.sweep``'s pilots find; a cache with too few planner misses takes the fit
pooled over every cache, saying so in one line), saved as ``cost_<bw>_c<cache>.json``, so the
planned cells with next-layer prefetch price their cache's share (grid calibration, no ``--cost``;
inert in the other cells; ``--calibration separate`` takes the share per cache from replays).

The noise floor: decisions are deterministic (same inputs, same cost JSON), so the repeats of a
cell verify the same subtrees cycle by cycle (``repeat_same_subtree_fraction`` checks it) and
differ only in their timings. Per cell, ``live_repeat_spread_pct`` is the spread of the repeats'
throughputs ((max - min) / mean) and ``cycle_noise_median_pct`` / ``cycle_noise_p90_pct`` the
median / p90 over matched cycles of the per-cycle coefficient of variation of the model cycle
time across repeats (NaN with ``--repeats 1``). ``ok`` says the cell meets the issue-13 aims, each
against its own measured noise (throughput error within the repeat spread, per-cycle error median
within the per-cycle noise median, hit rate within 0.5 points, same subtree >= 99 %:
:mod:`analysis.fidelity`); ``within_noise`` says every missed fixed target (throughput 2 %,
per-cycle median 3 %, p90 8 %) is within that measured floor and the hit-rate and same-subtree
targets are met.

Both sides make their decisions from the same inputs: the simulator's default expert predictor
``union-size`` (priced at the cache's observed miss fraction) with the table fitted from the
dense trace of the same prompts (the live engine gets the dense run directory as
``--predictor-tables``, which fits it with the same function over the same trees as
``sim.replay``), the same acceptance map (``acceptance.json``, fitted once from that dense trace
by :func:`calibration.acceptance_fit.fit_acceptance`; draft probabilities on both sides when too
few nodes), and the same cost JSON per bandwidth.

Outputs under ``--out`` (default ``runs/validate/<UTC time>``): ``fidelity.csv`` (one row per cell),
``fidelity.json`` (grid summary), ``cycle_errors.csv`` (one row per matched cycle: predicted vs
mean measured cycle time, error and noise), ``error_split.csv`` (per policy and bandwidth: pooled
per-cycle errors and where the simulated-vs-live time error lives, term by term:
:func:`analysis.fidelity.by_policy`), ``cost_<bw>.json`` per bandwidth, ``acceptance.json``
(both sides' acceptance map), ``figures/`` (sim vs live throughput, per-cycle error and noise
distributions, throughput against bandwidth), the dense run under ``live/dense`` and every live
repeat under ``live/<cell>/r<k>`` (a complete run there is reused on a rerun), logs under ``logs/``.
The table (one row per cell, ``tput_ok`` / ``med_ok`` the two noise-relative aims beside the noise
they are held to, ``ok`` = every aim met, ``within_noise`` = every miss within the noise floor;
short headers, then a line mapping them to the fidelity.csv names) is followed by one line per
cell that misses an aim (the figure and the measured noise it was held to), the per-policy table
of where the error lives (``error_split.csv``), the wall time and machine load, the aims line
(with whether the grid aims were met), the grid's noise-floor line (with the per-cycle error a
bias-free model would show against the repeats' means: ``cycle_error_floor_*_pct``,
:func:`analysis.fidelity.noise_floor_pct`), where the per-cycle error lives (:func:`bias_line`:
the bias beyond that noise, the cells' offsets, the error within cells, the whole-run speed fraction
of the noise and the repeats the aims need; :func:`analysis.fidelity.error_decomposition`) and the cells' live compute speed against the cost's
fit runs (``live_compute_speed_pct`` per cell, :meth:`Validator.compute_speed_pct`; its range and
its correlation with the throughput errors in the summary), then the speed probe's line
(:func:`probe_line`): each cell's ``probe_speed_index`` (its runs' ``live.record`` speed-probe
median over the cost's fit runs', a gauge independent of the decoding), the cell replayed once
more with its cycles timed at that speed (``sim.config.SimConfig.compute_speed``; the planner
prices with the cost as live) giving ``norm_throughput_error_pct``,
``norm_cycle_error_median_pct`` / ``_p90_pct`` and ``norm_within_noise`` beside the raw ones,
the correlation of the probe with the runs' attention + router speed (per run in
``speed_runs.csv``) and the cells within noise raw and normalised; raw stays the headline unless
that correlation is strong (:data:`PROBE_TRACKS_R`). The fit runs are not normalised before
fitting (the cost is fitted at their pooled speed, the reference of the index). The last stdout line is the
JSON summary with the overall median and p90 per-cycle errors, ``aim_cycle_median`` /
``aim_cycle_p90``, ``repeats``, the pooled per-cycle noise (``noise_cycle_median_pct``,
``noise_cycle_p90_pct``), ``median_live_repeat_spread_pct`` / ``max_live_repeat_spread_pct``,
``wall_s``, ``load_avg_1min`` (at start and end) and ``cpu_count``, ``ran`` (the grid ran to the
end), ``all_targets_met`` (= ``all_aims_met``: every cell's ``ok`` and both grid aims) and
``all_within_noise`` (every cell's ``within_noise``).
Exit status: 0 (also when targets are missed: the report says which term is off), 2 for a bad
flag, 1 when a live run or the replay fails (the cell is named).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from analysis import fidelity
from calibration.checks import CalibrationDataError
from calibration.costfit import WEIGHTINGS, FitOptions, fit_cost_model
from live.spec.names import DTYPES
from specfit.cli import (
    ArgumentParser,
    choices_help,
    cli_main,
    comma_list,
    gb_per_s,
    non_negative_float,
    non_negative_int,
    positive_int,
    print_summary,
    run_main,
)
from specfit.cost import CycleCostModel, cost_file_warnings
from specfit.policies import TREE_POLICY_HELP
from specfit.prefetch import PREFETCH_MODES, uses_next_layer
from specfit.units import gb_per_s_to_bytes_per_s, us_to_s

GRID_POLICIES = ("ar", "topn", "specfit")
CALIBRATION_MODES = ("grid", "separate")  # --calibration
COST_FREE_POLICIES = ("ar", "topn")  # their choices do not depend on the cost model
SIM_PREDICTOR = "union-size"  # the expert predictor both sides use (sim default; live.record --predictor)
SIM_CACHE_POLICY = "lru"


# The per-cell table printed on stdout (short headers, :data:`analysis.fidelity.SHORT_COLUMNS`,
# with a legend line under it; fidelity.csv keeps the full names and every other column).
PRINTED_COLUMNS = (
    "bandwidth_gb_per_s",
    "cache_experts_per_layer",
    "policy",
    "overlap",
    "prefetch",
    "live_tokens_per_s",
    "sim_tokens_per_s",
    "throughput_error_pct",
    "live_repeat_spread_pct",
    "aim_throughput",
    "cycle_error_median_pct",
    "cycle_noise_median_pct",
    "aim_cycle_median",
    "cycle_error_p90_pct",
    "cycle_noise_p90_pct",
    "hit_rate_diff_points",
    "same_subtree_fraction",
    "off_terms",
    "prefetch_counts_identical",
    "within_noise",
    "ok",
    "probe_speed_index",
    "norm_throughput_error_pct",
    "norm_cycle_error_median_pct",
    "norm_within_noise",
)
# the per-(policy, bandwidth) table of where the error lives (analysis.fidelity.by_policy)
SPLIT_PRINTED = (
    "policy",
    "bandwidth_gb_per_s",
    "overlap",
    "cells",
    "cycles",
    "throughput_error_pct",
    "cycle_error_median_pct",
    "cycle_error_p90_pct",
    "cycle_error_signed_median_pct",
    *(f"split_{t}_pct" for t in fidelity.SPLIT_TERMS),
)


class ValidationError(RuntimeError):
    """A live run or replay of one cell failed (the message names the cell)."""


@dataclass(frozen=True)
class Cell:
    """One grid cell: bandwidth (GB/s), cache size (experts per layer), tree policy; ``depth`` set
    only for the calibration-only runs (a draft depth other than ``--depth``)."""

    bandwidth_gb_per_s: float
    cache_experts_per_layer: int
    policy: str
    depth: int | None = None
    overlap: str = "off"
    prefetch: str = "none"
    calibration: bool = False  # a --calibration separate run the cost is fitted on, not compared

    @property
    def name(self) -> str:
        """Folder-safe name, e.g. ``bw16-c8-specfit`` (``bw16-c8-topn-d1`` with a depth,
        ``bw16-c8-specfit-ovl`` with overlap on, ``bw16-c8-ar-pf-next-layer`` with a prefetch)."""
        name = f"bw{self.bandwidth_gb_per_s:g}-c{self.cache_experts_per_layer}-{self.policy}"
        name = name if self.depth is None else f"{name}-d{self.depth}"
        name = name if self.overlap == "off" else f"{name}-ovl"
        name = name if self.prefetch == "none" else f"{name}-pf-{self.prefetch}"
        return f"{name}-cal" if self.calibration else name

    def key(self) -> dict[str, Any]:
        """The fidelity row's key columns (:data:`analysis.fidelity.CELL_KEY`, in that order)."""
        return {column: getattr(self, column) for column in fidelity.CELL_KEY}


def cell_cost(costs: dict[Any, Any], cell: Cell) -> Any:
    """The entry of ``costs`` (a cost, its JSON path, or both) a cell runs and is priced with:
    the one for its ``(overlap, cache size)`` (the next-layer share per cache), else the one for
    its overlap."""
    key = (cell.overlap, cell.cache_experts_per_layer)
    return costs[key] if key in costs else costs[cell.overlap]


def _fit_next_layer(runs: list[Path], what: str) -> Any:
    """:func:`calibration.costfit.fit_next_layer_terms` on ``runs``' cycles; a failure is a
    :class:`ValidationError` naming ``what`` (e.g. ``"cache 8"``)."""
    from calibration.costfit import fit_next_layer_terms
    from calibration.runs import load_runs

    try:
        return fit_next_layer_terms(load_runs(runs).cycles)
    except ValueError as exc:
        raise ValidationError(f"next-layer prefetch terms ({what}): {exc}") from None


def build_parser() -> ArgumentParser:
    """The CLI's parser."""
    p = ArgumentParser(prog="python -m analysis.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="target checkpoint directory or 'default' (embedded)")
    p.add_argument(
        "--draft", default=None, help="draft checkpoint directory (default: embedded with --model default)"
    )
    p.add_argument(
        "--prompts",
        default="default",
        help="'default', 'mtbench' or a .jsonl/.txt prompt file (as live.record --prompts: the MT-bench "
        "question.jsonl layout is read, first turn)",
    )
    p.add_argument(
        "--category",
        default=None,
        metavar="NAME[,NAME]",
        help="only the prompts of these categories (as live.record --category); default: every prompt",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="model weight dtype of the live runs (live.record --dtype); bfloat16 for the real-width "
        "checkpoint of `python -m live.build_width`",
    )
    p.add_argument("--num-prompts", type=positive_int, default=3, help="prompts (count)")
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=24, help="tokens generated per prompt (count)"
    )
    p.add_argument(
        "--bandwidth",
        type=comma_list(gb_per_s),
        default=[1.0, 8.0],
        help="emulated H2D bandwidths in GB/s (CPU; 1 GB = 1e9 B, at most 10,000); on a GPU one value, a "
        "label of the real link",
    )
    p.add_argument(
        "--latency-us", type=non_negative_float, default=20.0, help="emulated per-transfer latency (us)"
    )
    p.add_argument(
        "--cache",
        "--cache-experts",
        dest="cache_experts",
        type=comma_list(positive_int),
        default=None,
        help="cache sizes (experts per layer) list; default: a quarter and a half of the experts per layer",
    )
    p.add_argument(
        "--policy",
        "--policies",
        dest="policies",
        type=comma_list(str),
        default=list(GRID_POLICIES),
        help="tree policies, comma-separated: " + choices_help(GRID_POLICIES, TREE_POLICY_HELP),
    )
    p.add_argument("--depth", type=positive_int, default=3, help="maximum draft depth (levels)")
    p.add_argument("--topk", type=positive_int, default=2, help="children per frontier node (count)")
    p.add_argument(
        "--max-nodes", type=positive_int, default=8, help="draft tree node budget incl. the root (count)"
    )
    p.add_argument(
        "--device", default="cpu", help="device for the live engine (cpu; cuda uses the real link)"
    )
    p.add_argument(
        "--cost", default=None, help="CycleCostModel JSON to use instead of fitting (bandwidth replaced)"
    )
    p.add_argument(
        "--min-cycles", type=positive_int, default=8, help="fewest cycles to fit a cost model (count)"
    )
    p.add_argument(
        "--weighting",
        choices=WEIGHTINGS,
        default="absolute",
        help="cost-fit residuals: relative or absolute (absolute suits a busy shared CPU); see calibration.lsq",
    )
    p.add_argument(
        "--miss-compute",
        choices=("on", "off"),
        default="on",
        help="fit a compute cost per cache miss into the per-transfer H2D cost (per-miss work outside the "
        "timed copies, e.g. transient-expert kernels and caches evicted by emulated copies; "
        "calibration.costfit.FitOptions.miss_compute)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=2,
        help="live runs per policy-mode cell (count); the repeats measure the run-to-run noise floor",
    )
    p.add_argument(
        "--overlap",
        type=comma_list(str),
        default=["off"],
        help="compute/H2D overlap of the policy-mode cells, off and/or on (live.record --overlap, "
        "sim.sweep --overlap: the same per-layer model); e.g. off,on for a cell of each",
    )
    p.add_argument(
        "--prefetch",
        type=comma_list(str),
        default=["none"],
        help="expert prefetch of the policy-mode cells, comma-separated, a cell each: "
        + ", ".join(PREFETCH_MODES)
        + " (live.record --prefetch, sim.sweep --prefetch: the same choices at the same points); "
        "e.g. none,draft,next-layer. Per cell, prefetch issued/used/wasted live vs simulated, which "
        "do not depend on timing and must be identical",
    )
    p.add_argument(
        "--calibration",
        choices=CALIBRATION_MODES,
        default="grid",
        help="where the cost model is fitted: grid = on the ar/topn cells themselves (in sample for "
        "them; SpecFit's cells recorded after the fit); separate = on runs of their own first (ar/topn "
        "at the first cache size, --repeats each, off and on), then every cell out of sample and "
        "recorded interleaved, repeat by repeat, so a drift of the machine's speed hits every cell alike",
    )
    p.add_argument("--seed", type=int, default=0, help="seed (live runs and fit split)")
    p.add_argument(
        "--threads",
        "--torch-threads",
        dest="torch_threads",
        type=non_negative_int,
        default=1,
        help="torch intra-op threads of the live runs (count; 0 = torch's default, as in live.record); "
        "1 keeps CPU timings steady on a shared machine",
    )
    p.add_argument("--out", default=None, help="output folder (default runs/validate/<UTC time>)")
    p.add_no_progress()
    p.later_spellings("--cache", "--policy", "--threads")  # README "Flag spellings": old abbreviations keep their flag
    return p


def live_record(argv: list[str], log: Path) -> None:
    """Run ``live.record.main(argv)`` in this process, its stdout into ``log`` (also used by
    ``benchmarks/wait_step.py``).

    Raises:
        ValidationError: non-zero exit or an exception inside the live engine (the command is named).
    """
    from live.record import main as record_main

    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle, contextlib.redirect_stdout(handle):
        try:
            code = record_main(argv)
        except SystemExit as exc:  # argparse/SessionError: exit 2
            code = int(exc.code or 0)
        except Exception as exc:  # the live engine failed: name the run, keep the cause
            raise ValidationError(
                f"live.record {' '.join(argv)} failed: {type(exc).__name__}: {exc}; log: {log}"
            ) from exc
        finally:
            # a finished run's model, expert store and pool sit in reference cycles (module hooks):
            # free them now, or every in-process run keeps its checkpoint alive (a 2.5 GB real-width
            # target per run runs a grid out of memory)
            gc.collect()
    if code != 0:
        raise ValidationError(f"live.record {' '.join(argv)} exited {code}; see {log}")


def _started(path: Path) -> bool | None:
    """Whether the run at ``path`` is complete (True), started but interrupted (False), or absent
    (None)."""
    from traces.reader import read_manifest

    if not (path / "manifest.json").is_file():
        return None
    return bool(read_manifest(path).complete)


class Validator:
    """Runs the grid (see the module docstring). ``args`` are the parsed flags."""

    def __init__(self, args: Any, out: Path) -> None:
        """A validation of the parsed ``args`` (:func:`build_parser`) writing under ``out``."""
        self.args = args
        self.out = out
        self.cells_done: list[dict[str, Any]] = []
        self.per_cycle: list[pd.DataFrame] = []
        self.cost_splits: dict[tuple[float, str], dict[str, float]] = {}  # (bandwidth, overlap) -> term_split()
        self.fits: dict[float, Any] = {}  # bandwidth -> the serial CostFit
        self.fit_runs: dict[tuple[float, str], list[Path]] = {}  # (bandwidth, overlap) -> the cost's fit runs
        self._cycles: dict[Path, pd.DataFrame] = {}  # run folder -> its cycles table (fit runs, read once)
        self._speed_refs: dict[tuple[Path, ...], Any] = {}  # fit runs -> their attention + router line
        self.speed_runs: list[dict[str, Any]] = []  # per live run: probe index and attention + router speed
        self.dense_path: Path | None = None
        self.dense: Any = None  # the open dense trace (run)
        self.acceptance: dict[str, Any] | None = None
        self.acceptance_path: Path | None = None

    def fit_acceptance(self, dense: Any) -> None:
        """Fit the acceptance map both sides use from the dense trace (``acceptance.json``); leaves
        it ``None`` (draft probabilities on both sides) when the trace has too few nodes."""
        from calibration.acceptance_fit import AcceptanceDataError, fit_acceptance
        from calibration.fit import dense_nodes_frame

        try:
            fit = fit_acceptance(
                dense_nodes_frame([("dense", dense.node_arrays())]),
                seed=self.args.seed,
                source=f"analysis.validate {self.dense_path}",
            )
        except AcceptanceDataError as exc:
            print(
                f"warning: acceptance map not fitted ({exc}); draft probabilities on both sides",
                file=sys.stderr,
            )
            return
        self.acceptance = fit.calibration.to_dict()
        self.acceptance_path = self.out / "acceptance.json"
        self.acceptance_path.write_text(json.dumps(self.acceptance, indent=2) + "\n")

    def _common(self, depth: int | None = None) -> list[str]:
        a = self.args
        depth = a.depth if depth is None else depth
        argv = ["--model", a.model, "--prompts", a.prompts, "--num-prompts", str(a.num_prompts)]
        argv += ["--max-new-tokens", str(a.max_new_tokens), "--depth", str(depth), "--topk", str(a.topk)]
        argv += ["--max-nodes", str(a.max_nodes), "--device", a.device, "--seed", str(a.seed)]
        argv += ["--dtype", a.dtype]
        if a.draft is not None:
            argv += ["--draft", a.draft]
        if a.category is not None:
            argv += ["--category", a.category]
        if a.no_progress:
            argv.append("--no-progress")
        return argv

    def _link_flags(self, bandwidth: float) -> list[str]:
        if not self.args.device.startswith("cpu"):
            return []  # the real link is measured on a GPU
        return ["--bandwidth", f"{bandwidth:g}", "--latency-us", f"{self.args.latency_us:g}"]

    def record_dense(self) -> Path:
        """Record the dense trace, reuse it when complete, or finish it (``--resume``) when a
        previous call was interrupted."""
        path = self.out / "live" / "dense"
        argv = [*self._common(), "--mode", "dense", "--out", str(path)]
        started = _started(path)
        if started is None or not started:
            live_record(argv + (["--resume"] if started is False else []), self.out / "logs" / "dense.log")
        return path

    def run_live(self, cell: Cell, cost_path: Path | None, repeat: int = 1) -> Path:
        """Record repeat ``repeat`` (1-based) of one live policy-mode cell under
        ``live/<cell>/r<repeat>`` (reused when complete); returns the run folder.

        Raises:
            ValidationError: the live run failed (the command and its log are named).
        """
        path = self.out / "live" / cell.name / f"r{repeat}"
        started = _started(path)
        if started:
            return path
        argv = [*self._common(cell.depth), "--mode", "policy", "--policy", cell.policy]
        argv += ["--predictor", SIM_PREDICTOR, "--predictor-tables", str(self.dense_path)]
        argv += ["--cache-policy", SIM_CACHE_POLICY]
        if self.acceptance_path is not None:
            argv += ["--acceptance", str(self.acceptance_path)]
        argv += ["--cache", str(cell.cache_experts_per_layer), "--out", str(path)]
        argv += self._link_flags(cell.bandwidth_gb_per_s)
        if cell.overlap != "off":
            argv += ["--overlap", cell.overlap]
        if cell.prefetch != "none":
            argv += ["--prefetch", cell.prefetch]
        if cost_path is not None:
            argv += ["--cost", str(cost_path)]
        if started is False:  # an interrupted earlier call: finish it
            argv.append("--resume")
        live_record(argv, self.out / "logs" / f"{cell.name}-r{repeat}.log")
        return path

    def run_repeats(
        self, cells: list[Cell], cost_path: Path | None | dict[str, Path | None]
    ) -> dict[Cell, list[Path]]:
        """Record ``--repeats`` runs of each cell: repeat 1 of every cell, then repeat 2, ... (so
        a drift of the machine's load hits every cell alike); ``cost_path``: one cost JSON, or
        one per overlap value or per ``(overlap, cache size)`` (:func:`cell_cost`); returns each cell's run folders in repeat order."""
        paths: dict[Cell, list[Path]] = {cell: [] for cell in cells}
        for repeat in range(1, self.args.repeats + 1):
            for cell in cells:
                cost = cell_cost(cost_path, cell) if isinstance(cost_path, dict) else cost_path
                paths[cell].append(self.run_live(cell, cost, repeat))
        return paths

    def cost_for(self, bandwidth: float, runs: list[Path], model: Any) -> tuple[CycleCostModel, Path]:
        """The cost model of one bandwidth: ``--cost`` re-based, or fitted from ``runs``' cycles.

        Args:
            bandwidth: the cell's link bandwidth (GB/s); an emulated link's bandwidth replaces
                ``--cost``'s.
            runs: the live runs to fit on (run folders; unused with ``--cost``).
            model: the dense trace's ``ModelInfo`` (expert bytes, MoE layers).

        Returns:
            ``(cost model, its JSON under the output folder)``.

        Raises:
            CalibrationDataError: the runs cannot be read or fitted (run and field named).
        """
        path = self.out / f"cost_{bandwidth:g}.json"
        emulated = self.args.device.startswith("cpu")
        if self.args.cost is not None:
            cost = CycleCostModel.load(self.args.cost)
            if emulated:
                cost = cost.with_bandwidth(gb_per_s_to_bytes_per_s(bandwidth))
            cost.save(path)
            return cost, path
        from calibration.runs import load_runs

        try:
            loaded = load_runs(runs)
        except ValueError as exc:
            raise CalibrationDataError(str(exc)) from None
        options = FitOptions(
            min_cycles=self.args.min_cycles,
            seed=self.args.seed,
            known_s_per_transfer=us_to_s(self.args.latency_us) if emulated else None,
            weighting=self.args.weighting,
            miss_compute=self.args.miss_compute == "on",
        )
        cycles, transfers, _ = loaded.cost_fit_tables()
        fit = fit_cost_model(
            cycles,
            transfers,
            expert_bytes=model.bytes_per_expert,
            num_layers=model.num_layers,
            options=options,
            source=f"analysis.validate fit at {bandwidth:g} GB/s from {len(runs)} runs",
        )
        fit.model.save(path)
        self.fits[bandwidth] = fit
        self.fit_runs[(bandwidth, "off")] = list(runs)
        self.cost_splits[(bandwidth, "off")] = fit.term_split()
        (self.out / f"cost_{bandwidth:g}_report.json").write_text(
            json.dumps(fit.to_dict(), indent=2, default=float) + "\n"
        )
        return fit.model, path

    def overlap_cost_for(
        self, bandwidth: float, cost: CycleCostModel, runs: list[Path]
    ) -> tuple[CycleCostModel, Path]:
        """The overlap-on cost model of one bandwidth: ``cost`` priced with overlap mode "on",
        its compute-stream terms (placing per miss, late-expert call) fitted on ``runs`` (the
        cost-free policies' overlap-on runs; ``calibration.costfit.fit_overlap_terms``) when the
        serial cost was fitted here, else ``cost`` as given (``--cost``).

        Returns:
            ``(cost model, its JSON under the output folder)``.

        Raises:
            CalibrationDataError: the runs cannot be read or fitted (run and field named).
        """
        path = self.out / f"cost_{bandwidth:g}_overlap.json"
        fit = self.fits.get(bandwidth)
        if fit is None or not runs:
            cost = dataclasses.replace(cost, overlap_h2d=True, overlap_mode="on")
            cost.save(path)
            return cost, path
        from calibration.costfit import OVERLAP_FIT_REPORT_VERSION, fit_overlap_terms
        from calibration.runs import load_runs

        try:
            cycles, transfers, _ = load_runs(runs).cost_fit_tables()
        except ValueError as exc:
            raise CalibrationDataError(str(exc)) from None
        overlap = fit_overlap_terms(fit, cycles, transfers)
        overlap.model.save(path)
        self.fit_runs[(bandwidth, "on")] = list(runs)
        self.cost_splits[(bandwidth, "on")] = overlap.term_split()
        report = {
            "version": OVERLAP_FIT_REPORT_VERSION,
            "cost": overlap.model.to_dict(),
            **overlap.report_fields(),
        }
        (self.out / f"cost_{bandwidth:g}_overlap_report.json").write_text(
            json.dumps(report, indent=2, default=float) + "\n"
        )
        return overlap.model, path

    def _fit_serial(self, bw: float, fit_runs: list[Path], first_cache: int, model: Any) -> tuple[CycleCostModel, Path]:
        """Fit one bandwidth's serial cost on ``fit_runs`` plus a depth-1 topn run (so
        ``draft_base_s`` is identifiable); a failed fit is a :class:`ValidationError`."""
        if self.args.depth > 1:
            fit_runs = [*fit_runs, self.run_live(Cell(bw, first_cache, "topn", depth=1), None)]
        try:
            return self.cost_for(bw, fit_runs, model)
        except CalibrationDataError as exc:
            raise ValidationError(f"bandwidth {bw:g} GB/s: cost fit failed: {exc}") from None

    def _fit_overlap(self, bw: float, cost: CycleCostModel, runs: list[Path]) -> tuple[CycleCostModel, Path]:
        """:meth:`overlap_cost_for`, a failed fit a :class:`ValidationError`."""
        try:
            return self.overlap_cost_for(bw, cost, runs)
        except CalibrationDataError as exc:
            raise ValidationError(f"bandwidth {bw:g} GB/s: overlap cost fit failed: {exc}") from None

    def _next_layer_shares(self, bw: float, live_paths: dict[Cell, list[Path]], caches: list[int]) -> dict[int, Any]:
        """Default ``--calibration grid``: next-layer prefetch's share and waste per cache size of
        the grid, fitted on that cache's cost-free cells recorded with ``--prefetch next-layer``
        (else ``both``) in ``live_paths`` (``calibration.costfit.fit_next_layer_terms``: per tree
        size where the counts allow): the share depends strongly on the cache, so each cache gets
        its own fit, as ``sim.sweep``'s pilots and ``--calibration separate`` do. A cache whose runs
        hold fewer than ``specfit.prefetch.NEXT_LAYER_MIN_KNOT_MISSES`` planner misses (demand
        misses of layers 1..L-1 + used prefetches, as the knots count them) takes the fit pooled over every cache size, and one stderr line
        says so. Empty with ``--cost`` or without such runs (the cost is then used as it is).

        Returns:
            cache size -> :class:`calibration.costfit.NextLayerFit`.

        Raises:
            ValidationError: the runs' prefetch counts cannot be fitted.
        """
        from specfit.prefetch import NEXT_LAYER_MIN_KNOT_MISSES

        runs: dict[int, list[Path]] = {}
        for prefetch in ("next-layer", "both"):
            for cell, paths in live_paths.items():
                if cell.prefetch == prefetch:
                    runs.setdefault(cell.cache_experts_per_layer, []).extend(paths)
            if runs:
                break
        if self.args.cost is not None or not runs:
            return {}
        fits = {c: _fit_next_layer(paths, f"cache {c}") for c, paths in runs.items()}
        pooled = _fit_next_layer([p for paths in runs.values() for p in paths], "every cache")
        shares = {}
        for c in caches:
            fit = fits.get(c)
            # the knots' count (specfit.prefetch.next_layer_share_by_nodes): layer 0's misses left out
            planner_misses = 0 if fit is None else fit.num_planner_misses
            if planner_misses < NEXT_LAYER_MIN_KNOT_MISSES:
                print(
                    f"warning: {bw:g} GB/s, cache {c}: next-layer prefetch share pooled over every cache size "
                    f"({planner_misses} planner misses in this cache's next-layer runs, < {NEXT_LAYER_MIN_KNOT_MISSES})",
                    file=sys.stderr,
                )
                fit = pooled
            shares[c] = fit
        return shares

    @staticmethod
    def _priced_per_cache(
        cost: CycleCostModel, path: Path, shares: dict[int, Any], caches: list[int]
    ) -> dict[int, tuple[CycleCostModel, Path]]:
        """Per cache size, ``cost`` with that cache's next-layer share (a
        :class:`specfit.prefetch.NextLayerShare` in ``shares``) saved beside ``path`` as
        ``<stem>_c<cache>.json``; ``cost`` at ``path`` for every cache when ``shares`` is empty."""
        if not shares:
            return {c: (cost, path) for c in caches}
        priced = {}
        for c in caches:
            cache_cost, cache_path = dataclasses.replace(cost, **shares[c].cost_fields()), path.with_name(f"{path.stem}_c{c}.json")
            cache_cost.save(cache_path)
            priced[c] = (cache_cost, cache_path)
        return priced

    def _with_replayed_share(
        self, cost: CycleCostModel, path: Path, caches: list[int]
    ) -> dict[int, tuple[CycleCostModel, Path]]:
        """``--calibration separate``: per cache size of the grid, ``cost`` with next-layer
        prefetch's share per tree size estimated by replays of ``sim.sweep.PILOT_POLICIES`` on the
        dense trace at that cache (``sim.sweep.next_layer_share_from_replays``, one cache at a
        time as ``sim.sweep``'s pilots: the share depends strongly on the cache; the counts do not
        depend on timing and are the live engine's to the copy, so no calibration run is needed
        and no cell is in sample), saved beside ``path`` as ``<stem>_c<cache>.json``; ``cost`` at
        ``path`` for every cache with ``--cost`` or when no planned cell prefetches one layer ahead."""
        from sim.config import SimConfig
        from sim.sweep import next_layer_share_from_replays
        from specfit.prefetch import uses_next_layer

        if self.args.cost is not None or not any(uses_next_layer(f) for f in getattr(self.args, "prefetch", ["none"])):
            return {c: (cost, path) for c in caches}
        shares = {}
        for c in caches:
            config = SimConfig(
                cost=cost, policy="ar", cache_capacity_per_layer=c, cache_policy=SIM_CACHE_POLICY,
                predictor=SIM_PREDICTOR, seed=self.args.seed, acceptance=self.acceptance,
            )  # fmt: skip
            try:
                shares[c] = next_layer_share_from_replays(self.dense, [config])
            except ValueError as exc:
                raise ValidationError(f"next-layer prefetch share (replays, cache {c}): {exc}") from None
        return self._priced_per_cache(cost, path, shares, caches)

    def _planned_cells(self, bw: float, caches: list[int]) -> list[Cell]:
        """The grid's cells of the planned (cost-using) policies at one bandwidth."""
        return [
            Cell(bw, c, p, overlap=o, prefetch=f)
            for p in self.args.policies
            if p not in COST_FREE_POLICIES
            for c in caches
            for o in getattr(self.args, "overlap", ["off"])
            for f in getattr(self.args, "prefetch", ["none"])
        ]

    def run_separate(
        self, bw: float, caches: list[int], free: list[Cell], model: Any, cost: Any, cost_path: Any
    ) -> tuple[dict[Cell, list[Path]], dict[str, tuple[CycleCostModel, Path]]]:
        """``--calibration separate`` at one bandwidth: fit the cost on calibration runs of their
        own (ar/topn at the first cache size, ``--repeats`` each, plus a depth-1 topn run; the
        overlap terms on their overlap-on twins), then record every cell of the grid, ar/topn and
        planned alike, interleaved repeat by repeat: every cell is out of sample, and a drift of
        the machine's speed between blocks of runs hits every cell alike (and shows in each
        cell's repeat noise). Returns each cell's run folders and the cost (model, JSON) per
        ``(overlap, cache size)`` (:func:`cell_cost`)."""
        overlaps = list(getattr(self.args, "overlap", ["off"]))
        if cost is None:
            cal = [Cell(bw, caches[0], p, calibration=True) for p in COST_FREE_POLICIES]
            fit_runs = [path for paths in self.run_repeats(cal, None).values() for path in paths]
            cost, cost_path = self._fit_serial(bw, fit_runs, caches[0], model)
        costs = {"off": (cost, cost_path)}
        on = [o for o in overlaps if o != "off"]
        if on:
            overlap_runs = []
            if self.args.cost is None:
                cal = [Cell(bw, caches[0], p, overlap=on[0], calibration=True) for p in COST_FREE_POLICIES]
                overlap_runs = [path for paths in self.run_repeats(cal, None).values() for path in paths]
            costs["on"] = self._fit_overlap(bw, cost, overlap_runs)
        costs = {  # no prefetch runs above: the share from replays, per cache
            (o, c): priced for o, pair in costs.items() for c, priced in self._with_replayed_share(*pair, caches).items()
        }
        cells = [*free, *self._planned_cells(bw, caches)]
        return self.run_repeats(cells, {key: path for key, (_, path) in costs.items()}), costs

    def replay(
        self, dense: Any, cell: Cell, cost: CycleCostModel, decision_s: float, compute_speed: float = 1.0
    ) -> Any:
        """Replay one cell on the dense trace (its cycles timed at ``compute_speed`` x the cost's
        compute, its planner pricing with ``cost``: ``sim.config.SimConfig.compute_speed``).

        Args:
            dense: the open dense trace (``traces.reader.open_run``).
            cell: the grid cell (bandwidth, cache, policy, overlap, prefetch).
            cost: the cell's cost model.
            decision_s: the planner time charged per cycle (seconds; the live runs' mean).
            compute_speed: compute-time multiplier (1 = the cost's own).

        Returns:
            :func:`sim.replay.replay_policy`'s result (cycles and totals).

        Raises:
            ValidationError: the replay failed (cell named).
        """
        from sim.config import SimConfig
        from sim.replay import replay_policy

        config = SimConfig(
            cost=cost,
            policy=cell.policy,
            cache_capacity_per_layer=cell.cache_experts_per_layer,
            cache_policy=SIM_CACHE_POLICY,
            predictor=SIM_PREDICTOR,
            overlap=cell.overlap,
            prefetch=cell.prefetch,
            decision_s=decision_s,
            seed=self.args.seed,
            record_cycles=True,
            acceptance=self.acceptance,
            compute_speed=compute_speed,
        )
        try:
            return replay_policy(dense, config)
        except ValueError as exc:
            raise ValidationError(f"cell {cell.name}: replay failed: {exc}") from None

    def compare(self, dense: Any, cell: Cell, live_paths: list[Path], cost: CycleCostModel) -> dict[str, Any]:
        """Replay and compare one cell against its live repeats (run folders in repeat order);
        keeps its per-cycle errors and noise (one row per matched cycle).

        Raises:
            ValidationError: the replay failed or the live tables cannot be compared (cell named).
        """
        from traces.reader import open_run

        runs = [open_run(p) for p in live_paths]
        cycles, transfers = [r.cycles for r in runs], [r.transfers for r in runs]
        decision = pd.concat([pd.to_numeric(c["decision_s"], errors="coerce") for c in cycles]).fillna(0.0)
        decision_s = float(decision.mean()) if len(decision) else 0.0
        result = self.replay(dense, cell, cost, decision_s)
        sim_cycles = pd.DataFrame([dataclasses.asdict(r) for r in result.cycles])
        try:
            row = fidelity.compare_cell(
                cell.key(),
                cycles,
                transfers,
                result.totals.to_dict(),
                sim_cycles,
                cost,
                cost_split=self.cost_splits.get((cell.bandwidth_gb_per_s, cell.overlap)),
            )
            match = fidelity.match_repeats(cycles)
            errors = fidelity.cycle_error_table(cost, match)
        except ValueError as exc:
            raise ValidationError(f"cell {cell.name}: cannot compare the live runs: {exc}") from None
        row.update(prefetch_counts(cycles, sim_cycles))
        if not row["prefetch_counts_identical"]:  # not timing: no noise floor excuses it
            row["ok"] = row["within_noise"] = False
        frac = row["repeat_same_subtree_fraction"]
        if np.isfinite(frac) and frac < 1.0:
            print(
                f"warning: cell {cell.name}: the repeats verified different subtrees in "
                f"{1.0 - frac:.1%} of the cycles they share; noise and errors use the "
                f"{row['num_cycles_matched']} matched cycles",
                file=sys.stderr,
            )
        for column, value in reversed(cell.key().items()):
            errors.insert(0, column, value)
        self.per_cycle.append(errors)
        row["live_compute_speed_pct"] = self.compute_speed_pct(cell, cycles)
        row.update(self.normalised(dense, cell, live_paths, cycles, row, fidelity.mean_repeat_cycles(match), cost, decision_s))
        if not row["prefetch_counts_identical"]:
            row["norm_within_noise"] = False
        return row

    def _fit_run_paths(self, cell: Cell) -> list[Path]:
        """The runs the cell's cost was fitted on (empty with ``--cost``)."""
        return self.fit_runs.get((cell.bandwidth_gb_per_s, "off" if cell.overlap == "off" else "on"), [])

    def _speed_reference(self, cell: Cell) -> fidelity.ComputeSpeedReference | None:
        """The attention + router line of the cell's cost's fit runs
        (:class:`analysis.fidelity.ComputeSpeedReference`), fitted once per set of fit runs; None
        with ``--cost`` (no fit runs) or runs without ``layer_pre_router_s``."""
        from traces.reader import open_run

        paths = tuple(self._fit_run_paths(cell))
        if paths not in self._speed_refs:
            for path in paths:
                if path not in self._cycles:
                    self._cycles[path] = open_run(path).cycles
            self._speed_refs[paths] = fidelity.ComputeSpeedReference.fit([self._cycles[p] for p in paths])
        return self._speed_refs[paths]

    def compute_speed_pct(self, cell: Cell, cycles: list[pd.DataFrame]) -> float:
        """How much slower (+) or faster (-) the cell's live compute ran than the runs its cost was
        fitted on, in % (:func:`analysis.fidelity.compute_speed` on their attention + router
        time); NaN when the cost was given (``--cost``: no fit runs) or the runs lack
        ``layer_pre_router_s``. The machine's speed drifting between runs shows here: the
        simulator prices every cell at the fit runs' speed. A diagnostic only: the cell's own
        cycles never set the simulator's speed (the speed probe's index does, :meth:`normalised`)."""
        ref = self._speed_reference(cell)
        return (ref.speed(cycles) - 1.0) * 100.0 if ref is not None else float("nan")

    def normalised(
        self,
        dense: Any,
        cell: Cell,
        live_paths: list[Path],
        cycles: list[pd.DataFrame],
        row: dict[str, Any],
        mean_cycles: pd.DataFrame,
        cost: CycleCostModel,
        decision_s: float,
    ) -> dict[str, Any]:
        """The cell's figures at its runs' measured machine speed: ``probe_speed_index`` (its
        runs' speed-probe median over the cost's fit runs', :func:`analysis.fidelity.probe_speed_index`),
        and, the cell replayed with its cycles timed at that index (the planner pricing with the
        cost as live: :attr:`sim.config.SimConfig.compute_speed`) and the per-cycle errors taken
        against ``cost.with_compute_speed(index)`` (:func:`analysis.fidelity.rescored` of the raw
        ``row``), ``norm_sim_tokens_per_s``, ``norm_throughput_error_pct``,
        ``norm_cycle_error_median_pct``, ``norm_cycle_error_p90_pct`` and ``norm_within_noise``
        (held to the same repeat noise as the raw figures). NaN (and ``norm_within_noise`` None)
        when a side has no probe, or when the two sides timed different gauges
        (:func:`speed_probe_gauge`: a warning says so). Each run's probe index, its matrix-chain probe index
        (``chain_probe_speed_index``, the previous gauge, recorded beside it) and its attention +
        router speed (:func:`analysis.fidelity.compute_speed`) go to ``speed_runs``, whose
        correlations say whether each gauge tracks the compute at all.

        Raises:
            ValidationError: the replay failed.
        """
        fit_paths = self._fit_run_paths(cell)
        reference = [speed_probe_s(p) for p in fit_paths]
        chain_reference = [speed_probe_s(p, CHAIN_PROBE_KEY) for p in fit_paths]
        own = [speed_probe_s(p) for p in live_paths]
        ref_gauges = {speed_probe_gauge(p) for p, r in zip(fit_paths, reference) if len(r)}
        own_gauges = [speed_probe_gauge(p) for p in live_paths]
        mixed = ref_gauges | {g for g, o in zip(own_gauges, own) if len(o)}
        index = fidelity.probe_speed_index(reference, own) if len(mixed) <= 1 else np.nan
        if len(mixed) > 1:  # e.g. fit runs reused from an older output folder, timed on the chain
            print(
                f"warning: cell {cell.name}: its runs and its cost's fit runs timed different speed probes "
                f"({', '.join(sorted(mixed))}; summary.json's speed_probe_workload); probe index left NaN",
                file=sys.stderr,
            )
        speed_ref = self._speed_reference(cell)
        for repeat, (path, probe, gauge, run_cycles) in enumerate(zip(live_paths, own, own_gauges, cycles), start=1):
            self.speed_runs.append(
                {
                    **cell.key(),
                    "repeat": repeat,
                    "probe_speed_index": fidelity.probe_speed_index(reference, [probe])
                    if ref_gauges <= {gauge} else np.nan,
                    "chain_probe_speed_index": fidelity.probe_speed_index(
                        chain_reference, [speed_probe_s(path, CHAIN_PROBE_KEY)]
                    ),
                    "compute_speed": speed_ref.speed([run_cycles]) if speed_ref is not None else np.nan,
                }
            )
        out: dict[str, Any] = {"probe_speed_index": index}
        names = ("sim_tokens_per_s", "throughput_error_pct", "cycle_error_median_pct", "cycle_error_p90_pct")
        if not np.isfinite(index):
            return {**out, **{f"norm_{n}": np.nan for n in names}, "norm_within_noise": None}
        result = self.replay(dense, cell, cost, decision_s, compute_speed=index)
        norm = fidelity.rescored(row, result.totals.to_dict(), cost.with_compute_speed(index), mean_cycles)
        return {**out, **{f"norm_{n}": norm[n] for n in names}, "norm_within_noise": norm["within_noise"]}

    def run(self, progress: bool = True) -> tuple[pd.DataFrame, dict[str, Any]]:
        """Run the whole grid; returns (fidelity table, summary).

        Args:
            progress: bars on stderr.

        Returns:
            ``(fidelity table: one row per cell, summary: analysis.fidelity.overall and the run's
            figures)``.

        Raises:
            ValidationError: a ``--cache`` above the model's experts, a live run, fit or replay
                that failed (named).
            CalibrationDataError: runs that cannot be fitted (named).
        """
        from sim.replay import level_tree_note
        from traces.reader import open_run

        dense_path = self.dense_path = self.record_dense()
        dense = self.dense = open_run(dense_path)
        level_note = level_tree_note(dense)  # a dense trace reused from before format v2
        if level_note:
            print(f"warning: {dense_path}: {level_note}", file=sys.stderr)
        self.fit_acceptance(dense)
        model = dense.manifest.model
        caches = self.args.cache_experts or sorted(
            {max(1, model.num_experts // 4), max(1, model.num_experts // 2)}
        )
        for c in caches:
            if c > model.num_experts:
                raise ValidationError(
                    f"--cache {c} exceeds the model's {model.num_experts} experts per layer"
                )
        policies = list(self.args.policies)
        overlaps = list(getattr(self.args, "overlap", ["off"]))
        prefetches = list(getattr(self.args, "prefetch", ["none"]))
        modes = [(o, f) for o in overlaps for f in prefetches]
        total = len(self.args.bandwidth) * len(caches) * len(policies) * len(modes)
        bar = tqdm(total=total, desc="cells", unit="cell", disable=not progress, file=sys.stderr)
        rows = []
        for bw in self.args.bandwidth:
            cost = cost_path = None
            if self.args.cost is not None:
                cost, cost_path = self.cost_for(bw, [], model)
            free = [
                Cell(bw, c, p, overlap=o, prefetch=f)
                for p in policies
                if p in COST_FREE_POLICIES
                for c in caches
                for o, f in modes
            ]
            if getattr(self.args, "calibration", "grid") == "separate":
                live_paths, costs = self.run_separate(bw, caches, free, model, cost, cost_path)
            else:
                live_paths = self.run_repeats(free, cost_path)
                if cost is None:
                    # only planned policies asked: record the cost-free ones at one cache size to calibrate from
                    # (fitted on overlap-off runs without prefetch: the cost model's terms are serial phases)
                    fit_paths = {
                        c: p for c, p in live_paths.items() if c.overlap == "off" and c.prefetch == "none"
                    } or self.run_repeats([Cell(bw, caches[0], p) for p in COST_FREE_POLICIES], None)
                    fit_runs = [path for paths in fit_paths.values() for path in paths]
                    cost, cost_path = self._fit_serial(bw, fit_runs, caches[0], model)
                serial = {"off": (cost, cost_path)}
                if any(o != "off" for o in overlaps):  # priced as the engine overlaps (per layer)
                    overlap_runs = [
                        p
                        for c, paths in live_paths.items()
                        if c.overlap != "off" and c.prefetch == "none"
                        for p in paths
                    ] or [p for c, paths in live_paths.items() if c.overlap != "off" for p in paths]
                    serial["on"] = self._fit_overlap(bw, cost, overlap_runs)
                shares = self._next_layer_shares(bw, live_paths, caches)  # one per cache size
                costs = {
                    (o, c): priced
                    for o, pair in serial.items()
                    for c, priced in self._priced_per_cache(*pair, shares, caches).items()
                }
                planned = self._planned_cells(bw, caches)
                live_paths.update(self.run_repeats(planned, {key: path for key, (_, path) in costs.items()}))
            for cell, paths in live_paths.items():
                rows.append(self.compare(dense, cell, paths, cell_cost(costs, cell)[0]))
                bar.update(1)
        bar.close()
        table = pd.DataFrame(rows)
        summary = fidelity.overall(
            rows,
            [d["cycle_error_pct"].to_numpy() for d in self.per_cycle],
            [d["cycle_noise_pct"].to_numpy() for d in self.per_cycle],
        )
        summary.update(speed_summary(table))
        summary.update(probe_summary(table, pd.DataFrame(self.speed_runs)))
        summary.update(cycle_noise_summary(self.per_cycle, self.args.repeats))
        summary["repeats"] = self.args.repeats
        summary["calibration"] = getattr(self.args, "calibration", "grid")
        summary["level_trees"] = level_note or "recorded"
        return table, summary


def cycle_noise_summary(per_cycle: Sequence[pd.DataFrame], repeats: int) -> dict[str, Any]:
    """The grid's per-cycle noise figures: ``cycle_error_floor_median_pct`` / ``_p90_pct`` (what a
    model without bias would show, :func:`analysis.fidelity.noise_floor_pct`) and
    :func:`analysis.fidelity.error_decomposition`'s fields.

    Args:
        per_cycle: per cell, its :func:`analysis.fidelity.cycle_error_table` (``cycle_error_pct``,
            ``cycle_noise_pct``, ``cycle_run_noise_pct``, ``cycle_deviation_pct_<r>``; a cell without matched cycles has none:
            it adds nothing, and a table lacking a column counts as NaN there).
        repeats: live runs per cell (R).

    Returns:
        The fields above (NaN / None where nothing was measured); never raises for empty cells,
        so validate always writes its outputs.
    """

    def column(name: str) -> list[np.ndarray]:
        return [
            d[name].to_numpy(dtype=np.float64) if name in d.columns else np.full(len(d), np.nan) for d in per_cycle
        ]

    deviations = [fidelity.table_deviations_pct(d) for d in per_cycle]
    pooled = np.concatenate(deviations or [np.zeros(0)])
    out: dict[str, Any] = {}
    for name, q in (("median", 0.5), ("p90", 0.9)):  # what a model without bias would show
        out[f"cycle_error_floor_{name}_pct"] = fidelity.noise_floor_pct(pooled, repeats, q)
    out.update(
        fidelity.error_decomposition(
            column("cycle_error_pct"),
            column("cycle_noise_pct"),
            column("cycle_run_noise_pct"),
            repeats,
            per_cycle_deviation=deviations,
        )
    )
    return out


PREFETCH_COUNTS = ("num_prefetch_issued", "num_prefetch_used", "num_prefetch_wasted")


def prefetch_counts(live_cycles: Sequence[pd.DataFrame], sim_cycles: pd.DataFrame) -> dict[str, Any]:
    """Prefetch issued/used/wasted of one cell, live (each repeat) vs simulated.

    These counts do not depend on timing (the same cache decisions, the same predictor output, the
    same next-layer guesses), so they must be identical cycle by cycle (issue 13).

    Args:
        live_cycles: the cell's live ``cycles`` tables, one per repeat.
        sim_cycles: the replay's cycle records (``CycleRecord`` fields; None counts, as a replay
            without prefetch writes them, are 0).

    Returns:
        ``live_prefetch_{issued,used,wasted}`` (totals of repeat 1), ``sim_prefetch_*`` (totals)
        and ``prefetch_counts_identical``: every repeat's per-cycle counts, in (request, cycle)
        order, equal the simulator's.
    """

    def per_cycle(cycles: pd.DataFrame) -> np.ndarray:  # int64[C, 3]
        if not len(cycles):
            return np.zeros((0, len(PREFETCH_COUNTS)), dtype=np.int64)
        ordered = cycles.sort_values(["request_id", "cycle_index"])
        return np.stack(
            [
                pd.to_numeric(ordered[c], errors="coerce").fillna(0).to_numpy(np.int64)
                for c in PREFETCH_COUNTS
            ],
            axis=1,
        )

    sim = per_cycle(sim_cycles)
    live = [per_cycle(c) for c in live_cycles]
    row: dict[str, Any] = {}
    for i, name in enumerate(("issued", "used", "wasted")):
        row[f"live_prefetch_{name}"] = int(live[0][:, i].sum()) if live else 0
        row[f"sim_prefetch_{name}"] = int(sim[:, i].sum())
    row["prefetch_counts_identical"] = bool(live) and all(
        r.shape == sim.shape and np.array_equal(r, sim) for r in live
    )
    return row


def write_outputs(
    out: Path, table: pd.DataFrame, summary: dict[str, Any], per_cycle: list[pd.DataFrame]
) -> list[Path]:
    """``fidelity.csv``, ``fidelity.json``, ``cycle_errors.csv`` and the figures; returns the figure paths.

    Args:
        out: the output folder.
        table: one row per cell (the fidelity table).
        summary: the grid summary (:func:`analysis.fidelity.overall` and the run's figures).
        per_cycle: per cell, its per-cycle errors and noise (concatenated into ``cycle_errors.csv``).

    Raises:
        OSError: a file cannot be written.
    """
    from analysis import figures

    table.to_csv(out / "fidelity.csv", index=False)
    (out / "fidelity.json").write_text(json.dumps(_clean(summary), indent=2, sort_keys=True) + "\n")
    errors = pd.concat(per_cycle, ignore_index=True) if per_cycle else pd.DataFrame()
    errors.to_csv(out / "cycle_errors.csv", index=False)
    if len(table) and len(errors):
        fidelity.by_policy(table, errors).to_csv(out / "error_split.csv", index=False)
    fig_dir = out / "figures"
    paths = [
        figures.sim_vs_live_throughput(table, fig_dir / "sim_vs_live_throughput.png"),
        figures.cycle_error_distribution(errors, fig_dir / "cycle_error_distribution.png"),
    ]
    tp = pd.concat(
        [
            table[["bandwidth_gb_per_s", "cache_experts_per_layer", "policy", f"{s}_tokens_per_s"]]
            .rename(columns={f"{s}_tokens_per_s": "tokens_per_s"})
            .assign(source=s, label="validate")
            for s in ("live", "sim")
        ],
        ignore_index=True,
    )
    paths.append(figures.throughput_vs_bandwidth(tp, fig_dir / "throughput_vs_bandwidth.png"))
    return [p for p in paths if p is not None]


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (float, np.floating)):
        return float(obj) if np.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def targets_line(targets: fidelity.Targets | None = None, summary: dict[str, Any] | None = None) -> str:
    """The fidelity aims (:class:`analysis.fidelity.Targets`): per cell (its ``ok`` column) and
    over the grid, with whether the grid aims were met when ``summary``
    (:func:`analysis.fidelity.overall`) is given."""
    t = targets or fidelity.Targets()

    def met(key: str) -> str:
        if summary is None or key not in summary:
            return ""
        return " (met)" if summary[key] else " (NOT met)"

    return (
        f"targets (ok = every per-cell aim met): per cell, throughput error within the cell's live repeat "
        f"spread and per-cycle error median within its per-cycle noise median ({t.throughput_pct:g} % / "
        f"{t.cycle_median_pct:g} % when not measured), hit rate within {t.hit_rate_points:g} points, same "
        f"subtree >= {t.same_subtree_fraction:.0%}; over the grid, per-cycle error median <= "
        f"{t.cycle_median_pct:g} %{met('aim_cycle_median')} and p90 <= {t.cycle_p90_pct:g} %"
        f"{met('aim_cycle_p90')}"
    )


def speed_summary(table: pd.DataFrame) -> dict[str, Any]:
    """The cells' live compute speed against their cost's fit runs (``live_compute_speed_pct``,
    :meth:`Validator.compute_speed_pct`) over the grid: ``num_cells_speed_measured``, the range
    (``live_compute_speed_min_pct`` / ``_max_pct``), the median of its magnitude
    (``live_compute_speed_abs_median_pct``) and its Pearson correlation with the cells' throughput
    error (``speed_throughput_error_correlation``; NaN below 3 measured cells): near 1 when the
    cells' errors follow the machine's speed in each cell's runs rather than the model."""
    column = table["live_compute_speed_pct"] if "live_compute_speed_pct" in table.columns else pd.Series(dtype=float)
    speed = pd.to_numeric(column, errors="coerce")
    corr = _pearson(speed, table.get("throughput_error_pct", pd.Series(np.nan, index=table.index)))
    measured = speed.dropna()
    return {
        "num_cells_speed_measured": len(measured),
        "live_compute_speed_min_pct": float(measured.min()) if len(measured) else np.nan,
        "live_compute_speed_max_pct": float(measured.max()) if len(measured) else np.nan,
        "live_compute_speed_abs_median_pct": float(measured.abs().median()) if len(measured) else np.nan,
        "speed_throughput_error_correlation": corr,
    }


def speed_line(summary: dict[str, Any]) -> str:
    """The cells' live compute speed against the cost's fit runs in one line (:func:`speed_summary`),
    printed under the noise floor."""
    n = summary.get("num_cells_speed_measured", 0)
    if not n:
        return "live compute speed vs the cost's fit runs: not measured (a given --cost, or runs without layer_pre_router_s)"
    corr = summary.get("speed_throughput_error_correlation", np.nan)
    corr_text = f"{corr:.2f}" if np.isfinite(corr) else "n/a"
    return (
        f"live compute speed vs the cost's fit runs (attention + router time; the simulator prices every cell "
        f"at the fit runs' speed): {summary['live_compute_speed_min_pct']:+.0f} .. "
        f"{summary['live_compute_speed_max_pct']:+.0f} % over {n} cells (median |.| "
        f"{summary['live_compute_speed_abs_median_pct']:.0f} %); correlation with the throughput error {corr_text}"
    )


# |Pearson r| from which the probe counts as tracking the runs' compute speed (probe_line)
PROBE_TRACKS_R = 0.7


CHAIN_PROBE_KEY = "speed_probe_chain_s"  # the matrix-chain gauge live.record times beside the model's own


def speed_probe_s(run_dir: Path, key: str = "speed_probe_s") -> np.ndarray:
    """float64[P]: a speed probe's seconds of one live run (``summary.json``'s ``key``, written by
    ``live.record``: :mod:`live.speed_probe`; ``speed_probe_s`` the gauge validate normalises with,
    :data:`CHAIN_PROBE_KEY` the matrix chain timed beside it); empty when the run has none
    (recorded before that probe existed) or its summary is unreadable."""
    try:
        values = json.loads((Path(run_dir) / "summary.json").read_text())["summary"].get(key) or []
        return np.asarray(values, dtype=np.float64).ravel()
    except (OSError, ValueError, KeyError, TypeError):
        return np.zeros(0)


def speed_probe_gauge(run_dir: Path) -> str:
    """Which gauge a live run's ``speed_probe_s`` timed: ``"model"`` (the target's own attention +
    router, :data:`live.speed_probe.MODEL_WORKLOAD`) or ``"chain"`` (the matrix chain: runs recorded
    before the model gauge, targets without its layout, or a model probe that failed), read from
    ``summary.json``'s ``speed_probe_workload``; ``"chain"`` when that line is missing or unreadable.
    Two runs' probe seconds are comparable only under the same gauge."""
    from live.speed_probe import MODEL_WORKLOAD

    try:
        workload = json.loads((Path(run_dir) / "summary.json").read_text())["summary"].get("speed_probe_workload")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "chain"
    return "model" if isinstance(workload, str) and workload.startswith(MODEL_WORKLOAD) else "chain"


def _pearson(x: pd.Series, y: pd.Series) -> float:
    """Pearson r (``scipy.stats.pearsonr``) of the pairs where both are finite; NaN below 3 pairs
    or without spread."""
    from scipy.stats import pearsonr

    x, y = pd.to_numeric(x, errors="coerce"), pd.to_numeric(y, errors="coerce")
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3 or x[keep].std() == 0 or y[keep].std() == 0:
        return np.nan
    return float(pearsonr(x[keep].to_numpy(np.float64), y[keep].to_numpy(np.float64)).statistic)


def probe_summary(table: pd.DataFrame, runs: pd.DataFrame) -> dict[str, Any]:
    """The speed probe over the grid (:meth:`Validator.normalised`): ``num_cells_probe_measured``,
    the cells' ``probe_speed_index`` range (``probe_speed_index_min`` / ``_max``), the Pearson
    correlation of the probe index with the runs' attention + router speed per run
    (``probe_compute_speed_correlation_runs``, over ``num_runs_probe_compared`` runs) and per cell
    (``probe_compute_speed_correlation_cells``, against ``1 + live_compute_speed_pct / 100``), its
    correlation with the cells' raw throughput error (``probe_throughput_error_correlation``), the
    matrix-chain gauge's per-run correlation in the same runs (``chain_probe_compute_speed_correlation_runs``),
    and the cells within their noise raw and speed-normalised (``num_cells_within_noise`` as
    measured, ``num_cells_within_noise_normalised``; ``probe_tracks_compute``: the per-run
    correlation is at least :data:`PROBE_TRACKS_R`, without which the normalised figures mean
    nothing)."""
    col = table.get("probe_speed_index", pd.Series(np.nan, index=table.index, dtype=float))
    index = pd.to_numeric(col, errors="coerce")
    measured = index.dropna()
    compute = 1.0 + pd.to_numeric(table.get("live_compute_speed_pct", pd.Series(np.nan, index=table.index)), errors="coerce") / 100.0
    r_runs = _pearson(runs["probe_speed_index"], runs["compute_speed"]) if len(runs) else np.nan
    chain = runs.get("chain_probe_speed_index") if len(runs) else None
    r_chain = _pearson(chain, runs["compute_speed"]) if chain is not None else np.nan
    compared = int((np.isfinite(pd.to_numeric(runs.get("probe_speed_index", pd.Series(dtype=float)), errors="coerce"))
                    & np.isfinite(pd.to_numeric(runs.get("compute_speed", pd.Series(dtype=float)), errors="coerce"))).sum())
    norm = table.get("norm_within_noise", pd.Series(None, index=table.index, dtype=object))
    return {
        "num_cells_probe_measured": len(measured),
        "probe_speed_index_min": float(measured.min()) if len(measured) else np.nan,
        "probe_speed_index_max": float(measured.max()) if len(measured) else np.nan,
        "num_runs_probe_compared": compared,
        "probe_compute_speed_correlation_runs": r_runs,
        "chain_probe_compute_speed_correlation_runs": r_chain,
        "probe_compute_speed_correlation_cells": _pearson(index, compute),
        "probe_throughput_error_correlation": _pearson(index, table.get("throughput_error_pct", pd.Series(np.nan, index=table.index))),
        "num_cells_within_noise_normalised": int((norm == True).sum()),  # noqa: E712 - None = not measured
        "probe_tracks_compute": bool(np.isfinite(r_runs) and r_runs >= PROBE_TRACKS_R),
    }


def probe_line(summary: dict[str, Any], num_cells: int) -> str:
    """The speed probe's verdict in one line (:func:`probe_summary`), printed under the speed line:
    the index range, its correlation with the runs' compute speed, and the cells within noise raw
    and speed-normalised (raw stays the headline unless the probe tracks the compute)."""
    n = summary.get("num_cells_probe_measured", 0)
    if not n:
        return "speed probe: not measured (a given --cost, or runs recorded before live.speed_probe); raw figures only"

    def r(key: str) -> str:
        value = summary.get(key, np.nan)
        return f"{value:.2f}" if isinstance(value, (int, float)) and np.isfinite(value) else "n/a"

    verdict = (
        "it tracks the compute, so the normalised figures separate the machine's drift from model error"
        if summary.get("probe_tracks_compute")
        else f"it does NOT track the compute (r < {PROBE_TRACKS_R:g}), so the normalised figures mean little: raw is the headline"
    )
    return (
        f"speed probe (index = the cell's runs' probe median / the cost's fit runs'): "
        f"{summary['probe_speed_index_min']:.2f} .. {summary['probe_speed_index_max']:.2f} over {n} cells; "
        f"correlation with the runs' attention + router speed {r('probe_compute_speed_correlation_runs')} over "
        f"{summary.get('num_runs_probe_compared', 0)} runs ({r('probe_compute_speed_correlation_cells')} over cells; "
        f"the matrix-chain gauge in the same runs {r('chain_probe_compute_speed_correlation_runs')}), "
        f"with the raw throughput error {r('probe_throughput_error_correlation')}; within noise: raw "
        f"{summary.get('num_cells_within_noise', 0)} of {num_cells}, speed-normalised (simulator timed at each "
        f"cell's index, planner unchanged) {summary.get('num_cells_within_noise_normalised', 0)} of {num_cells}; "
        + verdict
    )


def missed_lines(table: pd.DataFrame) -> list[str]:
    """One line per cell that misses an aim, naming the cell, each missed figure and the measured
    repeat noise it was held to (:func:`analysis.fidelity.missed_aims`), then the cell's live
    compute speed against the cost's fit runs when measured (:meth:`Validator.compute_speed_pct`)."""
    lines = []
    for _, row in table.iterrows():
        missed = fidelity.missed_aims(row)
        if not row.get("prefetch_counts_identical", True):
            missed.append("prefetch issued/used/wasted differ from the simulator's")
        if missed:
            name = Cell(
                row["bandwidth_gb_per_s"], int(row["cache_experts_per_layer"]), row["policy"],
                overlap=row.get("overlap", "off"), prefetch=row.get("prefetch", "none"),
            ).name  # fmt: skip
            speed = row.get("live_compute_speed_pct", np.nan)
            if isinstance(speed, (int, float)) and np.isfinite(speed):
                missed.append(f"its live compute ran {speed:+.0f} % vs the cost's fit runs")
            index = row.get("probe_speed_index", np.nan)
            if isinstance(index, (int, float)) and np.isfinite(index):
                missed.append(
                    f"speed probe x{index:.2f}: normalised throughput error {row['norm_throughput_error_pct']:+.1f} %, "
                    f"per-cycle median {row['norm_cycle_error_median_pct']:.1f} %, "
                    f"{'within' if row.get('norm_within_noise') else 'not within'} noise"
                )
            lines.append(f"  {name}: " + "; ".join(missed))
    return (
        ["missed aims (figure > the noise it is held to):", *lines]
        if lines
        else ["every cell meets its aims"]
    )


def _pct_text(value: Any) -> str:
    """A percentage for the printed lines: 3 significant digits ("7.12 %", "123 %"), "n/a" when
    missing or not finite."""
    if not isinstance(value, (int, float)) or not np.isfinite(value):
        return "n/a"
    return f"{value:.3g} %" if abs(value) < 1000 else f"{value:.0f} %"


def noise_line(summary: dict[str, Any], repeats: int) -> str:
    """The grid's measured noise floor (from :func:`analysis.fidelity.overall`'s summary), printed
    under the targets line; ``repeats``: live runs per cell (below 2 no noise is measured)."""
    if repeats < 2:
        return "noise floor: not measured (--repeats 1); within_noise = ok"

    def pct(key: str) -> str:
        return _pct_text(summary.get(key))

    return (
        f"noise floor ({repeats} repeats per cell): live throughput spread median "
        f"{pct('median_live_repeat_spread_pct')} over cells (max {pct('max_live_repeat_spread_pct')}); "
        f"per-cycle cycle-time noise (CV across repeats, pooled) median {pct('noise_cycle_median_pct')}, "
        f"p90 {pct('noise_cycle_p90_pct')}; within_noise = every missed timing target within it; a model "
        f"without bias would show per-cycle error median {pct('cycle_error_floor_median_pct')}, p90 "
        f"{pct('cycle_error_floor_p90_pct')} against these {repeats}-repeat means (the noise of the mean alone)"
    )


def bias_line(summary: dict[str, Any], repeats: int) -> str:
    """Where the grid's per-cycle error lives (:func:`analysis.fidelity.error_decomposition`'s
    figures in ``summary``), printed under the noise-floor line; empty with one repeat."""
    if repeats < 2:
        return ""

    def pct(key: str) -> str:
        return _pct_text(summary.get(key))

    share = summary.get("noise_run_speed_fraction")
    finite = isinstance(share, (int, float)) and np.isfinite(share)  # < 0 when normalising raised the noise: none
    share_text = f"{100 * max(share, 0.0):.0f} %" if finite else "n/a"
    need = [summary.get(f"repeats_for_aim_{k}") for k in ("median", "p90")]
    need_text = " / ".join(str(n) if n is not None else "n/a" for n in need)
    return (
        f"where the per-cycle error lives: beyond the noise of the {repeats}-repeat means "
        f"{pct('cycle_error_bias_rms_pct')} rms; the cells' offsets (signed median, common to a "
        f"cell's cycles) {pct('cycle_error_cell_offset_rms_pct')} rms; within cells (offset removed) "
        f"median {pct('cycle_error_within_cell_median_pct')}, p90 {pct('cycle_error_within_cell_p90_pct')}; "
        f"{share_text} of the per-cycle noise variance is whole-run speed (noise left after dividing each "
        f"run by its speed factor: median {pct('noise_cycle_run_normalised_median_pct')}); a model without "
        f"bias meets the per-cycle median / p90 aims from {need_text} independent repeats per cell"
    )


def _experts_per_layer(model: str) -> int | None:
    """Routed experts per layer from ``--model``'s ``config.json`` (:func:`live.loader.experts_per_layer`)."""
    from live.loader import experts_per_layer

    return experts_per_layer(model)


def _moe_layers(model: str) -> int | None:
    """MoE decoder layers from ``--model``'s ``config.json`` (:func:`live.loader.moe_layer_count`)."""
    from live.loader import moe_layer_count

    return moe_layer_count(model)


def check_cost(args: Any, parser: ArgumentParser) -> CycleCostModel | None:
    """Load and check ``--cost`` before any work: a readable, valid ``CycleCostModel`` JSON whose
    ``num_layers`` matches the model's MoE layers. Exits 2 naming ``--cost`` and the field.

    Args:
        args: the parsed flags; parser: the ``specfit.cli.ArgumentParser`` that exits 2.

    Returns:
        The loaded cost model, or None without ``--cost``.
    """
    if args.cost is None:
        return None
    if not Path(args.cost).is_file():
        parser.fail("--cost", f"no such file: {args.cost} (expected a CycleCostModel JSON)")
    try:
        cost = CycleCostModel.load(args.cost)
    except ValueError as exc:
        parser.fail("--cost", str(exc))
    layers = _moe_layers(args.model)
    if layers is not None and cost.num_layers != layers:
        parser.fail(
            "--cost",
            f"{args.cost}: field 'num_layers' is {cost.num_layers} but the model {args.model!r} has "
            f"{layers} MoE layers (calibrate the cost on this model)",
        )
    for note in cost_file_warnings(  # as sim.sweep and live.record say it
        args.cost,
        cost,
        overlap="on" in args.overlap,
        next_layer=any(uses_next_layer(mode) for mode in getattr(args, "prefetch", ["none"])),
        consequence="the planner and the simulator price cycles with that error",
    ):
        print(f"warning: --cost {note}", file=sys.stderr)
    return cost


def check_model_and_prompts(args: Any, parser: ArgumentParser) -> None:
    """Flag checks that need the checkpoint or prompt file, made before any output is written:
    a checkpoint without ``config.json`` or with a truncated safetensors file, an unsupported
    architecture, a draft with a larger vocabulary (:func:`live.loader.check_checkpoints`), ``--cache`` above the experts per layer, a
    prompt file that yields no prompts. Exits 2 naming the flag (``parser.fail``; ``args``: the
    parsed flags)."""
    if args.model != "default" and not (Path(args.model) / "config.json").is_file():
        parser.fail("--model", f"{args.model!r} is not a Hugging Face checkpoint directory (no config.json)")
    from live.loader import check_checkpoints

    check_checkpoints(args.model, args.draft)  # config, safetensors headers, vocabularies: exit 2
    experts = _experts_per_layer(args.model)
    if experts is not None and args.cache_experts:
        big = [c for c in args.cache_experts if c > experts]
        if big:
            parser.fail("--cache", f"expected at most {experts} (the experts per layer), got {big}")
    from live.record import check_categories

    check_categories(args.prompts, args.category, parser)
    from live.prompts import load_prompts

    try:
        prompts = load_prompts(args.prompts)
    except (ValueError, FileNotFoundError) as exc:
        parser.fail("--prompts", str(exc))
    if not prompts:
        parser.fail("--prompts", f"{args.prompts!r} holds no prompts")


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    bad_overlap = [o for o in args.overlap if o not in ("off", "on")]
    if bad_overlap:
        parser.fail("--overlap", f"expected off and/or on, got {bad_overlap}")
    bad_prefetch = [f for f in args.prefetch if f not in PREFETCH_MODES]
    if bad_prefetch:
        parser.fail("--prefetch", f"expected modes from {list(PREFETCH_MODES)}, got {bad_prefetch}")
    args.prefetch = list(dict.fromkeys(args.prefetch))
    bad = [p for p in args.policies if p not in GRID_POLICIES]
    if bad:
        parser.fail("--policy", f"expected names from {list(GRID_POLICIES)}, got {bad}")
    if not args.device.startswith("cpu") and len(args.bandwidth) > 1:
        parser.fail(
            "--bandwidth", "on a GPU the real link is measured: give one value (it only labels the cells)"
        )
    if args.model != "default" and not Path(args.model).is_dir():
        parser.fail("--model", f"{args.model!r} is not a checkpoint directory (or 'default')")
    check_model_and_prompts(args, parser)
    check_cost(args, parser)
    out = parser.ensure_out_dir(
        "--out",
        args.out or Path("runs") / "validate" / _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ"),
    )
    import torch

    started, load_start = time.perf_counter(), os.getloadavg()[0]
    threads = torch.get_num_threads()
    if args.torch_threads:  # 0: torch's default, as live.record --threads 0
        torch.set_num_threads(args.torch_threads)
    validator = Validator(args, out)
    try:
        table, summary = validator.run(progress=not args.no_progress)
    except (ValidationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        print_summary(
            {
                "ran": False,
                "repeats": args.repeats,
                "all_targets_met": False,
                "all_within_noise": False,
                "error": str(exc),
                "exit_code": 1,
                "ok": False,
                "out": str(out),
            }
        )
        return 1
    finally:
        torch.set_num_threads(threads)
    summary.update(
        wall_s=time.perf_counter() - started,
        load_avg_1min=[load_start, os.getloadavg()[0]],
        cpu_count=os.cpu_count(),
    )
    figs = write_outputs(out, table, summary, validator.per_cycle)
    pd.DataFrame(validator.speed_runs).to_csv(out / "speed_runs.csv", index=False)
    printed, legend = fidelity.short_table(table, PRINTED_COLUMNS)
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(printed.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        print(legend)
        print("\n".join(missed_lines(table)))
        errors = pd.concat(validator.per_cycle, ignore_index=True) if validator.per_cycle else pd.DataFrame()
        if len(table) and len(errors):
            split, split_legend = fidelity.short_table(fidelity.by_policy(table, errors), SPLIT_PRINTED)
            print(
                "where the error lives, per policy and bandwidth (d_<term>% = simulated minus live time of "
                "that term, % of the live time, cycles with the same subtree; error_split.csv):"
            )
            print(
                split.to_string(
                    index=False, float_format=lambda v: f"{v:+.2f}" if abs(v) < 100 else f"{v:.0f}"
                )
            )
            print(split_legend)
    print(
        f"ran in {summary['wall_s']:.0f} s wall; load average (1 min) {load_start:.1f} at start, "
        f"{summary['load_avg_1min'][1]:.1f} at the end, on {os.cpu_count()} CPUs"
    )
    print(targets_line(summary=summary))
    print(noise_line(summary, args.repeats))
    bias = bias_line(summary, args.repeats)  # empty with one repeat
    if bias:
        print(bias)
    print(speed_line(summary))
    print(probe_line(summary, len(table)))
    summary.update(
        ran=True,
        repeats=args.repeats,
        all_targets_met=bool(summary.get("all_aims_met", False)),
        all_within_noise=bool(len(table)) and bool(table["within_noise"].all()),
        out=str(out),
        fidelity_csv=str(out / "fidelity.csv"),
        figures=[str(p) for p in figs],
    )
    print_summary(_clean(summary))
    return 0


if __name__ == "__main__":
    run_main(main)
