"""Train the embedded EAGLE-3 head for the embedded default target (``live/assets/default/eagle3``).

``python -m live.train_eagle3 --out live/assets/default/eagle3`` rebuilds the shipped head byte
for byte (same flags, same ``--threads``, same software versions). Steps:

1. Text: the same corpus and hold-out split as the default models (:func:`live.train_default.read_corpus`,
   the Python 3.11 documentation of Debian's ``python3.11-doc``), tokenized with the shipped
   target's tokenizer.
2. Features: the shipped target (``live/assets/default/target``, float32) runs each training
   window once; hooks take the inputs of decoder layers ``2, L // 2, L - 3`` (the EAGLE-3
   reference taps, :func:`live.eagle3.default_layer_ids`).
   ``--pool-windows`` random training windows are run once and their states kept.
3. Head: one Llama decoder layer of the target's width with the target's token embedding (not
   saved: the loader takes the target's), the full 2,048-token vocabulary (``d2t`` all zero),
   trained with :func:`live.eagle3_train.train_head` (cross-entropy on the target's text with
   ``--ttt-steps`` unrolled training-time-test steps, Adam, warm-up then cosine learning rate).
4. Saved in bfloat16 in the EAGLE/SpecForge layout (:func:`live.eagle3.save_head`), reloaded and
   evaluated on held-out text: greedy agreement of the head's next-next-token prediction with the
   target's greedy token, beside the same figure for the 2-layer draft. Figures go to
   ``metrics.json`` and ``MODEL_CARD.md`` in ``--out``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specfit.cli import ArgumentParser, cli_main, positive_float, positive_int, print_summary, run_main


@dataclass(frozen=True)
class HeadTrainConfig:
    """Everything that determines the head's weights (recorded in ``metrics.json``)."""

    seed: int = 0
    steps: int = 600
    lr: float = 3e-3
    warmup_steps: int = 30
    seq_len: int = 128
    batch_size: int = 4
    pool_windows: int = 96
    ttt_steps: int = 3
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    eval_windows: int = 16


def build_parser() -> ArgumentParser:
    """The ``python -m live.train_eagle3`` flags (defaults: :class:`HeadTrainConfig`)."""
    from live.train_default import DEFAULT_DOCS_DIR

    d = HeadTrainConfig()
    p = ArgumentParser(prog="python -m live.train_eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=Path("runs/train_eagle3"), help="output folder (live/assets/default/eagle3 "
        "replaces the shipped head)"
    )  # fmt: skip
    p.add_argument(
        "--target", type=Path, default=None, help="target checkpoint (default: the embedded target)"
    )
    p.add_argument(
        "--docs-dir", type=Path, default=DEFAULT_DOCS_DIR, help="Python documentation reST sources"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (weights, windows)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimiser steps")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="peak learning rate")
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len, help="training window (tokens)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="windows per step")
    p.add_argument(
        "--ttt-steps", type=positive_int, default=d.ttt_steps, help="unrolled training-time-test steps"
    )
    p.add_argument(
        "--pool-windows",
        type=positive_int,
        default=d.pool_windows,
        help="training windows run once through the target (count)",
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (results depend on it)")
    p.add_no_progress()
    return p


def reproduce_command(cfg: HeadTrainConfig, threads: int) -> str:
    """The command that rebuilds the shipped head with ``cfg``."""
    flags = {
        "--seed": cfg.seed,
        "--steps": cfg.steps,
        "--lr": cfg.lr,
        "--seq-len": cfg.seq_len,
        "--batch-size": cfg.batch_size,
        "--pool-windows": cfg.pool_windows,
        "--ttt-steps": cfg.ttt_steps,
        "--threads": threads,
    }
    return "python -m live.train_eagle3 --out live/assets/default/eagle3 " + " ".join(
        f"{k} {v}" for k, v in flags.items()
    )


def _windows(stream, seq_len: int, count: int, gen) -> list[list[int]]:
    import torch

    starts = torch.randint(0, stream.numel() - seq_len - 1, (count,), generator=gen).tolist()
    return [stream[s : s + seq_len].tolist() for s in starts]


def head_agreement(head, target, windows: Sequence[Sequence[int]]) -> float:
    """Fraction of positions where the head's top-1 (from the target's states of token ``j`` and
    token ``j + 1``) equals the target's greedy token after ``j + 1``: the depth-1 acceptance of
    a chain drafter when the target follows its own text."""
    import torch

    from live.eagle3_train import _ttt_mask, collect_features

    hits = total = 0
    with torch.no_grad():
        for (feats, ids, _), seq in zip(
            collect_features(target, windows, head.config.layer_ids), windows, strict=True
        ):
            greedy = target(input_ids=torch.tensor([list(seq)])).logits[0].argmax(-1)
            n = len(seq) - 1
            chain = _ttt_mask(n, 0)  # causal over the window
            out, _ = head(feats[:n], ids[1:], torch.arange(n), None, chain, fused=True)
            pred = head.to_target_ids(head.logits(out).argmax(-1))
            hits += int((pred[: n - 1] == greedy[1:n]).sum())
            total += n - 1
    return hits / max(total, 1)


def draft_agreement(draft, target, windows: Sequence[Sequence[int]]) -> float:
    """The same figure for a causal-LM draft: its argmax after token ``j + 1`` vs the target's."""
    import torch

    hits = total = 0
    with torch.no_grad():
        for seq in windows:
            ids = torch.tensor([list(seq)])
            t, d = target(input_ids=ids).logits[0].argmax(-1), draft(input_ids=ids).logits[0].argmax(-1)
            hits += int((t[1:] == d[1:]).sum())
            total += len(seq) - 1
    return hits / max(total, 1)


def train(cfg: HeadTrainConfig, target, stream, progress: bool = True):
    """Train a head for ``target`` on windows of ``stream``; returns (head, losses).

    The target runs once over ``cfg.pool_windows`` random windows (their tapped states are kept);
    every step draws ``cfg.batch_size`` of them (seeded).
    """
    import torch

    from live.eagle3 import random_head
    from live.eagle3_train import collect_features, train_head
    from live.train_default import _lr_at, _progress

    head = random_head(
        target.config,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        seed=cfg.seed,
        own_embedding=False,
    )
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    gen = torch.Generator().manual_seed(cfg.seed + 11)
    pool = collect_features(target, _windows(stream, cfg.seq_len, cfg.pool_windows, gen))
    bar = _progress(cfg.steps, "eagle3 head", progress)

    def batches(step: int):
        picks = torch.randint(0, len(pool), (cfg.batch_size,), generator=gen).tolist()
        return [pool[i] for i in picks]

    def report(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    losses = train_head(
        head,
        batches,
        steps=cfg.steps,
        lr=lambda step: _lr_at(step, cfg.steps, cfg.lr, cfg.warmup_steps),
        ttt_steps=cfg.ttt_steps,
        seed=cfg.seed,
        progress=report,
    )
    bar.close()
    return head, losses


def save_bf16(head, out: Path, extra: dict[str, Any]) -> Path:
    """Save ``head`` in bfloat16 (the shipped precision) in the trainers' layout."""
    import copy

    import torch

    from live.eagle3 import save_head

    half = copy.deepcopy(head)
    for module in (half.fc, half.midlayer, half.norm, half.lm_head):
        module.to(torch.bfloat16)
    return save_head(half, out, extra_config=extra)


def _run(cfg: HeadTrainConfig, args, parser) -> int:
    import torch

    from live.assets import default_model_paths
    from live.eagle3 import load_head
    from live.train_default import (
        _sha256,
        _versions,
        checkpoint_bytes,
        encode_stream,
        load_checkpoint,
        read_corpus,
    )

    torch.set_num_threads(args.threads)
    target_dir, draft_dir = default_model_paths()
    target_dir = args.target or target_dir
    try:
        train_texts, heldout_texts = read_corpus(args.docs_dir, 10)
    except FileNotFoundError as exc:
        parser.fail("--docs-dir", str(exc).removeprefix("--docs-dir: "))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
    target = load_checkpoint(target_dir)
    started = time.perf_counter()
    head, losses = train(cfg, target, encode_stream(tokenizer, train_texts), progress=not args.no_progress)
    train_s = time.perf_counter() - started
    out = save_bf16(head, args.out, {"eagle3_trained_by": reproduce_command(cfg, args.threads)})
    reloaded = load_head(out, target)
    gen = torch.Generator().manual_seed(cfg.seed + 99)
    windows = _windows(encode_stream(tokenizer, heldout_texts), cfg.seq_len, cfg.eval_windows, gen)
    metrics = {
        "config": asdict(cfg),
        "command": reproduce_command(cfg, args.threads),
        "train_s": train_s,
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "heldout_agreement_head": head_agreement(reloaded, target, windows),
        "heldout_agreement_draft": draft_agreement(load_checkpoint(draft_dir), target, windows),
        "weights_sha256": _sha256(out / "model.safetensors"),
        "size_bytes": checkpoint_bytes(out),
        "software": _versions(),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if (out.parent / "metrics.json").is_file() and (out.parent / "MODEL_CARD.md").is_file():
        from live.train_default import write_model_card  # the default models' card gets the head's section

        write_model_card(out.parent, json.loads((out.parent / "metrics.json").read_text()))
    print_summary({k: v for k, v in metrics.items() if not isinstance(v, dict)})
    return 0


DRAFTERS_FILE = "drafters.json"
"""Beside the head: ``benchmarks/drafters.py --save`` output (both drafters, per category)."""


def eagle3_card_section(head_dir: Path) -> str:
    """The model card's EAGLE-3 section from ``head_dir/metrics.json`` (and ``drafters.json`` when
    measured); empty without a head."""
    file = head_dir / "metrics.json"
    if not file.is_file():
        return ""
    m = json.loads(file.read_text())
    cfg = m["config"]
    text = f"""
## EAGLE-3 head (`eagle3/`)
Generated by `live/train_eagle3.py`; reproduce with:

    {m["command"]}

One Llama decoder layer (hidden 128, {cfg["num_heads"]} query / {cfg["num_kv_heads"]} key-value heads, MLP
{cfg["intermediate_size"]}) over `cat(token embedding, fc(target states at the inputs of layers 2, 3, 3))`
(the reference taps 2, L//2, L-3 of the 6-layer target), the full 2,048-token vocabulary, the
target's own embedding (not saved). Trained on the same corpus as the models above: the target
ran {cfg["pool_windows"]} training windows of {cfg["seq_len"]} tokens once; {cfg["steps"]} Adam steps of
{cfg["batch_size"]} windows against the target's next-token distributions with {cfg["ttt_steps"]}
training-time-test steps; {m["train_s"]:.0f} s on the shared 2-core CPU. Size {m["size_bytes"]:,} B (bfloat16);
SHA-256 of `model.safetensors`: `{m["weights_sha256"]}`.

| figure (held-out text) | EAGLE-3 head | 2-layer draft |
|---|---|---|
| greedy agreement with the target (next token after the one the head is given) | {m["heldout_agreement_head"]:.3f} | {m["heldout_agreement_draft"]:.3f} |
"""
    bench = head_dir / DRAFTERS_FILE
    if bench.is_file():
        b = json.loads(bench.read_text())
        text += f"""
Measured live (`{b["command"]}`; {b["note"]}): tau (committed tokens per cycle, bonus
included), acceptance alpha_d = accepted(d) / reached(d) per depth d (a cycle reached d when its
accepted path got to d-1 and verification judged a draft token below it, docs/metrics.md; policy
`full`: the whole tree verified) and decode tokens/s, per prompt category:

| drafter | policy | category | tau | tokens/s | alpha_1..alpha_{b["depth"]} |
|---|---|---|---|---|---|
"""
        for key, cats in b["results"].items():
            kind, policy = key.split("/")
            for cat, f in cats.items():
                alphas = " ".join("-" if a is None or a != a else f"{a:.2f}" for a in f["accept_depth"])
                text += (
                    f"| {kind} | {policy} | {cat} | {f['tau']:.2f} | {f['tokens_per_s']:.2f} | {alphas} |\n"
                )
    from live.assets import DEFAULT_DRAFT_KIND

    text += f"""
`python -m live.record --model default` drafts with: **{DEFAULT_DRAFT_KIND}**
(`live.assets.DEFAULT_DRAFT_KIND`; the head becomes the default only when it beats the 2-layer
draft in measured tokens/s at the default link; `--draft live/assets/default/draft` or
`--draft live/assets/default/eagle3` selects either).
"""
    return text


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Train, save and evaluate the embedded head; the last stdout line is a JSON summary."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = HeadTrainConfig(
        seed=args.seed,
        steps=args.steps,
        lr=args.lr,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        pool_windows=args.pool_windows,
        ttt_steps=args.ttt_steps,
    )
    return _run(cfg, args, parser)


if __name__ == "__main__":
    run_main(main)
