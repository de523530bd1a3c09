"""Tree verification, KV trimming and losslessness of the live speculative decoder (tiny random MoEs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from live_fixtures import TINY_ARCHS, TINY_VOCAB_SIZE
from transformers import AutoModelForCausalLM, DynamicCache

from live.spec.attention import keep_cache_positions, tree_attention_mask
from live.spec.draft import DraftResult, ModelDrafter, TreeShape
from live.spec.engine import AutoregressiveChooser, Choice, FullTreeChooser, SpecDecoder
from live.spec.runner import CachedLM
from live.spec.tree import TokenTree
from live.spec.verify import TreeVerifier

PROMPT = [5, 9, 33, 12, 40, 7]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny shapes run fastest single-threaded; avoids thread oversubscription on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tiny_draft):
    """The session's tiny checkpoints of every architecture and the draft."""
    return {arch: tiny_checkpoint(arch) for arch in TINY_ARCHS} | {"draft": tiny_draft}


def reference_greedy(model, prompt, n, eos=()):
    """Plain greedy decoding without any cache (the ground truth)."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.tensor([seq], device=next(model.parameters()).device)
            tok = int(model(input_ids=ids).logits[0, -1].argmax())
            seq.append(tok)
            if tok in eos:
                break
    return seq[len(prompt) :]


class RandomSubtreeChooser:
    """Drafts the full tree, then verifies a random ancestor-closed subtree (stands in for any policy)."""

    name = "random-subtree"

    def __init__(self, drafter, shape, seed=0):
        self.drafter, self.shape, self.rng = drafter, shape, np.random.default_rng(seed)

    def choose(self, state):
        draft = self.drafter.grow(state.committed, self.shape)
        keep = [0]
        for v in range(1, draft.tree.num_nodes):
            if int(draft.tree.parents[v]) in keep and self.rng.random() < 0.7:
                keep.append(v)
        return Choice(draft, np.asarray(keep, dtype=np.int64))


class FixedTreeChooser:
    """Verifies a caller-built tree (tokens chosen by the test) rooted at the last committed token."""

    name = "fixed"

    def __init__(self, make_tree):
        self.make_tree = make_tree

    def choose(self, state):
        tree = self.make_tree(state)
        return Choice(DraftResult(tree, int(tree.max_depth), 0.0), np.arange(tree.num_nodes))


def test_reached_depth_follows_the_accepted_path_not_the_deepest_verified_node():
    from live.spec.verify import Verification, greedy_accept

    # root 0 -> 1 (a), 2 (b); 1 -> 3 (c); 2 -> 4 (d) -> 5 (e). The target wants a after the root,
    # then x after a (c rejected), so the accepted path is [1].
    tree = TokenTree.from_parents([7, 10, 11, 12, 13, 14], [-1, 0, 0, 1, 2, 4], np.zeros(6))
    target = np.array([10, 99, 13, 50, 14, 60])

    def reached(nodes, eos=frozenset()):
        path, on_eos = greedy_accept(tree, nodes, target, eos)
        empty = np.zeros((len(nodes), 0, 1), dtype=np.int64)
        ver = Verification(
            tree, np.asarray(nodes), target, path, on_eos, empty, empty.astype(np.float32), 0.0
        )
        return len(path), ver.reached_depth

    assert reached([0, 1, 2, 3, 4, 5]) == (1, 2)  # c verified below a and rejected: depth 2 reached
    assert reached([0, 1, 2, 4, 5]) == (1, 1)  # verified to depth 3 on b's branch, but a is a leaf
    assert reached([0, 2, 4, 5]) == (0, 1)  # a not verified: b judged at depth 1 and rejected
    assert reached([0]) == (0, 0)  # root only
    assert reached([0, 1, 3], eos=frozenset({10})) == (1, 1)  # accepted EOS: nothing judged below it


def test_tree_attention_mask_values():
    tree = TokenTree.from_parents([1, 2, 3, 4], [-1, 0, 0, 1], [0, -1, -2, -1])
    mask = tree_attention_mask(2, [0, 1, 2, 3], [0, 1, 2, 3], tree.ancestor_matrix(), torch.float16)
    assert mask.shape == (1, 1, 4, 6) and mask.dtype == torch.float16
    visible = (mask[0, 0] == 0).numpy()
    expected_tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)
    assert visible[:, :2].all()
    assert (visible[:, 2:] == expected_tree).all()
    assert float(mask[0, 0, 0, 3]) == torch.finfo(torch.float16).min


def test_keep_cache_positions_gathers_rows():
    cache = DynamicCache()
    keys = torch.arange(8, dtype=torch.float32).reshape(1, 1, 8, 1).repeat(1, 2, 1, 3)
    cache.update(keys, keys + 100, 0)
    keep_cache_positions(cache, 3, [4, 6])
    assert cache.get_seq_length() == 5
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 4, 6]
    assert cache.layers[0].values[0, 1, :, 0].tolist() == [100, 101, 102, 104, 106]
    with pytest.raises(ValueError, match="positions must lie"):
        keep_cache_positions(cache, 3, [9])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tree_logits_equal_sequential_paths(checkpoints, arch):
    target = _load(checkpoints[arch])
    drafter = ModelDrafter(_load(checkpoints["draft"]))
    draft = drafter.grow(PROMPT, TreeShape(depth=3, topk=3, max_nodes=10))
    tree = draft.tree
    assert tree.num_nodes == 10 and len(tree.children(0)) == 3  # siblings at the same position
    lm = CachedLM(target)
    lm.feed_causal(PROMPT[:-1])
    logits = lm.feed_tree(
        tree.token_ids,
        tree.depths,
        len(PROMPT) - 1,
        len(PROMPT) - 1,
        range(10),
        range(10),
        tree.ancestor_matrix(),
    )
    with torch.inference_mode():
        for v in range(tree.num_nodes):
            seq = PROMPT[:-1] + [int(tree.token_ids[u]) for u in tree.path_to(v)]
            ref = target(input_ids=torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(logits[v], ref, atol=2e-4, rtol=1e-4)


def _planned(drafter, shape, policy, verifier):
    """A specfit-policy chooser with a fixed cost model (per-node verify cost, free H2D)."""
    from live.spec.planning import PlannedChooser
    from specfit.cost import CycleCostModel

    num_layers = verifier.capture.num_layers
    num_experts = verifier.capture.num_experts
    cost = CycleCostModel(1e-3, 5e-3, 1e-4, 0.0, 1e12, 0.0, 4096, num_layers, source="test")
    return PlannedChooser(drafter, shape, policy, "recent", cost, num_experts)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_lossless_every_chooser(checkpoints, arch):
    target = _load(checkpoints[arch])
    ref = reference_greedy(target, PROMPT, 14)
    verifier = TreeVerifier(target)
    self_draft = ModelDrafter(_load(checkpoints[arch]))  # the target as its own draft: long accepted paths
    shape = TreeShape(depth=4, topk=3, max_nodes=12)
    cases = [(FullTreeChooser(self_draft, shape), False), (RandomSubtreeChooser(self_draft, shape), False)]
    cases += [(_planned(self_draft, shape, name, verifier), False) for name in ("specfit", "topn", "chain")]
    if arch == "qwen3_moe":  # the other choosers and dense mode do not depend on the architecture
        other_draft = ModelDrafter(_load(checkpoints["draft"]))
        cases += [(AutoregressiveChooser(), False), (FullTreeChooser(other_draft, shape), False)]
        cases += [(FullTreeChooser(self_draft, shape), True)]
    taus = []
    for chooser, dense in cases:
        drafter = getattr(chooser, "drafter", None)
        result = SpecDecoder(verifier, drafter).generate(PROMPT, 14, chooser, dense=dense)
        assert list(result.generated_ids) == ref, (arch, chooser.name, dense)
        assert len(result.cycles) == 14 if dense else len(result.cycles) <= 14
        taus.append(result.tau)
    assert taus[0] > 1.5  # self-drafting accepts: the test really exercises accepted paths and KV trimming


@pytest.fixture(scope="module")
def qwen(checkpoints):
    return _load(checkpoints["qwen3_moe"]), _load(checkpoints["qwen3_moe"])


def test_prompt_length_one_and_equal_to_tree_size(qwen):
    target, draft_model = qwen
    verifier, drafter = TreeVerifier(target), ModelDrafter(draft_model)
    shape = TreeShape(depth=3, topk=2, max_nodes=7)
    for prompt in ([17], list(range(10, 17))):
        ref = reference_greedy(target, prompt, 12)
        result = SpecDecoder(verifier, drafter).generate(prompt, 12, FullTreeChooser(drafter, shape))
        assert list(result.generated_ids) == ref
        assert result.prefill_expert_ids.shape[0] == len(prompt) - 1


def test_all_drafts_rejected_commits_one_token_per_cycle(qwen):
    target, _ = qwen
    ref = reference_greedy(target, PROMPT, 10)

    def wrong_tree(state):  # children never equal the target's greedy token
        bad = (ref[state.position] + 1) % TINY_VOCAB_SIZE
        return TokenTree.from_parents(
            [state.committed[-1], bad, (bad + 1) % TINY_VOCAB_SIZE], [-1, 0, 0], [0, -1, -2]
        )

    result = SpecDecoder(TreeVerifier(target)).generate(PROMPT, 10, FixedTreeChooser(wrong_tree))
    assert list(result.generated_ids) == ref
    assert [c.num_accepted for c in result.cycles] == [0] * 10
    assert result.tau == 1.0


def test_deep_chain_accepts_the_whole_chain(qwen):
    target, _ = qwen
    ref = reference_greedy(target, PROMPT, 20)

    def oracle_chain(state):  # the true continuation as a 12-deep chain
        toks = [state.committed[-1], *ref[state.position : state.position + 12]]
        return TokenTree.from_parents(toks, [-1, *range(len(toks) - 1)], [0.0] + [-0.1] * (len(toks) - 1))

    result = SpecDecoder(TreeVerifier(target)).generate(PROMPT, 20, FixedTreeChooser(oracle_chain))
    assert list(result.generated_ids) == ref
    assert [len(c.committed) for c in result.cycles] == [13, 7]  # 12 accepted + bonus, then the length limit


def test_eos_accepted_mid_tree_ends_output(qwen):
    target, draft_model = qwen
    ref = reference_greedy(target, PROMPT, 24)
    k = next(i for i in range(2, 8) if ref[i] not in ref[:i])  # first occurrence of the "EOS" token
    eos = ref[k]

    def oracle_chain(state):  # the true continuation, EOS at depth k + 1, more nodes after it
        toks = [state.committed[-1], *ref[state.position : state.position + 10]]
        return TokenTree.from_parents(toks, [-1, *range(len(toks) - 1)], [0.0] + [-0.1] * (len(toks) - 1))

    verifier = TreeVerifier(target, eos_token_ids=[eos])
    result = SpecDecoder(verifier).generate(PROMPT, 24, FixedTreeChooser(oracle_chain))
    assert list(result.generated_ids) == ref[: k + 1]
    assert len(result.cycles) == 1 and result.cycles[0].verification.stopped_on_eos and result.stopped_on_eos
    # with a drafted tree too: the output ends at the first EOS
    drafter = ModelDrafter(draft_model)
    tree_result = SpecDecoder(verifier, drafter).generate(
        PROMPT, 24, FullTreeChooser(drafter, TreeShape(8, 2, 17))
    )
    assert list(tree_result.generated_ids) == ref[: k + 1]


def test_back_to_back_generations_match_fresh_engine(checkpoints, qwen):
    target, draft_model = qwen
    shape = TreeShape(depth=3, topk=3, max_nodes=10)
    verifier, drafter = TreeVerifier(target), ModelDrafter(draft_model)
    decoder = SpecDecoder(verifier, drafter)
    first = decoder.generate(PROMPT, 16, FullTreeChooser(drafter, shape))
    second = decoder.generate([3, 4], 16, FullTreeChooser(drafter, shape))
    fresh_drafter = ModelDrafter(_load(checkpoints["qwen3_moe"]))
    fresh = SpecDecoder(TreeVerifier(_load(checkpoints["qwen3_moe"])), fresh_drafter).generate(
        [3, 4], 16, FullTreeChooser(fresh_drafter, shape)
    )
    assert second.generated_ids == fresh.generated_ids
    assert [len(c.committed) for c in second.cycles] == [len(c.committed) for c in fresh.cycles]
    assert first.generated_ids == tuple(reference_greedy(target, PROMPT, 16))


def test_dense_mode_records_every_node_routing(qwen):
    target, draft_model = qwen
    drafter = ModelDrafter(draft_model)
    result = SpecDecoder(TreeVerifier(target), drafter).generate(
        PROMPT, 6, FullTreeChooser(drafter, TreeShape(3, 3, 10)), dense=True
    )
    for c in result.cycles:
        ver = c.verification
        assert ver.expert_ids.shape == (10, 2, 4)
        assert ((ver.expert_ids >= 0) & (ver.expert_ids < 16)).all()
        assert np.allclose(ver.router_weights.sum(-1), 1.0, atol=1e-4) or (ver.router_weights > 0).all()
        assert (ver.target_tokens >= 0).all() and len(c.committed) == 1
        assert c.committed[0] == ver.target_tokens[0]


def test_offloaded_target_is_lossless_and_counts_traffic(checkpoints):
    from live.offload import make_link, offload_model

    resident = _load(checkpoints["qwen3_moe"])
    ref = reference_greedy(resident, PROMPT, 12)
    target = _load(checkpoints["qwen3_moe"])
    offload = offload_model(target, cache_experts=4, link=make_link("cpu", bandwidth_gb_per_s=5.0))
    drafter = ModelDrafter(_load(checkpoints["qwen3_moe"]))
    seen_cache = []

    class Spy(FullTreeChooser):
        def choose(self, state):
            seen_cache.append(state.cached_bits)
            return super().choose(state)

    result = SpecDecoder(TreeVerifier(target), drafter, stats=offload).generate(
        PROMPT, 12, Spy(drafter, TreeShape(3, 2, 7))
    )
    assert list(result.generated_ids) == ref
    assert all(b is not None and b.shape == (2, 1) for b in seen_cache)
    for c in result.cycles:
        assert c.stats.layer_misses.shape == (2,)
        assert c.stats.h2d_bytes == int(c.stats.layer_misses.sum()) * offload.bytes_per_expert
        assert c.stats.hits + c.stats.misses == sum(
            len(np.unique(c.verification.expert_ids[:, layer])) for layer in range(2)
        )
    assert sum(c.stats.misses for c in result.cycles) > 0


@pytest.mark.gpu
def test_cuda_tree_decoding_is_lossless(checkpoints):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = _load(checkpoints["qwen3_moe"]).to("cuda")
    ref = reference_greedy(target, PROMPT, 12)
    drafter = ModelDrafter(_load(checkpoints["qwen3_moe"]).to("cuda"))
    result = SpecDecoder(TreeVerifier(target), drafter).generate(
        PROMPT, 12, FullTreeChooser(drafter, TreeShape(3, 2, 7))
    )
    assert list(result.generated_ids) == ref


def test_router_capture_shapes(checkpoints):
    from live.spec.routing import RouterCapture

    for arch, (layers, experts, k) in {
        "qwen3_moe": (2, 16, 4),
        "mixtral": (2, 8, 2),
        "deepseek_v3": (2, 16, 4),
    }.items():
        model = _load(checkpoints[arch])
        cap = RouterCapture(model)
        assert (cap.num_layers, cap.num_experts, cap.top_k) == (layers, experts, k)
        with torch.inference_mode():
            model(input_ids=torch.tensor([PROMPT]))
        ids, weights = cap.take()
        assert ids.shape == weights.shape == (len(PROMPT), layers, k)
        assert ((ids >= 0) & (ids < experts)).all() and (weights > 0).all()
        assert all(len(set(row)) == k for row in ids.reshape(-1, k).tolist())  # distinct experts per token
        assert cap.take()[0].shape == (0, layers, k)  # taking clears
        cap.close()
    dense = _load(checkpoints["draft"])
    assert RouterCapture(dense).num_layers == 0
