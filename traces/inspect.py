"""``python -m traces.inspect RUN_DIR [--validate]``: summary of a trace run.

Prints a table (requests, positions, nodes, full-tree tau, per-depth acceptance, expert-union
growth with tree size, cache hit rate, H2D bytes) and, as the last stdout line, the same figures
as one JSON object. ``--validate`` checks every value of every table first.

Exit status (the CLI contract, ``specfit.cli``): 0 on success; 2 for bad flags, a missing
directory, or a run that does not read or validate (one stderr line names the file, table and
row); the last stdout line is JSON either way.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specfit.cli import ArgumentParser, cli_main, comma_list, positive_int, print_summary, run_main
from traces.errors import TraceError
from traces.reader import open_run
from traces.stats import DEFAULT_UNION_SIZES, summarize


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return str(value)


_ROWS = (
    ("complete", "manifest complete flag"),
    ("mode", "run mode"),
    ("format_version", "trace format version (2 on: level trees; 3: compact transfers)"),
    ("model", "target model"),
    ("num_requests", "requests (finished)"),
    ("num_unfinished_requests", "requests without a requests row"),
    ("num_prefill_tokens", "prefill tokens"),
    ("num_trees", "dense positions (trees)"),
    ("num_nodes", "dense tree nodes"),
    ("mean_nodes_per_tree", "nodes per tree (mean)"),
    ("full_tree_tau", "full-tree tau (tokens/cycle, incl. bonus)"),
    ("depth_acceptance", "acceptance by depth 1.. (conditional)"),
    ("expert_union", "distinct experts/layer of best-n nodes"),
    ("next_layer_guess_recall", "next-layer guess recall (nan: not in trace)"),
    ("num_pushed_out_nodes", "nodes pushed out by a later level (None: no level trees)"),
    ("num_cycles", "executed cycles"),
    ("cycle_tau", "cycle tau (mean committed)"),
    ("cache_hit_rate", "expert cache hit rate"),
    ("h2d_bytes", "H2D bytes (cycles)"),
    ("num_transfers", "H2D transfers"),
    ("transfer_bytes", "H2D bytes (transfers)"),
    ("bytes_on_disk", "run size on disk (bytes)"),
)


def _print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"trace {summary['run_dir']}")
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    for key, label in _ROWS:
        table.add_row(label, _fmt(summary[key]))
    Console(file=sys.stdout, width=120).print(table)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Summarise (and with ``--validate`` fully check) a trace run directory."""
    parser = ArgumentParser(
        prog="python -m traces.inspect",
        description="Summarise a trace run directory; --validate checks every value first. "
        "Exit 2 for bad flags or a run that does not read or validate (the message names the file, "
        "table and row).",
    )
    parser.add_argument("run_dir", help="trace run directory (holds manifest.json)")
    parser.add_argument("--validate", action="store_true", help="check every value of every table first")
    parser.add_argument(
        "--union-sizes",
        type=comma_list(positive_int),
        default=",".join(str(n) for n in DEFAULT_UNION_SIZES),
        help="tree sizes (nodes) at which to report expert-union growth",
    )
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        parser.fail("run_dir", f"{run_dir} is not a directory")
    try:
        run = open_run(run_dir, validate=args.validate)
        summary = summarize(run, args.union_sizes)
    except TraceError as exc:
        parser.fail("run_dir", str(exc))
    _print_table(summary)
    summary["validated"] = bool(args.validate)
    summary["valid"] = True if args.validate else None
    print_summary(summary)
    return 0


if __name__ == "__main__":
    run_main(main)
