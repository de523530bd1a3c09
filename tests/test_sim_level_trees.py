"""The simulator's per-level planning problems are the live engine's (issue 13, same subtree).

The live engine asks SpecFit's stopping rule after each draft level on the EAGLE-2 tree of that
level (``live.spec.draft``: the ``max_nodes - 1`` most probable candidates so far, reranked after
every level). A deeper level can push a shallow candidate out, so that tree is not the final tree
cut at the level's depth; and since calibrated children are renormalised against their siblings
(``specfit.acceptance.path_accept_probs``), the surviving sibling's P(v) differs too. Dense mode
therefore records the union of the level trees with each node's ``last_level``
(``TreeDrafter.grow(..., level_union=True)``), and ``sim.replay._TreeData.level`` rebuilds each
level's tree from it. Format-v1 traces (no ``last_level``) keep the old approximation.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from live_fixtures import replay_test_cost  # noqa: E402

from live.spec.draft import TreeDrafter, TreeShape  # noqa: E402
from sim.replay import _TreeData  # noqa: E402
from specfit.acceptance import AcceptanceCalibration, path_accept_probs  # noqa: E402
from traces.reader import DenseTree  # noqa: E402

VOCAB = 16
# depth 3, top-k 2, 8 nodes: root; a, b; a's children a1, a2 and b's b1, b2; then the frontier
# (a1, b1)'s children a1x, a1y, b1x, b1y push a2 (path 0.8 * 0.04) out of the level-3 tree
CHILDREN = {  # parent token -> its two children's (token, draft probability)
    0: [(1, 0.8), (2, 0.2)],
    1: [(3, 0.9), (4, 0.04)],
    2: [(5, 0.6), (6, 0.3)],
    3: [(7, 0.9), (8, 0.05)],
    5: [(9, 0.5), (10, 0.2)],
}
SHAPE = TreeShape(depth=3, topk=2, max_nodes=8)
CALIBRATION = AcceptanceCalibration(
    knots_x=np.array([0.0, 0.5, 1.0]), knots_y=np.array([0.0, 0.95, 1.0]), scope="edge"
)


def _logits(token: int) -> torch.Tensor:
    """Next-token logits after ``token``: its two scripted children, the rest of the mass spread thin."""
    probs = np.full(VOCAB, 1e-6)
    for child, p in CHILDREN.get(token, [(11, 0.5), (12, 0.4)]):
        probs[child] = p
    return torch.log(torch.as_tensor(probs / probs.sum(), dtype=torch.float64))


class ScriptedDrafter(TreeDrafter):
    """A drafter whose distribution after token t is fixed (:data:`CHILDREN`)."""

    kind = "scripted"

    def _root_logits(self, committed):
        return _logits(int(committed[-1]))[None]

    def _level_logits(self, frontier, tokens, parents, depths):
        return torch.stack([_logits(tokens[v]) for v in frontier])


def _dense(draft) -> DenseTree:
    tree = draft.tree.to_draft_tree()
    n = tree.num_nodes
    zeros = np.zeros((n, 1, 1), dtype=np.int16)
    return DenseTree(0, 0, 1, tree, np.zeros(n, np.int64), np.ones(n, bool), zeros, zeros.astype(np.float32),
                     last_level=draft.last_level)  # fmt: skip


def test_sim_level_tree_is_the_live_level_tree() -> None:
    asked = {}  # levels -> the tree the live stopping rule is asked about

    def keep_drafting(tree, levels):
        asked[levels] = tree.to_draft_tree()
        return True

    live = ScriptedDrafter().grow([0], SHAPE, keep_drafting)
    dense = ScriptedDrafter().grow([0], SHAPE, level_union=True)
    asked[3] = live.tree.to_draft_tree()  # the rule is not asked after the last level: the final tree
    assert dense.num_levels == live.num_levels == 3
    assert 4 in asked[2].token_ids and 4 not in asked[3].token_ids  # a2 pushed out at level 3
    assert dense.tree.num_nodes == SHAPE.max_nodes + 1  # the union holds it; its last level is 2
    assert dense.last_level[list(dense.tree.token_ids).index(4)] == 2
    data = _TreeData(_dense(dense))
    assert data.level_trees and data.depth == 3
    for levels, want in asked.items():
        sub, keep = data.level(levels)
        assert sub.token_ids.tolist() == want.token_ids.tolist(), levels
        assert sub.parents.tolist() == want.parents.tolist(), levels
        np.testing.assert_array_equal(sub.path_logprobs, want.path_logprobs)
        np.testing.assert_array_equal(data.accept_probs("cal", levels, CALIBRATION), path_accept_probs(want, CALIBRATION))
    # what a format-v1 trace held (the final tree, no last_level): its depth-2 cut lacks a2, and
    # a1's calibrated P differs from the live level-2 tree's (siblings renormalised)
    old = _TreeData(_dense(ScriptedDrafter().grow([0], SHAPE)))
    assert not old.level_trees and old.depth == 3
    cut, _ = old.level(2)
    assert cut.token_ids.tolist() == [t for t in asked[2].token_ids.tolist() if t != 4]
    a1_live = path_accept_probs(asked[2], CALIBRATION)[asked[2].token_ids.tolist().index(3)]
    a1_cut = old.accept_probs("cal", 2, CALIBRATION)[cut.token_ids.tolist().index(3)]
    assert a1_live != a1_cut


def test_final_tree_is_what_a_plain_grow_returns() -> None:
    """The union's nodes with ``last_level == num_levels`` are the tree ``grow`` returns."""
    plain = ScriptedDrafter().grow([0], SHAPE)
    dense = ScriptedDrafter().grow([0], SHAPE, level_union=True)
    assert plain.last_level is None
    final = np.flatnonzero(dense.last_level == dense.num_levels)
    assert dense.tree.token_ids[final].tolist() == plain.tree.token_ids.tolist()
    d = _dense(dense)
    assert d.level_nodes(dense.num_levels).tolist() == final.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", ["none", "next-layer"])
def test_live_and_replay_choose_the_same_subtree_where_nodes_are_pushed_out(tmp_path, capsys, prefetch) -> None:
    """End to end on the embedded default (a trained draft, so deeper candidates do push shallow
    ones out): a dense trace, a live SpecFit run and its replay choose the same draft levels and
    subtree cycle by cycle, with the same predicted E[committed] (up to the draft's float noise
    between the two recordings), including cycles that stopped on a level tree that is not the
    final tree's depth cut; the format-v1 approximation (``last_level`` dropped) does not."""
    import json

    from live.assets import default_model_paths
    from live.record import main
    from sim.config import SimConfig
    from sim.replay import replay_policy
    from traces.reader import open_run

    try:
        default_model_paths()
    except FileNotFoundError:
        pytest.skip("embedded default checkpoints not in this checkout")
    acceptance_path = "traces/samples/default/acceptance.json"
    shape = ["--num-prompts", "2", "--max-new-tokens", "12", "--depth", "4", "--topk", "3", "--max-nodes", "10"]
    assert main([*shape, "--out", str(tmp_path / "dense"), "--no-progress"]) == 0
    dense = open_run(tmp_path / "dense")
    assert dense.has_level_trees
    model = dense.manifest.model
    cost = replay_test_cost(model, verify_base_s=3e-3)
    cost.save(tmp_path / "cost.json")
    argv = [*shape, "--out", str(tmp_path / "live"), "--no-progress", "--mode", "policy", "--policy", "specfit"]
    argv += ["--predictor", "union-size", "--predictor-tables", str(tmp_path / "dense"), "--cache-policy", "lru"]
    argv += ["--acceptance", acceptance_path, "--cost", str(tmp_path / "cost.json"), "--cache-experts", "16"]
    assert main([*argv, "--bandwidth", "1", "--prefetch", prefetch]) == 0
    capsys.readouterr()
    live = open_run(tmp_path / "live").cycles.sort_values(["request_id", "cycle_index"])

    def replay(run):
        config = SimConfig(
            cost=cost,
            policy="specfit",
            cache_capacity_per_layer=16,
            predictor="union-size",
            acceptance=json.loads(open(acceptance_path).read()),
            prefetch=prefetch,  # next-layer: the planner's miss fraction counts used prefetches (issue 13)
        )
        return sorted(replay_policy(run, config).cycles, key=lambda c: (c.request_id, c.cycle_index))

    sim = replay(dense)
    assert len(sim) == len(live)
    assert [c.num_draft_levels for c in sim] == live["num_draft_levels"].tolist()
    assert [c.verified_nodes for c in sim] == live["verified_nodes"].map(list).tolist()
    counts = ("num_prefetch_issued", "num_prefetch_used", "num_prefetch_wasted") if prefetch != "none" else ()
    for name in ("position", "num_accepted", "cache_hits", "cache_misses", *counts):
        assert [getattr(c, name) for c in sim] == live[name].astype(int).tolist(), name
    np.testing.assert_allclose(
        [c.predicted_expected_committed for c in sim], live["predicted_expected_committed"], rtol=1e-6
    )
    trees = {(t.request_id, t.position): t for t in dense.iter_trees()}
    stopped_on_a_level_tree = [
        c for c in sim
        if not np.array_equal(
            trees[c.request_id, c.position].level_nodes(c.num_draft_levels),
            np.flatnonzero(trees[c.request_id, c.position].tree.depths <= c.num_draft_levels),
        )
    ]  # fmt: skip
    assert stopped_on_a_level_tree  # the case this test is about
    old = open_run(tmp_path / "dense")  # what a format-v1 trace held: each position's final tree only
    old.__dict__["_node_arrays"] = _final_trees_only(old.node_arrays())
    approx = replay(old)
    assert [(c.num_draft_levels, c.verified_nodes, round(c.predicted_expected_committed, 6)) for c in approx] != [
        (c.num_draft_levels, c.verified_nodes, round(c.predicted_expected_committed, 6)) for c in sim
    ]


def _final_trees_only(arrays):
    """``NodeArrays`` of the final trees (nodes with ``last_level`` = the levels drafted, renumbered)
    without ``last_level``: the format-v1 view of a v2 trace."""
    import dataclasses

    sizes = np.diff(arrays.offsets)
    start = np.repeat(arrays.offsets[:-1], sizes)
    keep = arrays.last_level == arrays.last_level[start]
    new_row = np.cumsum(keep) - 1  # new global row of each kept row
    offsets = np.concatenate([[0], np.cumsum(np.add.reduceat(keep, arrays.offsets[:-1]))])
    new_start = np.repeat(offsets[:-1], sizes)
    parent = np.where(arrays.parent >= 0, new_row[start + np.maximum(arrays.parent, 0)] - new_start, -1)
    rows = {
        name: getattr(arrays, name)[keep]
        for name in ("depth", "token_id", "target_token", "accepted", "draft_logprob", "path_logprob",
                     "expert_ids", "router_weights", "next_layer_expert_ids")
    }  # fmt: skip
    return dataclasses.replace(arrays, offsets=offsets, parent=parent[keep], last_level=None, **rows)
