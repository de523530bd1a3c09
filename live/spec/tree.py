"""Token trees drafted by the live engine and their ancestor structure.

The live engine keeps its own small tree record (:class:`TokenTree`) because it is built
incrementally during drafting; :meth:`TokenTree.to_draft_tree` converts it to the project's
canonical :class:`specfit.tree.DraftTree` (docs/contracts.md) at the edges (planner, trace writer).

Conventions (DESIGN.md): node 0 is the root (the last committed token), ``parents[0] == -1``,
parents precede children, ``depth[v] = depth[parent] + 1``, position id = ``root_position + depth``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specfit.tree import TREE_FIELD_DTYPES, TypedTree, tree_array


def ancestor_matrix(parents: Any) -> np.ndarray:
    """bool[N, N] from parent ids (``parents[0] == -1``, parents precede children); ``[a, v]``: a is v or an ancestor."""
    n = len(parents)
    anc = np.eye(n, dtype=bool)
    for v in range(1, n):
        anc[:, v] |= anc[:, int(parents[v])]
    return anc


@dataclass(frozen=True)
class TokenTree(TypedTree):
    """A drafted token tree, nodes in creation (breadth-first) order.

    Its arrays are read-only 1-D ndarrays of the dtypes below whatever the constructor is given
    (converted once here; an array of the right dtype that owns its memory is shared and made
    read-only, so the caller's own later write raises; a view is copied, since its base could
    still be written): ``specfit.tree.TypedTree``, so the planner's compiled questions read them
    without checking their types per question (issue 14).

    Attributes (``N`` nodes):
        token_ids: int64[N]; node 0 holds the root token.
        parents: int64[N]; ``parents[0] == -1``, ``parents[v] < v``.
        depths: int64[N]; 0 at the root.
        draft_logprobs: float64[N]; log-prob of the node's token under the draft given its parent (0 at the root).
        path_logprobs: float64[N]; sum of ``draft_logprobs`` along the root path (0 at the root).

    Raises:
        ValueError: naming the field and node when the arrays disagree in length, an array has
            more than one axis or non-integral ids, or the parent order is broken.
    """

    token_ids: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    draft_logprobs: np.ndarray
    path_logprobs: np.ndarray

    def __post_init__(self) -> None:
        for name, dtype in TREE_FIELD_DTYPES.items():
            values = getattr(self, name)
            if type(values) is not np.ndarray or values.ndim != 1 or (values.dtype is not dtype and values.dtype != dtype):
                values = tree_array("TokenTree", name, values, dtype.type)
            if values.base is not None:  # a view: whatever owns the memory could still write it
                values = values.copy()
            values.setflags(write=False)
            object.__setattr__(self, name, values)
        n = len(self.token_ids)
        for name in ("parents", "depths", "draft_logprobs", "path_logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TokenTree.{name}: expected {n} entries, got {len(getattr(self, name))}")
        if n == 0:
            raise ValueError("TokenTree.token_ids: a tree needs at least the root node")
        if self.parents[0] != -1:
            raise ValueError(f"TokenTree.parents[0]: expected -1 for the root, got {self.parents[0]}")
        for v in range(1, n):
            p = int(self.parents[v])
            if not 0 <= p < v:
                raise ValueError(f"TokenTree.parents[{v}]: expected a node id in [0, {v}), got {p}")
            if self.depths[v] != self.depths[p] + 1:
                raise ValueError(f"TokenTree.depths[{v}]: expected depth[parent]+1 = {self.depths[p] + 1}")

    @classmethod
    def from_parents(cls, token_ids: Any, parents: Any, draft_logprobs: Any) -> TokenTree:
        """Build a tree from tokens, parents and per-node draft log-probs; derives depths and path log-probs."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        parents = np.asarray(parents, dtype=np.int64)
        draft_logprobs = np.asarray(draft_logprobs, dtype=np.float64)
        n = len(token_ids)
        if len(parents) != n or len(draft_logprobs) != n:
            raise ValueError(
                f"TokenTree.from_parents: token_ids, parents and draft_logprobs need equal lengths, "
                f"got {n}, {len(parents)}, {len(draft_logprobs)}"
            )
        depths = np.zeros(n, dtype=np.int64)
        path = np.zeros(n, dtype=np.float64)
        for v in range(1, n):
            p = int(parents[v])
            if not 0 <= p < v:
                raise ValueError(f"TokenTree.parents[{v}]: expected a node id in [0, {v}), got {p}")
            depths[v] = depths[p] + 1
            path[v] = path[p] + draft_logprobs[v]
        logprobs = draft_logprobs.copy()
        logprobs[0] = 0.0
        return cls(token_ids, parents, depths, logprobs, path)

    @classmethod
    def root_only(cls, token_id: int) -> TokenTree:
        """The one-node tree used by autoregressive decoding."""
        return cls.from_parents([token_id], [-1], [0.0])

    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N`` including the root."""
        return len(self.token_ids)

    @property
    def max_depth(self) -> int:
        """Largest node depth (0 for a root-only tree)."""
        return int(self.depths.max())

    def children(self, v: int) -> np.ndarray:
        """Node ids whose parent is ``v`` (int64, ascending)."""
        return np.flatnonzero(self.parents == v)

    def ancestor_matrix(self) -> np.ndarray:
        """bool[N, N]; ``[a, v]`` is True when ``a`` is ``v`` or an ancestor of ``v``."""
        return ancestor_matrix(self.parents)

    def path_to(self, v: int) -> list[int]:
        """Node ids from the root to ``v`` inclusive."""
        path = [int(v)]
        while self.parents[path[-1]] >= 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]

    def is_ancestor_closed(self, nodes: Any) -> bool:
        """True when ``nodes`` contains the root and the parent of each of its nodes."""
        chosen = set(int(v) for v in nodes)
        return 0 in chosen and all(v == 0 or int(self.parents[v]) in chosen for v in chosen)

    def to_draft_tree(self) -> Any:
        """The same tree as :class:`specfit.tree.DraftTree` (docs/contracts.md).

        Built with ``DraftTree.trusted``: this tree's constructor has checked the parent order and
        depths, and its arrays are the drafter's own (log-softmax log-probs, their path sums); the
        planner asks for it after every draft level, where re-validation costs more than the plan.
        The arrays are shared, not copied (this tree's constructor made them read-only arrays of
        the right dtypes that own their memory).
        """
        from specfit.tree import DraftTree

        return DraftTree.trusted(
            token_ids=self.token_ids,
            parents=self.parents,
            depths=self.depths,
            draft_logprobs=self.draft_logprobs,
            path_logprobs=self.path_logprobs,
        )
