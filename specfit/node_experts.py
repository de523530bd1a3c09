"""What the planner knows about the experts each draft node will need: ``NodeExperts``.

The target's routing of a draft token is unknown before verification, so a predictor supplies
either per-node expert bitsets (``bits``: uint64[N, L, W]) or, for the union-size predictor, only
the expected number of DISTINCT experts ``n`` nodes touch per layer (``union_size[l, n]``). In
the union-size case the planner charges ``union_size[l, |S|] * miss_fraction[l]`` misses at
layer ``l`` (``miss_fraction`` defaults to the uncached share of the layer's experts,
``1 - |C_l| / E``, i.e. distinct experts are assumed spread like the routing's uniform prior).
Because that cost depends on |S| only, the best subtree of each size is the top-|S| by path
probability (ancestor-closed since P never increases along a path), which keeps the search exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit import bitsets


@dataclass(frozen=True, eq=False)
class NodeExperts:
    """Predicted experts of the nodes of one draft tree.

    Attributes:
        num_experts: experts per layer ``E``.
        bits: uint64[N, L, W] per-node predicted expert sets, or ``None`` (union-size mode).
        union_size: float64[L, M+1], expected distinct experts at each layer among ``n`` nodes
            for ``n = 0..M`` (union-size mode), else ``None``. Beyond ``M`` it extrapolates with the
            last increment, capped at ``E``.
        miss_fraction: float64[L] share of those distinct experts expected to miss the cache, or
            ``None`` for ``1 - |C_l| / E``.
        source: predictor name.

    Raises:
        ValueError: neither or both of ``bits`` / ``union_size`` given, wrong dtype or shape.
    """

    num_experts: int
    bits: np.ndarray | None = None
    union_size: np.ndarray | None = None
    miss_fraction: np.ndarray | None = None
    source: str = "unknown"

    def __post_init__(self) -> None:
        if (self.bits is None) == (self.union_size is None):
            raise ValueError(
                "NodeExperts: give exactly one of bits (uint64[N, L, W]) or union_size (float[L, M+1])"
            )
        words = bitsets.num_words(self.num_experts)
        if self.bits is not None:
            bits = np.asarray(self.bits)
            if bits.dtype != np.uint64 or bits.ndim != 3 or bits.shape[2] != words:
                raise ValueError(
                    f"NodeExperts.bits: expected uint64[N, L, {words}], got {bits.dtype}{list(bits.shape)}"
                )
            object.__setattr__(self, "bits", bits)
        else:
            size = np.asarray(self.union_size, dtype=np.float64)
            if size.ndim != 2 or size.shape[1] < 2 or not np.all(np.isfinite(size)) or np.any(size < 0):
                raise ValueError("NodeExperts.union_size: expected finite float[L, M+1] >= 0 with M >= 1")
            if np.any(np.diff(size, axis=1) < -1e-9):
                raise ValueError("NodeExperts.union_size: expected non-decreasing in the node count")
            object.__setattr__(self, "union_size", size)
        if self.miss_fraction is not None:
            frac = np.asarray(self.miss_fraction, dtype=np.float64)
            if frac.shape != (self.num_layers,) or np.any(frac < 0) or np.any(frac > 1):
                raise ValueError(f"NodeExperts.miss_fraction: expected float[{self.num_layers}] in [0, 1]")
            object.__setattr__(self, "miss_fraction", frac)

    @classmethod
    def trusted(
        cls,
        num_experts: int,
        bits: np.ndarray | None = None,
        union_size: np.ndarray | None = None,
        miss_fraction: np.ndarray | None = None,
        source: str = "unknown",
    ) -> NodeExperts:
        """Build WITHOUT the ``__post_init__`` checks, for a predictor's own output in hot loops.

        The caller guarantees what the constructor would check and convert: exactly one of
        ``bits`` (uint64[N, L, W]) and ``union_size`` (finite float64[L, M+1] >= 0, M >= 1,
        non-decreasing along the node count, e.g. checked once when the predictor was built),
        and ``miss_fraction`` float64[L] in [0, 1] or ``None``. Use the constructor for anything
        external.
        """
        out = object.__new__(cls)
        for name, value in (
            ("num_experts", num_experts),
            ("bits", bits),
            ("union_size", union_size),
            ("miss_fraction", miss_fraction),
            ("source", source),
        ):
            object.__setattr__(out, name, value)
        return out

    @property
    def is_union_size(self) -> bool:
        """True when only expected union sizes are known (no per-node sets)."""
        return self.bits is None

    @property
    def num_layers(self) -> int:
        """Layers ``L``."""
        return int(self.bits.shape[1] if self.bits is not None else self.union_size.shape[0])

    @property
    def num_nodes(self) -> int | None:
        """Nodes ``N`` with per-node sets (``None`` in union-size mode)."""
        return None if self.bits is None else int(self.bits.shape[0])

    def expected_union(self, num_nodes: int) -> np.ndarray:
        """float64[L] expected distinct experts among ``num_nodes`` nodes (union-size mode)."""
        if self.union_size is None:
            raise ValueError("NodeExperts.expected_union: only defined in union-size mode")
        size = self.union_size
        top = size.shape[1] - 1
        if num_nodes <= top:
            return size[:, int(num_nodes)].copy()
        slope = size[:, top] - size[:, top - 1]
        return np.minimum(size[:, top] + slope * (num_nodes - top), float(self.num_experts))

    def expected_union_table(self, max_nodes: int) -> np.ndarray:
        """float64[max_nodes, L] C-contiguous: row ``k - 1`` is :meth:`expected_union` ``(k)``.

        The same element-wise arithmetic as the scalar method, so every row is bit-identical to
        it (one call replaces ``max_nodes`` calls in the union-size planner).
        """
        if self.union_size is None:
            raise ValueError("NodeExperts.expected_union_table: only defined in union-size mode")
        size = self.union_size
        top = size.shape[1] - 1
        if int(max_nodes) <= top:  # all measured: a copy of the columns 1..max_nodes
            return np.array(size[:, 1 : int(max_nodes) + 1].T, order="C")
        counts = np.arange(1, int(max_nodes) + 1)
        out = np.empty((counts.shape[0], size.shape[0]), dtype=np.float64)
        inside = counts[counts <= top]
        out[: inside.shape[0]] = size[:, inside].T
        beyond = counts[counts > top]
        if beyond.shape[0]:
            slope = size[:, top] - size[:, top - 1]
            extra = size[:, top][None, :] + slope[None, :] * (beyond - top)[:, None]
            out[inside.shape[0] :] = np.minimum(extra, float(self.num_experts))
        return out

    def layer_miss_fraction(self, cached_bits: np.ndarray) -> np.ndarray:
        """float64[L]: ``miss_fraction`` or ``1 - |C_l| / E`` from the cache bitsets uint64[L, W]."""
        if self.miss_fraction is not None:
            return self.miss_fraction
        return 1.0 - bitsets.popcount(cached_bits).astype(np.float64) / self.num_experts

    def expected_misses(self, num_nodes: int, cached_bits: np.ndarray) -> np.ndarray:
        """float64[L] expected misses for a subtree of ``num_nodes`` nodes (union-size mode)."""
        return self.expected_union(num_nodes) * self.layer_miss_fraction(cached_bits)
