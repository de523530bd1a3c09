"""Bytes on disk per (node, layer, expert slot) of a real-shape synthetic dense trace.

    python benchmarks/trace_size.py [--model-shape qwen3-30b-a3b] [--num-requests 4] [--positions 500]

Generates a synthetic dense trace (``traces.synthetic``) at a real model shape, then reports the
size of the ``nodes`` table and of the whole run divided by ``nodes x L x K`` (target <= 3
bytes), split into expert ids, router weights and the other columns (from the Parquet column
chunk sizes), plus generation, open+validate and ``iter_trees`` times. Last line: JSON summary.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import _root  # benchmarks/ is first on sys.path when a script runs by its path
import pyarrow.parquet as pq

_root.put_root_first()

from specfit.cli import ArgumentParser, cli_main, non_negative_int, positive_int, print_summary, run_main  # noqa: E402
from specfit.shapes import MODEL_SHAPES, get_model_shape  # noqa: E402
from traces.reader import open_run  # noqa: E402
from traces.synthetic import generate_dense_trace  # noqa: E402

TARGET_BYTES_PER_SLOT = 3.0


def column_bytes(run_dir: Path, table: str) -> dict[str, int]:
    """Compressed bytes per top-level column of ``table`` over all its parts (Parquet metadata)."""
    sizes: dict[str, int] = {}
    for part in sorted((run_dir / table).glob("part-*.parquet")):
        meta = pq.ParquetFile(part).metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                column = group.column(c)
                name = column.path_in_schema.split(".")[0]
                sizes[name] = sizes.get(name, 0) + column.total_compressed_size
    return sizes


def build_parser() -> ArgumentParser:
    """The benchmark's flags."""
    parser = ArgumentParser(prog="python benchmarks/trace_size.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-shape",
        "--shape",
        dest="shape",
        default="qwen3-30b-a3b",
        help=f"model shape, one of {sorted(MODEL_SHAPES)}",
    )
    parser.add_argument("--num-requests", type=positive_int, default=4, help="requests")
    parser.add_argument("--positions", type=positive_int, default=500, help="trees per request")
    parser.add_argument("--max-nodes", type=positive_int, default=32, help="nodes per tree incl. root")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed")
    parser.add_argument("--keep", default=None, help="keep the trace in this directory (default: temp dir)")
    parser.later_spellings("--model-shape")  # README "Flag spellings": old abbreviations keep their flag
    return parser


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Measure trace bytes per (node, layer, expert slot); see the module docstring."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shape = get_model_shape(args.shape)
    except ValueError as exc:
        parser.fail("--model-shape", str(exc))
    tmp = None
    if args.keep:
        out = Path(args.keep)
        if out.exists() and any(out.iterdir()):
            parser.fail("--keep", f"{out} is not empty")
    else:
        tmp = tempfile.mkdtemp(prefix="trace_size_")
        out = Path(tmp) / "run"
    try:
        t0 = time.perf_counter()
        generate_dense_trace(
            out,
            shape,
            num_requests=args.num_requests,
            positions_per_request=args.positions,
            max_nodes=args.max_nodes,
            seed=args.seed,
            progress=True,
        )
        generate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        run = open_run(out)
        open_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        num_trees = sum(1 for _ in run.iter_trees())
        iter_s = time.perf_counter() - t0
        num_nodes = run.num_rows("nodes")
        slots = num_nodes * shape.num_layers * shape.top_k
        nodes_bytes = sum(p.stat().st_size for p in (out / "nodes").glob("part-*.parquet"))
        run_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        cols = column_bytes(out, "nodes")
        ids_b, w_b = cols.get("expert_ids", 0), cols.get("router_weights", 0)
        other_b = sum(cols.values()) - ids_b - w_b
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    per_slot = nodes_bytes / slots
    print(f"shape {shape.name}: L={shape.num_layers} E={shape.num_experts} K={shape.top_k}")
    print(f"trees {num_trees}, nodes {num_nodes}, slots (node x layer x k) {slots}")
    print(f"nodes table: {nodes_bytes} bytes = {per_slot:.3f} bytes/slot (target <= {TARGET_BYTES_PER_SLOT})")
    print(
        f"  expert ids {ids_b / slots:.3f}, router weights {w_b / slots:.3f}, other columns {other_b / slots:.3f} "
        "bytes/slot (column chunks)"
    )
    print(f"whole run: {run_bytes} bytes = {run_bytes / slots:.3f} bytes/slot")
    print(f"generate {generate_s:.2f} s, open+validate {open_s:.2f} s, iter_trees {iter_s:.2f} s")
    print_summary(
        {
            "shape": shape.name,
            "num_trees": num_trees,
            "num_nodes": num_nodes,
            "slots": slots,
            "nodes_bytes": nodes_bytes,
            "bytes_per_slot": per_slot,
            "run_bytes_per_slot": run_bytes / slots,
            "expert_id_bytes_per_slot": ids_b / slots,
            "router_weight_bytes_per_slot": w_b / slots,
            "meets_target": per_slot <= TARGET_BYTES_PER_SLOT,
            "generate_s": generate_s,
            "open_validate_s": open_s,
            "iter_trees_s": iter_s,
        }
    )
    return 0


if __name__ == "__main__":
    run_main(main)
