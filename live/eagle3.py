"""EAGLE-3 draft heads: the on-disk layout, a loader, a saver, and the checks against a target.

Layout (checked against the public trainers: SafeAILab/EAGLE ``eagle/model/cnets.py`` (the
EAGLE-3 ``Model`` with ``midlayer = LlamaDecoderLayeremb``) and sgl-project/SpecForge
``specforge/modeling/draft/llama3_eagle.py``; both save ``config.json`` + ``model.safetensors``):

``config.json`` is a Llama config (``architectures: ["LlamaForCausalLMEagle3"]``, ``hidden_size``
H, ``num_attention_heads``, ``num_key_value_heads``, optional ``head_dim``, ``intermediate_size``,
``rms_norm_eps``, ``rope_theta``/``rope_scaling``, ``vocab_size`` V = the target's vocabulary)
plus ``draft_vocab_size`` Vd and optional ``target_hidden_size`` Ht (default H). Optional
``eagle_aux_hidden_state_layer_ids`` (vLLM/SpecForge key, top level or inside ``eagle_config``)
pins the tapped target layers; otherwise the reference taps the INPUTS of target decoder layers
``2, L // 2, L - 3`` (EAGLE's ``modeling_*_kv.py``: ``if idx == len(self.layers) - 3 or idx ==
len(self.layers) // 2 or idx == 2: all_hidden_states += (hidden_states,)`` before the layer runs),
concatenated in that order. Layer id ``j`` means "the input of decoder layer j" (id L = the last
layer's output before the final norm, as in vLLM's convention). For targets with fewer than 6
layers (the tiny test models) the default ids are clamped into ``[0, L - 1]``.

Weights (safetensors names): ``fc.weight`` [H, 3 Ht] (fuses the three tapped states);
``midlayer.hidden_norm.weight`` [H], ``midlayer.input_layernorm.weight`` [H],
``midlayer.self_attn.{q,k,v}_proj.weight`` [heads * head_dim, 2H] (attention input is
``cat(input_layernorm(token embedding), hidden_norm(fused feature))``, width 2H),
``midlayer.self_attn.o_proj.weight`` [H, heads * head_dim], ``midlayer.post_attention_layernorm``,
``midlayer.mlp.{gate,up,down}_proj.weight`` (Llama MLP); ``norm.weight`` [H];
``lm_head.weight`` [Vd, H]; ``d2t`` int64[Vd] (draft id -> target id OFFSET:
``target_id = draft_id + d2t[draft_id]``); ``t2d`` bool[V] (target ids in the draft vocabulary);
optional ``embed_tokens.weight`` [V, H] (the target's token embedding is used when absent).
The residual of the mid layer is the fused feature (un-normed), as in the reference.

Nothing is unpickled and no remote code runs: config.json is read as JSON, weights with
``safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_NAME = "model.safetensors"


def read_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory as a dict.

    Raises:
        FileNotFoundError: no directory or no config.json; ValueError: not a JSON object.
    """
    root = Path(path)
    file = root / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{root}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data


def is_eagle3_config(config: dict[str, Any]) -> bool:
    """True for an EAGLE-3 head config: ``draft_vocab_size`` or an ``*Eagle3*`` architecture."""
    archs = config.get("architectures") or []
    return "draft_vocab_size" in config or any("eagle3" in str(a).lower() for a in archs)


def is_eagle3_checkpoint(path: str | Path) -> bool:
    """True when ``path/config.json`` describes an EAGLE-3 head (False when unreadable)."""
    try:
        return is_eagle3_config(read_config(path))
    except (FileNotFoundError, ValueError):
        return False


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Tapped target layers of the reference, ``(2, L // 2, L - 3)``, clamped into ``[0, L - 1]``."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@dataclass(frozen=True)
class HeadConfig:
    """The EAGLE-3 head's shape (from config.json).

    Attributes:
        hidden_size: H; target_hidden_size: Ht (width of each tapped target state).
        vocab_size: V (target vocabulary as the head knows it); draft_vocab_size: Vd.
        layer_ids: pinned tapped layer ids, or None for the reference default.
        raw: the whole config.json dict (builds the Llama config of the mid layer).
    """

    hidden_size: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    layer_ids: tuple[int, ...] | None
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> HeadConfig:
        """Parse; raises ValueError naming the missing/bad key."""
        for key in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
        ):
            if not isinstance(data.get(key), int) or data[key] < 1:
                raise ValueError(f"{where}: key {key!r} must be a positive integer, got {data.get(key)!r}")
        hidden = int(data["hidden_size"])
        eagle = data.get("eagle_config") if isinstance(data.get("eagle_config"), dict) else {}
        ids = data.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None and (
            not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids)
        ):
            raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be 3 integers, got {ids!r}")
        return cls(
            hidden_size=hidden,
            target_hidden_size=int(data.get("target_hidden_size") or hidden),
            vocab_size=int(data["vocab_size"]),
            draft_vocab_size=int(data.get("draft_vocab_size") or data["vocab_size"]),
            layer_ids=None if ids is None else tuple(ids),
            raw=dict(data),
        )

    def llama_config(self):
        """transformers ``LlamaConfig`` of the mid layer (rotary embedding, MLP, norms)."""
        from transformers import LlamaConfig

        keep = {k: v for k, v in self.raw.items() if k not in ("architectures", "auto_map", "model_type")}
        return LlamaConfig(**keep)


class _MidAttention(nn.Module):
    """Self-attention over ``cat(embedding, feature)`` (width 2H), Llama RoPE, grouped KV heads."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, past, mask):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim).transpose(0, 1)[None]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)[None]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)[None]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        rep = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(t, -1)), (k, v)


class _MidLayer(nn.Module):
    def __init__(self, config) -> None:
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        super().__init__()
        eps = config.rms_norm_eps
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.self_attn = _MidAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (module names = checkpoint names, see the module docstring).

    Args:
        config: the head's :class:`HeadConfig`.
        embed_tokens: token embedding to use when the checkpoint has none (the target's), or None
            to create one (filled by ``load_state_dict``).
    """

    def __init__(self, config: HeadConfig, embed_tokens: nn.Embedding | None = None) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        self.config = config
        llama = config.llama_config()
        self.hidden_size = config.hidden_size
        self.own_embedding = embed_tokens is None
        self.embed_tokens = embed_tokens or nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = _MidLayer(llama)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=llama.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(llama)

    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        fused: bool,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One pass of the mid layer over ``T`` inputs after ``past`` cached ones.

        Args:
            hidden: [T, 3 Ht] tapped target states (``fused=True``, projected by ``fc``) or [T, H]
                the head's own outputs for its parents (``fused=False``).
            token_ids: int64[T] token of each input (target ids); position_ids: int64[T].
            past: (keys, values) [1, kv_heads, P, head_dim] or None; mask: additive float
                [1, 1, T, P + T] or None (full visibility).

        Returns:
            (out [T, H] pre-norm hidden states, the new (keys, values) including ``past``).
        """
        h = self.fc(hidden) if fused else hidden
        emb = self.embed_tokens(token_ids).to(h.dtype)
        mid = self.midlayer
        x = torch.cat([mid.input_layernorm(emb), mid.hidden_norm(h)], dim=-1)
        cos, sin = self.rotary(x, position_ids[None])
        attn, kv = mid.self_attn(x, cos, sin, past, mask)
        h = h + attn
        h = h + mid.mlp(mid.post_attention_layernorm(h))
        return h, kv

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, Vd] from outputs [T, H] (``lm_head(norm(out))``)."""
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids (``draft_id + d2t[draft_id]``): int64 tensor, same shape,
        on the head's device (no host copy of ``d2t``; ``draft_ids`` on that device)."""
        return draft_ids + self.d2t[draft_ids]


def head_state_dict(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """Tensors as saved on disk (``embed_tokens.weight`` only when the head owns it; no rotary buffers)."""
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    if not head.own_embedding:
        state.pop("embed_tokens.weight", None)
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def save_head(head: Eagle3Head, path: str | Path, extra_config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the trainers' layout; returns the directory.

    The config keys are sorted and the tensors saved by ``safetensors`` (deterministic bytes for
    identical weights).
    """
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = dict(head.config.raw)
    config.update(
        {
            "architectures": [EAGLE3_ARCHITECTURE],
            "draft_vocab_size": head.config.draft_vocab_size,
            "target_hidden_size": head.config.target_hidden_size,
            **(extra_config or {}),
        }
    )
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(head_state_dict(head), str(root / WEIGHTS_NAME), metadata={"format": "pt"})
    return root


def random_head(
    target_config,
    *,
    hidden_size: int | None = None,
    draft_vocab_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    seed: int = 0,
    own_embedding: bool = True,
    layer_ids: tuple[int, int, int] | None = None,
) -> Eagle3Head:
    """A randomly initialised head for ``target_config`` (a transformers config), for tests and training.

    With ``draft_vocab_size`` Vd < V the draft vocabulary is the even target ids then the odd
    ones (first Vd, sorted), so ``d2t`` is a non-trivial offset table. ``own_embedding=False``
    saves no ``embed_tokens.weight`` (the loader then takes the target's).
    """
    hidden = hidden_size or target_config.hidden_size
    vocab = target_config.vocab_size
    vd = draft_vocab_size or vocab
    raw = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or 2 * hidden,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden // num_attention_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": float(getattr(target_config, "rope_theta", None) or 10000.0),
        "max_position_embeddings": int(getattr(target_config, "max_position_embeddings", 2048)),
        "hidden_act": "silu",
        "vocab_size": vocab,
        "draft_vocab_size": vd,
        "target_hidden_size": target_config.hidden_size,
        "tie_word_embeddings": False,
    }
    if layer_ids is not None:
        raw["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    config = HeadConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / max(param.shape[-1], 1) ** 0.5)
        # a non-trivial mapping when Vd < V: the even ids, then the odd ones, first Vd of them
        used = sorted((list(range(0, vocab, 2)) + list(range(1, vocab, 2)))[:vd])
        head.d2t.copy_(torch.tensor([t - i for i, t in enumerate(used)], dtype=torch.int64))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
        head.t2d.copy_(t2d)
    head.own_embedding = own_embedding
    return head.eval()


class HeadMismatchError(ValueError):
    """The head cannot draft for this target (hidden size, vocabulary mapping, tapped layers, tokenizer)."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.model.layers``).

    Raises:
        ValueError: when the model has none there.
    """
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.model.layers")
    return layers


def _target_embedding(target) -> nn.Embedding:
    return target.get_input_embeddings()


def check_head_fits(config: HeadConfig, target_config, num_target_layers: int, where: str) -> None:
    """Refuse a head that cannot draft for the target; each error names both values.

    Raises:
        HeadMismatchError: ``target_hidden_size`` differs from the target's hidden size; the
            head's ``vocab_size`` differs from the target's; tapped layer ids outside ``[0, L]``.
    """
    target_hidden = int(target_config.hidden_size)
    if config.target_hidden_size != target_hidden:
        raise HeadMismatchError(
            f"{where}: EAGLE-3 head expects target hidden size {config.target_hidden_size} "
            f"(target_hidden_size/hidden_size) but the target's hidden_size is {target_hidden}"
        )
    target_vocab = int(target_config.vocab_size)
    if config.vocab_size != target_vocab:
        raise HeadMismatchError(
            f"{where}: EAGLE-3 head vocab_size is {config.vocab_size} but the target's vocab_size is {target_vocab}"
        )
    if config.draft_vocab_size > target_vocab:
        raise HeadMismatchError(
            f"{where}: EAGLE-3 head draft_vocab_size {config.draft_vocab_size} exceeds the target's "
            f"vocab_size {target_vocab}"
        )
    if config.layer_ids is not None and not all(0 <= i <= num_target_layers for i in config.layer_ids):
        raise HeadMismatchError(
            f"{where}: eagle_aux_hidden_state_layer_ids {list(config.layer_ids)} must lie in "
            f"[0, {num_target_layers}] (the target has {num_target_layers} decoder layers)"
        )


def check_head_config(path: str | Path, target_config: dict[str, Any], where: str = "--draft") -> None:
    """:func:`check_head_fits` from config.json files only (before any model loads).

    Args:
        path: the head's directory; target_config: the target's config.json dict.
    Raises:
        HeadMismatchError, ValueError: as :func:`check_head_fits` / :meth:`HeadConfig.from_dict`.
    """
    from types import SimpleNamespace

    config = HeadConfig.from_dict(read_config(path), where=f"{where}/config.json")
    text = target_config.get("text_config") if isinstance(target_config.get("text_config"), dict) else {}
    merged = {**text, **target_config}
    if not all(isinstance(merged.get(k), int) for k in ("hidden_size", "vocab_size", "num_hidden_layers")):
        return  # the target's own checks report an unreadable config
    target = SimpleNamespace(hidden_size=merged["hidden_size"], vocab_size=merged["vocab_size"])
    check_head_fits(config, target, merged["num_hidden_layers"], where)


def check_vocab_mapping(head: Eagle3Head, target_vocab: int, where: str) -> None:
    """``d2t``/``t2d`` must map every draft id into ``[0, target_vocab)`` and agree with each other.

    Raises:
        HeadMismatchError: naming the first draft id mapped outside the target vocabulary, or a
            ``t2d`` of the wrong length / count.
    """
    d2t = head.d2t.cpu().numpy()
    if d2t.shape != (head.config.draft_vocab_size,):
        raise HeadMismatchError(
            f"{where}: d2t has shape {list(d2t.shape)}, expected [{head.config.draft_vocab_size}] (draft_vocab_size)"
        )
    mapped = np.arange(d2t.shape[0]) + d2t
    bad = np.flatnonzero((mapped < 0) | (mapped >= target_vocab))
    if bad.size:
        i = int(bad[0])
        raise HeadMismatchError(
            f"{where}: d2t maps draft id {i} to target id {int(mapped[i])}, outside the target "
            f"vocabulary [0, {target_vocab}) ({bad.size} draft ids out of range)"
        )
    t2d = head.t2d.cpu().numpy()
    if t2d.shape != (target_vocab,):
        raise HeadMismatchError(
            f"{where}: t2d has {t2d.shape[0]} entries but the target's vocab_size is {target_vocab}"
        )


def _vocab_of(folder: Path) -> dict[str, int] | None:
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)


def check_tokenizer(head_dir: str | Path, target_dir: str | Path, where: str) -> None:
    """When both directories ship ``tokenizer.json``, their vocabularies must be identical.

    Raises:
        HeadMismatchError: naming the sizes and the first differing token.
    """
    head_vocab, target_vocab = _vocab_of(Path(head_dir)), _vocab_of(Path(target_dir))
    if head_vocab is None or target_vocab is None or head_vocab == target_vocab:
        return
    diff = sorted(set(head_vocab.items()) ^ set(target_vocab.items()))
    raise HeadMismatchError(
        f"{where}: the head's tokenizer ({len(head_vocab)} tokens) differs from the target's "
        f"({len(target_vocab)} tokens), e.g. {diff[0][0]!r}"
    )


def load_head(
    path: str | Path,
    target,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    target_dir: str | Path | None = None,
    where: str = "--draft",
) -> Eagle3Head:
    """Load an EAGLE-3 head saved by the EAGLE/SpecForge trainers, checked against ``target``.

    Args:
        path: directory with config.json and model.safetensors (or several ``*.safetensors``).
        target: the loaded transformers target model (its config, layer count and embedding).
        device, dtype: where and in which dtype the head runs.
        target_dir: the target checkpoint directory (tokenizer comparison), optional.
        where: the flag named in errors.

    Returns:
        The head in eval mode; its ``embed_tokens`` is the target's when the checkpoint has none.
    Raises:
        FileNotFoundError: no config.json or no safetensors weights.
        ValueError: pickle weights, bad config keys, missing/misshapen tensors.
        HeadMismatchError: see :func:`check_head_fits`, :func:`check_vocab_mapping`, :func:`check_tokenizer`.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    config = HeadConfig.from_dict(read_config(root), where=f"{where} {root}/config.json")
    num_layers = len(decoder_layers(target))
    check_head_fits(config, target.config, num_layers, f"{where} {root}")
    if target_dir is not None:
        check_tokenizer(root, target_dir, f"{where} {root}")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        hint = (
            f" (found {pickles}; pickle checkpoints are not loaded: convert to safetensors)"
            if pickles
            else ""
        )
        raise FileNotFoundError(f"{where} {root}: no *.safetensors weights{hint}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{where} {file}: unreadable safetensors file ({exc})") from exc
    has_embedding = "embed_tokens.weight" in state
    if not has_embedding:
        emb = _target_embedding(target)
        if emb.weight.shape[1] != config.hidden_size:
            raise HeadMismatchError(
                f"{where} {root}: the head has no embed_tokens.weight and its hidden_size {config.hidden_size} "
                f"differs from the target embedding width {emb.weight.shape[1]}"
            )
    head = Eagle3Head(config, embed_tokens=None if has_embedding else _target_embedding(target))
    expected = head_state_dict(head)
    if not has_embedding:
        expected.pop("embed_tokens.weight", None)
    state.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
    state.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(
            f"{where} {root}: EAGLE-3 weights missing {missing[:4]} (expected the EAGLE/SpecForge layout)"
        )
    for name, ref in expected.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise ValueError(
                f"{where} {root}: tensor {name} has shape {list(state[name].shape)}, expected {list(ref.shape)}"
            )
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name in state and not (name == "embed_tokens.weight" and not has_embedding):
                param.copy_(state[name].to(param.dtype))
        head.d2t.copy_(state["d2t"].to(torch.int64))
        head.t2d.copy_(state["t2d"].to(torch.bool))
    check_vocab_mapping(head, int(target.config.vocab_size), f"{where} {root}")
    head = head.to(device=device)
    for module in (head.fc, head.midlayer, head.norm, head.lm_head):
        module.to(dtype=dtype)
    if has_embedding:
        head.embed_tokens.to(device=device, dtype=dtype)
    return head.eval().requires_grad_(False)
