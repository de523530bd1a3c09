"""Does compute that follows an emulated-link wait run slower? Live runs at several bandwidths.

Issue 13 item 4 asked whether the emulated link's waits leave the compute that follows on cold
caches (on a nested VM, code and data not touched for ~1 ms run several times slower on their
next use), so that per-layer compute grows with the wait before it. This benchmark records the
same cell (``live.record --mode policy --policy ar --cache 16 --num-prompts 2`` by
default) over the emulated link at several bandwidths, interleaved repeat by repeat so that a
drift of the machine's speed hits every bandwidth alike, and reads each run's per-layer timings
(``cycles.layer_compute_s``, ``layer_pre_router_s``, ``layer_stall_s``, ``layer_misses``):

- ``wait_per_miss_ms``: the compute stream's stall per missed expert (placing + wire time);
- ``step_1_ms`` / ``step_3_ms``: the experts' compute (``layer_compute_s - layer_pre_router_s``)
  of layers with exactly 1 / at least 3 misses minus that of layers with none, in the same run
  (layers 1..L-1; the first layer also embeds). With ``ar`` every layer computes the same number
  of experts (top-k of one token), so a step is what a miss costs the compute that follows it;
- ``speed_ms``: the run's mean attention + router time per layer (no wait precedes it inside its
  layer): how fast the machine computed during that run.

If the waits left the compute cold, the steps would grow with ``wait_per_miss_ms`` (the
bandwidth); a step that is there at a bandwidth with no wire time at all (1000 GB/s) is the
miss's own host work. Per bandwidth the medians over repeats are printed, then one JSON line.
Complete runs under ``--out`` are reused. Usage::

    python benchmarks/wait_step.py                          # 1000,8,1,0.25,0.1 GB/s x 3 repeats
    python benchmarks/wait_step.py --bandwidth 8,0.25 --repeats 2 --out runs/bench/wait_step
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import _root  # benchmarks/ is first on sys.path when a script runs by its path
import numpy as np
import pandas as pd

_root.put_root_first()

from benchmarks._threads import add_threads_flag, apply_threads  # noqa: E402
from specfit.cli import (  # noqa: E402
    ArgumentParser,
    cli_main,
    comma_list,
    gb_per_s,
    non_negative_float,
    positive_int,
    print_summary,
    run_main,
)

COLUMNS = ("layer_misses", "layer_compute_s", "layer_pre_router_s", "layer_stall_s")


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python benchmarks/wait_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--bandwidth",
        "--bandwidths",
        dest="bandwidths",
        type=comma_list(gb_per_s),
        default=[1000.0, 8.0, 1.0, 0.25, 0.1],
        help="emulated link bandwidths (GB/s, comma-separated)",
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per bandwidth, interleaved (count)")
    p.add_argument("--num-prompts", type=positive_int, default=2, help="prompts per run (count)")
    p.add_argument(
        "--cache", "--cache-experts", dest="cache_experts", type=positive_int, default=16,
        help="experts cached per layer (count)",
    )  # fmt: skip
    p.add_argument("--latency-us", type=non_negative_float, default=20.0, help="emulated per-transfer latency (us)")
    p.add_argument("--out", default="runs/bench/wait_step", help="folder of the runs (reused when complete)")
    add_threads_flag(p)
    p.later_spellings("--bandwidth", "--cache")  # README "Flag spellings": old abbreviations keep their flag
    return p


def run_steps(cycles: pd.DataFrame) -> dict[str, float]:
    """One run's figures (see the module docstring) from its ``cycles`` table (the :data:`COLUMNS`,
    one list of L values per row, L >= 2): ``wait_per_miss_ms``, ``step_1_ms``, ``step_3_ms``
    (NaN where the run has no such layer or no layer without misses), ``speed_ms`` and
    ``num_layers_0`` / ``_1`` / ``_3`` (the layers each mean is over).

    Raises:
        ValueError: a missing column or fewer than 2 layers.
    """
    missing = [c for c in COLUMNS if c not in cycles.columns]
    if missing:
        raise ValueError(f"cycles: missing column(s) {missing} (record with a live.record that writes them)")
    misses, compute, pre, stall = (np.stack(cycles[c].to_numpy()).astype(np.float64) for c in COLUMNS)
    if misses.ndim != 2 or misses.shape[1] < 2:
        raise ValueError("cycles: need at least 2 layers per cycle")
    experts_ms = (compute - pre)[:, 1:] * 1e3
    m = misses[:, 1:]

    def mean(mask: np.ndarray) -> float:
        return float(experts_ms[mask].mean()) if mask.any() else float("nan")

    none = mean(m == 0)
    total_misses = float(misses.sum())
    return {
        "wait_per_miss_ms": float(stall.sum()) / total_misses * 1e3 if total_misses else float("nan"),
        "step_1_ms": mean(m == 1) - none,
        "step_3_ms": mean(m >= 3) - none,
        "speed_ms": float(pre[:, 1:].mean()) * 1e3,
        "num_layers_0": int((m == 0).sum()),
        "num_layers_1": int((m == 1).sum()),
        "num_layers_3": int((m >= 3).sum()),
    }


def summarize(per_run: dict[float, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per bandwidth (GB/s, as a string key), the median over its runs of each :func:`run_steps`
    figure and the run count."""
    out = {}
    for bw, runs in per_run.items():
        frame = pd.DataFrame(runs)
        row = {k: float(np.nanmedian(frame[k])) if frame[k].notna().any() else float("nan") for k in frame.columns}
        row["runs"] = len(runs)
        out[f"{bw:g}"] = row
    return out


def _record(path: Path, bandwidth: float, args) -> None:
    """Record one ``ar`` run at ``bandwidth`` into ``path`` (in this process:
    ``analysis.validate.live_record``; its stdout into ``path``'s ``.log`` beside it).

    Raises:
        analysis.validate.ValidationError: the run failed or exited non-zero (command and log named).
    """
    from analysis.validate import live_record

    argv = ["--mode", "policy", "--policy", "ar", "--cache", str(args.cache_experts)]
    argv += ["--num-prompts", str(args.num_prompts), "--bandwidth", f"{bandwidth:g}"]
    argv += ["--latency-us", f"{args.latency_us:g}", "--out", str(path), "--no-progress"]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    live_record(argv, path.with_suffix(".log"))


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Record (or reuse) the runs, print the per-bandwidth table and the JSON line."""
    args = _parser().parse_args(argv)
    threads = apply_threads(args.threads)
    from traces.reader import open_run, read_manifest

    out = Path(args.out)
    per_run: dict[float, list[dict[str, float]]] = {bw: [] for bw in args.bandwidths}
    for repeat in range(1, args.repeats + 1):  # interleaved: a drift hits every bandwidth alike
        for bw in args.bandwidths:
            path = out / f"bw{bw:g}" / f"r{repeat}"
            if not ((path / "manifest.json").is_file() and read_manifest(path).complete):
                _record(path, bw, args)
            per_run[bw].append(run_steps(open_run(path).cycles))
    table = summarize(per_run)
    print(f"compute after a link wait, ar, cache {args.cache_experts}, medians over {args.repeats} interleaved runs")
    print(f"{'GB/s':>8} {'wait/miss ms':>13} {'step 1 miss ms':>15} {'step >=3 ms':>12} {'attn+router ms':>15}")
    for bw, row in table.items():
        print(
            f"{bw:>8} {row['wait_per_miss_ms']:13.3f} {row['step_1_ms']:+15.3f} {row['step_3_ms']:+12.3f} "
            f"{row['speed_ms']:15.3f}"
        )
    print_summary(
        {
            "benchmark": "wait_step",
            "bandwidths_gb_per_s": table,
            "repeats": args.repeats,
            "cache_experts": args.cache_experts,
            "torch_threads": threads,
            "out": str(out),
        }
    )
    return 0


if __name__ == "__main__":
    run_main(main)
