"""EAGLE-3 heads: on-disk layout, loading checks, and lossless greedy drafting on every architecture."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from live_fixtures import TINY_ARCHS, make_tiny_eagle3_head
from safetensors.torch import load_file, save_file
from test_live_spec_verify import (  # noqa: F401 - _one_torch_thread is an autouse fixture
    PROMPT,
    RandomSubtreeChooser,
    _load,
    _one_torch_thread,
    _planned,
    reference_greedy,
)

from live.eagle3 import HeadMismatchError, is_eagle3_checkpoint, load_head
from live.eagle3_draft import Eagle3Drafter, features_for
from live.spec.draft import TreeShape
from live.spec.engine import FullTreeChooser, SpecDecoder
from live.spec.verify import TreeVerifier

N_NEW = 12


@pytest.fixture(scope="module")
def heads(tiny_checkpoint, tmp_path_factory):
    """Per architecture: (the session's tiny target dir, trained head dir); the head is fitted to
    PROMPT's greedy output."""
    root = tmp_path_factory.mktemp("eagle3")
    out = {}
    for arch in TINY_ARCHS:
        target_dir = tiny_checkpoint(arch)
        seq = PROMPT + reference_greedy(_load(target_dir), PROMPT, N_NEW + 4)
        out[arch] = (target_dir, make_tiny_eagle3_head(root, target_dir, train_on=[seq], train_steps=80))
    return out


def _drafter(target, head_dir):
    head = load_head(head_dir, target)
    features = features_for(head, target)
    return Eagle3Drafter(head, features), TreeVerifier(target, features=features)


def test_saved_head_has_the_trainers_layout(heads):
    target_dir, head_dir = heads["qwen3_moe"]
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    h, ht, v = config["hidden_size"], config["target_hidden_size"], config["vocab_size"]
    vd = config["draft_vocab_size"]
    shapes = {k: list(t.shape) for k, t in load_file(str(head_dir / "model.safetensors")).items()}
    assert shapes["fc.weight"] == [h, 3 * ht]
    assert shapes["midlayer.self_attn.q_proj.weight"][1] == 2 * h
    assert shapes["midlayer.hidden_norm.weight"] == [h] and shapes["midlayer.input_layernorm.weight"] == [h]
    assert shapes["lm_head.weight"] == [vd, h] and shapes["norm.weight"] == [h]
    assert shapes["d2t"] == [vd] and shapes["t2d"] == [v] and shapes["embed_tokens.weight"] == [v, h]
    assert is_eagle3_checkpoint(head_dir) and not is_eagle3_checkpoint(target_dir)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_lossless_every_chooser_with_an_eagle3_head(heads, arch):
    target_dir, head_dir = heads[arch]
    target = _load(target_dir)
    ref = reference_greedy(target, PROMPT, N_NEW)
    drafter, verifier = _drafter(target, head_dir)
    shape = TreeShape(depth=4, topk=3, max_nodes=12)
    cases = [(FullTreeChooser(drafter, shape), False), (RandomSubtreeChooser(drafter, shape), False)]
    cases += [(_planned(drafter, shape, name, verifier), False) for name in ("specfit", "topn", "chain")]
    cases += [(FullTreeChooser(drafter, shape), True)]
    taus = []
    for chooser, dense in cases:
        result = SpecDecoder(verifier, drafter).generate(PROMPT, N_NEW, chooser, dense=dense)
        assert list(result.generated_ids) == ref, (arch, chooser.name, dense)
        taus.append(result.tau)
    assert taus[0] > 1.5, taus  # the fitted head gets drafts accepted: rollback and re-feed are exercised


def test_reduced_draft_vocabulary_maps_through_d2t(tiny_checkpoint, tmp_path):
    target_dir = tiny_checkpoint("qwen3_moe")
    head_dir = make_tiny_eagle3_head(tmp_path, target_dir, draft_vocab_size=40, own_embedding=False)
    assert "embed_tokens.weight" not in load_file(str(head_dir / "model.safetensors"))
    target = _load(target_dir)
    drafter, verifier = _drafter(target, head_dir)
    allowed = set(np.flatnonzero(drafter.head.t2d.numpy()).tolist())
    assert len(allowed) == 40 and drafter.head.embed_tokens is target.get_input_embeddings()
    seen = []

    class Spy(FullTreeChooser):
        def choose(self, state):
            choice = super().choose(state)
            seen.extend(int(t) for t in choice.draft.tree.token_ids[1:])
            return choice

    result = SpecDecoder(verifier, drafter).generate(PROMPT, 6, Spy(drafter, TreeShape(3, 3, 10)))
    assert list(result.generated_ids) == reference_greedy(target, PROMPT, 6)
    assert seen and set(seen) <= allowed and max(seen) >= 40  # ids beyond Vd: mapped through d2t


def test_one_token_prompt_verifies_the_root_alone_first(heads):
    target_dir, head_dir = heads["qwen3_moe"]
    target = _load(target_dir)
    drafter, verifier = _drafter(target, head_dir)
    result = SpecDecoder(verifier, drafter).generate([7], 5, FullTreeChooser(drafter, TreeShape(3, 2, 6)))
    assert list(result.generated_ids) == reference_greedy(target, [7], 5)
    assert result.cycles[0].choice.draft.num_levels == 0 and result.cycles[1].choice.draft.num_levels > 0


def _rewrite(head_dir, out, config_changes=None, tensor_changes=None):
    out.mkdir()
    config = json.loads((head_dir / "config.json").read_text()) | (config_changes or {})
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(head_dir / "model.safetensors")) | (tensor_changes or {})
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_mismatched_heads_are_refused_naming_both_values(heads, tmp_path):
    target_dir, head_dir = heads["qwen3_moe"]
    target = _load(target_dir)
    wide = _rewrite(head_dir, tmp_path / "wide", {"target_hidden_size": 48})
    with pytest.raises(HeadMismatchError, match=r"48.*hidden_size is 32"):
        load_head(wide, target)
    vd = json.loads((head_dir / "config.json").read_text())["draft_vocab_size"]
    d2t = torch.zeros(vd, dtype=torch.int64)
    d2t[5] = 500
    off = _rewrite(head_dir, tmp_path / "off", tensor_changes={"d2t": d2t})
    with pytest.raises(HeadMismatchError, match=r"draft id 5 to target id 505.*\[0, 96\)"):
        load_head(off, target)
    vocab = _rewrite(head_dir, tmp_path / "vocab", {"vocab_size": 128})
    with pytest.raises(HeadMismatchError, match=r"128.*vocab_size is 96"):
        load_head(vocab, target)
    layers = _rewrite(head_dir, tmp_path / "layers", {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]})
    with pytest.raises(HeadMismatchError, match=r"\[0, 1, 9\].*\[0, 2\]"):
        load_head(layers, target)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((head_dir / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pickle"):
        load_head(pickled, target)


def test_causal_lm_draft_is_not_taken_for_a_head(tiny_draft):
    assert not is_eagle3_checkpoint(tiny_draft)


@pytest.fixture(scope="module")
def cli(tiny_checkpoint, tmp_path_factory):
    """The session's tiny target (with a tokenizer), its fitted head, and a prompt file, for ``live.record``."""
    from test_live_record import PROMPT_LINES

    root = tmp_path_factory.mktemp("eagle3-cli")
    target_dir = tiny_checkpoint("qwen3_moe")
    target = _load(target_dir)
    seqs = [[int(w[1:]) for w in line.split()] for line in PROMPT_LINES]
    train = [s + reference_greedy(target, s, 10) for s in seqs]
    head_dir = make_tiny_eagle3_head(root, target_dir, train_on=train, train_steps=120)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPT_LINES) + "\n")
    return {"target": str(target_dir), "head": head_dir, "prompts": str(prompts), "root": root}


def _record_args(cli, out, *extra, draft=None):
    return [
        "--model", cli["target"], "--draft", str(draft or cli["head"]), "--prompts", cli["prompts"],
        "--max-new-tokens", "8", "--depth", "3", "--topk", "2", "--max-nodes", "7",
        "--cache-experts", "6", "--out", str(out), *extra,
    ]  # fmt: skip


def test_record_with_a_head_dense_and_policy_lossless_and_replayable(cli, tmp_path, capsys):
    from live.record import main
    from sim.sweep import main as sweep_main
    from traces.reader import open_run

    dense = tmp_path / "dense"
    assert main(_record_args(cli, dense)) == 0
    err = capsys.readouterr().err
    assert "EAGLE-3 head" in err
    run = open_run(dense)
    assert run.manifest.draft.kind == "eagle3" and run.manifest.run.mode == "dense"
    want = run.requests.sort_values("request_id")["generated_token_ids"].map(list).tolist()
    assert (run.cycles["num_accepted"] > 0).any()  # the fitted head's drafts are accepted
    for policy in ("specfit", "full"):
        out = tmp_path / policy
        assert main(_record_args(cli, out, "--mode", "policy", "--policy", policy)) == 0
        got = open_run(out).requests.sort_values("request_id")["generated_token_ids"].map(list).tolist()
        assert got == want, policy
        assert open_run(out).manifest.draft.kind == "eagle3"
    capsys.readouterr()
    sweep = ["--trace", str(dense), "--bandwidth", "16", "--cache", "0.5", "--out", str(tmp_path / "sweep")]
    assert sweep_main([*sweep, "--jobs", "1", "--no-progress", "--no-figures"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cells_run"] > 0


def test_record_refuses_a_mismatched_head_before_writing(cli, tmp_path, capsys):
    from live.record import main

    bad = _rewrite(cli["head"], tmp_path / "bad", {"target_hidden_size": 64})
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        main(_record_args(cli, out, draft=bad))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "--draft" in err and "64" in err and "32" in err
    assert not out.exists() or not any(out.iterdir())


def test_head_router_routes_every_node_and_leaves_decoding_lossless(heads):
    from live.eagle3_draft import HeadRouter
    from specfit import bitsets
    from specfit.predictors import PredictContext, make_predictor, score_predictor

    target_dir, head_dir = heads["olmoe"]
    target = _load(target_dir)
    drafter, verifier = _drafter(target, head_dir)
    router = HeadRouter(target)
    routed = []

    class Spy(FullTreeChooser):
        def choose(self, state):
            choice = super().choose(state)
            states = drafter.node_states()  # feeds the unfed leaves once; must not disturb drafting
            if states is not None:
                assert states.shape == (choice.draft.tree.num_nodes, drafter.head.hidden_size)
                routed.append((choice.draft.tree, router.route(states)))
            return choice

    result = SpecDecoder(verifier, drafter).generate(
        PROMPT, N_NEW, Spy(drafter, TreeShape(3, 3, 10)), dense=True
    )
    assert list(result.generated_ids) == reference_greedy(target, PROMPT, N_NEW)
    num_experts, top_k = verifier.capture.num_experts, verifier.capture.top_k
    cases = []
    assert len(routed) == len(result.cycles)  # a 6-token prompt: every cycle drafts from target states
    for (tree, ids), cycle in zip(routed, result.cycles, strict=True):
        assert ids.shape == (tree.num_nodes, verifier.capture.num_layers, top_k)
        assert ((ids >= 0) & (ids < num_experts)).all()
        assert all(len(set(row)) == top_k for row in ids.reshape(-1, top_k).tolist())
        truth = bitsets.pack(cycle.verification.expert_ids, num_experts)
        ctx = PredictContext(tree, num_experts, ids.shape[1], head_experts=bitsets.pack(ids, num_experts))
        cases.append((ctx, truth))
    score = score_predictor(make_predictor("head-router"), cases)
    assert 0.0 <= score.recall <= 1.0 and score.recall == pytest.approx(
        score.precision
    )  # K per node both sides
    with pytest.raises(ValueError, match="head_experts"):
        make_predictor("head-router").predict(PredictContext(routed[0][0], num_experts, ids.shape[1]))


def test_head_training_is_reproducible_from_the_seed(tiny_checkpoint, tmp_path):
    target_dir = tiny_checkpoint("mixtral")
    seq = [PROMPT + reference_greedy(_load(target_dir), PROMPT, 10)]
    first = make_tiny_eagle3_head(tmp_path / "a", target_dir, train_on=seq, train_steps=15)
    again = make_tiny_eagle3_head(tmp_path / "b", target_dir, train_on=seq, train_steps=15)
    untrained = make_tiny_eagle3_head(tmp_path / "c", target_dir)
    data = [(d / "model.safetensors").read_bytes() for d in (first, again, untrained)]
    assert data[0] == data[1] and data[0] != data[2]
    assert (first / "config.json").read_bytes() == (again / "config.json").read_bytes()


def test_embedded_head_is_lossless_on_the_embedded_default_and_documented():
    import hashlib

    from transformers import AutoTokenizer

    from live.assets import DEFAULT_DIR, DEFAULT_EAGLE3_DIR, default_model_paths
    from live.prompts import default_prompts

    if not (DEFAULT_EAGLE3_DIR / "model.safetensors").is_file():
        pytest.skip("no embedded EAGLE-3 head (python -m live.train_eagle3 --out live/assets/default/eagle3)")
    target_dir, _ = default_model_paths()
    target = _load(target_dir)
    ids = AutoTokenizer.from_pretrained(str(target_dir)).encode(default_prompts(1)[0].text)[:40]
    drafter, verifier = _drafter(target, DEFAULT_EAGLE3_DIR)
    result = SpecDecoder(verifier, drafter).generate(ids, 10, FullTreeChooser(drafter, TreeShape(4, 4, 16)))
    assert list(result.generated_ids) == reference_greedy(target, ids, 10)
    assert result.tau > 1.0  # the trained head's drafts are accepted
    metrics = json.loads((DEFAULT_EAGLE3_DIR / "metrics.json").read_text())
    sha = hashlib.sha256((DEFAULT_EAGLE3_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert metrics["weights_sha256"] == sha
    card = (DEFAULT_DIR / "MODEL_CARD.md").read_text()
    assert "## EAGLE-3 head" in card and sha in card and metrics["command"] in card


def test_target_features_grow_by_doubling_and_keep_every_committed_row(tiny_checkpoint):
    """TargetFeatures.commit appends into a buffer that doubles when full: the committed rows equal
    the concatenation of every forward's chosen rows, across several regrowths."""
    from live.eagle3_draft import TargetFeatures

    model = _load(tiny_checkpoint("qwen3_moe"))
    features = TargetFeatures(model, (0, 1, 2))
    rng = np.random.default_rng(0)
    want = []
    with torch.inference_mode():
        features.begin_forward()
        model(input_ids=torch.as_tensor([rng.integers(4, 90, size=70).tolist()]))
        features.reset(take_forward=True)
        want.append(features.forward_features())
        for _ in range(30):  # 70 + 30 * 3 rows: the buffer regrows (70 -> 140 -> 280)
            features.begin_forward()
            model(input_ids=torch.as_tensor([rng.integers(4, 90, size=5).tolist()]))
            features.commit([0, 2, 4])
            want.append(features.forward_features()[[0, 2, 4]])
    features.close()
    assert features.num_committed == 160
    assert torch.equal(features.committed, torch.cat(want))
    assert features.committed.shape == (160, 3 * model.config.hidden_size)
