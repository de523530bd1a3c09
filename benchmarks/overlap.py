"""Does ``--overlap on`` pay on the emulated CPU link? Forward time, overlap off vs on, per bandwidth.

The embedded default target is offloaded (``live.offload``, LRU expert cache of ``--cache``
experts per layer) over an emulated ``cpu`` link (``live.h2d.H2DLink``: bandwidth + 20 us per
expert, what ``live.record --bandwidth/--latency-us`` uses) and runs ``--forwards`` target forward
passes of ``--tokens`` random tokens each (1: an autoregressive step; 8: a small tree's nodes),
once with overlap off and once on, alternating ``--repeats`` times so that machine drift hits
both alike. Per bandwidth it prints the median forward time of each mode, their ratio, and with
overlap on the median stall and the share of it spent placing misses (host work the copy stream
does not hide). Overlap on pays when a layer's copies take longer than what overlap costs the
compute stream (placing each miss, one extra kernel call on the late experts:
``specfit.cost.CycleCostModel`` ``host_s_per_transfer`` and ``late_call_s``), i.e. at low
bandwidth. Aim: on faster than off at the lowest bandwidth (``ok``). Usage::

    python benchmarks/overlap.py                        # prints a table, then one JSON line
    python benchmarks/overlap.py --bandwidth 0.05,1 --forwards 60
"""

from __future__ import annotations

from collections.abc import Sequence

import _root  # benchmarks/ is first on sys.path when a script runs by its path
import numpy as np

_root.put_root_first()

from benchmarks._threads import add_threads_flag, apply_threads  # noqa: E402
from specfit.cli import ArgumentParser, cli_main, comma_list, gb_per_s, positive_int, print_summary, run_main  # noqa: E402

LATENCY_S = 20e-6


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python benchmarks/overlap.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--bandwidth", type=comma_list(gb_per_s), default=[0.05, 0.25, 1.0, 8.0], help="emulated GB/s list"
    )
    p.add_argument("--cache", type=positive_int, default=16, help="cached experts per layer (count)")
    p.add_argument("--tokens", type=positive_int, default=1, help="tokens per forward (count)")
    p.add_argument("--forwards", type=positive_int, default=40, help="timed forwards per mode and repeat")
    p.add_argument("--repeats", type=positive_int, default=2, help="off/on alternations (count)")
    add_threads_flag(p)
    return p


def measure(bandwidth_gb_per_s: float, overlap: bool, args) -> dict[str, list[float]]:
    """Per-forward wall, stall and placing seconds of one offloaded model (lists, warm-up dropped)."""
    import torch

    from live.assets import default_model_paths
    from live.loader import describe_moe, load_target, quiet_loading
    from live.offload import OffloadedMoE, make_link
    from specfit.cache import make_expert_cache

    quiet_loading()
    model = load_target(default_model_paths()[0])
    spec = describe_moe(model)
    cache = make_expert_cache("lru", spec.num_layers, spec.num_experts, args.cache)
    link = make_link("cpu", bandwidth_gb_per_s, LATENCY_S)
    engine = OffloadedMoE.install(model, cache, link, capacity_per_layer=args.cache, overlap=overlap)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.forwards + 5, args.tokens), generator=generator)
    out: dict[str, list[float]] = {"wall_s": [], "stall_s": [], "placing_s": []}
    with torch.no_grad():
        for i in range(ids.shape[0]):
            engine.begin_forward()
            model(ids[i : i + 1])
            placing = float(engine._state.placing_s.sum())
            stats = engine.end_forward()
            if i >= 5:
                out["wall_s"].append(stats.wall_s)
                out["stall_s"].append(stats.stall_s)
                out["placing_s"].append(placing)
    link.close()
    return out


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    threads = apply_threads(args.threads)
    rows = []
    print(f"embedded default, cache {args.cache}/layer, {args.tokens} token(s)/forward, {threads} torch thread(s)")
    print("medians per forward; stall = the compute stream waiting for copies (placing included)")
    print(f"{'GB/s':>6} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'off stall ms':>13} {'on stall ms':>12} {'placing share':>14}")
    for bw in args.bandwidth:
        runs = {False: {"wall_s": [], "stall_s": [], "placing_s": []}, True: {"wall_s": [], "stall_s": [], "placing_s": []}}
        for _ in range(args.repeats):
            for overlap in (False, True):
                for key, values in measure(bw, overlap, args).items():
                    runs[overlap][key] += values
        off, on = (float(np.median(runs[o]["wall_s"])) for o in (False, True))
        stall = float(np.median(runs[True]["stall_s"]))
        off_stall = float(np.median(runs[False]["stall_s"]))
        placing = float(np.sum(runs[True]["placing_s"]) / max(np.sum(runs[True]["stall_s"]), 1e-12))
        rows.append({"bandwidth_gb_per_s": bw, "off_ms": off * 1e3, "on_ms": on * 1e3, "on_over_off": on / off,
                     "off_stall_ms": off_stall * 1e3, "on_stall_ms": stall * 1e3,
                     "on_placing_share_of_stall": placing})  # fmt: skip
        print(
            f"{bw:>6g} {off * 1e3:>8.2f} {on * 1e3:>8.2f} {on / off:>7.3f} {off_stall * 1e3:>13.2f} "
            f"{stall * 1e3:>12.2f} {placing:>14.2f}"
        )
    lowest = min(rows, key=lambda r: r["bandwidth_gb_per_s"])
    print_summary(
        {"benchmark": "overlap", "rows": rows, "torch_threads": threads, "ok": bool(lowest["on_over_off"] < 1.0)}
    )
    return 0


if __name__ == "__main__":
    run_main(main)
