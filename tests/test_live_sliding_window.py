"""Sliding-window attention in tree verification (tiny random Mixtral, Qwen3-MoE, Qwen2-MoE).

The KV cache keeps every key; tree masks hide keys a window or more behind each node, as causal
decoding with the window does (live/spec/attention.py). The window here (5) is shorter than the
prompt, so it changes the model's outputs: the tests would fail if it were ignored.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from live_fixtures import make_tiny_checkpoint, save_tiny_tokenizer, tiny_config
from test_live_spec_verify import RandomSubtreeChooser, reference_greedy
from transformers import AutoModelForCausalLM

from live.spec.attention import AttentionLayout, attention_layout, tree_attention_mask
from live.spec.draft import ModelDrafter, TreeShape
from live.spec.engine import FullTreeChooser, SpecDecoder
from live.spec.runner import CachedLM
from live.spec.tree import TokenTree
from live.spec.verify import TreeVerifier

PROMPT = [5, 9, 33, 12, 40, 7, 21, 64]
WINDOW = 5
SLIDING = {
    "mixtral": {"sliding_window": WINDOW},
    "qwen3_moe": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 2},
    "qwen2_moe": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},  # mixed
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_draft):
    """Sliding-window variants of the tiny checkpoints (their own configs) and the session's draft."""
    root = tmp_path_factory.mktemp("sliding")
    made = {arch: make_tiny_checkpoint(root, arch, **kw) for arch, kw in SLIDING.items()}
    made["mixtral-wide"] = make_tiny_checkpoint(root / "wide", "mixtral", sliding_window=4096)
    made["draft"] = tiny_draft
    return made


def _load(path, **overrides):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()


def test_attention_layout_per_architecture():
    assert attention_layout(tiny_config("mixtral")) == AttentionLayout(None)
    assert attention_layout(tiny_config("mixtral", sliding_window=5)) == AttentionLayout(5)
    assert attention_layout(tiny_config("qwen3_moe", sliding_window=5)) == AttentionLayout(None)  # not used
    assert attention_layout(tiny_config("qwen3_moe", **SLIDING["qwen3_moe"])) == AttentionLayout(5)
    assert attention_layout(tiny_config("qwen2_moe", **SLIDING["qwen2_moe"])) == AttentionLayout(5, True)
    assert attention_layout(tiny_config("qwen2_moe", sliding_window=5)) == AttentionLayout(None)
    # OLMoE's model has no sliding window: a stray config attribute changes nothing
    assert attention_layout(tiny_config("olmoe", sliding_window=5)) == AttentionLayout(None)
    chunked = tiny_config("qwen2_moe", **SLIDING["qwen2_moe"])
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="config.json field layer_types: \\['chunked_attention'\\]"):
        attention_layout(chunked)
    negative = tiny_config("mixtral")
    negative.sliding_window = -3
    with pytest.raises(ValueError, match="config.json field sliding_window"):
        attention_layout(negative)


def test_tree_attention_mask_hides_keys_a_window_behind():
    # context of 4 keys (positions 0..3); the root and its two children are fed at positions 4, 5, 5;
    # window 3: a query at position 5 sees keys at 3..5, one at position 4 sees 2..4 (and its ancestors)
    tree = TokenTree.from_parents([1, 2, 3], [-1, 0, 0], [0, -1, -2])
    args = (4, [0, 1, 2], [0, 1, 2], tree.ancestor_matrix(), torch.float32)
    keys, queries = [0, 1, 2, 3, 4, 5, 5], [4, 5, 5]
    visible = tree_attention_mask(*args, window=3, key_positions=keys, query_positions=queries)[0, 0] == 0
    assert visible.int().tolist() == [
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 0, 1],
    ]
    with pytest.raises(ValueError, match="window needs 7 key and 3 query positions"):
        tree_attention_mask(*args, window=3, key_positions=keys[:3], query_positions=queries)


@pytest.mark.parametrize("arch", list(SLIDING))
def test_window_changes_the_reference(checkpoints, arch):
    """The window matters at these lengths: ignoring it gives other greedy tokens."""
    windowed = reference_greedy(_load(checkpoints[arch]), PROMPT, 12)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoints[arch])
    config.sliding_window = 10**6  # wider than any context here: no window in effect
    full = reference_greedy(_load(checkpoints[arch], config=config), PROMPT, 12)
    assert windowed != full


# The tree's arrays are read-only (TokenTree); the runner must copy them, not share them with a warning.
@pytest.mark.filterwarnings("error:The given NumPy array is not writable")
@pytest.mark.parametrize("arch", list(SLIDING))
def test_tree_logits_equal_sequential_paths_beyond_the_window(checkpoints, arch):
    target = _load(checkpoints[arch])
    draft = ModelDrafter(_load(checkpoints["draft"])).grow(PROMPT, TreeShape(depth=3, topk=3, max_nodes=10))
    tree = draft.tree
    lm = CachedLM(target)
    lm.feed_causal(PROMPT[:-1])
    root = len(PROMPT) - 1
    logits = lm.feed_tree(
        tree.token_ids, tree.depths, root, root, range(10), range(10), tree.ancestor_matrix()
    )
    with torch.inference_mode():
        for v in range(tree.num_nodes):
            seq = PROMPT[:-1] + [int(tree.token_ids[u]) for u in tree.path_to(v)]
            ref = target(input_ids=torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(logits[v], ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", [*SLIDING, "mixtral-wide"])
def test_sliding_window_decoding_is_lossless(checkpoints, arch):
    """Full trees and random subtrees, self-drafting (long accepted paths, KV trimming of the
    accepted path) and another draft; a window wider than the context ("mixtral-wide") is harmless."""
    target = _load(checkpoints[arch])
    ref = reference_greedy(target, PROMPT, 16)
    verifier = TreeVerifier(target)
    self_draft = ModelDrafter(_load(checkpoints[arch]))
    other_draft = ModelDrafter(_load(checkpoints["draft"]))
    shape = TreeShape(depth=3, topk=2, max_nodes=7)
    choosers = [FullTreeChooser(self_draft, shape), RandomSubtreeChooser(self_draft, shape)]
    choosers += [FullTreeChooser(other_draft, shape)]
    for chooser in choosers:
        result = SpecDecoder(verifier, chooser.drafter).generate(PROMPT, 16, chooser)
        assert list(result.generated_ids) == ref, (arch, chooser.name)
    self_result = SpecDecoder(verifier, self_draft).generate(PROMPT, 16, choosers[0])
    assert self_result.tau > 1.5  # accepted paths: the trimmed cache is really reused


def test_record_runs_a_sliding_window_checkpoint(checkpoints, tmp_path, capsys):
    """live.record on a Mixtral checkpoint with sliding_window set: finishes (it used to crash after
    the first verification) and commits the target's own greedy tokens."""
    from live.record import main
    from traces.reader import open_run

    save_tiny_tokenizer(checkpoints["mixtral"])  # the session's draft has one
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(f"w{t}" for t in PROMPT) + "\n")
    out = tmp_path / "run"
    argv = [
        "--model", str(checkpoints["mixtral"]), "--draft", str(checkpoints["draft"]),
        "--prompts", str(prompts), "--max-new-tokens", "10", "--depth", "3", "--topk", "2",
        "--max-nodes", "7", "--mode", "policy", "--policy", "topn", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    generated = list(open_run(out).requests["generated_token_ids"].iloc[0])
    target = _load(checkpoints["mixtral"])
    want = reference_greedy(target, PROMPT, 10, eos=(2,))
    assert generated == want
    assert np.asarray(generated).size == len(want)
