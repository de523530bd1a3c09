"""Non-negative (optionally robust) linear least squares used by every cost-model term fit.

Every term of :class:`specfit.cost.CycleCostModel` is linear in its parameters with non-negative
coefficients (seconds per level, per node, per context token, per transfer; seconds per byte),
so each term is fitted as ``y ~ A @ x`` with ``x >= 0``:

- default: bounded linear least squares, ``scipy.optimize.lsq_linear(..., bounds=(0, inf),
  method="bvls")`` (Stark & Parker's bounded-variable least squares, exact for this convex
  problem);
- ``robust=True``: ``scipy.optimize.least_squares`` with the ``soft_l1`` loss (a smooth Huber-like
  loss), same bounds, started from the BVLS solution, ``f_scale`` = 1.4826 x the median absolute
  residual of that start (the MAD scale), so a few cycles disturbed by the OS or the allocator do
  not drag the fit.

Residuals are *relative* (each row divided by its measured value) because the fidelity targets are
percentage errors (median and p90 of |predicted - measured| / measured); rows whose measured value
is 0 cannot carry a relative residual and must be filtered out by the caller. Columns are scaled to
unit max-norm before solving (times are ~1e-3, byte counts ~1e7) and the solution is scaled back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares, lsq_linear

MAD_TO_SIGMA = 1.4826  # consistency constant of the median absolute deviation for a normal law


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
    design: np.ndarray, target: np.ndarray, names: tuple[str, ...], *, robust: bool = False
) -> LinearFit:
    """Fit ``target ~ design @ x`` with ``x >= 0`` minimising relative residuals.

    Args:
        design: float64[n, P] design matrix (columns: the regressors of the term).
        target: float64[n] measured durations (> 0).
        names: P parameter names (used in messages and the result).
        robust: refine with the soft-L1 loss (see module docstring).

    Returns:
        :class:`LinearFit`.

    Raises:
        ValueError: shape mismatch, non-finite values, a non-positive target, or fewer rows than
            parameters (names the parameters).
    """
    a = np.asarray(design, dtype=np.float64)
    y = np.asarray(target, dtype=np.float64)
    if a.ndim != 2 or y.ndim != 1 or a.shape[0] != y.shape[0] or a.shape[1] != len(names):
        raise ValueError(f"design {a.shape} / target {y.shape} / names {len(names)}: shapes do not match")
    if a.shape[0] < a.shape[1]:
        raise ValueError(f"fitting {list(names)}: need at least {a.shape[1]} rows, got {a.shape[0]}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(y))):
        raise ValueError(f"fitting {list(names)}: non-finite values in the data")
    if np.any(y <= 0):
        raise ValueError(f"fitting {list(names)}: measured values must be > 0 for relative residuals")
    weighted = a / y[:, None]
    rhs = np.ones_like(y)
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = weighted / scale
    x0 = lsq_linear(scaled, rhs, bounds=(0.0, np.inf), method="bvls").x
    x = x0
    if robust:
        resid = scaled @ x0 - rhs
        f_scale = max(MAD_TO_SIGMA * float(np.median(np.abs(resid))), 1e-6)
        x = least_squares(
            lambda v: scaled @ v - rhs,
            np.maximum(x0, 0.0),
            jac=lambda v: scaled,
            bounds=(0.0, np.inf),
            loss="soft_l1",
            f_scale=f_scale,
        ).x
    coef = np.maximum(x / scale, 0.0)
    return LinearFit(names=tuple(names), coef=coef, num_rows=int(a.shape[0]), robust=robust)
