"""The embedded default models shipped with the repository (no download needed).

``default/target`` is a tiny Qwen3-MoE (``Qwen3MoeForCausalLM``) and ``default/draft`` a tiny dense
Qwen3 (``Qwen3ForCausalLM``) sharing its byte-level BPE tokenizer; both were trained on the Python
documentation by ``python -m live.train_default --out live/assets/default`` (see
``default/MODEL_CARD.md`` for the figures and the exact command). Load them with
``AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, trust_remote_code=False)`` and
``AutoTokenizer.from_pretrained(path)``.

``default/eagle3`` is an EAGLE-3 head for the target (``python -m live.train_eagle3 --out
live/assets/default/eagle3``; figures in ``default/eagle3/metrics.json`` and the model card).
:data:`DEFAULT_DRAFT_KIND` says which drafter ``live.record`` uses for ``--model default``: the
head only where it beat the 2-layer draft in measured tokens/s at the default link
(``benchmarks/drafters.py``); ``--draft live/assets/default/draft`` or ``.../eagle3`` picks either.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent / "default"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
DEFAULT_EAGLE3_DIR = DEFAULT_DIR / "eagle3"
DEFAULT_DRAFT_KIND = "causal-lm"
"""``"causal-lm"`` or ``"eagle3"``: the embedded default's drafter (see the module docstring)."""


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


def default_draft_path() -> Path:
    """The drafter ``--model default`` uses: the EAGLE-3 head when :data:`DEFAULT_DRAFT_KIND` is
    ``"eagle3"`` (and it is present), else the causal-LM draft (see :func:`default_model_paths`)."""
    if DEFAULT_DRAFT_KIND == "eagle3" and (DEFAULT_EAGLE3_DIR / "model.safetensors").is_file():
        return DEFAULT_EAGLE3_DIR
    return default_model_paths()[1]
