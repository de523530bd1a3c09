"""Synthetic cycles and transfers drawn from a known :class:`CycleCostModel` (for tests and benchmarks).

Each cycle draws a draft depth, a verified-node count, a context length and per-layer misses, and
sets every measured duration to the model's prediction times ``1 + noise`` with
``noise ~ Normal(0, noise_rel)`` independently per term (clipped at -0.5 so durations stay > 0).
Planned policies (all but ``ar``) log the noiseless prediction as ``predicted_cycle_s`` (with the
true misses) and a zero ``decision_s``, as the live engine logs its planner's view.
Transfers are one row per missed expert with ``bytes = expert_bytes`` and their own noisy time,
as the live engine records them; :func:`synthetic_size_sweep` gives copies of varied sizes (what
``calibration.h2d`` measures), the data that separate bandwidth from per-transfer latency.
With next-layer prefetch terms in the model (``next_layer_cover_fraction``, ``next_layer_waste_per_miss``)
each cycle also records prefetch counts drawn from them: of a layer's ``w`` drawn misses
``Binomial(w, cover)`` were prefetched and used (the rest are its demand misses, ``layer_misses``;
none at layer 0, which no guess covers), and ``Poisson(waste * w)`` wrong guesses were wasted
(``w`` summed over layers 1..L-1). Fitting these tables must recover the
model (``tests/test_calibration_fit.py``, ``tests/test_calibration_costfit.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from specfit.cost import CycleCostModel
from specfit.shapes import ModelShape


def synthetic_tables(
    model: CycleCostModel,
    *,
    num_cycles: int,
    noise_rel: float,
    seed: int,
    max_levels: int = 6,
    max_nodes: int = 48,
    context_range: tuple[int, int] = (64, 1024),
    num_requests: int = 8,
    max_misses_per_layer: int = 4,
    policy: str = "specfit",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Draw a ``cycles`` table and a ``transfers`` table from ``model``.

    Args:
        model: the ground-truth cost model (no overlap assumed for the cycle sum unless set).
        num_cycles: C cycles (one request).
        noise_rel: relative standard deviation of the multiplicative noise (e.g. 0.01).
        seed: numpy Generator seed.
        max_levels, max_nodes, max_misses_per_layer: ranges of the drawn features.
        context_range: range of the prompt lengths (tokens); the context grows with each commit.
        num_requests: cycles are dealt round-robin to this many requests.
        policy: value of the ``policy`` column.

    Returns:
        (cycles DataFrame with the CycleRecord columns, ``attrs["prompt_lens"]`` the prompt length
        of each request; transfers DataFrame with ``request_id, cycle_index, layer, expert, bytes,
        h2d_s``).

    Raises:
        ValueError: ``num_cycles < 1`` or ``noise_rel < 0``.
    """
    if num_cycles < 1:
        raise ValueError(f"num_cycles: expected >= 1, got {num_cycles}")
    if noise_rel < 0:
        raise ValueError(f"noise_rel: expected >= 0, got {noise_rel}")
    rng = np.random.default_rng(seed)
    num_layers = model.num_layers

    def noisy(value: float) -> float:
        return float(value * (1.0 + max(rng.normal(0.0, noise_rel), -0.5)))

    rows, transfers = [], []
    prompt_lens = rng.integers(context_range[0], context_range[1] + 1, size=num_requests)
    positions = np.zeros(num_requests, dtype=np.int64)
    cycle_counts = np.zeros(num_requests, dtype=np.int64)
    for i in range(num_cycles):
        req = i % num_requests
        c = int(cycle_counts[req])
        levels = int(rng.integers(0, max_levels + 1))
        nodes = 1 if levels == 0 else int(rng.integers(2, max_nodes + 1))
        ctx = int(prompt_lens[req] + positions[req])
        misses = rng.integers(0, max_misses_per_layer + 1, size=num_layers)
        prefetch: dict[str, int] = {}
        if model.has_next_layer_share:  # counts of a next-layer run
            cover, waste = model.next_layer_share_at(nodes)  # per tree size when the model has knots
            used = rng.binomial(misses, float(cover))
            used[0] = 0  # layer 0 has no layer before it to guess from (the cost model's share is of layers 1..L-1)
            wasted = int(rng.poisson(float(waste) * float(misses[1:].sum())))
            misses = misses - used  # the demand misses left
            prefetch = {
                "num_prefetch_issued": int(used.sum()) + wasted,
                "num_prefetch_used": int(used.sum()),
                "num_prefetch_wasted": wasted,
                "prefetch_wasted_bytes": wasted * model.expert_bytes,
            }
        layer_bytes = np.zeros(num_layers, dtype=np.int64)
        layer_s = np.zeros(num_layers)
        for layer in range(num_layers):
            for k in range(int(misses[layer])):
                t = noisy(model.s_per_miss)
                transfers.append((req, c, layer, k, model.expert_bytes, t))
                layer_bytes[layer] += model.expert_bytes
                layer_s[layer] += t
        draft_s = noisy(model.draft_s(levels)) if levels else 0.0
        verify_s = noisy(model.verify_s(nodes, ctx))
        h2d_s = float(layer_s.sum())
        cycle_s = model.combine_s(draft_s, verify_s, h2d_s)
        num_accepted = min(levels, nodes - 1, int(rng.integers(0, 4)))
        rows.append(
            {
                "request_id": req,
                "cycle_index": c,
                "position": int(positions[req]),
                "context_len": ctx,
                "policy": policy,
                "num_draft_levels": levels,
                "num_nodes_verified": nodes,
                "verified_nodes": list(range(nodes)),
                "num_accepted": num_accepted,
                "num_committed": num_accepted + 1,
                "draft_s": draft_s,
                "verify_s": verify_s,
                "h2d_s": h2d_s,
                "cycle_s": cycle_s,
                "layer_misses": misses.astype(np.int64),
                "layer_h2d_bytes": layer_bytes,
                "layer_h2d_s": layer_s,
                "layer_compute_s": np.full(num_layers, verify_s / num_layers),
                "layer_pre_router_s": np.full(num_layers, model.pre_router_fraction * verify_s / num_layers),
                "cache_hits": int(rng.integers(0, 8 * num_layers)),
                "cache_misses": int(misses.sum()),
                "predicted_expected_committed": None if policy == "ar" else float(num_accepted + 1),
                "predicted_cycle_s": None if policy == "ar" else model.cycle_s(levels, nodes, ctx, misses),
                "decision_s": None if policy == "ar" else 0.0,
                **prefetch,
            }
        )
        positions[req] += num_accepted + 1
        cycle_counts[req] += 1
    cycles = pd.DataFrame(rows)
    cycles.attrs["prompt_lens"] = [int(v) for v in prompt_lens]
    transfer_df = pd.DataFrame(
        transfers, columns=["request_id", "cycle_index", "layer", "expert", "bytes", "h2d_s"]
    )
    return cycles, transfer_df


def synthetic_size_sweep(
    bytes_per_s: float,
    s_per_transfer: float,
    *,
    sizes_bytes: tuple[int, ...] = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24),
    repeats: int = 8,
    noise_rel: float = 0.01,
    seed: int = 0,
) -> pd.DataFrame:
    """Timed copies of varied sizes from a known link: ``h2d_s = bytes / bytes_per_s + s_per_transfer``.

    Args:
        bytes_per_s: the link's bandwidth (bytes/s, > 0).
        s_per_transfer: its latency per copy (seconds, >= 0).
        sizes_bytes: copy sizes (bytes); repeats: copies per size.
        noise_rel: relative Gaussian noise on each time (fraction).
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        DataFrame with ``bytes`` (int64) and ``h2d_s`` (float64, noisy by ``noise_rel``), one row
        per copy, ``len(sizes_bytes) * repeats`` rows.

    Raises:
        ValueError: non-positive bandwidth, negative latency or ``repeats < 1``.
    """
    if not bytes_per_s > 0 or s_per_transfer < 0 or repeats < 1:
        raise ValueError("bytes_per_s > 0, s_per_transfer >= 0 and repeats >= 1 are required")
    rng = np.random.default_rng(seed)
    sizes = np.repeat(np.asarray(sizes_bytes, dtype=np.int64), repeats)
    truth = sizes / bytes_per_s + s_per_transfer
    noise = np.maximum(rng.normal(0.0, noise_rel, size=sizes.size), -0.5)
    return pd.DataFrame({"bytes": sizes, "h2d_s": truth * (1.0 + noise)})


def write_synthetic_cycles_run(
    out_dir: str | Path,
    shape: ModelShape,
    model: CycleCostModel,
    *,
    num_cycles: int,
    noise_rel: float,
    seed: int,
    policy: str = "specfit",
    config: dict[str, Any] | None = None,
    **table_kwargs: Any,
) -> Path:
    """Write the tables of :func:`synthetic_tables` as a policy-mode run through ``traces.writer``.

    Args:
        out_dir: new (or empty) run directory.
        shape: the model shape written into the manifest (``num_layers`` must equal the model's).
        model: ground-truth cost model; num_cycles, noise_rel, seed: as :func:`synthetic_tables`.
        policy: tree policy named in the manifest and the cycles.
        config: extra manifest config entries (e.g. ``{"overlap": "on"}``, as ``live.record`` writes).
        table_kwargs: further :func:`synthetic_tables` arguments.

    Returns:
        The run directory.

    Raises:
        ValueError: layer counts that disagree.
    """
    from traces.schema import CycleRecord, DraftSpec, HardwareSpec, Manifest, ModelSpec, RunConfig
    from traces.writer import TraceWriter

    if shape.num_layers != model.num_layers:
        raise ValueError(f"shape.num_layers ({shape.num_layers}) != model.num_layers ({model.num_layers})")
    cycles, transfers = synthetic_tables(
        model, num_cycles=num_cycles, noise_rel=noise_rel, seed=seed, policy=policy, **table_kwargs
    )
    manifest = Manifest.create(
        model=ModelSpec.from_shape(shape),
        hardware=HardwareSpec(
            device_name="synthetic",
            link_kind="cpu-emulated",
            h2d_memory="emulated",
            emulated_bandwidth_bytes_per_s=model.h2d_bytes_per_s,
            emulated_s_per_transfer=model.h2d_s_per_transfer,
        ),
        draft=DraftSpec(model="synthetic", tree_depth=6, tree_topk=4, max_nodes=64),
        run=RunConfig(
            mode="policy",
            prompt_source="synthetic",
            tree_policy=policy,
            cache_policy="lru",
            cache_capacity_per_layer=max(1, shape.num_experts // 4),
        ),
        seed=seed,
        command_line=["calibration.synthetic"],
        config={"generator": "calibration.synthetic", "noise_rel": noise_rel, **(config or {})},
    )
    fields = set(CycleRecord.__dataclass_fields__)
    with TraceWriter(out_dir, manifest) as writer:
        for req, prompt_len in enumerate(cycles.attrs["prompt_lens"]):
            generated = int(cycles.loc[cycles["request_id"] == req, "num_committed"].sum())
            writer.add_request(req, [1] * prompt_len, [2] * generated, f"synthetic:{req}")
        for row in cycles.to_dict("records"):
            writer.add_cycle(CycleRecord(**{k: v for k, v in row.items() if k in fields}))
        for (req, c), group in transfers.groupby(["request_id", "cycle_index"]):
            writer.add_transfers(
                int(req), int(c), group["layer"], group["expert"], group["bytes"], group["h2d_s"]
            )
    return Path(out_dir)
