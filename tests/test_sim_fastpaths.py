"""The replay's unchecked helpers build exactly what the checked constructors would."""

from __future__ import annotations

import numpy as np

from sim.replay import _depth_subtree, _layer_mask
from specfit.tree import DraftTree


def test_depth_subtree_equals_the_checked_subtree() -> None:
    rng = np.random.default_rng(3)
    n = 40
    tree = DraftTree.from_parents(
        rng.integers(0, 1000, n),
        [-1] + [int(rng.integers(0, v)) for v in range(1, n)],
        np.concatenate(([0.0], -rng.exponential(0.5, n - 1))),
    )
    for depth in range(int(tree.max_depth) + 1):
        keep = np.flatnonzero(tree.depths <= depth)
        fast, checked = _depth_subtree(tree, keep), tree.subtree(keep)
        assert fast.equals(checked) and isinstance(fast, DraftTree)
        assert fast.num_nodes == keep.size and fast.max_depth == depth
        assert not fast.parents.flags.writeable
        assert fast.children(0).tolist() == checked.children(0).tolist()


def test_layer_mask_is_the_per_layer_union() -> None:
    ids = np.array([[[1, 2], [3, -1]], [[2, 4], [-1, -1]], [[0, 0], [5, 6]]])  # [N=3, L=2, K=2]
    mask = _layer_mask(ids, np.array([0, 1]), 8)
    assert mask.dtype == bool and mask.shape == (2, 8)
    assert np.flatnonzero(mask[0]).tolist() == [1, 2, 4] and np.flatnonzero(mask[1]).tolist() == [3]
    rng = np.random.default_rng(5)
    for dtype in (np.int16, np.int32, np.int64):  # the recorded int16 routing, widened prompt ids
        ids = rng.integers(-1, 70, size=(9, 4, 3)).astype(dtype)
        nodes = np.sort(rng.choice(9, size=4, replace=False))
        want = np.zeros((4, 70), dtype=bool)
        for v in nodes:
            for layer in range(4):
                want[layer, [e for e in ids[v, layer] if e >= 0]] = True
        assert np.array_equal(_layer_mask(ids, nodes, 70), want)


def test_depth_subtree_of_a_tree_not_stored_level_by_level() -> None:
    # node 2 (depth 2) precedes node 3 (depth 1): the depth-1 subtree is {0, 1, 3}, not a prefix
    tree = DraftTree.from_parents([5, 6, 7, 8], [-1, 0, 1, 0], [0.0, -0.1, -0.2, -0.3])
    keep = np.flatnonzero(tree.depths <= 1)
    fast = _depth_subtree(tree, keep)
    assert keep.tolist() == [0, 1, 3] and fast.equals(tree.subtree(keep))
    assert fast.parents.tolist() == [-1, 0, 0] and fast.token_ids.tolist() == [5, 6, 8]


def test_mask_rows_index_like_a_list_of_id_arrays() -> None:
    from sim.replay import _MaskRows
    from specfit.cache import make_expert_cache

    mask = np.zeros((3, 70), dtype=bool)
    mask[0, [1, 65]] = True
    mask[2, 3] = True
    access = make_expert_cache("lru", 3, 70, 4).access_layers(mask)  # an empty cache: all miss
    rows = _MaskRows(access.miss_ids, 3)
    assert len(rows) == 3 and [r.tolist() for r in rows] == [[1, 65], [], [3]]
    assert [r.tolist() for r in _MaskRows(access.hit_ids, 3)] == [[], [], []]
