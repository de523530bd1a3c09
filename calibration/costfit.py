"""Fit :class:`specfit.cost.CycleCostModel` from recorded cycles and transfers (pandas tables).

Each term of the cost formula (DESIGN.md) is fitted on its own measured duration with
non-negative least squares (:mod:`calibration.lsq`; residuals in seconds by default, relative with
``weighting="relative"``; the link fit always absolute, see below):

=============  ===========================================  ==========================================
term           model                                        data
=============  ===========================================  ==========================================
H2D transfer   ``h2d_s = bytes / h2d_bytes_per_s            ``transfers`` rows (one tensor copy each,
               + h2d_s_per_transfer``                       latency / copies per expert); when
                                                            that table is empty, per-layer cycle data
                                                            ``layer_h2d_s ~ layer_h2d_bytes, layer_misses``
verify         ``T_verify = verify_base_s                   the verify target (below) vs
               + verify_s_per_node * N                      ``num_nodes_verified``, ``context_len``
               + verify_s_per_context_token * ctx``
draft          ``draft_s = draft_base_s                     cycles with ``num_draft_levels > 0``
               + draft_s_per_level * levels``               (base 0 when one depth only)
=============  ===========================================  ==========================================

Verify target: the live engine's ``cycle_s`` is the wall time of the whole cycle (draft +
planner decision + verify + KV bookkeeping). The planner's own ``decision_s`` is measured and
reported separately, so the cost model predicts the *model cycle* ``cycle_s - decision_s``
(``decision_s`` null = 0). With ``verify_target="residual"`` (default, no overlap) the verify term is
fitted on ``model cycle - draft_s - h2d_s``, i.e. the target forward plus per-cycle bookkeeping, so
whole cycles are predicted without a bias; ``"verify_s"`` fits the recorded forward time only
(and is always used with ``overlap_h2d``, where the residual is not separable). The report states
the bookkeeping share (median of ``(residual - verify_s) / model cycle``).

Identifiability: when every transfer has the same size (one expert per copy, the usual case),
bandwidth and per-transfer latency cannot be told apart from these data; then the per-transfer
latency is taken from ``known_s_per_transfer`` (e.g. a ``calibration.h2d`` microbenchmark) or set
to 0, the bandwidth becomes the *effective* bandwidth ``bytes / (h2d_s - latency)``, and the
report says so (``h2d_identifiable: false``). Predictions at the recorded expert size are exact
either way; only ``with_bandwidth`` what-ifs depend on the split.

Link price: the cost model SUMS copy times (per miss, per cycle), so the per-copy price must be
the MEAN copy time. Copies of one size are often bimodal (emulated links are memcpy-bound: at 8 GB/s
on the embedded default most copies take ~14-18 us and a tail 30-55 us), and a relative-error fit
follows the fast mode: on ``runs/val-lead-final`` it priced the 8 GB/s copies 7.7 % below their mean
(ratio of summed price to summed copy time 0.923; 1 GB/s: 1.002). The link is therefore always fitted
on absolute residuals (seconds): ordinary least squares on single copies (the transfers table; its
per-copy column is an intercept) prices the mean exactly when the latency is not at its bound 0;
per-layer cycle data (no transfers table) groups unequal miss counts and need not. ``robust=True`` applies its soft-L1 loss to the link
too, which alone would lean to the fast mode again (0.86-0.87 of the timed copies on
``runs/val-lead-final``); the fit is then scaled so the copies' summed price equals their summed time
(``fit_link(..., price_at_mean=True)``, always passed here): the robust loss sets only the
bandwidth/latency split, the mean pricing holds with or without it.

Held-out evaluation: cycles are split by a seeded permutation (``numpy.random.default_rng(seed)``)
into fit and held-out sets; transfers follow their cycle (same ``run``, ``request_id``,
``cycle_index``). Errors per term and for whole cycles are reported on both sets as
:class:`analysis.metrics`-style summaries (median / p90 |% error|, R^2) computed here with the same
definitions (calibration may not import analysis; analysis imports calibration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from calibration.checks import (
    TRANSFER_COLUMNS,
    CalibrationDataError,
    validate_cycles,
    validate_transfers,
)
from calibration.link import LinkFit, fit_link
from calibration.lsq import fit_non_negative, r_squared
from specfit.cost import CycleCostModel
from specfit.prefetch import (
    PREFETCH_COUNT_COLUMNS,
    NextLayerShare,
    next_layer_share,
    next_layer_share_by_nodes,
)

VERIFY_TARGETS = ("residual", "verify_s")
WEIGHTINGS = ("relative", "absolute")


@dataclass(frozen=True)
class FitOptions:
    """Options of :func:`fit_cost_model`.

    Attributes:
        holdout_fraction: share of cycles held out for evaluation, in [0, 0.9].
        seed: seed of the fit / held-out permutation.
        robust: use the soft-L1 loss (see :mod:`calibration.lsq`).
        min_cycles: fewest cycles accepted (all runs together).
        overlap_h2d: value written into the fitted model (H2D overlapped with compute).
        known_s_per_transfer: per-transfer latency (s) used when sizes do not identify it.
        verify_target: ``"residual"`` or ``"verify_s"`` (see the module docstring).
        weighting: ``"relative"`` or ``"absolute"`` residuals (see :mod:`calibration.lsq`).
        miss_compute: also fit, with the verify term, a non-negative compute cost per cache miss
            (``verify target ~ base + nodes + context + misses``) and move it into
            ``h2d_s_per_transfer`` (without ``overlap_h2d`` the formula charges every miss that
            term, so whole cycles are predicted the same; the verify term then excludes it).
            Per-miss costs outside the timed copies (e.g. the live engine computing transient
            experts, CPU caches evicted by emulated copies) otherwise bias the verify term by
            the cache size. Ignored with ``overlap_h2d``.
    """

    holdout_fraction: float = 0.25
    seed: int = 0
    robust: bool = False
    min_cycles: int = 16
    overlap_h2d: bool = False
    known_s_per_transfer: float | None = None
    verify_target: str = "residual"
    weighting: str = "absolute"
    miss_compute: bool = False

    def lsq_kwargs(self) -> dict[str, bool]:
        """Keyword arguments of :func:`calibration.lsq.fit_non_negative` for these options."""
        return {"robust": self.robust, "relative": self.weighting == "relative"}

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting: expected one of {list(WEIGHTINGS)}, got {self.weighting!r}")
        if self.verify_target not in VERIFY_TARGETS:
            raise ValueError(
                f"verify_target: expected one of {list(VERIFY_TARGETS)}, got {self.verify_target!r}"
            )
        if not 0.0 <= self.holdout_fraction <= 0.9:
            raise ValueError(
                f"holdout_fraction: expected a fraction in [0, 0.9], got {self.holdout_fraction}"
            )
        if self.min_cycles < 4:
            raise ValueError(
                f"min_cycles: expected >= 4 (cycles per fitted parameter), got {self.min_cycles}"
            )
        if self.known_s_per_transfer is not None and not (self.known_s_per_transfer >= 0):
            raise ValueError(f"known_s_per_transfer: expected seconds >= 0, got {self.known_s_per_transfer}")


@dataclass(frozen=True)
class TermError:
    """|% error| summary of one term on one split: samples, median, p90 (percent), R^2."""

    num_samples: int
    median_abs_pct_error: float
    p90_abs_pct_error: float
    r2: float

    @classmethod
    def of(cls, predicted: np.ndarray, measured: np.ndarray) -> TermError:
        """Summary over rows with measured > 0 (a 0 s duration has no percentage error).

        Args:
            predicted, measured: float64[n] durations (seconds), row for row.

        Returns:
            :class:`TermError`: kept rows, median and p90 of ``|% error|``, R^2 (NaN with fewer
            than 2 rows or a constant measurement; :func:`calibration.lsq.r_squared`).

        Raises:
            IndexError: ``predicted`` and ``measured`` of different lengths.
        """
        pred = np.asarray(predicted, dtype=np.float64)
        meas = np.asarray(measured, dtype=np.float64)
        keep = meas > 0
        pred, meas = pred[keep], meas[keep]
        if meas.size == 0:
            return cls(0, float("nan"), float("nan"), float("nan"))
        ape = 100.0 * np.abs(pred - meas) / meas
        return cls(int(meas.size), float(np.median(ape)), float(np.percentile(ape, 90)), r_squared(pred, meas))


@dataclass(frozen=True)
class CostFit:
    """Outcome of :func:`fit_cost_model`.

    Attributes:
        model: the fitted :class:`CycleCostModel`.
        errors: ``{term: {"fit": TermError, "heldout": TermError}}`` for terms ``draft``,
            ``verify``, ``h2d_transfer``, ``h2d_cycle`` and ``cycle``.
        h2d_identifiable: whether transfer sizes varied enough to separate latency and bandwidth.
        num_cycles_fit, num_cycles_heldout, num_transfers_fit: split sizes.
        notes: human-readable remarks (fallbacks taken).
        bookkeeping_share: median over cycles of ``(model cycle - draft - h2d - verify_s) / model cycle``.
        h2d_link_s_per_transfer, h2d_host_s_per_transfer: the two parts of the model's
            ``h2d_s_per_transfer`` (link latency per expert; host placing time, 0 without a
            transfers table); ``compute_s_per_miss`` the third part with ``miss_compute``.
        draft_base_note: why ``model.draft_base_s`` is 0, in words (``""`` when it was fitted > 0).
        heldout_mask: bool[C] held-out cycles, in the order of the input table.
    """

    model: CycleCostModel
    errors: dict[str, dict[str, TermError]]
    h2d_identifiable: bool
    num_cycles_fit: int
    num_cycles_heldout: int
    num_transfers_fit: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    bookkeeping_share: float = float("nan")
    heldout_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    h2d_link_s_per_transfer: float = float("nan")
    h2d_host_s_per_transfer: float = 0.0
    compute_s_per_miss: float = 0.0
    draft_base_note: str = ""

    def term_split(self) -> dict[str, float]:
        """The non-link parts of ``model.h2d_s_per_transfer``, as keyword arguments of
        :func:`evaluate` (``compute_s_per_miss``, ``host_s_per_transfer``)."""
        return {
            "compute_s_per_miss": self.compute_s_per_miss,
            "host_s_per_transfer": self.h2d_host_s_per_transfer,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able report."""
        return {
            "cost": self.model.to_dict(),
            "errors": {t: {s: vars(e) for s, e in d.items()} for t, d in self.errors.items()},
            "h2d_identifiable": self.h2d_identifiable,
            "num_cycles_fit": self.num_cycles_fit,
            "num_cycles_heldout": self.num_cycles_heldout,
            "num_transfers_fit": self.num_transfers_fit,
            "bookkeeping_share": self.bookkeeping_share,
            "h2d_link_s_per_transfer": self.h2d_link_s_per_transfer,
            "h2d_host_s_per_transfer": self.h2d_host_s_per_transfer,
            "compute_s_per_miss": self.compute_s_per_miss,
            "draft_base_note": self.draft_base_note,
            "notes": list(self.notes),
        }


def split_cycles(
    num_cycles: int, holdout_fraction: float, seed: int, groups: Sequence[Any] | None = None
) -> np.ndarray:
    """Boolean mask of held-out cycles: ``round(fraction * n)`` of them, chosen by a seeded permutation.

    With ``groups`` (one label per cycle), whole groups are held out instead: ``round(fraction *
    number of groups)`` of them, so the copies of one cycle (its repeats, e.g. ``analysis.validate
    --repeats``) never sit on both sides. Groups are numbered in order of first appearance, so
    distinct labels give the same mask as no labels.

    Args:
        num_cycles: rows ``n`` (count).
        holdout_fraction: share held out (fraction in [0, 1]).
        seed: seed of the permutation (``numpy.random.default_rng``).
        groups: None, or one label per cycle.

    Returns:
        bool[num_cycles], True = held out.
    """
    if groups is None:
        codes, num_groups = np.arange(num_cycles), num_cycles
    else:
        codes, uniques = pd.factorize(pd.Series(list(groups)), sort=False)
        num_groups = len(uniques)
    rng = np.random.default_rng(seed)
    held_groups = np.zeros(num_groups, dtype=bool)
    num_out = int(round(holdout_fraction * num_groups))
    held_groups[rng.permutation(num_groups)[:num_out]] = True
    return held_groups[codes]


def cycle_identity(cycles: pd.DataFrame) -> list[tuple[str, ...]] | None:
    """One label per cycle naming the decision it repeats: ``(policy, request_id, cycle_index)``
    (the columns present; ``None`` without ``request_id``/``cycle_index``). Repeats of a run share
    labels; so do runs of the same policy at other cache sizes (a coarser split, still honest)."""
    keys = [c for c in ("policy", "request_id", "cycle_index") if c in cycles.columns]
    if not {"request_id", "cycle_index"} <= set(keys):
        return None
    return list(zip(*(cycles[k].astype(str) for k in keys)))


def _stack(column: pd.Series) -> np.ndarray:
    return np.stack([np.asarray(v, dtype=np.float64) for v in column]) if len(column) else np.zeros((0, 0))


def _cycle_keys(df: pd.DataFrame) -> pd.MultiIndex:
    run = df["run"] if "run" in df.columns else pd.Series([""] * len(df), index=df.index)
    return pd.MultiIndex.from_arrays(
        [run.astype(str), df["request_id"].astype(int), df["cycle_index"].astype(int)]
    )


def copies_per_transfer(transfers: pd.DataFrame) -> int:
    """Tensor copies per expert transfer in a ``transfers`` table (1 without ``layer``/``expert``).

    The live engine writes one row per tensor copy (an expert's gate/up and down matrices: 2
    rows of different sizes, consecutive, same ``layer`` and ``expert``); the cost model's
    ``h2d_s_per_transfer`` is per expert, i.e. this count times the per-copy latency. Computed
    as rows / runs of consecutive rows sharing (run, request, cycle, layer, expert), rounded.
    """
    if not len(transfers) or not {"layer", "expert"} <= set(transfers.columns):
        return 1
    keys = [c for c in ("run", "request_id", "cycle_index", "layer", "expert") if c in transfers.columns]
    frame = transfers[keys].reset_index(drop=True)
    changed = (frame.iloc[1:].to_numpy() != frame.iloc[:-1].to_numpy()).any(axis=1)
    runs = 1 + int(np.count_nonzero(changed))
    return max(1, int(round(len(frame) / runs)))


@dataclass(frozen=True)
class PlacingAfterEnqueue:
    """The compute stream's placing after a copy-stream batch's enqueue, per expert transfer.

    Attributes:
        s_per_transfer: the fitted seconds per transfer (s, >= 0; 0 with no measured batch).
        num_batches: copy-stream batches with measured memcpy ends (count).
        num_transfers: expert transfers in them (count).
        r_squared: R^2 of the batches' placing against ``s_per_transfer`` times their transfers
            (NaN with fewer than 2 batches; low when a few descheduled batches dominate the variance).
        notes: what the fit's reader must know (batches whose memcpys end before their enqueue:
            the clocks are out of step, and when most are, the fit is not meaningful).
    """

    s_per_transfer: float
    num_batches: int
    num_transfers: int
    r_squared: float
    notes: tuple[str, ...] = ()

    @classmethod
    def none(cls) -> PlacingAfterEnqueue:
        """No measured batch: 0 s per transfer, no batches or transfers, R^2 NaN (the model before
        the term; traces without ``placed_at_s``)."""
        return cls(0.0, 0, 0, float("nan"))

    def report_fields(self) -> dict[str, Any]:
        """JSON-ready: ``placing_after_enqueue_measured_s_per_transfer`` (s, the fitted value as
        measured; a cost model may clip it, :meth:`OverlapFit.report_fields`),
        ``placing_after_enqueue_batches``, ``placing_after_enqueue_transfers``,
        ``placing_after_enqueue_r_squared``."""
        return {
            "placing_after_enqueue_measured_s_per_transfer": self.s_per_transfer,
            "placing_after_enqueue_batches": self.num_batches,
            "placing_after_enqueue_transfers": self.num_transfers,
            "placing_after_enqueue_r_squared": self.r_squared,
        }


def fit_placing_after_enqueue(transfers: pd.DataFrame) -> PlacingAfterEnqueue:
    """Fit the placing a copy-stream batch spends on the compute stream AFTER its enqueue, per
    expert transfer, from the transfers table's memcpy ends (``placed_at_s``).

    The live CPU copy stream (``live.h2d.H2DLink.enqueue``) enqueues a layer's batch, then does its
    memcpys on the compute thread while the link clock already runs; each copy's memcpy end is
    recorded (``transfers.placed_at_s``), so a batch's placing after the enqueue is ``y_b = max
    placed_at_s - enqueued_at_s`` over its rows. A batch is the rows of one (run, request, cycle,
    layer, enqueue instant); it moves ``n_b = rows / copies_per_transfer`` experts. The memcpys of a
    batch are back to back, so ``y_b = p n_b`` for the per-transfer placing ``p``, estimated as the
    median over batches of ``y_b / n_b`` (clipped at 0): robust to a batch whose thread was
    descheduled mid-memcpy, which is machine load, not placing work (``analysis.validate
    --repeats 1 --overlap on --bandwidth 1,8`` at load 7 on 2 cores: median 21.6 us per transfer,
    p90 34.7 us, but single batches up to 18.7 ms, and least squares through the origin gave
    97 us). This is ``CycleCostModel.placing_after_enqueue_s_per_transfer`` and
    ``sim.engine.CyclePlan.placing_ns_per_transfer``.

    Rows without ``placed_at_s`` (null or NaN: synchronous copies, CUDA, traces recorded before
    the column existed) are left out; with none left the fit is 0 (the model before issue 13's
    item 3: the whole placing precedes the enqueue). A batch whose last memcpy ends before its
    enqueue (``y_b < 0``) cannot happen on one clock: the fit's ``notes`` name how many there
    are, and when the median is negative (clipped to 0, its R^2 that of a zero prediction) say
    that the fit is not meaningful (rev3's finding).

    Args:
        transfers: the runs' transfers table (``request_id``, ``cycle_index``, ``layer``,
            ``expert``, ``enqueued_at_s``, ``placed_at_s``; optional ``run``).

    Returns:
        :class:`PlacingAfterEnqueue`.
    """
    needed = {"enqueued_at_s", "placed_at_s", "layer"}
    if not len(transfers) or not needed <= set(transfers.columns):
        return PlacingAfterEnqueue.none()
    frame = transfers.reset_index(drop=True)
    placed = pd.to_numeric(frame["placed_at_s"], errors="coerce").to_numpy(dtype=np.float64)
    enqueued = pd.to_numeric(frame["enqueued_at_s"], errors="coerce").to_numpy(dtype=np.float64)
    ok = np.isfinite(placed) & np.isfinite(enqueued)
    if not ok.any():
        return PlacingAfterEnqueue.none()
    copies = copies_per_transfer(frame)
    keys = [c for c in ("run", "request_id", "cycle_index", "layer") if c in frame.columns]
    rows = frame.loc[ok, keys].assign(enqueued=enqueued[ok], placed=placed[ok])
    batches = rows.groupby([*keys, "enqueued"], sort=False).agg(last=("placed", "max"), size=("placed", "size"))
    if not len(batches):  # every row's batch key null (groupby drops null keys): nothing to fit
        return PlacingAfterEnqueue.none()
    y = batches["last"].to_numpy(dtype=np.float64) - batches.index.get_level_values("enqueued").to_numpy(dtype=np.float64)
    n = batches["size"].to_numpy(dtype=np.float64) / max(copies, 1)
    median_s = float(np.median(y / n))
    p = max(median_s, 0.0)
    r2 = r_squared(p * n, y)
    notes = []
    if (num_before := int(np.count_nonzero(y < 0.0))) > 0:
        notes.append(
            f"placing after the enqueue: {num_before} of {y.size} copy-stream batches end their memcpys before "
            "their enqueue, which one clock cannot give (the memcpy and enqueue clocks are out of step)"
            + (
                f"; the median, {median_s * 1e6:.3g} us per transfer, is clipped to 0, so the fit "
                f"(P = 0, R^2 {r2:.3g}) is not meaningful"
                if median_s < 0.0
                else "; they are in the median"
            )
        )
    return PlacingAfterEnqueue(p, int(y.size), int(round(n.sum())), float(r2), tuple(notes))


def _capped_placing_after_enqueue(
    placing_s: float, per_miss_s: float, per_miss_text: str, notes: list[str], prefix: str = ""
) -> float:
    """The placing after the enqueue a model prices: the measured ``placing_s`` (s per transfer),
    at most the per-miss term ``per_miss_s`` (s) it is part of (``specfit.cost``: the compute
    stream's placing + memcpy per miss, of which the part after the enqueue is a share); when it is
    clipped, a note naming both (``prefix``, then the term described by ``per_miss_text``) is
    appended to ``notes``. Used by :func:`fit_cost_model` and :func:`fit_overlap_terms`; raises nothing."""
    if placing_s <= per_miss_s:
        return placing_s
    notes.append(
        f"{prefix}placing after the enqueue: {placing_s * 1e6:.3g} us per transfer exceeds the per-miss "
        f"term it is part of ({per_miss_s * 1e6:.3g} us, {per_miss_text}): clipped to it"
    )
    return per_miss_s


def host_s_per_transfer(cycles: pd.DataFrame, transfers: pd.DataFrame, copies: int) -> float:
    """Host seconds per expert transfer recorded in the cycles' ``h2d_s`` beyond their timed copies.

    The live engine's ``h2d_s`` includes the host time spent placing missed experts into slots
    right before their copies (``live.offload.ForwardStats``); the ``transfers`` rows time the
    copies alone. Ratio estimator over the cycles that have transfers:
    ``sum(h2d_s - sum of the cycle's copy seconds) / sum(expert transfers)``, clipped at 0
    (0 when nothing matches, e.g. traces whose ``h2d_s`` is the copies' sum).
    """
    if not len(transfers) or not len(cycles):
        return 0.0
    names = ["run", "request_id", "cycle_index"]
    copy_s = pd.Series(
        transfers["h2d_s"].to_numpy(dtype=np.float64),
        index=_cycle_keys(transfers.reset_index(drop=True)).set_names(names),
    )
    per_cycle = copy_s.groupby(level=names).agg(["sum", "size"])
    h2d = pd.Series(
        cycles["h2d_s"].to_numpy(dtype=np.float64),
        index=_cycle_keys(cycles.reset_index(drop=True)).set_names(names),
        name="h2d",
    )
    joined = per_cycle.join(h2d, how="inner")
    num_transfers = float(joined["size"].sum()) / max(copies, 1)
    if num_transfers <= 0:
        return 0.0
    extra_s = float((joined["h2d"] - joined["sum"]).sum())
    if extra_s <= 1e-9 * float(joined["h2d"].sum()):  # float rounding of equal sums
        return 0.0
    return extra_s / num_transfers


def _fit_h2d(
    cycles: pd.DataFrame, transfers: pd.DataFrame, opts: FitOptions, notes: list[str]
) -> tuple[LinkFit, float]:
    """Link fit from the transfers table, or from per-layer cycle data when it is empty.

    From the transfers table, bandwidth and per-copy latency are fitted on the rows (copies of
    different sizes identify both) and the per-*expert* latency is the per-copy latency times
    :func:`copies_per_transfer`; the host placing time per transfer
    (:func:`host_s_per_transfer`) is returned beside it (the model's ``h2d_s_per_transfer`` is
    their sum). Returns ``(link, host seconds per transfer)``."""
    if len(transfers):
        b = transfers["bytes"].to_numpy(dtype=np.float64)
        copies = copies_per_transfer(transfers)
        known = opts.known_s_per_transfer
        link = fit_link(
            b,
            np.ones_like(b),
            transfers["h2d_s"].to_numpy(dtype=np.float64),
            robust=opts.robust,
            relative=False,
            known_s_per_transfer=None if known is None else known / copies,
            price_at_mean=True,
        )
        if copies > 1:
            link = replace(
                link,
                s_per_transfer=link.s_per_transfer * copies,
                note=f"{link.note}; {copies} copies per expert transfer (latency x {copies})",
            )
        source = "transfers"
        host_s = host_s_per_transfer(cycles, transfers, copies)
        notes.append(
            f"h2d per transfer = link latency {link.s_per_transfer * 1e6:.3g} us + host placing "
            f"{host_s * 1e6:.3g} us (cycles' h2d_s beyond their timed copies)"
        )
    else:
        host_s = 0.0
        b = _stack(cycles["layer_h2d_bytes"]).ravel()
        n = _stack(cycles["layer_misses"]).ravel()
        s = _stack(cycles["layer_h2d_s"]).ravel()
        link = fit_link(
            b,
            n,
            s,
            robust=opts.robust,
            relative=False,
            known_s_per_transfer=opts.known_s_per_transfer,
            price_at_mean=True,
        )
        source = "per-layer cycle data (no transfers table)"
    notes.append(f"h2d from {source}: {link.note}")
    return link, host_s


def model_cycle_s(cycles: pd.DataFrame) -> np.ndarray:
    """float64[C] measured cycle time without the planner's decision: ``cycle_s - decision_s`` (null = 0)."""
    cycle = cycles["cycle_s"].to_numpy(dtype=np.float64)
    if "decision_s" not in cycles.columns:
        return cycle
    decision = pd.to_numeric(cycles["decision_s"], errors="coerce").fillna(0.0).to_numpy(dtype=np.float64)
    return np.maximum(cycle - decision, 0.0)


def verify_target_s(cycles: pd.DataFrame, target: str, overlap_h2d: bool) -> np.ndarray:
    """float64[C] the durations the verify term is fitted on (seconds; see the module docstring).

    Args:
        cycles: C rows of the cycles table.
        target: ``"residual"`` (``cycle_s - decision_s - draft_s - h2d_s``) or ``"verify_s"``
            (the recorded forward time), :data:`VERIFY_TARGETS`.
        overlap_h2d: the runs overlapped copies with compute (``verify_s`` is then used).
    """
    if target == "verify_s" or overlap_h2d:
        return cycles["verify_s"].to_numpy(dtype=np.float64)
    rest = model_cycle_s(cycles) - cycles["draft_s"].to_numpy(dtype=np.float64)
    return rest - cycles["h2d_s"].to_numpy(dtype=np.float64)


def _fit_verify(cycles: pd.DataFrame, opts: FitOptions) -> tuple[float, float, float, float]:
    """``(verify_base_s, verify_s_per_node, verify_s_per_context_token, compute s per miss)``;
    the last is 0 unless ``opts.miss_compute`` (and not ``overlap_h2d``)."""
    y = verify_target_s(cycles, opts.verify_target, opts.overlap_h2d)
    keep = y > 0
    if keep.sum() < 3:
        raise CalibrationDataError(
            f"verify: need >= 3 cycles with a positive verify time (fields 'verify_s' / 'cycle_s'), got {int(keep.sum())}"
        )
    n = cycles["num_nodes_verified"].to_numpy(dtype=np.float64)
    sizes = np.unique(n[keep])
    if sizes.size < 2:
        raise CalibrationDataError(
            f"verify: every cycle verified {int(sizes[0])} node(s) (field 'num_nodes_verified'), so "
            "the fixed and per-node verify costs cannot be told apart; record cycles of different "
            "tree sizes, e.g. `live.record --mode policy --policy ar` and `--policy topn`"
        )
    ctx = cycles["context_len"].to_numpy(dtype=np.float64)
    columns = [np.ones_like(n), n, ctx]
    names = ["verify_base_s", "verify_s_per_node", "verify_s_per_context_token"]
    per_miss = opts.miss_compute and not opts.overlap_h2d
    if per_miss:
        columns.append(_stack(cycles["layer_misses"]).sum(axis=1))
        names.append("compute_s_per_miss")
    fit = fit_non_negative(np.column_stack(columns)[keep], y[keep], tuple(names), **opts.lsq_kwargs())
    coef = [float(c) for c in fit.coef]
    return coef[0], coef[1], coef[2], (coef[3] if per_miss else 0.0)


def _fit_draft(cycles: pd.DataFrame, opts: FitOptions, notes: list[str]) -> tuple[float, float, str]:
    """``(draft_base_s, draft_s_per_level, draft_base_note)`` from the cycles that drafted
    (``draft_s ~ base + per_level * levels``, non-negative least squares).

    The base is identifiable only when the drafting cycles drafted at least two different depths;
    otherwise it is 0 and the per-level cost carries the whole draft time (exact at that depth).
    ``draft_base_note`` says in words why the base is what it is whenever it is 0 (no drafting
    cycle; one depth only, naming it and what run to add; or two depths whose times show no fixed
    cost, the unconstrained intercept being negative), else ``""``; the note is also appended to
    ``notes``."""
    lev = cycles["num_draft_levels"].to_numpy(dtype=np.float64)
    y = cycles["draft_s"].to_numpy(dtype=np.float64)
    keep = (lev > 0) & (y > 0)
    if not keep.any():
        note = "no cycle drafted (autoregressive runs only): draft_base_s and draft_s_per_level set to 0"
        notes.append(f"draft: {note}")
        return 0.0, 0.0, note
    depths = np.unique(lev[keep])
    if depths.size < 2:
        note = (
            f"is not identifiable: every drafting cycle drafted {int(depths[0])} level(s), so a fixed cost per "
            "draft cannot be told apart from the per-level cost; set to 0 (the per-level cost carries the "
            "whole draft time, exact at this depth, wrong at others). Add a run with another draft depth, "
            f"e.g. `python -m live.record --mode policy --policy topn --depth {1 if depths[0] > 1 else 2}`"
        )
        notes.append(f"draft: draft_base_s {note}")
        fit = fit_non_negative(lev[keep, None], y[keep], ("draft_s_per_level",), **opts.lsq_kwargs())
        return 0.0, float(fit.coef[0]), note
    x = np.column_stack([np.ones(int(keep.sum())), lev[keep]])
    fit = fit_non_negative(x, y[keep], ("draft_base_s", "draft_s_per_level"), **opts.lsq_kwargs())
    base, per_level = float(fit.coef[0]), float(fit.coef[1])
    note = ""
    if base == 0.0:
        free = np.linalg.lstsq(x, y[keep], rcond=None)[0]
        shown = ", ".join(f"{int(d)}" for d in depths[:6]) + (", ..." if depths.size > 6 else "")
        note = (
            f"is fitted at its lower bound 0: the drafting cycles (depths {shown} levels) show no fixed cost "
            f"per draft; an unconstrained line through their draft times has intercept "
            f"{free[0] * 1e6:.4g} us (< 0), i.e. deeper drafts cost less per level than shallow ones "
            "(timing noise, or cycles whose drafts stopped early); the per-level cost carries the whole "
            "draft time"
        )
        notes.append(f"draft: draft_base_s {note}")
    return base, per_level, note


def predict_terms(
    model: CycleCostModel, cycles: pd.DataFrame, compute_s_per_miss: float = 0.0
) -> dict[str, np.ndarray]:
    """Per-cycle predictions of each term: ``draft``, ``verify``, ``h2d_cycle``, ``cycle`` (float64[C], s).

    ``compute_s_per_miss``: the share of ``model.h2d_s_per_transfer`` that is verify compute per
    miss (:attr:`CostFit.compute_s_per_miss`, fitted with ``miss_compute``); it is moved from the
    ``h2d_cycle`` prediction to the ``verify`` one so each term is compared with what it measures
    (the cycle prediction is unchanged).

    Args:
        model: the cost model.
        cycles: C rows of a cycles table (levels, verified nodes, context, per-layer misses).
        compute_s_per_miss: seconds per miss (see above).

    Returns:
        ``{term: float64[C]}`` (seconds).
    """
    out: dict[str, list[float]] = {"draft": [], "verify": [], "h2d_cycle": [], "cycle": []}
    for lev, n, ctx, misses in zip(
        cycles["num_draft_levels"],
        cycles["num_nodes_verified"],
        cycles["context_len"],
        cycles["layer_misses"],
    ):
        misses = np.asarray(misses, dtype=np.int64)
        miss_compute_s = compute_s_per_miss * float(misses.sum())
        out["draft"].append(model.draft_s(int(lev)))
        out["verify"].append(model.verify_s(int(n), int(ctx)) + miss_compute_s)
        out["h2d_cycle"].append(model.h2d_s(misses) - miss_compute_s)
        out["cycle"].append(model.cycle_s(int(lev), int(n), int(ctx), misses))
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def measured_terms(
    cycles: pd.DataFrame, verify_target: str = "residual", overlap_h2d: bool = False
) -> dict[str, np.ndarray]:
    """Measured counterpart of :func:`predict_terms` (seconds), keyed the same way.

    ``verify`` is the fitted verify target (:func:`verify_target_s` of ``verify_target`` and
    ``overlap_h2d``) and ``cycle`` the model cycle (``cycle_s - decision_s``).

    Args:
        cycles: C rows of the cycles table.

    Returns:
        ``{term: float64[C]}`` (seconds) for ``draft``, ``verify``, ``h2d_cycle``, ``cycle``.
    """
    return {
        "draft": cycles["draft_s"].to_numpy(dtype=np.float64),
        "verify": verify_target_s(cycles, verify_target, overlap_h2d),
        "h2d_cycle": cycles["h2d_s"].to_numpy(dtype=np.float64),
        "cycle": model_cycle_s(cycles),
    }


def evaluate(
    model: CycleCostModel,
    cycles: pd.DataFrame,
    transfers: pd.DataFrame,
    verify_target: str = "residual",
    *,
    compute_s_per_miss: float = 0.0,
    host_s_per_transfer: float = 0.0,
) -> dict[str, TermError]:
    """|% error| summary per term (and ``h2d_transfer`` per copy) of ``model`` on these rows.

    ``compute_s_per_miss`` and ``host_s_per_transfer`` are the parts of ``h2d_s_per_transfer``
    that are not link time (:class:`CostFit` fields): the per-copy ``h2d_transfer`` prediction
    leaves both out (a ``transfers`` row times one copy on the link), and ``compute_s_per_miss``
    is predicted in the verify term, not in ``h2d_cycle`` (see :func:`predict_terms`).

    Args:
        model: the cost model.
        cycles, transfers: the rows scored (cycles and transfers tables).
        verify_target: as :func:`verify_target_s`.
        compute_s_per_miss, host_s_per_transfer: seconds per miss / per copy (see above).

    Returns:
        ``{term: TermError}`` for ``draft``, ``verify``, ``h2d_cycle``, ``h2d_transfer``, ``cycle``.
    """
    pred = (
        predict_terms(model, cycles, compute_s_per_miss)
        if len(cycles)
        else {k: np.zeros(0) for k in ("draft", "verify", "h2d_cycle", "cycle")}
    )
    meas = (
        measured_terms(cycles, verify_target, model.overlap_h2d)
        if len(cycles)
        else {k: np.zeros(0) for k in pred}
    )
    errors = {k: TermError.of(pred[k], meas[k]) for k in pred}
    if len(transfers):
        b = transfers["bytes"].to_numpy(dtype=np.float64)
        link_s = max(model.h2d_s_per_transfer - compute_s_per_miss - host_s_per_transfer, 0.0)
        t_pred = b / model.h2d_bytes_per_s + link_s / copies_per_transfer(transfers)
        errors["h2d_transfer"] = TermError.of(t_pred, transfers["h2d_s"].to_numpy(dtype=np.float64))
    else:
        errors["h2d_transfer"] = TermError.of(np.zeros(0), np.zeros(0))
    return errors


def cycle_predictions(
    model: CycleCostModel,
    cycles: pd.DataFrame,
    heldout_mask: np.ndarray,
    verify_target: str = "residual",
    compute_s_per_miss: float = 0.0,
) -> pd.DataFrame:
    """One row per cycle: keys, split, and ``measured_<term>_s`` / ``predicted_<term>_s`` per term.

    Terms: ``draft``, ``verify``, ``h2d_cycle``, ``cycle`` (model cycle, see module docstring).

    Args:
        model: the fitted cost model.
        cycles: C rows of the cycles table.
        heldout_mask: bool[C] (:func:`split_cycles`), True = held out (``split`` = ``heldout``).
        verify_target, compute_s_per_miss: as :func:`measured_terms` / :func:`predict_terms`.

    Returns:
        DataFrame of C rows (seconds in the ``*_s`` columns).
    """
    keys = [
        c for c in ("run", "request_id", "cycle_index", "policy", "num_nodes_verified") if c in cycles.columns
    ]
    out = cycles[keys].reset_index(drop=True).copy()
    out["split"] = np.where(np.asarray(heldout_mask, dtype=bool), "heldout", "fit")
    pred = predict_terms(model, cycles, compute_s_per_miss)
    meas = measured_terms(cycles, verify_target, model.overlap_h2d)
    for term in pred:
        out[f"measured_{term}_s"] = meas[term]
        out[f"predicted_{term}_s"] = pred[term]
    return out


def fit_pre_router_fraction(cycles: pd.DataFrame, notes: list[str] | None = None) -> float:
    """``CycleCostModel.pre_router_fraction``: the share of a layer's compute spent before its router
    has chosen its experts (attention, norms, the router), from the cycles' ``layer_pre_router_s``
    (recorded live by ``live.offload``: decoder-layer start to the experts module's call) over
    their ``layer_compute_s``.

    The median over cycles of ``sum_l pre_router_l / sum_l compute_l`` (a median, as the other
    per-cycle fits here, so that a shared machine's slow spells do not move it), clipped to
    [0, 1]. Cycles without the column (traces recorded before it) or without compute are left
    out; with none left it is 0 (copies enqueued at the layer's start, the older model) and a
    note says so (appended to ``notes`` when given).

    Returns:
        The share (fraction in [0, 1]).
    """
    ratios = []
    if "layer_pre_router_s" in cycles.columns:
        for pre, compute in zip(cycles["layer_pre_router_s"], cycles["layer_compute_s"]):
            if pre is None or (np.ndim(pre) == 0 and pd.isna(pre)):
                continue
            total = float(np.sum(compute))
            if total > 0:
                ratios.append(float(np.sum(pre)) / total)
    if not ratios:
        if notes is not None:
            notes.append("pre_router_fraction set to 0: no cycle recorded layer_pre_router_s (record with a newer live.record)")
        return 0.0
    return float(np.clip(np.median(ratios), 0.0, 1.0))


@dataclass(frozen=True)
class NextLayerFit(NextLayerShare):
    """Outcome of :func:`fit_next_layer_terms`: the share :class:`specfit.prefetch.NextLayerShare`
    (``cover_fraction``, ``waste_per_miss`` and the summed counts) and

    Attributes:
        num_cycles: cycles with prefetch counts used (count).
        notes: remarks.
    """

    num_cycles: int = 0
    notes: tuple[str, ...] = ()


def fit_next_layer_terms(cycles: pd.DataFrame) -> NextLayerFit:
    """Next-layer prefetch's two cost terms from cycles recorded with it (``live.record --prefetch
    next-layer``), from their prefetch counts (``num_prefetch_used``, ``num_prefetch_wasted``,
    ``cache_misses``; ``specfit.prefetch.PrefetchLedger``).

    A used prefetch is a miss the planner, which prices the cache as it stands when it chooses,
    counted and the prefetch covered, so the planner's misses are ``M + U`` (``M`` the recorded
    demand misses, ``U`` the used prefetches) and

        next_layer_cover_fraction      = sum U / (sum M - sum M_0 + sum U)
        next_layer_waste_per_miss  = sum W / (sum M - sum M_0 + sum U)   (W: wasted, evicted unused)

    ratios of the runs' totals (:func:`specfit.prefetch.next_layer_share`, which ``sim.sweep``'s
    pilot replays use too), over layers 1..L-1: layer 0's demand misses (``layer_misses[0]``)
    are left out of ``sum M`` (no guess covers layer 0; the cost model prices it without). With a
    ``num_nodes_verified`` column the same ratios are also fitted per tree size
    (:func:`specfit.prefetch.next_layer_share_by_nodes`: knots over the verified nodes, which the
    cost model interpolates; one share under-prices big trees). Cycles without counts
    (null: recorded without prefetch accounting) are left out; with none left or no miss at all
    both terms are 0 and a note says so.

    Raises:
        CalibrationDataError: a negative count (the run and column named).
    """
    notes: list[str] = []
    columns = PREFETCH_COUNT_COLUMNS
    if not len(cycles) or any(c not in cycles.columns for c in columns):
        notes.append("next-layer prefetch terms set to 0: no cycle recorded prefetch counts")
        return NextLayerFit(0.0, 0.0, 0, 0, 0, num_cycles=0, notes=tuple(notes))
    table = cycles.dropna(subset=list(columns))
    for column in columns:
        bad = table[table[column].astype(np.int64) < 0]
        if len(bad):
            run = bad["run"].iloc[0] if "run" in bad.columns else "cycles"
            raise CalibrationDataError(f"{run}: column {column!r} has a negative count ({int(bad[column].iloc[0])})")
    first = None  # layer 0's demand misses: no guess covers them (specfit.prefetch.next_layer_share)
    if "layer_misses" in table.columns and len(table):
        first = _stack(table["layer_misses"])[:, 0].astype(np.int64)
    elif len(table):
        notes.append(
            "next-layer prefetch: no layer_misses column, so layer 0's misses (which no guess covers) "
            "stay in the denominator: the share is over every layer (as cost JSON versions 5-6) but is "
            "stored and priced as a share of layers 1..L-1 (version 7), i.e. slightly low"
        )
    if "num_nodes_verified" in table.columns and not table["num_nodes_verified"].isna().any():
        share = next_layer_share_by_nodes(
            table["num_nodes_verified"], *(table[c].astype(np.int64) for c in columns), first_layer_misses=first
        )
    else:
        share = next_layer_share(*(int(table[c].astype(np.int64).sum()) for c in columns), int(first.sum()) if first is not None else 0)
    misses, used, wasted = share.num_misses, share.num_used, share.num_wasted
    if misses + used == 0:
        notes.append(f"next-layer prefetch terms set to 0: {len(table)} cycle(s) with prefetch counts and no miss")
        return NextLayerFit(0.0, 0.0, misses, used, wasted, num_cycles=len(table), notes=tuple(notes))
    cover, waste = share.cover_fraction, share.waste_per_miss
    notes.append(
        f"next-layer prefetch: {cover:.3f} of the planner's misses covered, {waste:.3f} wasted copies per "
        f"miss ({used} used, {wasted} wasted, {misses} demand misses in {len(table)} cycles)"
        + (f"; {share.knots_text()}" if share.nodes else "")
    )
    return NextLayerFit(**vars(share), num_cycles=len(table), notes=tuple(notes))


def fit_cost_model(
    cycles: pd.DataFrame,
    transfers: pd.DataFrame | None,
    *,
    expert_bytes: int,
    num_layers: int,
    options: FitOptions | None = None,
    source: str = "calibration.fit",
) -> CostFit:
    """Fit every term of the cost model and evaluate it on fit and held-out cycles.

    Args:
        cycles: cycles table(s) (CycleRecord columns, optional ``run`` column), C rows.
        transfers: transfers table(s) or ``None`` / empty (then per-layer cycle data are used).
        expert_bytes: bytes of one expert (manifest ``model.bytes_per_expert``).
        num_layers: MoE layers L.
        options: :class:`FitOptions`.
        source: provenance string written in the model's ``source`` field.

    Returns:
        :class:`CostFit`.

    Raises:
        CalibrationDataError: too few cycles, bad values (run and field named), no H2D data.
    """
    opts = options or FitOptions()
    transfers = transfers if transfers is not None else pd.DataFrame(columns=list(TRANSFER_COLUMNS))
    validate_cycles(cycles, num_layers)
    if len(transfers):
        validate_transfers(transfers)
    if len(cycles) < opts.min_cycles:
        runs = sorted(set(cycles["run"])) if "run" in cycles.columns else []
        raise CalibrationDataError(
            f"{', '.join(map(str, runs)) or 'cycles'}: {len(cycles)} cycles recorded; "
            f"need >= {opts.min_cycles} (flag --min-cycles) to fit and hold out"
        )
    cycles = cycles.reset_index(drop=True)
    held = split_cycles(len(cycles), opts.holdout_fraction, opts.seed, cycle_identity(cycles))
    fit_cycles, held_cycles = cycles[~held], cycles[held]
    if len(transfers):
        held_keys = _cycle_keys(held_cycles)
        t_held = _cycle_keys(transfers.reset_index(drop=True)).isin(held_keys)
        transfers = transfers.reset_index(drop=True)
        fit_transfers, held_transfers = transfers[~t_held], transfers[t_held]
    else:
        fit_transfers = held_transfers = transfers
    notes: list[str] = []
    link, host_s = _fit_h2d(fit_cycles, fit_transfers, opts, notes)
    base, per_node, per_ctx, miss_compute_s = _fit_verify(fit_cycles, opts)
    if miss_compute_s > 0:
        notes.append(
            f"compute per cache miss {miss_compute_s * 1e6:.3g} us fitted with the verify term and "
            "added to h2d_s_per_transfer (miss_compute)"
        )
    draft_base, per_level, draft_base_note = _fit_draft(fit_cycles, opts, notes)
    after = fit_placing_after_enqueue(fit_transfers)
    notes.extend(after.notes)
    model = CycleCostModel(
        draft_s_per_level=per_level,
        draft_base_s=draft_base,
        verify_base_s=base,
        verify_s_per_node=per_node,
        verify_s_per_context_token=per_ctx,
        h2d_bytes_per_s=link.bytes_per_s,
        h2d_s_per_transfer=link.s_per_transfer + host_s + miss_compute_s,
        host_s_per_transfer=host_s + miss_compute_s,
        expert_bytes=int(expert_bytes),
        num_layers=int(num_layers),
        overlap_h2d=bool(opts.overlap_h2d),
        source=source,
        pre_router_fraction=fit_pre_router_fraction(fit_cycles, notes),
        placing_after_enqueue_s_per_transfer=_capped_placing_after_enqueue(
            after.s_per_transfer, host_s + miss_compute_s, "the measured placing + memcpy plus the per-miss compute", notes
        ),
    )
    split = {"compute_s_per_miss": miss_compute_s, "host_s_per_transfer": host_s}
    fit_err = evaluate(model, fit_cycles, fit_transfers, opts.verify_target, **split)
    held_err = evaluate(model, held_cycles, held_transfers, opts.verify_target, **split)
    model_cycle = model_cycle_s(cycles)
    overhead = verify_target_s(cycles, "residual", False) - cycles["verify_s"].to_numpy(dtype=np.float64)
    share = overhead[model_cycle > 0] / model_cycle[model_cycle > 0]
    bookkeeping = float(np.median(share)) if share.size else float("nan")
    errors = {term: {"fit": fit_err[term], "heldout": held_err[term]} for term in fit_err}
    return CostFit(
        model=model,
        errors=errors,
        h2d_identifiable=link.identifiable,
        num_cycles_fit=len(fit_cycles),
        num_cycles_heldout=len(held_cycles),
        num_transfers_fit=len(fit_transfers),
        notes=tuple(notes),
        bookkeeping_share=bookkeeping,
        heldout_mask=held,
        h2d_link_s_per_transfer=link.s_per_transfer,
        h2d_host_s_per_transfer=host_s,
        compute_s_per_miss=miss_compute_s,
        draft_base_note=draft_base_note,
    )


OVERLAP_FIT_REPORT_VERSION = 2
"""Version of the ``overlap_fit`` report block (``calibration.fit``, ``analysis.validate``): 2 has the
fitted per-miss term under ``host_s_per_transfer`` and the measured placing under
``placing_s_per_transfer``; blocks without a version (1) had the measured placing under
``host_s_per_transfer``."""


@dataclass(frozen=True)
class OverlapFit:
    """Outcome of :func:`fit_overlap_terms`: the overlap-on cost model and how it was found.

    Attributes:
        model: the serial fit's model priced as the live engine overlaps (``overlap_mode="on"``),
            with ``host_s_per_transfer`` and ``late_call_s`` fitted together on whole cycles.
        placing_s_per_transfer: the placing measured on the overlap runs per miss (slot bookkeeping
            and the CPU copy stream's memcpy: ``h2d_s`` beyond the copies), reported beside the
            model's fitted per-miss term ``model.host_s_per_transfer``.
        late_call_s: the late-expert kernel call's seconds (per layer with misses).
        num_cycles: overlap-on cycles used.
        cycle_error: |% error| of whole overlap-on cycles with the fitted model (in sample: the
            two terms are fitted on these cycles, only ``late_call_s`` when they are not separable).
        separable: whether the cycles separated the two terms (misses and layers with misses not
            proportional); if not, the per-miss term is the measured placing plus the serial
            runs' per-miss compute and only ``late_call_s`` is fitted (a note says so).
        notes: remarks.
    """

    model: CycleCostModel
    placing_s_per_transfer: float
    late_call_s: float
    num_cycles: int
    cycle_error: TermError
    notes: tuple[str, ...] = ()
    separable: bool = True
    placing_after_enqueue: PlacingAfterEnqueue | None = None

    def report_fields(self) -> dict[str, Any]:
        """The fit's part of an ``overlap_fit`` report block (``calibration.fit``'s report,
        ``analysis.validate``'s ``cost_<bw>_overlap_report.json``; version
        :data:`OVERLAP_FIT_REPORT_VERSION`, which the caller writes with its own run labels or
        cost): ``host_s_per_transfer`` (s, the model's per-miss term, fitted on whole cycles),
        ``placing_s_per_transfer`` (s, measured: h2d_s beyond the copies), ``late_call_s`` (s),
        ``terms_separable`` (False: only ``late_call_s`` fitted, see the notes), ``num_cycles``,
        ``cycle_error_in_sample``, ``notes`` and the placing after the enqueue
        (:meth:`PlacingAfterEnqueue.report_fields`: the measured value under
        ``placing_after_enqueue_measured_s_per_transfer``, and the model's, clipped at its per-miss
        term, under ``placing_after_enqueue_s_per_transfer``; rev2: the model's overwrote the
        measured one under one key)."""
        after = self.placing_after_enqueue or PlacingAfterEnqueue.none()
        return {
            **after.report_fields(),
            "placing_after_enqueue_s_per_transfer": self.model.placing_after_enqueue_s_per_transfer,
            "host_s_per_transfer": self.model.host_s_per_transfer,
            "placing_s_per_transfer": self.placing_s_per_transfer,
            "late_call_s": self.late_call_s,
            "terms_separable": self.separable,
            "num_cycles": self.num_cycles,
            "cycle_error_in_sample": vars(self.cycle_error),
            "notes": list(self.notes),
        }

    def term_split(self) -> dict[str, float]:
        """The non-link parts of ``model.h2d_s_per_transfer`` as :meth:`CostFit.term_split` gives
        them: ``host_s_per_transfer`` the measured placing (``placing_s_per_transfer``; the key
        keeps :meth:`CostFit.term_split`'s name), ``compute_s_per_miss`` the rest of the
        fitted per-miss term (what overlap's misses cost the compute stream beyond placing;
        clipped at 0)."""
        placing = min(self.placing_s_per_transfer, self.model.host_s_per_transfer)
        return {"compute_s_per_miss": self.model.host_s_per_transfer - placing, "host_s_per_transfer": placing}


OVERLAP_MAX_CONDITION = 30.0
"""Largest condition number of :func:`fit_overlap_terms`' design (per overlap-on cycle with
misses: its misses, its layers with misses; columns at unit max-norm) at which the two terms are
fitted jointly. Equal columns (no layer missed twice) give infinity; ``runs/val-lead-final``'s
ar + topn overlap-on cycles gave 4.4 (ar alone 7.8); 200 six-layer cycles with one layer missing
twice gave 88, with 3 % of layers missing twice 22."""


def fit_overlap_terms(fit: CostFit, cycles: pd.DataFrame, transfers: pd.DataFrame | None) -> OverlapFit:
    """Fit what overlap costs the compute stream, from cycles recorded with ``--overlap on``.

    ``fit`` is the serial fit (:func:`fit_cost_model` on overlap-off runs of the same link); its
    link (bandwidth, latency per expert), verify and draft terms are kept. The two compute-stream
    terms of the cost model's overlap mode "on" (``specfit.cost``), ``host_s_per_transfer`` (per
    miss) and ``late_call_s`` (per layer with misses), enter a cycle's price linearly, so they are
    fitted together by non-negative least squares (:func:`calibration.lsq.fit_non_negative`,
    BVLS; plain seconds, so the MEAN cycle time that throughput sums is what
    it aims at: unbiased when the model's form is right, but with no intercept the residuals
    need not sum to 0, and the note gives the cycles' summed price over their summed time; the
    target may be negative, which plain residuals allow) on the overlap-on cycles' measured
    model cycle (``cycle_s - decision_s``) less the price of everything else, regressors the
    cycle's demand misses and its layers with misses. Both are what overlap costs per miss and per layer
    on the runs themselves: placing each miss and, on the CPU copy stream, its memcpy; the
    late-expert kernel call (``live.offload``); and how the per-miss compute differs from the
    serial runs' (there the host waits out every copy before computing). Measured on
    ``runs/val-lead-final`` (grid, 3 repeats), the serial runs' per-miss compute carried over to
    overlap (120 us at 1 GB/s, 65 us at 8 GB/s) with a MEDIAN late call (678 / 144 us) priced
    overlap-on layers with many misses short at 1 GB/s and long at 8 GB/s (top-N +4.0 / -8.6 %
    throughput error, simulator's verify term -9.8 / +8.5 % of live time).

    The measured placing (:func:`host_s_per_transfer` of these runs: the cycles' ``h2d_s`` beyond
    their copies' own seconds) is reported beside the fit (``OverlapFit.placing_s_per_transfer``)
    and, with the serial fit's per-miss compute added, is the model's per-miss term when fewer
    than 3 cycles have misses (late call 0 then, with a note) and when the two regressors are
    (nearly) proportional, e.g. every layer missed at most one expert so that both columns are
    equal: least squares would then split the per-layer total between the terms arbitrarily
    (a 60 us miss + 250 us late call came out 155 / 155 us, exact on those cycles, 4-miss layers
    mis-priced), so when the condition number of the unit-max-norm design exceeds
    :data:`OVERLAP_MAX_CONDITION` only ``late_call_s`` is fitted, ``separable`` is False and a
    note says so. ``transfers``: the overlap runs' transfers table (None or empty: the serial
    fit's measured placing is used, with a note).

    Raises:
        CalibrationDataError: bad cycle values (run and field named) or no overlap cycle.
    """
    base = fit.model
    validate_cycles(cycles, base.num_layers)
    if not len(cycles):
        raise CalibrationDataError("overlap fit: no cycles recorded with --overlap on")
    transfers = transfers if transfers is not None else pd.DataFrame(columns=list(TRANSFER_COLUMNS))
    notes: list[str] = []
    after = fit_placing_after_enqueue(transfers)
    notes.extend(f"overlap on: {note}" for note in after.notes)
    if len(transfers):
        host_s = host_s_per_transfer(cycles, transfers, copies_per_transfer(transfers))
    else:
        host_s = fit.h2d_host_s_per_transfer
        notes.append("no transfers table in the overlap runs: the serial runs' placing time is used")
    placing_s = after.s_per_transfer if after.num_batches else base.placing_after_enqueue_s_per_transfer
    placing_s = _capped_placing_after_enqueue(  # capped before the late call's step is tested
        placing_s, host_s + fit.compute_s_per_miss, "the measured placing + memcpy plus the serial runs' per-miss compute", notes, "overlap on: "
    )
    link_latency_s = max(base.h2d_s_per_transfer - fit.h2d_host_s_per_transfer - fit.compute_s_per_miss, 0.0)

    pre_router_fraction = base.pre_router_fraction or fit_pre_router_fraction(cycles, notes)

    misses = _stack(cycles["layer_misses"])  # [C, L]

    def priced(per_miss_s: float, late_s: float, after_s: float) -> tuple[CycleCostModel, np.ndarray]:
        model = replace(
            base,
            overlap_h2d=True,
            overlap_mode="on",
            h2d_s_per_transfer=link_latency_s + per_miss_s,
            host_s_per_transfer=per_miss_s,
            late_call_s=late_s,
            pre_router_fraction=pre_router_fraction,
            placing_after_enqueue_s_per_transfer=after_s,
            source=f"{base.source}; overlap terms from {len(cycles)} overlap-on cycles",
        )
        rows = zip(cycles["num_draft_levels"], cycles["num_nodes_verified"], cycles["context_len"], misses)
        return model, np.array([model.cycle_s(int(lev), int(n), int(ctx), m) for lev, n, ctx, m in rows])

    measured = model_cycle_s(cycles)
    layers_with_misses = np.count_nonzero(misses, axis=1) if misses.size else np.zeros(len(cycles))
    total_misses = misses.sum(axis=1) if misses.size else np.zeros(len(cycles))
    # everything but the two terms, which add linearly (the placing after the enqueue is fixed:
    # priced at a per-miss term equal to it, then that term taken off)
    at_placing, rest = priced(placing_s, 0.0, placing_s)
    rest = rest - placing_s * total_misses
    keep = layers_with_misses > 0
    per_miss_s, late_s = host_s + fit.compute_s_per_miss, 0.0
    separable = fitted = keep.sum() >= 3
    if fitted and placing_s > 0.0 and at_placing.link_s_per_transfer <= placing_s:  # step: priced_late_call_s is 0
        separable = fitted = False
        notes.append(
            f"overlap on: the placing after the enqueue ({placing_s * 1e6:.3g} us per transfer) covers each "
            f"copy's link time ({at_placing.link_s_per_transfer * 1e6:.3g} us), so no late call is priced and "
            "neither term is fitted: the per-miss term is the measured placing plus the serial runs' per-miss compute"
        )
    elif fitted:
        design = np.column_stack([total_misses, layers_with_misses])[keep].astype(np.float64)
        unit = design / design.max(axis=0)  # columns at unit max-norm (both counts), for the condition number
        target = (measured - rest)[keep]
        rank = np.linalg.matrix_rank(unit)
        condition = float(np.linalg.cond(unit)) if rank == 2 else np.inf  # equal columns: rank 1
        separable = bool(np.isfinite(condition) and condition <= OVERLAP_MAX_CONDITION)
        if separable:
            coef = fit_non_negative(design, target, ("host_s_per_transfer", "late_call_s")).coef
            per_miss_s, late_s = (float(x) for x in coef)
        else:  # one column: non-negative least squares is the clipped projection
            layers, left = design[:, 1], target - per_miss_s * design[:, 0]
            late_s = max(float(layers @ left / (layers @ layers)), 0.0)
            notes.append(
                f"overlap on: per-miss term and late_call_s not separable: the cycles' misses and layers with "
                f"misses are (nearly) proportional (condition number {condition:.3g} > {OVERLAP_MAX_CONDITION:g}; "
                f"{np.mean(design[:, 0] / design[:, 1]):.3g} misses per layer with misses on average, 1 when "
                "every layer missed at most one expert), so the per-miss term is the measured placing + memcpy "
                "plus the serial runs' per-miss compute and only late_call_s is fitted; layers with more misses "
                "than recorded may be mis-priced: record runs with more misses per layer (smaller cache, topn)"
            )
    elif keep.sum() < 3:
        notes.append(f"late_call_s set to 0: {int(keep.sum())} overlap cycle(s) with misses (need >= 3)")
    model_placing_s = _capped_placing_after_enqueue(placing_s, per_miss_s, "the per-miss term fitted", notes, "overlap on: ")
    model, predicted = priced(per_miss_s, late_s, model_placing_s)
    how = "fitted" if separable else "not fitted"  # separable only where fitted
    notes.append(
        f"overlap on: compute stream {per_miss_s * 1e6:.3g} us per miss ({how}; measured placing + memcpy "
        f"{host_s * 1e6:.3g} us, serial runs' per-miss compute {fit.compute_s_per_miss * 1e6:.3g} us), "
        f"late-expert call {late_s * 1e6:.3g} us per layer with misses ({len(cycles)} cycles; summed price / "
        f"summed time {predicted.sum() / measured.sum():.4f})"
    )
    if model.placing_after_enqueue_s_per_transfer > 0:
        notes.append(
            f"overlap on: placing after the enqueue {model.placing_after_enqueue_s_per_transfer * 1e6:.3g} us per "
            f"transfer (memcpy ends of {after.num_batches} copy-stream batches, R^2 {after.r_squared:.3g})"
        )
    return OverlapFit(
        model, host_s, late_s, len(cycles), TermError.of(predicted, measured), tuple(notes), bool(separable), after
    )


def fit_tables(fit: CostFit) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The fit as two printable tables: ``(parameters, errors)``.

    ``parameters``: one row per cost-model field (``parameter``, ``value``, ``unit``), the
    per-transfer cost split into link latency, host placing and per-miss compute beneath it.
    ``errors``: one row per term (``draft``, ``verify``, ``h2d_cycle``, ``h2d_transfer``, ``cycle``)
    with samples, median / p90 absolute % error and R^2 on the fit and held-out sets.
    """
    m = fit.model
    rows = [
        ("draft_base_s", m.draft_base_s, "s"),
        ("draft_s_per_level", m.draft_s_per_level, "s/level"),
        ("verify_base_s", m.verify_base_s, "s"),
        ("verify_s_per_node", m.verify_s_per_node, "s/node"),
        ("verify_s_per_context_token", m.verify_s_per_context_token, "s/token"),
        ("h2d_bytes_per_s", m.h2d_bytes_per_s, "bytes/s"),
        ("h2d_s_per_transfer", m.h2d_s_per_transfer, "s/transfer"),
        ("  link latency", fit.h2d_link_s_per_transfer, "s/transfer"),
        ("  host placing", fit.h2d_host_s_per_transfer, "s/transfer"),
        ("    after the enqueue", m.placing_after_enqueue_s_per_transfer, "s/transfer"),
        ("  compute per miss", fit.compute_s_per_miss, "s/miss"),
        ("pre_router_fraction", m.pre_router_fraction, "fraction"),
    ]
    params = pd.DataFrame(rows, columns=["parameter", "value", "unit"])
    errors = pd.DataFrame(
        [
            {
                "term": term,
                **{f"{split}_{k}": getattr(e, a) for split, e in splits.items() for k, a in _ERROR_FIELDS},
            }
            for term, splits in fit.errors.items()
        ]
    )
    return params, errors


_ERROR_FIELDS = (
    ("n", "num_samples"),
    ("median_pct", "median_abs_pct_error"),
    ("p90_pct", "p90_abs_pct_error"),
    ("r2", "r2"),
)


def worst_term(errors: dict[str, TermError]) -> str | None:
    """Name of the component term (draft / verify / h2d_cycle) with the largest median |% error|."""
    terms = {k: v.median_abs_pct_error for k, v in errors.items() if k in ("draft", "verify", "h2d_cycle")}
    terms = {k: v for k, v in terms.items() if np.isfinite(v)}
    return max(terms, key=terms.get) if terms else None


__all__ = [
    "CostFit",
    "FitOptions",
    "fit_pre_router_fraction",
    "NextLayerFit",
    "OVERLAP_FIT_REPORT_VERSION",
    "OVERLAP_MAX_CONDITION",
    "OverlapFit",
    "fit_overlap_terms",
    "fit_next_layer_terms",
    "copies_per_transfer",
    "host_s_per_transfer",
    "TermError",
    "cycle_predictions",
    "evaluate",
    "fit_cost_model",
    "fit_tables",
    "measured_terms",
    "model_cycle_s",
    "predict_terms",
    "split_cycles",
    "cycle_identity",
    "verify_target_s",
    "worst_term",
]
