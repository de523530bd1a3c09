"""Tree attention masks and KV-cache trimming for draft-tree verification.

Source of the technique: SpecInfer / Medusa / EAGLE tree attention. A batch of tree nodes is fed
in one forward pass after a committed context held in the KV cache; each node attends to the
whole context, to its ancestors already in the cache and to itself. transformers passes a 4-D
mask through unchanged (``masking_utils._preprocess_mask_arguments``); it must be an additive
float mask in the model dtype (0 visible, ``finfo(dtype).min`` masked), because a boolean mask is
silently ignored by eager attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def tree_attention_mask(
    context_len: int,
    slot_nodes: Sequence[int],
    query_nodes: Sequence[int],
    ancestors: np.ndarray,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Additive 4-D attention mask for feeding ``query_nodes`` after a cache.

    Args:
        context_len: committed tokens in the KV cache before any tree slot (all visible).
        slot_nodes: node ids occupying the cache slots after the context, in cache order, INCLUDING the
            query nodes themselves at the end (their keys are appended by this forward pass).
        query_nodes: node ids fed in this pass, in input order.
        ancestors: bool[N, N] from :meth:`TokenTree.ancestor_matrix` (``[a, v]``: a is v or an ancestor).
        dtype: the model's floating dtype; masked entries get ``torch.finfo(dtype).min``.

    Returns:
        float tensor [1, 1, len(query_nodes), context_len + len(slot_nodes)].
    """
    slots = np.asarray(slot_nodes, dtype=np.int64)
    queries = np.asarray(query_nodes, dtype=np.int64)
    visible = np.ones((len(queries), context_len + len(slots)), dtype=bool)
    visible[:, context_len:] = ancestors[np.ix_(slots, queries)].T
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
