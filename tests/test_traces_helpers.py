"""Builders shared by the traces tests: a small complete run with every table, and part editing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specfit.shapes import ModelShape
from specfit.tree import DraftTree
from traces.schema import CycleRecord, DraftSpec, HardwareSpec, Manifest, ModelSpec, RunConfig
from traces.writer import TraceWriter

SMALL_SHAPE = ModelShape(
    name="tiny",
    num_layers=3,
    num_experts=8,
    top_k=2,
    hidden_size=16,
    expert_intermediate_size=8,
    bytes_per_expert=768,
)
PARENTS = np.array([-1, 0, 0, 1, 1, 2])
DRAFT_LP = np.array([0.0, -0.1, -0.9, -0.3, -1.2, -0.5])


def small_manifest(mode: str = "policy", shape: ModelShape = SMALL_SHAPE) -> Manifest:
    """A manifest for :data:`SMALL_SHAPE` (policy mode: tree policy, cache policy and size set)."""
    run = RunConfig(
        mode=mode, prompt_source="test", tree_policy="specfit", cache_policy="lru", cache_capacity_per_layer=4
    )
    return Manifest.create(
        model=ModelSpec.from_shape(shape, architecture="test"),
        hardware=HardwareSpec("cpu", "cpu-emulated", "emulated", emulated_bandwidth_bytes_per_s=16e9),
        draft=DraftSpec("test-draft", tree_depth=2, tree_topk=2, max_nodes=6),
        run=run,
        seed=0,
        command_line=["pytest"],
    )


def random_routing(
    rng: np.random.Generator, n: int, shape: ModelShape = SMALL_SHAPE
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct top-k expert ids ``[n, L, K]`` and normalised weights ``[n, L, K]`` (descending per layer)."""
    ids = np.argsort(rng.random((n, shape.num_layers, shape.num_experts)), axis=2)[:, :, : shape.top_k]
    w = -np.sort(-(rng.random((n, shape.num_layers, shape.top_k)) + 0.1), axis=2)
    return ids, w / w.sum(axis=2, keepdims=True)


def tree_rows(rng: np.random.Generator, position: int, generated: np.ndarray) -> dict:
    """One 6-node tree whose node 1 (and its child 3) carry the true next tokens."""
    target = rng.integers(100, 200, size=6)
    target[0] = generated[position]
    target[1] = generated[position + 1]
    tokens = rng.integers(200, 300, size=6)
    tokens[0] = generated[position - 1] if position > 0 else 7
    tokens[1] = target[0]
    tokens[3] = target[1]
    tree = DraftTree.from_parents(tokens, PARENTS, DRAFT_LP)
    accepted = np.array([True] + [tokens[v] == target[PARENTS[v]] for v in range(1, 6)])
    return {"tree": tree, "target_tokens": target, "accepted": accepted}


def write_small_run(
    run_dir: Path, *, num_requests: int = 2, positions: int = 3, seed: int = 0, flush_every_rows: int = 10_000
) -> Path:
    """A complete policy-mode-manifest run with requests, prefill, nodes, cycles and transfers.

    Rows per request: 4 prefill tokens, ``positions`` trees of 6 nodes, ``positions`` cycles
    (each commits 3 tokens, cycle ``i`` at position ``3 i``; ``3 * positions`` generated tokens),
    2 transfers per cycle.
    """
    rng = np.random.default_rng(seed)
    with TraceWriter(run_dir, small_manifest(), flush_every_rows=flush_every_rows) as writer:
        for rid in range(num_requests):
            prompt = rng.integers(0, 100, size=4)
            generated = rng.integers(0, 100, size=3 * positions)
            writer.add_prefill(rid, *random_routing(rng, 4))
            for pos in range(positions):
                rows = tree_rows(rng, pos, generated)
                ids, w = random_routing(rng, 6)
                writer.add_tree(rid, pos, 4 + pos, expert_ids=ids, router_weights=w, **rows)
                writer.add_cycle(small_cycle(rid, pos, position=3 * pos, context_len=4 + 3 * pos))
                writer.add_transfers(rid, pos, [0, 2], [3, 5], 768, [1e-6, 2e-6])
            writer.add_request(rid, prompt, generated, f"test:{rid}")
    return Path(run_dir)


def small_cycle(request_id: int, index: int, **changes) -> CycleRecord:
    """A valid cycle of :data:`SMALL_SHAPE` (3 layers)."""
    fields = dict(
        request_id=request_id,
        cycle_index=index,
        position=index,
        context_len=4 + index,
        policy="specfit",
        num_draft_levels=2,
        num_nodes_verified=3,
        verified_nodes=[0, 1, 3],
        num_accepted=2,
        num_committed=3,
        draft_s=1e-3,
        verify_s=2e-3,
        h2d_s=3e-6,
        cycle_s=6e-3,
        layer_misses=[1, 0, 1],
        layer_h2d_bytes=[768, 0, 768],
        layer_h2d_s=[1e-6, 0.0, 2e-6],
        layer_compute_s=[6e-4, 6e-4, 6e-4],
        cache_hits=10,
        cache_misses=2,
        predicted_expected_committed=2.5 if index % 2 == 0 else None,
        predicted_cycle_s=5e-3 if index % 2 == 0 else None,
        decision_s=1e-4 if index % 2 == 0 else None,
        committed_token_ids=[1, 2, 3],
    )
    fields.update(changes)
    return CycleRecord(**fields)


def first_part(run_dir: Path, table: str) -> Path:
    """Path of ``table``'s first part."""
    return sorted((Path(run_dir) / table).glob("part-*.parquet"))[0]


def edit_part(path: Path, edit) -> None:
    """Rewrite one part with ``edit(pa.Table) -> pa.Table`` (schema metadata kept)."""
    table = pq.read_table(path)
    pq.write_table(edit(table), path)


def set_value(table: pa.Table, column: str, row: int, value) -> pa.Table:
    """``table`` with ``column[row] = value`` (same type)."""
    values = table.column(column).to_pylist()
    values[row] = value
    index = table.schema.get_field_index(column)
    field = table.schema.field(column).with_nullable(True)
    return table.set_column(index, field, pa.array(values, type=field.type))
