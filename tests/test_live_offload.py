"""live.offload: offloaded == resident, cache counters == the policy object, fetch before compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from live_fixtures import TINY_ARCHS, make_cache
from transformers import DynamicCache

from live.h2d import H2DLink
from live.loader import describe_moe, load_target
from live.offload import (
    ForwardStats,
    OffloadedMoE,
    default_cache_experts,
    make_link,
    validate_cache_experts,
)

PROMPT = torch.tensor([[5, 17, 42, 8, 90, 33, 61, 7, 12, 71]])


def _offloaded(path, capacity, *, link=None, policy="lru", record_routing=True, overlap=False):
    model = load_target(path)
    spec = describe_moe(model)
    cache = make_cache(policy, spec.num_layers, spec.num_experts, capacity)
    engine = OffloadedMoE.install(
        model, cache, link, record_routing=record_routing, capacity_per_layer=capacity, overlap=overlap
    )
    return model, engine


@torch.no_grad()
def _greedy(model, engine, prompt, steps):
    """Prefill + ``steps`` greedy decode steps; returns (logits per forward, stats, routing)."""
    kv = DynamicCache(config=model.config)
    ids, logits_all, stats, routing = prompt, [], [], []
    for _ in range(steps + 1):
        if engine is not None:
            engine.begin_forward()
        out = model(input_ids=ids, cache=kv, use_cache=True)
        if engine is not None:
            stats.append(engine.end_forward())
            routing.append(engine.last_routing())
        logits_all.append(out.logits[0])
        ids = out.logits[:, -1:].argmax(-1)
    return logits_all, stats, routing


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_offloaded_logits_equal_resident(tiny_checkpoint, arch, overlap):
    """With and without overlap (copies on the copy stream, late experts computed as they land;
    an emulated link slow enough that copies are still in flight when the layer computes)."""
    path = tiny_checkpoint(arch)
    resident = load_target(path, experts_on_device=True)
    link = make_link("cpu", bandwidth_gb_per_s=0.05) if overlap else None
    model, engine = _offloaded(path, capacity=3, link=link, overlap=overlap)
    want, _, _ = _greedy(resident, None, PROMPT, steps=4)
    got, stats, routing = _greedy(model, engine, PROMPT, steps=4)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    total = sum(stats[1:], stats[0])
    assert total.misses > 0 and total.hits > 0
    assert total.h2d_bytes >= total.misses * engine.bytes_per_expert
    assert stats[0].num_tokens == PROMPT.shape[1] and stats[1].num_tokens == 1
    ids, weights = routing[0]
    assert ids.shape == (PROMPT.shape[1], 2, engine.top_k) and weights.shape == ids.shape
    assert ids.min() >= 0 and ids.max() < engine.num_experts


def test_routing_equals_router_outputs(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    resident = load_target(path, experts_on_device=True)
    captured = []
    for layer in resident.model.layers:
        layer.mlp.gate.register_forward_hook(
            lambda m, a, out: captured.append((out[2].clone(), out[1].clone()))
        )
    with torch.no_grad():
        resident(PROMPT)
    model, engine = _offloaded(path, capacity=2)
    _, _, routing = _greedy(model, engine, PROMPT, steps=0)
    ids, weights = routing[0]
    for layer, (want_ids, want_w) in enumerate(captured):
        np.testing.assert_array_equal(ids[:, layer], want_ids.numpy())
        np.testing.assert_allclose(weights[:, layer], want_w.numpy(), rtol=1e-6)
    # Qwen3 without norm_topk_prob: softmax top-k weights, descending, summing to < 1
    assert np.all(np.diff(weights, axis=-1) <= 0) and np.all(weights.sum(-1) < 1)


def test_counters_equal_the_policy_fed_the_same_sequence(tiny_checkpoint):
    model, engine = _offloaded(tiny_checkpoint("olmoe"), capacity=5)
    _, stats, routing = _greedy(model, engine, PROMPT, steps=6)
    replay = make_cache("lru", engine.num_layers, engine.num_experts, 5)
    for forward_stats, (ids, _) in zip(stats, routing):
        for layer in range(engine.num_layers):
            access = replay.access(layer, np.unique(ids[:, layer]))
            assert forward_stats.layer_hits[layer] == len(access.hits)
            assert forward_stats.layer_misses[layer] == len(access.misses)
            assert forward_stats.layer_evictions[layer] == len(access.evicted)
    np.testing.assert_array_equal(replay.cached_bits(), engine.cache.cached_bits())
    assert sum(s.evictions for s in stats) > 0
    for layer in range(engine.num_layers):  # pool mirrors the policy's cached set
        cached = [e for e in range(engine.num_experts) if engine.cache.contains(layer, e)]
        np.testing.assert_array_equal(engine.pool.resident(layer), cached)


class _LoggingLink(H2DLink):
    def __init__(self, log):
        super().__init__("cpu")
        self.log = log

    def fetch(self, transfers):
        self.log.append("fetch")
        return super().fetch(transfers)


def test_fetch_happens_before_compute(tiny_checkpoint):
    log = []
    model, engine = _offloaded(tiny_checkpoint("qwen3_moe"), capacity=2, link=_LoggingLink(log))
    log.clear()  # install synchronises the (empty) cache through the link
    for _, block in [(i, layer.mlp) for i, layer in enumerate(model.model.layers)]:
        block.experts.register_forward_hook(lambda m, a, o: log.append(f"computed{m.moe_index}"))
    # poison every slot: any expert computed before being fetched would turn the output into NaN
    for gate_up, down in [*engine.pool.persistent, engine.pool.scratch]:
        gate_up.fill_(float("nan"))
        down.fill_(float("nan"))
    with torch.no_grad():
        logits = model(PROMPT).logits
    assert torch.isfinite(logits).all()
    assert log == ["fetch", "computed0", "fetch", "computed1"]
    assert engine.last_stats is not None and engine.last_stats.num_forwards == 1  # auto-bracketed


def test_all_experts_cached_means_no_traffic(tiny_checkpoint):
    model, engine = _offloaded(tiny_checkpoint("qwen3_moe"), capacity=16)
    warm_bytes = engine.warm_all()
    assert warm_bytes == 2 * 16 * engine.bytes_per_expert == engine.warm_bytes
    _, stats, _ = _greedy(model, engine, PROMPT, steps=3)
    assert all(s.misses == 0 and s.h2d_bytes == 0 and s.h2d_s == 0 for s in stats)
    assert stats[0].hit_rate == 1.0


def test_back_to_back_generations_match_fresh_engine(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    model, engine = _offloaded(path, capacity=2)
    first, _, _ = _greedy(model, engine, PROMPT, steps=3)
    second, _, _ = _greedy(model, engine, PROMPT, steps=3)
    engine.reset_cache()
    assert engine.pool.resident(0).size == 0
    third, _, _ = _greedy(model, engine, PROMPT[:, :1], steps=2)  # prompt length 1 works
    fresh_model, fresh_engine = _offloaded(path, capacity=2)
    fresh, _, _ = _greedy(fresh_model, fresh_engine, PROMPT, steps=3)
    # the cache state differs between runs, so kernels see different slot layouts: equal within
    # float tolerance, and the same greedy tokens
    for a, b, c in zip(first, second, fresh):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
        assert torch.equal(a.argmax(-1), b.argmax(-1)) and torch.equal(a.argmax(-1), c.argmax(-1))
    assert third[0].shape == (1, fresh_model.config.vocab_size)


def test_emulated_link_time_is_recorded_per_layer(tiny_checkpoint, fake_clock):
    """On a fake clock (tests/fake_clock.py) each layer's H2D time is exactly its misses times
    the emulated per-expert time (plus clock reads); compute is what remains of the layer."""
    bandwidth_gb_per_s = 0.01  # 6144-byte experts -> 0.61 ms each
    model, engine = _offloaded(
        tiny_checkpoint("qwen3_moe"), capacity=4, link=make_link("cpu", bandwidth_gb_per_s)
    )
    _, stats, _ = _greedy(model, engine, PROMPT, steps=1)
    per_expert_s = engine.bytes_per_expert / (bandwidth_gb_per_s * 1e9)
    reads_s = 1e-4  # all clock reads of a forward together (1e-7 s each)
    for s in stats:
        assert s.misses > 0
        np.testing.assert_allclose(s.layer_h2d_s, s.layer_misses * per_expert_s, atol=reads_s)
        assert np.all(s.layer_compute_s >= 0) and s.compute_s < reads_s
        assert s.wall_s >= s.h2d_s
    assert engine.h2d_link.kind == "cpu-emulated"
    assert engine.h2d_link.bandwidth_bytes_per_s == pytest.approx(1e7)


def test_recorder_and_totals(tiny_checkpoint):
    seen: list[ForwardStats] = []
    model = load_target(tiny_checkpoint("qwen3_moe"))
    cache = make_cache("lru", 2, 16, 4)
    engine = OffloadedMoE.install(model, cache, recorder=seen.append, record_routing=False)
    _greedy_no_routing = [model(PROMPT) for _ in range(2)]
    assert len(seen) == 2 and len(_greedy_no_routing) == 2
    assert engine.total_stats.misses == seen[0].misses + seen[1].misses
    assert engine.total_stats.num_forwards == 2
    # same tokens twice: the second access finds the 4 experts LRU kept from the same union
    np.testing.assert_array_equal(seen[1].layer_hits, [4, 4])
    np.testing.assert_array_equal(seen[1].layer_misses, seen[0].layer_misses - 4)
    with pytest.raises(RuntimeError, match="routing recording is off"):
        engine.last_routing()


def test_bad_capacity_and_double_install(tiny_checkpoint):
    model = load_target(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(ValueError, match=r"\(--cache\): expected 0\.\.16"):
        OffloadedMoE.install(model, make_cache("lru", 2, 16, 4), capacity_per_layer=17)
    with pytest.raises(ValueError, match=r"--cache: expected 0\.\.16"):
        validate_cache_experts(17, 16)
    assert default_cache_experts(64) == 16 and default_cache_experts(2) == 1
    with pytest.raises(ValueError, match=r"cache\.num_experts: expected 16"):
        OffloadedMoE.install(model, make_cache("lru", 2, 8, 4))
    with pytest.raises(ValueError, match="cache capacity per layer: expected 2"):
        OffloadedMoE.install(model, make_cache("lru", 2, 16, 4), capacity_per_layer=2)
    engine = OffloadedMoE.install(model, make_cache("lru", 2, 16, 4))
    with pytest.raises(ValueError, match=r"cache\.num_layers: expected 2"):
        engine.set_cache(make_cache("lru", 3, 16, 4))
    with pytest.raises(ValueError, match="already offloaded"):
        OffloadedMoE.install(model, make_cache("lru", 2, 16, 4))
    with pytest.raises(ValueError, match="--bandwidth"):
        make_link("cpu", 0.0)


def test_generate_runs_on_the_offloaded_model(tiny_checkpoint):
    path = tiny_checkpoint("qwen2_moe")
    resident = load_target(path, experts_on_device=True)
    model, engine = _offloaded(path, capacity=4)
    kwargs = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = resident.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **kwargs)
        got = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **kwargs)
    assert torch.equal(got, want)
    assert engine.total_stats.num_forwards == 5  # one auto-bracketed forward per token
    assert engine.total_stats.num_tokens == PROMPT.shape[1] + 4


@pytest.mark.parametrize("policy", ["lfu", "static"])
def test_other_policies_match_their_replay(tiny_checkpoint, policy):
    pytest.importorskip("specfit.cache")
    from live.offload import offload_model

    frequency = np.tile(np.arange(16, dtype=np.float64)[::-1], (2, 1))  # static keeps experts 0..5
    model = load_target(tiny_checkpoint("qwen3_moe"))
    engine = offload_model(model, cache_experts=6, cache_policy=policy, frequency=frequency)
    if policy == "static":
        np.testing.assert_array_equal(engine.pool.resident(0), np.arange(6))
        assert engine.warm_bytes == 2 * 6 * engine.bytes_per_expert
    replay = engine.cache.copy()
    _, stats, routing = _greedy(model, engine, PROMPT, steps=4)
    for forward_stats, (ids, _) in zip(stats, routing):
        for layer in range(engine.num_layers):
            access = replay.access(layer, ids[:, layer])
            assert forward_stats.layer_misses[layer] == len(access.misses)
            assert forward_stats.layer_hits[layer] == len(access.hits)
    if policy == "static":
        assert sum(s.evictions for s in stats) == 0
        np.testing.assert_array_equal(engine.pool.resident(1), np.arange(6))


def test_offload_model_flag_errors(tiny_checkpoint):
    from live.offload import offload_model

    model = load_target(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(ValueError, match="--cache-policy: expected one of lru, lfu, static"):
        offload_model(model, cache_policy="fifo")
    with pytest.raises(ValueError, match="--cache-policy static: needs expert frequencies"):
        offload_model(model, cache_policy="static")
    with pytest.raises(ValueError, match="--cache: expected"):
        offload_model(model, cache_experts=99)


def test_bfloat16_offloaded_close_to_resident(tiny_checkpoint):
    path = tiny_checkpoint("olmoe")
    resident = load_target(path, dtype="bfloat16", experts_on_device=True)
    model = load_target(path, dtype="bfloat16")
    engine = OffloadedMoE.install(model, make_cache("lru", 2, 16, 3))
    with torch.no_grad():
        want = resident(PROMPT).logits.float()
        got = model(PROMPT).logits.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert engine.bytes_per_expert == 3 * 32 * 16 * 2


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_every_upstream_expert_kernel_matches_resident(tiny_checkpoint, implementation):
    """Split layers (cached + transient experts) use upstream's sentinel convention per kernel."""
    path = tiny_checkpoint("qwen3_moe")
    resident = load_target(path, experts_on_device=True)
    resident.set_experts_implementation(implementation)
    model = load_target(path)
    model.set_experts_implementation(implementation)
    engine = OffloadedMoE.install(model, make_cache("lru", 2, 16, 3))
    want, _, _ = _greedy(resident, None, PROMPT, steps=2)
    got, stats, _ = _greedy(model, engine, PROMPT, steps=2)
    assert model.config._experts_implementation == implementation
    assert stats[0].misses > 3 * 2  # transient experts in the prefill: the split path ran
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_explicit_bracketing_errors_and_abort(tiny_checkpoint):
    model, engine = _offloaded(tiny_checkpoint("qwen3_moe"), capacity=4)
    with pytest.raises(RuntimeError, match="no forward in progress"):
        engine.end_forward()
    engine.begin_forward()
    with pytest.raises(RuntimeError, match="abort_forward"):
        engine.begin_forward()
    with pytest.raises(IndexError), torch.no_grad():
        model(torch.tensor([[1000]]))  # token id beyond the vocabulary
    engine.abort_forward()
    assert engine.total_stats.num_forwards == 0
    _, stats, _ = _greedy(model, engine, PROMPT, steps=0)
    assert stats[0].num_forwards == 1 and engine.total_stats.num_forwards == 1
