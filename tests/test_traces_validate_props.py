"""Property tests of the vectorised tree checks against random trees (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import validate as V


@st.composite
def forests(draw):
    """Random valid dense-tree rows: several trees, parents precede children, consistent fields."""
    num_trees = draw(st.integers(1, 4))
    rows = {
        k: [] for k in ("request_id", "position", "node_id", "parent", "depth", "token_id", "target_token")
    }
    draft = []
    for t in range(num_trees):
        n = draw(st.integers(1, 9))
        parents = [-1] + [draw(st.integers(0, v - 1)) for v in range(1, n)]
        depth = [0] * n
        for v in range(1, n):
            depth[v] = depth[parents[v]] + 1
        rows["request_id"] += [t // 2] * n
        rows["position"] += [t % 2] * n
        rows["node_id"] += list(range(n))
        rows["parent"] += parents
        rows["depth"] += depth
        rows["token_id"] += draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        rows["target_token"] += draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        draft += [0.0] + draw(st.lists(st.floats(-5, 0), min_size=n - 1, max_size=n - 1))
    arrays = {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}
    starts = V.tree_starts(arrays["request_id"], arrays["position"])
    start = np.repeat(starts, np.diff(np.append(starts, len(draft))))
    parent_row = np.where(arrays["parent"] >= 0, start + arrays["parent"], 0)
    arrays["accepted"] = np.where(
        arrays["parent"] < 0, True, arrays["token_id"] == arrays["target_token"][parent_row]
    )
    path = np.zeros(len(draft))
    for i in range(len(draft)):  # parents precede children
        path[i] = 0.0 if arrays["parent"][i] < 0 else path[parent_row[i]] + draft[i]
    arrays["draft_logprob"] = np.asarray(draft)
    arrays["path_logprob"] = path
    return arrays


@settings(max_examples=60, deadline=None)
@given(forests(), st.data())
def test_valid_forests_pass_and_a_broken_parent_is_found_at_its_row(arrays, data):
    assert V.check_trees(**arrays) is None
    candidates = np.flatnonzero(arrays["node_id"] > 0)
    if candidates.size == 0:
        return
    row = int(data.draw(st.sampled_from(candidates.tolist())))
    broken = {k: v.copy() for k, v in arrays.items()}
    broken["parent"][row] = broken["node_id"][row] + data.draw(st.integers(0, 3))  # not an earlier node
    found = V.check_trees(**broken)
    assert found is not None and found.row == row  # every other row is still valid
    assert f"orphan node {int(arrays['node_id'][row])}" in found.message
