"""live.build_width: Qwen3-30B-A3B widths (9,437,184-byte bf16 experts), loadable and offloadable."""

from __future__ import annotations

import pytest
import torch

from live.build_width import build, expert_bytes, main, width_config


def test_full_width_config_has_the_real_expert_size():
    config = width_config(num_layers=3)
    assert expert_bytes(config) == 9_437_184
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok) == (2048, 128, 8)
    assert config.num_hidden_layers == 3 and config.vocab_size == 2048  # the embedded tokenizer's
    with pytest.raises(ValueError, match="--layers"):
        width_config(num_layers=0)


def test_built_checkpoint_loads_offloads_and_moves_real_sized_experts(tmp_path):
    """Full width, 4 experts instead of 128 (a test-sized file): one forward through the
    offloaded engine copies 9,437,184-byte experts."""
    from live.loader import load_target
    from live.offload import offload_model

    out = build(tmp_path / "w", num_layers=1, num_experts=4)
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    model = load_target(out, dtype="bfloat16")
    engine = offload_model(model, cache_experts=1)
    assert engine.bytes_per_expert == 9_437_184
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits.float()).all() and engine.last_stats.h2d_bytes % 9_437_184 == 0


def test_cli_refuses_a_non_empty_out(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
