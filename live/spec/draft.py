"""Draft-tree growth (EAGLE-2 / EAGLE-3 dynamic tree) with a small draft language model.

Algorithm (EAGLE-2, Li et al. 2024, "dynamic draft trees"): the root is the last committed token.
Level by level, every frontier node proposes its ``topk`` most likely next tokens under the draft;
among all those candidates the level keeps the ``topk`` best by path probability (the product of
draft probabilities from the root), and never more than the remaining node budget
(``max_nodes`` including the root). Growth stops at ``depth`` levels, when the budget is spent,
or when the ``keep_drafting`` callback (the SpecFit stopping rule) says so.

:class:`Drafter` is the interface the decode loops use, so an EAGLE-3 head (which drafts from the
target's hidden states) can later replace :class:`ModelDrafter`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from live.spec.runner import CachedLM
from live.spec.tree import TokenTree

KeepDrafting = Callable[[TokenTree, int], bool]
"""``keep_drafting(tree_so_far, num_levels) -> bool``; called after each drafted level."""


@dataclass(frozen=True)
class TreeShape:
    """Size limits of a draft tree.

    Attributes:
        depth: maximum number of draft levels (tree depth), >= 0.
        topk: children proposed per frontier node, and frontier width kept per level, >= 1.
        max_nodes: total node budget including the root, >= 1.
    """

    depth: int = 5
    topk: int = 4
    max_nodes: int = 32

    def __post_init__(self) -> None:
        if self.depth < 0:
            raise ValueError(f"TreeShape.depth: expected >= 0, got {self.depth}")
        if self.topk < 1:
            raise ValueError(f"TreeShape.topk: expected >= 1, got {self.topk}")
        if self.max_nodes < 1:
            raise ValueError(f"TreeShape.max_nodes: expected >= 1, got {self.max_nodes}")


@dataclass(frozen=True)
class DraftResult:
    """A drafted tree and how it was made.

    Attributes:
        tree: the tree; node 0 is the root (last committed token).
        num_levels: draft forward passes over tree levels (0 for a root-only tree).
        draft_s: wall seconds spent drafting (catch-up feed + all levels).
    """

    tree: TokenTree
    num_levels: int
    draft_s: float


class Drafter(Protocol):
    """What the decode loops need from a drafter (a draft LM today, an EAGLE-3 head later)."""

    def reset(self) -> None:
        """Forget all state before a new generation."""

    def grow(
        self, committed: Sequence[int], shape: TreeShape, keep_drafting: KeepDrafting | None = None
    ) -> DraftResult:
        """Draft a tree rooted at ``committed[-1]`` given all committed tokens (prompt + generated)."""

    def accept(self, path_nodes: Sequence[int]) -> None:
        """After a commit: ``path_nodes`` (non-root node ids of the last tree, root to leaf) were committed."""


class ModelDrafter:
    """:class:`Drafter` backed by a small causal LM that shares the target's tokenizer.

    The draft's KV cache holds a prefix of the committed tokens; ``grow`` feeds the missing
    committed tokens causally, then one forward per level with a tree attention mask. ``accept``
    keeps only the accepted path's entries (KV trimming), so the next ``grow`` feeds only what is new.
    """

    def __init__(self, model: nn.Module) -> None:
        self.lm = CachedLM(model)
        self._slots: list[int] = []
        self._context_len = 0

    def reset(self) -> None:
        """Drop the draft cache."""
        self.lm.reset()
        self._slots = []
        self._context_len = 0

    def grow(
        self, committed: Sequence[int], shape: TreeShape, keep_drafting: KeepDrafting | None = None
    ) -> DraftResult:
        """Grow a tree rooted at ``committed[-1]`` (see module docstring).

        Args:
            committed: every committed token id so far (prompt then generated), at least one.
            shape: depth, top-k and node budget.
            keep_drafting: optional stopping rule called after each level with the tree so far.

        Returns:
            :class:`DraftResult`; draft log-probs are natural-log probabilities under the draft.
        Raises:
            ValueError: when ``committed`` is empty or shorter than what the cache already holds.
        """
        start = time.perf_counter()
        n = len(committed)
        if n == 0:
            raise ValueError("ModelDrafter.grow: committed is empty (need at least the root token)")
        tokens, parents, logps = [int(committed[-1])], [-1], [0.0]
        path_logp = [0.0]
        depths = [0]
        if shape.depth == 0 or shape.max_nodes == 1:
            return DraftResult(TokenTree.from_parents(tokens, parents, logps), 0, time.perf_counter() - start)
        if self.lm.cache_len > n:
            raise ValueError(
                f"ModelDrafter.grow: draft cache holds {self.lm.cache_len} tokens but only {n} committed"
            )
        if self.lm.cache_len == n:  # the root itself is cached: re-feed it to get its next-token logits
            self.lm.keep(n - 1, [])
        logits = self.lm.feed_causal(list(committed[self.lm.cache_len :]))[-1:]
        self._context_len = n
        self._slots = []
        frontier = [0]
        levels = 0
        while levels < shape.depth and len(tokens) < shape.max_nodes:
            logprobs = torch.log_softmax(logits, dim=-1)
            top_lp, top_id = torch.topk(logprobs, min(shape.topk, logprobs.shape[-1]), dim=-1)
            top_lp, top_id = top_lp.cpu().numpy(), top_id.cpu().numpy()
            cands = [
                (path_logp[p] + float(top_lp[i, j]), p, int(top_id[i, j]), float(top_lp[i, j]))
                for i, p in enumerate(frontier)
                for j in range(top_lp.shape[1])
            ]
            order = sorted(range(len(cands)), key=lambda c: (-cands[c][0], c))
            keep = order[: min(shape.topk, shape.max_nodes - len(tokens))]
            frontier = []
            for c in sorted(keep):
                path, parent, tok, lp = cands[c]
                frontier.append(len(tokens))
                tokens.append(tok)
                parents.append(parent)
                logps.append(lp)
                path_logp.append(path)
                depths.append(depths[parent] + 1)
            levels += 1
            tree = TokenTree.from_parents(tokens, parents, logps)
            if levels >= shape.depth or len(tokens) >= shape.max_nodes:
                break
            if keep_drafting is not None and not keep_drafting(tree, levels):
                break
            self._slots.extend(frontier)
            logits = self.lm.feed_tree(
                [tokens[v] for v in frontier],
                [depths[v] for v in frontier],
                root_position=n - 1,
                context_len=n,
                slot_nodes=self._slots,
                query_nodes=frontier,
                ancestors=tree.ancestor_matrix(),
            )
        tree = TokenTree.from_parents(tokens, parents, logps)
        return DraftResult(tree, levels, time.perf_counter() - start)

    def accept(self, path_nodes: Sequence[int]) -> None:
        """Keep the committed context plus the cached entries of the accepted path's leading nodes."""
        kept = []
        for v in path_nodes:
            if v not in self._slots:
                break
            kept.append(self._context_len + self._slots.index(v))
        self.lm.keep(self._context_len, kept)
        self._slots = []
