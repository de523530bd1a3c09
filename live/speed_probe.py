"""Machine-speed gauges independent of the decoding: fixed small torch workloads, timed.

``live.record`` times them a few times before its first request and after each request
(``live.spec.session.RecordSession.run``), outside every timed cycle, and writes the timings to
``summary.json``. Two workloads, interleaved (each after an untimed ``PROBE_GAP_S`` pause, so the
memory it touches goes cold, as between a decode's phases: README, issue 14's cold-page finding):

- ``speed_probe_s`` (the gauge ``analysis.validate`` normalises with): the target model's OWN
  attention and router (:func:`probe_model_once`): per decoder layer its input norm, its attention
  module (upstream's code, no KV cache, no mask), the residual, its post-attention norm and the
  router's logits, softmax and top-k on the layer's router weight, for a fixed seeded
  ``[1, PROBE_ROWS, hidden]`` input at positions ``0..PROBE_ROWS-1``: the same weights, code and
  kernels as the attention + router part of every verify forward (``layer_pre_router_s``), called
  directly on the submodules so no hook of the engine (router capture, layer timing, offload) sees
  it and the expert cache is untouched. Models without that layout (``model.model.layers`` with
  ``input_layernorm`` / ``self_attn`` / ``post_attention_layernorm`` / ``mlp.gate.weight`` and
  ``model.model.rotary_emb``) fall back to the chain below, and the workload line says so.
- ``speed_probe_chain_s``: a chain of ``PROBE_CHAIN`` small products ``tanh(y @ w[i])`` of a
  float32 ``[PROBE_ROWS, PROBE_SIZE]`` activation through ``PROBE_CHAIN`` distinct
  ``PROBE_SIZE x PROBE_SIZE`` weights (:func:`probe_once`; about 1 ms on one thread of this
  project's CPU machine), the previous gauge, kept so each run measures both. On the embedded
  default it correlated 0.67-0.77 per run with the runs' attention + router speed (README, validate)
  although both are reproducible within a run (split-half r 0.94 each, 72 runs): it measures
  another part of the machine than the decode's own code and weights do.

Their data are fixed, so their time varies only with the machine. ``analysis.validate`` divides a
cell's median by its cost's fit runs' median to price the cell at the speed its runs saw
(``specfit.cost.CycleCostModel.with_compute_speed``). On CUDA the workloads run on the device and
are timed between two ``torch.cuda.synchronize`` calls (launch overhead included).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# how the model gauge's workload line opens (analysis.validate tells the two gauges apart by it)
MODEL_WORKLOAD = "the target's own attention + router"
PROBE_SIZE = 64  # weight side (elements)
PROBE_ROWS = 8  # activation rows, like a small draft tree's nodes (count)
PROBE_CHAIN = 48  # distinct weights multiplied in turn (count)
PROBE_GAP_S = 0.005  # untimed pause before each probe (s)
PROBES_PER_POINT = 16  # probes at each point: before the first request, after each request (count)
MODEL_PROBES_PER_POINT = 8  # model-workload probes at each point, spread among the chain's (count)


def probe_inputs(device: str = "cpu") -> tuple[Any, Any]:
    """The fixed operands ``(x float32[PROBE_ROWS, PROBE_SIZE], w)`` on ``device``, ``w`` a tuple
    of ``PROBE_CHAIN`` separate float32 ``[PROBE_SIZE, PROBE_SIZE]`` tensors (distinct allocations,
    as a model's weights are): seeded, scaled by ``1/sqrt(PROBE_SIZE)`` so the chain stays bounded."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(PROBE_ROWS, PROBE_SIZE, generator=gen)
    w = tuple((torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen) / PROBE_SIZE**0.5).to(device) for _ in range(PROBE_CHAIN))
    return x.to(device), w


def probe_once(x: Any, w: Any) -> float:
    """Seconds one chain ``y = tanh(y @ w[i])`` over the ``PROBE_CHAIN`` weights takes, from
    ``y = x``, after an untimed ``PROBE_GAP_S`` pause (wall clock, ``time.perf_counter``; CUDA
    synchronised before and after)."""
    import torch

    cuda = x.is_cuda
    time.sleep(PROBE_GAP_S)
    if cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    with torch.inference_mode():
        y = x
        for weight in w:
            y = torch.tanh(y @ weight)
    if cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


@dataclass(frozen=True)
class ModelProbeInputs:
    """What :func:`probe_model_once` runs: the fixed input ``x`` float[1, PROBE_ROWS, hidden] (the
    model's dtype and device), ``position_ids`` int64[1, PROBE_ROWS], the model's rotary embedding
    module, and per decoder layer ``(layer, router weight [E, hidden], top-k)``."""

    x: Any
    position_ids: Any
    rotary: Any
    layers: tuple[tuple[Any, Any, int], ...]


def model_probe_inputs(model: Any, rows: int = PROBE_ROWS) -> ModelProbeInputs | None:
    """The fixed operands of :func:`probe_model_once` for ``model`` (a transformers MoE causal LM
    as ``live.loader.load_target`` returns it): a seeded ``[1, rows, hidden]`` input (unit scale;
    every layer starts with a norm) on the model's device and dtype, over the MoE layers (those
    with a router, ``mlp.gate.weight``; dense layers are left out, as ``layer_pre_router_s`` leaves
    them out); None when the model lacks the layout the probe calls (``model.model.layers`` whose
    MoE layers have ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``;
    ``model.model.rotary_emb``)."""
    import torch

    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    layers = []
    for layer in getattr(inner, "layers", None) or ():
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        weight = getattr(gate, "weight", None)
        if weight is None:  # a dense layer (no router): not an MoE layer's attention + router
            continue
        if not all(hasattr(layer, n) for n in ("input_layernorm", "self_attn", "post_attention_layernorm")):
            return None
        top_k = int(getattr(gate, "top_k", 0) or getattr(model.config, "num_experts_per_tok", 1))
        layers.append((layer, weight, top_k))
    if rotary is None or not layers:
        return None
    weight = layers[0][1]
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(1, rows, weight.shape[1], generator=gen).to(device=weight.device, dtype=weight.dtype)
    position_ids = torch.arange(rows, device=weight.device)[None]
    return ModelProbeInputs(x, position_ids, rotary, tuple(layers))


def probe_model_once(inputs: ModelProbeInputs) -> float:
    """Seconds the target's own attention + router take on ``inputs``
    (:func:`model_probe_inputs`), after an untimed ``PROBE_GAP_S`` pause: the rotary embedding,
    then per layer ``h = x + self_attn(input_layernorm(x))``, ``x = h`` and the router's
    ``topk(softmax(post_attention_layernorm(h) @ W_gate^T))`` (as upstream's routers compute it,
    on their weight, without calling the router module, whose forward hooks record routing). Wall
    clock (``time.perf_counter``); CUDA synchronised before and after.

    Raises:
        TypeError, RuntimeError, AttributeError: an attention module with another call signature
            (:class:`SpeedProbe` then falls back to the chain).
    """
    import torch

    cuda = inputs.x.is_cuda
    time.sleep(PROBE_GAP_S)
    if cuda:
        torch.cuda.synchronize(inputs.x.device)
    start = time.perf_counter()
    with torch.inference_mode():
        x = inputs.x
        position_embeddings = inputs.rotary(x, position_ids=inputs.position_ids)
        for layer, weight, top_k in inputs.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), position_embeddings=position_embeddings, attention_mask=None)[0]
            logits = torch.nn.functional.linear(layer.post_attention_layernorm(x), weight)
            torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if cuda:
        torch.cuda.synchronize(inputs.x.device)
    return time.perf_counter() - start


@dataclass
class SpeedProbe:
    """The gauges' timings of one ``live.record`` call (seconds, in the order taken): ``seconds``
    the target's own attention + router (:func:`probe_model_once`; the chain when no ``model`` is
    given or its layout is not the probe's), ``chain_seconds`` the matrix chain (:func:`probe_once`)."""

    device: str = "cpu"
    model: Any = field(default=None, repr=False, compare=False)  # the target (live.loader.load_target)
    seconds: list[float] = field(default_factory=list)
    chain_seconds: list[float] = field(default_factory=list)
    _inputs: tuple[Any, Any] | None = field(default=None, init=False, repr=False)  # built on first use
    _model_inputs: ModelProbeInputs | None = field(default=None, init=False, repr=False)
    _model_checked: bool = field(default=False, init=False, repr=False)

    def _model_probe(self) -> float | None:
        """One model-workload timing, or None (no model, another layout, or a call that failed:
        then never tried again in this run, and the model timings taken before are dropped, so
        ``speed_probe_s`` holds one gauge: the chain's)."""
        if not self._model_checked:
            self._model_checked = True
            self._model_inputs = model_probe_inputs(self.model) if self.model is not None else None
        if self._model_inputs is None:
            return None
        try:
            return probe_model_once(self._model_inputs)
        except (TypeError, RuntimeError, AttributeError, ValueError):
            self._model_inputs = None
            self.seconds.clear()  # the run's gauge is the chain's from here on: no mix of the two
            return None

    def measure(self, num_probes: int = PROBES_PER_POINT, num_model_probes: int = MODEL_PROBES_PER_POINT) -> None:
        """Time the chain ``num_probes`` (count) times and the model workload ``num_model_probes``
        times (at most ``num_probes``; spread evenly among the chain's), and keep the timings (s)."""
        if self._inputs is None:
            self._inputs = probe_inputs(self.device)
        for i in range(num_probes):
            if (i + 1) * num_model_probes // num_probes > i * num_model_probes // num_probes:
                model_s = self._model_probe()
                if model_s is not None:
                    self.seconds.append(model_s)
            self.chain_seconds.append(probe_once(*self._inputs))

    @property
    def workload(self) -> str:
        """What ``speed_probe_s`` timed, in words (:data:`MODEL_WORKLOAD` opens the model gauge's)."""
        gap = f"after a {PROBE_GAP_S * 1e3:g} ms pause, on {self.device}"
        if self._model_inputs is not None and self.seconds:
            return (
                f"{MODEL_WORKLOAD} (norm, attention, residual, norm, router top-k) of "
                f"{len(self._model_inputs.layers)} layers on a fixed {PROBE_ROWS}-row input, {gap}"
            )
        return self.chain_workload + " (the target's layout is not the model probe's)" * (self.model is not None)

    @property
    def chain_workload(self) -> str:
        """What ``speed_probe_chain_s`` timed, in words."""
        return (
            f"tanh(y @ w) through {PROBE_CHAIN} float32 {PROBE_SIZE}x{PROBE_SIZE} weights, y {PROBE_ROWS} rows, "
            f"after a {PROBE_GAP_S * 1e3:g} ms pause, on {self.device}"
        )

    def summary(self) -> dict[str, Any]:
        """``speed_probe_s`` (list of s: the model workload, else the chain's), ``speed_probe_median_s``
        (s; NaN without timings), ``speed_probe_workload``, and the chain's ``speed_probe_chain_s`` /
        ``speed_probe_chain_workload`` for ``summary.json``."""
        gauge = self.seconds or self.chain_seconds
        return {
            "speed_probe_s": list(gauge),
            "speed_probe_median_s": statistics.median(gauge) if gauge else float("nan"),
            "speed_probe_workload": self.workload,
            "speed_probe_chain_s": list(self.chain_seconds),
            "speed_probe_chain_workload": self.chain_workload,
        }
