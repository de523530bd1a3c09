"""Router top-k capture for every token of every forward pass, collected by the engine itself.

transformers 5 MoE blocks call a router module (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``,
``OlmoeTopKRouter``, ``Qwen2MoeTopKRouter``, ``DeepseekV3TopkRouter``) that returns
``(router_logits, top_k_weights, top_k_index)``. A forward hook on each router records the last
two, in layer order, so the routing of every token is kept even where ``generate`` drops it.
Some routers return their top-k in no particular order (DeepSeek-V3 picks experts by bias-corrected
scores, ``topk(sorted=False)`` over groups); :func:`order_by_weight` puts every token's choices in
descending router weight, the order docs/trace-format.md promises for every architecture.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

_ROUTER_CLASS = re.compile(r"Top[Kk]Router$")


def order_by_weight(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder each token's top-k choices by descending router weight (ties keep the router's order).

    Args:
        ids: int[..., K] expert ids; weights: float[..., K] router weights, same shape.
    Returns:
        ``(ids, weights)`` permuted along the last axis, same shapes and dtypes (new arrays).
    Raises:
        ValueError: when the shapes differ.
    Source: the trace contract (docs/trace-format.md, "choices in descending router weight").
    """
    if ids.shape != weights.shape:
        raise ValueError(f"order_by_weight: ids {ids.shape} and weights {weights.shape} differ in shape")
    order = np.argsort(-weights, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, axis=-1), np.take_along_axis(weights, order, axis=-1)


def find_routers(model: nn.Module) -> list[nn.Module]:
    """Router modules of ``model`` in layer order (empty for a dense model)."""
    return [m for _, m in model.named_modules() if _ROUTER_CLASS.search(type(m).__name__)]


class RouterCapture:
    """Collects top-k expert ids and router weights per token and MoE layer.

    Usage: ``cap = RouterCapture(model)``; run one forward; ``ids, weights = cap.take()`` gives
    ``int64[T, L, K]`` and ``float32[T, L, K]`` for the ``T`` tokens of that forward (token order
    of the input). ``close()`` removes the hooks. ``num_layers == 0`` for a dense model, where
    ``take`` returns arrays of shape ``[0, 0, 0]``.
    """

    def __init__(self, model: nn.Module) -> None:
        self._routers = find_routers(model)
        self._ids: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self._weights: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self._routers)]

    @property
    def num_layers(self) -> int:
        """Number of MoE layers ``L`` (routers found)."""
        return len(self._routers)

    @property
    def top_k(self) -> int:
        """Experts per token ``K`` (from the first router's ``top_k``), 0 for a dense model."""
        return int(getattr(self._routers[0], "top_k", 0)) if self._routers else 0

    @property
    def num_experts(self) -> int:
        """Routed experts per layer ``E`` (rows of the first router's weight), 0 for a dense model."""
        return int(self._routers[0].weight.shape[0]) if self._routers else 0

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            self._weights[layer].append(output[1].detach().reshape(-1, output[1].shape[-1]).float().cpu())
            self._ids[layer].append(output[2].detach().reshape(-1, output[2].shape[-1]).cpu())

        return hook

    def clear(self) -> None:
        """Forget everything captured so far."""
        for lst in (*self._ids, *self._weights):
            lst.clear()

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """Return (ids int64[T, L, K], weights float32[T, L, K]) captured since the last take, and clear.

        Each token's K choices are in descending router weight (:func:`order_by_weight`).

        Raises:
            RuntimeError: when layers saw different token counts (a forward was interrupted).
        """
        if not self._routers:
            return np.zeros((0, 0, 0), np.int64), np.zeros((0, 0, 0), np.float32)
        ids = [torch.cat(x) if x else torch.zeros(0, self.top_k, dtype=torch.long) for x in self._ids]
        weights = [torch.cat(x) if x else torch.zeros(0, self.top_k) for x in self._weights]
        self.clear()
        counts = {int(t.shape[0]) for t in ids}
        if len(counts) != 1:
            raise RuntimeError(f"RouterCapture: layers saw different token counts {sorted(counts)}")
        return order_by_weight(
            torch.stack(ids, dim=1).numpy().astype(np.int64),
            torch.stack(weights, dim=1).numpy().astype(np.float32),
        )

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
