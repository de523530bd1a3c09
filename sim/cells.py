"""Sweep cells: one replay configuration each, identified by a hash of its content.

A cell is a plain JSON-able :class:`CellSpec`; :func:`run_cell` (a top-level function, so process
pools and Ray can ship it) opens the trace (once per worker process), builds the
:class:`sim.config.SimConfig` and returns one tidy result row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.config import LOSSY_POLICIES, SimConfig, base_policy, canonical_policy, overlap_mode, prefetch_mode
from specfit.cost import CycleCostModel
from specfit.units import gb_per_s_to_bytes_per_s

# result columns describing the cell (the rest are metrics); units in the names
KEY_COLUMNS = (
    "bandwidth_gb_per_s",
    "cache_experts_per_layer",
    "cache_policy",
    "predictor",
    "overlap",
    "prefetch",
    "policy",
)


@dataclass(frozen=True)
class CellSpec:
    """One cell of a sweep (everything :func:`run_cell` needs; JSON-able).

    Attributes:
        trace_path: dense trace run directory.
        cost: ``CycleCostModel.to_dict()`` of the sweep's base cost (expert bytes, compute, latency).
        bandwidth_gb_per_s: H2D bandwidth of this cell (GB/s, 1 GB = 1e9 bytes).
        cache_experts_per_layer: cache capacity (experts per layer); cache_fraction: of ``E``.
        policy, cache_policy, predictor: names; overlap, prefetch: link modes.
        engine, link_concurrency, decision_s, max_requests, max_positions, seed, acceptance:
            see :class:`sim.config.SimConfig`.
        policy_options: keyword arguments of the tree policy (``SimConfig.policy_options``), e.g.
            ``{"stopping": "bound"}`` for ``specfit``; ``None``: the policy's defaults. Part of
            :attr:`cell_id` only when set, so cells without options keep their earlier ids.
        expert_budget: ``moespec`` cells only (lossy): see ``SimConfig.expert_budget``; in
            :attr:`cell_id` only when set.
        planner_deadline_fraction: SpecFit cells only: ``SimConfig.planner_deadline_fraction``
            (the live engine's planner deadline; results then depend on this machine's speed);
            in :attr:`cell_id` only when set.
    """

    trace_path: str
    cost: dict
    bandwidth_gb_per_s: float
    cache_experts_per_layer: int
    cache_fraction: float
    policy: str
    cache_policy: str = "lru"
    predictor: str = "union-size"
    overlap: bool | str = "off"
    prefetch: bool | str = "none"
    engine: str = "auto"
    link_concurrency: int = 1
    decision_s: float = 0.0
    max_requests: int | None = None
    max_positions: int | None = None
    seed: int = 0
    acceptance: dict | None = None
    policy_options: dict | None = None
    expert_budget: int | None = None
    planner_deadline_fraction: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-able)."""
        return dataclasses.asdict(self)

    @property
    def cell_id(self) -> str:
        """16 hex digits of the SHA-256 of the canonical JSON: same content, same id.

        ``policy_options`` enters the JSON only when set (cells of policies without options keep
        the ids they had before the field existed; a resumed sweep still finds them).
        """
        content = self.to_dict()
        # off/on as the bools they were before "ideal" existed (resumed sweeps keep their ids)
        content["overlap"] = {"off": False, "on": True}.get(content["overlap"], content["overlap"])
        # none/draft as the bools of the earlier on/off prefetch switch (same ids as before)
        content["prefetch"] = {"none": False, "draft": True}.get(content["prefetch"], content["prefetch"])
        for optional in ("policy_options", "expert_budget", "planner_deadline_fraction"):
            if content[optional] is None:
                del content[optional]
        blob = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def sim_config(self, record_cycles: bool = False) -> SimConfig:
        """The :class:`SimConfig` of this cell (cost at this cell's bandwidth)."""
        cost = CycleCostModel.from_dict(self.cost, where="cell cost").with_bandwidth(
            gb_per_s_to_bytes_per_s(self.bandwidth_gb_per_s)
        )
        return SimConfig(
            cost=cost,
            policy=self.policy,
            cache_capacity_per_layer=self.cache_experts_per_layer,
            cache_policy=self.cache_policy,
            predictor=self.predictor,
            overlap=self.overlap,
            prefetch=self.prefetch,
            engine=self.engine,
            link_concurrency=self.link_concurrency,
            decision_s=self.decision_s,
            max_requests=self.max_requests,
            max_positions=self.max_positions,
            seed=self.seed,
            record_cycles=record_cycles,
            acceptance=self.acceptance,
            policy_options=tuple(sorted((self.policy_options or {}).items())),
            expert_budget=self.expert_budget,
            planner_deadline_fraction=self.planner_deadline_fraction,
        )


def parse_cache_sizes(items: Sequence[str], num_experts: int) -> list[tuple[int, float]]:
    """Resolve ``--cache`` items to ``(experts per layer, fraction of E)``, in the given order.

    An item with a ``.`` (``"0.25"``) or a ``%`` (``"25%"``) is a fraction of the ``num_experts``
    experts per layer (rounded to the nearest count); otherwise it is a count (``"32"``). Only an
    explicit count ``0`` means no cache: a fraction that rounds to 0 experts is an error.

    Raises:
        ValueError: not a number, a fraction outside (0, 1] or one that rounds to 0 experts, a
            negative count or one above ``num_experts``; the message names ``--cache`` and the item.
    """
    out: list[tuple[int, float]] = []
    for raw in items:
        text = str(raw).strip()
        try:
            if text.endswith("%"):
                frac = float(text[:-1]) / 100.0
                count = None
            elif "." in text or "e" in text.lower():
                frac, count = float(text), None
            else:
                count, frac = int(text), None
        except ValueError:
            raise ValueError(f"--cache: expected a count or a fraction, got {text!r}") from None
        if count is None:
            if not 0 < frac <= 1:
                raise ValueError(f"--cache: a fraction must be in (0, 1], got {text!r}")
            count = int(round(frac * num_experts))
            if count == 0:
                raise ValueError(
                    f"--cache: {text!r} of the trace's {num_experts} experts per layer is "
                    f"{frac * num_experts:.3g} experts, which rounds to 0 (no cache); give 0 explicitly for "
                    f"no cache, else a fraction >= {1.0 / num_experts:.3g} (1 expert) or a count"
                )
        if not 0 <= count <= num_experts:
            raise ValueError(
                f"--cache: {text!r} gives {count} experts per layer; expected a count 0..{num_experts} "
                f"(the trace's experts per layer) or a fraction in (0, 1]"
            )
        out.append((count, count / num_experts))
    return out


def make_cells(
    *,
    trace_path: str,
    cost: CycleCostModel,
    bandwidths_gb_per_s: Sequence[float],
    caches: Sequence[tuple[int, float]],
    policies: Sequence[str],
    cache_policies: Sequence[str] = ("lru",),
    predictors: Sequence[str] = ("union-size",),
    overlaps: Sequence[bool | str] = ("off",),
    prefetches: Sequence[bool | str] = ("none",),
    policy_options: dict[str, dict[str, Any]] | None = None,
    budget: int | None = None,
    planner_deadline_fraction: float | None = None,
    **common: Any,
) -> list[CellSpec]:
    """The Cartesian product of the sweep axes as cells (deterministic order, duplicates dropped).

    ``policy_options``: per canonical policy name, that policy's keyword arguments (e.g.
    ``{"specfit": {"stopping": "bound"}}``); cells of other policies get none. ``budget``: the
    lossy ``moespec`` cells' expert budget per layer (``None``: twice the top-k).
    ``planner_deadline_fraction``: the SpecFit cells' (oracle variants included) planner
    deadline (``SimConfig.planner_deadline_fraction``); other cells get none.
    """
    options = {canonical_policy(k): dict(v) for k, v in (policy_options or {}).items() if v}
    cells, seen = [], set()
    cost_dict = cost.to_dict()
    for cache, bw, cpol, pred, ovl, pre, pol in itertools.product(
        caches, bandwidths_gb_per_s, cache_policies, predictors, overlaps, prefetches, policies
    ):
        name = canonical_policy(pol)
        cell = CellSpec(
            trace_path=str(trace_path),
            cost=cost_dict,
            bandwidth_gb_per_s=float(bw),
            cache_experts_per_layer=int(cache[0]),
            cache_fraction=float(cache[1]),
            policy=name,
            cache_policy=cpol,
            predictor=pred,
            overlap=overlap_mode(ovl, "--overlap"),
            prefetch=prefetch_mode(pre, "--prefetch"),
            policy_options=options.get(name, options.get(base_policy(name))),
            expert_budget=budget if name in LOSSY_POLICIES else None,
            planner_deadline_fraction=planner_deadline_fraction if base_policy(name) == "specfit" else None,
            **common,
        )
        if cell.cell_id not in seen:
            seen.add(cell.cell_id)
            cells.append(cell)
    return cells


_TRACES: dict[str, Any] = {}


def _default_stopping() -> str:
    """``SpecFitPolicy``'s default stopping rule (read from its signature, not restated here)."""
    import inspect

    from specfit.policies import SpecFitPolicy

    return str(inspect.signature(SpecFitPolicy.__init__).parameters["stopping"].default)


def _open_trace(path: str, decoded: str | None = None) -> Any:
    """Open (once per process) the trace at ``path``; later cells reuse its decoded arrays.

    ``decoded``: a file of this trace's decoded arrays (:func:`export_traces`), memory-mapped
    instead of decoding the trace's ``nodes`` table in this process (workers that are not forked).
    """
    if path not in _TRACES:
        from traces.reader import open_run

        run = open_run(path, validate=False)
        if decoded is not None:
            from sim.decoded import read_node_arrays

            run.use_node_arrays(read_node_arrays(decoded))
        _TRACES[path] = run
    return _TRACES[path]


def prepare_traces(cells: Sequence[CellSpec]) -> None:
    """Open, decode and validate (in this process, once) every trace ``cells`` replay.

    Called by the local executor before it forks its workers: they inherit the decoded arrays
    and the validated trees (copy-on-write pages, shared until written), so no worker decodes or
    validates the trace again, for any of its cells (decoding a 2,000-position Qwen3-shape trace
    takes seconds of CPU).
    """
    from sim.replay import prepare_trace

    for path in dict.fromkeys(cell.trace_path for cell in cells):
        prepare_trace(_open_trace(path))


def export_traces(cells: Sequence[CellSpec], directory: str | Path) -> dict[str, str]:
    """Decode (once, in this process: :func:`prepare_traces`) every trace ``cells`` replay and
    write each one's decoded arrays to ``directory`` as a memory-mappable Arrow IPC file
    (:func:`sim.decoded.write_node_arrays`); returns trace path -> file, which :func:`run_cell`
    takes as ``decoded`` in workers that are not forked (a spawn pool, Ray), so that they map the
    arrays instead of decoding the trace.

    Raises:
        OSError: a file cannot be written.
    """
    from sim.decoded import write_node_arrays

    prepare_traces(cells)
    out: dict[str, str] = {}
    for path in dict.fromkeys(cell.trace_path for cell in cells):
        name = hashlib.sha256(path.encode()).hexdigest()[:16]
        out[path] = str(write_node_arrays(_open_trace(path).node_arrays(), Path(directory) / f"{name}.arrow"))
    return out


def run_cell(
    cell: dict[str, Any] | CellSpec, cycles_dir: str | None = None, decoded: str | None = None
) -> dict[str, Any]:
    """Replay one cell and return its tidy result row (cell keys + metrics + ``cell_id``).

    Args:
        cell: a :class:`CellSpec` or its dict.
        cycles_dir: when given, the per-cycle records go to ``cycles_dir/<cell_id>.parquet``.
        decoded: the cell's trace decoded (:func:`export_traces`), memory-mapped when this
            process has not opened the trace yet; ``None``: decoded here on first use.

    Raises:
        ReplayError / ValueError: from :func:`sim.replay.replay_policy`.
    """
    from sim.replay import replay_policy

    spec = cell if isinstance(cell, CellSpec) else CellSpec(**cell)
    run = _open_trace(spec.trace_path, decoded)
    result = replay_policy(run, spec.sim_config(record_cycles=cycles_dir is not None))
    if cycles_dir is not None:
        write_cycles(result.cycles, Path(cycles_dir) / f"{spec.cell_id}.parquet", run.manifest.model)
    row: dict[str, Any] = {
        "cell_id": spec.cell_id,
        "bandwidth_gb_per_s": spec.bandwidth_gb_per_s,
        "cache_experts_per_layer": spec.cache_experts_per_layer,
        "cache_fraction": spec.cache_fraction,
        "cache_policy": spec.cache_policy,
        "predictor": spec.predictor,
        "overlap": overlap_mode(spec.overlap),
        "prefetch": prefetch_mode(spec.prefetch),
        "policy": spec.policy,
    }
    if base_policy(spec.policy) == "specfit":  # the stopping rule it ran with (the policy's default when not set)
        row["stopping"] = (spec.policy_options or {}).get("stopping", _default_stopping())
        row["planner_deadline_fraction"] = spec.planner_deadline_fraction  # None: no deadline (deterministic)
    row["lossy"] = spec.policy in LOSSY_POLICIES  # MoE-Spec's budget drops experts: output may differ
    row.update(result.totals.to_dict())
    return row


def write_cycles(records: Sequence[Any], path: Path, model: Any) -> Path:
    """Write cycle records as one Parquet file with the trace format's ``cycles`` schema (atomic).

    Args:
        records: ``traces.schema.CycleRecord`` list; path: output file; model: the trace's
            ``ModelSpec`` (the schema builder's argument).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from traces.schema import arrow_schema

    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(r) for r in records]
    for r in rows:
        for k, v in r.items():
            if isinstance(v, tuple):
                r[k] = list(v)
    table = pa.Table.from_pylist(rows, schema=arrow_schema("cycles", model))
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path
