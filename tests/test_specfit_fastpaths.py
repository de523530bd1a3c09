"""Fast paths added for the simulator's speed keep the exact semantics of the plain ones.

* ``ExpertCache.access_layers`` (one vectorised access per layer) == ``L`` calls of ``access``,
  and both follow a plain OrderedDict LRU written out here as the reference.
* The union-size planner scores every prefix size at once: bit-identical to scoring each size
  with ``cost.cycle_s`` (the scalar loop is written out here), also when the expected-miss table
  is shared between the contexts of successive draft levels.
* ``plan_exact`` remembers the plan of a context object; ``PolicyContext.trusted`` skips checks
  only; ``make_plan``'s closure check still rejects bad sets.
* ``CycleCostModel.h2d_s`` / ``cycle_s`` price a signed-integer ``int[L]`` miss array in plain
  Python: bit-identical to the numpy path (a list, a float array) and it still rejects bad counts.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit import bitsets
from specfit.cache import make_expert_cache
from specfit.context import PolicyContext, make_plan
from specfit.cost import CycleCostModel, _int_misses_total
from specfit.node_experts import NodeExperts
from specfit.planner import plan_exact, plan_exact_many
from specfit.tree import DraftTree


class _ReferenceLRU:
    """One layer of the LRU semantics, spelled out with an OrderedDict (oldest first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.entries = capacity, OrderedDict()

    def access(self, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        ids = sorted(set(ids))
        hits = [e for e in ids if e in self.entries]
        misses = [e for e in ids if e not in self.entries]
        for e in hits:
            self.entries.move_to_end(e)
        evicted = []
        for e in misses:
            if self.capacity == 0:
                break
            if len(self.entries) >= self.capacity:
                victim = next(iter(self.entries))
                if victim in ids:
                    break  # only experts of this access are left: the rest are transient
                del self.entries[victim]
                evicted.append(victim)
            self.entries[e] = None
        return hits, misses, sorted(evicted)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["lru", "lfu", "static", "belady"]),
    st.integers(1, 3),
    st.integers(1, 70),
    st.integers(0, 2**31 - 1),
)
def test_access_layers_equals_per_layer_accesses(policy, num_layers, num_experts, seed) -> None:
    rng = np.random.default_rng(seed)
    steps = 12
    seqs = [
        [rng.choice(num_experts, size=int(rng.integers(0, min(num_experts, 6) + 1))) for _ in range(steps)]
        for _ in range(num_layers)
    ]
    capacity = rng.integers(0, num_experts + 1, size=num_layers)
    kwargs = {"frequency": rng.random((num_layers, num_experts)), "future": seqs}
    if policy != "static":
        kwargs.pop("frequency")
    if policy != "belady":
        kwargs.pop("future")
    single = make_expert_cache(policy, num_layers, num_experts, capacity, **kwargs)
    batched = make_expert_cache(policy, num_layers, num_experts, capacity, **kwargs)
    reference = [_ReferenceLRU(int(c)) for c in capacity]
    for k in range(steps):
        mask = np.zeros((num_layers, num_experts), dtype=bool)
        for layer in range(num_layers):
            mask[layer, seqs[layer][k]] = True
        out = batched.access_layers(mask)
        for layer, hits, misses, evicted in zip(
            range(num_layers), out.hit_ids(), out.miss_ids(), out.evicted_ids()
        ):
            one = single.access(layer, seqs[layer][k])
            assert one.hits.tolist() == hits.tolist() and one.misses.tolist() == misses.tolist()
            assert one.evicted.tolist() == evicted.tolist()
            if policy == "lru":
                assert reference[layer].access(seqs[layer][k].tolist()) == (
                    hits.tolist(),
                    misses.tolist(),
                    evicted.tolist(),
                )
        assert out.num_misses.tolist() == [len(m) for m in out.miss_ids()]
        assert np.array_equal(single.cached_bits(), batched.cached_bits())
        assert np.array_equal(single.cached_mask(), batched.cached_mask())
    for name in ("layer_hits", "layer_misses", "layer_evictions"):
        assert np.array_equal(getattr(single.stats, name), getattr(batched.stats, name))
    assert np.array_equal(single.stats.layer_miss_fraction, batched.stats.layer_miss_fraction, equal_nan=True)
    assert (single.stats.hits, single.stats.misses) == (batched.stats.hits, batched.stats.misses)


def test_access_layers_rejects_a_bad_mask_and_lru_order_is_exact() -> None:
    cache = make_expert_cache("lru", 2, 8, 2)
    with pytest.raises(ValueError, match=r"bool\[2, 8\]"):
        cache.access_layers(np.zeros((2, 7), dtype=bool))
    with pytest.raises(ValueError, match=r"bool\[2, 8\]"):
        cache.access_layers(np.zeros((2, 8), dtype=np.int64))
    mask = np.zeros((2, 8), dtype=bool)
    mask[0, [1, 2]] = True
    cache.access_layers(mask)
    mask[:] = False
    mask[0, 1] = True  # 1 becomes the most recent
    cache.access_layers(mask)
    mask[0, 1], mask[0, 5] = False, True
    out = cache.access_layers(mask)
    assert out.evicted_ids()[0].tolist() == [2] and cache.cached_ids(0).tolist() == [1, 5]
    assert out.num_misses.tolist() == [1, 0] and cache.stats.layer_misses.tolist() == [3, 0]
    assert cache.contains(0, 5) and not cache.contains(0, 99) and not cache.contains(1, 5)


def _union_plan_by_scan(ctx: PolicyContext) -> tuple[list[int], float]:
    """The union-size optimum scored one size at a time with ``cost.cycle_s`` (reference)."""
    p = ctx.accept_probs
    order = np.lexsort((np.arange(p.shape[0]), -p))
    order = np.concatenate(([0], order[order != 0]))
    best_ratio, best_k, gain = -1.0, 1, 1.0
    for k in range(1, order.shape[0] + 1):
        if k > 1:
            gain += float(p[order[k - 1]])
        misses = ctx.node_experts.expected_misses(k, ctx.cached_bits)
        ratio = gain / ctx.cost.cycle_s(ctx.num_levels, k, ctx.context_len, misses)
        if ratio > best_ratio:
            best_ratio, best_k = ratio, k
    return sorted(order[:best_k].tolist()), best_ratio


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.booleans(), st.booleans())
def test_union_size_plan_is_bit_identical_to_the_scan(seed, n, overlap, fixed_fraction) -> None:
    rng = np.random.default_rng(seed)
    num_layers, num_experts = int(rng.integers(1, 50)), 128
    tree = DraftTree.from_parents(
        np.zeros(n, dtype=np.int64),
        [-1] + [int(rng.integers(0, v)) for v in range(1, n)],
        np.concatenate(([0.0], -rng.exponential(0.7, n - 1))),
    )
    top = int(rng.integers(1, 50))  # sizes beyond ``top`` are extrapolated
    union = np.cumsum(rng.random((num_layers, top + 1)) * 3, axis=1)
    union[:, 0] = 0.0
    ne = NodeExperts(
        num_experts, union_size=union, miss_fraction=rng.random(num_layers) if fixed_fraction else None
    )
    cost = CycleCostModel(
        1e-3 * rng.random(), 2e-2 * rng.random(), 2e-4 * rng.random(), 1e-7 * rng.random(),
        1e9 + 5e10 * rng.random(), 1e-5 * rng.random(), 9_437_184, num_layers, overlap_h2d=overlap,
    )  # fmt: skip
    cached = bitsets.pack(rng.integers(-1, num_experts, size=(num_layers, 40)), num_experts)
    probs = np.exp(tree.path_logprobs)
    context_len = int(rng.integers(0, 3000))

    def contexts() -> list[PolicyContext]:
        # the contexts of successive draft levels share one NodeExperts and one cached_bits array
        out = []
        for levels in range(int(tree.max_depth) + 1):
            keep = np.flatnonzero(tree.depths <= levels)
            out.append(
                PolicyContext(
                    tree=tree.subtree(keep),
                    accept_probs=probs[keep],
                    node_experts=ne,
                    cached_bits=cached,
                    cost=cost,
                    context_len=context_len,
                    num_levels=levels,
                )  # fmt: skip
            )
        return out

    batched = contexts()
    batch_plans = plan_exact_many(batched)
    for ctx, plan, single in zip(batched, batch_plans, map(plan_exact, contexts())):
        nodes, ratio = _union_plan_by_scan(ctx)
        assert plan.nodes.tolist() == nodes == single.nodes.tolist()
        assert plan.predicted_tokens_per_s == pytest.approx(ratio, rel=1e-12)
        # the plan's scores are evaluate_nodes' own, bit for bit (as make_plan would give)
        again = make_plan(ctx, plan.nodes, "specfit", 0.0, 1)
        for name in ("expected_committed", "predicted_cycle_s", "predicted_tokens_per_s", "predicted_misses"):
            assert getattr(plan, name) == getattr(again, name) == getattr(single, name)
        assert plan_exact(ctx) is plan  # remembered per context object


def test_trusted_context_and_closure_checks() -> None:
    tree = DraftTree.from_parents([1, 2, 3, 4], [-1, 0, 0, 1], [0.0, -0.1, -0.5, -0.2])
    ne = NodeExperts(8, bits=bitsets.pack(np.array([[[0]], [[1]], [[2]], [[3]]]), 8))
    cost = CycleCostModel(1e-3, 1e-2, 1e-4, 0.0, 1e9, 1e-5, 1000, 1)
    fields = {
        "tree": tree,
        "accept_probs": np.exp(tree.path_logprobs),
        "node_experts": ne,
        "cached_bits": bitsets.pack(np.array([[1]]), 8),
        "cost": cost,
        "context_len": 5,
        "num_levels": 2,
    }
    checked, trusted = PolicyContext(**fields), PolicyContext.trusted(**fields)
    for name, value in fields.items():
        assert getattr(trusted, name) is value
    assert plan_exact(checked).nodes.tolist() == plan_exact(trusted).nodes.tolist()
    with pytest.raises(ValueError, match="not ancestor-closed"):
        make_plan(checked, np.array([0, 3]), "x", 0.0, 1)
    with pytest.raises(ValueError, match="not ancestor-closed"):
        make_plan(checked, np.array([1]), "x", 0.0, 1)
    with pytest.raises(ValueError, match="node 9 out of range"):
        make_plan(checked, np.array([0, 9]), "x", 0.0, 1)
    assert make_plan(checked, np.array([3, 1, 0, 1]), "x", 0.0, 1).nodes.tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="P\\(root\\)"):
        PolicyContext(**{**fields, "accept_probs": np.array([0.5, 0.4, 0.3, 0.2])})


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 64),
    st.sampled_from(["off", "ideal", "on"]),
    st.sampled_from([np.int16, np.int32, np.int64]),
)
def test_cycle_s_int_fast_path_is_bit_identical_to_numpy(seed, num_layers, overlap, dtype) -> None:
    rng = np.random.default_rng(seed)
    cost = CycleCostModel(
        draft_s_per_level=float(rng.uniform(0, 1e-3)),
        verify_base_s=float(rng.uniform(0, 1e-2)),
        verify_s_per_node=float(rng.uniform(0, 1e-4)),
        verify_s_per_context_token=float(rng.uniform(0, 1e-6)),
        h2d_bytes_per_s=float(rng.uniform(1e9, 6e10)),
        h2d_s_per_transfer=float(rng.uniform(0, 1e-4)),
        expert_bytes=int(rng.integers(1, 2**24)),
        num_layers=num_layers,
        draft_base_s=float(rng.uniform(0, 1e-3)),
        overlap_h2d=overlap != "off",
        overlap_mode="on" if overlap == "on" else "ideal",
    )
    misses = rng.integers(0, int(rng.choice([2, 9, 129, 10_000])), size=num_layers).astype(dtype)
    total = float(np.asarray(misses, dtype=np.int64).sum())
    assert _int_misses_total(misses, num_layers) == total  # the scalar path is the one taken
    assert cost.h2d_s(misses) == cost.transfer_s(total) == cost.h2d_s(misses.tolist())
    assert cost.h2d_s(misses) == cost.h2d_s(misses.astype(np.float64))
    levels, nodes, context = int(rng.integers(0, 8)), int(rng.integers(1, 65)), int(rng.integers(0, 4096))
    fast = cost.cycle_s(levels, nodes, context, misses)
    assert type(fast) is float
    assert fast == cost.cycle_s(levels, nodes, context, misses.tolist())
    assert fast == cost.cycle_s(levels, nodes, context, misses.astype(np.float64))
    bad = misses.copy()
    bad[int(rng.integers(0, num_layers))] = -1
    with pytest.raises(ValueError, match="counts >= 0"):
        cost.h2d_s(bad)
    with pytest.raises(ValueError, match="counts >= 0"):
        cost.cycle_s(levels, nodes, context, bad)
    with pytest.raises(ValueError, match="layers"):
        cost.h2d_s(np.zeros(num_layers + 1, dtype=dtype))
