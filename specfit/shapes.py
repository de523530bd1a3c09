"""MoE model shapes: layers, experts per layer, top-k and the size of one expert.

Figures come from the models' published ``config.json`` files as collected in
``docs/reference-figures.md``. One expert of a SwiGLU MoE layer holds three
``hidden x intermediate`` matrices (gate, up, down), so in bf16 it occupies
``3 * hidden_size * expert_intermediate_size * 2`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    """Shape of an MoE target model, as far as expert offloading is concerned.

    Attributes:
        name: preset name (lower case, e.g. ``"qwen3-30b-a3b"``).
        num_layers: number of MoE layers ``L`` (dense layers are not counted).
        num_experts: routed experts per layer ``E``.
        top_k: experts each token routes to per layer ``K``.
        hidden_size: model width.
        expert_intermediate_size: intermediate width of one expert's MLP.
        bytes_per_expert: bytes one expert's weights occupy (what one H2D transfer moves).

    Raises:
        ValueError: on a non-positive field or ``top_k > num_experts``, naming the field.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    bytes_per_expert: int

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "num_experts",
            "top_k",
            "hidden_size",
            "expert_intermediate_size",
            "bytes_per_expert",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{field}: expected a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"ModelShape.top_k: expected <= num_experts ({self.num_experts}), got {self.top_k}"
            )

    @property
    def num_words(self) -> int:
        """uint64 words per expert bitset, ``ceil(num_experts / 64)``."""
        return math.ceil(self.num_experts / 64)

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of all layers (``L * E * bytes_per_expert``)."""
        return self.num_layers * self.num_experts * self.bytes_per_expert

    @classmethod
    def from_dims(
        cls,
        name: str,
        num_layers: int,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        expert_intermediate_size: int,
        dtype_bytes: int = BF16_BYTES,
    ) -> ModelShape:
        """Build a shape whose ``bytes_per_expert = 3 * hidden * intermediate * dtype_bytes``."""
        return cls(
            name=name,
            num_layers=num_layers,
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            expert_intermediate_size=expert_intermediate_size,
            bytes_per_expert=3 * hidden_size * expert_intermediate_size * dtype_bytes,
        )

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able dict of the fields."""
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "expert_intermediate_size": self.expert_intermediate_size,
            "bytes_per_expert": self.bytes_per_expert,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelShape:
        """Inverse of :meth:`to_dict`; missing keys raise ``ValueError`` naming them."""
        names = (
            "name",
            "num_layers",
            "num_experts",
            "top_k",
            "hidden_size",
            "expert_intermediate_size",
            "bytes_per_expert",
        )
        missing = [k for k in names if k not in data]
        if missing:
            raise ValueError(f"ModelShape: missing field(s) {missing}")
        return cls(**{k: data[k] for k in names})  # type: ignore[arg-type]


MODEL_SHAPES: dict[str, ModelShape] = {
    # Qwen3-30B-A3B config.json: 48 MoE layers, 128 experts, top-8, hidden 2048, moe_intermediate 768.
    "qwen3-30b-a3b": ModelShape.from_dims("qwen3-30b-a3b", 48, 128, 8, 2048, 768),
    # Mixtral-8x7B config.json: 32 layers, 8 experts, top-2, hidden 4096, intermediate 14336.
    "mixtral-8x7b": ModelShape.from_dims("mixtral-8x7b", 32, 8, 2, 4096, 14336),
    # OLMoE-1B-7B config.json: 16 layers, 64 experts, top-8, hidden 2048, intermediate 1024.
    "olmoe-1b-7b": ModelShape.from_dims("olmoe-1b-7b", 16, 64, 8, 2048, 1024),
    # DeepSeek-V2-Lite config.json: 26 MoE layers of 27, 64 routed experts, top-6, hidden 2048,
    # moe_intermediate 1408 (the 2 shared experts stay resident and are not modelled here).
    "deepseek-v2-lite": ModelShape.from_dims("deepseek-v2-lite", 26, 64, 6, 2048, 1408),
}


def get_model_shape(name: str) -> ModelShape:
    """Return the preset ``name`` (case-insensitive).

    Raises:
        ValueError: unknown name; the message lists the known presets.
    """
    key = str(name).strip().lower()
    if key not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; expected one of {sorted(MODEL_SHAPES)}")
    return MODEL_SHAPES[key]
