"""The report's expert-union growth figure ranks nodes as the planner does (issue 14, wdocs item 4).

The planner prices a subtree of n nodes with the union-size table, fitted on dense trees ranked by
draft path probability, and asks about top-by-P prefixes ranked by calibrated acceptance. The figure
draws the table's ranking and, where the run has an acceptance map, the calibrated ranking beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis import figures
from specfit.acceptance import AcceptanceCalibration
from traces.reader import NodeArrays

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces" / "samples" / "default"


def _one_tree() -> NodeArrays:
    """Root (expert 0), its top child A (draft p 0.6, expert 0) and runner-up B (p 0.3, expert 5)."""
    draft = np.log([1.0, 0.6, 0.3])
    return NodeArrays(
        offsets=np.array([0, 3]),
        request_ids=np.zeros(1, dtype=np.int64),
        positions=np.zeros(1, dtype=np.int64),
        context_lens=np.ones(1, dtype=np.int64),
        parent=np.array([-1, 0, 0]),
        depth=np.array([0, 1, 1]),
        token_id=np.array([7, 8, 9]),
        target_token=np.array([8, 9, 9]),
        accepted=np.array([True, False, True]),
        draft_logprob=np.where(np.arange(3) == 0, 0.0, draft),
        path_logprob=np.where(np.arange(3) == 0, 0.0, draft),
        expert_ids=np.array([[[0]], [[0]], [[5]]], dtype=np.int16),
        router_weights=np.ones((3, 1, 1), dtype=np.float32),
    )


# the runner-up child is accepted far more often than the top child: the two orders differ
RUNNER_UP_WINS = AcceptanceCalibration(
    np.array([0.0, 1.0]),
    np.array([0.0, 0.1]),
    scope="edge",
    runner_up_knots_x=np.array([0.0, 1.0]),
    runner_up_knots_y=np.array([0.0, 0.9]),
)


def test_union_growth_ranks_by_draft_probability_or_by_calibrated_acceptance():
    arrays = _one_tree()
    # draft order root, A, B: A shares the root's expert, so 2 nodes bring 1 expert
    np.testing.assert_array_equal(figures.union_growth(arrays, 8), [[0.0, 1.0, 1.0, 2.0]])
    # calibrated order root, B (0.27), A (0.06): 2 nodes bring 2 experts
    np.testing.assert_array_equal(figures.union_growth(arrays, 8, RUNNER_UP_WINS), [[0.0, 1.0, 2.0, 2.0]])


@pytest.mark.skipif(not (SAMPLE / "manifest.json").is_file(), reason="shipped sample trace not in this checkout")
def test_draft_ranked_curve_is_the_planners_union_size_table():
    """Without a map the figure draws exactly the table calibration.fit gives the planner."""
    from calibration.predictor_tables import fit_predictor_tables
    from traces.reader import open_run

    run = open_run(SAMPLE)
    arrays = run.node_arrays()
    num_experts = run.manifest.model.num_experts
    table = fit_predictor_tables([arrays], num_experts).union_size
    np.testing.assert_array_equal(figures.union_growth(arrays, num_experts), table)


def test_figure_draws_the_calibrated_ranking_beside_the_table(tmp_path, monkeypatch):
    drawn = {}

    def keep(fig, path):
        drawn["labels"] = [line.get_label() for line in fig.axes[0].get_lines()]
        drawn["curves"] = {line.get_label(): np.asarray(line.get_ydata()) for line in fig.axes[0].get_lines()}
        return path

    monkeypatch.setattr(figures, "_save", keep)
    dense = [("run", _one_tree(), 8)]
    figures.expert_union_growth(dense, tmp_path / "a.png")
    assert f"mean over layers, {figures.DRAFT_RANKED}" in drawn["labels"]
    assert not any(figures.CALIBRATED_RANKED in label for label in drawn["labels"])
    figures.expert_union_growth(dense, tmp_path / "b.png", {"run": RUNNER_UP_WINS})
    np.testing.assert_array_equal(drawn["curves"][f"mean, {figures.CALIBRATED_RANKED}"], [0.0, 1.0, 2.0, 2.0])
    np.testing.assert_array_equal(drawn["curves"][f"mean over layers, {figures.DRAFT_RANKED}"], [0.0, 1.0, 1.0, 2.0])


def test_report_inputs_find_the_runs_acceptance_map(tmp_path):
    from analysis.inputs import ReportInputError, _read_acceptance

    good = tmp_path / "acceptance.json"
    good.write_text(json.dumps(RUNNER_UP_WINS.to_dict()))
    got = _read_acceptance(good)
    np.testing.assert_array_equal(got.runner_up_knots_y, RUNNER_UP_WINS.runner_up_knots_y)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"knots_x": [0.0, 1.0]}))
    with pytest.raises(ReportInputError, match="bad.json"):
        _read_acceptance(bad)


@pytest.mark.skipif(not (SAMPLE / "acceptance.json").is_file(), reason="shipped sample trace not in this checkout")
def test_collect_attaches_the_shipped_samples_map():
    from analysis.inputs import collect

    data = collect([SAMPLE])
    [(label, _, _)] = data.dense
    assert label in data.dense_acceptance
