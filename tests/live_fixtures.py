"""Tiny random Hugging Face checkpoints for the live engine's tests (no download).

``make_tiny_checkpoint(tmp_path, arch)`` writes a randomly initialised MoE checkpoint of one
supported architecture (config.json + model.safetensors, written by transformers'
``save_pretrained``) and returns its directory; ``make_tiny_draft(tmp_path)`` writes a tiny dense
Qwen3 model with the same vocabulary (``TINY_VOCAB_SIZE``), usable as a draft. Shapes are small
enough that a forward pass takes milliseconds on a CPU, yet every MoE layer has enough experts
(16, top-4) for caches to hit, miss and evict.

Shared by the offloaded-runtime tests and the speculative-decoding tests; import it as
``from live_fixtures import make_tiny_checkpoint`` (pytest puts tests/ on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_VOCAB_SIZE = 96
TINY_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3")

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "num_experts_per_tok": 4,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

_PER_ARCH: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 16, "moe_intermediate_size": 16, "intermediate_size": 48, "head_dim": 8},
    "qwen2_moe": {
        "num_experts": 16,
        "moe_intermediate_size": 16,
        "intermediate_size": 48,
        "shared_expert_intermediate_size": 24,
    },
    "mixtral": {"num_local_experts": 8, "intermediate_size": 16, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 16, "intermediate_size": 16},
    "deepseek_v3": {
        "n_routed_experts": 16,
        "moe_intermediate_size": 16,
        "intermediate_size": 48,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "kv_lora_rank": 8,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
        "num_key_value_heads": 4,
        "routed_scaling_factor": 2.5,
    },
}


def tiny_config(arch: str, **overrides: Any):
    """The transformers config of a tiny ``arch`` MoE model (see ``TINY_ARCHS``)."""
    from transformers import AutoConfig

    if arch not in _PER_ARCH:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {', '.join(TINY_ARCHS)}")
    kwargs = {**_COMMON, **_PER_ARCH[arch], **overrides}
    return AutoConfig.for_model(arch, **kwargs)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter and the DeepSeek correction bias visible random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))


def make_tiny_checkpoint(tmp_path: Path, arch: str = "qwen3_moe", *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random ``arch`` MoE checkpoint (safetensors) under ``tmp_path``; return its directory.

    ``overrides`` replace config fields (e.g. ``num_experts=64``). Same seed -> same weights.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    out = Path(tmp_path) / f"tiny-{arch}-{seed}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_draft(tmp_path: Path, *, seed: int = 1, vocab_size: int = TINY_VOCAB_SIZE) -> Path:
    """Write a tiny dense Qwen3 draft model sharing the tiny vocabulary; return its directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    out = Path(tmp_path) / f"tiny-draft-{seed}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_tiny_tokenizer(folder: Path) -> None:
    """Write a word-level tokenizer over the tiny vocabulary ('w4'..'w95') into ``folder``, so the
    CLIs can tokenize text prompts for a tiny checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, TINY_VOCAB_SIZE)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)


class FakeLRUCache:
    """Minimal LRU expert cache following the ``specfit.cache.ExpertCache`` contract.

    Used by the live tests only while ``specfit.cache`` is not importable; the contract is in
    docs/contracts.md (ascending processing of the deduplicated ids, misses beyond capacity are
    transient, an expert of the current access is never evicted).
    """

    def __init__(self, num_layers: int, num_experts: int, capacity_per_layer: int) -> None:
        from collections import OrderedDict

        self.num_layers = num_layers
        self.num_experts = num_experts
        self.capacity_per_layer = capacity_per_layer
        self._layers = [OrderedDict() for _ in range(num_layers)]

    def access(self, layer: int, expert_ids):
        from types import SimpleNamespace

        import numpy as np

        ids = sorted({int(e) for e in np.asarray(expert_ids).ravel() if e >= 0})
        current = set(ids)
        lru = self._layers[layer]
        hits, misses, evicted = [], [], []
        for e in ids:
            if e in lru:
                hits.append(e)
                lru.move_to_end(e)
                continue
            misses.append(e)
            if len(lru) < self.capacity_per_layer:
                lru[e] = True
                continue
            victim = next((v for v in lru if v not in current), None)
            if victim is not None:
                del lru[victim]
                evicted.append(victim)
                lru[e] = True
        as_arr = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        return SimpleNamespace(hits=as_arr(hits), misses=as_arr(misses), evicted=as_arr(evicted))

    def contains(self, layer: int, expert: int) -> bool:
        return int(expert) in self._layers[layer]

    def warm(self, layer: int, expert_ids) -> None:
        for e in expert_ids:
            if len(self._layers[layer]) < self.capacity_per_layer:
                self._layers[layer][int(e)] = True

    def cached_bits(self):
        import numpy as np

        words = (self.num_experts + 63) // 64
        bits = np.zeros((self.num_layers, words), dtype=np.uint64)
        for layer, lru in enumerate(self._layers):
            for e in lru:
                bits[layer, e // 64] |= np.uint64(1) << np.uint64(e % 64)
        return bits

    def copy(self) -> FakeLRUCache:
        import copy

        return copy.deepcopy(self)


def make_cache(policy: str, num_layers: int, num_experts: int, capacity_per_layer: int, **kwargs: Any):
    """``specfit.cache.make_expert_cache`` when available, else :class:`FakeLRUCache` (lru only)."""
    try:
        from specfit.cache import make_expert_cache
    except ImportError:
        if policy != "lru":
            import pytest

            pytest.skip("specfit.cache not available yet")
        return FakeLRUCache(num_layers, num_experts, capacity_per_layer)
    return make_expert_cache(policy, num_layers, num_experts, capacity_per_layer, **kwargs)


def make_tiny_eagle3_head(
    tmp_path: Path,
    target_dir: Path,
    *,
    seed: int = 2,
    train_on: list[list[int]] | None = None,
    train_steps: int = 60,
    **head_kwargs: Any,
) -> Path:
    """Write a tiny EAGLE-3 head for the target at ``target_dir`` in the trainers' on-disk layout.

    ``train_on``: token sequences to fit the head to (the target's own hidden states,
    ``live.eagle3_train``), so drafts get accepted and tests exercise accepted paths; ``None``
    keeps the random weights. ``head_kwargs`` go to :func:`live.eagle3.random_head` (e.g.
    ``draft_vocab_size=64``, ``own_embedding=False``, ``hidden_size=48``).
    """
    from transformers import AutoModelForCausalLM

    from live.eagle3 import random_head, save_head
    from live.eagle3_train import collect_features, train_head

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = random_head(target.config, seed=seed, **head_kwargs)
    if head.embed_tokens.weight.shape == target.get_input_embeddings().weight.shape:
        with torch.no_grad():
            head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    if train_on:
        data = collect_features(target, train_on, head.config.layer_ids)
        train_head(head, lambda step: [data[step % len(data)]], steps=train_steps, lr=1e-2, seed=seed)
    out = Path(tmp_path) / f"tiny-eagle3-{Path(target_dir).name}-{seed}"
    return save_head(head, out)


def replay_test_cost(model: Any, **changes: Any):
    """A ``specfit.cost.CycleCostModel`` for live-versus-replay tests of the trace model ``model``
    (``traces.schema.ModelSpec``): 1 ms per draft level, 1 ms + 0.1 ms per node to verify, 1 GB/s
    and 20 us per expert copy; ``changes`` replace fields."""
    from specfit.cost import CycleCostModel

    fields = dict(
        draft_s_per_level=1e-3, verify_base_s=1e-3, verify_s_per_node=1e-4, verify_s_per_context_token=0.0,
        h2d_bytes_per_s=1e9, h2d_s_per_transfer=2e-5, expert_bytes=model.bytes_per_expert,
        num_layers=model.num_layers, source="test",
    )  # fmt: skip
    return CycleCostModel(**{**fields, **changes})
