"""The default cycle cost model of a live run: the emulated link plus a quick measured compute estimate.

Used by ``python -m live.record --mode policy`` when no ``--cost`` JSON is given. Before the run,
on the first prompt: the draft time is fitted as ``draft_base_s + per_level * levels`` from a
one-level draft and a full-depth draft (the base is 0 when the shape allows one level only); the
target's verify time is fitted as ``base + per_node * nodes`` from root-only and full-tree
verifications (median of ``repeats``, their H2D time subtracted), and ``pre_router_fraction`` is
their median share of layer compute before the routers (``ForwardStats.layer_pre_router_s``);
the H2D terms come from the
link (``--bandwidth``, ``--latency-us``), for a plain memcpy link from timing copies of one
expert, and on CUDA from event-timed fetches of one expert over the real link
(:func:`measure_link`). The context term is left at 0 (too small to fit in a few forwards). Calibrated models
(``python -m calibration.fit``) replace this estimate through ``--cost``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import torch

from live.spec.draft import Drafter, TreeShape
from live.spec.verify import TreeVerifier


def measure_copy_bytes_per_s(num_bytes: int, repeats: int = 20) -> float:
    """Host memcpy bandwidth (bytes/s) of a ``num_bytes`` tensor copy: bytes moved over the summed
    time of ``repeats`` copies (the MEAN copy time, which the cost model sums; a median would
    follow the fast mode of bimodal copy times and price copies short)."""
    src = torch.empty(max(int(num_bytes), 1), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return src.numel() / max(float(np.mean(times)), 1e-9)


def measure_link(offload, repeats: int = 20) -> tuple[float, float]:
    """``(bytes_per_s, s_per_transfer)`` of the real link, from ``repeats`` timed fetches of one
    stored expert (layer 0, expert 0) into scratch device tensors, per copy as the engine times
    them (CUDA events on the link's copy stream), fitted as ``seconds = bytes / bandwidth +
    latency`` through the MEAN time of each copy size (an expert's copies differ in size, which
    separates the two; a negative latency is clipped to 0 and the bandwidth taken through the
    origin). Means, not medians: the cost model sums copy times, so the price of a copy must be
    its mean; copy times are often bimodal (an emulated link's sleeps, a copy delayed by another
    process), and a median then follows the fast mode and prices copies short (the bias
    ``calibration.link.fit_link`` avoids with ``relative=False``). The line through the two
    sizes' means prices the fetches it was measured on at exactly their summed time. The latency
    returned is per expert (per-copy latency times copies per expert)."""
    store = offload.store
    sources = (store.gate_up[0][0], store.down[0][0])
    pairs = [(torch.empty(src.shape, dtype=src.dtype, device=offload.link.device), src) for src in sources]
    offload.link.fetch([pairs])  # warm-up
    sizes, seconds = [], []
    for _ in range(repeats):
        fetch = offload.link.fetch([pairs])
        seconds.extend(fetch.copy_seconds().tolist())
        sizes.extend(fetch.copy_bytes.tolist())
    x, y = np.asarray(sizes, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    means = {size: float(np.mean(y[x == size])) for size in np.unique(x)}
    lo, hi = min(means), max(means)
    s_per_byte = (means[hi] - means[lo]) / (hi - lo) if hi > lo else 0.0
    latency_s = means[lo] - s_per_byte * lo
    if latency_s < 0 or s_per_byte <= 0:  # through the origin: prices the summed bytes at the summed time
        latency_s, s_per_byte = 0.0, float(y.sum() / x.sum())
    return 1.0 / float(s_per_byte), float(latency_s) * len(pairs)


def _line_through(points: dict[int, float]) -> tuple[float, float]:
    """``(base, slope)`` >= 0 of the line through the smallest and largest level counts of
    ``{levels: seconds}`` (one point: base 0, slope = seconds / levels; none: zeros)."""
    if not points:
        return 0.0, 0.0
    lo, hi = min(points), max(points)
    if hi == lo:
        return 0.0, points[lo] / lo
    slope = max((points[hi] - points[lo]) / (hi - lo), 0.0)
    base = points[lo] - slope * lo
    if base < 0:  # timing noise: keep the model non-negative, through the larger point
        return 0.0, points[hi] / hi
    return base, slope


def estimate_cost_model(
    verifier: TreeVerifier,
    drafter: Drafter,
    offload,
    shape: TreeShape,
    prompt_ids: Sequence[int],
    *,
    repeats: int = 3,
):
    """Measure a :class:`specfit.cost.CycleCostModel` for this engine (see module docstring).

    Args:
        verifier, drafter: the run's target and draft.
        offload: the :class:`live.offload.OffloadedMoE` (its link, expert bytes and layer count).
        shape: the run's tree shape (the full tree size is fitted).
        prompt_ids: a prompt to measure on (at least one token).

    Returns:
        ``CycleCostModel`` with ``source`` naming the estimate.
    """
    from specfit.cost import CycleCostModel

    draft_times: dict[int, list[float]] = {}
    verify_times: dict[int, list[float]] = {}
    pre_router: list[float] = []  # each forward's share of layer compute before the routers
    one_level = dataclasses.replace(shape, depth=min(shape.depth, 1))
    for _ in range(repeats):
        verifier.prefill(prompt_ids)  # an EAGLE-3 head drafts from the target's states of the prompt
        for draft_shape in (one_level, shape):
            drafter.reset()
            draft = drafter.grow(prompt_ids, draft_shape)
            if draft.num_levels > 0:
                draft_times.setdefault(draft.num_levels, []).append(draft.draft_s)
        for nodes in (np.zeros(1, np.int64), np.arange(draft.tree.num_nodes)):
            verifier.prefill(prompt_ids)
            offload.begin_forward()
            ver = verifier.verify(draft.tree, nodes)
            stats = offload.end_forward()
            verify_times.setdefault(len(nodes), []).append(max(ver.verify_s - stats.stall_s, 0.0))
            if stats.layer_pre_router_s is not None and stats.compute_s > 0:
                pre_router.append(float(stats.layer_pre_router_s.sum()) / stats.compute_s)
    draft_base, draft_per_level = _line_through(
        {levels: float(np.median(t)) for levels, t in draft_times.items()}
    )
    sizes = sorted(verify_times)
    small, large = sizes[0], sizes[-1]
    t_small, t_large = (float(np.median(verify_times[s])) for s in (small, large))
    per_node = max((t_large - t_small) / (large - small), 0.0) if large > small else 0.0
    info = offload.link.info
    latency_s = float(info.latency_s)
    if info.bandwidth_bytes_per_s is not None:
        bandwidth = float(info.bandwidth_bytes_per_s)
    elif offload.link.device.type == "cuda":
        bandwidth, latency_s = measure_link(offload)
    else:
        bandwidth = measure_copy_bytes_per_s(offload.bytes_per_expert)
    return CycleCostModel(
        draft_s_per_level=draft_per_level,
        draft_base_s=draft_base,
        verify_base_s=max(t_small - per_node * small, 0.0),
        verify_s_per_node=per_node,
        verify_s_per_context_token=0.0,
        h2d_bytes_per_s=float(bandwidth),
        h2d_s_per_transfer=latency_s,
        expert_bytes=int(offload.bytes_per_expert),
        num_layers=int(offload.num_layers),
        overlap_h2d=False,
        pre_router_fraction=float(np.clip(np.median(pre_router), 0.0, 1.0)) if pre_router else 0.0,
        source=f"live.record quick estimate ({info.kind}, {repeats} repeats)",
    )
