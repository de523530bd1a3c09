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
    (view,) = pool.views(1, ids, weights)  # one view of the whole arena: [L*C + X] = 8 rows
    assert view.num_slots == 8 and not view.has_sentinels
    # expert 5: persistent slot 0 of layer 1 = arena row 1*2 + 0; expert 2: scratch 0 = row 2*2 + 0
    np.testing.assert_array_equal(view.slot_index, [[2, 4], [4, 2]])
    np.testing.assert_allclose(view.weights, weights)
    assert torch.equal(view.gate_up[4], store.gate_up[1][2]) and torch.equal(
        view.gate_up[2], store.gate_up[1][5]
    )
    assert torch.equal(pool.scratch[0][0], store.gate_up[1][2])
    assert torch.equal(pool.persistent[1][0][0], store.gate_up[1][5])
    pool.end_layer()
    (own,) = pool.views(1, torch.tensor([[5]]), torch.tensor([[1.0]]))  # no transients: the layer's C slots
    assert own.num_slots == 2 and own.slot_index.tolist() == [[0]]
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


def test_scratch_growth_keeps_cached_experts():
    store = _store()
    pool = DeviceExpertPool(store, capacity_per_layer=2, device=torch.device("cpu"), scratch_slots=1)
    for dst, src in pool.place(1, 3, persistent=True):
        dst.copy_(src)
    pool.reserve_scratch(3)  # reallocates the arena
    assert pool.num_scratch == 3 and pool.persistent[1][0].data_ptr() != 0
    assert torch.equal(pool.persistent[1][0][pool.slot_of[1, 3]], store.gate_up[1][3])
    assert torch.equal(pool.persistent[1][1][pool.slot_of[1, 3]], store.down[1][3])


def test_capacity_outside_range():
    with pytest.raises(ValueError, match=r"capacity_per_layer: expected 0\.\.6"):
        DeviceExpertPool(_store(), capacity_per_layer=7, device=torch.device("cpu"))
