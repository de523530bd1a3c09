"""From decode-loop events to trace rows (``traces.writer.TraceWriter``) and run totals.

Dense mode writes one tree per committed position (every node with its routing) and one cycle
per verification; policy mode writes the cycles with the planner's predictions. Conventions of
the ``cycles`` table here: ``verify_s`` is the target forward's wall time minus its stall (the H2D time the compute stream waited for; all of it without overlap)
(compute), ``h2d_s`` the H2D time, ``cycle_s`` the wall time of the whole cycle (draft, decision,
verify, H2D and bookkeeping). In dense mode one token is committed per cycle by design, so
``num_committed`` is 1 while ``num_accepted`` is what the whole tree would have accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from live.spec.engine import CycleEvent, GenerationResult


def locally_accepted(event: CycleEvent) -> np.ndarray:
    """bool[N]: node token equals the target's greedy token at its parent (root True), as the trace stores it."""
    tree = event.verification.tree
    target = event.verification.target_tokens
    accepted = np.ones(tree.num_nodes, dtype=bool)
    accepted[1:] = tree.token_ids[1:] == target[tree.parents[1:]]
    verified = np.zeros(tree.num_nodes, dtype=bool)
    verified[event.verification.nodes] = True
    return accepted & verified


def layer_accesses(expert_ids: np.ndarray) -> tuple[list[int], list[int]]:
    """The expert-cache accesses of one forward from its routing ``expert_ids`` int[T, L, K]:
    ``(counts int[L], ids)``, where layer ``l`` accessed the union of its tokens' experts
    (``ExpertCache.access(l, ids)``, as ``live.offload`` does per layer) and ``ids`` holds the
    ``counts[l]`` ascending ids of each layer in turn (the ``cycles`` columns ``layer_accessed``
    and ``accessed_experts``; :func:`split_accesses` inverts it)."""
    ids = np.asarray(expert_ids)
    unions = [np.unique(ids[:, layer, :]) for layer in range(ids.shape[1])]
    return [int(u.size) for u in unions], np.concatenate(unions).astype(np.int64).tolist() if unions else []


def split_accesses(counts, ids) -> list[np.ndarray]:
    """Inverse of :func:`layer_accesses`: one int64 array of expert ids per layer."""
    bounds = np.cumsum([0, *counts])
    flat = np.asarray(ids, dtype=np.int64)
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def cycle_record(request_id: int, event: CycleEvent, policy: str):
    """The :class:`traces.schema.CycleRecord` of one cycle (with its expert-cache accesses)."""
    from traces.schema import CycleRecord

    stats, ver, plan = event.stats, event.verification, event.choice.plan
    layer_accessed, accessed = layer_accesses(ver.expert_ids)
    return CycleRecord(
        request_id=int(request_id),
        cycle_index=event.cycle_index,
        position=event.position,
        context_len=event.context_len,
        policy=policy,
        num_draft_levels=event.choice.draft.num_levels,
        num_nodes_verified=int(len(ver.nodes)),
        verified_nodes=ver.nodes.tolist(),
        num_accepted=event.num_accepted,
        num_committed=len(event.committed),
        draft_s=float(event.choice.draft.draft_s),
        verify_s=max(float(ver.verify_s) - stats.stall_s, 0.0),
        h2d_s=stats.h2d_s,
        cycle_s=float(event.cycle_s),
        layer_misses=stats.layer_misses,
        layer_h2d_bytes=stats.layer_h2d_bytes,
        layer_h2d_s=stats.layer_h2d_s,
        layer_compute_s=stats.layer_compute_s,
        layer_stall_s=stats.layer_stall_s,
        layer_pre_router_s=stats.layer_pre_router_s,
        num_prefetch_issued=stats.num_prefetch_issued,
        num_prefetch_used=stats.num_prefetch_used,
        num_prefetch_wasted=stats.num_prefetch_wasted,
        prefetch_wasted_bytes=stats.prefetch_wasted_bytes,
        cache_hits=stats.hits,
        cache_misses=stats.misses,
        predicted_expected_committed=None if plan is None else float(plan.expected_committed),
        predicted_cycle_s=None if plan is None else float(plan.predicted_cycle_s),
        decision_s=None if plan is None else float(plan.decision_s),
        committed_token_ids=list(event.committed),
        layer_accessed=layer_accessed if layer_accessed else None,
        accessed_experts=accessed if layer_accessed else None,
        reached_depth=ver.reached_depth,
    )


def write_transfers(writer, request_id: int, event: CycleEvent) -> int:
    """Write the per-copy H2D records of a cycle's verification forward to the ``transfers``
    table (``live.offload.TransferLog``: layer, expert, bytes, seconds per tensor copy; their
    bytes sum to the cycle's ``layer_h2d_bytes`` and seconds to its ``h2d_s``). Returns the rows
    written (0 for a cycle without transfers or a forward without per-copy records)."""
    log = event.stats.transfers
    if log is None or not len(log):
        return 0
    writer.add_transfers(
        request_id,
        event.cycle_index,
        log.layers,
        log.experts,
        log.num_bytes,
        log.h2d_s,
        spans=(log.enqueued_at_s, log.started_at_s, log.landed_at_s),
        placed_at_s=log.placed_at_s,
    )
    return len(log)


def write_tree(writer, request_id: int, event: CycleEvent) -> None:
    """Write the whole verified tree of a dense-mode cycle to the ``nodes`` table (with each
    node's ``last_level`` when the drafter recorded the union of its level trees).

    Raises:
        ValueError: when the cycle did not verify every node (not a dense cycle).
    """
    ver = event.verification
    if len(ver.nodes) != ver.tree.num_nodes:
        raise ValueError("write_tree: dense trees must verify every node")
    writer.add_tree(
        request_id,
        event.position,
        event.context_len,
        ver.tree.to_draft_tree(),
        ver.target_tokens,
        locally_accepted(event),
        ver.expert_ids,
        ver.router_weights,
        event.next_layer_ids,
        last_level=event.choice.draft.last_level,
    )


_ADDED_TOTALS = ("planner_deadline_hits", "planner_gap_sum")  # 0 when resuming older totals


@dataclass
class RunTotals:
    """Running totals over requests, for the summary table and ``summary.json``.

    Times are seconds, bytes are bytes. ``full_tree_tau`` averages, over dense cycles, the tokens
    the whole tree would commit (accepted path + bonus).
    """

    num_requests: int = 0
    num_tokens: int = 0
    num_cycles: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    h2d_s: float = 0.0
    compute_s: float = 0.0
    h2d_bytes: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    nodes_verified: int = 0
    decision_s: float = 0.0
    planner_deadline_hits: int = 0  # cycles whose exact search stopped at its deadline
    planner_gap_sum: float = 0.0  # sum of those plans' certified relative gaps
    committed_per_cycle: list[int] = field(default_factory=list)
    tree_accept_lengths: list[int] = field(default_factory=list)

    def add(self, result: GenerationResult) -> None:
        """Add one finished generation."""
        self.num_requests += 1
        self.num_tokens += len(result.generated_ids)
        self.decode_s += result.decode_s
        self.prefill_s += result.prefill_s
        for c in result.cycles:
            self.num_cycles += 1
            self.draft_s += c.choice.draft.draft_s
            self.verify_s += max(c.verification.verify_s - c.stats.stall_s, 0.0)
            self.h2d_s += c.stats.h2d_s
            self.compute_s += c.stats.compute_s
            self.h2d_bytes += c.stats.h2d_bytes
            self.cache_hits += c.stats.hits
            self.cache_misses += c.stats.misses
            self.nodes_verified += len(c.verification.nodes)
            plan = c.choice.plan
            self.decision_s += 0.0 if plan is None else float(plan.decision_s)
            if plan is not None and not plan.exact:
                self.planner_deadline_hits += 1
                self.planner_gap_sum += float(plan.gap)
            self.committed_per_cycle.append(len(c.committed))
            self.tree_accept_lengths.append(c.num_accepted + 1)

    def merge(self, other: RunTotals) -> None:
        """Add ``other``'s totals to these (e.g. the requests of an earlier, interrupted call)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_state(self) -> dict:
        """Every field as plain JSON (the inverse of :meth:`from_state`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> RunTotals:
        """Totals from :meth:`to_state` output.

        Raises:
            ValueError: a field missing or unknown (the message names it).
        """
        names = {f.name for f in fields(cls)}
        state = {**{name: 0 for name in _ADDED_TOTALS}, **state}  # totals written before they existed
        if set(state) != names:
            raise ValueError(
                f"run totals: fields {sorted(set(state) ^ names)} missing or unknown; expected {sorted(names)}"
            )
        return cls(**state)

    def to_dict(self) -> dict:
        """Summary figures (SI units, names carry them)."""
        accesses = self.cache_hits + self.cache_misses
        return {
            "num_requests": self.num_requests,
            "num_tokens": self.num_tokens,
            "num_cycles": self.num_cycles,
            "tokens_per_s": self.num_tokens / self.decode_s if self.decode_s > 0 else float("nan"),
            "tau": float(np.mean(self.committed_per_cycle)) if self.committed_per_cycle else float("nan"),
            "full_tree_tau": float(np.mean(self.tree_accept_lengths))
            if self.tree_accept_lengths
            else float("nan"),
            "mean_nodes_verified": self.nodes_verified / self.num_cycles if self.num_cycles else float("nan"),
            "hit_rate": self.cache_hits / accesses if accesses else float("nan"),
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "h2d_bytes": self.h2d_bytes,
            "decode_s": self.decode_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "h2d_s": self.h2d_s,
            "expert_compute_s": self.compute_s,
            "decision_s": self.decision_s,
            "decision_s_per_cycle": self.decision_s / self.num_cycles if self.num_cycles else float("nan"),
            "planner_deadline_hits": self.planner_deadline_hits,
            "planner_mean_gap": self.planner_gap_sum / self.planner_deadline_hits
            if self.planner_deadline_hits
            else 0.0,
        }
