"""Tree attention masks and KV-cache trimming for draft-tree verification.

Source of the technique: SpecInfer / Medusa / EAGLE tree attention. A batch of tree nodes is fed
in one forward pass after a committed context held in the KV cache; each node attends to the
whole context, to its ancestors already in the cache and to itself. transformers passes a 4-D
mask through unchanged (``masking_utils._preprocess_mask_arguments``); it must be an additive
float mask in the model dtype (0 visible, ``finfo(dtype).min`` masked), because a boolean mask is
silently ignored by eager attention.

Sliding-window attention (Mistral/Mixtral, Qwen2/3 with ``use_sliding_window``): the KV cache keeps
every key (full ``DynamicLayer`` per layer, so the accepted path can be kept and the rest dropped
like anywhere else) and the window is applied by the masks instead: transformers' own sliding
mask for causal feeding, :func:`tree_attention_mask` with ``window`` for tree nodes (a node at
position ``i`` sees context and ancestor keys at positions ``> i - W``), which is what causal
decoding with the window computes. Memory then grows with the context instead of the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SLIDING, FULL = "sliding_attention", "full_attention"
"""transformers' names of the two attention layer types (``config.layer_types``)."""


@dataclass(frozen=True)
class AttentionLayout:
    """Which past keys a model's attention layers see, as far as tree masks must reproduce it.

    Attributes:
        window: sliding window ``W`` of the windowed layers (a query at position ``i`` sees keys at
            positions ``j`` with ``i - W < j <= i``; transformers' ``sliding_window_causal_mask_function``),
            ``None`` when every layer attends to the whole past.
        per_layer_type: the model mixes full and sliding layers and takes one mask per layer type
            (a dict keyed by ``FULL`` / ``SLIDING``); otherwise one mask serves every layer.
    """

    window: int | None = None
    per_layer_type: bool = False


def attention_layout(config) -> AttentionLayout:
    """The :class:`AttentionLayout` of a transformers model config.

    ``sliding_window`` counts only where the config class declares it (Mistral/Mixtral, Qwen2/3(-MoE):
    their models build a sliding-window mask from it; a stray attribute on another architecture is
    ignored by its model too); 0 or ``None`` means no window. With ``layer_types`` the windowed
    layers are those typed ``"sliding_attention"``.

    Raises:
        ValueError: naming the config field, for a layer type other than full or sliding attention
            (e.g. chunked attention), or a ``sliding_window`` that is not a positive integer.
    """
    declared = hasattr(type(config), "sliding_window")
    window = getattr(config, "sliding_window", None) if declared else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(
            f"config.json field sliding_window: expected a positive integer or null, got {window!r}"
        )
    window = window or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return AttentionLayout(window)
    other = sorted(set(layer_types) - {FULL, SLIDING})
    if other:
        raise ValueError(
            f"config.json field layer_types: {other} not supported by tree verification "
            f"(expected {FULL!r} or {SLIDING!r} per layer)"
        )
    if window is None or SLIDING not in layer_types:
        return AttentionLayout(None)
    return AttentionLayout(window, per_layer_type=FULL in layer_types)


def tree_attention_mask(
    context_len: int,
    slot_nodes: Sequence[int],
    query_nodes: Sequence[int],
    ancestors: np.ndarray,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    window: int | None = None,
    key_positions: Sequence[int] | None = None,
    query_positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """Additive 4-D attention mask for feeding ``query_nodes`` after a cache.

    Args:
        context_len: committed tokens in the KV cache before any tree slot (all visible).
        slot_nodes: node ids occupying the cache slots after the context, in cache order, INCLUDING the
            query nodes themselves at the end (their keys are appended by this forward pass).
        query_nodes: node ids fed in this pass, in input order.
        ancestors: bool[N, N] from :meth:`TokenTree.ancestor_matrix` (``[a, v]``: a is v or an ancestor).
        dtype: the model's floating dtype; masked entries get ``torch.finfo(dtype).min``.
        window: sliding window ``W``: additionally hide keys ``W`` or more positions behind the
            query (``None``: no window). Needs ``key_positions`` and ``query_positions``.
        key_positions: position id of every key, int[context_len + len(slot_nodes)] (cache order).
        query_positions: position id of every query, int[len(query_nodes)].

    Returns:
        float tensor [1, 1, len(query_nodes), context_len + len(slot_nodes)].
    Raises:
        ValueError: ``window`` without positions of the right lengths.
    """
    slots = np.asarray(slot_nodes, dtype=np.int64)
    queries = np.asarray(query_nodes, dtype=np.int64)
    visible = np.ones((len(queries), context_len + len(slots)), dtype=bool)
    visible[:, context_len:] = ancestors[np.ix_(slots, queries)].T
    if window is not None:
        keys = np.asarray(key_positions if key_positions is not None else [], dtype=np.int64)
        rows = np.asarray(query_positions if query_positions is not None else [], dtype=np.int64)
        if keys.shape != (visible.shape[1],) or rows.shape != (visible.shape[0],):
            raise ValueError(
                f"tree_attention_mask: window needs {visible.shape[1]} key and {visible.shape[0]} query "
                f"positions, got {keys.size} and {rows.size}"
            )
        visible &= rows[:, None] - keys[None, :] < int(window)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(torch.from_numpy(~visible).to(device), torch.finfo(dtype).min)
    return mask[None, None]


def keep_cache_positions(cache: DynamicCache, prefix_len: int, extra_positions: Sequence[int]) -> None:
    """Keep the first ``prefix_len`` cache entries plus ``extra_positions`` (in that order), drop the rest.

    Used after verification to keep only the accepted path (KV trimming): ``extra_positions`` are the
    cache indices of the accepted nodes, ascending. Works in place on every layer of a
    ``DynamicCache`` (full-attention ``DynamicLayer`` only).

    Raises:
        ValueError: for a cache layer type other than ``DynamicLayer`` (sliding windows would need
            their own bookkeeping) or positions outside the cache.
    """
    extra = [int(p) for p in extra_positions]
    for idx, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"keep_cache_positions: cache layer {idx} is {type(layer).__name__}; only DynamicLayer "
                "(full attention) can be trimmed to a tree path"
            )
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        length = layer.keys.shape[-2]
        if prefix_len > length or any(not prefix_len <= p < length for p in extra):
            raise ValueError(
                f"keep_cache_positions: positions must lie in [prefix_len={prefix_len}, {length}), got {extra}"
            )
        if extra == list(range(prefix_len, prefix_len + len(extra))):
            layer.keys = layer.keys[..., : prefix_len + len(extra), :]
            layer.values = layer.values[..., : prefix_len + len(extra), :]
            continue
        index = torch.tensor(list(range(prefix_len)) + extra, dtype=torch.long, device=layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)
