"""Train an EAGLE-3 head on a target's own hidden states (small, CPU, deterministic).

Objective (EAGLE-3, Li et al. 2025, "training-time test"; SpecForge ``OnlineEagle3Model``):
the target runs each training sequence once; the head sees, at pair ``j``, the fused tapped
states of token ``j`` and the embedding of token ``j + 1`` and is trained with soft
cross-entropy against the target's own next-token distribution after token ``j + 1``, restricted
to the draft vocabulary and renormalised (SpecForge's target-probability labels). Unrolled step
``k >= 1`` feeds the head's own step ``k - 1`` outputs instead of target states (shifted one
token), attending causally to the step-0 keys and to its own earlier-step keys at the same
index, predicting the token after ``j + 1 + k``; this is what the head meets at depth ``k + 1`` of a tree.
The token embedding stays frozen (the reference freezes it). Adam; fixed seed, so with the same
thread count and software the result is byte-for-byte reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from live.eagle3 import Eagle3Head, decoder_layers, default_layer_ids


@torch.no_grad()
def collect_features(target, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int] | None = None):
    """Run the target once per sequence; returns ``[(features [T, 3 Ht], ids int64[T], logp [T, V])]``.

    ``logp`` are the target's next-token log-probabilities (float32), the soft labels of the
    head's loss. ``layer_ids`` default: the reference taps (:func:`live.eagle3.default_layer_ids`).
    """
    from live.eagle3_draft import TargetFeatures

    ids_list = list(layer_ids or default_layer_ids(len(decoder_layers(target))))
    tap = TargetFeatures(target, ids_list)
    device = next(target.parameters()).device
    out = []
    try:
        for seq in sequences:
            tap.begin_forward()
            logits = target(input_ids=torch.tensor([list(seq)], device=device)).logits[0]
            feats = tap.forward_features().float().cpu().clone()
            logp = torch.log_softmax(logits.float(), dim=-1).cpu().clone()
            out.append((feats, torch.tensor(list(seq), dtype=torch.long), logp))
    finally:
        tap.close()
    return out


def _soft_labels(head: Eagle3Head, logp: torch.Tensor) -> torch.Tensor:
    """Target probabilities restricted to the draft vocabulary and renormalised, [T, Vd]."""
    return torch.softmax(logp[:, head.t2d.cpu()], dim=-1)


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
    head: Eagle3Head, features: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, ttt_steps: int
) -> torch.Tensor:
    """Mean soft cross-entropy over the unrolled steps for one sequence.

    Args:
        features [T, 3 Ht], ids int64[T], logp [T, V]: from :func:`collect_features`.

    Every step covers the same ``n = T - ttt_steps`` pairs, so step ``s`` has every token it needs
    (``ids[1 + s + j]`` as input; the target's distribution after token ``1 + s + j`` as label
    for ``j < n - 1``, SpecForge's soft-label loss).
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
        labels = _soft_labels(head, logp[1 + step : step + n])
        losses.append(-(labels * F.log_softmax(head.logits(out[: n - 1]), dim=-1)).sum(-1).mean())
        hidden, fused = out, False
    return torch.stack(losses).mean()


def train_head(
    head: Eagle3Head,
    batches: Callable[[int], Sequence[tuple[torch.Tensor, torch.Tensor]]],
    *,
    steps: int,
    lr: float | Callable[[int], float] = 3e-3,
    ttt_steps: int = 3,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``head`` in place; returns the mean loss per step.

    Args:
        batches: ``batches(step)`` -> the step's sequences, each ``(features, ids, logp)`` as
            :func:`collect_features` returns them.
        steps: optimiser steps (Adam, gradient norm clipped to 1).
        lr: a learning rate, or ``lr(step)`` for a schedule.
        ttt_steps: unrolled training-time-test steps (see module docstring).
        seed: seeds torch before training (deterministic on one thread).
    """
    torch.manual_seed(seed)
    head.train()
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    for p in head.embed_tokens.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(params, lr=lr if isinstance(lr, float) else lr(0))
    losses = []
    for step in range(steps):
        if not isinstance(lr, float):
            for group in opt.param_groups:
                group["lr"] = lr(step)
        batch = batches(step)
        loss = torch.stack([sequence_loss(head, f, i, lp, ttt_steps) for f, i, lp in batch]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    head.eval()
    return losses
