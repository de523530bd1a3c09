"""Decoding and fidelity metrics with stated conventions (docs/metrics.md).

Conventions (EAGLE's, see docs/reference-figures.md "Metric conventions in the field"):

- ``tau`` is the mean number of tokens committed per verification cycle INCLUDING the bonus
  token, averaged over ALL cycles (not the last one): cycles with 0, 2 and 3 accepted drafts give
  tau = (1 + 3 + 4) / 3 = 2.67. Records store ``num_accepted`` (drafts only, no bonus) and
  ``num_committed`` (= num_accepted + 1 unless EOS or the length limit cut the cycle short).
- Per-depth acceptance is conditional: accepted(d) / reached(d). A cycle *reaches* depth d when
  all drafts at depths < d on its committed path were accepted (``num_accepted >= d - 1``) and
  its verified subtree has a node at depth d (``verified_depth >= d``); it *accepts* depth d when
  ``num_accepted >= d``.
- "Tokens per target forward" = committed tokens / target forward passes (every cycle is one
  forward, including cycles that verify the root only); "tokens per draft round" = committed
  tokens of the cycles that drafted / number of cycles that drafted (``num_draft_levels > 0``).
  They differ as soon as some steps do not speculate, so they are always labelled apart.
- Throughput = committed tokens / wall seconds (decode phase; prefill excluded unless the caller
  passes it in ``wall_s``).
- Hit rate = hits / (hits + misses) of expert-cache lookups, in [0, 1]; differences between two
  hit rates are reported in percentage *points*.
- Fidelity errors: signed percentage error = 100 * (predicted - measured) / measured; the
  summaries use its absolute value (median and 90th percentile, linear interpolation as in
  ``numpy.percentile``) and the coefficient of determination R^2 = 1 - SS_res / SS_tot.

All functions are pure numpy and raise ``ValueError`` naming the argument on bad input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

ArrayLike = Sequence[float] | np.ndarray


def _as_1d(name: str, values: ArrayLike, *, dtype: type = float, allow_empty: bool = False) -> np.ndarray:
    """Convert ``values`` to a finite 1-D array or raise ``ValueError`` naming ``name``."""
    arr = np.asarray(values, dtype=dtype)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if not allow_empty and arr.size == 0:
        raise ValueError(f"{name}: expected at least one value, got none")
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite values, found NaN or inf")
    return arr


def _non_negative_ints(name: str, values: ArrayLike) -> np.ndarray:
    arr = _as_1d(name, values, dtype=float)
    if np.any(arr < 0) or np.any(arr != np.round(arr)):
        raise ValueError(f"{name}: expected non-negative integers")
    return arr.astype(np.int64)


def tau(num_accepted: ArrayLike) -> float:
    """Mean tokens committed per cycle including the bonus token: mean(num_accepted + 1).

    Args:
        num_accepted: int[C], accepted draft tokens per cycle (bonus excluded), one per cycle.

    Returns:
        tau (tokens / cycle). ``tau([0, 2, 3]) == 8 / 3``.

    Raises:
        ValueError: empty input, negative or non-integer counts.

    Source: EAGLE (Li et al. 2024) "average acceptance length", which counts the bonus token.
    """
    acc = _non_negative_ints("num_accepted", num_accepted)
    return float(np.mean(acc + 1))


def tau_from_committed(num_committed: ArrayLike) -> float:
    """Mean committed tokens per cycle (already including the bonus): mean(num_committed).

    Use this form when cycles can be cut short by EOS or the length limit, where
    ``num_committed`` may be below ``num_accepted + 1``.

    Args:
        num_committed: int[C], tokens committed per cycle.

    Raises:
        ValueError: empty input, negative or non-integer counts.
    """
    com = _non_negative_ints("num_committed", num_committed)
    return float(np.mean(com))


def per_depth_acceptance(num_accepted: ArrayLike, reached_depth: ArrayLike) -> np.ndarray:
    """Conditional acceptance per depth: accepted(d) / reached(d) for d = 1..max(reached_depth).

    A cycle reached depth d when its accepted path got to depth d - 1 and verification tested a
    draft token at depth d below it (``reached_depth >= d``); it accepted d when ``num_accepted >= d``.

    Args:
        num_accepted: int[C], accepted draft tokens per cycle (bonus excluded).
        reached_depth: int[C], the depth each cycle's verification reached along its accepted
            path: ``num_accepted + 1`` when the last accepted node (the root if none) had a
            verified child, else ``num_accepted``. Policy-mode cycles record it (the ``cycles``
            column ``reached_depth``; read with ``traces.stats.cycle_reached_depths``), dense
            trees give it by ``traces.stats.reached_depths``. The deepest verified depth is a
            valid input only where the verified subtree is a chain (it counts a cycle as reaching
            depth d even when its accepted node there had no verified child, biasing alpha_d low).
            ``num_accepted <= reached_depth`` is required.

    Returns:
        float64[D] where entry ``d - 1`` is the acceptance at depth d; NaN where no cycle reached d.
        Example: accepted (0, 2, 3) with reached (1, 3, 3) -> [2/3, 2/2, 1/2]; with reached
        (1, 2, 3) -> [2/3, 2/2, 1/1] (the second cycle's path ended at a verified leaf).

    Raises:
        ValueError: mismatched lengths, negative counts, or num_accepted > reached_depth.

    Source: docs/metrics.md (``alpha(d)``), on greedy tree verification as in SpecInfer
    (Miao et al. 2024).
    """
    acc = _non_negative_ints("num_accepted", num_accepted)
    dep = _non_negative_ints("reached_depth", reached_depth)
    if acc.shape != dep.shape:
        raise ValueError(f"num_accepted and reached_depth: lengths differ ({acc.size} vs {dep.size})")
    if np.any(acc > dep):
        bad = int(np.argmax(acc > dep))
        raise ValueError(
            f"num_accepted: cycle {bad} accepted {acc[bad]} drafts but its reached depth is {dep[bad]}"
        )
    max_depth = int(dep.max()) if dep.size else 0
    out = np.full(max_depth, np.nan)
    for d in range(1, max_depth + 1):
        reached = (acc >= d - 1) & (dep >= d)
        n_reached = int(reached.sum())
        if n_reached:
            out[d - 1] = float((acc[reached] >= d).sum()) / n_reached
    return out


def tokens_per_target_forward(num_committed: ArrayLike, num_target_forwards: int | None = None) -> float:
    """Committed tokens per target forward pass.

    Args:
        num_committed: int[C], tokens committed per cycle.
        num_target_forwards: forwards of the target model; default C (one per cycle, the
            decode convention: the prefill forward is not counted).

    Raises:
        ValueError: bad counts or ``num_target_forwards <= 0``.
    """
    com = _non_negative_ints("num_committed", num_committed)
    forwards = com.size if num_target_forwards is None else int(num_target_forwards)
    if forwards <= 0:
        raise ValueError(f"num_target_forwards: expected > 0, got {forwards}")
    return float(com.sum()) / forwards


def tokens_per_draft_round(num_committed: ArrayLike, num_draft_levels: ArrayLike) -> float:
    """Committed tokens per cycle over the cycles that drafted (``num_draft_levels > 0``) only.

    Args:
        num_committed: int[C], tokens committed per cycle.
        num_draft_levels: int[C], draft levels run in each cycle (0 = no speculation).

    Returns:
        tokens / draft round; NaN when no cycle drafted.

    Raises:
        ValueError: mismatched lengths or bad counts.
    """
    com = _non_negative_ints("num_committed", num_committed)
    lev = _non_negative_ints("num_draft_levels", num_draft_levels)
    if com.shape != lev.shape:
        raise ValueError(f"num_committed and num_draft_levels: lengths differ ({com.size} vs {lev.size})")
    drafted = lev > 0
    if not drafted.any():
        return float("nan")
    return float(com[drafted].mean())


def throughput_tokens_per_s(num_committed_total: float, wall_s: float) -> float:
    """Committed tokens / wall seconds (docs/metrics.md, throughput).

    Args:
        num_committed_total: committed tokens (count, bonus tokens included).
        wall_s: wall-clock decode time (seconds).

    Returns:
        Throughput in tokens per second.

    Raises:
        ValueError: negative tokens or ``wall_s <= 0`` / not finite.
    """
    tokens = float(num_committed_total)
    wall = float(wall_s)
    if not np.isfinite(tokens) or tokens < 0:
        raise ValueError(f"num_committed_total: expected a count >= 0, got {num_committed_total!r}")
    if not np.isfinite(wall) or wall <= 0:
        raise ValueError(f"wall_s: expected seconds > 0, got {wall_s!r}")
    return tokens / wall


def hit_rate(hits: float, misses: float) -> float:
    """hits / (hits + misses) in [0, 1]; NaN when there were no lookups.

    Raises:
        ValueError: negative or non-finite counts.
    """
    h, m = float(hits), float(misses)
    if not (np.isfinite(h) and np.isfinite(m)) or h < 0 or m < 0:
        raise ValueError(f"hits/misses: expected counts >= 0, got {hits!r}/{misses!r}")
    total = h + m
    return h / total if total > 0 else float("nan")


def percentage_error(predicted: ArrayLike, measured: ArrayLike) -> np.ndarray:
    """Signed percentage error 100 * (predicted - measured) / measured, element-wise.

    Args:
        predicted, measured: float[n], same length; ``measured`` must be > 0.

    Returns:
        float64[n] in percent.

    Raises:
        ValueError: mismatched lengths, non-finite values or measured <= 0.
    """
    pred = _as_1d("predicted", predicted, allow_empty=True)
    meas = _as_1d("measured", measured, allow_empty=True)
    if pred.shape != meas.shape:
        raise ValueError(f"predicted and measured: lengths differ ({pred.size} vs {meas.size})")
    if np.any(meas <= 0):
        raise ValueError("measured: expected values > 0 for a percentage error")
    return 100.0 * (pred - meas) / meas


def r_squared(predicted: ArrayLike, measured: ArrayLike) -> float:
    """Coefficient of determination 1 - sum((m - p)^2) / sum((m - mean(m))^2) (the textbook
    R^2 of predictions against measurements; may be negative), checked: the form is
    :func:`calibration.lsq.r_squared`, which ``calibration.costfit.TermError`` reports too.

    Args:
        predicted, measured: float[n], same length (e.g. seconds).

    Returns:
        R^2 (dimensionless); NaN when ``measured`` is constant (R^2 undefined) or has fewer than 2
        values.

    Raises:
        ValueError: mismatched lengths or non-finite values.
    """
    pred = _as_1d("predicted", predicted, allow_empty=True)
    meas = _as_1d("measured", measured, allow_empty=True)
    if pred.shape != meas.shape:
        raise ValueError(f"predicted and measured: lengths differ ({pred.size} vs {meas.size})")
    from calibration.lsq import r_squared as r_squared_of

    return r_squared_of(pred, meas)


@dataclass(frozen=True)
class ErrorSummary:
    """Predicted-vs-measured summary: counts, |percentage error| median and p90 (percent), R^2."""

    num_samples: int
    median_abs_pct_error: float
    p90_abs_pct_error: float
    mean_pct_error: float
    r2: float

    def to_dict(self) -> dict[str, float | int]:
        """Plain dict for JSON output."""
        return asdict(self)


def error_summary(predicted: ArrayLike, measured: ArrayLike) -> ErrorSummary:
    """Summarise predicted vs measured: median / p90 of |percentage error|, mean signed error, R^2.

    Empty input gives NaN figures with ``num_samples = 0`` (a held-out set can be empty).

    Raises:
        ValueError: as :func:`percentage_error`.
    """
    pct = percentage_error(predicted, measured)
    if pct.size == 0:
        nan = float("nan")
        return ErrorSummary(0, nan, nan, nan, nan)
    abs_pct = np.abs(pct)
    return ErrorSummary(
        num_samples=int(pct.size),
        median_abs_pct_error=float(np.median(abs_pct)),
        p90_abs_pct_error=float(np.percentile(abs_pct, 90)),
        mean_pct_error=float(np.mean(pct)),
        r2=r_squared(predicted, measured),
    )


def hit_rate_difference_points(hit_rate_a: float, hit_rate_b: float) -> float:
    """(a - b) in percentage points, for hit rates given as fractions in [0, 1].

    Args:
        hit_rate_a, hit_rate_b: hit rates (fractions in [0, 1]).

    Returns:
        ``100 * (hit_rate_a - hit_rate_b)`` (percentage points).

    Raises:
        ValueError: a hit rate outside [0, 1] (named).
    """
    for name, v in (("hit_rate_a", hit_rate_a), ("hit_rate_b", hit_rate_b)):
        if not (0.0 <= float(v) <= 1.0):
            raise ValueError(f"{name}: expected a fraction in [0, 1], got {v!r}")
    return 100.0 * (float(hit_rate_a) - float(hit_rate_b))


def cycle_summary(cycles: object) -> dict[str, float]:
    """Decode metrics of one cycles table (pandas DataFrame with the CycleRecord columns).

    Uses ``num_accepted``, ``num_committed``, ``num_draft_levels``, ``cycle_s`` and, when
    present, ``cache_hits`` / ``cache_misses``. Wall seconds = sum of ``cycle_s``.

    Returns:
        dict with ``num_cycles``, ``num_committed``, ``tau``, ``tokens_per_target_forward``,
        ``tokens_per_draft_round``, ``wall_s``, ``tokens_per_s``, ``hit_rate``.

    Raises:
        ValueError: a required column is missing (named) or the table is empty.
    """
    required = ("num_accepted", "num_committed", "num_draft_levels", "cycle_s")
    missing = [c for c in required if c not in getattr(cycles, "columns", ())]
    if missing:
        raise ValueError(f"cycles: missing column(s) {missing}")
    df = cycles
    if len(df) == 0:
        raise ValueError("cycles: table is empty")
    committed = df["num_committed"].to_numpy()
    wall_s = float(df["cycle_s"].sum())
    out = {
        "num_cycles": int(len(df)),
        "num_committed": int(committed.sum()),
        "tau": tau_from_committed(committed),
        "tokens_per_target_forward": tokens_per_target_forward(committed),
        "tokens_per_draft_round": tokens_per_draft_round(committed, df["num_draft_levels"].to_numpy()),
        "wall_s": wall_s,
        "tokens_per_s": throughput_tokens_per_s(committed.sum(), wall_s) if wall_s > 0 else float("nan"),
        "hit_rate": float("nan"),
    }
    if "cache_hits" in df.columns and "cache_misses" in df.columns:
        out["hit_rate"] = hit_rate(df["cache_hits"].sum(), df["cache_misses"].sum())
    return out
