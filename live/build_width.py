"""Build a random-weight target at a real model's width: ``python -m live.build_width``.

The embedded default's experts are tiny (hidden 128), so its copies and per-expert compute are far
from a real model's. This writes a Qwen3-MoE checkpoint with Qwen3-30B-A3B's widths (hidden 2048,
128 experts of ``3 * 2048 * 768`` bf16 parameters = 9,437,184 bytes each, top-8 routing, 32 query /
4 key-value heads of 128; values from the model's public ``config.json``) but only ``--layers``
decoder layers and the embedded default's tokenizer and vocabulary (2,048 tokens, so the embedded
draft can draft for it), with random weights (seeded). It is made at run time under ``runs/`` and
never committed: two layers take ~2.5 GB. Use it with ``live.record --model <out> --draft
live/assets/default/draft --dtype bfloat16`` (the embedded draft, same vocabulary) and
``analysis.validate`` with the same flags.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from specfit.cli import cli_main, run_main

QWEN3_30B_A3B_WIDTH = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
"""Qwen3-30B-A3B's widths (Hugging Face ``Qwen/Qwen3-30B-A3B`` ``config.json``)."""


def width_config(num_layers: int = 2, num_experts: int | None = None):
    """The ``Qwen3MoeConfig`` of the width checkpoint (``num_experts`` overrides 128, for tests).

    Raises ``ValueError`` naming ``--layers`` / ``--experts`` when < 1."""
    import json

    from transformers import Qwen3MoeConfig

    if num_layers < 1:
        raise ValueError(f"--layers: expected >= 1, got {num_layers}")
    if num_experts is not None and num_experts < 1:
        raise ValueError(f"--experts: expected >= 1, got {num_experts}")
    default = json.loads((_default_target() / "config.json").read_text())
    values = dict(QWEN3_30B_A3B_WIDTH, num_hidden_layers=int(num_layers), vocab_size=default["vocab_size"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        values[key] = default.get(key)
    if num_experts is not None:
        values["num_experts"] = int(num_experts)
        values["num_experts_per_tok"] = min(values["num_experts_per_tok"], int(num_experts))
    return Qwen3MoeConfig(**values)


def expert_bytes(config, bytes_per_param: int = 2) -> int:
    """Bytes of one routed expert (gate, up and down matrices) at ``bytes_per_param`` (bf16: 2)."""
    return 3 * config.hidden_size * config.moe_intermediate_size * bytes_per_param


def _default_target() -> Path:
    return Path(__file__).resolve().parent / "assets" / "default" / "target"


def build(out: str | Path, num_layers: int = 2, seed: int = 0, num_experts: int | None = None) -> Path:
    """Write the checkpoint (safetensors, bf16, seeded normal(0, 0.02) weights, the embedded
    default's tokenizer) to ``out`` and return it. Raises ``ValueError`` for a non-empty ``out``."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out: {out} is not empty")
    config = width_config(num_layers, num_experts)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(_default_target() / name, out / name)
    return out


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``--out DIR`` (default ``runs/qwen3-30b-a3b-width-L<layers>``), ``--layers``, ``--seed``."""
    import json

    from specfit.cli import ArgumentParser, positive_int

    p = ArgumentParser(prog="python -m live.build_width", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=2, help="decoder (MoE) layers (count)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--out", default=None, help="output folder (must be empty or absent)")
    args = p.parse_args(argv)
    out = Path(args.out or f"runs/qwen3-30b-a3b-width-L{args.layers}")
    if out.exists() and any(out.iterdir()):
        p.fail("--out", f"{out} is not empty")
    path = build(out, args.layers, args.seed)
    config = width_config(args.layers)
    print(
        json.dumps(
            {"ok": True, "out": str(path), "expert_bytes": expert_bytes(config), "num_layers": args.layers}
        )
    )
    return 0


if __name__ == "__main__":
    run_main(main)
