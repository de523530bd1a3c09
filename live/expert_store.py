"""Where expert weights live: the host store and the device slot pool.

- :class:`HostExpertStore`: every routed expert of every MoE layer in host memory, as the fused
  transformers-5 tensors ``gate_up[l]: [E, 2I, H]`` and ``down[l]: [E, H, I]`` (pinned on CUDA by
  :meth:`live.h2d.H2DLink.prepare_host`). ``gate_up[l][e]`` is one contiguous expert.
- :class:`DeviceExpertPool`: the device expert cache's memory: per MoE layer C persistent slots
  (tensors ``[C, 2I, H]`` and ``[C, H, I]``), plus X scratch slots shared by all layers for
  *transient* experts (misses the cache policy does not keep; see ``specfit.cache``: "misses beyond
  capacity are transient: transferred, not kept"). A layer's experts are computed by transformers'
  own expert kernels (eager loop, ``batched_mm`` or ``grouped_mm``) on these slot tensors with the
  top-k expert ids remapped to slot ids (:class:`ExpertView`); with transient experts the layer is
  computed as two calls (persistent, scratch) using upstream's expert-parallel sentinel convention
  (an id equal to the number of slots is skipped), whose outputs are summed.

The pool only manages slots; which experts are cached is decided by the cache *policy*
(``specfit.cache.ExpertCache``) in :class:`live.offload.OffloadedMoE`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from live.h2d import CopyPair


class HostExpertStore:
    """Routed expert weights of all MoE layers in host memory.

    Args:
        gate_up: per MoE layer a host tensor ``[E, 2I, H]``.
        down: per MoE layer a host tensor ``[E, H, I]``.

    Raises ``ValueError`` when layers disagree in shape or dtype, or a tensor is not on the CPU.
    """

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> None:
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(
                f"gate_up/down: expected one tensor per MoE layer each, got {len(gate_up)}/{len(down)}"
            )
        for name, tensors in (("gate_up", gate_up), ("down", down)):
            for layer, t in enumerate(tensors):
                if t.device.type != "cpu" or t.dim() != 3:
                    raise ValueError(
                        f"{name}[{layer}]: expected a 3-D CPU tensor, got {tuple(t.shape)} on {t.device}"
                    )
                if t.shape != tensors[0].shape or t.dtype != tensors[0].dtype:
                    raise ValueError(f"{name}[{layer}]: shape/dtype differ from layer 0")
        self.gate_up = gate_up
        self.down = down
        self.num_layers = len(gate_up)
        self.num_experts = int(gate_up[0].shape[0])
        self.gate_up_shape = tuple(gate_up[0].shape[1:])
        self.down_shape = tuple(down[0].shape[1:])
        self.dtype = gate_up[0].dtype
        element = gate_up[0].element_size()
        self.bytes_per_expert = int((gate_up[0][0].numel() + down[0][0].numel()) * element)

    @property
    def total_bytes(self) -> int:
        """Bytes of all routed experts held on the host."""
        return self.bytes_per_expert * self.num_experts * self.num_layers


class ExpertView(NamedTuple):
    """One call of an upstream experts kernel: weights ``[n, 2I, H]``/``[n, H, I]`` and the
    top-k ids remapped to local slots ``0..n-1``. In a split layer, ``mask bool[T, K]`` marks the
    token-expert pairs this view serves; the others carry id ``n`` (upstream's expert-parallel
    sentinel, skipped by the kernels) and a zero routing weight. (A NamedTuple, not a dataclass:
    one is built per layer per forward pass.)"""

    gate_up: torch.Tensor
    down: torch.Tensor
    slot_index: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def has_sentinels(self) -> bool:
        """Whether some pairs belong to another view (split layer)."""
        return self.mask is not None

    @property
    def num_slots(self) -> int:
        """Slots in this view (upstream kernels size their one-hot/histogram by it)."""
        return int(self.gate_up.shape[0])


class DeviceExpertPool:
    """Slots for cached (persistent) and transient (scratch) experts on the device.

    All slots live in one arena pair (``gate_up [L*C + X, 2I, H]``, ``down [L*C + X, H, I]``):
    layer l owns the rows ``l*C .. (l+1)*C - 1`` (``persistent[l]``, views of the arena) and the
    last X rows (``scratch``) are shared by all layers for the transient experts of the layer
    being computed. A layer without transient experts is computed from its own C slots (one
    kernel call, ids remapped to ``0..C-1``); a layer with transient experts from ONE view of the
    whole arena (ids remapped to arena rows), so it costs one kernel call too, rather than a split
    into two calls whose extra cost would grow with the number of cache misses and bias the
    measured compute time by the cache size. (The kernels' per-slot bookkeeping is a histogram
    over ``L*C + X`` bins, negligible next to the matmuls.)

    Args:
        store: the host store whose experts are placed here (shapes and dtype).
        capacity_per_layer: persistent slots per MoE layer, ``0 <= C <= E``.
        device: the device holding the pool.
        scratch_slots: initial scratch slots (default ``E - C``; grown on demand).

    ``slot_of`` is ``int64[L, E]``: each expert's persistent slot at its layer, -1 if absent.
    Slots are zero-initialised so a slot read under a zero routing weight never yields NaN.
    """

    def __init__(
        self,
        store: HostExpertStore,
        capacity_per_layer: int,
        device: torch.device,
        scratch_slots: int | None = None,
    ) -> None:
        num_experts = store.num_experts
        if not 0 <= int(capacity_per_layer) <= num_experts:
            raise ValueError(
                f"capacity_per_layer: expected 0..{num_experts} (the experts per layer), got {capacity_per_layer}"
            )
        self.store = store
        self.device = torch.device(device)
        self.capacity = int(capacity_per_layer)
        self.num_layers = store.num_layers
        scratch = num_experts - self.capacity if scratch_slots is None else int(scratch_slots)
        self._arena = self._allocate(self.num_layers * self.capacity + max(scratch, 0))
        self._bind()
        self.slot_of = np.full((self.num_layers, num_experts), -1, dtype=np.int64)
        self._free: list[list[int]] = [list(range(self.capacity - 1, -1, -1)) for _ in range(self.num_layers)]
        self._scratch_used: dict[int, int] = {}  # expert -> scratch slot, current layer only
        self._lut: list[torch.Tensor | None] = [None] * self.num_layers

    def _allocate(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        kw = {"dtype": self.store.dtype, "device": self.device}
        return (
            torch.zeros((num_slots, *self.store.gate_up_shape), **kw),
            torch.zeros((num_slots, *self.store.down_shape), **kw),
        )

    def _bind(self) -> None:
        """(Re)build the per-layer persistent views and the scratch view of the arena."""
        gate_up, down = self._arena
        c, first_scratch = self.capacity, self.num_layers * self.capacity
        self.persistent = [
            (gate_up[i * c : (i + 1) * c], down[i * c : (i + 1) * c]) for i in range(self.num_layers)
        ]
        self.scratch = (gate_up[first_scratch:], down[first_scratch:])
        self._lut = [None] * self.num_layers
        self._arena_rows: list[np.ndarray | None] = [None] * self.num_layers

    @property
    def num_scratch(self) -> int:
        """Scratch slots currently allocated."""
        return int(self.scratch[0].shape[0])

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory the pool occupies."""
        return (self.num_layers * self.capacity + self.num_scratch) * self.store.bytes_per_expert

    def has_free_slot(self, layer: int) -> bool:
        """Whether ``layer`` has a free persistent slot."""
        return bool(self._free[layer])

    def resident(self, layer: int) -> np.ndarray:
        """Sorted expert ids with a persistent slot at ``layer``."""
        return np.flatnonzero(self.slot_of[layer] >= 0)

    def release(self, layer: int, experts) -> None:
        """Free the persistent slots of ``experts`` at ``layer`` (ids without a slot are ignored)."""
        for e in experts:
            slot = int(self.slot_of[layer, e])
            if slot >= 0:
                self.slot_of[layer, e] = -1
                self._free[layer].append(slot)
                self._lut[layer] = None
                self._arena_rows[layer] = None

    def place(self, layer: int, expert: int, *, persistent: bool) -> list[CopyPair]:
        """Give ``expert`` a slot (persistent at ``layer`` or scratch); return its copy pairs.

        Raises ``RuntimeError`` if no persistent slot is free (the policy kept more than C).
        """
        if persistent:
            if not self._free[layer]:
                raise RuntimeError(
                    f"layer {layer}: no free cache slot for expert {expert} "
                    f"(capacity {self.capacity}); cache policy and slot pool disagree"
                )
            slot = self._free[layer].pop()
            self.slot_of[layer, expert] = slot
            self._lut[layer] = None
            self._arena_rows[layer] = None
            gate_up, down = self.persistent[layer]
        else:
            if len(self._scratch_used) >= self.num_scratch:
                raise RuntimeError(
                    f"layer {layer}: scratch slots exhausted ({self.num_scratch}); call reserve_scratch first"
                )
            slot = len(self._scratch_used)
            self._scratch_used[int(expert)] = slot
            gate_up, down = self.scratch
        return [
            (gate_up[slot], self.store.gate_up[layer][expert]),
            (down[slot], self.store.down[layer][expert]),
        ]

    def reserve_scratch(self, num_slots: int) -> None:
        """Make at least ``num_slots`` scratch slots available to the layer about to be placed.

        Call before any :meth:`place` of the layer (copy pairs returned earlier would point into
        the old tensors). Growth doubles the scratch; on CUDA it synchronises first so that no
        queued copy or kernel still uses the released memory.
        """
        if self._scratch_used:
            raise RuntimeError("reserve_scratch: call before placing the layer's transient experts")
        if num_slots > self.num_scratch:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            kept = self.num_layers * self.capacity
            old_gate_up, old_down = self._arena
            self._arena = self._allocate(kept + max(num_slots, 2 * self.num_scratch))
            self._arena[0][:kept].copy_(old_gate_up[:kept])
            self._arena[1][:kept].copy_(old_down[:kept])
            self._bind()

    def _persistent_lut(self, layer: int, device: torch.device) -> torch.Tensor:
        table = self._lut[layer]
        if table is None:
            table = torch.from_numpy(self.slot_of[layer].copy()).to(device)
            self._lut[layer] = table
        return table

    def _arena_lut(self, layer: int) -> np.ndarray:
        """int64[E]: arena row of each expert with a persistent slot at ``layer``, else -1."""
        table = self._arena_rows[layer]
        if table is None:
            slots = self.slot_of[layer]
            table = np.where(slots >= 0, slots + layer * self.capacity, -1)
            self._arena_rows[layer] = table
        return table

    def views(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> list[ExpertView]:
        """The kernel call that computes ``layer`` for ``top_k_index int[T, K]`` (a one-item list).

        Without transient experts: a view of the layer's persistent slots (ids remapped to
        ``0..C-1``: the same kernel call as on resident weights). With transient experts: a view
        of the whole arena, ids remapped to arena rows (persistent ``l*C + slot``, scratch
        ``L*C + slot``). Every id must have a slot (persistent, or scratch placed for this layer).
        """
        if not self._scratch_used:
            lut = self._persistent_lut(layer, top_k_index.device)
            return [ExpertView(*self.persistent[layer], lut[top_k_index], top_k_weights)]
        rows = self._arena_lut(layer).copy()
        first_scratch = self.num_layers * self.capacity
        for expert, slot in self._scratch_used.items():
            rows[expert] = first_scratch + slot
        local = torch.from_numpy(rows).to(top_k_index.device)[top_k_index]
        return [ExpertView(*self._arena, local, top_k_weights)]

    def end_layer(self) -> None:
        """Forget the current layer's scratch assignments (their slots are reused next layer)."""
        self._scratch_used.clear()
