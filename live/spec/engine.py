"""Decode loops: autoregressive, dense trace mode and policy mode, all through one verify loop.

Every cycle: a :class:`SubtreeChooser` drafts a tree and picks the subtree ``S`` to verify; the
target verifies ``S`` in one forward pass (:class:`live.spec.verify.TreeVerifier`); the accepted
path plus the bonus token is committed (greedy acceptance, so the output is token for token the
target's autoregressive greedy output, whatever the chooser does); both KV caches keep only the
accepted path.

Dense mode (``dense=True``, DESIGN.md "Data flow" 1): the chooser verifies the whole maximal tree
at every position, and exactly ONE token (the target's greedy token at the root) is committed per
cycle, so there is a recorded tree at every committed position for exact replay of any policy.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from live.offload import ForwardStats
from live.spec.draft import Drafter, DraftResult, TreeShape
from live.spec.tree import TokenTree
from live.spec.verify import TreeVerifier, Verification
from specfit.policies import root_alone_copies
from specfit.prefetch import planner_miss_fraction, uses_draft, uses_next_layer


class StatsSource(Protocol):
    """Per-forward expert statistics: :class:`live.offload.OffloadedMoE` satisfies it.

    ``None`` in its place means a resident model (zero traffic, no cache).
    """

    cache: Any

    def begin_forward(self) -> None:
        """Start measuring one target forward."""

    def end_forward(self) -> ForwardStats:
        """Finish measuring and return the forward's statistics."""


@dataclass(frozen=True)
class ChooseState:
    """What a chooser sees before drafting.

    Attributes:
        committed: every committed token (prompt then generated); the last one is the root.
        position: generated tokens committed so far.
        context_len: ``len(committed)`` (prompt length + position).
        recent_experts: int64[m, L, K] routed experts of the last ``m`` target tokens (newest last).
        cached_bits: uint64[L, W] experts on the device, or None.
        miss_fraction: float64[L] the expert cache's observed miss fraction per layer (moving
            average, ``specfit`` ``cache.stats.layer_miss_fraction``; NaN before any access), or None.
    """

    committed: Sequence[int]
    position: int
    context_len: int
    recent_experts: np.ndarray
    cached_bits: np.ndarray | None
    miss_fraction: np.ndarray | None = None


@dataclass(frozen=True)
class Choice:
    """A drafted tree and the subtree to verify.

    Attributes:
        draft: the :class:`DraftResult` (tree, levels, draft seconds).
        nodes: int64[M] node ids to verify (ancestor-closed, contains 0).
        plan: the planner's :class:`specfit.policies.Plan` (or None when no planner chose).
        predicted_bits: uint64[N, L, W] the policy's predicted experts of every drafted node (what
            draft prefetch copies ahead for the chosen ones), or None (no per-node prediction).
    """

    draft: DraftResult
    nodes: np.ndarray
    plan: Any = None
    predicted_bits: np.ndarray | None = None


class SubtreeChooser(Protocol):
    """Drafts a tree and chooses the subtree to verify (a live policy)."""

    name: str

    def choose(self, state: ChooseState) -> Choice:
        """Draft and choose for one cycle."""


class AutoregressiveChooser:
    """Plain decoding: a root-only tree, no draft model (policy ``ar``)."""

    name = "ar"

    def choose(self, state: ChooseState) -> Choice:
        """Verify the root alone."""
        tree = TokenTree.root_only(int(state.committed[-1]))
        return Choice(DraftResult(tree, 0, 0.0), np.zeros(1, np.int64))


class FullTreeChooser:
    """Draft the maximal tree and verify all of it (dense mode, or policy ``full``).

    ``level_union`` (dense mode): draft and verify the union of the per-level trees
    (``Drafter.grow(..., level_union=True)``, ``DraftResult.last_level``), so the dense trace holds
    every tree the stopping rule of a policy run is asked about.
    """

    name = "full"

    def __init__(self, drafter: Drafter, shape: TreeShape, *, level_union: bool = False) -> None:
        self.drafter = drafter
        self.shape = shape
        self.level_union = bool(level_union)

    def choose(self, state: ChooseState) -> Choice:
        """Grow the tree to ``shape`` and verify every node."""
        if self.level_union:
            draft = self.drafter.grow(state.committed, self.shape, level_union=True)
        else:
            draft = self.drafter.grow(state.committed, self.shape)
        return Choice(draft, np.arange(draft.tree.num_nodes, dtype=np.int64))


@dataclass(frozen=True)
class CycleEvent:
    """One verification cycle as executed.

    Attributes:
        cycle_index: 0-based within the request; position: generated tokens before the cycle;
        context_len: prompt length + position (the root is token ``context_len - 1``).
        choice: the drafted tree, verified nodes and plan; verification: the target's verdict.
        committed: tokens committed by this cycle.
        stats: expert traffic of the verification forward.
        cycle_s: wall seconds of the whole cycle (draft + decision + verify + bookkeeping).
        next_layer_ids: int64[M, L-1, K] the verified nodes' next-layer guesses (input order =
            ``verification.nodes``; ``live.offload.OffloadedMoE.last_next_layer_routing``), or
            None when not recorded.
    """

    cycle_index: int
    position: int
    context_len: int
    choice: Choice
    verification: Verification
    committed: tuple[int, ...]
    stats: ForwardStats
    cycle_s: float
    next_layer_ids: np.ndarray | None = None

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens of the verified subtree, excluding the bonus token."""
        return len(self.verification.accepted_path)


@dataclass(frozen=True)
class GenerationResult:
    """A finished generation.

    Attributes:
        prompt_ids, generated_ids: token ids.
        prefill_expert_ids: int64[T, L, K] routing of the prefill tokens (``prompt[:-1]``);
        prefill_router_weights: float32[T, L, K]; prefill_stats: expert traffic of the prefill.
        prefill_s, decode_s: wall seconds; ``decode_s`` runs from the first cycle to the last and
            leaves out the ``on_cycle`` callbacks (trace recording), so every policy's tokens/s
            is charged the same: its cycles and the loop between them.
        stopped_on_eos: True when an end-of-sequence token ended the output.
        cycles: every :class:`CycleEvent`, in order.
        prefill_next_layer_ids: int64[T, L-1, K] next-layer guesses of the prefill tokens, or None
            when not recorded.
    """

    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    prefill_expert_ids: np.ndarray
    prefill_router_weights: np.ndarray
    prefill_stats: ForwardStats
    prefill_s: float
    decode_s: float
    stopped_on_eos: bool
    cycles: tuple[CycleEvent, ...] = field(default_factory=tuple)
    prefill_next_layer_ids: np.ndarray | None = None

    @property
    def tau(self) -> float:
        """Mean tokens committed per cycle including the bonus (EAGLE's tau); NaN without cycles."""
        return float(np.mean([len(c.committed) for c in self.cycles])) if self.cycles else float("nan")


class SpecDecoder:
    """Runs generations: prefill, then cycles of choose -> verify -> commit.

    Args:
        verifier: the target model wrapper.
        drafter: the draft (None for autoregressive-only use); reset before each generation.
        stats: per-forward expert statistics from the offloaded runtime, or None (resident model).
        recent_window: number of recent target tokens whose experts are kept for predictors.
    """

    def __init__(
        self,
        verifier: TreeVerifier,
        drafter: Drafter | None = None,
        stats: StatsSource | None = None,
        recent_window: int = 8,
    ) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.stats = stats
        self.recent_window = recent_window

    def _forward_stats_begin(self) -> None:
        if self.stats is not None:
            self.stats.begin_forward()

    def _forward_stats_end(self) -> ForwardStats:
        if self.stats is not None:
            return self.stats.end_forward()
        return ForwardStats.zeros(self.verifier.capture.num_layers)

    def _next_layer_ids(self, num_tokens: int) -> np.ndarray | None:
        """The last forward's next-layer guesses int64[T, L-1, K] (``num_tokens`` = T), or None
        when the stats source does not record them (or the forward fed no token)."""
        take = getattr(self.stats, "last_next_layer_routing", None)
        ids = None if take is None or num_tokens == 0 else take()
        if ids is not None and ids.shape[0] != num_tokens:
            raise RuntimeError(f"next-layer guesses of {ids.shape[0]} tokens for a forward of {num_tokens}")
        return ids

    def _prefetch_draft(self, choice: Choice) -> None:
        """Draft prefetch (``--prefetch draft|both``): as soon as the subtree is chosen, enqueue
        the experts the policy's predictor expects the chosen nodes to need and the cache lacks."""
        if choice.predicted_bits is None or not uses_draft(getattr(self.stats, "prefetch", "none")):
            return
        self.stats.prefetch_predicted(choice.predicted_bits[choice.nodes])

    def _root_alone(self, cached: np.ndarray, root_ids: np.ndarray, choice: Choice, next_layer, root_slot: int) -> tuple:
        """The paired guard's root alone on the cache the planner saw, as ``sim.replay``:
        ``(misses, None)`` without prefetch (``specfit.policies.root_layer_misses``), else its
        demand misses and prefetch copies (``specfit.policies.root_alone_copies``: the root's
        predicted experts with draft prefetch, its row ``root_slot`` of the forward's next-layer
        guesses ``next_layer`` with next-layer prefetch)."""
        prefetch = getattr(self.stats, "prefetch", "none")
        bits = choice.predicted_bits[0] if uses_draft(prefetch) and choice.predicted_bits is not None else None
        guesses = next_layer[root_slot] if uses_next_layer(prefetch) and next_layer is not None else None
        stats = self.stats
        return root_alone_copies(cached, root_ids, stats.num_experts, stats.capacity_per_layer, bits, guesses)

    def _miss_fraction(self) -> np.ndarray | None:
        """The planner's observed miss fraction: ``specfit.prefetch.planner_miss_fraction`` of the
        engine's cache and prefetch ledger (what the simulator hands its predictor too)."""
        cache = getattr(self.stats, "cache", None)
        if getattr(getattr(cache, "stats", None), "layer_miss_fraction", None) is None:
            return None
        ledger = getattr(self.stats, "ledger", None)
        prefetch = getattr(self.stats, "prefetch", "none") if ledger is not None else "none"
        return np.asarray(planner_miss_fraction(cache, ledger, prefetch), dtype=np.float64)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        chooser: SubtreeChooser,
        *,
        dense: bool = False,
        on_cycle: Callable[[CycleEvent], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens greedily after ``prompt_ids``.

        Args:
            prompt_ids: at least one token id.
            max_new_tokens: >= 1.
            chooser: drafts and picks the verified subtree each cycle.
            dense: commit exactly one token per cycle (dense trace mode).
            on_cycle: called after every cycle (e.g. to stream it to a trace writer).

        Raises:
            ValueError: empty prompt or ``max_new_tokens < 1``.
        """
        if len(prompt_ids) == 0:
            raise ValueError("SpecDecoder.generate: prompt_ids is empty (need at least one token)")
        if max_new_tokens < 1:
            raise ValueError(f"SpecDecoder.generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        if self.drafter is not None:
            self.drafter.reset()
        self._forward_stats_begin()
        pre_ids, pre_w, prefill_s = self.verifier.prefill(prompt_ids)
        prefill_stats = self._forward_stats_end()
        prefill_next_layer = self._next_layer_ids(len(pre_ids))
        committed = [int(t) for t in prompt_ids]
        generated: list[int] = []
        recent: deque[np.ndarray] = deque(pre_ids[-self.recent_window :], maxlen=self.recent_window)
        num_layers, top_k = self.verifier.capture.num_layers, self.verifier.capture.top_k
        cycles: list[CycleEvent] = []
        eos = False
        start = time.perf_counter()
        callback_s = 0.0
        # the policy's online guard (None for ar, top-N): looked up once, as sim.replay
        observe = getattr(getattr(chooser, "policy", None), "observe_cycle", None)
        # the guard's issued prefetch copies per cycle (as sim.replay): the ledger counts up only
        # when prefetch is on; without it a cycle's are zeros, made once here (no copy per cycle)
        ledger = getattr(self.stats, "ledger", None)
        track_issued = observe is not None and ledger is not None and getattr(self.stats, "prefetch", "none") != "none"
        no_copies = None
        if observe is not None and ledger is not None:
            no_copies = np.zeros_like(ledger.layer_issued)
            no_copies.setflags(write=False)
        while len(generated) < max_new_tokens and not eos:
            t0 = time.perf_counter()
            recent_arr = np.stack(list(recent)) if recent else np.zeros((0, num_layers, top_k), np.int64)
            cached = self.stats.cache.cached_bits() if self.stats is not None else None
            miss_fraction = self._miss_fraction()
            state = ChooseState(
                tuple(committed), len(generated), len(committed), recent_arr, cached, miss_fraction
            )
            choice = chooser.choose(state)
            issued_before = ledger.mark() if track_issued else None
            self._prefetch_draft(choice)
            self._forward_stats_begin()
            ver = self.verifier.verify(choice.draft.tree, choice.nodes)
            stats = self._forward_stats_end()
            next_layer = self._next_layer_ids(len(ver.nodes))
            toks = ver.committed_tokens()
            if dense:
                toks = toks[:1]
            toks = toks[: max_new_tokens - len(generated)]
            self.verifier.commit(ver, len(toks))
            if self.drafter is not None:
                self.drafter.accept(ver.accepted_path[: len(toks)])
            slot = {int(v): i for i, v in enumerate(ver.nodes)}
            for v in [0, *ver.accepted_path][: len(toks)]:
                if ver.expert_ids.shape[1]:
                    recent.append(ver.expert_ids[slot[v]])
            eos = any(t in self.verifier.eos_token_ids for t in toks)
            event = CycleEvent(
                cycle_index=len(cycles),
                position=len(generated),
                context_len=len(committed),
                choice=choice,
                verification=ver,
                committed=tuple(toks),
                stats=stats,
                cycle_s=time.perf_counter() - t0,
                next_layer_ids=next_layer,
            )
            committed.extend(toks)
            generated.extend(toks)
            cycles.append(event)
            # the policy's online guard sees each realised cycle, priced (as sim.replay), and
            # for a drafting cycle the root alone's misses on the cache the planner saw
            if observe is not None:
                root_misses = root_copies = None
                if cached is not None and choice.draft.num_levels > 0 and ver.expert_ids.shape[1]:
                    root_misses, root_copies = self._root_alone(cached, ver.expert_ids[slot[0]], choice, next_layer, slot[0])
                observe(
                    chooser.cost,
                    len(toks),
                    int(choice.draft.num_levels),
                    len(choice.nodes),
                    event.context_len,
                    stats.layer_misses,
                    root_misses,
                    no_copies if issued_before is None else ledger.copies_since(issued_before),  # as sim.replay
                    root_copies,
                )
            if on_cycle is not None:  # recording is not decoding: kept off the decode clock
                callback_start = time.perf_counter()
                on_cycle(event)
                callback_s += time.perf_counter() - callback_start
        return GenerationResult(
            tuple(int(t) for t in prompt_ids),
            tuple(generated),
            pre_ids,
            pre_w,
            prefill_stats,
            prefill_s,
            time.perf_counter() - start - callback_s,
            eos,
            tuple(cycles),
            prefill_next_layer,
        )
