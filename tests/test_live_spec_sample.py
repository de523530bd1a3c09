"""The shipped sample dense trace (traces/samples/default): valid, dense, format v2 (level trees), made from
the current embedded weights."""

from __future__ import annotations

from pathlib import Path

import pytest

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "default"


@pytest.fixture(scope="module")
def sample():
    if not (SAMPLE / "manifest.json").is_file():
        pytest.skip("no sample trace in this checkout")
    from traces.reader import open_run

    return open_run(SAMPLE)


def test_sample_is_a_complete_dense_trace(sample):
    assert sample.manifest.complete and sample.manifest.run.mode == "dense"
    assert sample.manifest.model.num_experts == 64 and sample.manifest.draft.max_nodes == 32
    trees = list(sample.iter_trees())
    generated = sum(len(g) for g in sample.requests["generated_token_ids"])
    assert len(trees) == generated  # one tree per committed position
    assert all(t.accepted[0] and t.target_tokens.min() >= 0 for t in trees)
    # format v2: the replay asks the stopping rule on the recorded level trees (no approximation),
    # and next-layer prefetch has the recorded guesses to replay
    assert sample.manifest.format_version == 2 and sample.has_level_trees
    assert all(t.next_layer_expert_ids is not None for t in trees)
    # format v2 (issue 13): 7.7 MB, of which transfers 5.1 MB (per-copy H2D time plus the copy's
    # enqueued/started/landed instants, ~3.6 MB of them), nodes 2.3 MB (the union of the level
    # trees, 35.8 nodes per tree, with last_level and the next-layer guesses); v1 was 2.8 MB
    assert sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file()) < 8.0e6


def test_sample_matches_the_embedded_weights(sample):
    from live.assets import default_model_paths
    from live.spec.session import _weights_sha256

    try:
        target, draft = default_model_paths()
    except FileNotFoundError:
        pytest.skip("embedded default checkpoints not in this checkout")
    recorded = sample.manifest.config.get("weights_sha256", {})
    regenerate = "stale sample: regenerate it with the command in traces/samples/default/README.md"
    assert recorded.get("target") == _weights_sha256(target), regenerate
    assert recorded.get("draft") == _weights_sha256(draft), regenerate
