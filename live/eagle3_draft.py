"""Drafting with an EAGLE-3 head from the target's own hidden states (no second target pass).

:class:`TargetFeatures` hooks the target's decoder layers and keeps, for every committed token
except the last (the same tokens the target's KV cache holds, see :class:`live.spec.verify.TreeVerifier`),
the concatenation of the three tapped hidden states ``[3 Ht]``. The verifier calls it: every
forward's rows are captured, and on commit the rows of the root and accepted path are appended.

:class:`Eagle3Drafter` grows the EAGLE-2/3 dynamic tree (the shared loop of
:class:`live.spec.draft.TreeDrafter`) with the head. Sequence alignment follows the reference
(SafeAILab/EAGLE ``cnets.py`` ``topK_genrate``: ``input_ids[:, 1:]`` against the target hidden
states): the head's cache entry ``j`` pairs the target feature of committed token ``j`` with the
embedding of token ``j + 1`` at position ``j``; the output of the last pair (``n - 2``) gives the
root's children. A tree node at depth ``d`` is fed with its parent's head output and its own
token at position ``n - 2 + d``, attending to the context and its ancestors (tree mask). After a
commit the head's cache is rolled back to the context: accepted tokens are re-fed with the
target's true features, as the reference does (its ``stable_kv`` only grows from target states).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from live.eagle3 import Eagle3Head, decoder_layers, default_layer_ids
from live.spec.attention import tree_attention_mask
from live.spec.draft import TreeDrafter
from live.spec.tree import ancestor_matrix


class TargetFeatures:
    """Tapped target hidden states of the committed tokens.

    Args:
        model: the target (transformers causal LM with ``model.model.layers``).
        layer_ids: three layer ids; id ``j < L`` is the INPUT of decoder layer ``j`` (forward
            pre-hook), id ``L`` the last layer's output (forward hook).

    Attributes:
        committed: [N, 3 Ht] features of the committed tokens but the last (None before a prefill):
            a view of a buffer that grows by doubling, so appending a cycle's rows is amortised
            O(rows), not a copy of everything committed so far.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        layers = decoder_layers(model)
        num = len(layers)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        if not all(0 <= i <= num for i in self.layer_ids):
            raise ValueError(f"TargetFeatures: layer ids {self.layer_ids} must lie in [0, {num}]")
        self._last: dict[int, torch.Tensor] = {}
        self._handles = []
        for i in sorted(set(self.layer_ids)):
            if i < num:
                self._handles.append(layers[i].register_forward_pre_hook(self._pre(i), with_kwargs=True))
            else:
                self._handles.append(layers[num - 1].register_forward_hook(self._post(i), with_kwargs=True))
        self._buffer: torch.Tensor | None = None  # [capacity, 3 Ht]; rows [0, _rows) are committed
        self._rows = 0

    def _pre(self, i: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self._last[i] = hidden.detach()[0]

        return hook

    def _post(self, i: int):
        def hook(module, args, kwargs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._last[i] = hidden.detach()[0]

        return hook

    @property
    def committed(self) -> torch.Tensor | None:
        """[N, 3 Ht] features of the committed tokens but the last (None before a prefill)."""
        return None if self._buffer is None else self._buffer[: self._rows]

    @property
    def num_committed(self) -> int:
        """Rows of :attr:`committed`."""
        return self._rows

    def begin_forward(self) -> None:
        """Forget the previous forward's rows (called before every target forward)."""
        self._last = {}

    def forward_features(self) -> torch.Tensor:
        """[T, 3 Ht] tapped states of the last forward's tokens, in input order."""
        return torch.cat([self._last[i] for i in self.layer_ids], dim=-1)

    def reset(self, take_forward: bool) -> None:
        """After a prefill: the committed features are the forward's rows (or none)."""
        self._buffer, self._rows = None, 0
        if take_forward:
            self._append(self.forward_features())

    def commit(self, rows: Sequence[int]) -> None:
        """Append the last forward's ``rows`` (root and accepted nodes, input order)."""
        self._append(
            self.forward_features()[torch.as_tensor(list(rows), dtype=torch.long, device=self._device())]
        )

    def _append(self, new: torch.Tensor) -> None:
        """Copy ``new`` [n, 3 Ht] after the committed rows, doubling the buffer when it is full."""
        need = self._rows + int(new.shape[0])
        if self._buffer is None or need > self._buffer.shape[0]:
            grown = new.new_empty((max(need, 2 * self._rows, 64), new.shape[1]))
            if self._rows:
                grown[: self._rows] = self._buffer[: self._rows]
            self._buffer = grown
        self._buffer[self._rows : need] = new
        self._rows = need

    def _device(self) -> torch.device:
        return next(iter(self._last.values())).device

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def features_for(head: Eagle3Head, target: nn.Module) -> TargetFeatures:
    """A :class:`TargetFeatures` tapping the layers ``head`` was trained on (pinned or reference default)."""
    layer_ids = head.config.layer_ids or default_layer_ids(len(decoder_layers(target)))
    return TargetFeatures(target, layer_ids)


class Eagle3Drafter(TreeDrafter):
    """:class:`live.spec.draft.Drafter` backed by an EAGLE-3 head (see module docstring).

    Args:
        head: the loaded :class:`live.eagle3.Eagle3Head`.
        features: the :class:`TargetFeatures` the target's verifier fills.
    """

    kind = "eagle3"

    def __init__(self, head: Eagle3Head, features: TargetFeatures) -> None:
        self.head = head.eval()
        self.features = features
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        self.reset()

    def reset(self) -> None:
        """Drop the head's cache."""
        self._past: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ctx = 0
        self._slots: list[int] = []
        self._node_out: dict[int, torch.Tensor] = {}
        self._tree_to_cand = np.zeros(1, np.int64)
        self._n = 0

    def _truncate(self, length: int) -> None:
        if self._past is not None:
            self._past = (self._past[0][:, :, :length], self._past[1][:, :, :length])
        self._ctx = min(self._ctx, length)

    def _begin(self, committed: Sequence[int]) -> None:
        self._truncate(self._ctx)  # drop tree slots a previous grow left (no accept in between)
        self._slots = []
        self._node_out = {}
        self._n = len(committed)

    @torch.inference_mode()
    def _root_logits(self, committed: Sequence[int]) -> torch.Tensor | None:
        n = len(committed)
        if n < 2:
            return None  # no target feature yet (one-token prompt): the root is verified alone
        have = self.features.num_committed
        if have < n - 1:
            raise ValueError(
                f"Eagle3Drafter.grow: target features cover {have} committed tokens, need {n - 1} "
                "(the target must have run them: TreeVerifier.prefill/commit with these features)"
            )
        if self._ctx > n - 1:
            raise ValueError(f"Eagle3Drafter.grow: head cache holds {self._ctx} pairs but only {n} committed")
        if self._ctx == n - 1:  # the root's pair is cached: re-feed it for its output
            self._truncate(n - 2)
        c = self._ctx
        count = n - 1 - c
        hidden = self.features.committed[c : n - 1].to(device=self.device, dtype=self.dtype)
        ids = torch.as_tensor(np.asarray(committed[c + 1 : n], dtype=np.int64), device=self.device)
        pos = torch.arange(c, n - 1, device=self.device)
        chain = np.triu(np.ones((count, count), dtype=bool))
        mask = tree_attention_mask(c, range(count), range(count), chain, self.dtype, self.device)
        out, self._past = self.head(hidden, ids, pos, self._past, mask, fused=True)
        self._ctx = n - 1
        self._node_out[0] = out[-1]
        return self.head.logits(out[-1:]).float()

    @torch.inference_mode()
    def _level_logits(self, frontier, tokens, parents, depths) -> torch.Tensor:
        self._slots.extend(frontier)
        hidden = torch.stack([self._node_out[parents[v]] for v in frontier])
        ids = torch.as_tensor([tokens[v] for v in frontier], dtype=torch.long, device=self.device)
        pos = torch.as_tensor(
            [self._n - 2 + depths[v] for v in frontier], dtype=torch.long, device=self.device
        )
        mask = tree_attention_mask(
            self._ctx, self._slots, frontier, ancestor_matrix(parents), self.dtype, self.device
        )
        out, self._past = self.head(hidden, ids, pos, self._past, mask, fused=False)
        for i, v in enumerate(frontier):
            self._node_out[v] = out[i]
        return self.head.logits(out).float()

    def _to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(ids)

    @torch.inference_mode()
    def node_states(self) -> torch.Tensor | None:
        """[N, H] the head's state at each node of the tree the last :meth:`grow` returned.

        The state at node ``v`` is the head's output after feeding ``v``'s token at ``v``'s
        position (for the root: the last context pair), the head's stand-in for the target's
        hidden state there. Nodes of the last level were never fed while drafting: they get
        one extra head pass here (its keys are not kept). None when the root was not drafted.
        """
        if 0 not in self._node_out:
            return None
        tokens, parents, depths = self._candidates
        missing = [int(c) for c in self._tree_to_cand if int(c) not in self._node_out]
        if missing:
            hidden = torch.stack([self._node_out[parents[c]] for c in missing])
            ids = torch.as_tensor([tokens[c] for c in missing], dtype=torch.long, device=self.device)
            pos = torch.as_tensor(
                [self._n - 2 + depths[c] for c in missing], dtype=torch.long, device=self.device
            )
            mask = tree_attention_mask(
                self._ctx,
                [*self._slots, *missing],
                missing,
                ancestor_matrix(parents),
                self.dtype,
                self.device,
            )
            out, _ = self.head(hidden, ids, pos, self._past, mask, fused=False)
            for i, c in enumerate(missing):
                self._node_out[c] = out[i]
        return torch.stack([self._node_out[int(c)] for c in self._tree_to_cand])

    def accept(self, path_nodes: Sequence[int]) -> None:
        """Roll the head's cache back to the committed context (accepted tokens are re-fed next grow)."""
        self._truncate(self._ctx)
        self._slots = []


class HeadRouter:
    """Routes head states with the target's own routers: per MoE layer ``l``, the target's
    ``post_attention_layernorm`` of that decoder layer then its router (top-k by router weight).

    Why the head's output state: it exists for every draft node (the fc-projected fused feature
    exists only for committed tokens, whose routing is already known), it is built on the
    residual stream ``fc(target states)`` and trained to predict the next token through an RMS
    norm, like the target's own late states; each layer's RMS norm removes its scale. It is an
    approximation: the head is never trained to match the target's per-layer states.

    Args:
        target: the target model (MoE blocks found by :func:`live.loader.find_moe_blocks`).
    """

    def __init__(self, target: nn.Module) -> None:
        from live.loader import find_moe_blocks

        layers = decoder_layers(target)
        self.parts = [
            (layers[i].post_attention_layernorm, block.gate) for i, block in find_moe_blocks(target)
        ]

    @torch.inference_mode()
    def route(self, states: torch.Tensor) -> np.ndarray:
        """int64[M, L, K] top-k experts per MoE layer of ``states`` [M, H], by descending router weight."""
        out = []
        for norm, gate in self.parts:
            x = norm(states.to(norm.weight.dtype))
            result = gate(x.reshape(-1, x.shape[-1]))
            weights, ids = result[1], result[2]
            order = torch.argsort(weights.float(), dim=-1, descending=True, stable=True)
            out.append(torch.gather(ids, -1, order).cpu().numpy().astype(np.int64))
        return np.stack(out, axis=1)
