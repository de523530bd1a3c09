"""Draft trees: the candidate tokens of one speculative-decoding cycle.

Node 0 is the root (the last committed token, always verified); ``parents[0] == -1``;
parents precede children (``0 <= parents[v] < v`` for ``v >= 1``); ``depths[v] =
depths[parents[v]] + 1``; ``path_logprobs[v]`` is the sum of ``draft_logprobs`` along the path
root -> v (the root contributes 0). These are the conventions of DESIGN.md ("Draft tree") and
of EAGLE-2's dynamic draft trees (Li et al., 2024), whose reranking uses the path probability.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

# Draft log-probabilities may be very slightly positive after float round-off (log-softmax in
# bf16 / fp16); anything above this is rejected as not a log-probability.
LOGPROB_TOLERANCE = 1e-6
PATH_TOLERANCE = 1e-6


class _Count(int):
    """An ``int`` that can also be called (``tree.num_nodes`` and ``tree.num_nodes()`` agree).

    docs/contracts.md lists ``num_nodes`` and ``max_depth`` among the methods of DraftTree
    without saying property or method; this keeps both spellings correct.
    """

    def __call__(self) -> int:
        return int(self)


#: The dtype of each array field of a draft tree (:class:`DraftTree`, ``live.spec.tree.TokenTree``).
TREE_FIELD_DTYPES = {
    "token_ids": np.dtype(np.int64),
    "parents": np.dtype(np.int64),
    "depths": np.dtype(np.int64),
    "draft_logprobs": np.dtype(np.float64),
    "path_logprobs": np.dtype(np.float64),
}


class TypedTree:
    """Base of the tree records whose construction guarantees each array field's type: a 1-D
    ``np.ndarray`` of :data:`TREE_FIELD_DTYPES`'s dtype (:class:`DraftTree`, its ``trusted``
    constructor included, and ``live.spec.tree.TokenTree``).

    The planner's compiled questions (``specfit.policies.UnionSizeQuestions``) read such a
    tree's arrays through numba's unchecked entry point after one exact-class lookup
    (:func:`is_typed_tree`) instead of
    checking the arrays' types per question (issue 14: each check costs microseconds after a
    model forward); a tree of another class goes through numba's dispatcher, which checks.

    Only the two classes above are trusted so (:func:`is_typed_tree`: the exact class, not any
    subclass): a subclass elsewhere, whatever it promises, goes through the dispatcher, since
    the entry point would misread arrays of another dtype of the same item size (a crash). The
    trusted classes' arrays are read-only; replacing a field with ``object.__setattr__`` voids
    the guarantee. The compiled question still checks the lengths and the parent order
    (``0 <= parents[v] < v``), so a read-only array changed through a writable base cannot make
    it read out of bounds.
    """

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if (cls.__module__, cls.__qualname__) in _TRUSTED_TREE_NAMES:
            TYPED_TREE_TYPES.add(cls)


#: The classes whose constructors guarantee their arrays' types (module, name): the only ones
#: :func:`is_typed_tree` trusts.
_TRUSTED_TREE_NAMES = frozenset({("specfit.tree", "DraftTree"), ("live.spec.tree", "TokenTree")})
#: Those classes, as they are defined (filled by :meth:`TypedTree.__init_subclass__`): ``type(tree)
#: in TYPED_TREE_TYPES`` is :func:`is_typed_tree` without its call, for a hot path in another
#: module (after a model forward a call into this module's function and globals costs ~8 us on the
#: build machine, issue 14).
TYPED_TREE_TYPES: set[type] = set()


def is_typed_tree(tree: object) -> bool:
    """True when ``tree``'s exact class is :class:`DraftTree` or ``live.spec.tree.TokenTree``
    (one set lookup): its arrays are 1-D read-only ndarrays of :data:`TREE_FIELD_DTYPES`'s dtypes
    of one length, so compiled code may read them without checking their types (issue 14)."""
    return type(tree) in TYPED_TREE_TYPES


def tree_array(owner: str, name: str, values: object, dtype: type) -> np.ndarray:
    """``values`` as a C-contiguous 1-D array of ``dtype`` (int64 or float64), shared when it is
    one already, else a converted copy.

    Raises:
        ValueError: naming ``owner.name``: not one axis, or non-integral values for int64.
    """
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{owner}.{name}: expected a 1-D array, got shape {arr.shape}")
    if dtype is np.int64:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                raise ValueError(f"{owner}.{name}: expected integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


def _as_1d(name: str, values: object, dtype: type) -> np.ndarray:
    out = tree_array("DraftTree", name, values, dtype)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class DraftTree(TypedTree):
    """A validated draft tree of ``N`` nodes (arrays are read-only copies).

    Attributes:
        token_ids: int64[N], token of each node (the root holds the last committed token).
        parents: int64[N], parent id; ``-1`` at the root; ``parents[v] < v``.
        depths: int64[N], 0 at the root, parent's depth + 1 elsewhere.
        draft_logprobs: float64[N], natural-log probability of the node's token under the draft
            model given its parent (``<= 0``; exactly 0 at the root).
        path_logprobs: float64[N], sum of ``draft_logprobs`` along root -> v (0 at the root).

    Raises:
        ValueError: empty tree, mismatched lengths, a bad root, a parent that does not precede
            its child, inconsistent depths or path log-probs, non-finite or positive log-probs;
            the message names the field and the node.
    """

    token_ids: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    draft_logprobs: np.ndarray
    path_logprobs: np.ndarray

    def __post_init__(self) -> None:
        fields = TREE_FIELD_DTYPES
        for name, dtype in fields.items():
            object.__setattr__(self, name, _as_1d(name, getattr(self, name), dtype.type))
        n = self.token_ids.shape[0]
        if n == 0:
            raise ValueError("DraftTree.token_ids: a tree needs at least the root node")
        for name in fields:
            if getattr(self, name).shape[0] != n:
                raise ValueError(
                    f"DraftTree.{name}: expected length {n} (= len(token_ids)), "
                    f"got {getattr(self, name).shape[0]}"
                )
        _validate_structure(self.parents, self.depths)
        _validate_logprobs(self.parents, self.draft_logprobs, self.path_logprobs)

    @classmethod
    def from_parents(
        cls,
        token_ids: Iterable[int] | np.ndarray,
        parents: Iterable[int] | np.ndarray,
        draft_logprobs: Iterable[float] | np.ndarray | None = None,
    ) -> DraftTree:
        """Build a tree from token ids and parents, deriving depths and path log-probs.

        Args:
            token_ids: int[N].
            parents: int[N], ``-1`` at the root, ``parents[v] < v`` elsewhere.
            draft_logprobs: float[N] (root entry must be 0); ``None`` means all zeros.

        Raises:
            ValueError: as the constructor (naming field and node).
        """
        parents_arr = _as_1d("parents", parents, np.int64)
        n = parents_arr.shape[0]
        if draft_logprobs is None:
            draft = np.zeros(n, dtype=np.float64)
        else:
            draft = _as_1d("draft_logprobs", draft_logprobs, np.float64)
            if draft.shape[0] != n:
                raise ValueError(
                    f"DraftTree.draft_logprobs: expected length {n} (= len(parents)), got {draft.shape[0]}"
                )
        _validate_parents(parents_arr)
        depths = np.zeros(n, dtype=np.int64)
        path = np.zeros(n, dtype=np.float64)
        for v in range(1, n):
            p = parents_arr[v]
            depths[v] = depths[p] + 1
            path[v] = path[p] + draft[v]
        return cls(
            token_ids=token_ids,
            parents=parents_arr,
            depths=depths,
            draft_logprobs=draft,
            path_logprobs=path,
        )

    @classmethod
    def trusted(cls, **fields: np.ndarray) -> DraftTree:
        """A tree from its five arrays WITHOUT the constructor's checks, for trusted internal callers.

        For hot loops that rebuild trees already validated elsewhere (the simulator's recorded
        trees, the live drafter's :class:`live.spec.tree.TokenTree`): the caller guarantees
        int64 ``token_ids``/``parents``/``depths`` and float64 ``draft_logprobs``/``path_logprobs``
        of one length, consistent as the constructor would check. The arrays are made read-only.
        Only their types and lengths are checked (a :class:`TypedTree`'s arrays are read unchecked
        by compiled code); other bad input gives wrong plans, not errors: use the constructor for
        anything external.

        Raises:
            ValueError: a field that is not a 1-D ``np.ndarray`` of its dtype, or of another
            length than ``token_ids`` (naming it).
        """
        tree = object.__new__(cls)
        n = -1
        for name, dtype in TREE_FIELD_DTYPES.items():
            arr = fields[name]
            if type(arr) is not np.ndarray or arr.ndim != 1 or (arr.dtype is not dtype and arr.dtype != dtype):
                raise ValueError(
                    f"DraftTree.trusted: {name}: expected a 1-D {dtype} ndarray, got "
                    f"{type(arr).__name__} {getattr(arr, 'dtype', '')} {getattr(arr, 'shape', '')}"
                )
            if n < 0:
                n = arr.shape[0]
            elif arr.shape[0] != n:
                raise ValueError(f"DraftTree.trusted: {name}: expected length {n} (= len(token_ids)), got {arr.shape[0]}")
            arr.setflags(write=False)
        tree.__dict__.update(  # the fields, as the frozen dataclass's __init__ stores them
            token_ids=fields["token_ids"],
            parents=fields["parents"],
            depths=fields["depths"],
            draft_logprobs=fields["draft_logprobs"],
            path_logprobs=fields["path_logprobs"],
        )
        return tree

    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N`` (also callable: ``tree.num_nodes()``)."""
        return _Count(self.token_ids.shape[0])

    @cached_property
    def max_depth(self) -> int:
        """Largest depth in the tree (0 for a root-only tree; also callable; computed once)."""
        return _Count(int(self.depths.max()))

    @property
    def path_probs(self) -> np.ndarray:
        """float64[N], ``exp(path_logprobs)``: draft probability of the path root -> v."""
        return np.exp(self.path_logprobs)

    @cached_property
    def _children(self) -> tuple[np.ndarray, ...]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for v in range(1, self.num_nodes):
            kids[int(self.parents[v])].append(v)
        return tuple(np.asarray(k, dtype=np.int64) for k in kids)

    def _check_node(self, v: int) -> int:
        v = int(v)
        if not 0 <= v < self.num_nodes:
            raise ValueError(f"DraftTree: node {v} out of range [0, {self.num_nodes})")
        return v

    def children(self, v: int) -> np.ndarray:
        """int64[] children of node ``v`` in ascending id order.

        Raises:
            ValueError: ``v`` out of range.
        """
        return self._children[self._check_node(v)]

    def ancestors(self, v: int) -> np.ndarray:
        """int64[] proper ancestors of ``v``, nearest first (parent, ..., root); empty at the root.

        Raises:
            ValueError: ``v`` out of range.
        """
        v = self._check_node(v)
        out = []
        p = int(self.parents[v])
        while p >= 0:
            out.append(p)
            p = int(self.parents[p])
        return np.asarray(out, dtype=np.int64)

    def nodes_at_depth(self, depth: int) -> np.ndarray:
        """int64[] ids of the nodes at ``depth``, ascending."""
        return np.flatnonzero(self.depths == int(depth)).astype(np.int64)

    def _node_mask(self, nodes: Iterable[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(list(nodes) if not isinstance(nodes, np.ndarray) else nodes)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"DraftTree: node ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64).ravel()
        bad = ids[(ids < 0) | (ids >= self.num_nodes)]
        if bad.size:
            raise ValueError(f"DraftTree: node {int(bad[0])} out of range [0, {self.num_nodes})")
        mask = np.zeros(self.num_nodes, dtype=bool)
        mask[ids] = True
        return mask

    def is_ancestor_closed(self, nodes: Iterable[int] | np.ndarray) -> bool:
        """True when ``nodes`` is non-empty and holds the parent of each of its nodes.

        A non-empty ancestor-closed set always contains the root.

        Raises:
            ValueError: a node id out of range.
        """
        mask = self._node_mask(nodes)
        if not mask.any():
            return False
        chosen = np.flatnonzero(mask)
        chosen = chosen[chosen > 0]
        return bool(mask[self.parents[chosen]].all())

    def subtree(self, nodes: Iterable[int] | np.ndarray) -> DraftTree:
        """The tree restricted to an ancestor-closed ``nodes``, renumbered in ascending id order.

        Raises:
            ValueError: ``nodes`` is not ancestor-closed or has an id out of range.
        """
        mask = self._node_mask(nodes)
        if not self.is_ancestor_closed(np.flatnonzero(mask)):
            raise ValueError("DraftTree.subtree: nodes must be ancestor-closed and contain the root 0")
        keep = np.flatnonzero(mask)
        new_id = np.full(self.num_nodes, -1, dtype=np.int64)
        new_id[keep] = np.arange(keep.size)
        parents = np.where(self.parents[keep] >= 0, new_id[self.parents[keep]], -1)
        return DraftTree(
            token_ids=self.token_ids[keep],
            parents=parents,
            depths=self.depths[keep],
            draft_logprobs=self.draft_logprobs[keep],
            path_logprobs=self.path_logprobs[keep],
        )

    def equals(self, other: DraftTree) -> bool:
        """Element-wise equality of all arrays (dataclass ``==`` is identity, arrays being arrays)."""
        return all(
            np.array_equal(getattr(self, f), getattr(other, f))
            for f in ("token_ids", "parents", "depths", "draft_logprobs", "path_logprobs")
        )


def _validate_parents(parents: np.ndarray) -> None:
    if parents.shape[0] == 0:
        raise ValueError("DraftTree.parents: a tree needs at least the root node")
    if parents[0] != -1:
        raise ValueError(f"DraftTree.parents: node 0 is the root and needs parent -1, got {parents[0]}")
    idx = np.arange(parents.shape[0])
    bad = np.flatnonzero((parents[1:] < 0) | (parents[1:] >= idx[1:])) + 1
    if bad.size:
        v = int(bad[0])
        raise ValueError(
            f"DraftTree.parents: node {v} has parent {int(parents[v])}; expected 0 <= parent < {v} "
            "(parents precede children)"
        )


def _validate_structure(parents: np.ndarray, depths: np.ndarray) -> None:
    _validate_parents(parents)
    if depths[0] != 0:
        raise ValueError(f"DraftTree.depths: root depth must be 0, got {depths[0]}")
    if parents.shape[0] > 1:
        bad = np.flatnonzero(depths[1:] != depths[parents[1:]] + 1) + 1
        if bad.size:
            v = int(bad[0])
            raise ValueError(
                f"DraftTree.depths: node {v} has depth {int(depths[v])}, expected "
                f"{int(depths[parents[v]]) + 1} (parent's depth + 1)"
            )


def _validate_logprobs(parents: np.ndarray, draft: np.ndarray, path: np.ndarray) -> None:
    for name, arr in (("draft_logprobs", draft), ("path_logprobs", path)):
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            raise ValueError(f"DraftTree.{name}: node {int(bad[0])} is not finite ({arr[bad[0]]})")
        bad = np.flatnonzero(arr > LOGPROB_TOLERANCE * (1 + np.arange(arr.size)))
        if bad.size:
            raise ValueError(
                f"DraftTree.{name}: node {int(bad[0])} has {arr[bad[0]]}, expected a log-probability <= 0"
            )
    if draft[0] != 0 or path[0] != 0:
        raise ValueError("DraftTree.draft_logprobs/path_logprobs: the root (node 0) must hold 0")
    if parents.shape[0] > 1:
        expected = path[parents[1:]] + draft[1:]
        bad = np.flatnonzero(np.abs(path[1:] - expected) > PATH_TOLERANCE * (1 + np.abs(expected))) + 1
        if bad.size:
            v = int(bad[0])
            raise ValueError(
                f"DraftTree.path_logprobs: node {v} has {path[v]}, expected {path[parents[v]] + draft[v]} "
                "(parent's path log-prob + draft log-prob)"
            )
