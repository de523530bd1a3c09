"""`python -m analysis.report` renders every figure from a small dense run, policy run, sweep and calibration."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import figures, metrics
from analysis import report as report_cli
from calibration import fit as fit_cli
from calibration.synthetic import write_synthetic_cycles_run
from specfit.cost import CycleCostModel
from specfit.shapes import ModelShape
from traces.reader import open_run
from traces.synthetic import generate_dense_trace

SHAPE = ModelShape(
    name="tiny-moe",
    num_layers=4,
    num_experts=16,
    top_k=2,
    hidden_size=64,
    expert_intermediate_size=32,
    bytes_per_expert=2_000_000,
)
COST = CycleCostModel(
    draft_s_per_level=2e-3,
    verify_base_s=8e-3,
    verify_s_per_node=0.3e-3,
    verify_s_per_context_token=2e-6,
    h2d_bytes_per_s=5e9,
    h2d_s_per_transfer=40e-6,
    expert_bytes=SHAPE.bytes_per_expert,
    num_layers=SHAPE.num_layers,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from sim import sweep

    root = tmp_path_factory.mktemp("report-inputs")
    dense = generate_dense_trace(
        root / "dense",
        SHAPE,
        num_requests=2,
        positions_per_request=30,
        prompt_len=8,
        tree_depth=4,
        tree_topk=3,
        max_nodes=16,
        vocab_size=50,
        seed=1,
    )
    policy = write_synthetic_cycles_run(root / "policy", SHAPE, COST, num_cycles=40, noise_rel=0.02, seed=2)
    argv = [
        "--trace",
        str(dense),
        "--bandwidth",
        "2,16",
        "--cache",
        "0.25,0.5",
        "--policy",
        "ar,topn,specfit",
        "--jobs",
        "1",
        "--expert-bytes",
        str(SHAPE.bytes_per_expert),
        "--out",
        str(root / "sweep"),
    ]
    assert sweep.main(argv) == 0
    assert fit_cli.main([str(policy), str(dense), "--out", str(root / "calib" / "cost.json")]) == 0
    return {"dense": dense, "policy": policy, "sweep": root / "sweep", "calib": root / "calib"}


def test_report_renders_every_figure(inputs, tmp_path, capsys) -> None:
    capsys.readouterr()
    out = tmp_path / "report"
    rc = report_cli.main([*(str(p) for p in inputs.values()), "--out", str(out)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and summary["ok"]
    assert summary["figures"] == list(figures.FIGURES) and summary["missing_figures"] == []
    for name in figures.FIGURES:
        png = out / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
    text = (out / "report.md").read_text()
    assert "2.67" in text and "conditional" in text  # conventions stated
    assert text.count("![") == len(figures.FIGURES)
    assert "| policy | 40 |" in text  # the recorded run's summary row
    assert "## Cost-model fit" in text and "| calib | cycle | heldout |" in text


def test_regime_map_flags_full_tree_slower_than_ar() -> None:
    tp = pd.DataFrame(
        {
            "label": "x",
            "source": "sim",
            "bandwidth_gb_per_s": [2, 2, 2, 32, 32, 32],
            "cache_experts_per_layer": 4,
            "policy": ["ar", "topn", "specfit"] * 2,
            "tokens_per_s": [100.0, 60.0, 101.0, 100.0, 150.0, 160.0],
        }
    )
    slow = figures.slower_than_ar(tp)
    assert slow["bandwidth_gb_per_s"].tolist() == [2]
    assert slow["specfit_tokens_per_s"].tolist() == [101.0]


def test_dense_depth_acceptance_matches_per_tree_count(inputs) -> None:
    run = open_run(inputs["dense"])
    trees = list(run.iter_trees())
    accepted = [t.num_accepted for t in trees]
    # reached: one past the accepted length when the accepted path's last node has a child
    reached = []
    for t in trees:
        ok = t.path_accepted
        last = int(np.flatnonzero(ok)[np.argmax(t.tree.depths[ok])])
        reached.append(t.num_accepted + int(np.any(t.tree.parents == last)))
    expected = metrics.per_depth_acceptance(accepted, reached)
    got = figures.dense_depth_acceptance(run.node_arrays())
    np.testing.assert_allclose(got, expected)
    assert 0.0 < expected[0] < 1.0
    # one definition: traces.inspect's summary reports the same figures
    from traces.stats import summarize

    np.testing.assert_allclose(summarize(run)["depth_acceptance"], got)


def test_report_errors(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        report_cli.main([str(tmp_path / "missing")])
    assert exc.value.code == 2 and "missing" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report_cli.main([str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 1
    assert "no manifest.json" in capsys.readouterr().err
