"""A causal LM with its own KV cache, fed causally (committed tokens) or as a tree (draft nodes).

Shared by the drafter and the verifier so both handle positions, masks and cache trimming the
same way. Batch size 1. The model is any transformers ``*ForCausalLM`` (transformers 5 calls the
cache argument ``cache``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from live.spec.attention import FULL, SLIDING, attention_layout, keep_cache_positions, tree_attention_mask


def float32_output_head(model: nn.Module) -> None:
    """Make ``model``'s output projection compute its logits in float32 (in place).

    The hidden state stays in the model's dtype; the last projection runs as
    ``linear(hidden.float(), W.float(), b)`` on a float32 copy of the head weight (``V x H x 4``
    bytes, e.g. 1.2 GB for Qwen3-30B-A3B's 151,936 x 2,048 head), so logits are no longer rounded
    to bfloat16/float16, where tokens one ulp apart tie (a bfloat16 logit near 10 has an ulp of
    0.0625). Affects every later forward of ``model``.

    Raises:
        ValueError: a model without an output embedding (``get_output_embeddings() is None``).
    """
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError("float32 logits: the model has no output projection (get_output_embeddings)")
    weight = head.weight.detach().float()
    bias = None if getattr(head, "bias", None) is None else head.bias.detach().float()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), weight, bias)

    head.forward = forward


class CachedLM:
    """Wraps ``model`` (eval mode, no grad) with a ``DynamicCache`` that holds a committed prefix.

    The cache keeps every key in full-attention layers whatever the model's attention (sliding
    windows are applied by the masks, see :mod:`live.spec.attention`), and the position id of
    each cache entry, so tree masks can reproduce a sliding window.

    Args:
        model: the causal LM.
        float32_logits: compute the logits in float32 (:func:`float32_output_head`) when the
            model runs in a lower precision.

    Attributes:
        model: the causal LM.
        cache: its ``DynamicCache``; ``cache_len`` entries.
        layout: the model's :class:`live.spec.attention.AttentionLayout`.

    Raises:
        ValueError: an attention layout tree verification cannot reproduce (names the config field).
    """

    def __init__(self, model: nn.Module, *, float32_logits: bool = False) -> None:
        self.model = model.eval()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.layout = attention_layout(model.config)
        if float32_logits and self.dtype != torch.float32:
            float32_output_head(model)
        self.reset()

    @property
    def cache_len(self) -> int:
        """Number of tokens whose keys/values are in the cache."""
        return int(self.cache.get_seq_length())

    def reset(self) -> None:
        """Drop the cache (a fresh one, so nothing leaks between generations)."""
        self.cache = DynamicCache()  # full-attention layers (created as layers are fed)
        self._positions = np.zeros(0, dtype=np.int64)  # position id of each cache entry

    @torch.inference_mode()
    def _forward(
        self, token_ids: Sequence[int], position_ids: Sequence[int], mask: torch.Tensor | None, keep: int = 0
    ):
        positions = np.asarray(position_ids, dtype=np.int64)
        # torch.tensor copies: a tree's arrays are read-only (live.spec.tree.TokenTree), which
        # torch.as_tensor would share with a warning; these are a few int64 values per forward.
        ids = torch.tensor(np.asarray(token_ids, dtype=np.int64), device=self.device)[None]
        pos = torch.tensor(positions, device=self.device)[None]
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        self._positions = np.concatenate([self._positions, positions])
        return out.logits[0].float()

    def feed_causal(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` after the cache with ordinary causal attention.

        Args:
            token_ids: tokens to append.
            last_only: compute the logits of the last token only (transformers' ``logits_to_keep=1``).

        Returns:
            float32 logits [T, V] (one row per fed token; [1, V] with ``last_only``), on the model's device.
        Raises:
            ValueError: for an empty token list.
        """
        if len(token_ids) == 0:
            raise ValueError("CachedLM.feed_causal: token_ids is empty")
        start = self.cache_len
        return self._forward(
            token_ids, range(start, start + len(token_ids)), None, keep=1 if last_only else 0
        )

    def feed_tree(
        self,
        token_ids: Sequence[int],
        depths: Sequence[int],
        root_position: int,
        context_len: int,
        slot_nodes: Sequence[int],
        query_nodes: Sequence[int],
        ancestors: np.ndarray,
    ) -> torch.Tensor:
        """Append tree nodes ``query_nodes`` (tokens ``token_ids``) with a tree attention mask.

        Args:
            token_ids, depths: the query nodes' tokens and depths (same order as ``query_nodes``).
            root_position: position id of the root; a node's position id is ``root_position + depth``.
            context_len: cache entries before the first tree slot (the committed context).
            slot_nodes, query_nodes, ancestors: see :func:`live.spec.attention.tree_attention_mask`.

        Returns:
            float32 logits [len(query_nodes), V].
        """
        positions = root_position + np.asarray(depths, dtype=np.int64)
        args = (context_len, slot_nodes, query_nodes, ancestors, self.dtype, self.device)
        mask = tree_attention_mask(*args)
        window = self.layout.window
        if window is not None and int(positions.max()) - int(self._positions.min(initial=0)) >= window:
            keys = np.concatenate([self._positions, positions])
            windowed = tree_attention_mask(
                *args, window=window, key_positions=keys, query_positions=positions
            )
            mask = {FULL: mask, SLIDING: windowed} if self.layout.per_layer_type else windowed
        return self._forward(token_ids, positions, mask)

    def keep(self, prefix_len: int, extra_positions: Sequence[int]) -> None:
        """Keep the first ``prefix_len`` entries and ``extra_positions``; see :func:`keep_cache_positions`."""
        keep_cache_positions(self.cache, prefix_len, extra_positions)
        self._positions = np.concatenate(
            [self._positions[:prefix_len], self._positions[np.asarray(extra_positions, dtype=np.int64)]]
        )
