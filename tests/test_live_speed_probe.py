"""live.speed_probe: the target's own attention + router as a machine-speed gauge (no wall-clock
assertion: only that it runs, touches no engine state and falls back cleanly)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.live_fixtures import TINY_ARCHS  # noqa: E402


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_model_probe_runs_the_targets_own_attention_and_router_without_hooks(tiny_checkpoint, arch, fake_clock):
    """On every tiny architecture the probe finds the MoE layers' attention and router weights,
    runs (timed on a fake clock: the value follows from its clock reads), is deterministic in
    what it computes, and fires none of the engine's hooks: a router capture on the model sees nothing and the cache stats stay 0."""
    from live.loader import describe_moe, load_target
    from live.offload import offload_model
    from live.spec.routing import RouterCapture
    from live.speed_probe import SpeedProbe, model_probe_inputs, probe_model_once

    target = load_target(tiny_checkpoint(arch), "cpu", "float32")
    offload = offload_model(target, cache_experts=2)
    capture = RouterCapture(target)
    inputs = model_probe_inputs(target)
    assert inputs is not None and len(inputs.layers) == describe_moe(target).num_layers
    assert all(w.shape == (describe_moe(target).num_experts, target.config.hidden_size) for _, w, _ in inputs.layers)
    reads_before = fake_clock.reads
    probed = probe_model_once(inputs)  # timed on the fake clock (tests/fake_clock.py): no wall-clock read
    assert fake_clock.sleeps[-1] > 0  # the untimed pause before the timed part
    # the value is the clock's advance between its start and end reads: ticks alone, exactly
    assert probed == pytest.approx(fake_clock.tick_s * (fake_clock.reads - reads_before - 1), rel=1e-6)
    ids, _ = capture.take()
    assert ids.shape[0] == 0  # no router hook fired
    assert offload.total_stats.layer_hits.sum() == 0 and offload.total_stats.layer_misses.sum() == 0
    probe = SpeedProbe(model=target)
    probe.measure(num_probes=4, num_model_probes=2)
    summary = probe.summary()
    assert len(summary["speed_probe_s"]) == 2 and len(summary["speed_probe_chain_s"]) == 4
    assert summary["speed_probe_workload"].startswith("the target's own attention + router")


def test_probe_falls_back_to_the_chain_without_a_model_or_its_layout():
    """No model, or a model without the layout: ``speed_probe_s`` is the chain's timings and the
    workload line says which; a model whose attention call fails is not tried again."""
    from live import speed_probe
    from live.speed_probe import SpeedProbe

    plain = SpeedProbe()
    plain.measure(num_probes=2, num_model_probes=2)
    # which list holds the timings (the chain's, no model timings), not how long they took
    assert plain.summary()["speed_probe_s"] == plain.summary()["speed_probe_chain_s"] and len(plain.seconds) == 0
    assert plain.summary()["speed_probe_workload"].startswith("tanh(y @ w)")
    other = SpeedProbe(model=torch.nn.Linear(4, 4))
    other.measure(num_probes=2, num_model_probes=2)
    assert "(the target's layout is not the model probe's)" in other.summary()["speed_probe_workload"]
    assert speed_probe.model_probe_inputs(torch.nn.Linear(4, 4)) is None


def test_probe_drops_the_models_timings_when_its_attention_fails_partway(tiny_checkpoint):
    """A target whose ``self_attn`` runs once and then raises: the probe stops trying the model
    (``_model_inputs is None``), drops the model timing it took before, so ``speed_probe_s`` is
    the chain's timings alone and the workload line says chain (one gauge per run)."""
    from live.loader import load_target
    from live.speed_probe import SpeedProbe

    target = load_target(tiny_checkpoint("qwen3_moe"), "cpu", "float32")
    attention = target.model.layers[0].self_attn
    calls = []
    original = attention.forward

    def once_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("attention failed")
        return original(*args, **kwargs)

    attention.forward = once_then_fail
    probe = SpeedProbe(model=target)
    probe.measure(num_probes=4, num_model_probes=4)
    assert len(calls) == 2  # it ran once, failed once, and was not tried again
    summary = probe.summary()  # the model's timings dropped: the chain's are the run's one gauge
    assert probe._model_inputs is None and summary["speed_probe_s"] == summary["speed_probe_chain_s"]
    summary = probe.summary()
    assert summary["speed_probe_s"] == summary["speed_probe_chain_s"] and len(summary["speed_probe_s"]) == 4
    assert summary["speed_probe_workload"].startswith("tanh(y @ w)")
