"""The shipped sample dense trace (traces/samples/default): valid, dense, format v3 (level trees, compact
transfers), made from the current embedded weights."""

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
    # level trees (format v2 on): the replay asks the stopping rule on the recorded level trees (no
    # approximation), and next-layer prefetch has the recorded guesses to replay
    assert sample.manifest.format_version == 3 and sample.has_level_trees
    assert all(t.next_layer_expert_ids is not None for t in trees)
    # format v3: 3.84 MB (v2: 7.72 MB; v1: 2.8 MB, without level trees, next-layer guesses and copy
    # instants): transfers 1.58 MB (a serial batch's later starts, its enqueue instant and each
    # h2d_s = landed - started are rebuilt by the reader: traces/compact.py), nodes 1.89 MB, cycles
    # 0.26 MB (float columns BYTE_STREAM_SPLIT-encoded); every value equal to the v2 recording's
    assert sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file()) < 4.0e6


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
