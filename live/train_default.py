"""Train the embedded default models: a tiny Qwen3-MoE target and a tiny dense Qwen3 draft.

``python -m live.train_default --out live/assets/default`` reproduces the shipped checkpoints
from ``--seed`` in minutes on a CPU. Steps:

1. Text: the reST sources of the Python documentation from Debian's ``python3.11-doc`` package
   (``/usr/share/doc/python3.11/html/_sources``), lightly cleaned of markup (:func:`clean_rst`).
   The pages of the modules whose docstrings make the default prompts are held out
   (:func:`live.prompts.heldout_doc_pages`), and so is every page whose path hashes (CRC-32) to 0
   modulo ``TrainConfig.heldout_modulus`` (10); the held-out pages give the evaluation figures. The text is
   read at training time and never committed.
2. Tokenizer: byte-level BPE trained with ``tokenizers`` (``--vocab-size``), one special token
   ``<|endoftext|>`` (EOS, also the padding token), saved as ``tokenizer.json`` +
   ``tokenizer_config.json`` in both checkpoint folders.
3. Target: transformers' stock ``Qwen3MoeForCausalLM`` with fine-grained experts (64 experts per
   layer, top-4), trained on next-token cross-entropy plus a per-layer Switch-Transformer
   load-balancing loss (Fedus et al. 2021, eq. 4-6; ``--aux-loss-coef``) so that no expert dies
   while routing stays non-uniform. Training runs transformers' own ``grouped_mm`` experts
   implementation (the same weights give the same logits as the ``eager`` loop; tested).
4. Draft: a dense ``Qwen3ForCausalLM`` sharing the tokenizer, trained by distillation
   (KL(target || draft) on the target's next-token distributions, Hinton et al. 2015).
5. Both are saved in bfloat16 safetensors, reloaded with the stock classes, and evaluated on the
   held-out text: loss against the unigram baseline, expert-load entropy per layer, draft greedy
   agreement with the target. The figures go to ``metrics.json`` and ``MODEL_CARD.md``.
"""

from __future__ import annotations

import json
import math
import platform
import re
import shutil
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specfit.cli import ArgumentParser, cli_main, positive_float, positive_int, print_summary, run_main

DEFAULT_DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
DOCS_INSTALL_HINT = "apt-get update && apt-get install -y python3.11-doc"
EOS_TOKEN = "<|endoftext|>"
MAX_TOTAL_BYTES = 25_000_000  # both checkpoints with tokenizers, the budget (25 MB)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (recorded in ``metrics.json``).

    Sizes are counts; learning rates are per step (AdamW); ``seq_len`` in tokens.
    """

    seed: int = 0
    vocab_size: int = 2048
    seq_len: int = 256
    batch_size: int = 8
    # target (Qwen3-MoE)
    target_layers: int = 6
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 64
    top_k: int = 4
    moe_intermediate_size: int = 64
    target_steps: int = 800
    target_lr: float = 3e-3
    aux_loss_coef: float = 0.003
    # draft (dense Qwen3)
    draft_layers: int = 2
    draft_intermediate_size: int = 384
    draft_steps: int = 500
    draft_lr: float = 3e-3
    # data and evaluation
    heldout_modulus: int = 10
    eval_windows: int = 32
    eval_prompts: int = 8
    eval_new_tokens: int = 32
    warmup_steps: int = 50
    max_position_embeddings: int = 1024


# ---------------------------------------------------------------------------------------------
# Text


_UNDERLINE_RE = re.compile(r"^\s*([=\-~*^#\"'`+.:_])\1{2,}\s*$")
_DIRECTIVE_RE = re.compile(r"^\s*\.\. ")
_FIELD_RE = re.compile(r"^\s*:[\w -]+:(\s.*)?$")
_ROLE_RE = re.compile(r":[\w:+-]+:`([^`]*?)`")
_LINK_RE = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{1,2}")
_LITERAL_RE = re.compile(r"``(.+?)``")
_STRONG_RE = re.compile(r"\*\*(.+?)\*\*")


def _role_text(match: re.Match[str]) -> str:
    """Visible text of an inline role: ``title <target>`` -> title; ``~a.b`` -> a.b."""
    text = re.sub(r"\s*<[^>]*>$", "", match.group(1))
    return text.lstrip("~!")


def clean_rst(text: str) -> str:
    """reST source -> plain text: drops section underlines, directive and field lines; keeps
    the visible text of roles, links and literals; collapses runs of blank lines."""
    lines = []
    for line in text.splitlines():
        if _UNDERLINE_RE.match(line) or _DIRECTIVE_RE.match(line) or _FIELD_RE.match(line):
            continue
        line = _ROLE_RE.sub(_role_text, line)
        line = _LINK_RE.sub(r"\1", line)
        line = _LITERAL_RE.sub(r"\1", line)
        line = _STRONG_RE.sub(r"\1", line)
        lines.append(line.rstrip())
    out = re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
    return out.strip() + "\n"


def list_doc_pages(docs_dir: Path) -> list[Path]:
    """The ``*.rst.txt`` pages under ``docs_dir``, sorted.

    Raises ``FileNotFoundError`` with the install command when the docs are absent.
    """
    pages = sorted(docs_dir.rglob("*.rst.txt")) if docs_dir.is_dir() else []
    if not pages:
        raise FileNotFoundError(
            f"--docs-dir: no Python documentation sources (*.rst.txt) under {docs_dir}; "
            f"install Debian's python3.11-doc package: {DOCS_INSTALL_HINT}"
        )
    return pages


def is_heldout(rel_path: str, modulus: int) -> bool:
    """True for a held-out page: a prompt module's page, or CRC-32(path) % modulus == 0."""
    from live.prompts import heldout_doc_pages

    return rel_path in heldout_doc_pages() or zlib.crc32(rel_path.encode()) % modulus == 0


def read_corpus(docs_dir: Path, modulus: int) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts), each a list of cleaned pages in sorted path order."""
    train, heldout = [], []
    for page in list_doc_pages(docs_dir):
        rel = page.relative_to(docs_dir).as_posix()
        text = clean_rst(page.read_text(encoding="utf-8", errors="replace"))
        (heldout if is_heldout(rel, modulus) else train).append(text)
    return train, heldout


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE (GPT-2 pre-tokenisation) trained on ``texts``; returns a
    ``PreTrainedTokenizerFast`` with EOS = pad = ``<|endoftext|>`` (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def encode_stream(tokenizer: Any, texts: Sequence[str]) -> Any:
    """All ``texts`` as one int64 tensor of token ids, each page followed by EOS."""
    import torch

    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts)):
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Models


def target_config(cfg: TrainConfig, eos_id: int) -> Any:
    """The ``Qwen3MoeConfig`` of the default target (every layer sparse, tied embeddings)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=4 * cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.target_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        router_aux_loss_coef=cfg.aux_loss_coef,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def draft_config(cfg: TrainConfig, eos_id: int) -> Any:
    """The ``Qwen3Config`` of the default draft (dense, same vocabulary, tied embeddings)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.draft_intermediate_size,
        num_hidden_layers=cfg.draft_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def per_layer_balance_loss(router_logits: Sequence[Any], top_k: int) -> Any:
    """Mean over layers of the Switch-Transformer balance loss ``E * sum_i f_i * P_i``.

    ``router_logits``: one ``[T, E]`` tensor per layer; ``f_i`` = fraction of the T*top_k
    assignments that go to expert i, ``P_i`` = mean router probability of expert i. Equals
    ``top_k`` for perfectly uniform routing. Per layer (unlike transformers'
    ``load_balancing_loss_func``, which pools the layers) so no layer can starve an expert.
    """
    import torch

    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        num_experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices
        frac = (
            torch.zeros(num_experts).scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
            / probs.shape[0]
        )
        losses.append(num_experts * torch.sum(frac * probs.mean(dim=0)))
    return torch.stack(losses).mean()


def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10 % of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _optimizer(model: Any, lr: float) -> Any:
    """AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only): norms and the MoE routers
    (``mlp.gate.weight``) are not decayed, so routing can sharpen."""
    import torch

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.ndim >= 2 and not name.endswith("mlp.gate.weight") else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def _batch(stream: Any, cfg: TrainConfig, gen: Any) -> tuple[Any, Any]:
    """Random windows: inputs and next-token labels, both ``int64[batch, seq_len]``."""
    import torch

    starts = torch.randint(0, stream.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    windows = torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def _progress(total: int, desc: str, show: bool = True) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True, disable=not show)


def train_target(
    cfg: TrainConfig, stream: Any, eos_id: int, progress: bool = True
) -> tuple[Any, list[float]]:
    """Train the MoE target; returns (model in float32, loss per step). ``progress``: a bar on stderr."""
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(cfg.seed)
    model = Qwen3MoeForCausalLM(target_config(cfg, eos_id))
    model.set_experts_implementation("grouped_mm")
    model.train()
    opt = _optimizer(model, cfg.target_lr)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    with _progress(cfg.target_steps, "target", progress) as bar:
        for step in range(cfg.target_steps):
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg.target_steps, cfg.target_lr, cfg.warmup_steps)
            x, y = _batch(stream, cfg, gen)
            out = model(input_ids=x, output_router_logits=True, use_cache=False)
            ce = F.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
            loss = ce + cfg.aux_loss_coef * per_layer_balance_loss(out.router_logits, cfg.top_k)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(ce.item())
            bar.update(1)
            bar.set_postfix(ce=f"{ce.item():.3f}")
    model.eval()
    return model, losses


def train_draft(
    cfg: TrainConfig, stream: Any, target: Any, eos_id: int, progress: bool = True
) -> tuple[Any, list[float]]:
    """Distil the dense draft from ``target`` (KL(target || draft) per token); returns
    (model in float32, KL per step in nats). ``progress``: a bar on stderr."""
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(cfg.seed + 2)
    model = Qwen3ForCausalLM(draft_config(cfg, eos_id))
    model.train()
    opt = _optimizer(model, cfg.draft_lr)
    gen = torch.Generator().manual_seed(cfg.seed + 3)
    losses = []
    with _progress(cfg.draft_steps, "draft", progress) as bar:
        for step in range(cfg.draft_steps):
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg.draft_steps, cfg.draft_lr, cfg.warmup_steps)
            x, _ = _batch(stream, cfg, gen)
            with torch.no_grad():
                teacher = F.log_softmax(target(input_ids=x, use_cache=False).logits, dim=-1)
            student = F.log_softmax(model(input_ids=x, use_cache=False).logits, dim=-1)
            kl = F.kl_div(
                student.reshape(-1, cfg.vocab_size),
                teacher.reshape(-1, cfg.vocab_size),
                log_target=True,
                reduction="batchmean",
            )
            opt.zero_grad(set_to_none=True)
            kl.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(kl.item())
            bar.update(1)
            bar.set_postfix(kl=f"{kl.item():.3f}")
    model.eval()
    return model, losses


# ---------------------------------------------------------------------------------------------
# Saving and evaluation


def save_checkpoint(model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Save ``model`` in bfloat16 safetensors plus the tokenizer into ``out_dir`` (replaced)."""
    import torch

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.to(torch.float32)
    tokenizer.save_pretrained(out_dir)


def _sha256(path: Path) -> str:
    """Hex SHA-256 of a file (to compare a reproduction with the shipped weights)."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkpoint_bytes(folder: Path) -> int:
    """Total size in bytes of the files in ``folder``."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def load_checkpoint(folder: Path) -> Any:
    """Load a saved checkpoint with the stock Auto class in float32 (safetensors only)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, use_safetensors=True, trust_remote_code=False, dtype=torch.float32
    )
    return model.eval()


def unigram_loss(train_stream: Any, eval_tokens: Any, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of ``eval_tokens`` under add-one-smoothed training unigrams."""
    import torch

    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[eval_tokens].mean())


def expert_load_stats(counts: Any) -> list[dict[str, float]]:
    """Per-layer load figures from assignment counts ``int[L, E]``.

    ``entropy_bits`` of the load distribution, ``normalized_entropy`` = entropy / log2(E),
    ``min_load``/``max_load`` = least/most loaded expert's share times E (1.0 = uniform share),
    ``dead_experts`` = experts with no assignment.
    """
    stats = []
    for row in counts.double():
        frac = row / row.sum()
        nz = frac[frac > 0]
        entropy = float(-(nz * nz.log2()).sum())
        num_experts = row.numel()
        stats.append(
            {
                "entropy_bits": entropy,
                "normalized_entropy": entropy / math.log2(num_experts),
                "min_load": float(frac.min() * num_experts),
                "max_load": float(frac.max() * num_experts),
                "dead_experts": int((row == 0).sum()),
            }
        )
    return stats


def evaluate(
    cfg: TrainConfig,
    target: Any,
    draft: Any,
    train_stream: Any,
    heldout: Any,
    prompts: Sequence[Any],
    tokenizer: Any,
) -> dict[str, Any]:
    """Held-out figures of the reloaded checkpoints.

    ``heldout``: int64 token stream of the held-out pages; its first ``cfg.eval_windows`` windows
    of ``seq_len`` tokens are scored. Returns losses in nats/token (target, draft, and the
    add-one unigram baseline fitted on ``train_stream``), the draft's greedy (argmax) agreement
    with the target on that text and on the target's greedy continuations of ``prompts``
    (:func:`_generation_agreement`), expert load per layer (:func:`expert_load_stats`) and the
    expert-union growth (:func:`expert_union_growth`).
    """
    import torch
    import torch.nn.functional as F

    num = min(cfg.eval_windows, heldout.numel() // (cfg.seq_len + 1))
    windows = heldout[: num * (cfg.seq_len + 1)].view(num, cfg.seq_len + 1)
    x, y = windows[:, :-1], windows[:, 1:]
    counts = torch.zeros(cfg.target_layers, cfg.num_experts, dtype=torch.int64)
    chosen_all = []  # per window: int[L, seq_len, K]
    t_loss = d_loss = agree = 0.0
    with torch.no_grad():
        for i in range(num):
            out = target(input_ids=x[i : i + 1], output_router_logits=True, use_cache=False)
            chosen = torch.stack([torch.topk(lg, cfg.top_k, dim=-1).indices for lg in out.router_logits])
            chosen_all.append(chosen)
            for layer in range(chosen.shape[0]):
                counts[layer] += torch.bincount(chosen[layer].reshape(-1), minlength=cfg.num_experts)
            d_logits = draft(input_ids=x[i : i + 1], use_cache=False).logits
            t_loss += float(F.cross_entropy(out.logits[0], y[i]))
            d_loss += float(F.cross_entropy(d_logits[0], y[i]))
            agree += float((out.logits[0].argmax(-1) == d_logits[0].argmax(-1)).double().mean())
        gen_agree = _generation_agreement(cfg, target, draft, prompts, tokenizer)
    layers = expert_load_stats(counts)
    return {
        "heldout_tokens": int(num * cfg.seq_len),
        "target_heldout_loss_nats": t_loss / num,
        "draft_heldout_loss_nats": d_loss / num,
        "unigram_heldout_loss_nats": unigram_loss(train_stream, y.reshape(-1), cfg.vocab_size),
        "draft_agreement_heldout_text": agree / num,
        "draft_agreement_target_greedy": gen_agree,
        "expert_load": layers,
        "expert_union_by_tokens": expert_union_growth(torch.stack(chosen_all), cfg.num_experts),
        "min_normalized_entropy": min(s["normalized_entropy"] for s in layers),
        "max_normalized_entropy": max(s["normalized_entropy"] for s in layers),
        "dead_experts_total": sum(s["dead_experts"] for s in layers),
    }


UNION_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def expert_union_growth(chosen: Any, num_experts: int) -> dict[str, dict[str, float]]:
    """Mean number of distinct experts per layer that ``n`` consecutive tokens route to.

    ``chosen``: ``int[W, L, S, K]`` top-k expert ids of ``W`` windows of ``S`` tokens. For each
    ``n`` in :data:`UNION_TOKEN_COUNTS` (``n`` <= S) the windows are cut into blocks of ``n``
    tokens; the figure is the union size averaged over blocks and layers, beside
    ``independent = E * (1 - (1 - K/E)**n)``, the expectation if every token drew its ``K``
    experts uniformly and independently (a smaller measured union means locality: consecutive
    tokens share experts, as in real MoE models).
    """
    import torch

    num_windows, num_layers, seq_len, k = chosen.shape
    onehot = torch.zeros(num_windows, num_layers, seq_len, num_experts, dtype=torch.bool)
    onehot.scatter_(3, chosen, True)
    growth = {}
    for n in UNION_TOKEN_COUNTS:
        if n > seq_len:
            break
        blocks = onehot[:, :, : (seq_len // n) * n].reshape(
            num_windows, num_layers, seq_len // n, n, num_experts
        )
        union = blocks.any(dim=3).sum(dim=-1).double()
        growth[str(n)] = {
            "measured": float(union.mean()),
            "independent": num_experts * (1.0 - (1.0 - k / num_experts) ** n),
        }
    return growth


def _generation_agreement(
    cfg: TrainConfig, target: Any, draft: Any, prompts: Sequence[Any], tokenizer: Any
) -> float:
    """Fraction of the target's greedy continuations (``eval_new_tokens`` per prompt) that the
    draft predicts greedily with the target's own prefix (teacher forcing)."""
    import torch

    hits = total = 0
    for prompt in prompts[: cfg.eval_prompts]:
        ids = torch.tensor([tokenizer(prompt.text)["input_ids"]])
        seq = ids
        for _ in range(cfg.eval_new_tokens):
            nxt = target(input_ids=seq, use_cache=False).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        d_pred = draft(input_ids=seq[:, :-1], use_cache=False).logits[0].argmax(-1)
        start = ids.shape[1] - 1
        hits += int((d_pred[start:] == seq[0, start + 1 :]).sum())
        total += seq.shape[1] - ids.shape[1]
    return hits / max(1, total)


# ---------------------------------------------------------------------------------------------
# Model card


def write_model_card(out_dir: Path, metrics: dict[str, Any]) -> Path:
    """Write ``MODEL_CARD.md`` in ``out_dir`` from ``metrics`` (the ``metrics.json`` content)."""
    cfg, ev, sizes = metrics["config"], metrics["eval"], metrics["sizes_bytes"]
    rows = "\n".join(
        f"| {i} | {s['entropy_bits']:.3f} | {s['normalized_entropy']:.3f} | {s['min_load']:.3f} | "
        f"{s['max_load']:.3f} | {s['dead_experts']} |"
        for i, s in enumerate(ev["expert_load"])
    )
    union = ev.get("expert_union_by_tokens", {})
    union_rows = "\n".join(
        f"| {n} | {u['measured']:.1f} | {u['independent']:.1f} |" for n, u in union.items()
    )
    text = f"""# Embedded default models (target + draft)

Generated by `live/train_default.py`; do not edit by hand. Reproduce with:

    {metrics["command"]}

It needs Debian's `python3.11-doc` (`{DOCS_INSTALL_HINT}`). Training took
{metrics.get("train_s", float("nan")):.0f} s on a shared 2-core {metrics["machine"]} with `--threads {metrics["threads"]}`
(torch {metrics["versions"]["torch"]}, transformers {metrics["versions"]["transformers"]}).

## Models
- `target/`: `Qwen3MoeForCausalLM`, {cfg["target_layers"]} layers, all sparse; {cfg["num_experts"]} experts per layer,
  top-{cfg["top_k"]} routing (softmax, renormalised top-k), hidden {cfg["hidden_size"]}, expert intermediate
  {cfg["moe_intermediate_size"]}, {cfg["num_heads"]} query / {cfg["num_kv_heads"]} key-value heads of {cfg["head_dim"]}, tied embeddings;
  {metrics["params"]["target"]:,} parameters, of which {metrics["params"]["target_experts"]:,} in experts.
- `draft/`: dense `Qwen3ForCausalLM`, {cfg["draft_layers"]} layers, hidden {cfg["hidden_size"]}, MLP {cfg["draft_intermediate_size"]},
  tied embeddings; {metrics["params"]["draft"]:,} parameters; distilled from the target.
- Tokenizer (identical in both folders): byte-level BPE, {cfg["vocab_size"]} tokens, trained with `tokenizers`;
  `<|endoftext|>` (id {metrics["eos_token_id"]}) is EOS and padding.
- Weights in bfloat16 safetensors. Sizes: target {sizes["target"]:,} B, draft {sizes["draft"]:,} B,
  total {sizes["total"]:,} B (budget {MAX_TOTAL_BYTES:,} B).
- SHA-256 of `model.safetensors` (a rerun of the command above gives the same bytes):
  target `{metrics["sha256"]["target"]}`, draft `{metrics["sha256"]["draft"]}`.

## Training data and hold-out
The reST sources of the Python 3.11 documentation (Debian `python3.11-doc`,
`/usr/share/doc/python3.11/html/_sources`), markup lightly stripped; read at training time, never
committed. Held out: the pages of the modules whose docstrings make the default prompts
(`live.prompts.PROMPT_MODULES`) and every page whose path has CRC-32 = 0 mod {cfg["heldout_modulus"]}.
{metrics["data"]["train_pages"]} training pages ({metrics["data"]["train_tokens"]:,} tokens),
{metrics["data"]["heldout_pages"]} held-out pages ({metrics["data"]["heldout_tokens"]:,} tokens). Target: {cfg["target_steps"]} AdamW
steps of {cfg["batch_size"]} x {cfg["seq_len"]} tokens, cross-entropy + {cfg["aux_loss_coef"]} x per-layer load-balancing loss;
draft: {cfg["draft_steps"]} steps of KL(target || draft). Seed {cfg["seed"]}.

## Held-out figures (checkpoints reloaded from disk, float32)
| figure | value |
|---|---|
| target loss (nats/token) | {ev["target_heldout_loss_nats"]:.3f} |
| draft loss (nats/token) | {ev["draft_heldout_loss_nats"]:.3f} |
| unigram baseline loss (nats/token) | {ev["unigram_heldout_loss_nats"]:.3f} |
| draft greedy agreement with target, held-out text | {ev["draft_agreement_heldout_text"]:.3f} |
| draft greedy agreement with target, target's greedy continuations of {cfg["eval_prompts"]} default prompts | {ev["draft_agreement_target_greedy"]:.3f} |
| dead experts (all layers) | {ev["dead_experts_total"]} |

Held-out tokens scored: {ev["heldout_tokens"]:,}. Agreement = fraction of positions where the
draft's argmax equals the target's argmax given the same prefix.

Expert load per layer over the held-out tokens (share of the top-{cfg["top_k"]} assignments;
entropy in bits, maximum log2({cfg["num_experts"]}) = {math.log2(cfg["num_experts"]):.0f}; min/max load = least/most used expert's
share x {cfg["num_experts"]}, 1.0 = uniform):

| layer | entropy (bits) | normalised | min load | max load | dead |
|---|---|---|---|---|---|
{rows}

Expert union growth: distinct experts per layer that n consecutive held-out tokens route to (mean
over blocks and layers), against independent uniform routing, E * (1 - (1 - K/E)^n). Fewer than
independent = consecutive tokens share experts, which is what an expert cache and a draft tree's
expert union feed on:

| tokens n | measured | independent |
|---|---|---|
{union_rows}

## Licence and attribution
Weights, tokenizer and recipe are this project's (Apache-2.0). They were trained on the Python
documentation, (c) Python Software Foundation, distributed under the PSF licence; no text of it is
shipped here.
"""
    from live.train_eagle3 import eagle3_card_section

    text += eagle3_card_section(out_dir / "eagle3")
    path = out_dir / "MODEL_CARD.md"
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> ArgumentParser:
    """The ``python -m live.train_default`` flags (defaults: :class:`TrainConfig`)."""
    d = TrainConfig()
    p = ArgumentParser(prog="python -m live.train_default", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/train_default"),
        help="output folder (gets target/, draft/, metrics.json, MODEL_CARD.md); "
        "live/assets/default replaces the shipped models",
    )
    p.add_argument(
        "--docs-dir",
        type=Path,
        default=DEFAULT_DOCS_DIR,
        help="Python documentation reST sources (*.rst.txt)",
    )
    p.add_argument(
        "--evaluate-only",
        action="store_true",
        help="skip training: re-evaluate the checkpoints already in --out (with the flags they were "
        "trained with) and rewrite metrics.json and MODEL_CARD.md",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (weights, batches)")
    p.add_argument("--target-steps", type=positive_int, default=d.target_steps, help="target optimiser steps")
    p.add_argument("--draft-steps", type=positive_int, default=d.draft_steps, help="draft optimiser steps")
    p.add_argument("--target-lr", type=positive_float, default=d.target_lr, help="target peak learning rate")
    p.add_argument("--draft-lr", type=positive_float, default=d.draft_lr, help="draft peak learning rate")
    p.add_argument(
        "--aux-loss-coef",
        type=float,
        default=d.aux_loss_coef,
        help="weight of the per-layer load-balancing loss (dimensionless, >= 0)",
    )
    p.add_argument(
        "--vocab-size", type=positive_int, default=d.vocab_size, help="BPE vocabulary size (tokens)"
    )
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len, help="training window (tokens)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="windows per step")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads (1 is fastest on a shared, oversubscribed machine)",
    )
    p.add_no_progress()
    return p


def reproduce_command(cfg: TrainConfig, threads: int) -> str:
    """The command line that rebuilds the shipped checkpoints with ``cfg`` (every flag that
    changes the weights spelled out; ``--threads`` too, since float reductions depend on it)."""
    flags = {
        "--seed": cfg.seed,
        "--target-steps": cfg.target_steps,
        "--draft-steps": cfg.draft_steps,
        "--target-lr": cfg.target_lr,
        "--draft-lr": cfg.draft_lr,
        "--aux-loss-coef": cfg.aux_loss_coef,
        "--vocab-size": cfg.vocab_size,
        "--seq-len": cfg.seq_len,
        "--batch-size": cfg.batch_size,
        "--threads": threads,
    }
    return "python -m live.train_default --out live/assets/default " + " ".join(
        f"{flag} {value}" for flag, value in flags.items()
    )


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Train, save and evaluate the default models; last stdout line is the JSON summary."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.aux_loss_coef < 0:
        parser.fail("--aux-loss-coef", f"expected a number >= 0, got {args.aux_loss_coef}")
    if args.vocab_size < 300:
        parser.fail("--vocab-size", f"expected >= 300 (256 bytes + special + merges), got {args.vocab_size}")
    cfg = TrainConfig(
        seed=args.seed,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        target_steps=args.target_steps,
        draft_steps=args.draft_steps,
        target_lr=args.target_lr,
        draft_lr=args.draft_lr,
        aux_loss_coef=args.aux_loss_coef,
    )
    if args.evaluate_only:
        cfg = _config_of_saved_run(parser, args.out, cfg)
    try:
        train_texts, heldout_texts = read_corpus(args.docs_dir, cfg.heldout_modulus)
    except FileNotFoundError as exc:
        parser.fail("--docs-dir", str(exc).removeprefix("--docs-dir: "))
    return _run(cfg, args, train_texts, heldout_texts)


def _config_of_saved_run(parser: ArgumentParser, out: Path, fallback: TrainConfig) -> TrainConfig:
    """The TrainConfig recorded in ``out/metrics.json`` (``fallback`` if none); exits 2 naming
    ``--out`` when the checkpoints are missing or the recorded config is unreadable."""
    from live.loader import check_safetensors_files

    for sub in ("target", "draft"):
        if not (out / sub / "model.safetensors").is_file():
            parser.fail(
                "--out",
                f"--evaluate-only needs a trained checkpoint, {out / sub / 'model.safetensors'} is missing",
            )
        try:
            check_safetensors_files(out / sub)  # a truncated file: named now, not a traceback later
        except ValueError as exc:
            parser.fail("--out", str(exc))
    path = out / "metrics.json"
    if not path.is_file():
        return fallback
    try:
        return TrainConfig(**json.loads(path.read_text(encoding="utf-8"))["config"])
    except (ValueError, KeyError, TypeError) as exc:
        parser.fail("--out", f"{path}: cannot read the recorded 'config' ({exc})")
    raise AssertionError("unreachable")


def _versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
    }


def _train_and_save(cfg: TrainConfig, args: Any, train_texts: list[str]) -> dict[str, Any]:
    """Train tokenizer, target and draft; save both checkpoints under ``args.out``; return the
    training part of ``metrics.json``."""
    import torch

    started = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    train_stream = encode_stream(tokenizer, train_texts)
    print(f"corpus: {len(train_texts)} train pages, {train_stream.numel():,} tokens", file=sys.stderr)
    target, target_losses = train_target(cfg, train_stream, tokenizer.eos_token_id, not args.no_progress)
    draft, draft_losses = train_draft(cfg, train_stream, target, tokenizer.eos_token_id, not args.no_progress)
    save_checkpoint(target, tokenizer, args.out / "target")
    save_checkpoint(draft, tokenizer, args.out / "draft")
    return {
        "command": reproduce_command(cfg, args.threads),
        "config": asdict(cfg),
        "threads": args.threads,
        "machine": f"{platform.machine()} CPU",
        "versions": _versions(),
        "torch_threads_used": torch.get_num_threads(),
        "train_s": time.perf_counter() - started,
        "final_train_loss": {
            "target_ce_nats": sum(target_losses[-20:]) / len(target_losses[-20:]),
            "draft_kl_nats": sum(draft_losses[-20:]) / len(draft_losses[-20:]),
        },
    }


def _evaluate_saved(
    cfg: TrainConfig, out: Path, train_texts: list[str], heldout_texts: list[str], metrics: dict[str, Any]
) -> dict[str, Any]:
    """Reload the checkpoints in ``out`` with the stock classes, evaluate them on the held-out
    pages and complete ``metrics`` (sizes, parameter counts, data, eval)."""
    from transformers import AutoTokenizer

    from live.prompts import default_prompts

    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    train_stream = encode_stream(tokenizer, train_texts)
    heldout_stream = encode_stream(tokenizer, heldout_texts)
    target, draft = load_checkpoint(out / "target"), load_checkpoint(out / "draft")
    sizes = {"target": checkpoint_bytes(out / "target"), "draft": checkpoint_bytes(out / "draft")}
    sizes["total"] = sizes["target"] + sizes["draft"]
    metrics.update(
        {
            "sha256": {sub: _sha256(out / sub / "model.safetensors") for sub in ("target", "draft")},
            "eos_token_id": tokenizer.eos_token_id,
            "data": {
                "train_pages": len(train_texts),
                "train_tokens": int(train_stream.numel()),
                "heldout_pages": len(heldout_texts),
                "heldout_tokens": int(heldout_stream.numel()),
            },
            "params": {
                "target": sum(p.numel() for p in target.parameters()),
                "target_experts": sum(p.numel() for n, p in target.named_parameters() if ".experts." in n),
                "draft": sum(p.numel() for p in draft.parameters()),
            },
            "sizes_bytes": sizes,
            "eval": evaluate(cfg, target, draft, train_stream, heldout_stream, default_prompts(), tokenizer),
        }
    )
    return metrics


def _run(cfg: TrainConfig, args: Any, train_texts: list[str], heldout_texts: list[str]) -> int:
    """The pipeline after argument checks (see the module docstring); ``--evaluate-only`` keeps
    the checkpoints and training figures already in ``--out`` and redoes the evaluation."""
    import torch

    torch.set_num_threads(args.threads)
    out: Path = args.out
    if args.evaluate_only:
        metrics_path = out / "metrics.json"
        metrics = json.loads(metrics_path.read_text(encoding="utf-8")) if metrics_path.is_file() else {}
        metrics.update({"versions_eval": _versions()})
    else:
        metrics = _train_and_save(cfg, args, train_texts)
    metrics = _evaluate_saved(cfg, out, train_texts, heldout_texts, metrics)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    write_model_card(out, metrics)
    ev, total = metrics["eval"], metrics["sizes_bytes"]["total"]
    if total > MAX_TOTAL_BYTES:
        print(f"warning: checkpoints total {total:,} B > budget {MAX_TOTAL_BYTES:,} B", file=sys.stderr)
    print(
        f"target held-out loss {ev['target_heldout_loss_nats']:.3f} nats "
        f"(unigram {ev['unigram_heldout_loss_nats']:.3f}); draft agreement "
        f"{ev['draft_agreement_heldout_text']:.3f} text / {ev['draft_agreement_target_greedy']:.3f} greedy; "
        f"expert-load normalised entropy {ev['min_normalized_entropy']:.3f}-{ev['max_normalized_entropy']:.3f}, "
        f"dead experts {ev['dead_experts_total']}; {total:,} B"
    )
    print_summary(
        {
            "out": str(out),
            "train_s": round(metrics.get("train_s", float("nan")), 1),
            "total_bytes": total,
            "target_heldout_loss_nats": ev["target_heldout_loss_nats"],
            "unigram_heldout_loss_nats": ev["unigram_heldout_loss_nats"],
            "draft_agreement_heldout_text": ev["draft_agreement_heldout_text"],
            "draft_agreement_target_greedy": ev["draft_agreement_target_greedy"],
            "dead_experts_total": ev["dead_experts_total"],
            "min_normalized_entropy": ev["min_normalized_entropy"],
        }
    )
    return 0


if __name__ == "__main__":
    run_main(main)
