"""live.expert_store: host store validation, slot placement, scratch reservation, split views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from live.expert_store import DeviceExpertPool, HostExpertStore


def _store(num_layers=2, num_experts=6, hidden=4, inter=3):
    gen = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(num_experts, 2 * inter, hidden, generator=gen) for _ in range(num_layers)]
    down = [torch.randn(num_experts, hidden, inter, generator=gen) for _ in range(num_layers)]
    return HostExpertStore(gate_up, down)


def test_store_shapes_and_bytes():
    store = _store()
    assert store.num_layers == 2 and store.num_experts == 6
    assert store.bytes_per_expert == (2 * 3 * 4 + 4 * 3) * 4
    assert store.total_bytes == 2 * 6 * store.bytes_per_expert
    with pytest.raises(ValueError, match=r"down\[1\]"):
        HostExpertStore(store.gate_up, [store.down[0], store.down[1][:, :2]])
    with pytest.raises(ValueError, match="one tensor per MoE layer"):
        HostExpertStore(store.gate_up, store.down[:1])


def test_place_release_and_views():
    store = _store()
    pool = DeviceExpertPool(store, capacity_per_layer=2, device=torch.device("cpu"))
    assert pool.num_scratch == 4 and pool.device_bytes == (2 * 2 + 4) * store.bytes_per_expert
    for dst, src in pool.place(1, 5, persistent=True):
        dst.copy_(src)
    assert pool.slot_of[1, 5] == 0 and pool.resident(1).tolist() == [5]
    pool.reserve_scratch(1)
    for dst, src in pool.place(1, 2, persistent=False):
        dst.copy_(src)
    ids = torch.tensor([[5, 2], [2, 5]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    persistent, scratch = pool.views(1, ids, weights)
    np.testing.assert_array_equal(persistent.slot_index, [[0, 2], [2, 0]])  # 2 = sentinel (C)
    np.testing.assert_array_equal(scratch.slot_index, [[4, 0], [0, 4]])  # 4 = sentinel (X)
    np.testing.assert_allclose(persistent.weights, [[0.7, 0.0], [0.0, 0.4]])
    assert torch.equal(scratch.gate_up[0], store.gate_up[1][2])
    assert torch.equal(persistent.gate_up[0], store.gate_up[1][5])
    pool.end_layer()
    pool.release(1, [5])
    assert pool.resident(1).size == 0 and pool.has_free_slot(1)


def test_scratch_reservation_grows_and_guards():
    pool = DeviceExpertPool(_store(), capacity_per_layer=6, device=torch.device("cpu"))
    assert pool.num_scratch == 0
    with pytest.raises(RuntimeError, match="scratch slots exhausted"):
        pool.place(0, 1, persistent=False)
    pool.reserve_scratch(3)
    assert pool.num_scratch == 3
    pool.place(0, 1, persistent=False)
    with pytest.raises(RuntimeError, match="before placing"):
        pool.reserve_scratch(5)
    pool.end_layer()
    for e in range(6):
        pool.place(0, e, persistent=True)
    with pytest.raises(RuntimeError, match="no free cache slot"):
        pool.place(0, 0, persistent=True)


def test_capacity_outside_range():
    with pytest.raises(ValueError, match=r"capacity_per_layer: expected 0\.\.6"):
        DeviceExpertPool(_store(), capacity_per_layer=7, device=torch.device("cpu"))
