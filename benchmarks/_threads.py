"""The ``--threads`` flag of the benchmarks that run torch: default = ``live.record``'s default.

Timings depend on torch's intra-op thread count (on a loaded 2-core machine the default pool can
more than double a tiny model's step time), so a benchmark's figures are comparable with a
``live.record`` run only at the same count.
"""

from __future__ import annotations

from argparse import ArgumentParser


def add_threads_flag(parser: ArgumentParser) -> None:
    """Add ``--threads`` (count >= 0; 0 = torch's own default; unset = live.record's default)."""
    from specfit.cli import non_negative_int

    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=None,
        help="torch CPU threads (count; 0 = torch's default); default: live.record's default",
    )


def apply_threads(threads: int | None) -> int:
    """Set torch's thread count (``None``: live.record's default ``--threads``); return the count in use."""
    import torch

    if threads is None:
        from live.record import build_parser

        threads = int(build_parser().get_default("threads"))
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
