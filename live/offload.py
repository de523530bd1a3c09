"""Offloaded MoE runtime: experts in host memory, a policy-driven device expert cache.

:meth:`OffloadedMoE.install` replaces the ``experts`` module of every MoE block of a loaded
transformers model (see ``live.loader``) by an :class:`OffloadedExperts` module and keeps
everything else upstream's (attention, norms, router, shared experts, KV cache). For each forward
pass and MoE layer l, with the top-k ids the router chose for the T tokens:

1. the router's top-k ids and weights are recorded (``last_routing``), by the engine itself;
2. ``U_l`` = the union of the ids is passed to the cache policy, ``cache.access(l, U_l)``
   (``specfit.cache.ExpertCache``: the same object and the same access sequence the simulator
   uses, hence the same hits, misses and evictions);
3. evicted experts free their slots; every miss is fetched over the :class:`live.h2d.H2DLink`
   into a persistent slot (if the policy keeps it) or a scratch slot (transient) BEFORE the
   layer's experts compute (on CUDA the compute stream waits on the copy's end event). With
   ``overlap`` the misses are enqueued on the link's copy stream (``H2DLink.enqueue``) once the
   router has run; the resident experts compute while they are in flight and each missing
   expert computes as soon as its own copy lands (fetch-before-compute per expert);
4. transformers' own expert kernel for the model's ``experts_implementation`` (eager,
   ``batched_mm`` or ``grouped_mm``) runs on the slot tensors with ids remapped to slots, so
   offloaded output equals resident output within float rounding (often bit-for-bit; tested
   for every supported architecture).

Per forward pass the engine measures, per MoE layer: hits, misses, evictions, H2D bytes, H2D
seconds, stall seconds (the compute stream waiting on copies) and compute seconds (= wall time of
the decoder layer minus its stall; ``perf_counter`` on CPU, CUDA events on GPU), and per copy when
it was enqueued, started and landed. Bracket each forward with :meth:`OffloadedMoE.begin_forward` /
:meth:`OffloadedMoE.end_forward`; a forward that is not bracketed (e.g. inside ``generate``) is
bracketed automatically by a wrapper of ``model.forward``.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import torch

from live.expert_store import DeviceExpertPool, ExpertView, HostExpertStore
from live.h2d import H2DFetch, H2DLink, H2DLinkInfo
from live.loader import MoESpec, describe_moe, find_moe_blocks
from live.spec.names import CACHE_POLICIES
from live.spec.routing import order_by_weight
from specfit.prefetch import PREFETCH_MODES, uses_next_layer


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferLog:
    """Per-copy H2D records of one forward pass (or several concatenated), in issue order.

    ``layers``, ``experts`` (int64[M]): MoE layer and expert id of each copy; ``num_bytes``
    (int64[M]): bytes of the copy; ``h2d_s`` (float64[M]): its measured seconds;
    ``enqueued_at_s``, ``started_at_s``, ``landed_at_s`` (float64[M]): seconds from the start of
    the forward pass to the copy's enqueue on the copy stream (the layer's router has run), to its
    start and to its landing (``live.h2d.H2DFetch.copy_spans``); ``placed_at_s`` (float64[M]): to
    the end of the copy's host memcpy on the CPU copy stream, NaN where not measured (synchronous
    fetches, CUDA; ``live.h2d.H2DFetch.placed_at``). One expert is
    one *transfer* made of one or more tensor copies (gate/up and down: 2 for every supported
    architecture); ``copies_per_transfer`` gives that count. These are the rows of the trace's
    ``transfers`` table (``traces.writer.TraceWriter.add_transfers``).
    """

    layers: np.ndarray
    experts: np.ndarray
    num_bytes: np.ndarray
    h2d_s: np.ndarray
    enqueued_at_s: np.ndarray
    started_at_s: np.ndarray
    landed_at_s: np.ndarray
    placed_at_s: np.ndarray

    @classmethod
    def empty(cls) -> TransferLog:
        """No copies."""
        ints = np.zeros(0, dtype=np.int64)
        floats = np.zeros(0, dtype=np.float64)
        return cls(ints, ints, ints, floats, floats, floats, floats, floats)

    @classmethod
    def concat(cls, logs) -> TransferLog:
        """Concatenate logs in order."""
        logs = [log for log in logs if len(log)]
        if not logs:
            return cls.empty()
        if len(logs) == 1:
            return logs[0]
        return cls(*(np.concatenate([getattr(log, f.name) for log in logs]) for f in fields(cls)))

    def __len__(self) -> int:
        return int(self.h2d_s.shape[0])

    @property
    def copies_per_transfer(self) -> int:
        """Copies per expert transfer (rows per (layer, expert) run; 0 when empty)."""
        if not len(self):
            return 0
        starts = np.flatnonzero(
            np.r_[True, (self.layers[1:] != self.layers[:-1]) | (self.experts[1:] != self.experts[:-1])]
        )
        return int(round(len(self) / starts.size))


@dataclass(frozen=True)
class ForwardStats:
    """Measurements of one forward pass (or a sum of several, see ``__add__``).

    Per MoE layer (arrays of length L): ``layer_hits``, ``layer_misses`` and ``layer_evictions``
    (experts, as counted by the cache policy), ``layer_h2d_bytes`` (bytes fetched, including
    re-syncs of experts the cache says are cached but the pool lacked), ``layer_h2d_s`` (seconds
    the layer's fetches took: the timed copies plus the host seconds spent placing the missed
    experts into slots right before them, a per-miss cost that belongs to the miss rather than
    to the layer's compute), ``layer_stall_s`` (seconds the compute stream waited for the layer's
    copies, placing included: the whole ``layer_h2d_s`` without overlap; with overlap only the waits
    for copies that had not landed when their expert's turn came), ``layer_compute_s``
    (decoder-layer seconds minus its stall seconds), ``layer_pre_router_s`` (the part of
    ``layer_compute_s`` before the layer's experts were asked for: attention, norms and the
    router, from the decoder layer's start to the experts module's call; ``None`` on sums with a
    record lacking it).
    ``num_tokens``: tokens in the forward (T, batch flattened); ``num_forwards``: forwards summed;
    ``wall_s``: wall seconds between ``begin_forward`` and ``end_forward``. ``transfers``: the
    per-copy records (:class:`TransferLog`, bytes summing to ``h2d_bytes``; seconds of the copies
    alone, so they sum to ``h2d_s`` minus the placing time) of a forward from :meth:`OffloadedMoE.end_forward`; ``None`` on sums kept by the
    engine (``total_stats``) and on :meth:`zeros`. ``a + b`` concatenates them when both have one.
    ``num_prefetch_issued``/``_used``/``_wasted``: prefetched experts copied, hit before leaving
    the cache, and evicted first, during this forward (and the draft prefetch just before it;
    ``specfit.prefetch.PrefetchLedger``); ``prefetch_wasted_bytes``: bytes of the wasted ones.
    """

    num_tokens: int
    num_forwards: int
    wall_s: float
    layer_hits: np.ndarray
    layer_misses: np.ndarray
    layer_evictions: np.ndarray
    layer_h2d_bytes: np.ndarray
    layer_h2d_s: np.ndarray
    layer_compute_s: np.ndarray
    layer_stall_s: np.ndarray
    transfers: TransferLog | None = None
    num_prefetch_issued: int = 0
    num_prefetch_used: int = 0
    num_prefetch_wasted: int = 0
    prefetch_wasted_bytes: int = 0
    layer_pre_router_s: np.ndarray | None = None

    @classmethod
    def zeros(cls, num_layers: int) -> ForwardStats:
        """Empty statistics for ``num_layers`` MoE layers."""
        ints = [np.zeros(num_layers, dtype=np.int64) for _ in range(4)]
        floats = [np.zeros(num_layers, dtype=np.float64) for _ in range(3)]
        return cls(0, 0, 0.0, *ints, *floats, layer_pre_router_s=np.zeros(num_layers, dtype=np.float64))

    def __add__(self, other: ForwardStats) -> ForwardStats:
        summed = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name not in ("transfers", "layer_pre_router_s")
        }
        if self.layer_pre_router_s is not None and other.layer_pre_router_s is not None:
            summed["layer_pre_router_s"] = self.layer_pre_router_s + other.layer_pre_router_s
        if self.transfers is not None and other.transfers is not None:
            summed["transfers"] = TransferLog.concat((self.transfers, other.transfers))
        return ForwardStats(**summed)

    @property
    def hits(self) -> int:
        """Cache hits over all layers."""
        return int(self.layer_hits.sum())

    @property
    def misses(self) -> int:
        """Cache misses over all layers."""
        return int(self.layer_misses.sum())

    @property
    def evictions(self) -> int:
        """Evictions over all layers."""
        return int(self.layer_evictions.sum())

    @property
    def h2d_bytes(self) -> int:
        """Bytes fetched over all layers."""
        return int(self.layer_h2d_bytes.sum())

    @property
    def h2d_s(self) -> float:
        """H2D seconds over all layers."""
        return float(self.layer_h2d_s.sum())

    @property
    def compute_s(self) -> float:
        """Compute seconds of the MoE decoder layers."""
        return float(self.layer_compute_s.sum())

    @property
    def stall_s(self) -> float:
        """Seconds the compute stream waited for H2D copies (equals ``h2d_s`` without overlap)."""
        return float(self.layer_stall_s.sum())

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); NaN when nothing was accessed."""
        total = self.hits + self.misses
        return self.hits / total if total else float("nan")

    def to_dict(self) -> dict:
        """JSON-ready dict (arrays as lists) with the totals added."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "transfers"}
        if self.layer_pre_router_s is None:
            del d["layer_pre_router_s"]
        d = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}
        d.update(
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            h2d_bytes=self.h2d_bytes,
            h2d_s=self.h2d_s,
            compute_s=self.compute_s,
            stall_s=self.stall_s,
        )
        if self.transfers is not None:
            d["transfers"] = {
                f.name: getattr(self.transfers, f.name).tolist() for f in fields(self.transfers)
            }
        return d


class _LayerTimer:
    """Start/stop timing of decoder layers: ``perf_counter`` on CPU, CUDA events on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def elapsed_s(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


class _ForwardState:
    """Per-forward scratch: routing, fetch handles and layer timing marks."""

    def __init__(self, num_layers: int, started_s: float, auto: bool, origin) -> None:
        self.started_s = started_s
        self.origin = origin  # the layer timer's mark at the start (spans are measured from it)
        self.auto = auto
        self.num_tokens = 0
        self.hits = np.zeros(num_layers, dtype=np.int64)
        self.misses = np.zeros(num_layers, dtype=np.int64)
        self.evictions = np.zeros(num_layers, dtype=np.int64)
        self.fetches: list[list[H2DFetch]] = [[] for _ in range(num_layers)]
        self.fetch_experts: list[list[np.ndarray]] = [[] for _ in range(num_layers)]  # int64[n] per fetch
        self.placing_s = np.zeros(num_layers, dtype=np.float64)  # host seconds placing misses
        self.waited_s = np.zeros(num_layers, dtype=np.float64)  # compute waiting on copy-stream copies
        self.prefetch_counts = (0, 0, 0)  # the prefetch ledger's counts at the start
        self.cuda_waits: list[list[tuple]] = [[] for _ in range(num_layers)]  # (mark, fetch, transfer)
        self.marks: list[list] = [[] for _ in range(num_layers)]  # [start, end] pairs per call
        self.router_marks: list[list] = [[] for _ in range(num_layers)]  # experts asked for, per call
        self.ids: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
        self.weights: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.next_ids: list[list[np.ndarray]] = [[] for _ in range(num_layers - 1)]  # int64[T, K]


class _LayerWork(NamedTuple):
    """What :meth:`OffloadedMoE._prepare_layer` hands the experts module for one layer.

    ``view``: the kernel view covering every expert of the layer (ids remapped to slots);
    ``waits``: with overlap, the layer's experts whose copies (demand or prefetch) are still in
    flight, as ``(fetch, transfer index, expert)`` in issue order (empty: compute at once);
    ``ids`` int64[T, K]: the router's top-k ids."""

    view: ExpertView
    waits: list
    ids: np.ndarray


# ---------------------------------------------------------------------------------------------
# the experts module installed into the model
# ---------------------------------------------------------------------------------------------
class OffloadedExperts(torch.nn.Module):
    """Drop-in replacement of a transformers ``*Experts`` module whose weights live in the pool.

    ``forward(hidden_states[T, H], top_k_index int[T, K], top_k_weights[T, K]) -> [T, H]``, the
    upstream signature. It asks the engine to make the layer's experts resident (fetching misses),
    then runs the upstream experts forward (dispatching on ``config._experts_implementation``) on
    the slot tensors with ids remapped to slots: one call, or, with overlap and copies in flight,
    one call per group of experts that are ready (resident first, then as copies land).
    Holds no parameters.
    """

    is_offloaded = True

    def __init__(self, original: torch.nn.Module, engine: OffloadedMoE, moe_index: int) -> None:
        super().__init__()
        self._experts_cls = type(original)
        self.config = original.config
        self.act_fn = original.act_fn
        for flag, default in (
            ("has_gate", True),
            ("has_bias", False),
            ("is_transposed", False),
            ("is_concatenated", True),
            ("has_post_expert_norm", False),
        ):
            setattr(self, flag, getattr(original, flag, default))
        if self.has_bias or not self.has_gate or self.is_transposed or self.has_post_expert_norm:
            raise ValueError(
                f"{self._experts_cls.__name__}: only gated, bias-free, untransposed experts are supported"
            )
        self._view: ExpertView | None = None
        self.moe_index = moe_index
        self.engine = engine

    @property
    def store(self) -> HostExpertStore:
        """The host store holding this model's experts."""
        return self.engine.store

    @property
    def gate_up_proj(self) -> torch.Tensor:
        """Slot tensor ``[n, 2I, H]`` of the view being computed (what upstream kernels index)."""
        return self._view.gate_up

    @property
    def down_proj(self) -> torch.Tensor:
        """Slot tensor ``[n, H, I]`` of the view being computed."""
        return self._view.down

    @property
    def num_experts(self) -> int:
        """Slots of the view being computed (upstream kernels size one-hot/histograms by it)."""
        return self._view.num_slots

    @property
    def _is_expert_parallel(self) -> bool:
        # upstream's sentinel handling (ids == num_experts are skipped) for split views
        return self._view is not None and self._view.has_sentinels

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self._experts_cls._apply_gate(self, gate_up_out)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        work = self.engine._prepare_layer(self.moe_index, top_k_index, top_k_weights)
        self.engine._next_layer(self.moe_index, hidden_states)
        try:
            if not work.waits:
                return self._run(work.view, hidden_states, work.view.slot_index, work.view.weights)
            return self._run_as_copies_land(work, hidden_states)
        finally:
            self._view = None
            self.engine.pool.end_layer()

    def _run(self, view: ExpertView, hidden_states, view_index, weights) -> torch.Tensor:
        self._view = view
        return self._experts_cls.forward(self, hidden_states, view_index, weights)

    def _run_as_copies_land(self, work: _LayerWork, hidden_states: torch.Tensor) -> torch.Tensor:
        """Fetch-before-compute per expert (overlap): one upstream kernel call on the token-expert
        pairs of the experts already resident (or landed) while the others are in flight, then
        one call per group of late experts whose copies have landed together
        (:meth:`OffloadedMoE._pairs_as_copies_land`). Each call gets the layer's own ``[T, K]``
        routing with the other pairs set to upstream's expert-parallel sentinel (id ``n``,
        weight 0: skipped by the kernels, as in a split layer), and the calls' outputs are
        summed: the one-call layer up to float rounding (the sum over K is regrouped). With
        nothing in flight any more when the layer computes, it is the one-call layer itself."""
        view = work.view
        groups = self.engine._pairs_as_copies_land(self.moe_index, work)
        first = next(groups)
        if first is None:  # every copy landed already: one call
            return self._run(view, hidden_states, view.slot_index, view.weights)
        sentinel = torch.full_like(view.slot_index, view.num_slots)  # [T, K]
        zero = torch.zeros_like(view.weights)  # [T, K]
        out = None
        for mask in itertools.chain((first,), groups):  # bool[T, K]; each group once it landed
            part = self._run(
                view._replace(mask=mask),
                hidden_states,
                torch.where(mask, view.slot_index, sentinel),
                torch.where(mask, view.weights, zero),
            )  # [T, D]
            out = part if out is None else out + part
        return out

    def extra_repr(self) -> str:
        return f"moe_index={self.moe_index}, offloaded"


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
def _cache_capacity(cache) -> int | None:
    """The cache's uniform capacity per layer (``capacity`` int or int[L]; None if absent).

    Raises ``ValueError`` for per-layer capacities that differ (the slot pool is uniform).
    """
    for name in ("capacity_per_layer", "capacity"):
        value = getattr(cache, name, None)
        if value is None:
            continue
        values = np.unique(np.asarray(value, dtype=np.int64))
        if values.size != 1:
            raise ValueError(
                f"cache.{name}: the offloaded runtime needs one capacity for all layers, got {value}"
            )
        return int(values[0])
    return None


def _check_cache(cache, num_layers: int, num_experts: int, capacity: int) -> None:
    """``ValueError`` naming the field when ``cache`` does not fit the model or the pool."""
    for name, want in (("num_layers", num_layers), ("num_experts", num_experts)):
        got = getattr(cache, name, want)
        if got != want:
            raise ValueError(f"cache.{name}: expected {want} (the model's MoE {name[4:]}), got {got}")
    got_capacity = _cache_capacity(cache)
    if got_capacity is not None and got_capacity != capacity:
        raise ValueError(
            f"cache capacity per layer: expected {capacity} (the slot pool's), got {got_capacity}"
        )


def _bits_to_ids(words: np.ndarray) -> np.ndarray:
    """uint64[W] bitset -> sorted expert ids (bit e of word e // 64 is expert e)."""
    bits = np.unpackbits(np.asarray(words, dtype="<u8").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


class OffloadedMoE:
    """Offloaded-expert engine installed on one transformers MoE model.

    Build with :meth:`install`. Public attributes: ``model``, ``cache`` (the ExpertCache
    policy object), ``link`` (:class:`H2DLink`), ``store`` (:class:`HostExpertStore`), ``pool``
    (:class:`DeviceExpertPool`), ``spec`` (:class:`live.loader.MoESpec`), ``num_layers`` L,
    ``num_experts`` E, ``top_k`` K, ``capacity_per_layer`` C, ``bytes_per_expert``,
    ``last_stats`` (:class:`ForwardStats` of the last finished forward), ``total_stats`` (sum
    since install or :meth:`reset_stats`), ``warm_bytes`` (bytes moved outside forward passes by
    :meth:`warm` and cache (re)synchronisation).
    """

    def __init__(self) -> None:  # use install()
        raise TypeError("use OffloadedMoE.install(model, cache, link)")

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def install(
        cls,
        model: torch.nn.Module,
        cache,
        link: H2DLink | None = None,
        recorder: Callable[[ForwardStats], None] | None = None,
        *,
        capacity_per_layer: int | None = None,
        record_routing: bool = True,
        overlap: bool = False,
        prefetch: str = "none",
        record_next_layer: bool = False,
    ) -> OffloadedMoE:
        """Offload ``model``'s routed experts and return the engine driving them.

        Args:
            model: a model from ``live.loader.load_target`` (experts anywhere; they are moved to
                host memory, pinned on CUDA when possible).
            cache: a ``specfit.cache.ExpertCache`` with ``num_layers`` = number of MoE layers and
                ``num_experts`` = E; its current content is loaded into the pool (not counted).
            link: the H2D link (default: ``H2DLink("cpu")``, a plain memcpy); the non-expert
                weights are moved to ``link.device``.
            recorder: called with each forward's :class:`ForwardStats` at ``end_forward``.
            capacity_per_layer: persistent slots per layer; default: the cache's
                ``capacity_per_layer`` attribute.
            record_routing: keep top-k ids and weights for :meth:`last_routing`.
            overlap: copy a layer's misses on the link's copy stream (``H2DLink.enqueue``) while
                the layer computes its resident experts, and compute each missing expert as soon
                as its copy lands; without it a layer's copies complete before any of its
                experts computes.
            prefetch: one of :data:`PREFETCH_MODES`: ``draft`` (:meth:`prefetch_predicted`,
                called by the decode loop once the subtree is chosen), ``next-layer`` (layer
                l+1's router on layer l's MoE input, see ``specfit.prefetch``) or ``both``.
                Prefetched experts enter the cache through ``cache.warm`` (the replacement
                policy decides what leaves) and cross the link on the copy stream; a layer waits
                for a prefetched expert's copy only when it needs that expert.
            record_next_layer: keep every token's next-layer guess (what ``next-layer`` prefetch
                copies ahead) for :meth:`last_next_layer_routing`, with or without prefetch
                (``live.record --mode dense`` records it in the trace for ``sim.replay``).

        Raises:
            ValueError: no MoE layer, experts already offloaded, or capacity outside ``0..E``.
        """
        self = object.__new__(cls)
        link = link or H2DLink("cpu")
        blocks = find_moe_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__}: no MoE layers (mlp.gate + mlp.experts) to offload")
        if any(getattr(b.experts, "is_offloaded", False) for _, b in blocks):
            raise ValueError("model experts are already offloaded (install once per model)")
        self.spec: MoESpec = describe_moe(model)
        capacity = capacity_per_layer if capacity_per_layer is not None else _cache_capacity(cache)
        if capacity is None:
            raise ValueError(
                "capacity_per_layer: not given and the cache has no capacity_per_layer attribute"
            )
        if not 0 <= capacity <= self.spec.num_experts:
            raise ValueError(
                f"capacity_per_layer (--cache): expected 0..{self.spec.num_experts} "
                f"(the experts per layer), got {capacity}"
            )
        _check_cache(cache, self.spec.num_layers, self.spec.num_experts, capacity)
        self.model = model
        self.link = link
        self.recorder = recorder
        self.record_routing = bool(record_routing)
        self.overlap = bool(overlap)
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"--prefetch: expected one of {', '.join(PREFETCH_MODES)}, got {prefetch!r}")
        self.prefetch = prefetch
        self.record_next_layer = bool(record_next_layer)
        # copies go through the link's copy stream (FIFO) whenever anything may be in flight
        self._copy_stream = self.overlap or prefetch != "none"
        self._gates = [block.gate for _, block in blocks]
        self._in_flight: dict[tuple[int, int], tuple[H2DFetch, int]] = {}
        self._carried: list[tuple[int, H2DFetch, np.ndarray]] = []  # (layer, fetch, experts)
        gate_up, down = [], []
        for moe_index, (_, block) in enumerate(blocks):
            original = block.experts
            gate_up.append(link.prepare_host(original.gate_up_proj.data))
            down.append(link.prepare_host(original.down_proj.data))
            block.experts = OffloadedExperts(original, self, moe_index)
            del original
        self.store = HostExpertStore(gate_up, down)
        from specfit.prefetch import PrefetchLedger

        self.ledger = PrefetchLedger(len(blocks), self.store.num_experts)
        self._ledger_counts_at_end = self.ledger.counts()
        self.pool = DeviceExpertPool(self.store, capacity, link.device)
        self.num_layers = self.store.num_layers
        self.num_experts = self.store.num_experts
        self.top_k = self.spec.top_k
        self.capacity_per_layer = capacity
        self.bytes_per_expert = self.store.bytes_per_expert
        model.to(link.device)
        self._timer = _LayerTimer(link.device)
        self._state: _ForwardState | None = None
        self._last_state: _ForwardState | None = None
        self.last_stats: ForwardStats | None = None
        self.total_stats = ForwardStats.zeros(self.num_layers)
        self.warm_bytes = 0
        # Instance-level forward wrappers rather than nn.Module hooks: a module with hooks leaves
        # torch's fast call path, which costs more than the whole bookkeeping on small models.
        layers = model.model.layers
        for moe_index, (layer_index, _) in enumerate(blocks):
            layers[layer_index].forward = self._timed_layer_forward(layers[layer_index].forward, moe_index)
        model.forward = self._bracketed_model_forward(model.forward)
        self._initial_cache = cache.copy()
        self.cache = cache
        self._sync_all_layers()
        return self

    # -- cache management ----------------------------------------------------------------------
    @property
    def h2d_link(self) -> H2DLinkInfo:
        """Link description for the run manifest."""
        return self.link.info

    def set_cache(self, cache) -> None:
        """Use ``cache`` from now on; the pool is synchronised with its content (not counted in
        forward statistics; bytes added to ``warm_bytes``). Raises ``ValueError`` on a layer,
        expert or capacity mismatch."""
        _check_cache(cache, self.num_layers, self.num_experts, self.capacity_per_layer)
        self.link.synchronize()  # no copy may still be landing in a slot the new content reuses
        self._in_flight.clear()
        self.ledger.restart(cache.stats.layer_miss_fraction)  # prefetched experts leave with the old content
        self.cache = cache
        self._sync_all_layers()

    def reset_cache(self) -> None:
        """Return to a copy of the cache as it was at install (e.g. between requests)."""
        self.set_cache(self._initial_cache.copy())

    def reset_stats(self) -> None:
        """Zero ``total_stats``."""
        self.total_stats = ForwardStats.zeros(self.num_layers)

    def warm(self, layer: int, expert_ids) -> int:
        """Insert ``expert_ids`` at MoE ``layer`` into the cache (``cache.warm``, uncounted) and
        fetch them into the pool; returns the bytes fetched (also added to ``warm_bytes``)."""
        self.cache.warm(layer, np.asarray(expert_ids, dtype=np.int64))
        return self._sync_layer(layer)

    def warm_all(self) -> int:
        """Warm every layer with experts ``0..C-1`` (with C = E: every expert cached)."""
        ids = np.arange(self.capacity_per_layer, dtype=np.int64)
        return sum(self.warm(layer, ids) for layer in range(self.num_layers))

    def _sync_all_layers(self) -> int:
        return sum(self._sync_layer(layer) for layer in range(self.num_layers))

    def _sync_layer(self, layer: int) -> int:
        """Make the pool's persistent slots of ``layer`` hold exactly the cache's experts."""
        cached = _bits_to_ids(self.cache.cached_bits()[layer])
        cached = cached[cached < self.num_experts]
        resident = self.pool.resident(layer)
        self.pool.release(layer, np.setdiff1d(resident, cached))
        transfers = [self.pool.place(layer, int(e), persistent=True) for e in np.setdiff1d(cached, resident)]
        fetch = self.link.fetch(transfers)
        fetch.seconds()
        self.warm_bytes += fetch.num_bytes
        return fetch.num_bytes

    # -- per-forward bracketing ----------------------------------------------------------------
    def begin_forward(self) -> None:
        """Start measuring a forward pass (call right before ``model(...)``)."""
        self._begin(auto=False)

    def _begin(self, auto: bool) -> None:
        if self._state is not None and not auto:
            raise RuntimeError(
                "begin_forward: the previous forward was not ended (call end_forward or abort_forward)"
            )
        origin = self._timer.mark()
        self._state = state = _ForwardState(self.num_layers, time.perf_counter(), auto, origin)
        state.prefetch_counts = self._ledger_counts_at_end  # a draft prefetch just before counts here
        for layer, fetch, experts in self._carried:  # prefetches issued since the last forward
            state.fetches[layer].append(fetch)
            state.fetch_experts[layer].append(experts)
        self._carried = []

    def abort_forward(self) -> None:
        """Drop the forward in progress without recording it (e.g. after an exception inside
        ``model(...)``); the cache and pool keep whatever the partial forward did to them."""
        self.link.synchronize()
        if self.link.device.type == "cuda":
            torch.cuda.synchronize(self.link.device)
        self._state = None
        self.pool.end_layer()

    def end_forward(self) -> ForwardStats:
        """Finish the forward pass started by :meth:`begin_forward`; return its statistics.

        Resolves CUDA timings (synchronises the compute stream only: copies still in flight, on
        CUDA as on the CPU copy stream, move to the next forward's records), updates
        ``last_stats``/``total_stats`` and calls the recorder. Raises ``RuntimeError`` without a
        matching ``begin_forward``.
        """
        state = self._state
        if state is None:
            raise RuntimeError("end_forward: no forward in progress (call begin_forward first)")
        if self.link.device.type == "cuda":  # the compute stream only: copies nobody waited for
            torch.cuda.current_stream(self.link.device).synchronize()  # carry into the next forward
        wall_s = time.perf_counter() - state.started_s
        self._carry_unlanded(state)
        h2d_bytes = np.array([sum(f.num_bytes for f in fl) for fl in state.fetches], dtype=np.int64)
        copies_s = np.array([sum(f.seconds() for f in fl) for fl in state.fetches], dtype=np.float64)
        h2d_s = copies_s + state.placing_s
        if self._copy_stream:
            stall_s = state.placing_s + state.waited_s
            for layer, waits in enumerate(state.cuda_waits):
                stall_s[layer] += sum(fetch.landed_after_s(i, ready) for ready, fetch, i in waits)
        else:
            stall_s = h2d_s
        elapsed = self._timer.elapsed_s
        layer_s = np.array([sum(elapsed(start, end) for start, end in marks) for marks in state.marks], dtype=np.float64)
        pre_router_s = np.array(  # each decoder-layer call's start to its experts' call (its router has run)
            [sum(elapsed(m[0], r) for m, r in zip(marks, routed)) for marks, routed in zip(state.marks, state.router_marks)],
            dtype=np.float64,
        )
        stats = ForwardStats(
            num_tokens=state.num_tokens,
            num_forwards=1,
            wall_s=wall_s,
            layer_hits=state.hits,
            layer_misses=state.misses,
            layer_evictions=state.evictions,
            layer_h2d_bytes=h2d_bytes,
            layer_h2d_s=h2d_s,
            layer_compute_s=np.maximum(layer_s - stall_s, 0.0),
            layer_stall_s=stall_s,
            transfers=self._transfer_log(state),
            **self._prefetch_counts(state),
            layer_pre_router_s=np.minimum(pre_router_s, np.maximum(layer_s - stall_s, 0.0)),
        )
        self._state = None
        self._last_state = state
        self.last_stats = stats
        self.total_stats = self.total_stats + replace(stats, transfers=None)
        if self.recorder is not None:
            self.recorder(stats)
        return stats

    def _prefetch_counts(self, state: _ForwardState) -> dict:
        counts = self.ledger.counts()
        issued, used, wasted = np.subtract(counts, state.prefetch_counts).tolist()
        self._ledger_counts_at_end = counts
        return {
            "num_prefetch_issued": issued,
            "num_prefetch_used": used,
            "num_prefetch_wasted": wasted,
            "prefetch_wasted_bytes": wasted * self.bytes_per_expert,
        }

    def _carry_unlanded(self, state: _ForwardState) -> None:
        """Copies still in flight at the end of a forward (prefetches nobody waited for) move to
        the next forward's records; landed ones leave ``_in_flight``."""
        for layer in range(self.num_layers):
            keep = []
            for f, e in zip(state.fetches[layer], state.fetch_experts[layer]):
                if f.done():  # asked once: a copy landing meanwhile must not fall in neither list
                    keep.append((f, e))
                else:
                    self._carried.append((layer, f, e))
            state.fetches[layer] = [f for f, _ in keep]
            state.fetch_experts[layer] = [e for _, e in keep]
        self._in_flight = {k: v for k, v in self._in_flight.items() if not v[0].done()}

    @staticmethod
    def _transfer_log(state: _ForwardState) -> TransferLog:
        """The per-copy records of a finished forward (layer order, then issue order)."""
        parts = []
        for layer, (fetches, experts) in enumerate(zip(state.fetches, state.fetch_experts)):
            for fetch, ids in zip(fetches, experts):
                per_copy = np.repeat(ids, fetch.copies_per_transfer)
                parts.append(
                    TransferLog(
                        np.full(per_copy.size, layer, dtype=np.int64),
                        per_copy,
                        fetch.copy_bytes,
                        fetch.copy_seconds(),
                        *fetch.copy_spans(state.origin),
                        fetch.placed_at(state.origin),
                    )
                )
        return TransferLog.concat(parts)

    def last_routing(self) -> tuple[np.ndarray, np.ndarray]:
        """Router choices of the last finished forward, tokens in input order (batch flattened).

        Returns ``(expert_ids int64[T, L, K], router_weights float32[T, L, K])``: the top-k ids
        and the weights the experts' outputs were combined with (after the architecture's
        normalisation/scaling, e.g. DeepSeek-V3's ``routed_scaling_factor``), each token's K
        choices in descending router weight (:func:`live.spec.routing.order_by_weight`).
        Raises ``RuntimeError`` if routing recording is off or no forward has finished.
        """
        if not self.record_routing:
            raise RuntimeError("last_routing: routing recording is off (record_routing=False)")
        state = self._last_state
        if state is None or not state.ids[0]:
            raise RuntimeError("last_routing: no finished forward pass yet")
        ids = np.stack([c[0] if len(c) == 1 else np.concatenate(c) for c in state.ids], axis=1)
        weights = torch.stack([c[0] if len(c) == 1 else torch.cat(c) for c in state.weights], dim=1)
        return order_by_weight(ids.astype(np.int64, copy=False), weights.float().cpu().numpy())

    def last_next_layer_routing(self) -> np.ndarray | None:
        """Next-layer guesses of the last finished forward, tokens in input order (batch
        flattened): int64[T, L-1, K], row ``l`` = the top-k of layer l+1's router on layer l's MoE
        input, by descending score (what ``--prefetch next-layer`` copies ahead; the trace column
        ``next_layer_expert_ids``). ``None`` without ``record_next_layer`` or with one MoE layer.
        Raises ``RuntimeError`` if no forward has finished."""
        if not self.record_next_layer or self.num_layers < 2:
            return None
        state = self._last_state
        if state is None:
            raise RuntimeError("last_next_layer_routing: no finished forward pass yet")
        per_layer = [
            np.concatenate(chunks) if chunks else np.zeros((0, self.top_k), dtype=np.int64)
            for chunks in state.next_ids
        ]
        return np.stack(per_layer, axis=1)

    # -- forward wrappers ------------------------------------------------------------------------
    def _bracketed_model_forward(self, forward: Callable) -> Callable:
        """Model forward that begins/ends measurement itself when the caller did not."""

        @functools.wraps(forward)
        def wrapper(*args, **kwargs):
            if self._state is not None:
                return forward(*args, **kwargs)
            self._begin(auto=True)
            try:
                return forward(*args, **kwargs)
            finally:
                if self._state is not None and self._state.auto:
                    self.end_forward()

        return wrapper

    def _timed_layer_forward(self, forward: Callable, moe_index: int) -> Callable:
        """Decoder-layer forward that records its start/end marks (for ``layer_compute_s``)."""
        mark = self._timer.mark

        @functools.wraps(forward)
        def wrapper(*args, **kwargs):
            if self._state is None:
                self._begin(auto=True)
            state = self._state
            start = mark()
            out = forward(*args, **kwargs)
            state.marks[moe_index].append((start, mark()))
            return out

        return wrapper

    # -- the per-layer work ----------------------------------------------------------------------
    def _prepare_layer(
        self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> _LayerWork:
        """Access the cache for the layer's expert union, fetch misses (with overlap: enqueue
        them on the copy stream), return the layer's kernel view and copies in flight."""
        state = self._state
        if state is None:  # experts called outside a model forward (tests, direct use)
            self._begin(auto=True)
            state = self._state
        state.router_marks[layer].append(self._timer.mark())  # attention and router are done
        ids_np = (top_k_index.detach() if top_k_index.requires_grad else top_k_index).cpu().numpy()
        if self.record_routing:
            state.ids[layer].append(ids_np.copy())
            state.weights[layer].append(top_k_weights.detach())
        if layer == 0:
            state.num_tokens += int(ids_np.shape[0])
        access = self.cache.access(layer, ids_np)  # the policy deduplicates: U_l = union of ids
        state.hits[layer] += len(access.hits)
        state.misses[layer] += len(access.misses)
        state.evictions[layer] += len(access.evicted)
        if self.prefetch != "none":  # nothing is pending without prefetch
            self.ledger.accessed(layer, access.hits, access.evicted, len(access.misses))
        pool = self.pool
        if len(access.evicted):
            self._release(layer, access.evicted)
        misses = np.asarray(access.misses, dtype=np.int64).tolist()
        hits = np.asarray(access.hits, dtype=np.int64)
        # hits the policy caches but the pool lacks (warmed outside the engine) are fetched too
        to_fetch = misses + hits[pool.slot_of[layer, hits] < 0].tolist()
        transfers = []
        if to_fetch:
            placing_started_s = time.perf_counter()
            keep = [bool(self.cache.contains(layer, e)) for e in to_fetch]
            if self._copy_stream and keep.count(False) > pool.num_scratch:
                self.link.synchronize()  # growing the arena moves slots copies may be landing in
            pool.reserve_scratch(keep.count(False))
            for e, kept in zip(to_fetch, keep):
                if pool.slot_of[layer, e] >= 0:  # policy says miss but the slot is filled: refill
                    pool.release(layer, (e,))
                if kept and not pool.has_free_slot(layer):
                    self._sync_layer_slots_only(layer)
                transfers.append(pool.place(layer, e, persistent=kept))
        # prefetched experts this layer hits whose copies may still be in flight
        waits = []
        if self._in_flight:  # only prefetches leave copies in flight across layers
            waits = [(*self._in_flight[(layer, int(e))], int(e)) for e in hits if (layer, int(e)) in self._in_flight]
            waits = [w for w in waits if not w[0].transfer_landed(w[1])]
        if transfers:
            fetched = np.asarray(to_fetch, dtype=np.int64)
            if self._copy_stream:  # CPU: the memcpys happen here, host time counted as placing
                fetch = self.link.enqueue(transfers)
                state.placing_s[layer] += time.perf_counter() - placing_started_s
                waits += [(fetch, i, int(e)) for i, e in enumerate(fetched)]
            else:
                state.placing_s[layer] += time.perf_counter() - placing_started_s
                fetch = self.link.fetch(transfers)
            state.fetches[layer].append(fetch)
            state.fetch_experts[layer].append(fetched)
        if waits and not self.overlap:  # the layer's copies all land before any expert computes
            self._wait(layer, waits)
            waits = []
        (view,) = pool.views(layer, top_k_index, top_k_weights)
        return _LayerWork(view, waits, ids_np)

    def _wait(self, layer: int, waits) -> None:
        """Make the compute stream wait for every ``(fetch, transfer, expert)`` of ``waits``; the
        host's waiting (CPU) is added to the layer's stall."""
        state = self._state
        for fetch, i, _ in waits:
            if self.link.device.type == "cuda":
                state.cuda_waits[layer].append((self._timer.mark(), fetch, i))
                fetch.wait_transfer(i)
            elif not fetch.transfer_landed(i):
                waiting_s = time.perf_counter()
                fetch.wait_transfer(i)
                state.waited_s[layer] += time.perf_counter() - waiting_s

    def _release(self, layer: int, experts) -> None:
        """Free the slots of ``experts`` (evicted) and forget their copies in flight."""
        self.pool.release(layer, experts)
        for e in experts:
            self._in_flight.pop((layer, int(e)), None)

    def _enqueue_prefetch(self, layer: int, experts: list[int], evicted, ahead: bool = False) -> H2DFetch | None:
        """Copy ``experts`` (already made resident in the cache by ``cache.warm``, which evicted
        ``evicted``) into persistent slots of ``layer`` on the copy stream; ``ahead``: next-layer
        prefetch's (``PrefetchLedger.issue``)."""
        self.ledger.evicted(layer, evicted)
        if len(evicted):
            self._release(layer, evicted)
        if not experts:
            return None
        transfers = []
        for e in experts:
            if not self.pool.has_free_slot(layer):
                self._sync_layer_slots_only(layer)
            transfers.append(self.pool.place(layer, e, persistent=True))
        fetch = self.link.enqueue(transfers)
        for i, e in enumerate(experts):
            self._in_flight[(layer, e)] = (fetch, i)
        self.ledger.issue(layer, experts, ahead=ahead)
        return fetch

    def prefetch_predicted(self, predicted_bits: np.ndarray | None) -> int:
        """Draft prefetch: make resident the experts ``predicted_bits uint64[|S|, L, W]`` (the
        policy's predictor, for the chosen nodes) name, at most the capacity per layer
        (``specfit.prefetch.draft_prefetch``), copying those the cache lacked on the copy
        stream; their copies count in the next forward's records. Returns the copies enqueued."""
        from specfit.prefetch import draft_prefetch

        copies, evicted = draft_prefetch(self.cache, predicted_bits, self.num_experts, self.capacity_per_layer)
        num = 0
        for layer in range(self.num_layers):
            experts = [e for lay, e in copies if lay == layer]
            fetch = self._enqueue_prefetch(layer, experts, evicted[layer])
            if fetch is not None:
                self._carried.append((layer, fetch, np.asarray(experts, dtype=np.int64)))
                num += len(experts)
        return num

    def _next_layer(self, layer: int, hidden_states: torch.Tensor) -> None:
        """After layer l's router: guess layer l+1's experts (:meth:`_next_layer_guess`), keep
        the guess for :meth:`last_next_layer_routing` (``record_next_layer``) and, with
        ``--prefetch next-layer|both``, prefetch it (:meth:`_prefetch_next_layer`)."""
        prefetching = uses_next_layer(self.prefetch)
        if layer + 1 >= self.num_layers or not (prefetching or self.record_next_layer):
            return
        ids = self._next_layer_guess(layer, hidden_states)  # [T, K]
        if self.record_next_layer:
            self._state.next_ids[layer].append(ids)
        if prefetching:
            self._prefetch_next_layer(layer, ids)

    def _next_layer_guess(self, layer: int, hidden_states: torch.Tensor) -> np.ndarray:
        """int64[T, K]: the top-k of layer l+1's router logits on layer l's MoE input
        ``hidden_states [T, D]`` (plus the router's score-correction bias where it has one, on
        sigmoid scores), by descending score. The pre-gating idea of Pre-gated MoE (Hwang et al.,
        ISCA 2024; here with the next layer's own gate, training-free, as AdapMoE, Zhong et al.,
        ICCAD 2024): ``specfit.prefetch``."""
        gate = self._gates[layer + 1]
        with torch.no_grad():
            scores = torch.nn.functional.linear(hidden_states, gate.weight.to(hidden_states.dtype))  # [T, E]
            bias = getattr(gate, "e_score_correction_bias", None)
            if bias is not None:
                scores = scores.sigmoid() + bias
            return scores.topk(self.top_k, dim=-1).indices.cpu().numpy().astype(np.int64)  # [T, K]

    def _prefetch_next_layer(self, layer: int, ids: np.ndarray) -> None:
        """Next-layer prefetch: the guessed experts ``ids int[T, K]`` of layer l+1, ranked by how
        many tokens choose them and capped at the capacity (``specfit.prefetch.next_layer_choice``,
        which ``sim.replay`` applies to the recorded guesses), are made resident at layer l+1 and
        copied on the copy stream behind layer l's own copies."""
        if self.capacity_per_layer == 0:
            return
        from specfit.prefetch import next_layer_choice, warm_layer

        chosen = next_layer_choice(ids, self.num_experts, self.capacity_per_layer)
        experts, evicted = warm_layer(self.cache, layer + 1, chosen)
        fetch = self._enqueue_prefetch(layer + 1, experts, evicted, ahead=True)
        if fetch is not None:
            self._state.fetches[layer + 1].append(fetch)
            self._state.fetch_experts[layer + 1].append(np.asarray(experts, dtype=np.int64))

    def _pairs_as_copies_land(self, layer: int, work: _LayerWork):
        """Yield, in compute order, ``bool[T, K]`` masks of the layer's token-expert pairs, each
        group computed by one kernel call: first ``None`` if every copy of ``work.waits`` has
        landed already (compute the layer in one call), else the pairs of the experts that are
        resident or landed (none: an empty group is skipped); then, until every expert is
        computed, wait for the next copy in issue order (:meth:`_wait`: CPU blocks until its
        landing, the wait counted as stall; CUDA ``Stream.wait_event``, the host does not block,
        the stall measured from events at the end of the forward) and yield the pairs of it and
        of every later expert whose copy has landed by then (FIFO link: a prefix of the rest)."""
        late = [w for w in work.waits if not w[0].transfer_landed(w[1])]
        if not late:
            yield None
            return
        device = work.view.slot_index.device

        def pairs_of(experts, invert: bool = False) -> torch.Tensor:
            return torch.from_numpy(np.isin(work.ids, experts, invert=invert)).to(device)  # [T, K]

        ready = pairs_of([e for _, _, e in late], invert=True)
        if ready.any():
            yield ready
        k = 0
        while k < len(late):
            self._wait(layer, [late[k]])
            group = [late[k][2]]
            k += 1
            while k < len(late) and late[k][0].transfer_landed(late[k][1]):
                group.append(late[k][2])
                k += 1
            yield pairs_of(group)

    def _sync_layer_slots_only(self, layer: int) -> None:
        """Free slots of experts the policy no longer caches (state drift repair)."""
        stale = [int(e) for e in self.pool.resident(layer) if not self.cache.contains(layer, int(e))]
        self.pool.release(layer, stale)


# ---------------------------------------------------------------------------------------------
# convenience
# ---------------------------------------------------------------------------------------------
def default_cache_experts(num_experts: int) -> int:
    """Default ``--cache`` (``live.record``): a quarter of the experts per layer (at least 1)."""
    return max(1, num_experts // 4)


def validate_cache_experts(cache_experts: int, num_experts: int) -> int:
    """Return ``cache_experts`` if ``0 <= cache_experts <= num_experts``, else ``ValueError``
    naming ``--cache`` (``live.record``'s flag) and the experts per layer."""
    if not 0 <= int(cache_experts) <= int(num_experts):
        raise ValueError(
            f"--cache: expected 0..{num_experts} (the experts per layer of this model), got {cache_experts}"
        )
    return int(cache_experts)


def make_link(
    device: str | torch.device = "cpu",
    bandwidth_gb_per_s: float | None = None,
    latency_s: float = 0.0,
) -> H2DLink:
    """H2D link from CLI-style values: ``--device``, ``--bandwidth`` in GB/s (1 GB = 1e9 bytes) and
    a per-transfer latency in seconds. Raises ``ValueError`` naming the flag at fault."""
    from specfit.units import gb_per_s_to_bytes_per_s

    if bandwidth_gb_per_s is not None and not 0 < float(bandwidth_gb_per_s) < float("inf"):
        raise ValueError(f"--bandwidth: expected a finite number > 0 (GB/s), got {bandwidth_gb_per_s}")
    if not float(latency_s) >= 0:
        raise ValueError(f"--latency: expected a number >= 0 (seconds), got {latency_s}")
    bw = gb_per_s_to_bytes_per_s(bandwidth_gb_per_s) if bandwidth_gb_per_s is not None else None
    try:
        return H2DLink(device, bandwidth_bytes_per_s=bw, latency_s=latency_s)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"--device: {exc}") from exc


def offload_model(
    model: torch.nn.Module,
    *,
    cache_experts: int | None = None,
    cache_policy: str = "lru",
    link: H2DLink | None = None,
    frequency: np.ndarray | None = None,
    recorder: Callable[[ForwardStats], None] | None = None,
    record_routing: bool = True,
    overlap: bool = False,
    prefetch: str = "none",
    record_next_layer: bool = False,
) -> OffloadedMoE:
    """Build a ``specfit.cache`` expert cache and install an :class:`OffloadedMoE` on ``model``.

    ``cache_experts``: persistent slots per layer (default :func:`default_cache_experts`);
    ``cache_policy``: ``"lru"`` (default), ``"lfu"`` or ``"static"`` (needs ``frequency
    float[L, E]``, e.g. expert counts from a trace); ``overlap``, ``prefetch``,
    ``record_next_layer``: see :meth:`OffloadedMoE.install`.
    Raises ``ValueError`` naming the flag.
    """
    from specfit.cache import make_expert_cache

    spec = describe_moe(model)
    if cache_experts is None:
        cache_experts = default_cache_experts(spec.num_experts)
    validate_cache_experts(cache_experts, spec.num_experts)
    if cache_policy not in CACHE_POLICIES:
        raise ValueError(
            f"--cache-policy: expected one of {', '.join(CACHE_POLICIES)}, got {cache_policy!r}"
        )
    if cache_policy == "static" and frequency is None:
        raise ValueError("--cache-policy static: needs expert frequencies (float[L, E])")
    cache = make_expert_cache(
        cache_policy, spec.num_layers, spec.num_experts, cache_experts, frequency=frequency
    )
    return OffloadedMoE.install(
        model,
        cache,
        link,
        recorder,
        capacity_per_layer=cache_experts,
        record_routing=record_routing,
        overlap=overlap,
        prefetch=prefetch,
        record_next_layer=record_next_layer,
    )
