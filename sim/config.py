"""Configuration of one simulated replay (:class:`SimConfig`) and the names it accepts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.engine import ENGINES
from specfit.cost import CycleCostModel
from specfit.prefetch import uses_draft, uses_next_layer

# CLI spellings -> specfit.policies names (issue 6: "autoregressive, top-N, SpecFit").
POLICY_ALIASES = {
    "autoregressive": "ar",
    "ar": "ar",
    "chain": "chain",
    "top-n": "topn",
    "topn": "topn",
    "specfit": "specfit",
    "cascade": "cascade",
    "specfit-oracle-accept": "specfit-oracle-accept",
    "specfit-oracle-experts": "specfit-oracle-experts",
    "specfit-oracle": "specfit-oracle",
    "moespec": "moespec",
    "moe-spec": "moespec",
}
# lossy baselines: reported as lossy, never in a lossless comparison (sim.sweep --lossy)
LOSSY_POLICIES = ("moespec",)


def expert_budget_or_default(expert_budget: int | None, top_k: int) -> int:
    """MoE-Spec's verification expert budget B per layer (experts): ``expert_budget`` when given,
    else ``2 * top_k`` (the default of ``sim.sweep --expert-budget``)."""
    return int(expert_budget or 2 * int(top_k))
DEFAULT_POLICIES = ("ar", "topn", "specfit")
# SpecFit fed oracle inputs (issue 12, decision regret): (recorded accepted flags as acceptance,
# recorded experts of every draft node); simulator only, never a policy a user can run live
ORACLE_VARIANTS = {
    "specfit-oracle-accept": (True, False),
    "specfit-oracle-experts": (False, True),
    "specfit-oracle": (True, True),
}
# the lossless baselines SpecFit must not fall below (issue 12, "a planner that never loses")
#: One line per oracle variant for ``--help``.
ORACLE_VARIANT_HELP = {
    "specfit-oracle-accept": "SpecFit given the recorded accepted flags as its acceptance (regret "
    "decomposition, regret_* columns)",
    "specfit-oracle-experts": "SpecFit given the recorded experts of every draft node",
    "specfit-oracle": "SpecFit given both",
}
BASELINE_POLICIES = ("ar", "chain", "topn", "cascade")


def base_policy(name: str) -> str:
    """The ``specfit.policies`` name behind a (canonical) sim policy: ``specfit`` for the oracle variants."""
    if name in ORACLE_VARIANTS:
        return "specfit"
    return "topn" if name == "moespec" else name


def canonical_policy(name: str) -> str:
    """Map a policy spelling (``"autoregressive"``, ``"top-N"``, ``"SpecFit"``) to its specfit name.

    Raises:
        ValueError: unknown name, listing the accepted spellings.
    """
    key = str(name).strip().lower()
    if key not in POLICY_ALIASES:
        raise ValueError(f"policy: expected one of {sorted(POLICY_ALIASES)}, got {name!r}")
    return POLICY_ALIASES[key]


def overlap_mode(value: bool | str, name: str = "overlap") -> str:
    """``"off"``, ``"on"`` or ``"ideal"`` from a mode name or a bool (``True`` = ``"on"``).

    Raises:
        ValueError: any other value, naming ``name``.
    """
    if isinstance(value, (bool, np.bool_)):
        return "on" if value else "off"
    if value not in ("off", "on", "ideal"):
        raise ValueError(f"{name}: expected 'off', 'on' or 'ideal', got {value!r}")
    return str(value)


def prefetch_mode(value: bool | str, name: str = "prefetch") -> str:
    """One of ``specfit.prefetch.PREFETCH_MODES`` (``"none"``, ``"draft"``, ``"next-layer"``,
    ``"both"``) from a mode name or a bool (``True`` = ``"draft"``, ``False`` = ``"none"``; also
    ``"on"``/``"off"``, the names of the earlier on/off switch).

    Raises:
        ValueError: any other value, naming ``name``.
    """
    from specfit.prefetch import PREFETCH_MODES

    if isinstance(value, (bool, np.bool_)):
        return "draft" if value else "none"
    value = {"on": "draft", "off": "none"}.get(value, value)
    if value not in PREFETCH_MODES:
        raise ValueError(f"{name}: expected one of {list(PREFETCH_MODES)}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class SimConfig:
    """One replay configuration: tree policy, expert cache, predictor, link and cost model.

    Attributes:
        cost: the cycle cost model (bandwidth, expert bytes, compute costs); its ``num_layers``
            must equal the trace's. Its ``overlap_h2d`` is replaced by ``overlap`` and its
            ``draft_prefetch`` by ``prefetch`` (draft or both), its ``next_layer_prefetch`` by
            ``prefetch`` (next-layer or both), as ``live.spec.session`` sets them.
        policy: tree policy (any spelling accepted by :func:`canonical_policy`); the
            :data:`ORACLE_VARIANTS` run SpecFit with the recorded acceptance and/or experts.
        cache_capacity_per_layer: experts the device caches per layer (count, >= 0).
        cache_policy: ``specfit.cache`` policy name (``"lru"``, ``"lfu"``, ``"static"``, ...).
        predictor: ``specfit.predictors`` name used by the planner and by prefetch.
        overlap: ``"off"``, ``"on"`` (as the live engine's ``--overlap on``) or ``"ideal"`` (a
            bound: every demand copy enqueued when verification starts), see :mod:`sim.engine`;
            ``False``/``True`` are read as ``"off"``/``"on"``.
        prefetch: ``"none"``, ``"draft"`` (when the subtree is chosen, make resident the
            experts the predictor expects its nodes to need), ``"next-layer"`` (after each
            layer's router, the recorded next-layer guesses of the verified nodes: needs a dense
            trace with ``next_layer_expert_ids``) or ``"both"``, as ``live.record --prefetch``
            (``specfit.prefetch``); ``False``/``True`` are read as ``"none"``/``"draft"``.
        engine: ``"auto"``, ``"fast"`` or ``"simpy"`` (same results; fast needs concurrency 1).
        link_concurrency: expert copies in flight at once (copy engines; the wire is shared).
        decision_s: modelled planner time per cycle (s, >= 0) of a drafting policy; ``ar`` pays
            none (as live, where autoregressive decoding asks no planner). A constant rather than
            the planner's measured wall time, so the same seed gives byte-identical results.
        history_tokens: committed tokens whose experts the predictor sees (count, >= 1; 8 as
            ``live.spec.engine``'s ``recent_window``).
        max_requests, max_positions: replay at most this many requests / generated positions
            per request (``None`` = all).
        seed: seed for anything random (predictors that sample).
        policy_options: extra keyword arguments for ``make_tree_policy`` as ``(name, value)`` pairs,
            e.g. ``(("stopping", "bound"),)`` for ``specfit`` (checked by building the policy once).
        record_cycles: keep one :class:`traces.schema.CycleRecord` per cycle in the result.
        expert_budget: ``moespec`` only: experts verified per layer (MoE-Spec's verification
            budget, the top-B by summed router weight over the verified nodes; lossy); ``None``:
            twice the trace's top-k.
        acceptance: ``specfit.acceptance.AcceptanceCalibration.to_dict()`` (e.g. the
            ``acceptance.json`` of ``calibration.fit``) mapping draft path probability to
            acceptance for the planner, or ``None``: draft path probabilities as they are.
        compute_speed: a dimensionless time factor: how long the machine's compute takes
            relative to ``cost``'s (1.2 = 20 % slower; finite, > 0; default 1): the replay times every cycle with
            ``cost.with_compute_speed(compute_speed)`` while its planner keeps pricing with
            ``cost``, as a live planner keeps its cost file while the machine's speed drifts
            (``analysis.validate`` sets it from the runs' speed probe).
        planner_deadline_fraction: SpecFit policies only (``specfit`` and its oracle variants):
            give each exact search the live engine's deadline rule, this fraction of the
            context's least predicted cycle time (``SpecFitPolicy(deadline_fraction=...)``; live
            uses ``specfit.policies.LIVE_DEADLINE_FRACTION``); finite, >= 0. The deadline reads
            this machine's wall clock, so a replay with one is NOT deterministic: which searches
            it cuts depends on this machine's speed and load. ``None`` (default): no deadline,
            every search runs to the end (deterministic). Either way the totals count the
            selected plans a deadline cut (``planner_deadline_hits``) and their mean gap.

    Raises:
        ValueError: a bad field, naming it.
    """

    cost: CycleCostModel
    policy: str = "specfit"
    cache_capacity_per_layer: int = 32
    cache_policy: str = "lru"
    predictor: str = "union-size"
    overlap: bool | str = "off"
    prefetch: bool | str = "none"
    engine: str = "auto"
    link_concurrency: int = 1
    decision_s: float = 0.0
    history_tokens: int = 8
    max_requests: int | None = None
    max_positions: int | None = None
    seed: int = 0
    policy_options: tuple[tuple[str, Any], ...] = field(default=())
    record_cycles: bool = True
    acceptance: dict[str, Any] | None = None
    expert_budget: int | None = None
    compute_speed: float = 1.0
    planner_deadline_fraction: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cost, CycleCostModel):
            raise ValueError(f"SimConfig.cost: expected a CycleCostModel, got {type(self.cost).__name__}")
        object.__setattr__(self, "policy", canonical_policy(self.policy))
        for name, minimum in (
            ("cache_capacity_per_layer", 0),
            ("link_concurrency", 1),
            ("history_tokens", 1),
            ("seed", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"SimConfig.{name}: expected an integer >= {minimum}, got {value!r}")
        for name in ("max_requests", "max_positions", "expert_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"SimConfig.{name}: expected an integer >= 1 or None, got {value!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"SimConfig.engine: expected one of {list(ENGINES)}, got {self.engine!r}")
        if self.engine == "fast" and self.link_concurrency != 1:
            raise ValueError("SimConfig.engine: 'fast' needs link_concurrency 1; use 'simpy' or 'auto'")
        if not (isinstance(self.decision_s, (int, float)) and 0 <= self.decision_s < float("inf")):
            raise ValueError(
                f"SimConfig.decision_s: expected a finite number >= 0 (s), got {self.decision_s!r}"
            )
        speed = self.compute_speed
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (0 < speed < float("inf")):
            raise ValueError(f"SimConfig.compute_speed: expected a finite number > 0, got {speed!r}")
        object.__setattr__(self, "compute_speed", float(speed))
        if self.acceptance is not None:
            from specfit.acceptance import AcceptanceCalibration

            try:
                AcceptanceCalibration.from_dict(self.acceptance)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"SimConfig.acceptance: {exc}") from None
        object.__setattr__(self, "policy_options", tuple((str(k), v) for k, v in self.policy_options))
        fraction = self.planner_deadline_fraction
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < float("inf"):
                raise ValueError(
                    f"SimConfig.planner_deadline_fraction: expected a finite number >= 0 or None, got {fraction!r}"
                )
            if base_policy(self.policy) != "specfit":
                raise ValueError(
                    f"SimConfig.planner_deadline_fraction: only SpecFit searches (policy {self.policy!r} has no search)"
                )
            if any(k == "deadline_fraction" for k, _ in self.policy_options):
                raise ValueError("SimConfig.planner_deadline_fraction: give it here or in policy_options, not both")
            object.__setattr__(self, "planner_deadline_fraction", float(fraction))
        if self.policy_options:
            from specfit.policies import make_tree_policy

            try:
                make_tree_policy(base_policy(self.policy), **dict(self.policy_options))
            except ValueError as exc:
                raise ValueError(f"SimConfig.policy_options: {exc}") from None
        object.__setattr__(self, "overlap", overlap_mode(self.overlap, "SimConfig.overlap"))
        object.__setattr__(self, "prefetch", prefetch_mode(self.prefetch, "SimConfig.prefetch"))
        mode = "on" if self.overlap == "on" else "ideal"
        wanted = (self.overlap != "off", mode, uses_draft(self.prefetch), uses_next_layer(self.prefetch))
        have = (self.cost.overlap_h2d, self.cost.overlap_mode, self.cost.draft_prefetch, self.cost.next_layer_prefetch)
        if have != wanted:
            cost = dataclasses.replace(
                self.cost, overlap_h2d=wanted[0], overlap_mode=mode, draft_prefetch=wanted[2], next_layer_prefetch=wanted[3]
            )
            object.__setattr__(self, "cost", cost)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (the cost model via its own ``to_dict``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cost"}
        out["policy_options"] = [list(kv) for kv in self.policy_options]
        out["cost"] = self.cost.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SimConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: unknown or bad field, naming it.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"SimConfig: unknown field(s) {unknown}; expected {sorted(names)}")
        kwargs = dict(data)
        kwargs["cost"] = CycleCostModel.from_dict(data["cost"], where="SimConfig.cost")
        kwargs["policy_options"] = tuple(tuple(kv) for kv in data.get("policy_options", ()))
        return cls(**kwargs)
