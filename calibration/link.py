"""Host-to-device link fit: bandwidth and per-copy latency from timed copies (:func:`fit_link`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibration.checks import CalibrationDataError
from calibration.lsq import fit_non_negative

SIZE_SPREAD_IDENTIFIABLE = 0.01  # relative spread of transfer sizes needed to separate latency and bandwidth


@dataclass(frozen=True)
class LinkFit:
    """A fitted host-to-device link: ``h2d_s = bytes / bytes_per_s + s_per_transfer`` per copy.

    Attributes:
        bytes_per_s: bandwidth (bytes/s; the *effective* one when not identifiable).
        s_per_transfer: per-copy latency (s).
        identifiable: whether copy sizes varied enough to separate the two.
        num_samples: copies (or per-layer groups) used.
        note: how the values were obtained.
    """

    bytes_per_s: float
    s_per_transfer: float
    identifiable: bool
    num_samples: int
    note: str


def fit_link(
    num_bytes: np.ndarray,
    num_copies: np.ndarray,
    seconds: np.ndarray,
    *,
    robust: bool = False,
    relative: bool = True,
    known_s_per_transfer: float | None = None,
    price_at_mean: bool = False,
) -> LinkFit:
    """Fit bandwidth and per-copy latency from timed copies (or groups of copies).

    Model: ``seconds = num_bytes / bytes_per_s + num_copies * s_per_transfer`` with both
    coefficients >= 0 (:func:`calibration.lsq.fit_non_negative`), on relative residuals by default
    because copy sizes span orders of magnitude (the latency is only visible on the small ones);
    :mod:`calibration.costfit` passes ``relative=False`` so the price is the MEAN copy time, which
    the cost model sums (a relative fit follows the fast mode of bimodal copy times).
    When bytes per copy vary by less
    than 1 % (relative range), only their sum per copy is identifiable: latency is then
    ``known_s_per_transfer`` (or 0) and the bandwidth absorbs the rest.

    ``price_at_mean``: after the fit, scale the fitted terms (both, or the bandwidth's alone when
    the latency is given) so that the samples' summed price equals their summed time: the MEAN
    pricing the cost model needs, kept under ``robust=True`` (whose soft-L1 loss follows the fast
    mode of bimodal copy times like a relative fit; it then sets only the bandwidth/latency split).
    Plain absolute least squares prices the mean by itself (factor 1) only when its residuals sum
    to 0: ``num_copies`` equal in every sample (the per-copy column is then an intercept) with the
    latency above its bound 0. Otherwise the factor can differ from 1 without any outlier: samples
    grouping unequal copy counts (per-layer cycle data: least squares weights the big groups),
    the latency at 0, the bandwidth-only fit of copies of (nearly) one size when the samples'
    bytes differ at all (a fit through the origin), or relative residuals. ``note`` gives the
    factor and those reasons when it differs from 1 by 0.1 % or more.

    Args:
        num_bytes, num_copies, seconds: float[n] per sample (one copy: ``num_copies = 1``).

    Raises:
        CalibrationDataError: fewer than 2 samples with ``seconds > 0`` or no positive bandwidth.
    """
    b = np.asarray(num_bytes, dtype=np.float64)
    n = np.asarray(num_copies, dtype=np.float64)
    s = np.asarray(seconds, dtype=np.float64)
    keep = (s > 0) & (n > 0) & (b > 0)
    b, n, s = b[keep], n[keep], s[keep]
    if s.size < 2:
        raise CalibrationDataError(
            f"h2d: need >= 2 timed transfers to fit bandwidth (field 'h2d_s'), got {s.size}; "
            "record with a cache smaller than the experts per layer"
        )
    per_copy = b / n
    spread = float((per_copy.max() - per_copy.min()) / per_copy.mean())
    if spread >= SIZE_SPREAD_IDENTIFIABLE:
        fit = fit_non_negative(
            np.column_stack([b, n]), s, ("s_per_byte", "s_per_transfer"), robust=robust, relative=relative
        )
        s_per_byte, latency = (float(c) for c in fit.coef)
        if s_per_byte > 0:
            note = "bandwidth and latency fitted"
            if price_at_mean:
                factor = float(s.sum() / (b * s_per_byte + n * latency).sum())
                s_per_byte, latency = s_per_byte * factor, latency * factor
                why = ["the latency at its bound 0"] if latency <= 0 else []
                if np.ptp(n) > 0:
                    why.append("copy counts that differ between samples")
                note += _mean_note(factor, robust, relative, why)
            return LinkFit(1.0 / s_per_byte, latency, True, int(s.size), note)
    latency = float(known_s_per_transfer or 0.0)
    note = (
        f"copy sizes do not vary (relative range {spread:.3g}); latency {latency:.3g} s "
        + ("given" if known_s_per_transfer is not None else "assumed 0")
        + ", bandwidth is the effective bandwidth"
    )
    rest = s - n * latency
    if np.any(rest <= 0):
        raise CalibrationDataError(
            f"h2d: the given per-transfer latency {latency} s exceeds measured copy times (field 'h2d_s')"
        )
    fit = fit_non_negative(b[:, None], rest, ("s_per_byte",), robust=robust, relative=relative)
    s_per_byte = float(fit.coef[0])
    if s_per_byte <= 0:
        raise CalibrationDataError("h2d: could not fit a positive bandwidth from field 'h2d_s'")
    if price_at_mean:
        factor = float(rest.sum() / (b * s_per_byte).sum())
        s_per_byte *= factor
        why = ["sample bytes that differ, fitted through the origin"] if np.ptp(b) > 0 else []
        note += _mean_note(factor, robust, relative, why)
    return LinkFit(1.0 / s_per_byte, latency, False, int(s.size), note)


def _mean_note(factor: float, robust: bool, relative: bool, why: list[str]) -> str:
    """The note :func:`fit_link` adds when ``price_at_mean`` scaled the fit by ``factor``: the
    factor and what, in this fit, keeps least squares from pricing the mean by itself (the robust
    loss, relative residuals, then ``why``: the fit's own reasons)."""
    if abs(factor - 1.0) < 1e-3:
        return ""
    reasons = ["robust loss"] * robust + ["relative residuals"] * relative + why
    return f"; scaled x{factor:.3f} to price the copies at their mean time ({', '.join(reasons) or 'rounding'})"
