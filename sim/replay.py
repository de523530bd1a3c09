"""Replay one tree policy on a dense trace: :func:`replay_policy` (issue 6, "Replay of one policy").

For every request of the trace:

1. Prefill: the prompt's routing goes through the expert cache (one forward pass: one access per
   layer with the union of the prompt's experts), so decode starts warm as it would live. Prefill
   time is not part of decode throughput; the prefill's copies are counted apart.
2. Decode, starting at generated position ``t = 0``: the recorded dense tree at ``t`` is the
   drafted tree. The policy chooses ``S`` from it using the chosen expert predictor, the
   simulated cache's contents and the cost model (SpecFit also decides after each draft level
   whether to draft another, asked after each drafted level as ``live.spec`` does; every other
   non-autoregressive policy pays the recorded tree's full depth, autoregressive none). The
   recorded accepted flags give the committed length (deepest
   path-accepted node of ``S``, plus the bonus token); the recorded true experts of ``S``'s nodes
   drive the cache and the H2D link; :mod:`sim.engine` times the cycle; the next cycle starts at
   ``t + committed``.

The expert cache persists across requests, as in ``live.spec`` (one cache per engine); each
request's timeline starts with an idle link (its prefill has drained every copy).

Greedy verification is lossless, so the tokens committed by any policy are the request's greedy
output: each cycle record carries ``committed_token_ids`` and their concatenation equals the
trace's ``generated_token_ids`` (tested).
"""

from __future__ import annotations

import contextlib
import gc
import json
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.config import ORACLE_VARIANTS, SimConfig, base_policy, expert_budget_or_default
from sim.engine import MEMO_MAX_ENTRIES, CyclePlan, CycleTiming, FastEngine, LinkSpec, make_engine
from specfit import bitsets
from specfit.cache import EVICTIONS, HITS
from specfit.prefetch import planner_miss_fraction
from specfit.units import BYTES_PER_GB, ns_to_s, s_to_ns
from traces.schema import CycleRecord

# predictor tables fitted per trace run, shared by the replays of one process
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# per trace run, list[T] of _TreeData: each dense tree read (and validated) once per process
_TREES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ReplayError(ValueError):
    """A trace that cannot be replayed (gap in the dense positions, layer mismatch, ...)."""


@dataclass(frozen=True)
class ReplayTotals:
    """Totals of one replay (decode phase only; times in integer ns, exact sums).

    Attributes:
        num_requests, num_cycles: counts. num_committed: tokens committed (incl. bonus tokens).
        num_accepted: accepted draft tokens. num_nodes_verified: sum of |S|.
        decode_ns, draft_ns, verify_ns, h2d_ns, stall_ns: summed cycle wall time, draft,
            verify compute, copy time and compute-stream stalls waiting for copies (ns).
        cache_hits, cache_misses: expert accesses during decode.
        h2d_bytes: bytes copied during decode (demand + prefetch); prefetch_bytes: of which
            prefetched; num_transfers: expert copies during decode.
        prefill_h2d_bytes: bytes copied while replaying the prompts (not in throughput).
        predicted_committed: sum over cycles of the planner's E[committed] (NaN-free: 0 when absent).
        num_stopped_early: requests whose replay stopped before their last generated token
            because the dense trace had no tree at the next position.
        num_draft_levels: draft levels run, summed over cycles.
        planner_deadline_hits: cycles whose selected plan's exact search stopped at its deadline
            (``Plan.exact`` False; only with ``SimConfig.planner_deadline_fraction``), as the live
            summary counts them; planner_gap_sum: the sum of those plans' certified relative gaps
            (``Plan.gap``).
    """

    num_requests: int = 0
    num_cycles: int = 0
    num_committed: int = 0
    num_accepted: int = 0
    num_nodes_verified: int = 0
    decode_ns: int = 0
    draft_ns: int = 0
    verify_ns: int = 0
    h2d_ns: int = 0
    stall_ns: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    h2d_bytes: int = 0
    prefetch_bytes: int = 0
    num_transfers: int = 0
    prefill_h2d_bytes: int = 0
    predicted_committed: float = 0.0
    num_stopped_early: int = 0
    num_draft_levels: int = 0
    planner_deadline_hits: int = 0
    planner_gap_sum: float = 0.0

    @property
    def decode_s(self) -> float:
        """Decode wall time (s)."""
        return ns_to_s(self.decode_ns)

    @property
    def tokens_per_s(self) -> float:
        """Committed tokens per second of decode (tokens/s); NaN without cycles."""
        return self.num_committed / self.decode_s if self.decode_ns else float("nan")

    @property
    def tau(self) -> float:
        """Mean tokens committed per cycle including the bonus token (EAGLE's convention)."""
        return self.num_committed / self.num_cycles if self.num_cycles else float("nan")

    @property
    def hit_rate(self) -> float:
        """Expert-cache hit rate during decode, hits / (hits + misses)."""
        total = self.cache_hits + self.cache_misses
        return self.cache_hits / total if total else float("nan")

    @property
    def h2d_gb(self) -> float:
        """Decode H2D traffic in GB (1e9 bytes)."""
        return self.h2d_bytes / BYTES_PER_GB

    @property
    def mean_nodes_verified(self) -> float:
        """Mean |S| per cycle."""
        return self.num_nodes_verified / self.num_cycles if self.num_cycles else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """Counters and derived metrics, with units in the names (seconds, GB)."""
        return {
            "num_requests": self.num_requests,
            "num_cycles": self.num_cycles,
            "num_committed": self.num_committed,
            "num_accepted": self.num_accepted,
            "num_transfers": self.num_transfers,
            "num_stopped_early": self.num_stopped_early,
            "tokens_per_s": self.tokens_per_s,
            "tau": self.tau,
            "hit_rate": self.hit_rate,
            "h2d_gb": self.h2d_gb,
            "h2d_bytes": self.h2d_bytes,
            "prefetch_bytes": self.prefetch_bytes,
            "prefill_h2d_bytes": self.prefill_h2d_bytes,
            "mean_nodes_verified": self.mean_nodes_verified,
            "mean_draft_levels": self.num_draft_levels / self.num_cycles if self.num_cycles else float("nan"),
            "decode_s": self.decode_s,
            "draft_s": ns_to_s(self.draft_ns),
            "verify_s": ns_to_s(self.verify_ns),
            "h2d_s": ns_to_s(self.h2d_ns),
            "stall_s": ns_to_s(self.stall_ns),
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "mean_predicted_committed": (
                self.predicted_committed / self.num_cycles if self.num_cycles else float("nan")
            ),
            "planner_deadline_hits": self.planner_deadline_hits,
            # the live summary's figure, 0 where no plan was cut as there (a NaN would make rows that
            # crossed a process unequal to the same rows made in-process, and is not standard JSON)
            "planner_mean_gap": (
                self.planner_gap_sum / self.planner_deadline_hits if self.planner_deadline_hits else 0.0
            ),
        }


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay_policy` returns: the config, per-cycle records and totals."""

    config: SimConfig
    totals: ReplayTotals
    cycles: tuple[CycleRecord, ...] = field(default=())


def split_ns(total_ns: int, parts: int) -> tuple[int, ...]:
    """Split ``total_ns`` into ``parts`` integer pieces that differ by at most 1 and sum exactly.

    Used for per-layer compute (``verify_s / L`` per layer, the cost model's ``layer_compute_s``)
    so the simulated verify time equals the formula's to the nanosecond.
    """
    bounds = [(total_ns * i) // parts for i in range(parts + 1)]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def link_from_cost(cost: Any, concurrency: int = 1) -> LinkSpec:
    """:class:`LinkSpec` of a cost model: latency = ``h2d_s_per_transfer - host_s_per_transfer``
    (the compute stream's share, placing each miss, is ``CyclePlan.host_ns_per_transfer``), wire =
    bytes / bandwidth.

    ``latency_ns + wire_ns == s_to_ns(cost.link_s_per_transfer)`` exactly.
    """
    transfer_ns = s_to_ns(cost.link_s_per_transfer)
    latency_ns = min(s_to_ns(cost.h2d_s_per_transfer - cost.host_s_per_transfer), transfer_ns)
    return LinkSpec(latency_ns=latency_ns, wire_ns=transfer_ns - latency_ns, concurrency=concurrency)


def committed_path(tree: Any, path_ok: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Node ids committed when ``nodes`` (ascending ids, ancestor-closed, contains 0) are verified.

    Returns the path root -> deepest path-accepted node of ``nodes`` (ties: lowest id, which
    greedy verification never meets since siblings carry distinct tokens), root first.
    The path-accepted nodes of ``nodes`` hold that node's ancestors (ancestor-closed), so when
    they are one more than its depth they are its path, in id order (parents precede children):
    returned as they are, without walking the parents (the usual case: one accepted node per depth).
    """
    nodes = np.asarray(nodes, dtype=np.int64)
    if nodes.shape[0] == 1:  # the root alone (always accepted: it is the last committed token)
        return nodes
    ok = nodes[path_ok[nodes]]
    depths = tree.depths[ok]
    at = int(depths.argmax())
    if int(depths[at]) + 1 == ok.shape[0]:
        return ok
    deepest = int(ok[at])
    path = [deepest]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return np.asarray(path[::-1], dtype=np.int64)


def reached_depth(tree: Any, path: np.ndarray, nodes: np.ndarray) -> int:
    """Depth verification reached along the committed ``path`` (root first, from
    :func:`committed_path`): its accepted length, plus one when the path's last node has a child
    among the verified ``nodes`` (judged and rejected); the ``cycles.reached_depth`` column, as
    ``live.spec.verify.Verification.reached_depth`` records it live."""
    children = np.flatnonzero(np.asarray(tree.parents) == int(path[-1]))
    return len(path) - 1 + int(bool(np.isin(children, nodes).any()))


def _layer_mask(expert_ids: np.ndarray, nodes: np.ndarray, num_experts: int) -> np.ndarray:
    """bool[L, E]: per layer, the distinct experts the ``nodes`` route to (negative ids = padding).

    Args:
        expert_ids: int[N, L, K] routing of the tree's nodes; nodes: int[] node ids.

    Returns:
        One boolean mask over all ``L * E`` keys (row ``l`` = the set layer ``l`` accesses), the
        input of ``ExpertCache.access_layers`` (compiled: ``specfit.cache_kernels.expert_mask``).
    """
    if not _CACHE_KERNELS:
        from specfit import cache_kernels  # numba: compiled once, cached

        _CACHE_KERNELS.append(cache_kernels)
    ids = np.asarray(expert_ids)
    if ids.dtype not in (np.int16, np.int64):
        ids = ids.astype(np.int64)
    return _CACHE_KERNELS[0].expert_mask(ids, np.asarray(nodes, dtype=np.int64), int(num_experts))


_CACHE_KERNELS: list = []  # specfit.cache_kernels once imported (an import statement per cycle costs ~1 us)


def _budget_mask(
    expert_ids: np.ndarray, router_weights: np.ndarray, nodes: np.ndarray, num_experts: int, budget: int
) -> np.ndarray:
    """bool[L, E]: per layer the ``budget`` experts of ``nodes`` with the largest summed router weight.

    MoE-Spec's verification expert budget (lossy: tokens routed to a dropped expert are computed
    without it). Ties: smaller expert id. Experts no node routes to are never chosen.
    """
    ex = np.asarray(expert_ids[nodes], dtype=np.int64)  # [|S|, L, K]
    w = np.asarray(router_weights[nodes], dtype=np.float64)
    num_layers = ex.shape[1]
    sums = np.zeros((num_layers, num_experts))
    layer = np.broadcast_to(np.arange(num_layers)[None, :, None], ex.shape)
    ok = ex >= 0
    np.add.at(sums, (layer[ok], ex[ok]), np.maximum(w[ok], 1e-12))  # every routed expert counts > 0
    top = np.argsort(-sums, axis=1, kind="stable")[:, :budget]
    mask = np.zeros((num_layers, num_experts), dtype=bool)
    np.put_along_axis(mask, top, True, axis=1)
    return mask & (sums > 0)


class _MaskRows(Sequence):
    """Per-layer ascending id arrays of one kind of a cache access, made when first indexed.

    ``CyclePlan.hits`` and ``CyclePlan.demand`` (with ``demand_counts``): the fast engine reads a
    layer's hits only while prefetched copies are in flight and its demand ids only to record
    copies, so most cycles never build them.

    Args:
        ids: returns the ``L`` arrays (``LayerAccesses.hit_ids`` or ``.miss_ids``).
        num_layers: ``L``.
    """

    def __init__(self, ids: Callable[[], list[np.ndarray]], num_layers: int) -> None:
        self.ids, self.num_layers = ids, num_layers
        self.rows: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer: int) -> np.ndarray:  # type: ignore[override]
        if self.rows is None:
            self.rows = self.ids()
        return self.rows[layer]


def _unchecked_tree(cls: type, fields: dict[str, np.ndarray]) -> Any:
    """A ``cls`` (``DraftTree``) holding ``fields`` read-only, without running its validation."""
    return cls.trusted(**fields)


def _depth_subtree(tree: Any, keep: np.ndarray) -> Any:
    """``tree.subtree(keep)`` for ``keep`` = a draft level's tree (ancestor-closed: the nodes up to
    some depth, or a recorded per-level tree), without re-validation.

    Such a set is ancestor-closed and the tree is already validated, so the restricted arrays
    are a valid tree by construction; skipping ``DraftTree.__post_init__`` removes its checks
    from the per-level loop. Same arrays (read-only) as ``tree.subtree(keep)``; when ``keep`` is
    ``0..k-1`` (trees stored level by level, as drafters emit them) they are views, not copies.
    """
    names = ("token_ids", "parents", "depths", "draft_logprobs", "path_logprobs")
    size = int(keep.size)
    if size and int(keep[-1]) == size - 1:  # a prefix: ids and parents are unchanged
        return _unchecked_tree(type(tree), {name: getattr(tree, name)[:size] for name in names})
    new_id = np.full(tree.num_nodes, -1, dtype=np.int64)
    new_id[keep] = np.arange(size)
    fields = {name: getattr(tree, name)[keep] for name in names}
    fields["parents"] = np.where(fields["parents"] >= 0, new_id[fields["parents"]], -1)
    return _unchecked_tree(type(tree), fields)


def _load_specfit() -> dict[str, Any]:
    """Import the specfit modules the replay drives (kept out of import time)."""
    from specfit import acceptance, cache, planner, policies, predictors

    return {
        "acceptance": acceptance,
        "cache": cache,
        "planner": planner,
        "policies": policies,
        "predictors": predictors,
    }


@contextlib.contextmanager
def _collector_paused(pause: bool = True) -> Iterator[None]:
    """With ``pause``, pause Python's cyclic garbage collector (``gc.disable``) inside the block,
    when it was running, and restart it after (also on an error); reference counting still frees
    every object as usual.

    A replay's cycles on the fast engine make no reference cycles (``tests/test_sim_replay.py``
    checks that ``gc.collect()`` finds nothing unreachable after replays of ar, top-N, SpecFit and
    cascade, with LRU/LFU/Belady, overlap and draft prefetch; not chain or next-layer prefetch; the
    SimPy engine's processes do make them, so it is not paused there), so the collector
    has nothing to reclaim there, while its passes, triggered by the cycles' short-lived
    objects, walk the process's tracked objects (~200,000 once a 48-layer trace is decoded):
    ~5 % of a SpecFit replay's CPU on this project's machine (issue 14, measured paired in one
    process). Nested blocks (Belady's first pass) leave the state to the outermost.
    """
    running = pause and gc.isenabled()
    if running:
        gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


class _Replayer:
    """State of one replay: the cache, policy, predictor and counters (one per call)."""

    def __init__(self, trace_run: Any, config: SimConfig, modules: dict[str, Any]) -> None:
        self.run = trace_run
        self.config = config
        self.mods = modules
        model = trace_run.manifest.model
        self.num_layers, self.num_experts = int(model.num_layers), int(model.num_experts)
        self.cost = config.cost
        # as live: autoregressive decoding asks no planner (live records decision_s = 0 for it)
        self.decision_s = 0.0 if config.policy == "ar" else float(config.decision_s)
        if self.cost.num_layers != self.num_layers:
            raise ReplayError(
                f"cost model has num_layers={self.cost.num_layers} but the trace "
                f"({trace_run.run_dir}) has {self.num_layers} MoE layers"
            )
        if config.cache_capacity_per_layer > self.num_experts:
            raise ReplayError(
                f"cache_capacity_per_layer={config.cache_capacity_per_layer} exceeds the trace's "
                f"{self.num_experts} experts per layer"
            )
        self.arrays = trace_run.node_arrays()
        if self.arrays.num_trees == 0:
            raise ReplayError(
                f"{trace_run.run_dir}: no dense trees to replay (run mode "
                f"{trace_run.manifest.run.mode!r}; record one with the dense mode of live.record)"
            )
        self.path_ok = self.arrays.path_accepted()
        self.trees: list[_TreeData | None] = _TREES.setdefault(trace_run, [None] * self.arrays.num_trees)
        # the cost the cycles are timed with: the planner's, at the machine's compute speed
        self.timed = self.cost if config.compute_speed == 1.0 else self.cost.with_compute_speed(config.compute_speed)
        self.link = link_from_cost(self.timed, config.link_concurrency)
        # the compute stream's share of each miss and, with overlap, each late-expert kernel call
        self._host_ns = s_to_ns(self.timed.host_s_per_transfer)
        self._late_call_ns = s_to_ns(self.timed.late_call_s)
        # the part of a copy-stream batch's placing after its enqueue (the live CPU link's memcpy)
        self._placing_ns = s_to_ns(self.timed.placing_after_enqueue_s_per_transfer)
        self.expert_bytes = int(self.cost.expert_bytes)
        self.calibration = None
        self._accept_key = ""  # names the acceptance map in the per-tree memo (_TreeData.accept)
        if config.acceptance is not None:
            self.calibration = modules["acceptance"].AcceptanceCalibration.from_dict(config.acceptance)
            self._accept_key = json.dumps(config.acceptance, sort_keys=True, default=str)
        self.access_log: list[list[np.ndarray]] | None = None
        self.cache = self._make_cache()
        from specfit.prefetch import PrefetchLedger, uses_draft, uses_next_layer

        self.draft_prefetch = uses_draft(config.prefetch)
        self.next_layer_prefetch = uses_next_layer(config.prefetch) and self.num_layers > 1
        if self.next_layer_prefetch and not getattr(trace_run, "has_next_layer_guesses", False):
            raise ReplayError(
                f"{trace_run.run_dir}: --prefetch {config.prefetch} needs the next-layer guesses "
                "(column next_layer_expert_ids), which this trace does not carry; record the dense "
                "trace again with this version's live.record --mode dense"
            )
        self.ledger = PrefetchLedger(self.num_layers, self.num_experts)
        self._ledger_counts = self.ledger.counts()
        self._prefetches = config.prefetch != "none"  # else the ledger is never fed (issues nothing)
        self._no_copies = np.zeros_like(self.ledger.layer_issued)  # a cycle's issued copies without prefetch
        self._no_copies.setflags(write=False)
        options = dict(config.policy_options)
        if config.planner_deadline_fraction is not None:  # the live engine's deadline rule
            options["deadline_fraction"] = config.planner_deadline_fraction
        self.policy = modules["policies"].make_tree_policy(base_policy(config.policy), **options)
        # oracle variants (issue 12): the recorded accepted flags as acceptance / the true experts
        self.oracle_accept, self.oracle_experts = ORACLE_VARIANTS.get(config.policy, (False, False))
        self.budget = None  # MoE-Spec's verification expert budget (lossy baseline)
        if config.policy == "moespec":
            self.budget = expert_budget_or_default(config.expert_budget, model.top_k)
        if self.oracle_experts:
            self.predictor = modules["predictors"].make_predictor("oracle")
        else:
            self.predictor = modules["predictors"].make_predictor(config.predictor, **self._predictor_tables())
        self.max_depth = int(trace_run.manifest.draft.tree_depth)
        self.topk = int(trace_run.manifest.draft.tree_topk)
        self.totals: dict[str, Any] = {f: 0 for f in ReplayTotals.__dataclass_fields__}
        self.totals["predicted_committed"] = 0.0
        self.totals["planner_gap_sum"] = 0.0
        self.records: list[CycleRecord] = []
        # _layer_split memo (a few distinct verify times)
        self._splits: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        # per-replay constants of the cycle loop, computed once
        self._decision_ns = s_to_ns(self.decision_s)
        self._draft_ns: dict[int, int] = {}  # draft levels -> s_to_ns(cost.draft_s(levels))
        self._observe = getattr(self.policy, "observe_cycle", None)
        self._uses_recent = bool(self.predictor.uses_recent)
        self._use_oracle_bits = config.predictor == "oracle" or self.oracle_experts
        self._never_drafts = config.policy == "ar"
        self._asks_to_draft = hasattr(self.policy, "keep_drafting")
        self._plans_levels_at_once = (  # SpecFit's bound rule plans every drafted level (_choose)
            base_policy(config.policy) == "specfit" and getattr(self.policy, "stopping", "bound") == "bound"
        )
        # SpecFit's expected rule on union sizes: the live engine's compiled questions
        # (``SpecFitPolicy.union_size_questions``: one compiled call per question, the selection
        # from the last answer; _choose_by_questions), bit-identical to the contexts' path below
        self._questions = None
        self._union_template = None  # the first cycle's union-size prediction: its sizes serve every cycle
        if (
            config.predictor == "union-size" and not self.oracle_accept and not self.oracle_experts
            and getattr(self.policy, "stopping", None) == "expected" and hasattr(self.policy, "union_size_questions")
        ):  # fmt: skip
            self._questions = self.policy.union_size_questions(
                self.cost, self.calibration, self.max_depth, int(self.arrays.tree_sizes.max())
            )

    # ---- setup ------------------------------------------------------------------------------
    def _make_cache(self) -> Any:
        kwargs: dict[str, Any] = {}
        if self.config.cache_policy == "static":
            kwargs["frequency"] = self._expert_frequency()
        elif self.config.cache_policy == "belady":
            kwargs["future"] = self._future_accesses()
        return self.mods["cache"].make_expert_cache(
            self.config.cache_policy,
            self.num_layers,
            self.num_experts,
            self.config.cache_capacity_per_layer,
            **kwargs,
        )

    def _expert_frequency(self) -> np.ndarray:
        """float64[L, E] expert counts over the prompts' routing, for the "static" cache.

        The same profile ``live.spec.session`` pins experts by (prompt tokens only; nothing of
        the generated text is looked at).
        """
        freq = np.zeros((self.num_layers, self.num_experts), dtype=np.float64)
        for rid in self._request_ids():
            ex = self._prefill_ids(rid)
            layer = np.broadcast_to(np.arange(self.num_layers)[None, :, None], ex.shape)
            ok = ex >= 0
            np.add.at(freq, (layer[ok], ex[ok]), 1.0)
        return freq

    def _predictor_tables(self) -> dict[str, Any]:
        """:meth:`_fit_predictor_tables`, memoised per trace run (cells of a sweep share them)."""
        key = (self.config.predictor, self.config.max_requests)
        memo = _TABLES.setdefault(self.run, {})
        if key not in memo:
            memo[key] = self._fit_predictor_tables()
        return memo[key]

    def _fit_predictor_tables(self) -> dict[str, Any]:
        """Tables of the table-driven predictors, fitted on what a live engine could know.

        ``token-table``: fitted on the prompts' routing (prefill; seen before decoding starts).
        ``union-size``: mean distinct experts of a tree's top-n nodes, measured over the trace's
        own trees (an in-sample statistic of tree routing, no per-node information).
        """
        preds = self.mods["predictors"]
        if self.config.predictor == "token-table":
            tokens, experts = [], []
            prompts = dict(zip(self.run.requests["request_id"], self.run.requests["prompt_token_ids"]))
            for rid in self._request_ids():
                if int(rid) in prompts:
                    ex = self._prefill_ids(int(rid))
                    tokens.append(np.asarray(prompts[int(rid)], dtype=np.int64)[: ex.shape[0]])
                    experts.append(ex[: len(tokens[-1])])
            if not tokens:
                return {"table": {}}
            return {
                "table": preds.token_table_from_routing(
                    np.concatenate(tokens), np.concatenate(experts), self.num_experts
                )
            }
        if self.config.predictor == "union-size":
            return {"union_size": preds.union_size_from_node_arrays(self.arrays, self.num_experts)}
        return {}

    def _prefill_ids(self, request_id: int) -> np.ndarray:
        """int64[T, L, K] prompt routing of ``request_id`` (empty when the trace has none)."""
        try:
            return self.run.prefill_experts(request_id).astype(np.int64)
        except KeyError:
            return np.zeros((0, self.num_layers, 1), dtype=np.int64)

    def _future_accesses(self) -> list[list[np.ndarray]]:
        """Per layer, the expert sets this replay will access, for Belady's MIN (an oracle bound).

        The accesses depend on the policy's choices, which depend on the cache, so they are
        taken from a first replay of the same configuration under LRU; where the Belady run
        then chooses differently, its future is approximate (documented bound, not exact).
        """
        import dataclasses

        first = _Replayer(
            self.run, dataclasses.replace(self.config, cache_policy="lru", record_cycles=False), self.mods
        )
        first.access_log = [[] for _ in range(self.num_layers)]
        first.replay()
        return first.access_log

    def _layer_split(self, verify_ns: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-layer compute of a verification forward of ``verify_ns`` (:func:`split_ns`) and the
        part of each computed before the layer's router (``cost.pre_router_fraction``, rounded to
        the nanosecond; empty when 0), after which the layer's demand copies are enqueued."""
        compute = split_ns(verify_ns, self.num_layers)
        frac = self.timed.pre_router_fraction
        return compute, tuple(min(round(frac * c), c) for c in compute) if frac else ()

    def _access(self, expert_ids: np.ndarray, nodes: np.ndarray, mask: np.ndarray | None = None) -> Any:
        """One forward pass over ``nodes`` (routing ``expert_ids`` int[N, L, K]) through the cache:
        ``cache.access_nodes`` (one access per layer), or ``cache.access_layers(mask)`` for a
        given bool[L, E] ``mask`` (the expert budget's); logs the accesses for the Belady first
        pass."""
        if mask is None and self.access_log is not None:
            mask = _layer_mask(expert_ids, nodes, self.num_experts)
        if mask is None:
            return self.cache.access_nodes(expert_ids, nodes)
        if self.access_log is not None:
            for layer, row in enumerate(mask):
                self.access_log[layer].append(np.flatnonzero(row))
        return self.cache.access_layers(mask)

    def _request_ids(self) -> list[int]:
        ids = [int(r) for r in np.unique(self.arrays.request_ids)]
        return ids[: self.config.max_requests] if self.config.max_requests else ids

    def _generated_lengths(self) -> dict[int, int]:
        req = self.run.requests
        return {int(r): len(g) for r, g in zip(req["request_id"], req["generated_token_ids"])}

    # ---- replay -----------------------------------------------------------------------------
    def replay(self, progress: Callable[[int], None] | None = None) -> ReplayResult:
        lengths = self._generated_lengths()
        for rid in self._request_ids():
            self._replay_request(rid, lengths, progress)
            self.totals["num_requests"] += 1
        totals = ReplayTotals(**self.totals)
        return ReplayResult(config=self.config, totals=totals, cycles=tuple(self.records))

    def _prefill(self, request_id: int) -> np.ndarray:
        """Warm the cache with the prompt's routing (with its next-layer prefetch, as the live
        engine's prefill forward); return its experts int64[T, L, K]. Prefetch counts of the
        prefill are not a cycle's (as live, where they belong to the prefill forward)."""
        ex = self._prefill_ids(request_id)
        if ex.shape[0]:
            copies = 0
            if self.next_layer_prefetch:
                copies = sum(map(len, self._next_layer_prefetch(self.run.prefill_next_layer_experts(request_id))))
            access = self._access(ex, np.arange(ex.shape[0]))
            self._ledger_accessed(access)
            misses = int(access.num_misses.sum())
            self.totals["prefill_h2d_bytes"] += (misses + copies) * self.expert_bytes
        self._ledger_counts = self.ledger.counts()
        return ex

    def _ledger_accessed(self, access: Any) -> None:
        """Count the prefetched experts an access hit (used) or evicted (wasted)."""
        if self.config.prefetch != "none":  # PrefetchLedger.accessed at every layer, batched
            self.ledger.accessed_layers(access.keys(HITS), access.keys(EVICTIONS), access.num_hits, access.num_misses)

    def _next_layer_prefetch(self, guesses: np.ndarray) -> list[list[int]]:
        """Next-layer prefetch of one forward, as the live engine's ``--prefetch next-layer``:
        per layer ``l < L-1``, the experts of layer ``l+1`` the forward's tokens guess most
        (``guesses int[T, L-1, K]``, the recorded ``next_layer_expert_ids``;
        ``specfit.prefetch.next_layer_choice``) are made resident at layer ``l+1``
        (``specfit.prefetch.warm_layer``; counted in the prefetch ledger). Returns per layer
        ``l`` (L entries, the last empty) the experts of layer ``l+1`` that cross the link.

        The live engine warms layer l+1 after layer l's access; the cache's layers are
        independent, so warming every layer before the forward's accesses gives the same hits,
        misses and evictions."""
        from specfit.prefetch import next_layer_choice, warm_layer

        capacity = self.config.cache_capacity_per_layer
        out: list[list[int]] = [[] for _ in range(self.num_layers)]
        if capacity == 0:
            return out
        for layer in range(self.num_layers - 1):
            chosen = next_layer_choice(guesses[:, layer], self.num_experts, capacity)
            copies, evicted = warm_layer(self.cache, layer + 1, chosen)
            self.ledger.evicted(layer + 1, evicted)
            self.ledger.issue(layer + 1, copies, ahead=True)
            out[layer] = copies
        return out

    def _trees(self, request_id: int) -> Iterator[int]:
        idx = np.flatnonzero(self.arrays.request_ids == request_id)
        return iter(idx[np.argsort(self.arrays.positions[idx], kind="stable")].tolist())

    def _replay_request(
        self, rid: int, lengths: dict[int, int], progress: Callable[[int], None] | None
    ) -> None:
        arrays = self.arrays
        engine = make_engine(self.config.engine, self.link, self.num_layers)
        prompt = self._prefill(rid)
        # the experts (int64[L, K] ids) of the last committed tokens, packed only for the
        # predictors that read them (PredictContext.recent_experts)
        history: deque[np.ndarray] = deque(maxlen=self.config.history_tokens)
        if prompt.shape[0]:
            history.extend(prompt[-self.config.history_tokens :])
        limit = lengths.get(rid)
        if limit is None:
            limit = int(arrays.positions[arrays.request_ids == rid].max()) + 1
        if self.config.max_positions:
            limit = min(limit, self.config.max_positions)
        # the fast engine's cycles make no reference cycles; SimPy's processes do
        with _collector_paused(type(engine) is FastEngine):
            position = self._replay_trees(rid, limit, engine, history, progress)
        if position < limit:
            self.totals["num_stopped_early"] += 1

    def _replay_trees(
        self, rid: int, limit: int, engine: Any, history: deque, progress: Callable[[int], None] | None
    ) -> int:
        """The cycles of request ``rid`` up to ``limit`` positions; returns the positions reached."""
        arrays = self.arrays
        position, cycle_index = 0, 0
        for i in self._trees(rid):
            tree_pos = int(arrays.positions[i])
            if tree_pos < position:
                continue
            if tree_pos > position:
                raise ReplayError(
                    f"{self.run.run_dir}: request {rid}: no dense tree at position {position} "
                    f"(next recorded position is {tree_pos})"
                )
            committed = self._cycle(i, rid, cycle_index, limit - position, engine, history)
            position += committed
            cycle_index += 1
            if progress is not None:
                progress(1)
            if position >= limit:
                break
        return position

    def _choose(
        self,
        data: _TreeData,
        true_bits: np.ndarray | None,
        history: deque,
        path_ok: np.ndarray | None,
        cached: np.ndarray,
    ) -> tuple[Any, np.ndarray, int, Any]:
        """Run the policy: (plan, chosen node ids in the recorded tree, draft levels, the
        prediction's per-node expert bitsets uint64[N, L, W] over the recorded tree or None in
        union-size mode).
        ``cached``: uint64[L, W] bitsets of the cache as the planner sees it (``ExpertCache.cached_bits``).

        ``path_ok``: the tree's recorded path-accepted flags, used as the acceptance (1 or 0) by
        the oracle-acceptance variants.
        """
        if self._questions is not None:
            return self._choose_by_questions(data, cached)
        mods, dense = self.mods, data.dense
        tree = dense.tree
        if not self._uses_recent:
            recent = None
        elif history:
            recent = bitsets.pack(np.stack(list(history)), self.num_experts)
        else:
            recent = np.zeros((0, self.num_layers, bitsets.num_words(self.num_experts)), np.uint64)
        # trusted: the tree was validated once per trace (_TreeData), the bitsets are packed
        # here (bitsets.pack checks the ids) and the miss fraction is the cache's own float64[L]
        node_experts = self._predict(
            dense, recent, true_bits, planner_miss_fraction(self.cache, self.ledger, self.config.prefetch)
        )
        oracle_accept = self.oracle_accept and path_ok is not None
        policy_ctx = mods["policies"].PolicyContext
        contexts: dict[int, tuple[Any, np.ndarray]] = {}

        def context(levels: int) -> tuple[Any, np.ndarray]:
            """The planning problem on the first ``levels`` levels (built once per level)."""
            if levels in contexts:
                return contexts[levels]
            sub, keep = data.level(levels)
            if oracle_accept:
                p = np.asarray(path_ok, dtype=np.float64)[keep]
            else:
                p = data.accept_probs(self._accept_key, levels, self.calibration)
            if sub is tree:
                ne = node_experts
            else:
                ne = node_experts if node_experts.bits is None else _restrict(node_experts, keep)
            # trusted: a validated tree, path_accept_probs output and the predictor's own output
            ctx = policy_ctx.trusted(
                tree=sub,
                accept_probs=p,
                node_experts=ne,
                cached_bits=cached,
                cost=self.cost,
                context_len=int(dense.context_len),
                num_levels=levels,
            )
            contexts[levels] = ctx, keep
            return contexts[levels]

        depth = data.depth
        if self._plans_levels_at_once and node_experts.is_union_size and depth > 1:
            # the stopping rule plans every drafted level: score them all in one pass
            # (plan_exact_many remembers the plans, plan_exact then returns them as they are)
            mods["planner"].plan_exact_many([context(k)[0] for k in range(1, depth + 1)])
        if self._never_drafts:
            levels = 0
        elif self._asks_to_draft:
            # as live.spec: the rule is asked before the first level (on the root alone) and after
            # each drafted level
            levels = self._drafted_levels(
                data, lambda k: self.policy.keep_drafting(context(k)[0], max_depth=self.max_depth, topk=self.topk)
            )
        else:
            levels = depth
        ctx, keep = context(levels)
        plan = self.policy.select(ctx)
        chosen = np.asarray(plan.nodes, dtype=np.int64)
        nodes = keep[chosen] if chosen.shape[0] == 1 else np.sort(keep[chosen])
        return plan, nodes, levels, node_experts.bits

    def _predict(
        self, dense: Any, recent: np.ndarray | None, true_bits: np.ndarray | None, miss_fraction: np.ndarray | None
    ) -> Any:
        """The predictor's ``NodeExperts`` for the recorded tree of ``dense`` (``recent``: uint64[H, L, W]
        bitsets of the recent tokens' experts or None; ``true_bits``: uint64[N, L, W] of the recorded
        routing for the oracle predictor or None; ``miss_fraction``: float64[L] observed, or None for
        the predictor's own), through ``PredictContext.trusted``: the tree was validated once per trace
        (``_TreeData``), the bitsets are packed by ``bitsets.pack`` (which checks the ids)."""
        return self.predictor.predict(
            self.mods["predictors"].PredictContext.trusted(
                tree=dense.tree,
                num_experts=self.num_experts,
                num_layers=self.num_layers,
                context_len=dense.context_len,
                recent_experts=recent,
                true_experts=true_bits,
                miss_fraction=miss_fraction,
            )
        )

    def _drafted_levels(self, data: _TreeData, keep_drafting: Any) -> int:
        """The levels drafted under the stopping rule ``keep_drafting(levels) -> bool``, asked as
        ``live.spec`` asks it: before the first level (on the root alone) and after each drafted
        level, while the recorded tree has one more; also after the last one when it is below the
        maximum depth and the trace has per-level trees (live asks after every level it drafted
        below the maximum depth, also when its drafter then stops because no child of the
        frontier could enter the full tree, live.spec.draft, and on the root alone even when the
        drafter cannot draft): that answer changes nothing here, but the question counts
        (ThroughputGuard's probe period, the running root estimate). One protocol for the
        contexts' path and the compiled questions (:meth:`_choose`, :meth:`_choose_by_questions`).
        """
        depth, levels = data.depth, 0
        while levels < depth and keep_drafting(levels):
            levels += 1
        if levels == depth < self.max_depth and data.level_trees:
            keep_drafting(levels)
        return levels

    def _choose_by_questions(self, data: _TreeData, cached: np.ndarray) -> tuple[Any, np.ndarray, int, Any]:
        """:meth:`_choose` for SpecFit's expected rule on union sizes through the live engine's
        compiled questions (``specfit.policies.UnionSizeQuestions``, as ``live.spec.planning``
        asks them): the questions on the same per-level trees, the selection from the last
        answer; no prediction, context or plan object per level. The predictor validates its
        sizes once (first cycle); its output then differs between cycles only by the observed
        miss fraction, which :meth:`UnionSizeQuestions.begin` takes as it is (cleaned in the
        kernel as the predictor cleans it). Same answers, plans and policy state as the
        contexts' path (``UnionSizeQuestions``' contract, tests/test_specfit_decide_kernels.py).
        """
        questions, dense = self._questions, data.dense
        observed = None
        if self.predictor.miss_fraction is None:  # else the fixed fraction: the template's
            observed = planner_miss_fraction(self.cache, self.ledger, self.config.prefetch)
        template = self._union_template
        if template is None:
            template = self._union_template = self._predict(dense, None, None, observed)
        questions.begin(template, cached, dense.context_len, observed)
        level = data.level
        levels = self._drafted_levels(data, lambda k: questions.ask(level(k)[0], k))
        sub, keep = level(levels)
        plan = questions.select(sub, levels)
        chosen = plan.nodes
        nodes = keep[chosen] if chosen.shape[0] == 1 else np.sort(keep[chosen])
        return plan, nodes, levels, None  # union sizes: no per-node experts

    def _prefetch(self, nodes: np.ndarray, node_bits: np.ndarray | None) -> list[tuple[int, int]]:
        """Draft prefetch, as the live engine's ``--prefetch draft``: warm the cache with the
        predicted experts of ``nodes`` (``node_bits``: the cycle's per-node predicted bitsets,
        uint64[N, L, W] over the recorded tree, or None: union sizes name no experts) and return
        the copies, in order (``specfit.prefetch.draft_prefetch``; counted in the prefetch ledger)."""
        from specfit.prefetch import draft_prefetch

        if node_bits is None:  # draft_prefetch's "nothing to prefetch", without its L empty arrays
            return []
        copies, evicted = draft_prefetch(
            self.cache, node_bits[nodes], self.num_experts, self.config.cache_capacity_per_layer
        )
        by_layer: dict[int, list[int]] = {}  # the copies per layer (they come in layer, then id order)
        for layer, e in copies:
            by_layer.setdefault(layer, []).append(e)
        for layer, gone in enumerate(evicted):  # layers are the ledger's disjoint rows: any order
            if len(gone):
                self.ledger.evicted(layer, gone)
        for layer, experts in by_layer.items():
            self.ledger.issue(layer, experts)
        return copies

    def _root_alone(self, cached: np.ndarray, root_ids: np.ndarray, node_bits: np.ndarray | None, dense: Any) -> tuple:
        """The paired guard's root alone on the cache the planner saw (``cached``): ``(misses,
        None)`` without prefetch (``specfit.policies.root_layer_misses``), else its demand misses
        and prefetch copies (``specfit.policies.root_alone_copies``: the root's row of the
        predicted bitsets ``node_bits`` with draft prefetch, of the recorded next-layer guesses
        with next-layer prefetch), as ``live.spec.engine``."""
        policies = self.mods["policies"]
        bits = node_bits[0] if self.draft_prefetch and node_bits is not None else None
        guesses = np.asarray(dense.next_layer_expert_ids)[0] if self.next_layer_prefetch else None
        capacity = self.config.cache_capacity_per_layer
        return policies.root_alone_copies(cached, root_ids, self.num_experts, capacity, bits, guesses)

    def _tree_data(self, i: int) -> _TreeData:
        """Recorded tree ``i``, read and validated as a ``DraftTree`` once per process.

        The sweep replays the same trees in every cell: later cells (and the replay's Belady
        first pass) reuse the same read-only arrays and per-level subtrees without re-running
        the checks.
        """
        data = self.trees[i]
        if data is None:
            data = self.trees[i] = _TreeData(self.arrays.tree(i))
        return data

    def _cycle(self, i: int, rid: int, cycle_index: int, remaining: int, engine: Any, history: deque) -> int:
        data = self._tree_data(i)
        dense = data.dense
        tree, cfg = dense.tree, self.config
        true_ids = dense.expert_ids  # int16[N, L, K]: only the rows used are widened
        true_bits = bitsets.pack(true_ids, self.num_experts) if self._use_oracle_bits else None
        offsets = self.arrays.offsets
        path_ok = self.path_ok[offsets[i] : offsets[i + 1]]
        cached = self.cache.cached_bits()  # the cache as the planner sees it
        plan, nodes, levels, node_bits = self._choose(data, true_bits, history, path_ok, cached)
        observe = self._observe
        root_misses = root_copies = None  # the root alone's misses (and copies) on the cache the planner saw
        if observe is not None and levels > 0:
            root_misses, root_copies = self._root_alone(cached, true_ids[0], node_bits, dense)
        # the ledger's issued counts before this cycle's prefetch (without prefetch nothing
        # issues: they stay 0, so the cycle's are the zeros made once, _no_copies)
        issued_before = self.ledger.mark() if observe is not None and self._prefetches else None
        prefetch = self._prefetch(nodes, node_bits) if self.draft_prefetch else []
        next_layer: list[list[int]] = []
        if self.next_layer_prefetch:
            next_layer = self._next_layer_prefetch(np.asarray(dense.next_layer_expert_ids)[nodes])
        stats = self.cache.stats
        hits_before, misses_before = stats.hits, stats.misses
        if self.budget is None:
            access = self._access(true_ids, nodes)
        else:  # lossy: the recorded acceptance is kept (an optimistic bound on MoE-Spec's output)
            weights = np.asarray(dense.router_weights)
            access = self._access(true_ids, nodes, _budget_mask(true_ids, weights, nodes, self.num_experts, self.budget))
        # this access's totals, as the cache's running counts moved (exact ints, no array sums)
        num_hits, num_misses = stats.hits - hits_before, stats.misses - misses_before
        hits, demand = _MaskRows(access.hit_ids, self.num_layers), _MaskRows(access.miss_ids, self.num_layers)
        self._ledger_accessed(access)
        verify_ns = s_to_ns(self.timed.verify_s(len(nodes), dense.context_len))
        split = self._splits.get(verify_ns)
        if split is None:
            if len(self._splits) >= MEMO_MAX_ENTRIES:  # bounded: context-dependent verify times vary
                self._splits.clear()
            split = self._splits[verify_ns] = self._layer_split(verify_ns)
        layer_compute, layer_pre_router = split
        draft_ns = self._draft_ns.get(levels)
        if draft_ns is None:
            draft_ns = self._draft_ns[levels] = s_to_ns(self.timed.draft_s(levels))
        timing = engine.run_cycle(
            CyclePlan.build(
                draft_ns=draft_ns,
                decision_ns=self._decision_ns,
                layer_compute_ns=layer_compute,
                hits=hits,
                demand=demand,
                prefetch=prefetch,
                overlap=cfg.overlap,  # "off" | "on" | "ideal"
                host_ns_per_transfer=self._host_ns,
                late_call_ns=self._late_call_ns,
                demand_counts=access.num_misses,
                next_layer=next_layer,
                layer_pre_router_ns=layer_pre_router,
                copy_stream=self._prefetches or None,  # live.offload: any prefetch mode enqueues demand copies too
                placing_ns_per_transfer=self._placing_ns,
            )
        )
        if next_layer:  # the next-layer copies count as prefetch copies of the layer they fill
            prefetch = prefetch + [(layer + 1, e) for layer, experts in enumerate(next_layer) for e in experts]
        path = committed_path(tree, path_ok, nodes)
        num_accepted = len(path) - 1
        num_committed = min(num_accepted + 1, remaining)
        if self._uses_recent:  # the only reader of the routing history (_choose)
            history.extend(true_ids[path].astype(np.int64))
        self._account(timing, plan, nodes, levels, num_hits, num_misses, prefetch, num_accepted, num_committed)
        if observe is not None:  # as live.spec.engine: the policy sees each realised cycle, priced
            # this cycle's prefetch copies (as live.spec)
            issued = self._no_copies if issued_before is None else self.ledger.copies_since(issued_before)
            observe(
                self.cost, num_committed, levels, len(nodes), dense.context_len, access.num_misses, root_misses, issued,
                root_copies,
            )  # fmt: skip
        if cfg.record_cycles:
            tokens = [int(t) for t in tree.token_ids[path[1:]]] + [int(dense.target_tokens[path[-1]])]
            self.records.append(
                self._record(
                    rid,
                    cycle_index,
                    dense,
                    timing,
                    plan,
                    nodes,
                    levels,
                    access,
                    prefetch,
                    split,
                    num_accepted,
                    num_committed,
                    tokens[:num_committed],
                    reached_depth(tree, path, nodes),
                )
            )
        return num_committed

    def _account(
        self,
        timing: CycleTiming,
        plan: Any,
        nodes: np.ndarray,
        levels: int,
        num_hits: int,
        num_misses: int,
        prefetch: list,
        num_accepted: int,
        num_committed: int,
    ) -> None:
        t = self.totals
        t["num_cycles"] += 1
        t["num_committed"] += num_committed
        t["num_accepted"] += num_accepted
        t["num_nodes_verified"] += len(nodes)
        t["num_draft_levels"] += levels
        t["decode_ns"] += timing.cycle_ns
        t["draft_ns"] += timing.draft_end_ns - timing.start_ns
        # compute-stream busy time: the layers' spans less the late-copy waits at their ends
        busy_ns = timing.busy_ns
        t["verify_ns"] += busy_ns
        t["h2d_ns"] += timing.h2d_ns
        t["stall_ns"] += timing.end_ns - timing.verify_start_ns - busy_ns  # = timing.stall_ns
        t["cache_hits"] += num_hits
        t["cache_misses"] += num_misses
        t["h2d_bytes"] += timing.num_transfers * self.expert_bytes
        t["prefetch_bytes"] += len(prefetch) * self.expert_bytes
        t["num_transfers"] += timing.num_transfers
        t["predicted_committed"] += float(getattr(plan, "expected_committed", 0.0) or 0.0)
        if not getattr(plan, "exact", True):  # cut by its deadline (live.spec.recording.RunTotals)
            t["planner_deadline_hits"] += 1
            t["planner_gap_sum"] += float(plan.gap)

    def _record(
        self,
        rid: int,
        cycle_index: int,
        dense: Any,
        timing: CycleTiming,
        plan: Any,
        nodes: np.ndarray,
        levels: int,
        access: Any,
        prefetch: list,
        split: tuple,
        num_accepted: int,
        num_committed: int,
        tokens: list,
        reached: int,
    ) -> CycleRecord:
        layer_compute, layer_pre_router = split  # ns per layer, as the cycle was timed (_layer_split)
        layer_misses = access.num_misses.tolist()
        counts = self.ledger.counts()
        issued, used, wasted = (now - before for now, before in zip(counts, self._ledger_counts))
        self._ledger_counts = counts
        per_layer_copies = list(layer_misses)
        for layer, _ in prefetch:
            per_layer_copies[layer] += 1
        prefetching = self.config.prefetch != "none"
        return CycleRecord(
            request_id=int(rid),
            cycle_index=int(cycle_index),
            position=int(dense.position),
            context_len=int(dense.context_len),
            policy=self.config.policy,
            num_draft_levels=int(levels),
            num_nodes_verified=len(nodes),
            # ids in the drafted tree, the tree after `levels` levels (plan.nodes: sorted), as the
            # live engine records them; `nodes` are their ids in the recorded union of level trees
            verified_nodes=[int(v) for v in plan.nodes],
            num_accepted=int(num_accepted),
            num_committed=int(num_committed),
            draft_s=ns_to_s(timing.draft_end_ns - timing.start_ns),
            verify_s=ns_to_s(sum(layer_compute)),
            h2d_s=ns_to_s(timing.h2d_ns),
            cycle_s=ns_to_s(timing.cycle_ns),
            layer_misses=layer_misses,
            layer_h2d_bytes=[n * self.expert_bytes for n in per_layer_copies],
            layer_h2d_s=[ns_to_s(x) for x in timing.layer_h2d_ns],
            layer_compute_s=[ns_to_s(x) for x in layer_compute],
            layer_pre_router_s=[ns_to_s(x) for x in layer_pre_router or (0,) * len(layer_compute)],
            cache_hits=int(access.num_hits.sum()),
            cache_misses=int(access.num_misses.sum()),
            predicted_expected_committed=float(plan.expected_committed),
            predicted_cycle_s=float(plan.predicted_cycle_s),
            decision_s=float(self.decision_s),
            committed_token_ids=list(tokens),
            num_prefetch_issued=issued if prefetching else None,
            num_prefetch_used=used if prefetching else None,
            num_prefetch_wasted=wasted if prefetching else None,
            prefetch_wasted_bytes=wasted * self.expert_bytes if prefetching else None,
            reached_depth=int(reached),
        )


class _TreeData:
    """One recorded tree, prepared once per process for every replay of it (``_Replayer._tree_data``).

    The planning problem after ``k`` draft levels is the tree the live engine's drafter held after
    ``k`` levels (``live.spec.draft``: EAGLE-2 reranking, so a later level may push a shallow node
    out): with the trace's ``last_level`` (format v2), exactly that tree
    (``DenseTree.level_nodes``), and its calibrated acceptance computed on it (siblings are
    renormalised against the siblings present, ``specfit.acceptance.path_accept_probs``); without
    it (format v1) the final tree cut at depth ``k`` (:data:`LEVEL_TREE_APPROXIMATION`).

    Attributes:
        dense: the ``traces.reader.DenseTree`` (validated when first read).
        depth: the draft levels run for it (its max depth without ``last_level``).
        level_trees: whether the trace recorded its per-level trees.
        levels: draft levels -> (the tree after ``levels`` levels, its node ids in ``dense.tree``).
        accept: (acceptance map key, levels) -> read-only float64 P(v) of that tree's nodes.
    """

    __slots__ = ("accept", "dense", "depth", "level_trees", "levels")

    def __init__(self, dense: Any) -> None:
        self.dense = dense
        self.level_trees = dense.last_level is not None
        self.depth = int(dense.num_levels)
        self.levels: dict[int, tuple[Any, np.ndarray]] = {}
        self.accept: dict[tuple[str, int], np.ndarray] = {}

    def level(self, levels: int) -> tuple[Any, np.ndarray]:
        """(the tree after ``levels`` draft levels, its node ids int64[] ascending)."""
        got = self.levels.get(levels)
        if got is None:
            tree = self.dense.tree
            keep = self.dense.level_nodes(levels)  # without last_level: the nodes at depth <= levels
            sub = tree if len(keep) == tree.num_nodes else _depth_subtree(tree, keep)
            got = self.levels[levels] = (sub, keep)
        return got

    def accept_probs(self, key: str, levels: int, calibration: Any) -> np.ndarray:
        """``path_accept_probs`` of :meth:`level` ``(levels)``'s tree (format v1: of the whole
        tree, restricted to the cut, which is the same for a depth cut); ``key`` names the
        calibration (the same key must always mean the same map)."""
        got = self.accept.get((key, levels))
        if got is None:
            from specfit.acceptance import path_accept_probs

            sub, keep = self.level(levels)
            if self.level_trees:
                got = path_accept_probs(sub, calibration)
            else:
                full = self.accept.get((key, -1))
                if full is None:
                    full = path_accept_probs(self.dense.tree, calibration)
                    full.setflags(write=False)
                    self.accept[(key, -1)] = full
                got = full if sub is self.dense.tree else full[keep]
            got.setflags(write=False)
            self.accept[(key, levels)] = got
        return got


LEVEL_TREE_APPROXIMATION = (
    "level trees approximated: the trace has no per-level trees (nodes.last_level: a format-v1 or "
    "synthetic trace), so SpecFit's stopping rule is asked on each position's final draft tree cut at "
    "each depth, not on the trees a live drafter holds after each level (a node a later level pushed out "
    "is missing); a dense trace recorded by live.record --mode dense has them"
)


def level_tree_note(trace_run: Any) -> str | None:
    """:data:`LEVEL_TREE_APPROXIMATION` for a dense trace without its per-level trees
    (``TraceRun.has_level_trees`` false), else None: the one line ``sim.sweep`` and
    ``analysis.validate`` print and record."""
    return None if trace_run.has_level_trees else LEVEL_TREE_APPROXIMATION


def _restrict(node_experts: Any, keep: np.ndarray) -> Any:
    """``NodeExperts`` of the nodes ``keep`` only (per-node mode)."""
    import dataclasses

    return dataclasses.replace(node_experts, bits=node_experts.bits[keep])


def prepare_trace(trace_run: Any) -> None:
    """Decode ``trace_run``'s dense trees, prompts and requests (the tables the replay reads) and
    validate every tree, in this process: later replays, and workers forked afterwards, reuse
    them (see ``_Replayer._tree_data``).

    Raises:
        traces.reader.TraceError: a recorded tree fails ``DraftTree``'s checks (names the file).
    """
    arrays = trace_run.node_arrays()
    trees = _TREES.setdefault(trace_run, [None] * arrays.num_trees)
    for i in range(arrays.num_trees):
        if trees[i] is None:
            trees[i] = _TreeData(arrays.tree(i))
    for table in ("requests", "prefill"):
        trace_run.arrow(table)


def replay_policy(
    trace_run: Any, config: SimConfig, *, progress: Callable[[int], None] | None = None
) -> ReplayResult:
    """Replay one policy configuration on a dense trace.

    Args:
        trace_run: a ``traces.reader.TraceRun`` of a dense run (``open_run(path)``).
        config: the replay configuration (policy, cache, predictor, link, cost model).
        progress: called with 1 after each simulated cycle (for progress bars).

    Returns:
        :class:`ReplayResult` with one ``traces.schema.CycleRecord`` per cycle (when
        ``config.record_cycles``) and the totals.

    Raises:
        ReplayError: the cost model's layer count differs from the trace's, the cache is larger
            than the experts per layer, or the dense trace lacks the tree at a position the
            replay reaches.
        ValueError: unknown policy, cache policy or predictor name (from ``specfit``).
    """
    return _Replayer(trace_run, config, _load_specfit()).replay(progress)
