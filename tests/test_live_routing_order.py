"""Every architecture's routing is captured and recorded in descending router weight.

docs/trace-format.md stores each node's K choices per layer in descending router weight. Some
routers return their top-k unsorted (DeepSeek-V3 selects by bias-corrected group scores), so
both capture points sort (``RouterCapture.take`` for traces, ``OffloadedMoE.last_routing``), and
``traces.inspect --validate`` refuses a trace that is not sorted. Tiny random checkpoints of
every supported architecture (tests/live_fixtures.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from live_fixtures import TINY_ARCHS
from transformers import AutoModelForCausalLM

pytest.importorskip("traces.writer")
from traces.reader import open_run  # noqa: E402

PROMPT = torch.tensor([list(range(3, 43))])  # 40 tokens: enough for DeepSeek's router to mis-order


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tiny_draft):
    """The session's tiny checkpoints (with tokenizers) of every architecture and the draft."""
    return {arch: tiny_checkpoint(arch) for arch in TINY_ARCHS} | {"draft": tiny_draft}


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _raw_router_outputs(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Hook every router; returns the list each call's raw (ids, weights) are appended to."""
    from live.spec.routing import find_routers

    raw = []
    for router in find_routers(model):
        router.register_forward_hook(lambda m, a, out: raw.append((out[2].clone(), out[1].float().clone())))
    return raw


def _assert_same_choices_sorted(ids, weights, raw_ids, raw_weights) -> None:
    """Per token and layer: the (expert, weight) pairs the router returned, in descending weight."""
    k = ids.shape[-1]
    assert np.all(np.diff(weights, axis=-1) <= 0), "choices not in descending router weight"
    for row_ids, row_w, want_ids, want_w in zip(
        ids.reshape(-1, k), weights.reshape(-1, k), raw_ids.reshape(-1, k), raw_weights.reshape(-1, k)
    ):
        got = dict(zip(row_ids.tolist(), row_w.tolist()))
        assert got == pytest.approx(dict(zip(want_ids.tolist(), want_w.tolist())))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_capture_points_sort_by_descending_router_weight(checkpoints, arch):
    from live.offload import make_link, offload_model
    from live.spec.routing import RouterCapture

    model = _load(checkpoints[arch])
    raw = _raw_router_outputs(model)
    cap = RouterCapture(model)
    with torch.inference_mode():
        model(input_ids=PROMPT)
    ids, weights = cap.take()
    cap.close()
    raw_ids = np.stack([r[0].numpy() for r in raw], axis=1)
    raw_w = np.stack([r[1].numpy() for r in raw], axis=1)
    _assert_same_choices_sorted(ids, weights, raw_ids, raw_w)
    if arch == "deepseek_v3":  # the case the sort exists for: the router's own order is not sorted
        assert np.any(np.diff(raw_w, axis=-1) > 0)

    offloaded = _load(checkpoints[arch])
    engine = offload_model(offloaded, cache_experts=4, link=make_link("cpu"))
    with torch.inference_mode():
        offloaded(input_ids=PROMPT)
    off_ids, off_w = engine.last_routing()
    np.testing.assert_array_equal(off_ids, ids)
    np.testing.assert_allclose(off_w, weights, rtol=1e-5, atol=1e-6)


def test_order_by_weight_keeps_ties_in_router_order_and_checks_shapes():
    from live.spec.routing import order_by_weight

    ids = np.array([[[4, 1, 7, 2]]])
    weights = np.array([[[0.125, 0.375, 0.375, 0.125]]], dtype=np.float32)
    got_ids, got_w = order_by_weight(ids, weights)
    assert got_ids.tolist() == [[[1, 7, 4, 2]]] and got_w.tolist() == [[[0.375, 0.375, 0.125, 0.125]]]
    assert got_ids.dtype == ids.dtype and got_w.dtype == weights.dtype
    with pytest.raises(ValueError, match="differ in shape"):
        order_by_weight(ids, weights[..., :3])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_recorded_dense_trace_validates_for_every_architecture(checkpoints, arch, tmp_path, capsys):
    """live.record writes prefill and node routing that passes ``traces.inspect --validate``
    (which checks the descending order), with weights sorted in both tables."""
    from live.record import main
    from traces.inspect import main as inspect_main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(f"w{i}" for i in range(5, 45)) + "\nw7 w8\n")
    out = tmp_path / "run"
    argv = [
        "--model", str(checkpoints[arch]), "--draft", str(checkpoints["draft"]), "--prompts", str(prompts),
        "--max-new-tokens", "3", "--depth", "2", "--topk", "2", "--max-nodes", "4",
        "--cache-experts", "2", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    assert inspect_main([str(out), "--validate"]) == 0
    run = open_run(out)
    top_k = run.manifest.model.top_k
    for table in (run.prefill, run.nodes):
        weights = np.stack(table["router_weights"].map(np.asarray).to_list())
        assert len(weights) > 0
        assert np.all(np.diff(weights.reshape(len(weights), -1, top_k), axis=-1) <= 0)
