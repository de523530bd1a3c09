"""Draft-tree growth (EAGLE-2 / EAGLE-3 dynamic tree) with a small draft language model.

Algorithm (EAGLE-2, Li et al. 2024, "dynamic draft trees", expansion then reranking): the root is
the last committed token. Level by level, each of the ``topk`` frontier nodes proposes its
``topk`` most likely next tokens under the draft; all of them become candidate nodes, and the
``topk`` candidates of the new level with the highest path probability (product of draft
probabilities from the root) form the next frontier (a beam). After every level the tree is the
``max_nodes - 1`` candidates with the highest path probability plus the root; because a child's
path probability never exceeds its parent's (ties broken by creation order), that set is
ancestor-closed. Growth stops after ``depth`` levels or when the ``keep_drafting`` callback (the
SpecFit stopping rule) says so.

Level trees and their union (dense traces): a shallow candidate of the tree after level ``k`` can
be pushed out by better candidates of a later level, so the tree the stopping rule is asked about
after level ``k`` is not the final tree cut at depth ``k``. ``grow(..., level_union=True)`` returns
instead the union of every level's tree, nodes in (depth, creation) order, with
:attr:`DraftResult.last_level` (the last level whose tree held each node): the level-``k`` tree is
the nodes with ``depth <= k <= last_level`` (once pushed out a candidate never returns: later
levels only add competitors), and the final tree those with ``last_level == num_levels``. Dense
mode verifies and records that union, so ``sim.replay`` asks the stopping rule on exactly the
trees the live engine sees (issue 13).

:class:`Drafter` is the interface the decode loops use; :class:`TreeDrafter` holds the growth
loop, shared by :class:`ModelDrafter` (a small causal LM) and :class:`live.eagle3_draft.Eagle3Drafter`
(an EAGLE-3 head drafting from the target's hidden states).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from live.spec.runner import CachedLM
from live.spec.tree import TokenTree, ancestor_matrix

KeepDrafting = Callable[[TokenTree, int], bool]
"""``keep_drafting(tree_so_far, num_levels) -> bool``; called after each drafted level."""


@dataclass(frozen=True)
class TreeShape:
    """Size limits of a draft tree.

    Attributes:
        depth: maximum number of draft levels (tree depth), >= 0.
        topk: children proposed per expanded node, and nodes expanded per level (beam width), >= 1.
        max_nodes: nodes kept in the tree including the root (best path probabilities), >= 1.
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
        last_level: int64[N] with ``grow(..., level_union=True)`` (``tree`` is then the union of
            the level trees): the last draft level whose tree held each node (``num_levels`` for
            the final tree's nodes, the root included); None otherwise.
    """

    tree: TokenTree
    num_levels: int
    draft_s: float
    last_level: np.ndarray | None = None


class Drafter(Protocol):
    """What the decode loops need from a drafter (a draft LM or an EAGLE-3 head).

    ``kind`` is ``"causal-lm"`` or ``"eagle3"`` (recorded as ``draft.kind`` in the manifest).
    """

    kind: str

    def reset(self) -> None:
        """Forget all state before a new generation."""

    def grow(
        self,
        committed: Sequence[int],
        shape: TreeShape,
        keep_drafting: KeepDrafting | None = None,
        *,
        level_union: bool = False,
    ) -> DraftResult:
        """Draft a tree rooted at ``committed[-1]`` given all committed tokens (prompt + generated);
        ``level_union``: return the union of the level trees (see the module docstring)."""

    def accept(self, path_nodes: Sequence[int]) -> None:
        """After a commit: ``path_nodes`` (non-root node ids of the last tree, root to leaf) were committed."""


def _rerank(parents: list[int], path: list[float], depths: list[int], max_nodes: int) -> np.ndarray:
    """Candidate ids of the best ``max_nodes`` (root included), in (depth, creation) order."""
    order = sorted(range(1, len(parents)), key=lambda v: (-path[v], v))[: max_nodes - 1]
    return np.asarray(sorted([0, *order], key=lambda v: (depths[v], v)), dtype=np.int64)


class TreeDrafter:
    """The EAGLE-2 tree growth shared by every drafter kind (see module docstring).

    A subclass supplies the draft distribution: :meth:`_root_logits` (next-token logits at the
    root, or None when it cannot draft) and :meth:`_level_logits` (logits of a frontier's nodes
    after feeding them), and optionally :meth:`_to_target_ids` (a head drafting over a reduced
    vocabulary maps its ids to target ids). ``_tree_to_cand`` maps the returned tree's node ids to
    candidate ids of the last :meth:`grow`.
    """

    _tree_to_cand: np.ndarray

    def _begin(self, committed: Sequence[int]) -> None:
        """Called first by every :meth:`grow` (even a root-only one)."""

    def _root_logits(self, committed: Sequence[int]) -> torch.Tensor | None:
        raise NotImplementedError

    def _level_logits(
        self, frontier: list[int], tokens: list[int], parents: list[int], depths: list[int]
    ) -> torch.Tensor:
        raise NotImplementedError

    def _to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of the drafter's ids (int64 tensor on the drafter's device, same shape)."""
        return ids

    def _tree(self, tokens, parents, logps, path, depths, max_nodes) -> TokenTree:
        return self._tree_of(_rerank(parents, path, depths, max_nodes), tokens, parents, logps)

    def _tree_of(self, keep: np.ndarray, tokens, parents, logps) -> TokenTree:
        """The tree of candidates ``keep`` (ancestor-closed, in (depth, creation) order)."""
        index = {int(c): i for i, c in enumerate(keep)}
        self._tree_to_cand = keep
        return TokenTree.from_parents(
            [tokens[c] for c in keep], [-1] + [index[parents[c]] for c in keep[1:]], [logps[c] for c in keep]
        )

    def _result(self, tree, levels, start, last_level, level_union, tokens, parents, logps, depths):
        """The :class:`DraftResult`: ``tree`` itself, or with ``level_union`` the union of the level
        trees (``last_level``: candidate id -> last level whose tree held it)."""
        if not level_union:
            return DraftResult(tree, levels, time.perf_counter() - start)
        union = np.asarray(sorted(last_level, key=lambda c: (depths[c], c)), dtype=np.int64)
        tree = self._tree_of(union, tokens, parents, logps)
        last = np.asarray([last_level[int(c)] for c in union], dtype=np.int64)
        return DraftResult(tree, levels, time.perf_counter() - start, last)

    def grow(
        self,
        committed: Sequence[int],
        shape: TreeShape,
        keep_drafting: KeepDrafting | None = None,
        *,
        level_union: bool = False,
    ) -> DraftResult:
        """Grow a tree rooted at ``committed[-1]`` (see module docstring).

        Args:
            committed: every committed token id so far (prompt then generated), at least one.
            shape: depth, top-k and node budget.
            keep_drafting: optional stopping rule called after each level (except the last) with the tree so far.
            level_union: return the union of the level trees and their ``last_level`` (dense
                mode; see the module docstring) instead of the last level's tree.

        Returns:
            :class:`DraftResult`; draft log-probs are natural-log probabilities under the draft.
        Raises:
            ValueError: when ``committed`` is empty or inconsistent with the drafter's cached state.
        """
        start = time.perf_counter()
        if len(committed) == 0:
            raise ValueError(f"{type(self).__name__}.grow: committed is empty (need at least the root token)")
        tokens, parents, logps, path, depths = [int(committed[-1])], [-1], [0.0], [0.0], [0]
        self._candidates = (tokens, parents, depths)  # grown in place; read by subclasses after grow
        self._begin(committed)
        logits = None
        if shape.depth > 0 and shape.max_nodes > 1:
            logits = self._root_logits(committed)
        last_level = {0: 0}  # candidate id -> the last level whose tree held it
        if logits is None:
            tree = self._tree(tokens, parents, logps, path, depths, 1)
            return self._result(tree, 0, start, last_level, level_union, tokens, parents, logps, depths)
        frontier = [0]
        levels = 0
        while True:
            top_lp, top_id = torch.topk(
                torch.log_softmax(logits, dim=-1), min(shape.topk, logits.shape[-1]), dim=-1
            )
            top_lp = top_lp.cpu().numpy().astype(np.float64)
            top_id = self._to_target_ids(top_id).cpu().numpy()
            level = []
            for i, parent in enumerate(frontier):
                for j in range(top_lp.shape[1]):
                    level.append(len(tokens))
                    tokens.append(int(top_id[i, j]))
                    parents.append(parent)
                    logps.append(float(top_lp[i, j]))
                    path.append(path[parent] + float(top_lp[i, j]))
                    depths.append(depths[parent] + 1)
            levels += 1
            tree = self._tree(tokens, parents, logps, path, depths, shape.max_nodes)
            last_level.update((int(c), levels) for c in self._tree_to_cand)
            if levels >= shape.depth or (keep_drafting is not None and not keep_drafting(tree, levels)):
                break
            frontier = sorted(level, key=lambda v: (-path[v], v))[: shape.topk]
            if len(self._tree_to_cand) == shape.max_nodes and path[frontier[0]] < min(
                path[c] for c in self._tree_to_cand
            ):
                break  # no child of the new frontier could enter the full tree: more levels cannot change it
            logits = self._level_logits(frontier, tokens, parents, depths)
        return self._result(tree, levels, start, last_level, level_union, tokens, parents, logps, depths)


class ModelDrafter(TreeDrafter):
    """:class:`Drafter` backed by a small causal LM that shares the target's tokenizer.

    The draft's KV cache holds a prefix of the committed tokens; ``grow`` feeds the missing
    committed tokens causally, then one forward per level (the frontier) with a tree attention
    mask. ``accept`` keeps only the accepted path's entries (KV trimming), so the next ``grow``
    feeds only what is new.
    """

    kind = "causal-lm"

    def __init__(self, model: nn.Module) -> None:
        self.lm = CachedLM(model)
        self._slots: list[int] = []  # candidate ids in the draft cache after the context, cache order
        self._tree_to_cand: np.ndarray = np.zeros(1, np.int64)
        self._context_len = 0

    def reset(self) -> None:
        """Drop the draft cache."""
        self.lm.reset()
        self._slots = []
        self._tree_to_cand = np.zeros(1, np.int64)
        self._context_len = 0

    def _begin(self, committed: Sequence[int]) -> None:
        self._slots = []
        self._context_len = len(committed)

    def _root_logits(self, committed: Sequence[int]) -> torch.Tensor:
        n = len(committed)
        if self.lm.cache_len > n:
            raise ValueError(
                f"ModelDrafter.grow: draft cache holds {self.lm.cache_len} tokens but only {n} committed"
            )
        if self.lm.cache_len == n:  # the root itself is cached: re-feed it to get its next-token logits
            self.lm.keep(n - 1, [])
        return self.lm.feed_causal(list(committed[self.lm.cache_len :]), last_only=True)

    def _level_logits(self, frontier, tokens, parents, depths) -> torch.Tensor:
        self._slots.extend(frontier)
        n = self._context_len
        return self.lm.feed_tree(
            [tokens[v] for v in frontier],
            [depths[v] for v in frontier],
            root_position=n - 1,
            context_len=n,
            slot_nodes=self._slots,
            query_nodes=frontier,
            ancestors=ancestor_matrix(parents),
        )

    def accept(self, path_nodes: Sequence[int]) -> None:
        """Keep the committed context plus the cached entries of the accepted path's leading nodes.

        ``path_nodes`` are node ids of the tree returned by the last :meth:`grow`.
        """
        kept = []
        for v in path_nodes:
            cand = int(self._tree_to_cand[v])
            if cand not in self._slots:
                break
            kept.append(self._context_len + self._slots.index(cand))
        self.lm.keep(self._context_len, kept)
        self._slots = []
