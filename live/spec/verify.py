"""Tree-attention verification by the target model and greedy acceptance.

One target forward over the chosen subtree ``S`` (ancestor-closed, contains the root): every node
sees the committed context and its own ancestors, position id = root position + depth
(SpecInfer, Miao et al. 2024; EAGLE). Greedy acceptance walks from the root: a child is accepted
when its token equals the target's greedy token at its parent; the target's greedy token at the
last accepted node is the bonus token. The target's KV cache then keeps only the accepted path.

Invariant of :class:`TreeVerifier`: the target cache holds every committed token except the last
one (the root of the next tree, fed by the next verification).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from live.spec.routing import RouterCapture
from live.spec.runner import CachedLM
from live.spec.tree import TokenTree


@dataclass(frozen=True)
class Verification:
    """Result of verifying subtree ``nodes`` of ``tree``.

    Attributes:
        tree: the drafted tree.
        nodes: int64[M] verified node ids (sorted, contains 0), M = |S|.
        target_tokens: int64[N] target greedy token at each tree node (-1 where not verified).
        accepted_path: non-root node ids accepted, root to leaf (tokens equal the target's greedy choice).
        stopped_on_eos: True when an accepted node's token is end-of-sequence (no bonus token then).
        expert_ids: int64[M, L, K] top-k experts per verified node (input order = ``nodes``), L = 0 for dense.
        router_weights: float32[M, L, K].
        verify_s: wall seconds of the target forward.
    """

    tree: TokenTree
    nodes: np.ndarray
    target_tokens: np.ndarray
    accepted_path: tuple[int, ...]
    stopped_on_eos: bool
    expert_ids: np.ndarray
    router_weights: np.ndarray
    verify_s: float

    @property
    def accepted_mask(self) -> np.ndarray:
        """bool[N]: the root and the accepted path nodes."""
        mask = np.zeros(self.tree.num_nodes, dtype=bool)
        mask[[0, *self.accepted_path]] = True
        return mask

    @property
    def reached_depth(self) -> int:
        """Depth this verification tested along its accepted path (the ``cycles.reached_depth`` column).

        ``len(accepted_path) + 1`` when the last accepted node (the root when none) has a child in
        the verified subtree, so the target judged a draft token one level deeper (and rejected
        it); ``len(accepted_path)`` when it has none or the path ended on an accepted
        end-of-sequence token. Per-depth acceptance accepted(d) / reached(d) conditions on it
        (``analysis.metrics.per_depth_acceptance``); the dense-tree form is
        ``traces.stats.reached_depths``.
        """
        depth = len(self.accepted_path)
        if self.stopped_on_eos:
            return depth
        last = self.accepted_path[-1] if self.accepted_path else 0
        children = self.tree.children(last)
        return depth + int(bool(np.isin(children, self.nodes).any()))

    def committed_tokens(self) -> list[int]:
        """Tokens this verification commits: the accepted path, then the bonus token unless EOS was accepted."""
        toks = [int(self.tree.token_ids[v]) for v in self.accepted_path]
        if not self.stopped_on_eos:
            last = self.accepted_path[-1] if self.accepted_path else 0
            toks.append(int(self.target_tokens[last]))
        return toks


def greedy_accept(
    tree: TokenTree, nodes: Sequence[int], target_tokens: np.ndarray, eos_token_ids: frozenset[int]
) -> tuple[tuple[int, ...], bool]:
    """Walk the verified subtree from the root accepting children equal to the target's greedy token.

    Returns:
        (accepted non-root node ids root to leaf, stopped_on_eos). Stops after an accepted EOS token.
    """
    chosen = set(int(v) for v in nodes)
    path: list[int] = []
    cur = 0
    while True:
        want = int(target_tokens[cur])
        nxt = next(
            (int(c) for c in tree.children(cur) if int(c) in chosen and tree.token_ids[c] == want), None
        )
        if nxt is None:
            return tuple(path), False
        path.append(nxt)
        if want in eos_token_ids:
            return tuple(path), True
        cur = nxt


class TreeVerifier:
    """The target model with its KV cache and router capture; prefill, verify, commit.

    Args:
        model: a transformers causal LM (MoE or dense; offloaded or resident).
        eos_token_ids: token ids that end a generation.
        features: optional tap of the target's hidden states (:class:`live.eagle3_draft.TargetFeatures`,
            for an EAGLE-3 drafter): told before every forward, reset by :meth:`prefill` and given
            the committed rows by :meth:`commit`, so it always covers the tokens the KV cache holds.
        float32_logits: greedy tokens from float32 logits (``live.record --verify-logits float32``;
            :func:`live.spec.runner.float32_output_head`) when the model runs in bfloat16/float16.
    """

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: Sequence[int] = (),
        features=None,
        *,
        float32_logits: bool = False,
    ) -> None:
        self.lm = CachedLM(model, float32_logits=float32_logits)
        self.capture = RouterCapture(model)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.features = features

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, float]:
        """Reset and feed ``prompt_ids[:-1]`` (the last prompt token is the first tree's root).

        Returns:
            (expert_ids int64[T, L, K], router_weights float32[T, L, K], seconds) for the T = len-1
            fed tokens (T = 0 for a one-token prompt).
        Raises:
            ValueError: for an empty prompt.
        """
        if len(prompt_ids) == 0:
            raise ValueError("TreeVerifier.prefill: empty prompt (need at least one token)")
        self.lm.reset()
        self.capture.clear()
        if self.features is not None:
            self.features.begin_forward()
        start = time.perf_counter()
        if len(prompt_ids) > 1:
            self.lm.feed_causal(list(prompt_ids[:-1]), last_only=True)
        if self.features is not None:
            self.features.reset(take_forward=len(prompt_ids) > 1)
        if self.lm.device.type == "cuda":  # the last layers may still be queued: time their end
            # (the compute stream only: prefetch copies nobody waited for stay in flight)
            torch.cuda.current_stream(self.lm.device).synchronize()
        seconds = time.perf_counter() - start
        ids, weights = self.capture.take()
        if len(prompt_ids) == 1:
            ids = np.zeros((0, self.capture.num_layers, self.capture.top_k), np.int64)
            weights = np.zeros(ids.shape, np.float32)
        return ids, weights, seconds

    def verify(self, tree: TokenTree, nodes: Sequence[int] | None = None) -> Verification:
        """Verify subtree ``nodes`` of ``tree`` (default: the whole tree) in ONE target forward.

        Raises:
            ValueError: when ``nodes`` is not ancestor-closed with the root.
        """
        nodes_arr = (
            np.arange(tree.num_nodes) if nodes is None else np.unique(np.asarray(nodes, dtype=np.int64))
        )
        if not tree.is_ancestor_closed(nodes_arr):
            raise ValueError(
                f"TreeVerifier.verify: nodes {nodes_arr.tolist()} must contain 0 and every parent"
            )
        context_len = self.lm.cache_len
        self.capture.clear()
        if self.features is not None:
            self.features.begin_forward()
        start = time.perf_counter()
        logits = self.lm.feed_tree(
            tree.token_ids[nodes_arr],
            tree.depths[nodes_arr],
            root_position=context_len,
            context_len=context_len,
            slot_nodes=nodes_arr,
            query_nodes=nodes_arr,
            ancestors=tree.ancestor_matrix(),
        )
        greedy = logits.argmax(dim=-1).cpu().numpy()
        verify_s = time.perf_counter() - start
        ids, weights = self.capture.take()
        target_tokens = np.full(tree.num_nodes, -1, dtype=np.int64)
        target_tokens[nodes_arr] = greedy
        path, eos = greedy_accept(tree, nodes_arr, target_tokens, self.eos_token_ids)
        self._pending = (context_len, nodes_arr)
        return Verification(tree, nodes_arr, target_tokens, path, eos, ids, weights, verify_s)

    def commit(self, verification: Verification, num_committed: int) -> None:
        """Keep in the cache the root and the first ``num_committed - 1`` accepted nodes.

        ``num_committed`` is the number of tokens committed from ``verification`` (>= 1; the last
        committed token becomes the next root and is not kept).
        """
        context_len, nodes_arr = self._pending
        slot = {int(v): i for i, v in enumerate(nodes_arr)}
        keep_nodes = [0, *verification.accepted_path][:num_committed]
        self.lm.keep(context_len, [context_len + slot[v] for v in keep_nodes])
        if self.features is not None:
            self.features.commit([slot[v] for v in keep_nodes])
