"""Real-clock accuracy of the emulated H2D link: does a fit on its per-copy timings recover it?

The unit tests check the emulated link on a fake clock (tests/fake_clock.py), where every copy
lasts exactly what the link charges. This benchmark is the same measurement on the real clock,
where sleeps overshoot and other processes preempt the copies: per case it fetches experts over
an emulated ``cpu`` link (``live.h2d.H2DLink``, what ``live.record --bandwidth/--latency-us``
uses), fits ``seconds = bytes / bandwidth + latency`` on the per-copy timings
(``calibration.link.fit_link`` on absolute residuals priced at the mean, as ``calibration.fit`` does) and on the
engine's quick estimate (``live.spec.costs.measure_link``, means per copy size), and prints the
fitted figures against the link's settings, and each fit's price of the timed copies over their
summed time (``priced/timed``: the cost model sums copy times, so 1.0 is the aim; a median or a
relative fit follows the fast mode of bimodal copy times and prices them short). Cases:

- ``default-shape``: experts of the embedded default's shape (gate/up 65,536 B + down 32,768 B,
  float32) over 4 GB/s + 20 us per expert (the test ``test_per_copy_timings_recover_...``);
- ``tiny``: the tests' tiny Qwen3-MoE experts (4,096 B + 2,048 B) over 0.2 GB/s + 20 us (the
  tests ``test_link_measurement_recovers_an_emulated_link`` and
  ``test_policy_run_transfers_recover_the_emulated_link``).

Aim: fitted bandwidth and per-expert latency within 5 % of the settings (``ok`` per case); the
priced/timed ratios are reported. On a
loaded machine the latency is the first to miss (a late wake-up lengthens small copies most).
Torch threads default to ``live.record``'s default (``--threads``). Usage::

    python benchmarks/h2d_link.py                 # prints a table, then one JSON line
    python benchmarks/h2d_link.py --transfers 300 --repeats 5
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import _root  # benchmarks/ is first on sys.path when a script runs by its path
import numpy as np

_root.put_root_first()

from benchmarks._threads import add_threads_flag, apply_threads  # noqa: E402
from specfit.cli import ArgumentParser, cli_main, positive_int, print_summary, run_main  # noqa: E402

AIM_REL = 0.05
# (name, gate/up bytes, down bytes, bandwidth GB/s, latency us per expert)
CASES = (
    ("default-shape", 65_536, 32_768, 4.0, 20.0),
    ("tiny", 4_096, 2_048, 0.2, 20.0),
)


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python benchmarks/h2d_link.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--transfers", type=positive_int, default=150, help="experts fetched per repeat (count)")
    p.add_argument("--repeats", type=positive_int, default=3, help="fetch batches per case (count)")
    add_threads_flag(p)
    return p


def measure_case(
    gate_up_bytes: int, down_bytes: int, gb_per_s: float, latency_us: float, transfers: int, repeats: int
) -> dict[str, float]:
    """Fit the emulated link from ``repeats`` fetches of ``transfers`` experts (real clock).

    Returns:
        ``fit_gb_per_s``, ``fit_latency_us`` (per expert, ``fit_link`` on every copy),
        ``quick_gb_per_s``, ``quick_latency_us`` (means per copy size, ``measure_link``'s rule) and
        ``fit_priced_over_timed``, ``quick_priced_over_timed``: each fit's price of the timed
        copies (bytes / bandwidth + latency per copy, summed) over their summed time.
    """
    import torch

    from calibration.link import fit_link
    from live.h2d import H2DLink
    from live.spec.costs import measure_link

    link = H2DLink("cpu", bandwidth_bytes_per_s=gb_per_s * 1e9, latency_s=latency_us * 1e-6)
    host = [(torch.ones(gate_up_bytes // 4), torch.ones(down_bytes // 4)) for _ in range(4)]
    dst = (torch.empty(gate_up_bytes // 4), torch.empty(down_bytes // 4))
    batch = [list(zip(dst, host[i % 4])) for i in range(transfers)]
    link.fetch(batch[:2])  # warm-up
    sizes, seconds = [], []
    for _ in range(repeats):
        fetch = link.fetch(batch)
        sizes.append(fetch.copy_bytes)
        seconds.append(fetch.copy_seconds())
    x, y = np.concatenate(sizes).astype(np.float64), np.concatenate(seconds)
    fit = fit_link(x, np.ones(x.size), y, relative=False, price_at_mean=True)
    # the engine's quick estimate, on the same link and expert tensors
    store = SimpleNamespace(gate_up=[[host[0][0]]], down=[[host[0][1]]])
    quick_bytes_per_s, quick_latency_s = measure_link(SimpleNamespace(store=store, link=link), repeats * 10)
    timed_s = float(y.sum())
    return {
        "fit_priced_over_timed": float((x / fit.bytes_per_s + fit.s_per_transfer).sum()) / timed_s,
        "quick_priced_over_timed": float((x / quick_bytes_per_s + quick_latency_s / 2).sum()) / timed_s,
        "fit_gb_per_s": fit.bytes_per_s / 1e9,
        "fit_latency_us": 2 * fit.s_per_transfer * 1e6,
        "quick_gb_per_s": quick_bytes_per_s / 1e9,
        "quick_latency_us": quick_latency_s * 1e6,
    }


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    apply_threads(args.threads)
    rows, results = [], {}
    for name, gate_up, down, gb_per_s, latency_us in CASES:
        got = measure_case(gate_up, down, gb_per_s, latency_us, args.transfers, args.repeats)
        errors = {
            "bandwidth_error_pct": 100 * (got["fit_gb_per_s"] / gb_per_s - 1),
            "latency_error_pct": 100 * (got["fit_latency_us"] / latency_us - 1),
            "quick_bandwidth_error_pct": 100 * (got["quick_gb_per_s"] / gb_per_s - 1),
            "quick_latency_error_pct": 100 * (got["quick_latency_us"] / latency_us - 1),
        }
        ok = all(abs(v) <= 100 * AIM_REL for v in errors.values())
        results[name] = {"gb_per_s": gb_per_s, "latency_us": latency_us, **got, **errors, "ok": ok}
        rows.append(
            (
                name,
                gb_per_s,
                got["fit_gb_per_s"],
                got["quick_gb_per_s"],
                latency_us,
                got["fit_latency_us"],
                got["quick_latency_us"],
                got["fit_priced_over_timed"],
                got["quick_priced_over_timed"],
                "yes" if ok else "NO",
            )
        )
    header = ("case", "set GB/s", "fit GB/s", "quick GB/s", "set us", "fit us", "quick us", "fit pr/timed", "quick pr/timed", "ok")
    print("emulated H2D link, real clock (measured; aim: within 5 % of the setting)")
    print("  ".join(f"{h:>13}" for h in header))
    for row in rows:
        print("  ".join(f"{v:>13.3f}" if isinstance(v, float) else f"{v:>13}" for v in row))
    print(
        "fit = calibration.link.fit_link on every copy; quick = live.spec.costs.measure_link's means; "
        "pr/timed = each fit's price of the timed copies over their summed time (aim 1.0)"
    )
    print_summary(
        {
            "benchmark": "h2d_link",
            "torch_threads": torch.get_num_threads(),
            "transfers": args.transfers,
            "repeats": args.repeats,
            "aim_rel": AIM_REL,
            "cases": results,
            "ok": all(r["ok"] for r in results.values()),
        }
    )
    return 0


if __name__ == "__main__":
    run_main(main)
