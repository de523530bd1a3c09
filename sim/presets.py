"""Named hardware cost presets: GPU compute costs and host-to-device links, with their sources.

A cost preset name is ``COMPUTE`` or ``COMPUTE+LINK`` (e.g. ``"qwen3-30b-a3b-2gpu+pcie5-x16"``);
:func:`resolve_cost` turns it (or a calibrated cost JSON written by ``calibration.fit``) into the
project's one cost formula, :class:`specfit.cost.CycleCostModel`.

Compute preset ``qwen3-30b-a3b-2gpu`` is derived from public figures
(docs/reference-figures.md, "Speculative decoding on MoE, public data points"): on
Qwen3-30B-A3B with experts resident on 2 GPUs, plain decoding ran at 222.5 tok/s, EAGLE-3 with a
chain of 4 drafts at 159.8 tok/s with tau 1.86, and with a 60-node tree (depth 7, EAGLE-3's
default) at 177.5 tok/s with tau 3.2. Each gives one cycle time, ``tau / throughput``:

    plain      0 draft levels,  1 node  : 4.494 ms
    chain-4    4 draft levels,  5 nodes : 11.640 ms
    tree-60    7 draft levels, 60 nodes : 18.028 ms

and the three equations ``levels * draft_s_per_level + verify_base_s + nodes * verify_s_per_node``
determine the three unknowns exactly (:func:`derive_compute_costs`): 1.766 ms per draft level,
4.475 ms base and 19.8 us per node. The context term is not identifiable from these figures
and is set to 0. The report does not name the GPU model, so the preset names the setup instead.

The compute preset's ``pre_router_fraction`` (the share of a layer's compute before its router has
chosen its experts, after which ``--overlap on`` enqueues the layer's copies) is not in any public
figure, so it is derived from the preset model's shape (:func:`pre_router_fraction_of`). Assumption:
decoding is memory-bound, so a layer's time is proportional to the weight bytes it reads; before
the router it reads the attention projections (q, k, v, o) and the router, after it the top-k
active experts (3 SwiGLU matrices each). Norm weights (< 0.03 %) and the KV cache are left out
(the preset has no context term either), and the share is a one-token decode step's: a verified
tree routes more nodes to more experts, so it is an upper bound there. For Qwen3-30B-A3B
(docs/reference-figures.md: hidden 2048, 128 experts, top-8, expert intermediate 768; attention
from the model's published config.json, not in that file: 32 query heads, 4 KV heads, head_dim
128): attention ``2 * 2048 * 4096 + 2 * 2048 * 512`` = 18,874,368 weights, router ``2048 * 128``
= 262,144, active experts ``8 * 3 * 2048 * 768`` = 37,748,736, so the share is 19,136,512 /
56,885,248 = 0.336.

Link presets are the public pinned-memory H2D figures of the same file (PCIe 3.0/4.0/5.0 x16,
NVLink-C2C). The per-transfer dispatch latency (10 us) is an assumption of this module, not a
figure from that file: the file says only that dispatch overhead can dominate; calibrate it
with ``calibration`` on real hardware.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from specfit.cost import CycleCostModel
from specfit.units import BYTES_PER_GIB, gb_per_s_to_bytes_per_s, us_to_s

DEFAULT_COMPUTE = "qwen3-30b-a3b-2gpu"
DEFAULT_LINK = "pcie5-x16"
DEFAULT_COST = f"{DEFAULT_COMPUTE}+{DEFAULT_LINK}"
ASSUMED_S_PER_TRANSFER = us_to_s(10.0)
REFERENCE = "docs/reference-figures.md"


@dataclass(frozen=True)
class PublicCyclePoint:
    """One public throughput figure seen as one cycle: ``tau / tokens_per_s`` seconds.

    Attributes:
        label: what was run; num_levels: draft levels per cycle; num_nodes: verified nodes
        (root included); tokens_per_s: reported throughput; tau: tokens per cycle incl. bonus.
    """

    label: str
    num_levels: int
    num_nodes: int
    tokens_per_s: float
    tau: float

    @property
    def cycle_s(self) -> float:
        """Seconds per cycle, ``tau / tokens_per_s``."""
        return self.tau / self.tokens_per_s


QWEN3_30B_A3B_2GPU_POINTS = (
    PublicCyclePoint("plain decoding", 0, 1, 222.5, 1.0),
    PublicCyclePoint("EAGLE-3 chain of 4", 4, 5, 159.8, 1.86),
    PublicCyclePoint("EAGLE-3 60-node tree, depth 7", 7, 60, 177.5, 3.2),
)


@dataclass(frozen=True)
class AttentionShape:
    """Attention projections of one decoder layer (from the model's published ``config.json``).

    Attributes:
        num_heads: query heads (``num_attention_heads``); num_kv_heads: key/value heads
        (``num_key_value_heads``, grouped-query attention); head_dim: width of one head.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int


QWEN3_30B_A3B_ATTENTION = AttentionShape(num_heads=32, num_kv_heads=4, head_dim=128)
"""Qwen3-30B-A3B's attention (published config.json: ``num_attention_heads`` 32,
``num_key_value_heads`` 4, ``head_dim`` 128; not in docs/reference-figures.md)."""


def pre_router_fraction_of(shape, attention: AttentionShape) -> float:
    """``CycleCostModel.pre_router_fraction`` of a model from its shape, decode assumed memory-bound.

    A layer's time is taken proportional to the weights it reads in a one-token decode step:
    before its router the attention projections, ``2 * hidden * heads * head_dim`` (q, o) ``+ 2 *
    hidden * kv_heads * head_dim`` (k, v), and the router, ``hidden * num_experts``; after it the
    ``top_k`` active experts, ``3 * hidden * expert_intermediate`` each (SwiGLU gate, up, down).
    The share is the first over the sum (a fraction in (0, 1)). Norm weights and the KV cache are
    left out (see the module docstring).

    Args:
        shape: a :class:`specfit.shapes.ModelShape` (hidden size, experts, top-k, intermediate).
        attention: its :class:`AttentionShape`.
    """
    hidden = shape.hidden_size
    attn = 2 * hidden * attention.num_heads * attention.head_dim + 2 * hidden * attention.num_kv_heads * attention.head_dim
    router = hidden * shape.num_experts
    experts = shape.top_k * 3 * hidden * shape.expert_intermediate_size
    return (attn + router) / (attn + router + experts)


@dataclass(frozen=True)
class ComputePreset:
    """Draft and verify compute costs of one GPU setup (seconds).

    Attributes:
        name: preset name; gpu_class: the hardware in words; draft_s_per_level, verify_base_s,
        verify_s_per_node, verify_s_per_context_token: :class:`CycleCostModel` fields (s);
        source: the derivation and the public source.
    """

    name: str
    gpu_class: str
    draft_s_per_level: float
    verify_base_s: float
    verify_s_per_node: float
    verify_s_per_context_token: float
    source: str
    pre_router_fraction: float = 0.0


@dataclass(frozen=True)
class LinkPreset:
    """A host-to-device link: bandwidth (bytes/s) and per-transfer latency (s), with its source."""

    name: str
    h2d_bytes_per_s: float
    h2d_s_per_transfer: float
    source: str


def derive_compute_costs(points: tuple[PublicCyclePoint, ...]) -> tuple[float, float, float]:
    """Least-squares ``(draft_s_per_level, verify_base_s, verify_s_per_node)`` from cycle points.

    Solves ``levels * d + b + nodes * n = tau / tokens_per_s`` (exact for three independent points).

    Raises:
        ValueError: fewer than three points, a degenerate system or a negative solution.
    """
    if len(points) < 3:
        raise ValueError(f"derive_compute_costs: need >= 3 points, got {len(points)}")
    a = np.array([[p.num_levels, 1.0, p.num_nodes] for p in points], dtype=np.float64)
    b = np.array([p.cycle_s for p in points], dtype=np.float64)
    if np.linalg.matrix_rank(a) < 3:
        raise ValueError("derive_compute_costs: the points do not determine the three costs")
    solution, *_ = np.linalg.lstsq(a, b, rcond=None)
    if np.any(solution < 0):
        raise ValueError(f"derive_compute_costs: negative cost in solution {solution.tolist()}")
    d, base, per_node = (float(x) for x in solution)
    return d, base, per_node


@lru_cache(maxsize=1)
def compute_presets() -> dict[str, ComputePreset]:
    """The named compute presets (built on first use)."""
    from specfit.shapes import get_model_shape

    d, base, per_node = derive_compute_costs(QWEN3_30B_A3B_2GPU_POINTS)
    pre = pre_router_fraction_of(get_model_shape("qwen3-30b-a3b"), QWEN3_30B_A3B_ATTENTION)
    figures = "; ".join(
        f"{p.label}: {p.tokens_per_s} tok/s at tau {p.tau} -> {p.cycle_s * 1e3:.3f} ms/cycle"
        for p in QWEN3_30B_A3B_2GPU_POINTS
    )
    return {
        DEFAULT_COMPUTE: ComputePreset(
            name=DEFAULT_COMPUTE,
            gpu_class="2 datacenter GPUs, Qwen3-30B-A3B bf16 with all experts resident (GPU model not reported)",
            draft_s_per_level=d,
            verify_base_s=base,
            verify_s_per_node=per_node,
            verify_s_per_context_token=0.0,
            source=(
                f"public EAGLE-3 figures on Qwen3-30B-A3B ({REFERENCE}): {figures}; solved for "
                f"draft {d * 1e3:.3f} ms/level, verify {base * 1e3:.3f} ms + {per_node * 1e6:.1f} us/node; "
                "context term 0 (not identifiable); "
                f"pre_router_fraction {pre:.3f} from the model's shape (attention + router weights over "
                "those + the top-8 experts', decode memory-bound; sim/presets.py)"
            ),
            pre_router_fraction=pre,
        )
    }


@lru_cache(maxsize=1)
def link_presets() -> dict[str, LinkPreset]:
    """The named H2D link presets (pinned-memory figures; latency assumed, see module doc)."""
    latency = f"per-transfer latency {ASSUMED_S_PER_TRANSFER * 1e6:.0f} us assumed (not in {REFERENCE})"

    def link(name: str, gb_per_s: float, what: str) -> LinkPreset:
        return LinkPreset(
            name=name,
            h2d_bytes_per_s=gb_per_s_to_bytes_per_s(gb_per_s),
            h2d_s_per_transfer=ASSUMED_S_PER_TRANSFER,
            source=f"{what} ({REFERENCE}); {latency}",
        )

    return {
        "pcie3-x16": link("pcie3-x16", 12.0, "PCIe 3.0 x16 pinned ~12 GB/s"),
        "pcie4-x16": link("pcie4-x16", 24.0, "PCIe 4.0 x16 pinned 22.5-26 GB/s, midpoint 24"),
        "pcie5-x16": link("pcie5-x16", 55.0, "PCIe 5.0 x16 copy engine ~55 GB/s"),
        "nvlink-c2c": link(
            "nvlink-c2c",
            97.0 * BYTES_PER_GIB / gb_per_s_to_bytes_per_s(1.0),
            "NVLink-C2C (GH200) pinned ~97 GiB/s",
        ),
    }


def preset_names() -> list[str]:
    """Every accepted cost preset name: each compute preset alone and with each link."""
    names = list(compute_presets())
    names += [f"{c}+{link}" for c in compute_presets() for link in link_presets()]
    return names


def cost_from_preset(
    name: str, *, expert_bytes: int, num_layers: int, overlap_h2d: bool = False
) -> CycleCostModel:
    """Build the cost model of preset ``COMPUTE[+LINK]`` (link default :data:`DEFAULT_LINK`).

    Args:
        name: preset name (see :func:`preset_names`).
        expert_bytes: bytes of one expert (bytes); num_layers: MoE layers of the replayed trace.
        overlap_h2d: the cost model's overlap flag (the planner's analytic form).

    Raises:
        ValueError: unknown compute or link name, listing the valid ones.
    """
    compute_name, _, link_name = name.partition("+")
    link_name = link_name or DEFAULT_LINK
    computes, links = compute_presets(), link_presets()
    if compute_name not in computes:
        raise ValueError(f"unknown compute preset {compute_name!r}; expected one of {sorted(computes)}")
    if link_name not in links:
        raise ValueError(f"unknown link preset {link_name!r}; expected one of {sorted(links)}")
    c, lk = computes[compute_name], links[link_name]
    return CycleCostModel(
        draft_s_per_level=c.draft_s_per_level,
        verify_base_s=c.verify_base_s,
        verify_s_per_node=c.verify_s_per_node,
        verify_s_per_context_token=c.verify_s_per_context_token,
        h2d_bytes_per_s=lk.h2d_bytes_per_s,
        h2d_s_per_transfer=lk.h2d_s_per_transfer,
        expert_bytes=int(expert_bytes),
        num_layers=int(num_layers),
        overlap_h2d=bool(overlap_h2d),
        pre_router_fraction=c.pre_router_fraction,
        source=f"preset {compute_name}+{link_name}: compute: {c.source}; link: {lk.source}",
    )


def resolve_cost(
    spec: str,
    *,
    num_layers: int,
    expert_bytes: int | None,
    default_expert_bytes: int,
    overlap_h2d: bool = False,
) -> CycleCostModel:
    """A cost model from a preset name or a calibrated cost JSON file.

    Args:
        spec: preset name (``COMPUTE[+LINK]``) or path to a ``CycleCostModel`` JSON file.
        num_layers: layers of the replayed trace (a file must agree).
        expert_bytes: bytes per expert to price transfers at, or ``None``: a file keeps its own,
            a preset uses ``default_expert_bytes``.
        overlap_h2d: the overlap flag to set.

    Raises:
        ValueError: unknown preset / unreadable or invalid file (message names the file and
            field), or a file calibrated for a different number of layers.
    """
    looks_like_file = spec.endswith(".json") or "/" in spec or Path(spec).is_file()
    if not looks_like_file:
        return cost_from_preset(
            spec,
            expert_bytes=default_expert_bytes if expert_bytes is None else expert_bytes,
            num_layers=num_layers,
            overlap_h2d=overlap_h2d,
        )
    cost = CycleCostModel.load(spec)
    if cost.num_layers != num_layers:
        raise ValueError(f"{spec}: num_layers is {cost.num_layers} but the trace has {num_layers} MoE layers")
    if expert_bytes is not None:
        cost = cost.with_expert_bytes(int(expert_bytes))
    return dataclasses.replace(
        cost, overlap_h2d=bool(overlap_h2d), source=f"calibrated {spec}: {cost.source}"
    )
