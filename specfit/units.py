"""Unit conversions at the edges of the toolkit.

Inside the code every physical quantity is SI with a suffix (``_s``, ``_bytes``,
``_bytes_per_s``). GB means 1e9 bytes (the PCIe convention); GiB (2**30) is used only for
memory capacity. Convert user-facing values here, never with inline factors.
"""

from __future__ import annotations

BYTES_PER_GB = 1e9
BYTES_PER_GIB = float(2**30)
S_PER_MS = 1e-3
S_PER_US = 1e-6
NS_PER_S = 1_000_000_000


def gb_per_s_to_bytes_per_s(gb_per_s: float) -> float:
    """GB/s (1 GB = 1e9 bytes) -> bytes/s."""
    return float(gb_per_s) * BYTES_PER_GB


def bytes_per_s_to_gb_per_s(bytes_per_s: float) -> float:
    """bytes/s -> GB/s (1 GB = 1e9 bytes)."""
    return float(bytes_per_s) / BYTES_PER_GB


def bytes_to_gb(num_bytes: float) -> float:
    """bytes -> GB (1e9 bytes)."""
    return float(num_bytes) / BYTES_PER_GB


def gb_to_bytes(gb: float) -> float:
    """GB (1e9 bytes) -> bytes."""
    return float(gb) * BYTES_PER_GB


def bytes_to_gib(num_bytes: float) -> float:
    """bytes -> GiB (2**30 bytes); memory capacity only."""
    return float(num_bytes) / BYTES_PER_GIB


def ms_to_s(ms: float) -> float:
    """milliseconds -> seconds."""
    return float(ms) * S_PER_MS


def s_to_ms(s: float) -> float:
    """seconds -> milliseconds."""
    return float(s) / S_PER_MS


def us_to_s(us: float) -> float:
    """microseconds -> seconds."""
    return float(us) * S_PER_US


def s_to_us(s: float) -> float:
    """seconds -> microseconds."""
    return float(s) / S_PER_US


def s_to_ns(s: float) -> int:
    """seconds -> integer nanoseconds (rounded to nearest), the simulator's clock unit."""
    return int(round(float(s) * NS_PER_S))


def ns_to_s(ns: int) -> float:
    """integer nanoseconds -> seconds."""
    return int(ns) / NS_PER_S
