"""The embedded default models shipped with the repository (no download needed).

``default/target`` is a tiny Qwen3-MoE (``Qwen3MoeForCausalLM``) and ``default/draft`` a tiny dense
Qwen3 (``Qwen3ForCausalLM``) sharing its byte-level BPE tokenizer; both were trained on the Python
documentation by ``python -m live.train_default --out live/assets/default`` (see
``default/MODEL_CARD.md`` for the figures and the exact command). Load them with
``AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, trust_remote_code=False)`` and
``AutoTokenizer.from_pretrained(path)``.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent / "default"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_paths() -> tuple[Path, Path]:
    """``(target_dir, draft_dir)``: absolute paths of the embedded default checkpoints.

    Raises ``FileNotFoundError`` naming the missing file if a checkpoint is incomplete (for
    example in a checkout without the assets); rebuild them with
    ``python -m live.train_default --out live/assets/default``.
    """
    dirs = (DEFAULT_DIR / "target", DEFAULT_DIR / "draft")
    for folder in dirs:
        for name in _REQUIRED_FILES:
            if not (folder / name).is_file():
                raise FileNotFoundError(
                    f"embedded default checkpoint incomplete: {folder / name} is missing; "
                    "rebuild with: python -m live.train_default --out live/assets/default"
                )
    return dirs
