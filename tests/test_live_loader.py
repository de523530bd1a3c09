"""live.loader: local safetensors checkpoints, supported architectures, clear refusals."""

from __future__ import annotations

import json

import pytest
import torch
from live_fixtures import TINY_ARCHS, TINY_VOCAB_SIZE

from live.loader import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedArchitectureError,
    describe_moe,
    find_moe_blocks,
    load_draft,
    load_target,
    read_checkpoint_config,
    resolve_dtype,
)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_load_target_keeps_experts_on_host_and_describes_shape(tiny_checkpoint, arch):
    model = load_target(tiny_checkpoint(arch), "cpu", "float32")
    spec = describe_moe(model)
    expected_layers = {"deepseek_v3": (1, 2)}.get(arch, (0, 1))  # DeepSeek: first layer dense
    assert spec.arch == arch
    assert spec.moe_layer_indices == expected_layers
    assert spec.num_layers == 2
    assert spec.num_experts == (8 if arch == "mixtral" else 16)
    assert spec.top_k == (2 if arch == "mixtral" else 4)
    assert spec.hidden_size == 32 and spec.expert_intermediate_size == 16
    assert spec.bytes_per_expert == 3 * 32 * 16 * 4  # gate, up, down; float32
    assert spec.vocab_size == TINY_VOCAB_SIZE
    assert len(find_moe_blocks(model)) == 2
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())


def test_dtype_is_applied(tiny_checkpoint):
    model = load_target(tiny_checkpoint("qwen3_moe"), "cpu", "bfloat16")
    assert describe_moe(model).dtype == "bfloat16"
    assert describe_moe(model).bytes_per_expert == 3 * 32 * 16 * 2
    assert next(model.parameters()).dtype == torch.bfloat16


def test_bad_device_is_named(tiny_checkpoint):
    from live.loader import check_device

    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda"):
        check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_target(tiny_checkpoint("qwen3_moe"), "cuda")


def test_resolve_dtype_rejects_unknown():
    assert resolve_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="dtype: expected one of float32, bfloat16, float16"):
        resolve_dtype("int8")


def test_unsupported_architecture_lists_supported(tiny_draft):
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_target(tiny_draft)
    message = str(err.value)
    assert "'qwen3'" in message
    for model_type in SUPPORTED_ARCHITECTURES:
        assert model_type in message


def test_pickle_only_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_target(tmp_path)


def test_remote_code_is_refused(tmp_path, tiny_checkpoint):
    src = tiny_checkpoint("qwen3_moe")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="auto_map.*remote code"):
        load_target(tmp_path)


def test_missing_paths_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        read_checkpoint_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_checkpoint_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_checkpoint_config(tmp_path)


def test_load_draft_shares_vocab(tiny_draft):
    draft = load_draft(tiny_draft, "cpu", "float32")
    assert draft.config.vocab_size == TINY_VOCAB_SIZE
    logits = draft(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape == (1, 3, TINY_VOCAB_SIZE)
