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


def test_specfit_replay_through_the_compiled_questions_equals_the_contexts_path(monkeypatch) -> None:
    """SpecFit (expected rule, union-size) replays through ``UnionSizeQuestions`` (the live
    engine's compiled questions); every cycle record and total equals the replay that builds a
    ``PolicyContext`` per level (``_choose``'s general path), with and without an acceptance map,
    with overlap and next-layer prefetch."""
    import dataclasses
    import json

    import sim.replay as replay
    from sim.config import SimConfig
    from sim.presets import DEFAULT_COST, cost_from_preset
    from sim.traceselect import sample_trace_dir
    from traces.reader import open_run

    run = open_run(sample_trace_dir())
    model = run.manifest.model
    cost = cost_from_preset(DEFAULT_COST, expert_bytes=int(model.bytes_per_expert), num_layers=model.num_layers)
    acceptance = json.loads((sample_trace_dir() / "acceptance.json").read_text())
    used = []
    init = replay._Replayer.__init__

    def contexts_only(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        used.append(self._questions is not None)
        self._questions = None

    for extra in ({"acceptance": acceptance}, {"overlap": "on", "prefetch": "next-layer"}):
        config = SimConfig(cost=cost, policy="specfit", cache_capacity_per_layer=16, max_positions=48, **extra)
        fast = replay.replay_policy(run, config)
        monkeypatch.setattr(replay._Replayer, "__init__", contexts_only)
        slow = replay.replay_policy(run, config)
        monkeypatch.setattr(replay._Replayer, "__init__", init)
        assert used.pop() is True  # the questions were built for this config (and switched off)
        assert fast.totals == slow.totals and len(fast.cycles) == len(slow.cycles) > 20
        assert [dataclasses.asdict(c) for c in fast.cycles] == [dataclasses.asdict(c) for c in slow.cycles]
        assert {c.num_draft_levels for c in fast.cycles} != {0}  # it drafted in some cycles
