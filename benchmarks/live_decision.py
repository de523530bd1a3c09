"""Live SpecFit decision time per cycle on the embedded default (issue 14 aim: <= 0.3 ms).

The live summary's ``decision_s_per_cycle`` is wall time: on a machine shared with other jobs it
also counts the time the planner's thread waits for a core. This benchmark measures the decide
path itself, twice:

1. ``live``: ``live.record --mode policy --policy specfit`` on the embedded default (its default
   predictor, calibration and cost estimate) for ``--num-prompts`` prompts; while it decodes,
   every cycle's planner inputs are kept in memory (the chooser's state, the tree handed to the
   stopping rule after each draft level, and what the engine reported back to the policy).
   ``live_decision_s_per_cycle`` is what the summary reports (wall).
2. ``replay``: the same cycles replayed ``--repeats`` times through a fresh copy of the chooser
   whose drafter hands back the recorded trees (no model runs), each cycle's ``choose`` timed on
   the thread's CPU clock (``time.thread_time``) and on the wall clock; the best repeat is
   reported (``replay_decision_cpu_s_per_cycle``, ``replay_decision_s_per_cycle``: the planner's
   own ``decision_s``). The replay must choose the same subtree in every cycle
   (``same_decisions``), so it times the decisions the live run made.
3. ``cold replay``: the same replay with a fixed busy-wait of ``--cold-gap-ms`` (default 3 ms,
   about one draft forward of the embedded default on the build machine) before each cycle and
   before each level's question, where the live cycle runs the draft (or target) model's forward.
   On some machines (the 2-core build machine, a nested VM) code and data untouched for ~1 ms
   run several times slower on their next use, per distinct page touched, so a question asked
   after a forward costs more than one replayed back to back; the cold replay reproduces that
   without models. ``cold_replay_decision_s_per_cycle`` is the planner's ``decision_s`` per cycle
   (wall, the spins not included: what the live summary counts) and
   ``cold_replay_decision_cpu_s_per_cycle`` the thread's CPU time in ``choose`` less the spins
   (steadier on a shared machine), each the median of the repeats. ``--cold-gap-ms 0`` skips it.
4. ``cold call``: where a cold question's time goes (compiled questions only: ``union-size``
   with the expected rule), each call after the same busy-wait, ``--cold-calls`` times, the two
   interleaved, medians: ``cold_empty_call_s``, a compiled call that does nothing but takes the
   question's nine arguments and returns its result tuple (numba's entry point, as the live
   questions call it: arguments unboxed, result boxed), and ``cold_ask_s``, one whole question
   (``UnionSizeQuestions.ask``: Python checks, the compiled question, the answer) on the largest
   tree of the last drafted cycle. Their ratio says how much of a question is the call boundary.

Comparing runs or releases: the live run's cost model is by default the session's quick
estimate (``live.record`` without ``--cost``), timed when the session opens, so each run prices
cycles differently, makes other decisions and asks another number of questions per cycle
(3.4-5.0 on the build machine); the per-cycle figure then moves with the count.
``--cost fixed`` plans with one cost model written in this file (:data:`FIXED_COST`, a quick
estimate of the embedded default rounded) and ``--cost PATH`` with a ``CycleCostModel`` JSON:
the decisions then no longer depend on timing, so two runs, or two releases whose decisions are
equal, ask the same questions (the same ``decisions_sha256``). Beside each per-cycle figure the
table prints microseconds per question (the per-cycle seconds over ``questions_per_cycle``: the
stopping-rule questions, the one before drafting included). The aim's figure,
``live_decision_s_per_cycle``, is the live summary's under whichever cost model the run used:
the aim is stated on the default (the quick estimate).

Usage::

    python benchmarks/live_decision.py                  # 4 prompts, 5 repeats
    python benchmarks/live_decision.py --cost fixed     # the same questions in every run
    python benchmarks/live_decision.py --cold-gap-ms 5  # a longer gap before each question
    python benchmarks/live_decision.py --num-prompts 8 --predictor recent
    python benchmarks/live_decision.py --overlap on --prefetch both   # the engine's overlapped copies

Prints a table and a final JSON line.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _root  # benchmarks/ is first on sys.path when a script runs by its path
import numpy as np

_root.put_root_first()

from specfit.cli import ArgumentParser, cli_main, non_negative_float, positive_int, print_summary  # noqa: E402

if TYPE_CHECKING:
    from specfit.cost import CycleCostModel

AIM_S_PER_CYCLE = 0.3e-3
COLD_GAP_MS = 3.0  # busy-wait before each question of the cold replay (ms): ~one draft forward here
COLD_CALLS = 60  # cold call: timed calls of each kind
# --cost fixed: the quick estimate of the embedded default on the build machine, rounded; the
# model's num_layers and expert_bytes are read off the embedded default (fixed_cost_model)
FIXED_COST = {
    "draft_s_per_level": 3.0e-3,
    "draft_base_s": 6.0e-3,
    "verify_base_s": 28.0e-3,
    "verify_s_per_node": 0.45e-3,
    "verify_s_per_context_token": 0.0,
    "h2d_bytes_per_s": 16e9,
    "h2d_s_per_transfer": 0.0,
}


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python benchmarks/live_decision.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=positive_int, default=4, help="prompts decoded live (count)")
    p.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens per prompt (count)")
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="replays of the recorded cycles (best kept)"
    )
    p.add_argument(
        "--cold-gap-ms",
        type=non_negative_float,
        default=COLD_GAP_MS,
        help=f"cold replay: busy-wait before each cycle and question (ms; 0: no cold replay; default {COLD_GAP_MS:g})",
    )
    p.add_argument(
        "--cold-calls",
        type=positive_int,
        default=COLD_CALLS,
        help=f"cold call: timed calls of each kind (default {COLD_CALLS})",
    )
    p.add_argument(
        "--cost",
        default="estimate",
        help="the planner's cost model: estimate (live.record's quick estimate, timed per run: the "
        "default), fixed (FIXED_COST in this file: the same decisions in every run) or a CycleCostModel JSON",
    )
    p.add_argument(
        "--predictor",
        default="auto",
        help="live.record --predictor (auto: union-size on the embedded default)",
    )
    p.add_argument("--stopping", default=None, help="live.record --stopping (default: the policy's)")
    p.add_argument(
        "--overlap", choices=("on", "off"), default=None, help="live.record --overlap (default: its own, off)"
    )
    p.add_argument(
        "--prefetch",
        choices=("none", "draft", "next-layer", "both"),
        default=None,
        help="live.record --prefetch (default: its own, none)",
    )
    return p


class _RecordingDrafter:
    """Wraps the live drafter: keeps the tree offered to the stopping rule after each level."""

    def __init__(self, inner: Any, sink: list) -> None:
        self.inner, self.sink, self.kind = inner, sink, inner.kind

    def grow(self, committed, shape, keep_drafting=None):
        offered = self.sink[-1]["trees"]

        def ask(tree, levels):
            offered.append((tree, levels))
            return keep_drafting(tree, levels)

        result = self.inner.grow(committed, shape, ask if keep_drafting is not None else None)
        self.sink[-1]["final"] = result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _RecordingPolicy:
    """Wraps the chooser's policy: keeps what the engine reports after each cycle."""

    def __init__(self, inner: Any, sink: list) -> None:
        self.inner, self.sink = inner, sink

    def observe_cycle(self, *args: Any) -> None:
        self.sink[-1]["observed"].append(args)
        self.inner.observe_cycle(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _RecordingChooser:
    """What the engine sees instead of the ``PlannedChooser``: records each cycle's inputs."""

    def __init__(self, inner: Any, sink: list) -> None:
        self.inner, self.sink = inner, sink
        self.policy = _RecordingPolicy(inner.policy, sink)
        inner.drafter = _RecordingDrafter(inner.drafter, sink)

    def choose(self, state):
        self.sink.append({"state": state, "trees": [], "observed": []})
        choice = self.inner.choose(state)
        self.sink[-1]["nodes"] = np.asarray(choice.nodes).tolist()
        return choice

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _spin(gap_s: float) -> float:
    """Busy-wait ``gap_s`` seconds (a model's forward between two questions, without the model);
    returns the thread CPU seconds it took."""
    started, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - started < gap_s:
        pass
    return time.thread_time() - cpu


class _ReplayDrafter:
    """Hands back the recorded trees: asks the rule on each until it says stop, as ``grow`` does;
    ``gap_s`` > 0: busy-waits that long before each question (a draft level's forward)."""

    kind = "replay"

    def __init__(self, gap_s: float = 0.0) -> None:
        self.cycle: dict[str, Any] = {}
        self.gap_s, self.spun_cpu_s = gap_s, 0.0

    def grow(self, committed, shape, keep_drafting=None):
        from live.spec.draft import DraftResult

        for tree, levels in self.cycle["trees"]:
            if self.gap_s > 0:
                self.spun_cpu_s += _spin(self.gap_s)
            if keep_drafting is not None and not keep_drafting(tree, levels):
                return DraftResult(tree, levels, 0.0)
        final = self.cycle["final"]
        return DraftResult(final.tree, final.num_levels, 0.0)


def replay(pristine: Any, cycles: list[dict[str, Any]], gap_s: float = 0.0) -> tuple[float, float, int]:
    """One replay: (decide CPU seconds, the planner's decision seconds, cycles with the live subtree);
    ``gap_s`` > 0: a busy-wait of that many seconds before each cycle and each level's question
    (the cold replay; the waits are not counted in the CPU seconds)."""
    chooser = copy.deepcopy(pristine)
    drafter = chooser.drafter = _ReplayDrafter(gap_s)
    cpu_s = decision_s = 0.0
    same = 0
    for cycle in cycles:
        drafter.cycle = cycle
        if gap_s > 0:
            _spin(gap_s)  # the previous cycle's verify forward
        started = time.thread_time()
        choice = chooser.choose(cycle["state"])
        cpu_s += time.thread_time() - started
        decision_s += 0.0 if choice.plan is None else float(choice.plan.decision_s)
        same += np.asarray(choice.nodes).tolist() == cycle["nodes"]
        for args in cycle["observed"]:
            chooser.policy.observe_cycle(*args)
    return cpu_s - drafter.spun_cpu_s, decision_s, same


def _empty_question_entry() -> Any:
    """The compiled entry point of a kernel that does nothing, with the argument types of the
    live question's entry point (:func:`specfit.decide_kernels.question_signature`) and its
    result tuple's types: what one compiled call costs before any work."""
    from numba import njit

    from specfit.decide_kernels import question_entry

    def empty(parents, values, work, table, miss, context_len, num_levels, root_alpha, ask):
        return False, False, 0.0, 0.0, 0.0, -1.0, 0, parents.shape[0]

    return question_entry(njit(empty))  # not cached on disk: compiled once per run (~1 s)


def cold_calls(pristine: Any, cycles: list[dict[str, Any]], gap_s: float, calls: int) -> dict[str, float] | None:
    """``{"cold_empty_call_s", "cold_ask_s"}``: median seconds of an empty compiled call with the
    question's arguments and of one whole question (``UnionSizeQuestions.ask``) on the largest
    tree of the last drafted cycle, each call after a busy-wait of ``gap_s`` seconds, the two
    interleaved, ``calls`` each. None when the chooser has no compiled questions, no cycle
    drafted a level, or the questions or the tree do not have the types the unchecked entry
    point was compiled for (``UnionSizeQuestions.ask`` takes it only for the same: a
    ``DraftTree``/``TokenTree`` (``specfit.tree.is_typed_tree``), int levels, typed questions;
    other arrays would be misread, not converted)."""
    from specfit.tree import is_typed_tree

    drafted = [c for c in cycles if c["trees"]]
    chooser = copy.deepcopy(pristine)
    questions = getattr(chooser, "_questions", None)
    if questions is None or not drafted:
        return None
    cycle = drafted[-1]
    chooser.drafter = _ReplayDrafter()
    chooser.drafter.cycle = cycle
    chooser.choose(cycle["state"])  # the cycle's begin: its union table, miss fractions, context
    tree, levels = max(cycle["trees"], key=lambda offered: len(offered[0].parents))
    if not (questions._typed and is_typed_tree(tree) and type(levels) is int):
        return None
    parents, logprobs = tree.parents, tree.draft_logprobs
    empty = _empty_question_entry()
    arrays = (parents, logprobs, questions.work, questions.table, questions.miss)
    alpha = float(chooser.policy.root_alpha)
    timed: dict[str, list[float]] = {"cold_empty_call_s": [], "cold_ask_s": []}
    for _ in range(calls):
        _spin(gap_s)
        started = time.perf_counter()
        empty(*arrays, questions.context_len, levels, alpha, True)
        timed["cold_empty_call_s"].append(time.perf_counter() - started)
        _spin(gap_s)
        started = time.perf_counter()
        questions.ask(tree, levels)
        timed["cold_ask_s"].append(time.perf_counter() - started)
    return {key: float(np.median(values)) for key, values in timed.items()}


def cost_file(choice: str, folder: Path) -> str | None:
    """The ``live.record --cost`` file for ``--cost choice``: None for ``estimate`` (the quick
    estimate), :data:`FIXED_COST` written under ``folder`` for ``fixed``, else ``choice`` (a path)."""
    if choice == "estimate":
        return None
    if choice != "fixed":
        return choice
    return str(fixed_cost_model().save(folder / "fixed_cost.json"))


def fixed_cost_model() -> CycleCostModel:
    """The ``CycleCostModel`` of ``--cost fixed``: :data:`FIXED_COST`'s terms, with the model's
    ``num_layers`` (its MoE layers, ``live.loader.moe_layer_count``) and ``expert_bytes`` (one
    routed expert, ``live.build_width.expert_bytes``, at ``live.record``'s default ``--dtype``)
    read from the embedded default's ``config.json``, which ``live.record`` runs here and checks a
    ``--cost`` file against (6 layers and 98,304 bytes for the default shipped today).

    Raises:
        ValueError: the embedded default's ``config.json`` is missing or does not state its MoE
            layers, ``hidden_size`` and ``moe_intermediate_size``.
    """
    from types import SimpleNamespace

    import torch

    from live.build_width import expert_bytes
    from live.loader import checkpoint_config, moe_layer_count, resolve_dtype
    from live.record import build_parser
    from specfit.cost import CycleCostModel

    config, num_layers = checkpoint_config("default"), moe_layer_count("default")
    sizes = [config.get(key) for key in ("hidden_size", "moe_intermediate_size")]
    if num_layers is None or not all(isinstance(size, int) and size > 0 for size in sizes):
        raise ValueError(
            "fixed: the embedded default's config.json does not state its MoE layers, hidden_size and "
            "moe_intermediate_size (is live/assets/default installed?)"
        )
    dtype = resolve_dtype(build_parser().get_default("dtype"))
    bytes_per_param = torch.empty((), dtype=dtype).element_size()
    return CycleCostModel(
        **FIXED_COST,
        num_layers=num_layers,
        expert_bytes=expert_bytes(SimpleNamespace(hidden_size=sizes[0], moe_intermediate_size=sizes[1]), bytes_per_param),
        source="benchmarks/live_decision.py FIXED_COST (the embedded default's quick estimate, rounded)",
    )


def decisions_digest(cycles: list[dict[str, Any]]) -> str:
    """SHA-256 (hex) of every cycle's questions and decision: the levels and node count of each
    tree the stopping rule was asked about, and the chosen subtree's node ids, in cycle order. Two
    runs with the same digest asked the same questions and chose the same subtrees."""
    import hashlib
    import json

    rows = [
        [[[int(levels), len(tree.parents)] for tree, levels in c["trees"]], [int(v) for v in c["nodes"]]]
        for c in cycles
    ]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print a table and the JSON summary line. Returns 0."""
    parser = _parser()
    args = parser.parse_args(argv)
    from live.record import build_parser, explicit_flags, resolve_config
    from live.spec.session import RecordSession, SessionError

    if args.cost not in ("estimate", "fixed") and not Path(args.cost).is_file():
        parser.fail("--cost", f"{args.cost!r} is not a file (expected estimate, fixed or a CycleCostModel JSON)")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cost = cost_file(args.cost, Path(tmp))
        except ValueError as exc:
            parser.fail("--cost", str(exc))
        record_argv = [
            "--mode", "policy", "--policy", "specfit", "--predictor", args.predictor,
            "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
            "--out", str(Path(tmp) / "run"), "--no-progress",
            *(["--stopping", args.stopping] if args.stopping else []),
            *(["--overlap", args.overlap] if args.overlap else []),
            *(["--prefetch", args.prefetch] if args.prefetch else []),
            *(["--cost", cost] if cost is not None else []),
        ]  # fmt: skip
        record_parser = build_parser()
        record_parser.prog = parser.prog  # its errors (a bad --cost file) name this benchmark
        config = resolve_config(
            record_parser.parse_args(record_argv), record_parser, explicit_flags(record_argv)
        )
        try:
            session = RecordSession.open(config)
        except SessionError as exc:
            parser.fail(exc.flag, exc.message)
        inner = session.chooser
        live_drafter, inner.drafter = inner.drafter, None
        pristine = copy.deepcopy(inner)  # the chooser as it starts (policy state, tables, cost)
        inner.drafter = live_drafter
        cycles: list[dict[str, Any]] = []
        session.chooser = _RecordingChooser(inner, cycles)
        session.run(progress=False)
        live_decision_s = session.run_totals.decision_s
        cost_source = session.cost.source
    n = len(cycles)
    questions_per_cycle = sum(len(c["trees"]) + 1 for c in cycles) / max(n, 1)
    best_cpu = best_decision = float("inf")
    same = 0
    for _ in range(args.repeats):
        cpu_s, decision_s, same = replay(pristine, cycles)
        best_cpu, best_decision = min(best_cpu, cpu_s), min(best_decision, decision_s)
    gap_s = args.cold_gap_ms * 1e-3
    cold: list[float] = []
    cold_cpu: list[float] = []
    cold_same = n
    for _ in range(args.repeats if gap_s > 0 else 0):
        cpu_s, decision_s, same_cold = replay(pristine, cycles, gap_s)
        cold.append(decision_s)
        cold_cpu.append(cpu_s)
        cold_same = min(cold_same, same_cold)
    anatomy = cold_calls(pristine, cycles, gap_s, args.cold_calls) if gap_s > 0 else None
    summary = {
        "benchmark": "live_decision",
        "policy": "specfit",
        "predictor": inner.predictor_name,
        "stopping": getattr(inner.policy, "stopping", None),
        "overlap": args.overlap or "off",
        "prefetch": args.prefetch or "none",
        "num_prompts": args.num_prompts,
        "num_cycles": n,
        "cost": args.cost,
        "cost_source": cost_source,
        "decisions_sha256": decisions_digest(cycles),
        "questions_per_cycle": questions_per_cycle,
        "live_decision_s_per_cycle": live_decision_s / max(n, 1),
        "live_decision_s_per_question": live_decision_s / max(n * questions_per_cycle, 1),
        "replay_decision_cpu_s_per_cycle": best_cpu / max(n, 1),
        "replay_decision_s_per_cycle": best_decision / max(n, 1),
        "cold_replay_decision_s_per_cycle": float(np.median(cold)) / max(n, 1) if cold else None,
        "cold_replay_decision_cpu_s_per_cycle": float(np.median(cold_cpu)) / max(n, 1) if cold else None,
        "cold_gap_ms": args.cold_gap_ms,
        "cold_empty_call_s": None if anatomy is None else anatomy["cold_empty_call_s"],
        "cold_ask_s": None if anatomy is None else anatomy["cold_ask_s"],
        "repeats": args.repeats,
        "same_decisions": same == n and cold_same == n,
        "aim_decision_s_per_cycle_max": AIM_S_PER_CYCLE,
    }
    print(f"SpecFit live decide path, embedded default, predictor {summary['predictor']}: {n} cycles")
    print(f"cost model: {cost_source}; {questions_per_cycle:.2f} questions per cycle")
    print(f"{'measure':<48}{'ms/cycle':>10}{'us/question':>13}")
    for label, key in (
        ("live (wall, as the live summary)", "live_decision_s_per_cycle"),
        ("replay, CPU time (best of repeats)", "replay_decision_cpu_s_per_cycle"),
        ("replay, planner decision_s (best of repeats)", "replay_decision_s_per_cycle"),
        (f"cold replay ({args.cold_gap_ms:g} ms gaps), CPU time (median)", "cold_replay_decision_cpu_s_per_cycle"),
        (f"cold replay ({args.cold_gap_ms:g} ms gaps), decision_s (median)", "cold_replay_decision_s_per_cycle"),
    ):
        if summary[key] is not None:
            per_question_us = 1e6 * summary[key] / questions_per_cycle if questions_per_cycle else float("nan")
            print(f"{label:<48}{1e3 * summary[key]:>10.3f}{per_question_us:>13.1f}")
    if anatomy is not None:
        print(f"{'one cold question (' + format(args.cold_gap_ms, 'g') + ' ms gaps, median)':<48}{'us/call':>10}")
        for label, key in (
            ("  empty compiled call, the question's arguments", "cold_empty_call_s"),
            ("  whole question (ask)", "cold_ask_s"),
        ):
            print(f"{label:<48}{1e6 * summary[key]:>10.1f}")
    print(f"aim <= {1e3 * AIM_S_PER_CYCLE:.1f} ms/cycle; same subtree as live in {same}/{n} replayed cycles")
    print_summary(summary)
    return 0


if __name__ == "__main__":
    from specfit.cli import run_main

    run_main(main)
