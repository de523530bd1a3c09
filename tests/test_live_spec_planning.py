"""Policy mode: specfit policies choose the verified subtree live (tiny random Qwen3-MoE)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from live.offload import make_link, offload_model
from live.spec.draft import ModelDrafter, TreeShape
from live.spec.engine import SpecDecoder
from live.spec.planning import PlannedChooser
from live.spec.verify import TreeVerifier

pytest.importorskip("specfit.policies")
from specfit import bitsets  # noqa: E402
from specfit.context import make_plan  # noqa: E402
from specfit.cost import CycleCostModel  # noqa: E402

PROMPT = [5, 9, 33, 12, 40, 7]
SHAPE = TreeShape(depth=4, topk=3, max_nodes=12)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


def _model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _cost(bandwidth_bytes_per_s: float, expert_bytes: int, s_per_node: float = 2e-4) -> CycleCostModel:
    return CycleCostModel(
        draft_s_per_level=1e-3,
        verify_base_s=5e-3,
        verify_s_per_node=s_per_node,
        verify_s_per_context_token=0.0,
        h2d_bytes_per_s=bandwidth_bytes_per_s,
        h2d_s_per_transfer=0.0,
        expert_bytes=expert_bytes,
        num_layers=2,
        source="test",
    )


def _engine(path, bandwidth_bytes_per_s, policy="specfit", predictor="recent", s_per_node=2e-4):
    target = _model(path)
    offload = offload_model(target, cache_experts=4, link=make_link("cpu"))
    drafter = ModelDrafter(_model(path))  # self-drafting: long accepted paths, so trees are worth verifying
    chooser = PlannedChooser(
        drafter,
        SHAPE,
        policy,
        predictor,
        _cost(bandwidth_bytes_per_s, offload.bytes_per_expert, s_per_node),
        16,
    )
    return SpecDecoder(TreeVerifier(target), drafter, stats=offload), chooser


def _reference(path, n):
    model, seq = _model(path), list(PROMPT)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(PROMPT) :]


def test_specfit_follows_the_cost_model_and_stays_lossless(path):
    ref = _reference(path, 16)
    sizes = {}
    for s_per_node in (10.0, 0.0):  # a verified node costs 10 s vs. nothing
        decoder, chooser = _engine(path, 1e15, s_per_node=s_per_node)
        chooser.policy.guard = None  # the per-cycle cost model alone, without the guard's history
        result = decoder.generate(PROMPT, 16, chooser)
        assert list(result.generated_ids) == ref
        for c in result.cycles:
            plan = c.choice.plan
            assert plan is not None and plan.decision_s > 0 and plan.expected_committed >= 1
            assert np.array_equal(c.verification.nodes, np.sort(plan.nodes))
        sizes[s_per_node] = np.mean([len(c.verification.nodes) for c in result.cycles])
    assert sizes[10.0] == 1.0  # nodes too dear: only the root is verified
    assert sizes[0.0] > 3.0


def test_the_live_specfit_planner_searches_with_the_live_deadline(path, monkeypatch):
    """The live chooser builds SpecFit with LIVE_DEADLINE_FRACTION: every exact search (per-node
    experts: the recent predictor) gets that fraction of its context's least predicted cycle time."""
    import specfit.policies
    from specfit.policies import LIVE_DEADLINE_FRACTION

    deadlines = []
    plan_exact = specfit.policies.plan_exact

    def spy(ctx, deadline_s=None, **kw):
        least_s = ctx.cost.cycle_s_total(ctx.num_levels, 1, ctx.context_len, 0.0)
        deadlines.append((deadline_s, LIVE_DEADLINE_FRACTION * least_s))
        return plan_exact(ctx, deadline_s=deadline_s, **kw)

    monkeypatch.setattr(specfit.policies, "plan_exact", spy)
    decoder, chooser = _engine(path, 1e15)
    assert chooser.policy.deadline_fraction == LIVE_DEADLINE_FRACTION > 0
    decoder.generate(PROMPT, 4, chooser)
    assert deadlines and all(given == wanted for given, wanted in deadlines)
    _, topn = _engine(path, 1e15, policy="topn")
    assert not hasattr(topn.policy, "deadline_fraction")  # no search to cut


def test_keep_drafting_is_asked_after_each_level(path):
    decoder, chooser = _engine(path, 1e15)
    asked = []

    class Policy:
        name = "probe"

        def keep_drafting(self, ctx, max_depth, topk):
            asked.append((ctx.num_levels, ctx.tree.max_depth, max_depth, topk))
            return ctx.num_levels < 2

        def select(self, ctx):
            return make_plan(ctx, np.arange(ctx.num_nodes), "probe", 1e-6, 1)

    chooser.policy = Policy()
    result = decoder.generate(PROMPT, 4, chooser)
    # asked first on the root alone (may it draft at all?), then after each drafted level
    assert asked[:3] == [(0, 0, 4, 3), (1, 1, 4, 3), (2, 2, 4, 3)]
    assert all(c.choice.draft.num_levels == 2 for c in result.cycles)

    class Never(Policy):
        def keep_drafting(self, ctx, max_depth, topk):
            return False

    decoder, chooser = _engine(path, 1e15)
    chooser.policy = Never()
    result = decoder.generate(PROMPT, 4, chooser)  # "no level can pay" on the root: nothing is drafted
    assert list(result.generated_ids) == _reference(path, 4)
    assert all(c.choice.draft.num_levels == 0 and c.choice.draft.draft_s == 0.0 for c in result.cycles)
    assert all(list(c.verification.nodes) == [0] for c in result.cycles)


def test_stopping_rule_time_is_decision_time_not_subtracted_twice(path, fake_clock):
    """The rule's time counts once, in decision_s; draft_s keeps the draft forwards (the level-0
    question runs before drafting, so it must not be taken off the draft time as well). On a fake
    clock (tests/fake_clock.py) only the stand-in pauses take time, so the split is exact."""
    decoder, chooser = _engine(path, 1e15)
    pause_s = 0.02

    class Slow:
        name = "slow"

        def keep_drafting(self, ctx, max_depth, topk):
            fake_clock.advance(pause_s)
            return ctx.num_levels < 2

        def select(self, ctx):
            return make_plan(ctx, np.arange(ctx.num_nodes), "slow", 1e-6, 1)

    chooser.policy = Slow()
    lm = chooser.drafter.lm
    for name in ("feed_causal", "feed_tree"):  # each draft forward takes pause_s
        forward = getattr(lm, name)

        def slow_forward(*args, _forward=forward, **kwargs):
            fake_clock.advance(pause_s)
            return _forward(*args, **kwargs)

        setattr(lm, name, slow_forward)
    result = decoder.generate(PROMPT, 4, chooser)
    reads_s = 1e-3  # every clock read of a cycle together (each read is one tick, 1e-7 s)
    for c in result.cycles:
        # asked at levels 0, 1 and 2: three pauses in the decision; two draft forwards in the draft
        assert c.choice.draft.num_levels == 2
        assert c.choice.plan.decision_s == pytest.approx(3 * pause_s, abs=reads_s)
        assert c.choice.draft.draft_s == pytest.approx(2 * pause_s, abs=reads_s)
        unaccounted_s = (
            c.cycle_s - c.choice.plan.decision_s - c.choice.draft.draft_s - c.verification.verify_s
        )
        assert 0.0 <= unaccounted_s < reads_s


def test_token_table_predictor_learns_committed_routing(path):
    decoder, chooser = _engine(path, 1e9, predictor="token-table")
    result = decoder.generate(PROMPT, 8, chooser)
    assert chooser.table
    committed = [*PROMPT, *result.generated_ids]
    # the table entry of the first prompt token is its prefill routing
    first = bitsets.pack(result.prefill_expert_ids[0], 16)
    if committed[0] not in committed[1:-1]:
        assert np.array_equal(chooser.table[committed[0]], first)
    assert all(v.shape == (2, 1) and v.dtype == np.uint64 for v in chooser.table.values())


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="expected one of"):
        PlannedChooser(None, SHAPE, "nope", "recent", None, 16)
    with pytest.raises(ValueError, match="expected one of"):
        PlannedChooser(None, SHAPE, "specfit", "oracle", None, 16)
    with pytest.raises(ValueError, match="union-size"):
        PlannedChooser(None, SHAPE, "specfit", "union-size", None, 16)


def test_quick_cost_estimate_uses_the_link_and_measures_compute(path):
    from live.spec.costs import estimate_cost_model

    target = _model(path)
    offload = offload_model(
        target, cache_experts=4, link=make_link("cpu", bandwidth_gb_per_s=2.0, latency_s=1e-5)
    )
    drafter = ModelDrafter(_model(path))
    cost = estimate_cost_model(TreeVerifier(target), drafter, offload, SHAPE, PROMPT, repeats=2)
    assert cost.h2d_bytes_per_s == 2e9 and cost.h2d_s_per_transfer == 1e-5
    assert cost.expert_bytes == offload.bytes_per_expert and cost.num_layers == 2
    assert cost.draft_s_per_level > 0 and cost.verify_base_s + cost.verify_s_per_node > 0
    assert 0 < cost.pre_router_fraction < 1  # attention + router measured: a share of each layer's compute


def test_quick_draft_estimate_is_a_line_through_one_level_and_full_depth() -> None:
    from live.spec.costs import _line_through

    assert _line_through({1: 1.5e-3, 4: 4.2e-3}) == pytest.approx((0.6e-3, 0.9e-3))
    assert _line_through({3: 3e-3}) == pytest.approx((0.0, 1e-3))  # one depth: no base
    assert _line_through({1: 1e-3, 3: 5e-3}) == pytest.approx((0.0, 5e-3 / 3))  # negative base: none
    assert _line_through({}) == (0.0, 0.0)


def test_decode_clock_leaves_out_trace_recording(path, fake_clock):
    """decode_s covers the cycles and the loop between them, not the on_cycle callbacks (the
    trace writer): otherwise a policy with more cycles pays more recording time per token. On a
    fake clock only the callbacks' stand-in pause takes time."""
    decoder, chooser = _engine(path, 1e15)
    pause_s = 0.05
    result = decoder.generate(PROMPT, 6, chooser, on_cycle=lambda event: fake_clock.advance(pause_s))
    cycles_s = sum(c.cycle_s for c in result.cycles)
    assert len(result.cycles) >= 2
    assert cycles_s <= result.decode_s < cycles_s + 1e-3  # < 1e-3: clock reads only, no pause


def test_selection_reuses_the_context_the_stopping_rule_just_planned(path):
    """When the rule stops drafting, select gets the very context it was asked on (the planner
    remembers plans per context, so the final plan is not searched twice)."""
    decoder, chooser = _engine(path, 1e15)
    asked, selected = [], []

    class Probe:
        name = "probe"

        def keep_drafting(self, ctx, max_depth, topk):
            asked.append(ctx)
            return ctx.num_levels < 2

        def select(self, ctx):
            selected.append(ctx)
            return make_plan(ctx, np.arange(ctx.num_nodes), "probe", 1e-6, 1)

    chooser.policy = Probe()
    decoder.generate(PROMPT, 4, chooser)
    assert selected and all(any(s is a for a in asked) for s in selected)


def test_link_measurement_recovers_an_emulated_link(path, fake_clock):
    """measure_link (the quick estimate's real-link path on CUDA) times fetches of one expert per
    copy and separates bandwidth and per-expert latency; checked here on an emulated link and a
    fake clock (tests/fake_clock.py), so the copies last exactly what the link charges."""
    from live.spec.costs import measure_link

    offload = offload_model(
        _model(path), cache_experts=4, link=make_link("cpu", bandwidth_gb_per_s=0.2, latency_s=20e-6)
    )
    bytes_per_s, s_per_transfer = measure_link(offload, repeats=10)
    # a copy overruns its deadline by less than one clock read (tick); the two copy sizes are
    # 4096 and 2048 bytes, so the slope is off by at most ~2 ticks / 2048 bytes
    tick = fake_clock.tick_s
    assert 1 / bytes_per_s == pytest.approx(1 / 0.2e9, abs=2 * tick / 2048)
    assert s_per_transfer == pytest.approx(20e-6, abs=10 * tick)


def test_live_engine_reports_each_cycle_to_the_policy_guard(path):
    """The same SpecFitPolicy object as the simulator: its guard sees every realised cycle."""
    decoder, chooser = _engine(path, 1e15)
    result = decoder.generate(PROMPT, 8, chooser)
    guard = chooser.policy.guard
    assert len(guard.arms["spec"]) + len(guard.arms["ar"]) == len(result.cycles)
    # each cycle is priced by the planner's cost model on its realised misses, never wall time,
    # so the simulator's replay (same misses, same cost model) feeds the guard the same numbers
    expected = {"spec": [], "ar": []}
    for c in result.cycles:
        levels = int(c.choice.draft.num_levels)
        priced = chooser.cost.cycle_s(levels, len(c.choice.nodes), c.context_len, c.stats.layer_misses)
        expected["spec" if levels > 0 else "ar"].append((float(len(c.committed)), float(priced)))
    for arm in ("spec", "ar"):
        assert [c[:2] for c in guard.arms[arm]] == expected[arm][-guard.window :]
    # each drafting cycle also carries the root alone's price on the cache the planner saw: the
    # root's experts are among the verified ones, so it misses no more than the cycle
    assert guard.arms["spec"]
    assert all(c[3] is not None and 0 < c[3] <= c[1] for c in guard.arms["spec"])


def test_live_guard_state_round_trips_the_root_alone_prices(path):
    """``--resume``: the chooser's saved guard keeps each drafting cycle's root-alone price."""
    import json

    decoder, chooser = _engine(path, 1e15)
    decoder.generate(PROMPT, 8, chooser)
    state = json.loads(json.dumps(chooser.state_dict()))
    _, fresh = _engine(path, 1e15)
    fresh.load_state_dict(state)
    for arm in ("spec", "ar"):
        assert list(fresh.policy.guard.arms[arm]) == list(chooser.policy.guard.arms[arm])
    assert fresh.policy.guard.root_rate() == chooser.policy.guard.root_rate()
