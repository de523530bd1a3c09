"""Acceptance calibration map and reliability table from dense-trace nodes (calibration.acceptance_fit)."""

import numpy as np
import pandas as pd
import pytest

from calibration.acceptance_fit import AcceptanceDataError, fit_acceptance, path_accepted


def _chain_nodes(num_trees: int, depth: int, seed: int) -> pd.DataFrame:
    """Chains whose true local acceptance is sqrt(draft prob): true path acceptance = sqrt(draft path prob)."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(num_trees):
        logp = 0.0
        for d in range(depth + 1):
            if d == 0:
                rows.append((0, t, 0, -1, 0, 0.0, True))
                continue
            q = rng.uniform(0.3, 0.95)
            logp += np.log(q)
            rows.append((0, t, d, d - 1, d, logp, bool(rng.random() < np.sqrt(q))))
    return pd.DataFrame(
        rows, columns=["request_id", "position", "node_id", "parent", "depth", "path_logprob", "accepted"]
    )


def test_path_accepted_requires_all_ancestors() -> None:
    # root, 1 (rejected), 2 child of 1 (locally accepted), 3 child of root (accepted), 4 child of 3
    nodes = pd.DataFrame(
        {
            "request_id": [0] * 5,
            "position": [0] * 5,
            "node_id": [0, 1, 2, 3, 4],
            "parent": [-1, 0, 1, 0, 3],
            "depth": [0, 1, 2, 1, 2],
            "path_logprob": [0.0, -0.1, -0.3, -1.0, -1.5],
            "accepted": [True, False, True, True, True],
        }
    )
    prob, ok, tree = path_accepted(nodes)
    np.testing.assert_array_equal(ok, [True, False, False, True, True])
    np.testing.assert_allclose(prob, np.exp([0.0, -0.1, -0.3, -1.0, -1.5]))
    np.testing.assert_array_equal(tree, 0)


def test_isotonic_map_recovers_sqrt_relation() -> None:
    fit = fit_acceptance(_chain_nodes(1500, 4, seed=0), scope="path", num_bins=20, seed=0)
    cal = fit.calibration
    assert np.all(np.diff(cal.knots_y) >= 0)
    for x in (0.1, 0.25, 0.5):
        assert cal.apply(np.array([x]))[0] == pytest.approx(np.sqrt(x), abs=0.05)
    assert fit.ece_calibrated < 0.06
    assert fit.ece_draft > 0.15  # the draft is under-confident by construction
    table = fit.reliability
    assert int(table["num_nodes"].sum()) == fit.num_nodes_eval == 375 * 4
    assert list(table.columns) == [
        "bin_lo",
        "bin_hi",
        "num_nodes",
        "mean_draft_prob",
        "mean_calibrated_prob",
        "observed_accept_rate",
    ]


def test_acceptance_errors_name_the_field() -> None:
    nodes = _chain_nodes(10, 3, seed=1)
    with pytest.raises(AcceptanceDataError, match="accepted"):
        fit_acceptance(nodes.drop(columns=["accepted"]), scope="path")
    bad = nodes.copy()
    bad.loc[3, "path_logprob"] = np.nan
    with pytest.raises(AcceptanceDataError, match="path_logprob"):
        fit_acceptance(bad, scope="path")
    with pytest.raises(AcceptanceDataError, match="need >= 20"):
        fit_acceptance(_chain_nodes(3, 2, seed=1), scope="path")
    with pytest.raises(AcceptanceDataError, match="draft_logprob"):
        fit_acceptance(nodes)  # the default edge scope needs each node's own draft log-prob
    with pytest.raises(AcceptanceDataError, match="scope"):
        fit_acceptance(nodes, scope="depth")


def _tree_nodes(num_trees: int, seed: int) -> pd.DataFrame:
    """Root + 3 children + 1 grandchild under each child; local acceptance = sqrt(own draft prob)."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(num_trees):
        rows.append((0, t, 0, -1, 0, 0.0, 0.0, True))
        q_children = rng.dirichlet([1.0, 1.0, 1.0])
        for c, q in enumerate(q_children):
            rows.append((0, t, 1 + 2 * c, 0, 1, np.log(q), np.log(q), bool(rng.random() < np.sqrt(q))))
            q2 = rng.uniform(0.3, 0.95)
            rows.append(
                (
                    0,
                    t,
                    2 + 2 * c,
                    1 + 2 * c,
                    2,
                    np.log(q) + np.log(q2),
                    np.log(q2),
                    bool(rng.random() < np.sqrt(q2)),
                )
            )
    cols = [
        "request_id",
        "position",
        "node_id",
        "parent",
        "depth",
        "path_logprob",
        "draft_logprob",
        "accepted",
    ]
    return pd.DataFrame(rows, columns=cols)


def test_edge_map_recovers_per_token_acceptance_and_calibrates_paths() -> None:
    from specfit.acceptance import AcceptanceCalibration, path_accept_probs
    from specfit.tree import DraftTree

    nodes = _tree_nodes(2000, seed=0)
    fit = fit_acceptance(nodes, num_bins=20, seed=0)
    cal = fit.calibration
    assert cal.scope == "edge"
    # per-token acceptance given the parent's path = sqrt(own draft prob), for the most probable
    # child (own map) and for its siblings (runner-up map), each where it has data
    assert cal.runner_up_knots_x is not None
    top = np.array([0.5, 0.8])
    np.testing.assert_allclose(cal.apply_edges(top, np.array([True, True])), np.sqrt(top), atol=0.06)
    runner = np.array([0.1, 0.25])
    np.testing.assert_allclose(cal.apply_edges(runner, np.array([False, False])), np.sqrt(runner), atol=0.06)
    assert fit.ece_calibrated < 0.05 < fit.ece_draft
    # P(v) multiplies the mapped per-token probabilities along the path
    tree = DraftTree.from_parents(np.array([0, 1, 2]), np.array([-1, 0, 1]), np.log([1.0, 0.25, 0.64]))
    p = path_accept_probs(tree, cal)
    assert p[2] == pytest.approx(
        cal.apply(np.array([0.25]))[0] * cal.apply(np.array([0.64]))[0]
    )  # only children
    wide = DraftTree.from_parents(np.array([0, 1, 2]), np.array([-1, 0, 0]), np.log([1.0, 0.3, 0.1]))
    p_wide = path_accept_probs(wide, cal)  # node 2 is the runner-up of node 1
    assert p_wide[2] == pytest.approx(cal.apply_edges(np.array([0.1]), np.array([False]))[0])
    # this synthetic data accepts siblings independently (sqrt(0.6) + sqrt(0.3) > 1); real greedy
    # verification accepts at most one child, so P shares the parent's value among the siblings
    wider = DraftTree.from_parents(np.array([0, 1, 2]), np.array([-1, 0, 0]), np.log([1.0, 0.6, 0.3]))
    mapped = cal.apply_edges(np.array([0.6, 0.3]), np.array([True, False]))
    assert mapped.sum() > 1
    np.testing.assert_allclose(path_accept_probs(wider, cal)[1:], mapped / mapped.sum())
    assert AcceptanceCalibration.from_dict(cal.to_dict()).scope == "edge"
