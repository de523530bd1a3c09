"""``--verify-logits float32``: the target's last projection in float32 in a bfloat16 run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from live.spec.runner import CachedLM

PROMPT = [5, 9, 33, 12, 40, 7]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tiny_draft):
    """The session's tiny target and draft (with tokenizers)."""
    return {"target": tiny_checkpoint("qwen3_moe"), "draft": tiny_draft}


def _bf16(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def test_float32_logits_are_the_unrounded_projection_of_the_bf16_hidden_state(checkpoints):
    model = _bf16(checkpoints["target"])
    with torch.inference_mode():
        hidden = model.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0]  # bfloat16
    weight = model.get_output_embeddings().weight
    plain = CachedLM(model).feed_causal(PROMPT)
    assert torch.equal(plain, plain.bfloat16().float())  # model logits: bfloat16 values (ties likely)
    exact = CachedLM(model, float32_logits=True).feed_causal(PROMPT)
    want = hidden.float() @ weight.float().T
    torch.testing.assert_close(exact, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(exact, exact.bfloat16().float())  # finer than bfloat16's grid
    torch.testing.assert_close(exact, plain, rtol=2e-2, atol=2e-2)  # the same logits up to rounding


def test_float32_logits_leave_a_float32_model_alone(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints["target"], dtype=torch.float32).eval()
    head_forward = model.get_output_embeddings().forward
    CachedLM(model, float32_logits=True)
    assert model.get_output_embeddings().forward == head_forward


def test_record_verify_logits_flag_is_used_and_recorded(checkpoints, tmp_path, capsys):
    from live.record import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w9 w33 w12\n")
    out = tmp_path / "run"
    argv = [
        "--model", str(checkpoints["target"]), "--draft", str(checkpoints["draft"]), "--prompts", str(prompts),
        "--max-new-tokens", "4", "--depth", "2", "--topk", "2", "--max-nodes", "4", "--dtype", "bfloat16",
        "--verify-logits", "float32", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert json.loads((out / "summary.json").read_text())["config"]["verify_logits"] == "float32"
    with pytest.raises(SystemExit) as err:
        main([*argv[:-3], "--verify-logits", "float64", "--out", str(tmp_path / "bad")])
    assert err.value.code == 2 and "--verify-logits" in capsys.readouterr().err
