"""Non-negative (optionally robust) linear least squares used by every cost-model term fit.

Every term of :class:`specfit.cost.CycleCostModel` is linear in its parameters with non-negative
coefficients (seconds per level, per node, per context token, per transfer; seconds per byte),
so each term is fitted as ``y ~ A @ x`` with ``x >= 0``:

- default: bounded linear least squares, ``scipy.optimize.lsq_linear(..., bounds=(0, inf),
  method="bvls")`` (Stark & Parker's bounded-variable least squares, exact for this convex
  problem);
- ``robust=True``: ``scipy.optimize.least_squares`` with the ``soft_l1`` loss (a smooth Huber-like
  loss), same bounds, started from the BVLS solution, ``f_scale`` = 1.4826 x the median absolute
  residual of the previous fit (the MAD scale), repeated :data:`ROBUST_ROUNDS` times so the scale
  is not set by a start that the outliers dragged; a few cycles disturbed by the OS or the
  allocator then do not drag the fit.

Residuals are plain seconds (``relative=False``, the default of ``calibration.fit``; any finite
target, also 0 or negative, e.g. a measured time less the price of the other terms) or *relative*
(each row divided by its measured value; rows whose measured value is <= 0 cannot carry one and
must be filtered out by the caller). Throughput is a ratio of sums (committed tokens / summed cycle
seconds), so the cost model must be unbiased for the MEAN cycle time: ordinary least squares on
seconds is; relative least squares is biased low under right-skewed noise (measured on the shared
2-core CPU, where contention adds whole scheduler slices to some cycles: relative weighting left
simulated throughput 114-182 % above live, plain weighting within 1-5 %). Relative weighting makes
cycles of very different sizes weigh alike, which suits clean timings and per-cycle % errors. Columns are scaled to
unit max-norm before solving (times are ~1e-3, byte counts ~1e7) and the solution is scaled back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares, lsq_linear

MAD_TO_SIGMA = 1.4826  # consistency constant of the median absolute deviation for a normal law
ROBUST_ROUNDS = 3  # soft-L1 refits, each with the MAD scale of the previous fit's residuals


def r_squared(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Coefficient of determination ``1 - sum((m - p)^2) / sum((m - mean(m))^2)``: the textbook
    R^2 of predictions against measurements (may be negative). The one form that
    ``calibration.costfit.TermError`` and ``analysis.metrics.r_squared`` report.

    Args:
        predicted, measured: float[n] (e.g. seconds), row for row; not checked for finiteness.

    Returns:
        R^2 (dimensionless); NaN with fewer than 2 values or a constant ``measured``.

    Raises:
        ValueError: ``predicted`` and ``measured`` of different shapes (also a length-1
            ``predicted``, which numpy would broadcast), naming both.
    """
    pred = np.asarray(predicted, dtype=np.float64)
    meas = np.asarray(measured, dtype=np.float64)
    if pred.shape != meas.shape:
        raise ValueError(f"r_squared: predicted has shape {pred.shape}, measured {meas.shape}; expected the same")
    if meas.size < 2:
        return float("nan")
    ss_tot = float(np.sum((meas - meas.mean()) ** 2))
    if ss_tot == 0.0:
        return float("nan")
    return 1.0 - float(np.sum((meas - pred) ** 2)) / ss_tot


@dataclass(frozen=True)
class LinearFit:
    """Result of :func:`fit_non_negative`.

    Attributes:
        names: parameter names, one per column of the design matrix.
        coef: float64[P] fitted non-negative coefficients, in the units of ``y`` / column.
        num_rows: rows used.
        robust: whether the soft-L1 refinement ran.
    """

    names: tuple[str, ...]
    coef: np.ndarray
    num_rows: int
    robust: bool

    def as_dict(self) -> dict[str, float]:
        """``{name: coefficient}``."""
        return {n: float(c) for n, c in zip(self.names, self.coef)}


def fit_non_negative(
    design: np.ndarray,
    target: np.ndarray,
    names: tuple[str, ...],
    *,
    robust: bool = False,
    relative: bool = False,
) -> LinearFit:
    """Fit ``target ~ design @ x`` with ``x >= 0`` minimising relative (or plain) residuals.

    Plain residuals are weighted by one constant, ``1 / median(|target|)`` (1 when that median is
    0), which only conditions the problem: the minimiser is that of the unweighted sum of squares.

    Args:
        design: float64[n, P] design matrix (columns: the regressors of the term).
        target: float64[n] measured durations (seconds; > 0 with ``relative``, any finite value
            without).
        names: P parameter names (used in messages and the result).
        robust: refine with the soft-L1 loss (see module docstring).
        relative: divide each row by its measured value, or not (default).

    Returns:
        :class:`LinearFit`.

    Raises:
        ValueError: shape mismatch, non-finite values, a non-positive target with ``relative``,
            or fewer rows than parameters (names the parameters).
    """
    a = np.asarray(design, dtype=np.float64)
    y = np.asarray(target, dtype=np.float64)
    if a.ndim != 2 or y.ndim != 1 or a.shape[0] != y.shape[0] or a.shape[1] != len(names):
        raise ValueError(f"design {a.shape} / target {y.shape} / names {len(names)}: shapes do not match")
    if a.shape[0] < a.shape[1]:
        raise ValueError(f"fitting {list(names)}: need at least {a.shape[1]} rows, got {a.shape[0]}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(y))):
        raise ValueError(f"fitting {list(names)}: non-finite values in the data")
    if relative and np.any(y <= 0):
        raise ValueError(f"fitting {list(names)}: measured values must be > 0 for relative residuals")
    typical = float(np.median(np.abs(y)))  # = median(y) for positive targets
    weights = 1.0 / y if relative else np.full_like(y, 1.0 / typical if typical > 0 else 1.0)
    weighted = a * weights[:, None]
    rhs = y * weights
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = weighted / scale
    x0 = lsq_linear(scaled, rhs, bounds=(0.0, np.inf), method="bvls").x
    x = x0
    if robust:
        for _ in range(ROBUST_ROUNDS):  # re-estimate the scale from the latest, less contaminated fit
            resid = scaled @ x - rhs
            f_scale = max(MAD_TO_SIGMA * float(np.median(np.abs(resid))), 1e-9)
            x = least_squares(
                lambda v: scaled @ v - rhs,
                np.maximum(x, 0.0),
                jac=lambda v: scaled,
                bounds=(0.0, np.inf),
                loss="soft_l1",
                f_scale=f_scale,
            ).x
    coef = np.maximum(x / scale, 0.0)
    return LinearFit(names=tuple(names), coef=coef, num_rows=int(a.shape[0]), robust=robust)
