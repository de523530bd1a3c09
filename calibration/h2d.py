"""``python -m calibration.h2d``: host-to-device bandwidth against transfer size, table and figure.

Measures the link the live engine uses (``live.h2d.H2DLink``, imported lazily with torch inside
:func:`measure`, so importing this module never loads torch): on CUDA pinned and pageable host
memory (copy stream, CUDA-event timing); on CPU a plain memcpy and the emulated link
(``--bandwidth`` GB/s, ``--latency-us`` per transfer). For every kind and size it times
``--repeats`` single-tensor transfers after ``--warmup`` untimed ones, then fits
``seconds = bytes / bandwidth + latency`` by non-negative least squares on the per-size medians
(robust to the odd preempted copy)
(:func:`calibration.link.fit_link`); varied sizes are what separate latency from bandwidth, so
``calibration.fit --h2d-table`` can take the latency from here.

Outputs (``--out``, default ``runs/h2d``): ``h2d.csv`` (kind, bytes, repeat, h2d_s,
bytes_per_s), ``h2d.json`` (per-kind fit and per-size medians; ``fits`` is keyed by link kind and
by the manifest's memory kind: ``pinned``, ``pageable``, ``emulated``, ``memcpy``), ``h2d.png``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from calibration.link import fit_link
from specfit.cli import (
    ArgumentParser,
    cli_main,
    comma_list,
    gb_per_s,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    print_summary,
    run_main,
)
from specfit.units import bytes_per_s_to_gb_per_s, gb_per_s_to_bytes_per_s, s_to_us, us_to_s

BYTES_PER_MIB = 1 << 20
CPU_KINDS = ("memcpy", "emulated")
CUDA_KINDS = ("pinned", "pageable")
MEMORY_KIND_OF_LINK = {
    "cuda-pinned": "pinned",
    "cuda-pageable": "pageable",
    "cpu-emulated": "emulated",
    "cpu-memcpy": "memcpy",
}


def build_parser() -> ArgumentParser:
    """The CLI's parser."""
    p = ArgumentParser(prog="python -m calibration.h2d", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="cuda when available on auto"
    )
    p.add_argument(
        "--sizes-mib",
        type=comma_list(positive_float),
        default=[0.0625, 0.25, 1.0, 4.0, 16.0],
        help="transfer sizes in MiB (2**20 bytes), comma-separated; >= 2 distinct sizes (they separate "
        "bandwidth from latency)",
    )
    p.add_argument("--repeats", type=positive_int, default=8, help="timed transfers per size (count)")
    p.add_argument("--warmup", type=int, default=2, help="untimed transfers per size (count)")
    p.add_argument(
        "--bandwidth",
        type=gb_per_s,
        default=16.0,
        help="emulated link bandwidth in GB/s (CPU, 1 GB = 1e9 B; at most 10,000)",
    )
    p.add_argument(
        "--latency-us",
        type=non_negative_float,
        default=20.0,
        help="emulated per-transfer latency in microseconds",
    )
    p.add_argument(
        "--threads",
        "--torch-threads",
        dest="torch_threads",
        type=non_negative_int,
        default=1,
        help="torch intra-op threads during the copies (count; 0 = torch default). On a busy CPU the "
        "thread pool's wake-up (~10 ms) can dominate copies above ~128 KiB",
    )
    p.add_argument(
        "--out", "--out-dir", dest="out_dir", default="runs/h2d", help="folder for h2d.csv, h2d.json, h2d.png"
    )
    p.add_no_progress()
    p.later_spellings("--threads", "--out")  # README "Flag spellings": old abbreviations keep their flag
    return p


def measure(
    device: str,
    sizes_bytes: Sequence[int],
    *,
    repeats: int,
    warmup: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    progress: bool = True,
) -> pd.DataFrame:
    """Time single-tensor transfers of each size on each link kind of ``device``.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        sizes_bytes: transfer sizes (bytes).
        repeats, warmup: timed and untimed transfers per size.
        bandwidth_bytes_per_s, latency_s: the emulated CPU link's parameters.
        progress: show a tqdm bar.

    Returns:
        DataFrame ``kind, link_kind, bytes, repeat, h2d_s, bytes_per_s`` (one row per timed transfer).

    Raises:
        ValueError: ``device="cuda"`` without CUDA.
    """
    import torch

    from live.h2d import H2DLink  # the live engine's link: same copies, same timing

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but torch.cuda.is_available() is False")
    if device == "cuda":
        links = {
            "pinned": H2DLink("cuda", pin_memory=True),
            "pageable": H2DLink("cuda", pin_memory=False),
        }
    else:
        links = {
            "memcpy": H2DLink("cpu"),
            "emulated": H2DLink("cpu", bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s),
        }
    rows = []
    total = len(links) * len(sizes_bytes) * (repeats + warmup)
    with tqdm(total=total, desc="h2d transfers", disable=not progress, file=sys.stderr) as bar:
        for kind, link in links.items():
            for size in sizes_bytes:
                numel = max(1, int(size) // 2)
                src = link.prepare_host(torch.ones(numel, dtype=torch.float16))
                dst = torch.empty(numel, dtype=torch.float16, device=link.device)
                for r in range(warmup + repeats):
                    seconds = link.fetch([[(dst, src)]]).seconds()
                    if r >= warmup:
                        nbytes = numel * 2
                        rows.append((kind, link.kind, nbytes, r - warmup, seconds, nbytes / seconds))
                    bar.update(1)
    return pd.DataFrame(rows, columns=["kind", "link_kind", "bytes", "repeat", "h2d_s", "bytes_per_s"])


def fit_table(table: pd.DataFrame) -> dict[str, Any]:
    """Per-kind link fit and per-size medians of a :func:`measure` table (JSON-able)."""
    fits: dict[str, Any] = {}
    medians: dict[str, Any] = {}
    for kind, group in table.groupby("kind", sort=False):
        per_size = group.groupby("bytes")["h2d_s"].median()  # medians: robust to preempted copies
        b = per_size.index.to_numpy(dtype=np.float64)
        link = fit_link(b, np.ones_like(b), per_size.to_numpy(dtype=np.float64))
        entry = {
            "bytes_per_s": link.bytes_per_s,
            "s_per_transfer": link.s_per_transfer,
            "identifiable": link.identifiable,
            "link_kind": str(group["link_kind"].iloc[0]),
        }
        fits[str(kind)] = entry
        fits[entry["link_kind"]] = entry
        medians[str(kind)] = {
            "bytes": [int(v) for v in per_size.index],
            "median_h2d_s": [float(v) for v in per_size.to_numpy()],
        }
    return {"fits": fits, "medians": medians}


def plot(table: pd.DataFrame, fits: dict[str, Any], path: Path) -> Path:
    """Bandwidth (GB/s) against transfer size (bytes, log scale) per kind, with the fitted curve
    ``size / (size / bytes_per_s + s_per_transfer)`` (latency + size / bandwidth).

    Args:
        table: one row per timed copy: ``kind``, ``bytes``, ``bytes_per_s``.
        fits: per kind, ``{"bytes_per_s": ..., "s_per_transfer": ...}`` (bytes/s, seconds).
        path: the PNG to write (folders made).

    Returns:
        ``path``.

    Raises:
        KeyError: a kind of ``table`` without a fit, or a missing column.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, group in table.groupby("kind", sort=False):
        med = group.groupby("bytes")["bytes_per_s"].median()
        (points,) = ax.plot(
            med.index, [bytes_per_s_to_gb_per_s(v) for v in med.to_numpy()], "o", label=f"{kind} (median)"
        )
        fit = fits[str(kind)]
        xs = np.geomspace(med.index.min(), med.index.max(), 50)
        ys = xs / (xs / fit["bytes_per_s"] + fit["s_per_transfer"])
        ax.plot(xs, [bytes_per_s_to_gb_per_s(v) for v in ys], "-", color=points.get_color(), label=f"{kind} fit")
    ax.set_xscale("log")
    ax.set_xlabel("transfer size (bytes)")
    ax.set_ylabel("bandwidth (GB/s, 1 GB = 1e9 B)")
    ax.set_title(
        "MEASURED host-to-device bandwidth against transfer size\n(markers: median of the timed copies; "
        "lines: fit, latency + size / bandwidth)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: exit 0 on success, 2 on a bad flag, 1 on a measurement error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.fail("--warmup", f"expected an integer >= 0, got {args.warmup}")
    sizes = sorted({max(2, int(round(s * BYTES_PER_MIB))) for s in args.sizes_mib})
    if len(sizes) < 2:
        shown = ",".join(f"{s:g}" for s in args.sizes_mib)
        parser.fail(
            "--sizes-mib",
            f"needs >= 2 sizes to separate bandwidth and latency, got {shown!r} ({len(sizes)} distinct "
            f"size in bytes: {sizes[0]})",
        )
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.fail(
            "--device", "'cuda' is not available here (torch.cuda.is_available() is False); use cpu or auto"
        )
    out = parser.ensure_out_dir("--out", args.out_dir)  # before any transfer is timed
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        table = measure(
            device,
            sizes,
            repeats=args.repeats,
            warmup=args.warmup,
            bandwidth_bytes_per_s=gb_per_s_to_bytes_per_s(args.bandwidth),
            latency_s=us_to_s(args.latency_us),
            progress=not args.no_progress,
        )
        result = fit_table(table)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print_summary({"ok": False, "error": str(exc), "exit_code": 1})
        return 1
    table.to_csv(out / "h2d.csv", index=False)
    result.update(device=device, sizes_bytes=sizes, repeats=args.repeats)
    (out / "h2d.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(table, result["fits"], out / "h2d.png")
    summary: dict[str, Any] = {
        "ok": True,
        "device": device,
        "out_dir": str(out),
        "torch_threads": torch.get_num_threads(),
    }
    med = table.groupby(["kind", "bytes"], sort=False)["h2d_s"].median().reset_index()
    print(f"{'kind':<10} {'bytes':>12} {'median us':>11} {'GB/s':>8}")
    for row in med.itertuples(index=False):
        gbps = bytes_per_s_to_gb_per_s(row.bytes / row.h2d_s)
        print(f"{row.kind:<10} {row.bytes:>12d} {s_to_us(row.h2d_s):>11.1f} {gbps:>8.2f}")
    print(f"\n{'kind':<10} {'fit GB/s':>8} {'latency us':>11}")
    for kind in table["kind"].unique():
        fit = result["fits"][kind]
        gbps, lat_us = bytes_per_s_to_gb_per_s(fit["bytes_per_s"]), s_to_us(fit["s_per_transfer"])
        print(f"{kind:<10} {gbps:8.2f} {lat_us:11.1f}")
        summary[f"{kind}_gb_per_s"] = gbps
        summary[f"{kind}_latency_us"] = lat_us
    print_summary(summary)
    return 0


if __name__ == "__main__":
    run_main(main)
