"""TokenTree validation and the EAGLE-2 rerank used by the drafter (pure numpy, fast)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from live.spec.draft import TreeShape, _rerank
from live.spec.tree import TokenTree, ancestor_matrix


def test_from_parents_derives_depths_and_paths():
    tree = TokenTree.from_parents([7, 8, 9, 10], [-1, 0, 0, 1], [0.0, -0.5, -1.0, -0.25])
    assert tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.path_logprobs.tolist() == [0.0, -0.5, -1.0, -0.75]
    assert tree.children(0).tolist() == [1, 2] and tree.path_to(3) == [0, 1, 3]
    assert tree.is_ancestor_closed([0, 1, 3]) and not tree.is_ancestor_closed([0, 3])
    assert tree.max_depth == 2 and tree.num_nodes == 4


def test_planner_view_equals_the_validated_draft_tree():
    """to_draft_tree skips re-validation (hot loop); its arrays equal the checked constructor's."""
    import numpy as np

    from specfit.tree import DraftTree

    tree = TokenTree.from_parents([7, 8, 9, 10, 11], [-1, 0, 0, 1, 3], [0.0, -0.5, -1.0, -0.25, -2.0])
    fast = tree.to_draft_tree()
    checked = DraftTree.from_parents(tree.token_ids, tree.parents, tree.draft_logprobs)
    for name in ("token_ids", "parents", "depths", "draft_logprobs", "path_logprobs"):
        assert np.array_equal(getattr(fast, name), getattr(checked, name)), name
        assert getattr(fast, name).dtype == getattr(checked, name).dtype
    assert fast.max_depth == 3 and fast.subtree(np.array([0, 1, 3])).num_nodes == 3
    with pytest.raises(ValueError):
        fast.parents[0] = 5


@pytest.mark.parametrize(
    ("parents", "match"),
    [([0, 0], r"parents\[0\]"), ([-1, 1], r"parents\[1\]"), ([-1, 0, 3, 1], r"parents\[2\]")],
)
def test_bad_parents_name_the_node(parents, match):
    with pytest.raises(ValueError, match=match):
        TokenTree.from_parents(list(range(len(parents))), parents, [0.0] * len(parents))


def test_tree_shape_rejects_bad_values():
    with pytest.raises(ValueError, match="TreeShape.topk"):
        TreeShape(depth=2, topk=0, max_nodes=4)
    with pytest.raises(ValueError, match="TreeShape.max_nodes"):
        TreeShape(depth=2, topk=2, max_nodes=0)


def test_ancestor_matrix():
    anc = ancestor_matrix([-1, 0, 0, 1, 3])
    assert anc[:, 4].tolist() == [True, True, False, True, True]
    assert anc[2].tolist() == [False, False, True, False, False]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rerank_keeps_an_ancestor_closed_best_set(data):
    n = data.draw(st.integers(2, 40))
    parents = [-1] + [data.draw(st.integers(0, v - 1)) for v in range(1, n)]
    logps = [0.0] + [data.draw(st.sampled_from([0.0, -0.1, -0.5, -1.0, -2.0])) for _ in range(1, n)]
    path, depths = [0.0] * n, [0] * n
    for v in range(1, n):
        path[v], depths[v] = path[parents[v]] + logps[v], depths[parents[v]] + 1
    budget = data.draw(st.integers(1, n))
    keep = _rerank(parents, path, depths, budget)
    assert len(keep) == budget and keep[0] == 0
    chosen = set(keep.tolist())
    assert all(v == 0 or parents[v] in chosen for v in chosen)  # ancestor-closed
    order = keep.tolist()
    assert [depths[v] for v in order] == sorted(depths[v] for v in order)  # parents precede children
    left_out = [v for v in range(n) if v not in chosen]
    if left_out and budget > 1:  # nothing left out beats anything kept (path probability)
        assert max(path[v] for v in left_out) <= min(path[v] for v in chosen if v != 0) + 1e-12
