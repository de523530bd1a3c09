"""Tests for the embedded default checkpoints (live/assets) and their training script."""

from __future__ import annotations

import hashlib
import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch

from live import train_default as T
from live.assets import DEFAULT_DIR, default_model_paths
from live.prompts import default_prompts


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: tiny shapes gain nothing from more, and the test machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@cache
def _models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = default_model_paths()
    kw = {"use_safetensors": True, "trust_remote_code": False, "dtype": torch.float32}
    target = AutoModelForCausalLM.from_pretrained(target_dir, **kw).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, **kw).eval()
    return target, draft, AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(draft_dir)


def _ids(text: str) -> torch.Tensor:
    return torch.tensor([_models()[2](text)["input_ids"]])


# ---------------------------------------------------------------------------------------------
# Shipped checkpoints


def test_default_model_paths_point_at_complete_checkpoints():
    target_dir, draft_dir = default_model_paths()
    assert target_dir.is_absolute() and target_dir == DEFAULT_DIR / "target"
    for folder in (target_dir, draft_dir):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (folder / name).is_file()


def test_checkpoints_fit_the_size_budget():
    total = sum(p.stat().st_size for p in DEFAULT_DIR.rglob("*") if p.is_file())
    assert total <= T.MAX_TOTAL_BYTES


def test_checkpoints_load_with_the_stock_classes_and_have_the_intended_shape():
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    target, draft, _, _ = _models()
    assert type(target) is Qwen3MoeForCausalLM and type(draft) is Qwen3ForCausalLM
    cfg = target.config
    assert 4 <= cfg.num_hidden_layers <= 8
    assert cfg.num_experts == 64 and cfg.num_experts_per_tok >= 4
    assert draft.config.vocab_size == cfg.vocab_size
    experts = target.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (64, 2 * cfg.moe_intermediate_size, cfg.hidden_size)


def test_tokenizers_identical_with_eos_and_round_trip():
    target_dir, draft_dir = default_model_paths()
    assert (target_dir / "tokenizer.json").read_bytes() == (draft_dir / "tokenizer.json").read_bytes()
    _, _, tok_t, tok_d = _models()
    text = "Return a list of the words in the string, using sep as the delimiter."
    ids = tok_t(text)["input_ids"]
    assert ids == tok_d(text)["input_ids"]
    assert tok_t.decode(ids) == text
    assert tok_t.eos_token == T.EOS_TOKEN and tok_t.eos_token_id == _models()[0].config.eos_token_id
    assert len(ids) < len(text) / 2  # BPE merges learned: well under one token per two characters


def test_default_prompts_tokenize_to_modest_lengths():
    tok = _models()[2]
    lengths = [len(tok(p.text)["input_ids"]) for p in default_prompts()]
    assert min(lengths) >= 8 and max(lengths) <= 96


def test_routing_is_non_degenerate_on_a_short_text():
    target = _models()[0]
    ids = _ids(" ".join(p.text for p in default_prompts(4)))
    with torch.no_grad():
        out = target(input_ids=ids, output_router_logits=True)
    k, num_experts = target.config.num_experts_per_tok, target.config.num_experts
    for logits in out.router_logits:
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, k, dim=-1).indices
        distinct = torch.unique(chosen).numel()
        assert k < distinct < num_experts  # tokens route to different experts, not all of them
        topk_mass = float(torch.topk(probs, k, dim=-1).values.sum(-1).mean())
        assert topk_mass > 1.25 * k / num_experts  # the chosen experts carry more than a uniform share


def test_training_experts_path_equals_stock_eager_forward():
    """Training runs transformers' grouped_mm experts; the saved weights give the same logits
    with the eager per-expert loop."""
    target = _models()[0]
    ids = _ids(default_prompts(1)[0].text).repeat(2, 1)
    with torch.no_grad():
        target.set_experts_implementation("eager")
        eager = target(input_ids=ids).logits
        target.set_experts_implementation("grouped_mm")
        grouped = target(input_ids=ids).logits
        target.set_experts_implementation("eager")
    torch.testing.assert_close(grouped, eager, rtol=1e-4, atol=1e-4)


def test_models_have_learned_held_out_text():
    """Default prompts are held out: the target predicts them far better than uniform, and the
    draft agrees with the target's greedy continuations most of the time."""
    target, draft, _, _ = _models()
    losses = []
    hits = total = 0
    with torch.no_grad():
        for prompt in default_prompts(4):
            ids = _ids(prompt.text)
            logits = target(input_ids=ids).logits[0, :-1]
            losses.append(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
            seq = ids
            for _ in range(12):
                nxt = target(input_ids=seq).logits[0, -1].argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            pred = draft(input_ids=seq[:, :-1]).logits[0, ids.shape[1] - 1 :].argmax(-1)
            hits += int((pred == seq[0, ids.shape[1] :]).sum())
            total += 12
    assert sum(losses) / len(losses) < 0.8 * math.log(target.config.vocab_size)
    assert hits / total >= 0.4


def test_model_card_and_metrics_record_the_claimed_figures():
    metrics = json.loads((DEFAULT_DIR / "metrics.json").read_text())
    card = (DEFAULT_DIR / "MODEL_CARD.md").read_text()
    ev = metrics["eval"]
    assert metrics["command"].startswith("python -m live.train_default")
    assert metrics["command"] in card
    assert ev["target_heldout_loss_nats"] < ev["unigram_heldout_loss_nats"]
    assert ev["dead_experts_total"] == 0
    assert len(ev["expert_load"]) == metrics["config"]["target_layers"]
    assert ev["max_normalized_entropy"] < 0.99  # clearly non-uniform
    assert metrics["sizes_bytes"]["total"] <= T.MAX_TOTAL_BYTES
    assert f"{ev['target_heldout_loss_nats']:.3f}" in card
    for sub in ("target", "draft"):  # the card describes the weights actually shipped
        digest = hashlib.sha256((DEFAULT_DIR / sub / "model.safetensors").read_bytes()).hexdigest()
        assert metrics["sha256"][sub] == digest and digest in card


# ---------------------------------------------------------------------------------------------
# Training script pieces


def test_clean_rst_strips_markup_and_keeps_text():
    src = (
        ".. _tut-x:\n\n**********\nA Title\n**********\n\n"
        "Use :func:`~os.path.join` and ``len(x)`` with :ref:`the guide <tut-guide>`.\n"
        "   :noindex:\n\nSee `Python <https://python.org>`_ for **more**.\n\n\n\nEnd.\n"
    )
    assert T.clean_rst(src) == (
        "A Title\n\nUse os.path.join and len(x) with the guide.\n\nSee Python for more.\n\nEnd.\n"
    )


def test_heldout_split_includes_prompt_module_pages():
    assert T.is_heldout("library/textwrap.rst.txt", 10)
    assert T.is_heldout("library/json.rst.txt", 1000003) is True
    pages = [f"library/page{i}.rst.txt" for i in range(200)]
    share = sum(T.is_heldout(p, 10) for p in pages) / len(pages)
    assert 0.03 < share < 0.2


def test_missing_docs_exit_2_with_install_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        T.main(["--docs-dir", str(tmp_path / "none")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--docs-dir" in err and "apt-get install -y python3.11-doc" in err


@pytest.mark.parametrize(
    ("flag", "value"), [("--target-steps", "0"), ("--aux-loss-coef", "-1"), ("--vocab-size", "10")]
)
def test_bad_flags_exit_2_naming_the_flag(flag: str, value: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        T.main([flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_balance_loss_is_top_k_when_uniform_and_larger_when_skewed():
    uniform = [torch.zeros(64, 8)]
    assert float(T.per_layer_balance_loss(uniform, top_k=2)) == pytest.approx(2.0, rel=1e-6)
    skewed = torch.zeros(64, 8)
    skewed[:, 0] = 5.0
    assert float(T.per_layer_balance_loss([skewed, torch.zeros(64, 8)], top_k=2)) > 2.5


def test_expert_load_stats_known_counts():
    counts = torch.tensor([[1, 1, 1, 1], [2, 2, 0, 0]])
    uniform, half = T.expert_load_stats(counts)
    assert uniform == {
        "entropy_bits": 2.0,
        "normalized_entropy": 1.0,
        "min_load": 1.0,
        "max_load": 1.0,
        "dead_experts": 0,
    }
    assert half["entropy_bits"] == pytest.approx(1.0) and half["dead_experts"] == 2
    assert half["max_load"] == pytest.approx(2.0) and half["min_load"] == 0.0


def test_lr_schedule_warmup_then_cosine():
    assert T._lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert T._lr_at(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert T._lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert T._lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)


def _tiny_config() -> T.TrainConfig:
    return T.TrainConfig(
        vocab_size=64,
        seq_len=16,
        batch_size=4,
        target_layers=2,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=16,
        target_steps=25,
        draft_steps=25,
        draft_layers=1,
        draft_intermediate_size=32,
        warmup_steps=2,
        target_lr=1e-2,
        draft_lr=1e-2,
    )


def _tiny_stream() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    pattern = torch.randint(1, 64, (40,), generator=gen)
    return pattern.repeat(30)  # a repeating sequence: learnable in a few steps


def test_train_target_learns_and_is_reproducible_from_the_seed():
    cfg, stream = _tiny_config(), _tiny_stream()
    model_a, losses_a = T.train_target(cfg, stream, eos_id=0)
    model_b, losses_b = T.train_target(cfg, stream, eos_id=0)
    assert losses_a == losses_b
    for (name, pa), pb in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert sum(losses_a[-5:]) / 5 < 0.7 * sum(losses_a[:5]) / 5


def test_train_draft_distils_towards_the_target():
    cfg, stream = _tiny_config(), _tiny_stream()
    target, _ = T.train_target(cfg, stream, eos_id=0)
    _, kl = T.train_draft(cfg, stream, target, eos_id=0)
    assert all(math.isfinite(v) and v >= -1e-6 for v in kl)
    assert sum(kl[-5:]) / 5 < 0.7 * sum(kl[:5]) / 5


def test_expert_union_growth_known_routing():
    # 1 window, 1 layer, 8 tokens, top-2 of 16 experts: tokens alternate between {0, 1} and {2, 3}
    chosen = torch.tensor([[[[0, 1], [2, 3]] * 4]])
    growth = T.expert_union_growth(chosen, num_experts=16)
    assert [growth[n]["measured"] for n in ("1", "2", "4", "8")] == [2.0, 4.0, 4.0, 4.0]
    assert growth["2"]["independent"] == pytest.approx(16 * (1 - (14 / 16) ** 2))
    assert "16" not in growth  # longer than the window


def test_evaluate_only_needs_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    if not T.DEFAULT_DOCS_DIR.is_dir():
        pytest.skip("python3.11-doc not installed")
    with pytest.raises(SystemExit) as exc:
        T.main(["--evaluate-only", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--out" in err and "model.safetensors is missing" in err


def test_shipped_metrics_report_expert_union_locality():
    union = json.loads((DEFAULT_DIR / "metrics.json").read_text())["eval"]["expert_union_by_tokens"]
    assert union["1"]["measured"] == pytest.approx(union["1"]["independent"])
    sizes = [union[n]["measured"] for n in ("1", "2", "4", "8", "16")]
    assert sizes == sorted(sizes) and sizes[-1] > 2 * sizes[0]  # the union grows with the tokens
    assert union["16"]["measured"] < union["16"]["independent"]  # consecutive tokens share experts
