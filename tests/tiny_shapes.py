"""Tiny model shapes and cost models shared by the tests (no tests here)."""

from specfit.cost import CycleCostModel
from specfit.shapes import ModelShape


def tiny_shape(bytes_per_expert: int, name: str = "tiny-moe") -> ModelShape:
    """4 layers x 16 experts, top-2, hidden 64, expert intermediate 32, at ``bytes_per_expert``."""
    return ModelShape(
        name,
        num_layers=4,
        num_experts=16,
        top_k=2,
        hidden_size=64,
        expert_intermediate_size=32,
        bytes_per_expert=bytes_per_expert,
    )


TINY_MOE = tiny_shape(2_000_000)
"""The calibration and report tests' shape: 2 MB experts."""

TINY_COST = CycleCostModel(
    draft_s_per_level=2e-3,
    verify_base_s=8e-3,
    verify_s_per_node=0.3e-3,
    verify_s_per_context_token=2e-6,
    h2d_bytes_per_s=5e9,
    h2d_s_per_transfer=40e-6,
    expert_bytes=TINY_MOE.bytes_per_expert,
    num_layers=TINY_MOE.num_layers,
)
"""Known cost parameters that synthetic cycles are generated from."""


def tiny_sweep_trace(out_dir) -> str:
    """A one-request, 12-position dense synthetic trace of ``tiny_shape(12_288, "tiny")`` in
    ``out_dir`` (depth 3, top-2, 8 nodes; seed 3): cells replay it in milliseconds."""
    from traces.synthetic import generate_dense_trace

    path = generate_dense_trace(
        out_dir,
        tiny_shape(12_288, "tiny"),
        num_requests=1,
        positions_per_request=12,
        prompt_len=8,
        tree_depth=3,
        tree_topk=2,
        max_nodes=8,
        seed=3,
    )
    return str(path)
