"""Load Hugging Face checkpoints from a local directory: safetensors only, no remote code.

:func:`load_target` loads a Mixture-of-Experts causal LM of one of ``SUPPORTED_ARCHITECTURES``
with transformers' own model classes (attention, norms, rotary embeddings and KV cache are
upstream's), keeps the fused 3-D expert weights (``experts.gate_up_proj[E, 2I, H]``,
``experts.down_proj[E, H, I]``, the transformers 5 layout) in host memory and puts every other
weight on the device; :class:`live.offload.OffloadedMoE` then takes over the expert computation.
:func:`load_draft` loads a small dense model (the draft) entirely on the device.

Checks, each with an error that names the path and what was expected:
the directory and its ``config.json`` exist; ``model_type`` is supported
(:class:`UnsupportedArchitectureError` lists the supported ones); weights are ``*.safetensors``
(pickle-based ``*.bin``/``*.pt`` checkpoints are refused, never unpickled); the config asks for no
remote code. Everything loads with ``local_files_only=True``: nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# model_type (config.json) -> transformers class name; all share the MoE block layout
# `mlp.gate` (router returning (logits, top-k weights, top-k ids)) + `mlp.experts` (fused 3-D).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's ``model_type`` is not one the offloaded runtime supports."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: a truncated or corrupt ``*.safetensors`` file (named), one
    transformers fails to load, or one transformers loads but cannot run (its one-token check
    forward fails: "transformers cannot run this checkpoint: ...")."""


@dataclass(frozen=True)
class MoESpec:
    """Shape of a loaded MoE model, for manifests and cache sizing.

    ``num_layers``: MoE layers L (dense decoder layers are not counted); ``moe_layer_indices``:
    their decoder-layer indices; ``num_experts`` E routed experts per layer; ``top_k`` K;
    ``bytes_per_expert``: bytes of one routed expert's weights (gate, up and down) in the loaded
    dtype; ``dtype``: e.g. ``"float32"``.
    """

    arch: str
    num_layers: int
    moe_layer_indices: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    bytes_per_expert: int
    vocab_size: int
    dtype: str

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        d = asdict(self)
        d["moe_layer_indices"] = list(self.moe_layer_indices)
        return d


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or a torch dtype among those) -> torch dtype.

    Raises ``ValueError`` naming the accepted names.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")


def read_checkpoint_config(path: str | Path) -> dict:
    """Validate a checkpoint directory and return its parsed ``config.json``.

    Raises:
        FileNotFoundError: the directory or its config.json is missing.
        ValueError: config.json is not a JSON object, asks for remote code (``auto_map``), or
            the directory holds no ``*.safetensors`` file (a pickle-only checkpoint is refused).
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root}: checkpoint directory not found (expected a local Hugging Face model dir)"
        )
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path}: missing (a Hugging Face checkpoint directory needs config.json)"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    if "auto_map" in config:
        raise ValueError(
            f"{config_path}: field 'auto_map' asks for remote code; refused (trust_remote_code=False)"
        )
    if not any(root.glob("*.safetensors")):
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        found = f" (found pickle-based {', '.join(pickles)}: refused, never unpickled)" if pickles else ""
        raise ValueError(f"{root}: no *.safetensors weights{found}; convert the checkpoint to safetensors")
    check_safetensors_files(root)
    return config


def check_safetensors_files(root: str | Path) -> None:
    """Read the header of every ``*.safetensors`` file in ``root`` (no tensor data is read): a
    truncated, empty or non-safetensors file raises :class:`CheckpointError` naming it.

    The header check is safetensors' own (``safe_open`` validates that the header parses and that
    the tensors' byte ranges cover the file exactly), so a file cut short is caught before
    transformers maps it.
    """
    from safetensors import SafetensorError, safe_open

    for file in sorted(Path(root).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="np"):
                pass
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(
                f"{file}: not a readable safetensors file ({exc}); the file is truncated or corrupt "
                "(re-download or re-save the checkpoint)"
            ) from None


def check_target_arch(config: dict, path: Path) -> str:
    """``model_type`` of a target's parsed ``config``; :class:`UnsupportedArchitectureError` (listing
    the supported ones) when the offloaded runtime does not support it."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedArchitectureError(
            f"{path / 'config.json'}: model_type {model_type!r} is not supported by the offloaded MoE "
            f"runtime; supported: {supported}"
        )
    return model_type


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` if it is ``cpu`` or an available ``cuda[:N]``; else
    ``ValueError`` naming ``device`` and what is available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {str(dev)!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {str(dev)!r} requested but CUDA is not available here")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device: {str(dev)!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return dev


def quiet_loading() -> None:
    """Silence transformers' per-load "Loading weights" progress bars (``--no-progress``), through
    its own switch ``transformers.utils.logging.disable_progress_bar``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _from_pretrained(path: Path, dtype: torch.dtype, attn_implementation: str | None):
    from transformers import AutoModelForCausalLM

    kwargs = {
        "dtype": dtype,
        "use_safetensors": True,
        "trust_remote_code": False,
        "local_files_only": True,
    }
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(
            f"{path}: transformers cannot load this checkpoint: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    model.eval()
    model.requires_grad_(False)
    check_forward(model, path)
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_forward(model: torch.nn.Module, path: str | Path) -> None:
    """Run one token (id 0, no cache) through ``model`` where it was loaded (host memory, before
    any offloading); a config that transformers loads but cannot run (e.g. attention heads that
    do not divide into key/value heads) raises :class:`CheckpointError` "transformers cannot run
    this checkpoint: ..." instead of failing mid-decoding.
    """
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
    except (RuntimeError, ValueError, IndexError, TypeError, AttributeError, KeyError) as exc:
        raise CheckpointError(
            f"{path}: transformers cannot run this checkpoint: {type(exc).__name__}: {_first_line(exc)} "
            "(its one-token check forward failed; check config.json against the weights)"
        ) from exc


def check_checkpoints(model: str, draft: str | None = None) -> None:
    """The CLI's checkpoint checks before any model loads (``live.record``, ``analysis.validate``):
    ``--model`` (a directory, or ``"default"``) has a readable config.json of a supported MoE
    architecture and intact safetensors headers, ``--draft`` a readable config.json and intact
    headers and a vocabulary no larger than the target's (an EAGLE-3 head: the config checks of
    :func:`live.eagle3.check_head_config`). Reads configs and headers only.

    Raises:
        specfit.cli.InputError: naming ``--model`` or ``--draft``, the file and what was expected.
    """
    from specfit.cli import InputError

    for flag, path in (("--model", model), ("--draft", draft)):
        if path is None or path == "default":
            continue
        try:
            config = read_checkpoint_config(path)
            if flag == "--model":
                check_target_arch(config, Path(path))
        except (ValueError, FileNotFoundError) as exc:
            raise InputError(flag, str(exc)) from None
    if draft is not None and draft != "default":
        from live.eagle3 import check_head_config, is_eagle3_checkpoint

        try:
            if is_eagle3_checkpoint(draft):
                check_head_config(draft, checkpoint_config(model), where=str(draft))
            else:
                check_draft_vocab(model, draft)
        except ValueError as exc:
            raise InputError("--draft", str(exc)) from None


def vocab_size_of(path: str | Path) -> int | None:
    """``vocab_size`` from a checkpoint's ``config.json`` (also under ``text_config``; ``path`` may
    be ``"default"``, the embedded target), else ``None``."""
    value = checkpoint_config(path).get("vocab_size")
    return int(value) if isinstance(value, int) else None


def check_draft_vocab(target: str | Path, draft: str | Path) -> None:
    """Refuse a draft whose vocabulary is larger than the target's (config.json ``vocab_size``):
    the target could not score draft tokens past its own vocabulary. Raises ``ValueError``
    naming both values; read from the configs only, so it runs before any model loads."""
    target_vocab, draft_vocab = vocab_size_of(target), vocab_size_of(draft)
    if target_vocab is not None and draft_vocab is not None and draft_vocab > target_vocab:
        raise ValueError(
            f"{draft}: the draft's vocabulary has {draft_vocab} tokens, more than the target's {target_vocab} "
            f"({target}); draft and target must share one tokenizer (draft vocab_size <= target vocab_size)"
        )


def find_moe_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``[(decoder_layer_index, moe_block), ...]`` for every decoder layer whose MLP is an MoE block.

    An MoE block has a ``gate`` (router) and an ``experts`` module with fused 3-D
    ``gate_up_proj[E, 2I, H]`` and ``down_proj[E, H, I]`` (transformers 5 layout), or an already
    installed :class:`live.offload.OffloadedExperts`.
    """
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found at model.model.layers")
    blocks = []
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None or getattr(mlp, "gate", None) is None:
            continue
        if getattr(experts, "is_offloaded", False) or getattr(experts, "gate_up_proj", None) is not None:
            blocks.append((index, mlp))
    return blocks


def describe_moe(model: torch.nn.Module) -> MoESpec:
    """The :class:`MoESpec` of a loaded (or offloaded) MoE model.

    Raises ``ValueError`` if the model has no MoE block.
    """
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no MoE layers (mlp.gate + mlp.experts) found")
    experts = blocks[0][1].experts
    gate = blocks[0][1].gate
    if getattr(experts, "is_offloaded", False):
        store = experts.store
        gate_up_shape, down_shape, dtype = store.gate_up_shape, store.down_shape, store.dtype
        num_experts = store.num_experts
    else:
        gate_up_shape = tuple(experts.gate_up_proj.shape[1:])
        down_shape = tuple(experts.down_proj.shape[1:])
        dtype = experts.gate_up_proj.dtype
        num_experts = experts.gate_up_proj.shape[0]
    element = torch.empty((), dtype=dtype).element_size()
    bytes_per_expert = (gate_up_shape[0] * gate_up_shape[1] + down_shape[0] * down_shape[1]) * element
    config = model.config
    return MoESpec(
        arch=str(config.model_type),
        num_layers=len(blocks),
        moe_layer_indices=tuple(i for i, _ in blocks),
        num_experts=int(num_experts),
        top_k=int(gate.top_k),
        hidden_size=int(down_shape[0]),
        expert_intermediate_size=int(down_shape[1]),
        bytes_per_expert=int(bytes_per_expert),
        vocab_size=int(config.vocab_size),
        dtype=str(dtype).removeprefix("torch."),
    )


def _expert_module_ids(model: torch.nn.Module) -> set[int]:
    return {id(block.experts) for _, block in find_moe_blocks(model)}


def move_non_expert_weights(model: torch.nn.Module, device: str | torch.device) -> None:
    """Move every parameter and buffer to ``device`` except the routed experts' fused weights.

    Parameters are moved in place (``param.data``), so tied weights stay tied.
    """
    device = torch.device(device)
    skip = _expert_module_ids(model)
    for module in model.modules():
        if id(module) in skip:
            continue
        for param in module._parameters.values():
            if param is not None and param.device != device:
                param.data = param.data.to(device)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def load_target(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    *,
    experts_on_device: bool = False,
    attn_implementation: str | None = None,
):
    """Load an MoE target model from a local checkpoint directory.

    Args:
        path: directory with config.json and ``*.safetensors`` (Hugging Face layout).
        device: device for the non-expert weights (``"cpu"``, ``"cuda"``, ...).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (or the torch dtype).
        experts_on_device: also put the expert weights on ``device`` (a resident reference
            model); by default they stay in host (CPU) memory, ready for
            ``live.offload.OffloadedMoE.install``.
        attn_implementation: passed to transformers (e.g. ``"eager"``, ``"sdpa"``); default:
            transformers' choice.

    Returns:
        The transformers ``*ForCausalLM`` model in eval mode, gradients off.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_checkpoint_config`; also a bad dtype or
            an unavailable device (:func:`check_device`).
        UnsupportedArchitectureError: ``model_type`` not in ``SUPPORTED_ARCHITECTURES``.
    """
    root = Path(path)
    device = check_device(device)
    config = read_checkpoint_config(root)
    check_target_arch(config, root)
    model = _from_pretrained(root, resolve_dtype(dtype), attn_implementation)
    if not find_moe_blocks(model):
        raise UnsupportedArchitectureError(f"{root}: no MoE layers found in the loaded model")
    if experts_on_device:
        model.to(device)
    else:
        move_non_expert_weights(model, device)
    return model


def load_draft(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    *,
    attn_implementation: str | None = None,
):
    """Load a (dense) draft causal LM entirely onto ``device``; same checks as :func:`load_target`
    except the architecture, which may be any causal LM that transformers implements natively.
    """
    root = Path(path)
    device = check_device(device)
    read_checkpoint_config(root)
    model = _from_pretrained(root, resolve_dtype(dtype), attn_implementation)
    return model.to(device)


def checkpoint_config(model: str | Path) -> dict:
    """A checkpoint's ``config.json`` (its ``text_config`` when nested; ``model`` a directory or
    ``"default"``, the embedded target); ``{}`` when unreadable. Reads no weights."""
    if str(model) == "default":
        from live.assets import default_model_paths

        try:
            folder = default_model_paths()[0]
        except FileNotFoundError:
            return {}
    else:
        folder = Path(model)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    return config if isinstance(config, dict) else {}


def experts_per_layer(model: str | Path) -> int | None:
    """Routed experts per layer from a checkpoint's ``config.json`` (``None`` when not stated)."""
    config = checkpoint_config(model)
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def moe_layer_count(model: str | Path) -> int | None:
    """MoE decoder layers (dense ones not counted) from a checkpoint's ``config.json``, as the
    architectures place them: Qwen-MoE ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek
    ``first_k_dense_replace`` / ``moe_layer_freq``, else every layer (Mixtral, OLMoE).
    ``None`` when the file does not state the layer count."""
    config = checkpoint_config(model)
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or experts_per_layer(model) is None:
        return None
    try:
        if "first_k_dense_replace" in config or "moe_layer_freq" in config:
            first = int(config.get("first_k_dense_replace") or 0)
            freq = max(1, int(config.get("moe_layer_freq") or 1))
            return sum(1 for i in range(layers) if i >= first and i % freq == 0)
        dense = {int(i) for i in config.get("mlp_only_layers") or []}
        step = max(1, int(config.get("decoder_sparse_step") or 1))
    except (TypeError, ValueError):
        return None  # a layout this check does not know: left to the engine
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
