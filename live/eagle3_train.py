"""Train an EAGLE-3 head on a target's own hidden states (small, CPU, deterministic).

Objective (EAGLE-3, Li et al. 2025, "training-time test"; SpecForge ``OnlineEagle3Model``):
the target runs each training sequence once; the head sees, at pair ``j``, the fused tapped
states of token ``j`` and the embedding of token ``j + 1`` and is trained with cross-entropy to
predict token ``j + 2`` over its draft vocabulary (tokens outside it are ignored). Unrolled step
``k >= 1`` feeds the head's own step ``k - 1`` outputs instead of target states (shifted one
token), attending causally to the step-0 keys and to its own earlier-step keys at the same
index, predicting token ``j + 2 + k``; this is what the head meets at depth ``k + 1`` of a tree.
The token embedding stays frozen (the reference freezes it). Adam; fixed seed, so with the same
thread count and software the result is byte-for-byte reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from live.eagle3 import Eagle3Head, decoder_layers, default_layer_ids


@torch.no_grad()
def collect_features(target, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int] | None = None):
    """Run the target once per sequence; returns ``[(features [T, 3 Ht] float32, ids int64[T])]``.

    ``layer_ids`` default: the reference taps (:func:`live.eagle3.default_layer_ids`).
    """
    from live.eagle3_draft import TargetFeatures

    ids_list = list(layer_ids or default_layer_ids(len(decoder_layers(target))))
    tap = TargetFeatures(target, ids_list)
    device = next(target.parameters()).device
    out = []
    try:
        for seq in sequences:
            tap.begin_forward()
            target(input_ids=torch.tensor([list(seq)], device=device))
            out.append(
                (tap.forward_features().float().cpu().clone(), torch.tensor(list(seq), dtype=torch.long))
            )
    finally:
        tap.close()
    return out


def _draft_labels(head: Eagle3Head, target_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids of target ids (-100 where outside the draft vocabulary)."""
    t2d = head.t2d.cpu()
    index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], index[target_ids], torch.full_like(target_ids, -100))


def _ttt_mask(t: int, step: int) -> torch.Tensor:
    """Additive mask [1, 1, t, (step + 1) t]: causal over step-0 keys, diagonal over later steps."""
    visible = torch.zeros(t, (step + 1) * t, dtype=torch.bool)
    visible[:, :t] = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for s in range(1, step + 1):
        visible[:, s * t : (s + 1) * t] = torch.eye(t, dtype=torch.bool)
    mask = torch.zeros(visible.shape)
    mask.masked_fill_(~visible, torch.finfo(torch.float32).min)
    return mask[None, None]


def sequence_loss(
    head: Eagle3Head, features: torch.Tensor, ids: torch.Tensor, ttt_steps: int
) -> torch.Tensor:
    """Mean cross-entropy over the unrolled steps for one sequence (features [T, 3 Ht], ids [T]).

    Every step covers the same ``n = T - ttt_steps`` pairs, so step ``s`` has every token it needs
    (``ids[1 + s + j]`` as input, ``ids[2 + s + j]`` as label for ``j < n - 1``).
    """
    n = ids.shape[0] - max(ttt_steps, 1)
    if n < 2:
        return features.sum() * 0.0
    losses = []
    hidden, fused, past = features[:n], True, None
    for step in range(ttt_steps):
        out, past = head(
            hidden,
            ids[1 + step : 1 + step + n],
            torch.arange(step, step + n),
            past,
            _ttt_mask(n, step),
            fused=fused,
        )
        labels = _draft_labels(head, ids[2 + step : 1 + step + n])
        if (labels >= 0).any():
            losses.append(F.cross_entropy(head.logits(out[: n - 1]), labels, ignore_index=-100))
        hidden, fused = out, False
    return torch.stack(losses).mean() if losses else features.sum() * 0.0


def train_head(
    head: Eagle3Head,
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float = 3e-3,
    ttt_steps: int = 3,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``head`` in place on ``data`` (from :func:`collect_features`); returns the loss per step.

    One optimiser step per sequence, cycling through ``data`` in a seeded order.
    """
    torch.manual_seed(seed)
    head.train()
    for p in head.embed_tokens.parameters():
        p.requires_grad_(False)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.Adam(params, lr=lr)
    order = np.random.default_rng(seed).permutation(len(data))
    losses = []
    for step in range(steps):
        feats, ids = data[int(order[step % len(order)])]
        loss = sequence_loss(head, feats, ids, ttt_steps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    head.eval()
    return losses
