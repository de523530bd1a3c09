"""Decision-time benchmark of SpecFit's exact subtree search (specfit.planner.plan_exact).

Planning problems with real shapes (default Qwen3-30B-A3B: 48 layers x 128 experts, top-8). By
default (``--source trace``) the trees are the recorded dense trees of a synthetic real-shape
TRACE (``traces.synthetic.generate_dense_trace`` at ``--model-shape``, EAGLE-2-style trees of at
most N nodes, Zipf routing with token-to-token expert locality; generated once per N under
``--trace-root`` and reused): each tree's own routing gives the per-node expert sets (the oracle
predictor's problem, the hard case of the exact search), P comes from the draft path
probabilities, the cache holds each layer's most used experts in the trace. ``--source
synthetic`` draws the problems from :mod:`specfit.synthetic` instead. H2D bandwidth and cache
size are swept so the optimal subtree ranges from the root alone to large trees. For each N it
times ``plan_exact`` (single-threaded) and prints p50 / p99 decision milliseconds, wall clock and
thread CPU time (on a shared machine the wall clock includes preemption by other processes), and
nodes explored; the last stdout line is one JSON object with a key per N (``"n16"``, ...).
Optionally it also times the large golden cases of ``tests/data/planner_cases.jsonl.gz`` (a copy of the shared golden cases)
(``--golden``).

    python benchmarks/planner.py --nodes 16,32,64 --trees 200
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _root  # benchmarks/ is first on sys.path when a script runs by its path
import numpy as np
from tqdm import tqdm

_root.put_root_first()

from specfit import bitsets  # noqa: E402
from specfit.cli import (  # noqa: E402
    ArgumentParser,
    InputError,
    cli_main,
    comma_list,
    gb_per_s,
    non_negative_float,
    positive_int,
    print_summary,
    run_main,
)
from specfit.context import PolicyContext  # noqa: E402
from specfit.cost import CycleCostModel  # noqa: E402
from specfit.node_experts import NodeExperts  # noqa: E402
from specfit.planner import plan_exact  # noqa: E402
from specfit.shapes import MODEL_SHAPES, get_model_shape  # noqa: E402
from specfit.synthetic import random_context  # noqa: E402
from specfit.tree import DraftTree  # noqa: E402
from specfit.units import ms_to_s, s_to_ms  # noqa: E402

AIMS_MS = {64: (0.3, 2.0), 128: (1.0, 5.0)}  # issue 14: N -> (p50, p99) decision ms on one core
# Hard inputs (issue 14): the trees of the default N=128 trace (seed 0, 200 trees) that took the
# most search states with the H2D/verify overlap cost (overlap_h2d=True, the weakest bound), found
# by timing every tree of that trace; kept here so the tail is tracked release to release.
HARD_TREES = (19, 139, 119, 198, 79, 99, 59, 199, 38, 58)
HARD_NODES = 128


def build_parser() -> ArgumentParser:
    """The CLI flags (units and defaults shown by --help)."""
    p = ArgumentParser(prog="python benchmarks/planner.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nodes",
        type=comma_list(positive_int),
        default=[64, 128],
        help="tree sizes N (nodes; trace trees have at most N)",
    )
    p.add_argument("--trees", type=positive_int, default=200, help="trees timed per N (count)")
    p.add_argument(
        "--model-shape", default="qwen3-30b-a3b", help=f"model shape preset, one of {sorted(MODEL_SHAPES)}"
    )
    p.add_argument(
        "--bandwidth",
        type=comma_list(gb_per_s),
        default=[4.0, 12.0, 25.0, 55.0, 100.0],
        help="H2D bandwidths cycled over the trees (GB/s, 1 GB = 1e9 bytes)",
    )
    p.add_argument(
        "--cache",
        "--cache-fraction",
        dest="cache_fraction",
        type=comma_list(float),
        default=[0.25, 0.5, 0.75, 0.9],
        help="cached share of each layer's experts, cycled over the trees (fraction in [0, 1))",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--source",
        choices=("trace", "synthetic"),
        default="trace",
        help="trees from a synthetic real-shape dense trace, or specfit.synthetic random contexts",
    )
    p.add_argument(
        "--trace-root",
        default="runs/bench/planner-traces",
        help="folder where the per-N synthetic traces are generated once and reused (--source trace)",
    )
    p.add_argument(
        "--deadline-ms",
        type=non_negative_float,
        default=5.0,
        help="planner deadline of the second pass and the hard inputs (ms; its max decision time is the aim)",
    )
    p.add_argument("--no-hard", action="store_true", help="skip the hard-input set")
    p.add_argument("--golden", default=None, help="also time the N>=32 golden cases from this .jsonl.gz path")
    p.add_argument(
        "--out", default="runs/benchmarks/planner.json", help="where to write per-N results (JSON)"
    )
    p.add_argument(
        "--pin", action="store_true", help="pin to one CPU (on a shared machine this adds preemption stalls)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.later_spellings("--cache")  # README "Flag spellings": old abbreviations keep their flag
    return p


def _pin_one_core(pin: bool) -> str:
    """Pin this process to one CPU when asked and the OS allows it; returns a description."""
    if pin and hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"cpu {cpu}"
    return "unpinned, single-threaded"


def _summarise(
    wall_s: list[float], cpu_s: list[float], explored: list[int], sizes: list[int], tree_sizes: list[int]
) -> dict[str, Any]:
    ms = np.array([s_to_ms(x) for x in wall_s])
    cpu_ms = np.array([s_to_ms(x) for x in cpu_s])
    states = np.asarray(explored)
    return {
        "trees": int(ms.size),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "cpu_p50_ms": float(np.percentile(cpu_ms, 50)),
        "cpu_p99_ms": float(np.percentile(cpu_ms, 99)),
        "cpu_max_ms": float(cpu_ms.max()),
        "nodes_explored_p50": float(np.percentile(states, 50)),
        "nodes_explored_p99": float(np.percentile(states, 99)),
        "nodes_explored_max": int(states.max()),
        "mean_plan_size": float(np.mean(sizes)),
        "mean_tree_nodes": float(np.mean(tree_sizes)),
    }


def _golden_contexts(path: Path) -> dict[int, list[PolicyContext]]:
    """The golden cases of ``path`` (gzipped JSON lines, as ``tests/data/planner_cases.jsonl.gz``)
    with at least 32 nodes, as planning problems keyed by node count.

    Raises:
        InputError: ``--golden`` is not gzip, not JSON lines, or a line lacks a golden case's fields.
    """
    try:
        return _read_golden(path)
    except (OSError, EOFError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError) as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, KeyError):
            why = f"a case lacks the field {exc}"
        raise InputError(
            "--golden",
            f"{path}: cannot read it as golden planner cases ({why}); expected gzipped JSON lines "
            "like tests/data/planner_cases.jsonl.gz",
        ) from None


def _read_golden(path: Path) -> dict[int, list[PolicyContext]]:
    out: dict[int, list[PolicyContext]] = {}
    with gzip.open(path, "rt") as fh:
        for line in fh:
            case = json.loads(line)
            n = len(case["parent"])
            if n < 32:
                continue
            num_experts, num_layers = case["num_experts"], len(case["cache"])
            width = max(len(ex) for node in case["experts"] for ex in node)
            ids = np.full((n, num_layers, width), -1)
            for v, node in enumerate(case["experts"]):
                for layer, ex in enumerate(node):
                    ids[v, layer, : len(ex)] = ex
            cache = np.full((num_layers, max(1, max(len(c) for c in case["cache"]))), -1)
            for layer, ex in enumerate(case["cache"]):
                cache[layer, : len(ex)] = ex
            c = case["cost"]
            ctx = PolicyContext(
                tree=DraftTree.from_parents(np.zeros(n, dtype=np.int64), case["parent"]),
                accept_probs=np.asarray(case["path_prob"]),
                node_experts=NodeExperts(num_experts, bits=bitsets.pack(ids, num_experts)),
                cached_bits=bitsets.pack(cache, num_experts),
                cost=CycleCostModel(
                    0.0, c["base_s"], c["per_node_s"], 0.0, 1.0, c["per_miss_s"], 0, num_layers
                ),
            )
            out.setdefault(n, []).append(ctx)
    return out


def _trace_contexts(shape_name: str, n: int, trees: int, args: Any, root: Path) -> list[PolicyContext]:
    """``trees`` planning problems from the dense trees of a synthetic trace with at most ``n`` nodes.

    Node experts are each tree's recorded routing (per-node sets), P the clamped draft path
    probabilities (``specfit.acceptance.path_accept_probs``), ``context_len`` and the drafted
    levels those of the recorded tree; the cache holds each layer's ``fraction * E`` most used
    experts over the trace's tree routing; bandwidth and cache fraction cycle over the trees.
    """
    from sim.traceselect import SyntheticSpec, synthetic_trace
    from specfit.acceptance import path_accept_probs
    from traces.reader import open_run

    per_request = 100
    spec = SyntheticSpec(
        shape=shape_name,
        num_requests=max(1, -(-trees // per_request)),
        positions_per_request=min(trees, per_request),
        max_nodes=n,
        seed=args.seed,
    )
    run = open_run(synthetic_trace(spec, root))
    arrays = run.node_arrays()
    model = run.manifest.model
    num_layers, num_experts = int(model.num_layers), int(model.num_experts)
    routing = np.asarray(arrays.expert_ids, dtype=np.int64)  # [rows, L, K]
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    layer = np.broadcast_to(np.arange(num_layers)[None, :, None], routing.shape)
    ok = routing >= 0
    np.add.at(counts, (layer[ok], routing[ok]), 1)
    popular = np.lexsort((np.broadcast_to(np.arange(num_experts), counts.shape), -counts), axis=-1)
    shape = get_model_shape(shape_name)
    out = []
    for i in range(min(trees, arrays.num_trees)):
        dense = arrays.tree(i)
        cost = CycleCostModel.for_shape(shape, bandwidth_gb_per_s=args.bandwidth[i % len(args.bandwidth)])
        fraction = args.cache_fraction[(i // len(args.bandwidth)) % len(args.cache_fraction)]
        cached = popular[:, : int(fraction * num_experts)] if fraction > 0 else np.full((num_layers, 1), -1)
        out.append(
            PolicyContext(
                tree=dense.tree,
                accept_probs=path_accept_probs(dense.tree),
                node_experts=NodeExperts(
                    num_experts, bits=bitsets.pack(np.asarray(dense.expert_ids, np.int64), num_experts)
                ),
                cached_bits=bitsets.pack(cached, num_experts),
                cost=cost,
                context_len=dense.context_len,
                num_levels=int(dense.tree.max_depth),
            )
        )
    return out


def _time(
    contexts: list[PolicyContext], desc: str, quiet: bool, deadline_s: float | None = None
) -> dict[str, Any]:
    plan_exact(contexts[0])  # warm caches and lazy imports (the first call loads the compiled search)
    plan_exact(dataclasses.replace(contexts[0]), deadline_s=0.0)  # and the deadline's bound
    wall, cpu, explored, sizes, gaps = [], [], [], [], []
    tree_sizes = [ctx.num_nodes for ctx in contexts]
    for ctx in tqdm(contexts, desc=desc, disable=quiet, leave=False):
        if deadline_s is not None:
            ctx = dataclasses.replace(ctx)  # a fresh context: plans are remembered per context object
        started, started_cpu = time.perf_counter(), time.thread_time()
        plan = plan_exact(ctx, deadline_s=deadline_s)
        cpu.append(time.thread_time() - started_cpu)
        wall.append(time.perf_counter() - started)
        explored.append(plan.nodes_explored)
        sizes.append(plan.num_nodes)
        gaps.append(None if plan.exact else plan.gap)
    row = _summarise(wall, cpu, explored, sizes, tree_sizes)
    hit = [g for g in gaps if g is not None]
    row["deadline_ms"] = None if deadline_s is None else s_to_ms(deadline_s)
    row["deadline_hits"] = len(hit)
    row["max_gap"] = max(hit, default=0.0)
    return row


def _print_row(label: str, row: dict[str, Any]) -> None:
    print(
        f"{label:>10} {row['trees']:>6} {row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f} {row['max_ms']:>8.3f} "
        f"{row['cpu_p50_ms']:>8.3f} {row['cpu_p99_ms']:>8.3f} {row['cpu_max_ms']:>8.3f} "
        f"{row['nodes_explored_p50']:>9.1f} {row['nodes_explored_max']:>9d} {row['deadline_hits']:>5d} "
        f"{row['max_gap']:>8.2%} {row['mean_plan_size']:>9.2f} {row['mean_tree_nodes']:>7.1f}"
    )


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0 (2 on bad flags)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shape = get_model_shape(args.model_shape)
    except ValueError as exc:
        parser.fail("--model-shape", str(exc))
    if any(not 0 <= f < 1 for f in args.cache_fraction):
        parser.fail("--cache", f"expected fractions in [0, 1), got {args.cache_fraction}")
    golden = Path(args.golden) if args.golden else None
    if golden is not None and not golden.is_file():
        parser.fail("--golden", f"no such file: {golden}")
    # every path before any work: a bad one exits 2 naming its flag, not a traceback after the run
    out = parser.ensure_out_file("--out", args.out, "the JSON file to write")
    if args.source == "trace" or not args.no_hard:
        parser.ensure_out_dir("--trace-root", args.trace_root)
    golden_contexts = _golden_contexts(golden) if golden is not None else {}
    pinned = _pin_one_core(args.pin)
    rng = np.random.default_rng(args.seed)
    results: dict[str, Any] = {}
    print(
        f"planner benchmark: {shape.name}, trees from {args.source}, {pinned}, python {platform.python_version()}, numpy {np.__version__}"
    )
    print(
        f"{'N':>10} {'trees':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'cpu p50':>8} {'cpu p99':>8} "
        f"{'cpu max':>8} {'expl p50':>9} {'expl max':>9} {'hits':>5} {'max gap':>8} {'|S| mean':>9} {'N mean':>7}"
    )
    deadline_s = ms_to_s(args.deadline_ms)
    for n in args.nodes:
        if args.source == "trace":
            contexts = _trace_contexts(shape.name, n, args.trees, args, Path(args.trace_root))
        else:
            contexts = []
            for i in range(args.trees):
                cost = CycleCostModel.for_shape(
                    shape, bandwidth_gb_per_s=args.bandwidth[i % len(args.bandwidth)]
                )
                fraction = args.cache_fraction[(i // len(args.bandwidth)) % len(args.cache_fraction)]
                contexts.append(random_context(rng, shape, n, cost, cache_fraction=fraction))
        row = _time(contexts, f"N={n}", args.no_progress)
        results[f"n{n}"] = row
        _print_row(f"{n}", row)
        row = _time(contexts, f"N={n} deadline", args.no_progress, deadline_s)
        results[f"n{n}_deadline"] = row
        _print_row(f"{n} dl", row)
    if not args.no_hard:
        pool = _trace_contexts(shape.name, HARD_NODES, max(HARD_TREES) + 1, args, Path(args.trace_root))
        hard = [
            dataclasses.replace(pool[i], cost=dataclasses.replace(pool[i].cost, overlap_h2d=True))
            for i in HARD_TREES
            if i < len(pool)
        ]
        for key, limit in (("hard", None), ("hard_deadline", deadline_s)):
            row = _time(hard, key, args.no_progress, limit)
            results[key] = row
            _print_row(key.replace("_deadline", " dl"), row)
    if golden is not None:
        for n, contexts in sorted(golden_contexts.items()):
            row = _time(contexts, f"golden N={n}", args.no_progress)
            results[f"golden_n{n}"] = row
            _print_row(f"golden {n}", row)
    aims: dict[str, Any] = {}
    print("aims (issue 14, one core; on a shared machine the wall clock includes preemption, CPU time does not):")
    for n in args.nodes:
        if n not in AIMS_MS:
            print(f"  N={n}: no aim (issue 14 sets aims for N={', '.join(str(k) for k in AIMS_MS)})")
    for n, (p50, p99) in AIMS_MS.items():
        row = results.get(f"n{n}")
        if row is None:
            continue
        for clock in ("", "cpu_"):
            met = row[f"{clock}p50_ms"] <= p50 and row[f"{clock}p99_ms"] <= p99
            aims[f"n{n}_{clock or 'wall_'}met"] = bool(met)
            print(
                f"  N={n} {clock or 'wall '}p50 {row[f'{clock}p50_ms']:.3f} ms (aim {p50}), "
                f"p99 {row[f'{clock}p99_ms']:.3f} ms (aim {p99}): {'met' if met else 'NOT met'}"
            )
        dl = results[f"n{n}_deadline"]
        met = dl["max_ms"] <= args.deadline_ms
        aims[f"n{n}_max_within_deadline"] = bool(met)
        print(
            f"  N={n} with a {args.deadline_ms:g} ms deadline: max {dl['max_ms']:.3f} ms wall, "
            f"{dl['cpu_max_ms']:.3f} ms CPU, {dl['deadline_hits']} hits, max gap {dl['max_gap']:.2%}: "
            f"{'met' if met else 'NOT met'}"
        )
    results["aims"] = aims
    record = {
        "argv": list(argv) if argv is not None else None,
        "seed": args.seed,
        "shape": shape.name,
        "source": args.source,
        **results,
    }
    out.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")
    print_summary(results)
    return 0


if __name__ == "__main__":
    run_main(main)
