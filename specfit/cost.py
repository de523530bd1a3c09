"""THE cycle cost model of the project: one verification cycle's duration, in seconds.

    T_cycle = T_draft(levels) + T_verify(nodes, context) + T_h2d(misses)          (no overlap)
    T_cycle = T_draft(levels) + sum_l [misses_l * host_s_per_transfer          (overlap_h2d, "on")
                                       + max(T_verify / L, T_pre + misses_l * T_link)
                                       + late_call_s * (misses_l > 0)]
    T_cycle = T_draft(levels) + max(T_verify, T_h2d)               (overlap_h2d, mode "ideal")
    T_draft  = draft_base_s + draft_s_per_level * levels   (levels > 0; 0 when nothing is drafted)
    T_verify = verify_base_s + verify_s_per_node * nodes + verify_s_per_context_token * context_len
    T_h2d    = sum over layers of misses_l * (expert_bytes / h2d_bytes_per_s + h2d_s_per_transfer)
    T_link   = expert_bytes / h2d_bytes_per_s + h2d_s_per_transfer - host_s_per_transfer
    T_pre    = pre_router_fraction * T_verify / L     (a layer's attention + router, before its copies)
  with a placing after the enqueue P = placing_after_enqueue_s_per_transfer (the CPU copy stream's
  memcpys, measured live), T_link where the engines run a copy stream (mode "on"; without
  overlap, any prefetch mode) is max(T_link - P, 0) and late_call_s is priced only while T_link > P
  (:attr:`CycleCostModel.overlapped_link_s_per_transfer`, :attr:`CycleCostModel.priced_late_call_s`)
  with next-layer prefetch (next_layer_prefetch; h = next_layer_cover_fraction, x = next_layer_waste_per_miss,
  c = T_verify / L), each layer's part above but the first's (layer 0 has no layer before it to guess
  from: it keeps h = x = 0) becomes
    (1 + x) * host_s_per_transfer * m_l + max(c + (1 - h) T_link m_l, (1 + x) T_link m_l)     (no overlap)
    (1 + x) * host_s_per_transfer * m_l + max(c, T_pre + (1 - h) T_link m_l, (1 + x) T_link m_l)
                                        + late_call_s * (m_l > 0)                               ("on")

This is the cost of the SpecFit paper's objective (arXiv 2610.15417, abstract: throughput =
E[committed] / T_cycle with an expert-coverage H2D term), with a per-transfer latency term
because measured offloading engines are dispatch-bound (docs/reference-figures.md).
Overlap mode "on" is the live engine's ``--overlap on`` (``live.offload``; ``sim.engine`` mode "on"):
layer l's misses are placed by the compute stream (``host_s_per_transfer`` each: slot
bookkeeping, the emulated link's memcpy, per-miss compute; the part of ``h2d_s_per_transfer`` that
is not link time), their copies are enqueued once its router has run (after the first
``pre_router_fraction`` of the layer's compute: attention, norms and the router, measured live per
layer) and overlap only the rest of that layer's compute (its experts), and the experts whose copies land after the resident ones were computed take one
more kernel call (``late_call_s``, once per layer when copies land one by one, the usual case:
``sim.engine`` models the groups exactly). Both are fitted by ``calibration.costfit`` from
overlap-on runs (``fit_overlap_terms``); with them and ``pre_router_fraction`` at 0 a layer lasts
``max(compute_l, h2d_l)`` on an idle link. The totals-only paths (:meth:`CycleCostModel.cycle_s_total`, the planner's
exact search, which knows a subtree's total misses only) price mode "on" with its lower bound
from the total ``M`` (:meth:`CycleCostModel.overlap_on_total_s`: ``host * M + max(T_verify,
pre_router_fraction * T_verify + T_link * M) + late_call_s * (M > 0)``, equal to the per-layer form
when all layers are compute-bound or all copy-bound); the planner prices its plan per layer and
certifies the gap (``specfit.planner``). Mode "ideal" is ``max(T_verify, T_h2d)``, a bound no
engine reaches (every layer's copies enqueued when verification starts). Files without ``overlap_mode`` keep the "ideal" meaning they had. The simulator gives the
exact value with prefetch and copies carried across cycles. With ``draft_prefetch`` (a run with
``--prefetch draft|both``) the planner prices a subtree's per-node predicted misses as the draft
prefetch moves them (:meth:`CycleCostModel.prefetched_cycle_s`: placed before the forward,
copied in layer order from then on, each layer's experts waiting only for their own copies), on
the planner's own assumption that its predictions are right and fit the cache. Next-layer
prefetch (``--prefetch next-layer|both``: layer l+1's router on layer l's input, its guesses
enqueued one layer ahead) guesses from hidden states the planner does not have when it chooses,
so it is priced by its measured effect (:meth:`CycleCostModel.cycle_s_layers`): a share ``h``
of a layer's misses is copied a layer early and no longer waits for the router, the wrong
guesses add ``x`` copies per miss to the link and the compute stream; both are fitted by
``calibration.costfit.fit_next_layer_terms`` from a run's prefetch used/wasted counts and apply
without overlap and in mode "on" (not to the bound "ideal", nor to the draft prefetch's
pipeline, which already copies every predicted miss). Realised cycles are priced with :meth:`CycleCostModel.realised_cycle_s` of their demand misses. ``draft_base_s`` is what a drafting cycle pays
once whatever its depth (the draft model's catch-up forward over the tokens committed last cycle,
launch overheads): measured live on the embedded default it is ~0.6 ms beside ~0.9 ms per level, so a
per-level-only draft term mispredicts 1-level drafts by ~25 % and SpecFit's "draft at all?" question. Calibration fits the parameters and writes
the JSON read by :meth:`CycleCostModel.load`; the planner, the simulator and the live engine all
use this one object.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specfit.cli import json_error_text
from specfit.units import gb_per_s_to_bytes_per_s

COST_MODEL_FORMAT = "specfit.CycleCostModel"
COST_MODEL_VERSION = 9  # 2: draft_base_s (version 1 loads with 0); 3: host_s_per_transfer,
# late_call_s (versions 1-2 load with 0: all of h2d_s_per_transfer is link time, no late calls);
# 4: pre_router_fraction (versions 1-3 load with 0: copies enqueued at the layer's start);
# 5: next_layer_cover_fraction, next_layer_waste_per_miss (versions 1-4 load with 0: next-layer
# prefetch not priced); 6: next_layer_nodes, next_layer_cover_fractions, next_layer_waste_per_misses
# (the share per tree size; versions 1-5 load without knots: one share at every size); 7: the
# share and waste are of the misses of layers 1..L-1 (layer 0 has no guess and is priced without
# them); versions 5-6 averaged them over every layer and load scaled by L / (L - 1) (share capped
# at 1): :func:`share_of_guessed_layers`; 8: the fraction fields named ``*_fraction(s)`` (versions
# 4-7 wrote pre_router_frac, next_layer_cover_frac and next_layer_cover_fracs: read under those
# names too, :data:`FORMER_FIELD_NAMES`); 9: placing_after_enqueue_s_per_transfer (versions 1-8 load
# with 0: the whole placing precedes the enqueue)
COST_FIT_REPORT_NAME = "cost_fit_report.json"  # written by calibration.fit beside its cost.json


def failed_fit_note(cost_path: str | Path) -> str | None:
    """One line saying that the cost JSON at ``cost_path`` failed ``calibration.fit``'s verdict, or
    None (it passed, or it has no fit report beside it: a hand-written or preset cost).

    Reads the ``verdict`` that ``calibration.fit`` records in ``cost_fit_report.json`` in the same
    folder (held-out per-cycle |% error| median and p90 against its thresholds), so that the tools
    that price cycles with this file (``sim.sweep --cost``, ``live.record --cost``) say so instead
    of using a model that missed its own accuracy aims silently. Never raises: an unreadable
    report gives None.
    """
    report = Path(cost_path).parent / COST_FIT_REPORT_NAME
    try:
        verdict = json.loads(report.read_text(encoding="utf-8")).get("verdict")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(verdict, dict) or verdict.get("verdict") != "fail":
        return None
    return f"{cost_path}: this cost model FAILED calibration.fit's verdict ({verdict.get('verdict_line', 'see ' + str(report))})"

def _no_pre_router_text(where: str, version: int) -> str:
    return (
        f"{where}: a version-{version} cost model has no pre_router_fraction; it is taken as 0 (a "
        "layer's copies enqueued at the layer's start, before its attention and router: optimistic "
        "with overlap). Refit with `python -m calibration.fit` on runs that record layer_pre_router_s."
    )


def _current_names(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a cost JSON object) with its fields, and those of its ``units``, under their current
    names (:data:`FORMER_FIELD_NAMES`); where a file gives both names, the current one's value."""

    def renamed(mapping: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in mapping.items() if k not in FORMER_FIELD_NAMES}
        for old, new in FORMER_FIELD_NAMES.items():
            if old in mapping and new not in mapping:
                out[new] = mapping[old]
        return out

    if not any(name in data for name in FORMER_FIELD_NAMES) and not (
        isinstance(data.get("units"), dict) and any(name in data["units"] for name in FORMER_FIELD_NAMES)
    ):
        return data
    out = renamed(data)
    if isinstance(data.get("units"), dict):
        out["units"] = renamed(data["units"])
    return out


def _file_without(cost_path: str | Path, field: str, last_version: int) -> tuple[dict, int] | None:
    """``(data, version)`` of the cost JSON at ``cost_path`` when it is a version up to
    ``last_version`` without ``field`` (a file older than that field), else None (also for an
    unreadable file or a bad version: loading reports those)."""
    try:
        data = json.loads(Path(cost_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version > last_version or field in _current_names(data):
        return None
    return data, version


def no_next_layer_note(cost_path: str | Path) -> str | None:
    """One line saying that the cost JSON at ``cost_path`` predates the next-layer prefetch term
    (version 1-4: ``next_layer_cover_fraction`` and ``next_layer_waste_per_miss`` loaded as 0, so a
    run with ``--prefetch next-layer|both`` is priced as if it prefetched nothing one layer ahead),
    else None. What :func:`unpriced_next_layer_note` says first for such a file. Never raises: an
    unreadable file gives None."""
    older = _file_without(cost_path, "next_layer_cover_fraction", 4)
    if older is None:
        return None
    version = older[1]
    return (
        f"{cost_path}: a version-{version} cost model has no next-layer prefetch share; it is taken as 0 "
        "(the planner prices no next-layer prefetch). Refit with `python -m calibration.fit` on runs "
        "recorded with --prefetch next-layer."
    )


def unpriced_next_layer_note(cost: CycleCostModel, cost_path: str | Path | None = None) -> str | None:
    """One line saying that ``cost`` prices no next-layer prefetch although the run prefetches
    one layer ahead (``--prefetch next-layer|both``), else None: a file older than the term
    (:func:`no_next_layer_note`) or a model whose share and waste are 0 (a preset, or a fit
    without ``--prefetch next-layer`` runs). For ``sim.sweep``, ``live.record`` and
    ``analysis.validate`` to print as a warning. Never raises."""
    if cost_path is not None and (note := no_next_layer_note(cost_path)) is not None:
        return note
    if cost.has_next_layer_share:
        return None
    return (
        f"{cost_path or cost.source}: no next-layer prefetch share (next_layer_cover_fraction and "
        "next_layer_waste_per_miss are 0), so the planner prices no next-layer prefetch; fit them with "
        "`python -m calibration.fit` on runs recorded with --prefetch next-layer"
    )


def no_pre_router_note(cost_path: str | Path) -> str | None:
    """One line saying that the cost JSON at ``cost_path`` predates ``pre_router_fraction`` (version
    1-3: loaded as 0) when the file itself does not say overlap mode "on" (then :meth:`CycleCostModel.from_dict`
    already warns), else None. For the tools that set overlap "on" after loading (``sim.sweep
    --overlap on``, ``live.record --overlap on``). Never raises: an unreadable file gives None."""
    older = _file_without(cost_path, "pre_router_fraction", 3)
    if older is None:
        return None
    data, version = older
    if data.get("overlap_h2d") and data.get("overlap_mode") == "on":
        return None
    return _no_pre_router_text(str(cost_path), version)


def cost_file_warnings(
    cost_path: str | Path,
    cost: CycleCostModel | None = None,
    *,
    overlap: bool = False,
    next_layer: bool = False,
    consequence: str = "",
) -> list[str]:
    """The warnings a tool that prices cycles with the cost JSON at ``cost_path`` prints (each as
    ``warning: --cost <line>``; ``sim.sweep``, ``live.record``, ``analysis.validate``): the file
    failed ``calibration.fit``'s verdict (:func:`failed_fit_note`, followed by ``; consequence``
    when given), it predates ``pre_router_fraction`` and the run overlaps (``overlap``;
    :func:`no_pre_router_note`), ``cost`` prices no next-layer prefetch and the run prefetches one
    layer ahead (``next_layer``; :func:`unpriced_next_layer_note`). Empty when none applies;
    never raises."""
    notes = []
    if (note := failed_fit_note(cost_path)) is not None:  # said, not refused
        notes.append(f"{note}; {consequence}" if consequence else note)
    if overlap and (note := no_pre_router_note(cost_path)) is not None:
        notes.append(note)
    if next_layer and cost is not None and (note := unpriced_next_layer_note(cost, cost_path)) is not None:
        notes.append(note)
    return notes


# a field's name in cost JSON before version 8 -> its name now (from_dict reads either)
FORMER_FIELD_NAMES: dict[str, str] = {
    "pre_router_frac": "pre_router_fraction",
    "next_layer_cover_frac": "next_layer_cover_fraction",
    "next_layer_cover_fracs": "next_layer_cover_fractions",
}
# field -> unit written beside it in JSON; load() rejects a file that states another unit.
FIELD_UNITS: dict[str, str] = {
    "draft_s_per_level": "s/level",
    "draft_base_s": "s",
    "verify_base_s": "s",
    "verify_s_per_node": "s/node",
    "verify_s_per_context_token": "s/token",
    "h2d_bytes_per_s": "bytes/s",
    "h2d_s_per_transfer": "s/transfer",
    "host_s_per_transfer": "s/transfer",
    "late_call_s": "s",
    "placing_after_enqueue_s_per_transfer": "s/transfer",
    "pre_router_fraction": "fraction",
    "next_layer_cover_fraction": "fraction",
    "next_layer_waste_per_miss": "copies/miss",
    "next_layer_nodes": "count",
    "next_layer_cover_fractions": "fraction",
    "next_layer_waste_per_misses": "copies/miss",
    "expert_bytes": "bytes",
    "num_layers": "count",
    "overlap_h2d": "bool",
    "overlap_mode": "text",
    "draft_prefetch": "bool",
    "next_layer_prefetch": "bool",
    "source": "text",
}
# the compute terms (s) that CycleCostModel.with_compute_speed scales besides host_s_per_transfer
COMPUTE_FIELDS = (
    "draft_s_per_level",
    "draft_base_s",
    "verify_base_s",
    "verify_s_per_node",
    "verify_s_per_context_token",
    "late_call_s",
)
_FLOAT_FIELDS = (
    "draft_s_per_level",
    "draft_base_s",
    "verify_base_s",
    "verify_s_per_node",
    "verify_s_per_context_token",
    "h2d_bytes_per_s",
    "h2d_s_per_transfer",
    "host_s_per_transfer",
    "late_call_s",
    "pre_router_fraction",
    "next_layer_cover_fraction",
    "next_layer_waste_per_miss",
    "placing_after_enqueue_s_per_transfer",
)


def _int_misses_total(misses_per_layer: Any, num_layers: int) -> int | None:
    """Total of a signed-integer ``int[num_layers]`` numpy array of miss counts, in plain Python.

    The per-cycle fast path of :meth:`CycleCostModel.h2d_s` (a few numpy calls on a 48-element
    array cost more than the sum): returns None for anything else (another type, dtype or
    length, or a negative count), which the numpy path then prices or rejects as before.
    """
    if type(misses_per_layer) is not np.ndarray or misses_per_layer.dtype.kind != "i":
        return None
    if misses_per_layer.ndim != 1 or misses_per_layer.shape[0] != num_layers:
        return None
    counts = misses_per_layer.tolist()
    if counts and min(counts) < 0:
        return None
    return sum(counts)


def _is_number(value: Any) -> bool:
    """A finite-or-not real number that is not a bool (what a JSON number loads as)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def share_of_guessed_layers(value: float, num_layers: int, cap: bool) -> float:
    """A next-layer share or waste averaged over EVERY layer (cost files of versions 5-6) as the
    same copies spread over layers ``1..L-1`` only, the layers a guess can cover (version 7):
    ``value * L / (L - 1)``, capped at 1 when ``cap`` (a valid share; an invalid one is left
    for the model's checks to name); ``value`` unchanged for one layer. Exact when every layer has as many planner misses (the old fit's denominator held
    layer 0's, which no guess covers: issue 13)."""
    if num_layers <= 1:
        return float(value)
    scaled = float(value) * num_layers / (num_layers - 1)
    return min(scaled, 1.0) if cap else scaled


@dataclass(frozen=True)
class CycleCostModel:
    """Parameters of the cycle cost, SI units (see the module docstring for the formula).

    Attributes:
        draft_s_per_level: seconds to draft one tree level (s).
        verify_base_s: fixed seconds of one target forward (s).
        verify_s_per_node: extra target-forward seconds per verified node (s).
        verify_s_per_context_token: extra seconds per context token (attention over the KV cache) (s).
        h2d_bytes_per_s: host-to-device bandwidth (bytes/s, > 0; ``math.inf`` = free bytes).
        h2d_s_per_transfer: fixed latency per expert transfer (s).
        expert_bytes: bytes of one expert (bytes).
        num_layers: MoE layers ``L`` (count, > 0).
        draft_base_s: fixed seconds of a cycle that drafts at least one level (s; default 0).
        overlap_h2d: whether transfers overlap the verify compute (see module doc).
        overlap_mode: how, when ``overlap_h2d``: ``"on"`` (per layer, as the live engine) or
            ``"ideal"`` (the bound; the default, which files written before the field keep).
        source: where the parameters come from (free text, e.g. a calibration path).
        host_s_per_transfer: the share of ``h2d_s_per_transfer`` the compute stream spends per
            miss (placing it, the emulated link's memcpy, per-miss compute) rather than the link
            (s; default 0). Without overlap it changes nothing; with overlap it is not hidden.
        late_call_s: with overlap mode "on", the compute-stream cost of the extra kernel call on
            the experts whose copies landed after the layer's resident experts were computed
            (s; default 0).
        pre_router_fraction: the share of each layer's compute that runs before its router has
            chosen the layer's experts (attention, norms, the router itself; fraction in [0, 1],
            default 0). With overlap mode "on" a layer's copies are enqueued only after it, so
            they overlap the remaining ``1 - pre_router_fraction`` (the experts' compute).
            ``calibration.costfit`` fits it from the live engine's ``layer_pre_router_s``.
        draft_prefetch: whether the run prefetches from the draft (``--prefetch draft|both``):
            the planner then prices a subtree whose per-node expert predictions it has as if its
            predicted misses were copied when it is chosen (:meth:`plan_cycle_s`); a run setting,
            like ``overlap_h2d`` (default False; optional in JSON).
        next_layer_cover_fraction: with next-layer prefetch, the share of a layer's demand misses (as
            the planner counts them, against the cache it sees) whose copies the guess of the
            layer before enqueued one layer ahead (fraction in [0, 1], default 0), over layers
            ``1..L-1``: layer 0 has no layer before it, so no guess, and is priced with none
            (:meth:`cycle_s_layers`; version 7; before, averaged over every layer, layer 0 too,
            which under-priced each cycle by the share spread over layer 0: issue 13).
            ``calibration.costfit`` fits it from a run's prefetch counts
            (:func:`calibration.costfit.fit_next_layer_terms`).
        next_layer_waste_per_miss: with next-layer prefetch, the copies of wrong guesses it adds to
            the link per such demand miss of layers ``1..L-1`` (copies/miss, >= 0, default 0),
            fitted alike.
        next_layer_nodes: knots of the share per tree size over a cycle's verified nodes (count,
            strictly increasing, >= 1; default empty: ``next_layer_cover_fraction`` and
            ``next_layer_waste_per_miss`` at every size). With knots, ``h`` and ``x`` of a cycle of
            ``n`` verified nodes are ``np.interp(n, next_layer_nodes, next_layer_cover_fractions)`` and
            ``np.interp(n, next_layer_nodes, next_layer_waste_per_misses)`` (the end values outside),
            and the two scalars are the pooled values (reported, not priced). Fitted by
            :func:`specfit.prefetch.next_layer_share_by_nodes` from per-cycle counts.
        next_layer_cover_fractions, next_layer_waste_per_misses: the share (fractions in [0, 1]) and
            waste (copies/miss, >= 0) at each knot (tuples as long as ``next_layer_nodes``).
        next_layer_prefetch: whether the run prefetches one layer ahead (``--prefetch
            next-layer|both``): the cycle is then priced with the two terms above (see
            :meth:`cycle_s_layers`); a run setting, like ``draft_prefetch`` (default False;
            optional in JSON).
        placing_after_enqueue_s_per_transfer: the part of ``host_s_per_transfer`` the compute
            stream spends placing a copy AFTER its batch was enqueued on the copy stream, while the
            link already copies (the live CPU copy stream's memcpy; s/transfer, in ``[0,
            host_s_per_transfer]``, default 0: the whole placing precedes the enqueue, the model
            before version 9). Measured live (``transfers.placed_at_s``) and fitted by
            ``calibration.costfit.fit_placing_after_enqueue``; ``sim.engine`` replays it as
            ``CyclePlan.placing_ns_per_transfer``. Priced where copies go on the copy stream
            (mode "on"; without overlap, any prefetch mode: ``live.offload``): each copy then
            occupies the link only :attr:`overlapped_link_s_per_transfer` beyond its placing,
            and the late call is priced only while a copy outlasts its placing
            (:attr:`priced_late_call_s`).

    Raises:
        ValueError: a negative or non-finite time, a non-positive bandwidth or layer count,
            ``host_s_per_transfer > h2d_s_per_transfer``, ``pre_router_fraction`` or
            ``next_layer_cover_fraction`` above 1; the message names the field.
    """

    draft_s_per_level: float
    verify_base_s: float
    verify_s_per_node: float
    verify_s_per_context_token: float
    h2d_bytes_per_s: float
    h2d_s_per_transfer: float
    expert_bytes: int
    num_layers: int
    draft_base_s: float = 0.0
    overlap_h2d: bool = False
    source: str = "manual"
    overlap_mode: str = "ideal"
    host_s_per_transfer: float = 0.0
    late_call_s: float = 0.0
    pre_router_fraction: float = 0.0
    draft_prefetch: bool = False
    next_layer_cover_fraction: float = 0.0
    next_layer_waste_per_miss: float = 0.0
    next_layer_prefetch: bool = False
    next_layer_nodes: tuple[float, ...] = ()
    next_layer_cover_fractions: tuple[float, ...] = ()
    next_layer_waste_per_misses: tuple[float, ...] = ()
    placing_after_enqueue_s_per_transfer: float = 0.0

    def __post_init__(self) -> None:
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise ValueError(
                    f"CycleCostModel.{name}: expected a number ({FIELD_UNITS[name]}), got {value!r}"
                )
            value = float(value)
            if name == "h2d_bytes_per_s":
                if not value > 0:
                    raise ValueError(f"CycleCostModel.{name}: expected > 0 bytes/s, got {value!r}")
            elif not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"CycleCostModel.{name}: expected a finite number >= 0 ({FIELD_UNITS[name]}), got {value!r}"
                )
            object.__setattr__(self, name, value)
        if self.host_s_per_transfer > self.h2d_s_per_transfer:
            raise ValueError(
                "CycleCostModel.host_s_per_transfer: expected <= h2d_s_per_transfer (it is the part of "
                f"it spent on the compute stream), got {self.host_s_per_transfer!r} > {self.h2d_s_per_transfer!r}"
            )
        if self.placing_after_enqueue_s_per_transfer > self.host_s_per_transfer:
            raise ValueError(
                "CycleCostModel.placing_after_enqueue_s_per_transfer: expected <= host_s_per_transfer (it is "
                f"the part of it after the enqueue), got {self.placing_after_enqueue_s_per_transfer!r} > "
                f"{self.host_s_per_transfer!r}"
            )
        for name in ("pre_router_fraction", "next_layer_cover_fraction"):
            if getattr(self, name) > 1.0:
                raise ValueError(f"CycleCostModel.{name}: expected a fraction in [0, 1], got {getattr(self, name)!r}")
        for name, minimum in (("expert_bytes", 0), ("num_layers", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < minimum:
                raise ValueError(f"CycleCostModel.{name}: expected an integer >= {minimum}, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.overlap_h2d, (bool, np.bool_)):
            raise ValueError(f"CycleCostModel.overlap_h2d: expected true/false, got {self.overlap_h2d!r}")
        object.__setattr__(self, "overlap_h2d", bool(self.overlap_h2d))
        for name in ("draft_prefetch", "next_layer_prefetch"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"CycleCostModel.{name}: expected true/false, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.overlap_mode not in ("on", "ideal"):
            raise ValueError(f"CycleCostModel.overlap_mode: expected 'on' or 'ideal', got {self.overlap_mode!r}")
        object.__setattr__(self, "source", str(self.source))
        knots = self._check_knots()
        # derived once (the fields are frozen): read by every pricing call
        on = self.overlap_h2d and self.overlap_mode == "on"
        nl = self.next_layer_prefetch and self.has_next_layer_share and not (self.overlap_h2d and not on)
        placing, late = self.placing_after_enqueue_s_per_transfer, self.late_call_s
        link, per_miss = self.link_s_per_transfer, self.s_per_miss
        # the engines put demand copies on the copy stream in mode "on" and, without overlap, with any
        # prefetch mode (live.offload's _copy_stream, sim.replay's copy_stream): not in mode "ideal"
        stream = on or (not self.overlap_h2d and (self.draft_prefetch or self.next_layer_prefetch))
        if placing > 0.0 and stream:  # the link copies while the rest of the batch is placed
            late = late if link > placing else 0.0  # every copy landed by the end of its placing
            link = max(link - placing, 0.0)
            per_miss = self.host_s_per_transfer + link
        object.__setattr__(self, "_copy_terms", (link, late, per_miss))
        host = self.host_s_per_transfer
        terms = self._share_terms(self.next_layer_cover_fraction, self.next_layer_waste_per_miss)
        plain = self.layer0_s_per_miss  # h = x = 0
        if knots is None:
            least = terms
            least_per_miss = terms[0] + terms[1]
        else:  # lower bounds over every size: the terms grow with x and fall with h; affine between knots
            least = self._share_terms(float(knots[1].max()), float(knots[2].min()))
            least_per_miss = float(np.min((1.0 + knots[2]) * host + (1.0 - knots[1]) * link))
        # layer 0 is priced without a guess (h = x = 0, cycle_s_layers): the bounds hold for it too
        # (the per-miss bound is then host + the least a: the totals form's, next_layer_total_s)
        least = tuple(min(a, b) for a, b in zip(least, plain))
        least_per_miss = min(least_per_miss, least[0] + least[1])
        derived = (on, nl, on or nl, terms, terms if nl else plain, knots, least, least_per_miss)
        object.__setattr__(self, "_derived", derived)

    def _check_knots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Validate the share-per-size knots (stored back as tuples of floats); their float64
        arrays ``(nodes, cover, waste)``, or None without knots."""
        names = ("next_layer_nodes", "next_layer_cover_fractions", "next_layer_waste_per_misses")
        arrays = []
        for name in names:
            value = getattr(self, name)
            try:
                items = tuple(float(v) for v in value if not isinstance(v, bool))
                ok = len(items) == len(value) and all(math.isfinite(v) and v >= 0.0 for v in items)
            except (TypeError, ValueError):
                ok = False
            if not ok or isinstance(value, (str, bytes)):
                raise ValueError(f"CycleCostModel.{name}: expected a list of finite numbers >= 0 ({FIELD_UNITS[name]}), got {value!r}")
            object.__setattr__(self, name, items)
            arrays.append(np.array(items, dtype=np.float64))
        nodes, cover, waste = arrays
        if not (len(nodes) == len(cover) == len(waste)):
            raise ValueError(
                f"CycleCostModel.next_layer_nodes: expected as many knots as next_layer_cover_fractions and "
                f"next_layer_waste_per_misses, got {len(nodes)}, {len(cover)} and {len(waste)}"
            )
        if not len(nodes):
            return None
        if nodes[0] < 1.0 or np.any(np.diff(nodes) <= 0.0):
            raise ValueError(f"CycleCostModel.next_layer_nodes: expected strictly increasing node counts >= 1, got {self.next_layer_nodes!r}")
        if np.any(cover > 1.0):
            raise ValueError(f"CycleCostModel.next_layer_cover_fractions: expected fractions in [0, 1], got {self.next_layer_cover_fractions!r}")
        for a in arrays:
            a.setflags(write=False)
        return nodes, cover, waste

    def _share_terms(self, cover: Any, waste: Any) -> tuple[Any, Any, Any]:
        """``(host, after, link)`` s per miss for share ``h = cover`` and waste ``x = waste``
        (floats or arrays): ``((1 + x) host_s_per_transfer, (1 - h) T_link, (1 + x) T_link)``,
        ``T_link`` here :attr:`overlapped_link_s_per_transfer`."""
        link = self._copy_terms[0]
        return (1.0 + waste) * self.host_s_per_transfer, (1.0 - cover) * link, (1.0 + waste) * link

    # ---- the formula -------------------------------------------------------------------------
    @property
    def s_per_miss(self) -> float:
        """Seconds one expert transfer costs, ``expert_bytes / h2d_bytes_per_s + h2d_s_per_transfer``."""
        return self.expert_bytes / self.h2d_bytes_per_s + self.h2d_s_per_transfer

    @property
    def link_s_per_transfer(self) -> float:
        """Seconds one expert copy occupies the link: :attr:`s_per_miss` less ``host_s_per_transfer``."""
        return self.expert_bytes / self.h2d_bytes_per_s + self.h2d_s_per_transfer - self.host_s_per_transfer

    @property
    def overlapped_link_s_per_transfer(self) -> float:
        """Seconds a copy adds to the link beyond its own placing where the engines run a copy
        stream (mode "on"; without overlap, any prefetch mode): ``max(T_link - P, 0)`` with ``P =
        placing_after_enqueue_s_per_transfer`` (the batch's copies start on the link at its
        enqueue and the compute stream places them one after another meanwhile: copy ``j``
        lands at ``max(E + (j + 1) T_link, E + (j + 1) P)``, ``sim.engine``; with its resident
        experts after the placing, a layer of ``m`` misses lasts ``host m + max(c, p c + m max(T_link
        - P, 0))`` plus the late call; without overlap ``c + m (host + max(T_link - P, 0))``);
        :attr:`link_s_per_transfer` itself with ``P = 0`` or without a copy stream (no overlap
        and no prefetch: the live engine's synchronous fetch; mode "ideal", a bound). The draft
        prefetch's pipeline (:meth:`prefetched_cycle_s`) places each batch itself."""
        return self._copy_terms[0]

    @property
    def priced_s_per_miss(self) -> float:
        """Seconds per demand miss as the cost prices it: :attr:`s_per_miss`, or where the
        engines run a copy stream with a placing after the enqueue (mode "on"; without overlap,
        any prefetch mode) ``host_s_per_transfer + overlapped_link_s_per_transfer`` (a layer's
        ``m`` copies then land ``m max(T_link, P)`` after their enqueue, ``(host - P) m`` after
        the router). The serial form's per-miss price (:meth:`transfer_s`, :meth:`cycle_s`,
        ``specfit.planner.cost_params``' ``s_per_miss``) and the copy branch of mode "on"'s
        totals form (:meth:`overlap_on_total_s`). Mode "ideal" keeps :attr:`s_per_miss`."""
        return self._copy_terms[2]

    @property
    def priced_late_call_s(self) -> float:
        """The late call's seconds as the per-layer forms price it: ``late_call_s``, but 0 when a
        placing after the enqueue ``P > 0`` covers each copy (``T_link <= P``: every copy has
        landed when the layer's resident experts start, so no expert is late; ``sim.engine``'s
        groups). A step at ``P = T_link``: at 1 GB/s idle the per-miss term is about one copy's
        time. With ``P = 0``, ``late_call_s`` as before version 9."""
        return self._copy_terms[1]

    def draft_s(self, num_levels: int) -> float:
        """Draft time for ``num_levels`` levels (s): ``draft_base_s + draft_s_per_level * levels``, 0 for 0."""
        if num_levels <= 0:
            return 0.0
        return self.draft_base_s + self.draft_s_per_level * float(num_levels)

    def draft_s_array(self, num_levels: Any) -> Any:
        """:meth:`draft_s` element-wise over an array of level counts (float64, same shape)."""
        levels = np.asarray(num_levels, dtype=np.float64)
        return np.where(levels > 0, self.draft_base_s + self.draft_s_per_level * levels, 0.0)

    def verify_s(self, num_nodes: int, context_len: int) -> float:
        """Target forward time verifying ``num_nodes`` nodes over ``context_len`` tokens (s)."""
        return (
            self.verify_base_s
            + self.verify_s_per_node * float(num_nodes)
            + self.verify_s_per_context_token * float(context_len)
        )

    def verify_s_array(self, num_nodes: Any, context_len: Any) -> np.ndarray:
        """:meth:`verify_s` element-wise (s; float64 arrays broadcast, same operations in the same
        order, so equal bit for bit): the vectorised callers' verify time."""
        verify = self.verify_base_s + self.verify_s_per_node * np.asarray(num_nodes, dtype=np.float64)
        return verify + self.verify_s_per_context_token * np.asarray(context_len, dtype=np.float64)

    def layer_compute_s(self, num_nodes: int, context_len: int) -> float:
        """Compute time of one MoE layer, ``verify_s / num_layers`` (s)."""
        return self.verify_s(num_nodes, context_len) / self.num_layers

    def transfer_s(self, num_experts: float = 1) -> float:
        """Time to move ``num_experts`` experts host -> device, each paying latency + bytes (s):
        :attr:`priced_s_per_miss` each (:attr:`s_per_miss` but where a copy stream overlaps the
        placing after the enqueue with the link)."""
        return float(num_experts) * self._copy_terms[2]

    def h2d_s(self, misses_per_layer: Any) -> float:
        """Total H2D time for ``misses_per_layer`` (int[L], or a scalar total) expert misses (s).

        A signed-integer ``int[L]`` array (the simulator's per-cycle counts) takes a scalar path:
        its total is an exact integer either way, so the result is the same float as numpy's.

        Raises:
            ValueError: a negative miss count, or an array whose length is not ``num_layers``.
        """
        total = _int_misses_total(misses_per_layer, self.num_layers)
        if total is not None:
            return self.transfer_s(total)
        misses = np.asarray(misses_per_layer)
        if misses.ndim == 1 and misses.shape[0] != self.num_layers:
            raise ValueError(f"misses_per_layer: expected {self.num_layers} layers, got {misses.shape[0]}")
        if misses.ndim > 1:
            raise ValueError(f"misses_per_layer: expected int[L] or a scalar, got shape {misses.shape}")
        if np.any(misses < 0):
            raise ValueError("misses_per_layer: expected counts >= 0")
        return self.transfer_s(float(misses.sum()))

    def combine_s(self, draft_s: Any, verify_s: Any, h2d_s: Any) -> Any:
        """Cycle time from phase times: ``draft + verify + h2d`` or ``draft + max(verify, h2d)``.

        Scalars give a float; numpy arrays broadcast (element-wise maximum).
        """
        if self.overlap_h2d:
            both = np.maximum(verify_s, h2d_s)
            return float(draft_s + both) if np.ndim(both) == 0 and np.ndim(draft_s) == 0 else draft_s + both
        return draft_s + verify_s + h2d_s

    @property
    def per_layer_overlap(self) -> bool:
        """True for the live engine's overlap (``overlap_h2d`` and mode "on"): the per-layer form."""
        return self._derived[0]

    @property
    def has_next_layer_share(self) -> bool:
        """True when a next-layer prefetch share was fitted (``next_layer_cover_fraction`` or
        ``next_layer_waste_per_miss`` > 0, or a knot's); versions 1-4 and presets load without one."""
        if self.next_layer_cover_fraction > 0.0 or self.next_layer_waste_per_miss > 0.0:
            return True
        return any(v > 0.0 for v in self.next_layer_cover_fractions + self.next_layer_waste_per_misses)

    def next_layer_share_at(self, num_nodes: Any) -> tuple[Any, Any]:
        """``(h, x)``: next-layer prefetch's share and waste for a cycle of ``num_nodes`` verified
        nodes (a count or an array of counts; the results broadcast alike): the knots'
        ``np.interp`` (the end values outside) when the model has them, else
        ``next_layer_cover_fraction`` and ``next_layer_waste_per_miss``."""
        knots = self._derived[5]
        if knots is None:
            return self.next_layer_cover_fraction, self.next_layer_waste_per_miss
        return np.interp(num_nodes, knots[0], knots[1]), np.interp(num_nodes, knots[0], knots[2])

    @property
    def next_layer_priced(self) -> bool:
        """True when cycles are priced with next-layer prefetch (:meth:`cycle_s_layers`):
        ``next_layer_prefetch`` with a fitted share (``next_layer_cover_fraction`` or
        ``next_layer_waste_per_miss`` > 0), without overlap or in mode "on". Mode "ideal" is left
        as it is: a bound that enqueues every demand copy when verification starts, which no
        prefetch improves on (its waste is left out, as its placing is). Set once per model."""
        return self._derived[1]

    @property
    def per_layer_priced(self) -> bool:
        """True when :meth:`cycle_s` prices each layer's misses (:meth:`cycle_s_layers`): overlap
        mode "on" (:attr:`per_layer_overlap`) or next-layer prefetch (:attr:`next_layer_priced`)."""
        return self._derived[2]

    @property
    def layer0_s_per_miss(self) -> tuple[float, float, float]:
        """``(host, after, link)`` seconds per demand miss of layer 0, which no next-layer guess
        covers (it has no layer before it: share ``h = 0``, waste ``x = 0``):
        ``(host_s_per_transfer, T, T)`` with ``T`` :attr:`overlapped_link_s_per_transfer`, the terms of
        :meth:`next_layer_s_per_miss` at ``h = x = 0`` (issue 13; :meth:`cycle_s_layers`)."""
        link = self._copy_terms[0]
        return self.host_s_per_transfer, link, link

    def next_layer_s_per_miss(self, num_nodes: Any = None) -> tuple[Any, Any, Any]:
        """``(host, after, link)`` seconds per demand miss ``m`` the planner counts in a cycle of
        ``num_nodes`` verified nodes (a count or an array: the terms broadcast alike), with
        next-layer prefetch covering ``h`` of them and adding ``x`` wrong copies
        (:meth:`next_layer_share_at`): placing every copy on the compute stream ``(1 + x) *
        host_s_per_transfer``; the copies still enqueued after the layer's router ``(1 - h) *
        T_link``; all of the layer's copies on the link ``(1 + x) * T_link``
        (:attr:`link_s_per_transfer`). Without knots (or ``num_nodes`` None) the pooled share's,
        set once per model. With ``h = x = 0`` they are mode "on"'s ``(host_s_per_transfer,
        T_link, T_link)``, so one per-layer form prices both (:meth:`cycle_s_layers`)."""
        if num_nodes is None or self._derived[5] is None:
            return self._derived[3]
        h, x = self.next_layer_share_at(num_nodes)
        return self._share_terms(h, x)

    @property
    def next_layer_least_s_per_miss(self) -> tuple[float, float, float]:
        """Lower bounds on :meth:`next_layer_s_per_miss` over every tree size: the terms at the
        largest knot share and the least knot waste (each term falls with ``h`` and grows with
        ``x``); the pooled terms without knots; each no more than layer 0's, which has no guess
        (``host_s_per_transfer, T_link, T_link``). The planner's exact search prices with them
        (``specfit.planner.search_costs``: a bound stays a bound; the plan's gap certifies the rest)."""
        return self._derived[6]

    def overlap_on_total_s(self, verify_s: Any, total_misses: Any) -> Any:
        """Mode "on"'s verification time from the TOTAL misses (s; arrays broadcast):
        ``max(V + host * M, pre_router_fraction * V + s_per_miss * M) + late_call_s * (M > 0)``
        (= ``host * M + max(V, pre_router_fraction * V + T_link * M) + ...``); with a placing after
        the enqueue ``T_link`` is :attr:`overlapped_link_s_per_transfer` (``s_per_miss`` then
        ``host + T_link``) and the late call :attr:`priced_late_call_s`.

        A LOWER bound on the per-layer form :meth:`cycle_s` gives for any split of ``M`` over the
        layers (a sum of maxima is at least the maximum of the sums; at least one layer holds
        the misses), equal to it when every layer is compute-bound or every layer copy-bound and
        at most one layer has misses or ``late_call_s`` is 0. The planner's exact search prices
        subtrees with it (it knows only the total) and certifies the gap to the per-layer price
        (``specfit.planner``).
        """
        v = np.asarray(verify_s, dtype=np.float64)
        m = np.asarray(total_misses, dtype=np.float64)
        _, late, per_miss = self._copy_terms  # late: priced_late_call_s; per_miss: priced_s_per_miss
        both = np.maximum(v + self.host_s_per_transfer * m, self.pre_router_fraction * v + per_miss * m)
        out = both + late * (m > 0)
        return float(out) if np.ndim(out) == 0 else out

    def cycle_s_total(self, num_levels: Any, num_nodes: Any, context_len: Any, total_misses: Any) -> Any:
        """Cycle time from the TOTAL miss count over layers (s); arrays broadcast (vectorised
        callers). Next-layer prefetch priced takes :meth:`next_layer_total_s`, overlap mode "on"
        :meth:`overlap_on_total_s` (lower bounds on the per-layer forms), mode "ideal" and no
        overlap :meth:`combine_s`."""
        verify = self.verify_s_array(num_nodes, context_len)
        if self.next_layer_priced:
            out = self.draft_s_array(num_levels) + self.next_layer_total_s(verify, total_misses, num_nodes)
        elif self.per_layer_overlap:
            out = self.draft_s_array(num_levels) + self.overlap_on_total_s(verify, total_misses)
        else:
            h2d = self._copy_terms[2] * np.asarray(total_misses, dtype=np.float64)  # priced_s_per_miss
            out = self.combine_s(self.draft_s_array(num_levels), verify, h2d)
        return float(out) if np.ndim(out) == 0 else out

    def plan_cycle_s_total(self, num_levels: Any, num_nodes: Any, context_len: Any, total_misses: Any) -> Any:
        """:meth:`cycle_s_total`, or with ``draft_prefetch`` ``draft + prefetched_total_s``: the
        planner's totals price of subtrees with per-node predictions (arrays broadcast)."""
        if not self.draft_prefetch:
            return self.cycle_s_total(num_levels, num_nodes, context_len, total_misses)
        verify = self.verify_s_array(num_nodes, context_len)
        out = self.draft_s_array(num_levels) + self.prefetched_total_s(verify, total_misses)
        return float(out) if np.ndim(out) == 0 else out

    def cycle_s_layers(self, num_levels: Any, num_nodes: Any, context_len: Any, misses: Any) -> Any:
        """The per-layer cycle time (s) for ``misses`` float[..., L] (rows broadcast against
        ``num_levels`` / ``num_nodes``), ``c = verify / L``, ``p = pre_router_fraction``. Overlap
        mode "on": ``draft + sum_l [host * m_l + max(c, p c + T_link * m_l) + late_call_s * (m_l >
        0)]``. The form :meth:`cycle_s` prices one subtree with; vectorised for the planner's
        union-size prefixes.

        With next-layer prefetch priced (:attr:`next_layer_priced`; ``host``, ``a`` (after the
        router) and ``b`` (link) of :attr:`next_layer_s_per_miss`), a layer lasts
        ``host * m_l + max(c, p c + a m_l, b m_l) + late_call_s * (m_l > 0)`` in mode "on" and
        ``host * m_l + max(c + a m_l, b m_l)`` without overlap: the covered copies were enqueued
        during the layer before (``live.offload``: layer l+1's router on layer l's input, the
        copies behind layer l's demand copies, or at layer l's start without overlap;
        ``sim.engine``), so only the rest waits for the router, while in steady state the link
        still carries all ``(1 + x) m_l`` copies per layer (the ``b`` branch: a copy-bound link
        gains nothing from prefetch and pays for its wrong guesses). An estimate on the planner's
        assumption that layers alike follow each other (the guesses of layer l-1 fly during
        layer l-1's compute, their window ``c``); the simulator replays the recorded guesses
        exactly. On a hand-built cycle (``tests/test_sim_engine.py``) it is the engine's timeline
        exactly while the guesses fit their window, link-bound too (layer 0 priced without the
        share). With ``h = x = 0`` both forms are the ones without prefetch. With
        the share per tree size (``next_layer_nodes``) each row takes ``h`` and ``x`` at its own
        ``num_nodes`` (:meth:`next_layer_s_per_miss`). Layer 0 takes ``h = x = 0`` (no layer
        before it guesses for it: ``live.offload`` and ``sim.replay`` issue guesses into layers
        ``1..L-1`` only), its host term through ``(host_s_per_transfer - host) * m_0`` added to
        the sum (0 without next-layer prefetch, so mode "on" alone is unchanged bit for bit);
        ``specfit.decide_kernels.union_cycle_s`` does the same operations in the same order."""
        m = np.asarray(misses, dtype=np.float64)
        c = self.verify_s_array(num_nodes, context_len) / self.num_layers
        c = np.asarray(c)[..., None]
        # mode "on" without next-layer prefetch is the same form with h = x = 0 (next_layer_s_per_miss:
        # max(c, p c + T m, T m) = max(c, p c + T m), bit for bit)
        host_s, after_s, link_s = self.per_layer_s_per_miss(num_nodes)
        if self._derived[1] and self._derived[5] is not None:  # per tree size: each row's own terms
            after_s, link_s = np.asarray(after_s)[..., None], np.asarray(link_s)[..., None]
        host = host_s * m.sum(axis=-1)
        after, link = m * after_s, m * link_s
        if self._derived[1]:  # next-layer prefetch: layer 0 has no guess (h = x = 0)
            plain_host_s, plain_after_s, plain_link_s = self.layer0_s_per_miss
            after[..., 0] = m[..., 0] * plain_after_s
            link[..., 0] = m[..., 0] * plain_link_s
            host = host + (plain_host_s - host_s) * m[..., 0]
        if self.overlap_h2d:  # mode "on" (next_layer_priced excludes "ideal"; cycle_s sends "ideal" elsewhere)
            host = host + self._copy_terms[1] * np.count_nonzero(m, axis=-1)
        return self._layers_s(num_levels, c, after, link, host)

    def _layers_s(self, num_levels: Any, c: Any, after: Any, link: Any, host: Any) -> Any:
        """``draft + sum_l layer_l + host`` (s): a layer lasts ``max(c, p c + after_l, link_l)`` in
        mode "on", ``max(c + after_l, link_l)`` without overlap; ``after`` and ``link`` float[..., L]
        are the seconds of the copies waiting for the layer's router and of all its copies on the
        link (:meth:`cycle_s_layers`, :meth:`realised_cycle_s`)."""
        if self.overlap_h2d:
            per_layer = np.maximum(np.maximum(c, self.pre_router_fraction * c + after), link)
        else:
            per_layer = np.maximum(c + after, link)
        out = self.draft_s_array(num_levels) + per_layer.sum(axis=-1) + host
        return float(out) if np.ndim(out) == 0 else out

    def per_layer_s_per_miss(self, num_nodes: Any = None) -> tuple[Any, Any, Any]:
        """The ``(host, after, link)`` seconds per miss :meth:`cycle_s_layers` prices a cycle of
        ``num_nodes`` verified nodes with: :meth:`next_layer_s_per_miss` when
        :attr:`next_layer_priced`, else its ``h = x = 0`` values ``(host_s_per_transfer, T_link,
        T_link)`` (mode "on" without next-layer prefetch). ``num_nodes`` None: the pooled share's
        (what ``specfit.planner.cost_params`` holds beside the knots)."""
        if num_nodes is None or self._derived[5] is None or not self._derived[1]:
            return self._derived[4]
        return self.next_layer_s_per_miss(num_nodes)

    def next_layer_total_s(self, verify_s: Any, total_misses: Any, num_nodes: Any = None) -> Any:
        """Verification time with next-layer prefetch priced, from the TOTAL misses ``M`` of a
        cycle of ``num_nodes`` verified nodes (s; arrays broadcast): ``host * M + max(V, p V + a
        M, b M) + late_call_s * (M > 0)`` in mode "on", ``host * M + max(V + a M, b M)`` without
        overlap (:meth:`next_layer_s_per_miss` at ``num_nodes``; None: the pooled share's, each
        term no more than layer 0's, which has no guess: ``host_s_per_transfer, T_link,
        T_link``). A LOWER bound on :meth:`cycle_s_layers`' form at the same size for any split
        of ``M`` over the layers (a sum of maxima is at least the maximum of the sums), as
        :meth:`overlap_on_total_s`."""
        v = np.asarray(verify_s, dtype=np.float64)
        m = np.asarray(total_misses, dtype=np.float64)
        host_s, after_s, link_s = (
            np.minimum(a, b) for a, b in zip(self.next_layer_s_per_miss(num_nodes), self.layer0_s_per_miss)
        )
        if self.overlap_h2d:
            both = np.maximum(np.maximum(v, self.pre_router_fraction * v + after_s * m), link_s * m)
            out = host_s * m + both + self._copy_terms[1] * (m > 0)
        else:
            out = host_s * m + np.maximum(v + after_s * m, link_s * m)
        return float(out) if np.ndim(out) == 0 else out

    def prefetched_total_s(self, verify_s: Any, total_misses: Any) -> Any:
        """Verification time when the subtree's ``M`` predicted misses were all prefetched from the
        draft (s; arrays broadcast): ``max(V + host * M, q * V + T_link * M)``, ``q = (1 -
        pre_router_fraction) / L`` without overlap (the last layer's experts compute after the last
        copy lands), 0 with overlap. A lower bound on :meth:`prefetched_cycle_s`'s per-layer
        pipeline (the forward starts once every copy is placed; the link carries them one after
        the other), what the planner's exact search maximises, as :meth:`overlap_on_total_s`."""
        v = np.asarray(verify_s, dtype=np.float64)
        m = np.asarray(total_misses, dtype=np.float64)
        out = np.maximum(v + self.host_s_per_transfer * m, self.prefetch_tail_fraction * v + self.link_s_per_transfer * m)
        return float(out) if np.ndim(out) == 0 else out

    @property
    def least_verify_share(self) -> float:
        """The least share of ``verify_s_per_node`` that one more verified node adds to ANY cycle
        price of this model (a fraction): 1 without overlap (``draft + V + H``); in mode "on"
        ``pre_router_fraction`` (a copy-bound layer ``max(c, p c + T_link m)`` hides the rest of its
        compute); 0 in mode "ideal" (``max(V, H)`` hides all of it when H dominates); with
        ``draft_prefetch`` at most :attr:`prefetch_tail_fraction` (the prefetch pipeline hides the
        compute that precedes the last landing). More nodes never lower the misses' part, so
        ``least_verify_share * verify_s_per_node`` per node is a lower bound on the time they add:
        SpecFit's ``stopping="bound"`` rule (``specfit.policies``) needs exactly that. With
        next-layer prefetch priced it is 0: a layer whose link carries more than its compute
        (``b m_l`` of :meth:`cycle_s_layers`) hides all of it."""
        if self.next_layer_priced:
            return 0.0
        share = 1.0 if not self.overlap_h2d else (self.pre_router_fraction if self.overlap_mode == "on" else 0.0)
        return min(share, self.prefetch_tail_fraction) if self.draft_prefetch else share

    @property
    def least_s_per_miss(self) -> float:
        """Without overlap, the least seconds one more predicted miss adds to any cycle price of
        this model, whatever the verified nodes add (a lower bound, with
        :attr:`least_verify_share`, for SpecFit's ``stopping="bound"`` rule): :attr:`priced_s_per_miss`;
        with next-layer prefetch priced the least ``host + a`` of :meth:`next_layer_s_per_miss`
        over every tree size (``max(c + a m, b m)`` grows by at least ``min(a, b) = a`` per miss;
        ``host + a`` is affine in ``h`` and ``x``, so between knots it is least at a knot), and no
        more than ``host_s_per_transfer`` (layer 0's placing: no guess, no waste there) plus the
        least ``a`` (:attr:`next_layer_least_s_per_miss`), the totals form's per-miss price."""
        if self.next_layer_priced:
            return self._derived[7]
        return self._copy_terms[2]

    @property
    def prefetch_tail_fraction(self) -> float:
        """``q`` of :meth:`prefetched_total_s`: the share of the verify time that follows the last
        prefetched copy's landing at the least (0 with overlap)."""
        return 0.0 if self.overlap_h2d else (1.0 - self.pre_router_fraction) / self.num_layers

    def prefetched_cycle_s(
        self, num_levels: int, num_nodes: int, context_len: int, misses_per_layer: Any, demand_per_layer: Any = None,
        ahead_per_layer: Any = None, needed_per_layer: Any = None,
    ) -> float:  # fmt: skip
        """Cycle time (s) when every predicted miss ``misses_per_layer`` (float[L]) is prefetched
        from the draft as the engines do (``--prefetch draft``; ``sim.engine``): placed by the
        compute stream layer by layer before the forward (``host_s_per_transfer`` each), each
        layer's copies enqueued once placed on an idle FIFO link (``T_link`` each; the last of
        layer ``l`` lands at ``A_l = max(A_{l-1}, host * sum_{k <= l} m_k) + T_link * m_l``), and
        waited for only where a layer's experts need them: the forward starts at ``host * M``;
        with layer compute ``c`` of which ``p c`` before the router, layer ``l`` begins its
        experts at ``b_l = e_{l-1} + p c`` and ends at ``max(b_l, A_l) + (1 - p) c`` without
        overlap, ``max(b_l + (1 - p) c, A_l) + late_call_s`` when ``A_l > b_l`` (one late call
        assumed) with overlap. Assumes what the planner assumes: the predictions are right, they fit the cache
        and the link is idle when the forward starts (the estimate of prefetch in
        SP-MoE-style systems; the simulator gives the exact value).

        A realised cycle (:meth:`realised_cycle_s`) adds, each optional (float[L]):

        - ``demand_per_layer``: the demand misses the prefetch did not cover: layer ``l``'s are
          placed after its router (``host_s_per_transfer`` each, so its experts begin ``host *
          d_l`` later) and copied BEHIND every copy already on the FIFO link, as ``sim.engine``
          and ``live.offload`` do; the layer waits for them as for its prefetched experts.
        - ``ahead_per_layer``: next-layer prefetch copies into layer ``l`` (``l >= 1``), issued
          during layer ``l - 1`` as the engines issue them: placed (``host`` each) and enqueued
          behind layer ``l - 1``'s demand copies before its first kernel call (overlap), or once
          its wait is over (no overlap); layer ``l - 1``'s experts begin after that placing.
        - ``needed_per_layer``: how many of layer ``l``'s copies, draft then next-layer in issue
          order, the layer waits for (those up to the last one whose expert it hits: a wrong
          guess occupies the link and the placing but is never waited for; issue 13: waiting
          for all of them over-priced wrong guesses). None: all of the draft copies, none of the
          next-layer ones.

        None for all three: no demand miss, no next-layer copy (the planner's assumption), the
        form above.

        Every batch (a layer's draft, demand or next-layer copies) is placed as the engines place
        it: with ``placing_after_enqueue_s_per_transfer`` ``P`` > 0 it is enqueued after ``host -
        P`` per copy and copy ``k`` lands at ``max(first + k T_link, enqueued + k P)``
        (``sim.engine._batch_landings``); with ``P = 0`` the forms above, bit for bit."""
        m = np.asarray(misses_per_layer, dtype=np.float64)
        c = self.verify_s(num_nodes, context_len) / self.num_layers
        pre, rest = self.pre_router_fraction * c, (1.0 - self.pre_router_fraction) * c
        host, per_copy, num_layers = self.host_s_per_transfer, self.link_s_per_transfer, self.num_layers
        placing = self.placing_after_enqueue_s_per_transfer

        def landing(first: float, enqueued: float, k: float) -> float:
            """Copy ``k`` (1-based) of a batch enqueued at ``enqueued`` that the link takes at
            ``first``: ``max(first + k T_link, enqueued + k placing)`` (``sim.engine._batch_landings``)."""
            if placing > 0.0:
                return max(first + per_copy * k, enqueued + placing * k)
            return first + per_copy * k

        placed = np.cumsum(m) * host
        needed = m if needed_per_layer is None else np.asarray(needed_per_layer, dtype=np.float64)
        link = 0.0
        arrivals = []  # the needed prefetch copies' last landing: they go first on the link, in layer order
        for layer in range(num_layers):
            landed = 0.0
            if m[layer] > 0:
                enqueued = float(placed[layer]) - placing * float(m[layer])  # P = 0: the placing's end
                first = max(link, enqueued)
                link = landing(first, enqueued, float(m[layer]))
                if needed[layer] > 0:
                    landed = landing(first, enqueued, float(min(needed[layer], m[layer])))
            arrivals.append(landed)
        demand = None if demand_per_layer is None else np.asarray(demand_per_layer, dtype=np.float64)
        ahead = None if ahead_per_layer is None else np.asarray(ahead_per_layer, dtype=np.float64)
        ahead_first = [0.0] * num_layers  # when each layer's next-layer copies start on the link
        ahead_enqueued = [0.0] * num_layers
        end = float(placed[-1])
        for layer in range(num_layers):
            landed = arrivals[layer]
            if ahead is not None and needed[layer] > m[layer]:  # a next-layer copy needed
                k = float(needed[layer] - m[layer])
                landed = max(landed, landing(ahead_first[layer], ahead_enqueued[layer], k))
            begin = end + pre
            if demand is not None and demand[layer] > 0:  # placed after the router, copied behind the link's queue
                d = float(demand[layer])
                enqueued = begin + (host - placing) * d
                begin = begin + host * d
                link = landing(max(link, enqueued), enqueued, d)
                landed = max(landed, link)
            n_next = 0.0 if ahead is None or layer + 1 == num_layers else float(ahead[layer + 1])
            if not self.overlap_h2d:
                if n_next > 0:  # issued once the layer's wait is over
                    begin = max(begin, landed)
                    ahead_enqueued[layer + 1] = begin + (host - placing) * n_next
                    ahead_first[layer + 1] = max(ahead_enqueued[layer + 1], link)
                    link = landing(ahead_first[layer + 1], ahead_enqueued[layer + 1], n_next)
                    end = begin + host * n_next + rest
                else:
                    end = max(begin, landed) + rest
                continue
            if n_next > 0:  # placed and enqueued behind the layer's demand copies, before its experts
                ahead_enqueued[layer + 1] = begin + (host - placing) * n_next
                begin = begin + host * n_next
                ahead_first[layer + 1] = max(ahead_enqueued[layer + 1], link)
                link = landing(ahead_first[layer + 1], ahead_enqueued[layer + 1], n_next)
            if landed > begin:
                end = max(begin + rest, landed) + self.late_call_s
            else:
                end = begin + rest
        return float(self.draft_s(num_levels) + end)

    def plan_cycle_s(self, num_levels: int, num_nodes: int, context_len: int, misses_per_layer: Any) -> float:
        """The planner's price of a subtree with per-node predicted misses ``misses_per_layer``:
        :meth:`prefetched_cycle_s` with ``draft_prefetch``, else :meth:`cycle_s`
        (``specfit.context.evaluate_nodes``)."""
        if self.draft_prefetch:
            return self.prefetched_cycle_s(num_levels, num_nodes, context_len, misses_per_layer)
        return self.cycle_s(num_levels, num_nodes, context_len, misses_per_layer)

    def cycle_s(self, num_levels: int, num_nodes: int, context_len: int, misses_per_layer: Any) -> float:
        """Predicted cycle time (s); see the module docstring for the three forms and next-layer
        prefetch's (with a scalar miss total, mode "on" and next-layer prefetch take their lower
        bounds, :meth:`overlap_on_total_s` and :meth:`next_layer_total_s`)."""
        misses = np.asarray(misses_per_layer) if self.per_layer_priced else None  # the others need the total only
        if misses is not None and misses.ndim == 1:
            self.h2d_s(misses)  # checks the counts
            return self.cycle_s_layers(num_levels, num_nodes, context_len, misses)
        if misses is not None:  # a scalar total
            self.h2d_s(misses)  # checks it
            verify = self.verify_s(num_nodes, context_len)
            if self.next_layer_priced:
                return float(self.draft_s(num_levels) + self.next_layer_total_s(verify, float(misses), num_nodes))
            return float(self.draft_s(num_levels) + self.overlap_on_total_s(verify, float(misses)))
        return self.combine_s(
            self.draft_s(num_levels), self.verify_s(num_nodes, context_len), self.h2d_s(misses_per_layer)
        )

    def realised_cycle_s(
        self, num_levels: int, num_nodes: int, context_len: int, demand_misses_per_layer: Any,
        prefetched_per_layer: Any = None,
    ) -> float:  # fmt: skip
        """A realised cycle's price (s) from its DEMAND misses (int[L], those its cache access
        still missed after any prefetch) and, with next-layer prefetch priced, the prefetch
        copies the cycle issued into each layer (``prefetched_per_layer`` int[L],
        ``specfit.prefetch.PrefetchLedger.layer_issued`` over the cycle): :meth:`cycle_s_layers`'
        form with the realised copies in place of next-layer prefetch's share and waste: per
        layer the demand misses wait for the router (``M_l * T_link``) and all the layer's copies
        occupy the link (``(M_l + P_l) * T_link``) and the compute stream's placing, the late call
        where ``M_l > 0``. Issue 13: scaling the demand misses back by ``1 / (1 - h)`` instead
        inflated every layer the guesses cover less than ``h`` (layer 0 has no layer before it):
        at 64 GB/s, cache 8, overlap on, on the shipped sample, a root cycle was priced 1.20x its
        simulated time and the guard saw drafting win where it lost. Without next-layer prefetch
        priced (or ``prefetched_per_layer`` None) :meth:`cycle_s` of the demand misses. What
        ``SpecFitPolicy.observe_cycle`` prices live and simulated cycles with, so both sides'
        guards see the same seconds.

        With draft prefetch (``draft_prefetch``, next-layer prefetch not priced, not mode "ideal")
        the cycle's prefetch copies ``prefetched_per_layer`` were all enqueued before the forward:
        :meth:`prefetched_cycle_s` of them with the demand misses queued behind them. Issue 13:
        priced as :meth:`cycle_s` of the demand misses alone, on the shipped sample (SpecFit,
        predictor ``recent``, cache 8, 4-16 GB/s, 19 prefetch copies per root cycle) root cycles
        were priced 0.51-0.59 of their simulated time and drafted ones 0.80-0.82.

        ``prefetched_per_layer`` int[3, L] (``PrefetchLedger.copies_since``: draft copies,
        next-layer copies, copies waited for) prices the realised timeline exactly as the engines
        run it, next-layer prefetch not priced by a share and not mode "ideal": with draft
        prefetch, or when the cycle issued next-layer copies, :meth:`prefetched_cycle_s` of the
        draft copies with the demand misses, the next-layer copies issued mid-forward and only
        the copies each layer waits for (issue 13: an int[L] of all copies priced every
        next-layer copy of ``--prefetch both`` without a share as placed before the forward, and
        made a layer wait for the copies of wrong guesses too; a next-layer run without a share
        priced none of its copies). With a share priced the two kinds of copies count alike (the
        form above); int[L] is all draft copies, each waited for (the form before). With
        next-layer prefetch and a placing after the enqueue ``P > 0`` a cycle that issued no copy
        takes :meth:`prefetched_cycle_s` too (rev2: it took :meth:`cycle_s`, which priced each
        demand miss at ``host + T_link`` while the engines overlap ``P`` of it with the link, so
        one guard mixed two pricings; ``P = 0`` unchanged bit for bit)."""
        prefetched = None if prefetched_per_layer is None else np.asarray(prefetched_per_layer)
        if prefetched is not None and not self.next_layer_priced and not (self.overlap_h2d and self.overlap_mode == "ideal"):
            if prefetched.ndim == 2:  # (draft, next-layer, waited for): PrefetchLedger.copies_since
                # with a placing after the enqueue every cycle of a next-layer run takes the
                # engines' timeline, not only those that issued copies (one pricing per guard)
                timeline = self.draft_prefetch or (self.next_layer_prefetch and self.placing_after_enqueue_s_per_transfer > 0.0)
                if timeline or prefetched[1].any():
                    return self.prefetched_cycle_s(
                        num_levels, num_nodes, context_len, prefetched[0], demand_misses_per_layer,
                        prefetched[1], prefetched[2],
                    )  # fmt: skip
            elif self.draft_prefetch:
                return self.prefetched_cycle_s(num_levels, num_nodes, context_len, prefetched, demand_misses_per_layer)
        if not self.next_layer_priced or prefetched is None:
            return self.cycle_s(num_levels, num_nodes, context_len, demand_misses_per_layer)
        if prefetched.ndim == 2:  # every copy issued into the layer, draft and next-layer alike
            prefetched = prefetched[0] + prefetched[1]
        demand = np.asarray(demand_misses_per_layer, dtype=np.float64)
        copies = demand + np.asarray(prefetched, dtype=np.float64)
        c = self.verify_s(num_nodes, context_len) / self.num_layers
        link = self._copy_terms[0]
        host = self.host_s_per_transfer * copies.sum()
        if self.overlap_h2d:
            host = host + self._copy_terms[1] * np.count_nonzero(demand)
        return float(self._layers_s(num_levels, c, demand * link, copies * link, host))

    # ---- helpers -----------------------------------------------------------------------------
    def with_bandwidth(self, bytes_per_s: float) -> CycleCostModel:
        """Copy with ``h2d_bytes_per_s`` replaced."""
        return dataclasses.replace(self, h2d_bytes_per_s=bytes_per_s)

    def with_compute_speed(self, factor: float) -> CycleCostModel:
        """Copy priced for a machine whose compute takes ``factor`` times as long (1.2 = 20 %
        slower; dimensionless, finite, > 0): every compute term is multiplied by ``factor`` --
        ``draft_s_per_level``, ``draft_base_s``, ``verify_base_s``, ``verify_s_per_node``,
        ``verify_s_per_context_token``, ``late_call_s`` and the compute stream's share of each
        miss ``host_s_per_transfer`` (which ``h2d_s_per_transfer`` contains, so it grows by the
        same seconds) with its part after the enqueue ``placing_after_enqueue_s_per_transfer`` -- while the link's wire time (``h2d_bytes_per_s``, the link's share of
        ``h2d_s_per_transfer``: :attr:`link_s_per_transfer`) and every other field stay as they
        are. ``analysis.validate`` prices each cell at its runs' measured machine speed with it
        (the speed probe of ``live.record``; README, validate).

        Raises:
            ValueError: ``factor`` not a finite number > 0.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float, np.floating, np.integer)):
            raise ValueError(f"compute speed factor: expected a finite number > 0, got {factor!r}")
        k = float(factor)
        if not (math.isfinite(k) and k > 0):
            raise ValueError(f"compute speed factor: expected a finite number > 0, got {factor!r}")
        host = self.host_s_per_transfer * k
        return dataclasses.replace(
            self,
            **{name: getattr(self, name) * k for name in COMPUTE_FIELDS},
            host_s_per_transfer=host,
            h2d_s_per_transfer=(self.h2d_s_per_transfer - self.host_s_per_transfer) + host,
            placing_after_enqueue_s_per_transfer=self.placing_after_enqueue_s_per_transfer * k,
        )

    def with_expert_bytes(self, num_bytes: int) -> CycleCostModel:
        """Copy with ``expert_bytes`` replaced."""
        return dataclasses.replace(self, expert_bytes=num_bytes)

    @classmethod
    def for_shape(
        cls,
        shape: Any,
        *,
        bandwidth_gb_per_s: float = 25.0,
        h2d_s_per_transfer: float = 10e-6,
        draft_s_per_level: float = 2e-3,
        draft_base_s: float = 0.0,
        verify_base_s: float = 20e-3,
        verify_s_per_node: float = 0.2e-3,
        verify_s_per_context_token: float = 0.0,
        overlap_h2d: bool = False,
    ) -> CycleCostModel:
        """A preset for a :class:`specfit.shapes.ModelShape` (timings are placeholders to be calibrated).

        ``bandwidth_gb_per_s`` is in GB/s (1 GB = 1e9 bytes), converted via :mod:`specfit.units`.
        """
        return cls(
            draft_s_per_level=draft_s_per_level,
            draft_base_s=draft_base_s,
            verify_base_s=verify_base_s,
            verify_s_per_node=verify_s_per_node,
            verify_s_per_context_token=verify_s_per_context_token,
            h2d_bytes_per_s=gb_per_s_to_bytes_per_s(bandwidth_gb_per_s),
            h2d_s_per_transfer=h2d_s_per_transfer,
            expert_bytes=shape.bytes_per_expert,
            num_layers=shape.num_layers,
            overlap_h2d=overlap_h2d,
            source=f"preset:{shape.name}",
        )

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: the fields, their ``units`` and the format tag (``inf`` as the string "inf")."""
        out: dict[str, Any] = {"format": COST_MODEL_FORMAT, "version": COST_MODEL_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = "inf" if isinstance(value, float) and math.isinf(value) else value
        out["units"] = dict(FIELD_UNITS)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "cost model") -> CycleCostModel:
        """Inverse of :meth:`to_dict`.

        Fields of versions 4-7 named ``*_frac(s)`` load under their current names
        (:data:`FORMER_FIELD_NAMES`). Version 1 files (before ``draft_base_s``) load with ``draft_base_s = 0`` and a
        ``UserWarning``; from version 2 every numeric field is required. Versions 5-6 held the
        next-layer share and waste averaged over every layer: they load as shares of layers
        ``1..L-1`` (:func:`share_of_guessed_layers`, exact when layers miss alike).

        Raises:
            ValueError: wrong format tag or an unknown ``version``, missing or unknown field, a
                stated unit differing from :data:`FIELD_UNITS`, or a bad value; the message names
                ``where`` and the field.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        data = _current_names(data)
        if data.get("format", COST_MODEL_FORMAT) != COST_MODEL_FORMAT:
            raise ValueError(
                f"{where}: field 'format': expected {COST_MODEL_FORMAT!r}, got {data.get('format')!r}"
            )
        units = data.get("units", {})
        if not isinstance(units, dict):
            raise ValueError(f"{where}: field 'units': expected an object mapping field -> unit")
        for name, unit in units.items():
            if name in FIELD_UNITS and unit != FIELD_UNITS[name]:
                raise ValueError(
                    f"{where}: field {name!r}: unit {unit!r} not supported, expected {FIELD_UNITS[name]!r}"
                )
        version = data.get("version", COST_MODEL_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= COST_MODEL_VERSION:
            raise ValueError(
                f"{where}: field 'version': expected 1..{COST_MODEL_VERSION} (this toolkit's cost "
                f"model format), got {version!r}; a newer file needs a newer toolkit"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names) - {"format", "version", "units"})
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; expected {names}")
        optional = ("overlap_h2d", "source", "overlap_mode", "draft_prefetch", "next_layer_prefetch")
        optional += ("draft_base_s",) if version == 1 else ()
        optional += ("host_s_per_transfer", "late_call_s") if version <= 2 else ()
        optional += ("pre_router_fraction",) if version <= 3 else ()
        optional += ("next_layer_cover_fraction", "next_layer_waste_per_miss") if version <= 4 else ()
        optional += ("next_layer_nodes", "next_layer_cover_fractions", "next_layer_waste_per_misses") if version <= 5 else ()
        optional += ("placing_after_enqueue_s_per_transfer",) if version <= 8 else ()
        missing = [n for n in names if n not in optional and n not in data]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        if version == 1 and "draft_base_s" not in data:
            warnings.warn(
                f"{where}: a version-1 cost model has no draft_base_s; it is taken as 0 s (a drafting "
                "cycle pays no fixed cost). Refit with `python -m calibration.fit` to price it.",
                UserWarning,
                stacklevel=2,
            )
        if version <= 3 and data.get("overlap_h2d") and data.get("overlap_mode") == "on":
            warnings.warn(_no_pre_router_text(where, version), UserWarning, stacklevel=2)
        kwargs = {n: data[n] for n in names if n in data}
        if version in (5, 6) and isinstance(kwargs.get("num_layers"), int):  # shares of every layer -> of 1..L-1
            layers = kwargs["num_layers"]

            def scaled(v: Any, cap: bool) -> Any:  # an invalid share stays as written, for the checks to name
                return v if cap and not 0.0 <= v <= 1.0 else share_of_guessed_layers(v, layers, cap)

            rescaled = False
            for name, cap in (("next_layer_cover_fraction", True), ("next_layer_waste_per_miss", False)):
                if _is_number(kwargs.get(name)):
                    rescaled |= kwargs[name] != 0 and layers > 1
                    kwargs[name] = scaled(kwargs[name], cap)
            for name, cap in (("next_layer_cover_fractions", True), ("next_layer_waste_per_misses", False)):
                if isinstance(kwargs.get(name), (list, tuple)) and all(_is_number(v) for v in kwargs[name]):
                    rescaled |= any(v != 0 for v in kwargs[name]) and layers > 1
                    kwargs[name] = [scaled(v, cap) for v in kwargs[name]]
            if rescaled and kwargs.get("next_layer_prefetch"):
                warnings.warn(
                    f"{where}: a version-{version} cost model's next-layer share and waste are averaged over "
                    f"every layer; read as shares of layers 1..L-1 (scaled by L / (L - 1) = {layers}/{layers - 1}, "
                    "exact when every layer misses alike). Refit with `python -m calibration.fit`.",
                    UserWarning,
                    stacklevel=2,
                )
        if kwargs.get("h2d_bytes_per_s") == "inf":
            kwargs["h2d_bytes_per_s"] = math.inf
        try:
            return cls(**kwargs)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def save(self, path: str | Path) -> Path:
        """Write the JSON file (parent folders created) and return its path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> CycleCostModel:
        """Read a JSON file written by :meth:`save` (or by calibration).

        Raises:
            ValueError: unreadable file, invalid JSON or a bad field (the message names the file).
        """
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as exc:
            raise ValueError(f"{p}: cannot read cost model: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: invalid JSON at {json_error_text(exc)}") from None
        return cls.from_dict(data, where=str(p))
