"""Compiled form of :func:`specfit.policies.root_layer_misses` (numba, ``cache=True``).

The throughput guard's paired price asks, in every drafting cycle of the simulator and the live
engine, how many of the root's routed experts the cache lacks per layer. Its numpy form
(:func:`specfit.policies.root_layer_misses_numpy`, kept as the oracle) is five array operations
on an ``[L, K]`` array, ~15-70 us on this project's machine; this loop is one call. Imported
lazily by :mod:`specfit.policies` on the first question, so importing ``specfit`` compiles nothing
(numba's on-disk cache makes later processes load it quickly). Same integers as the numpy form
(``tests/test_specfit_guard_kernels.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def root_layer_misses(cached_bits, root_expert_ids, out):
    """Per layer ``l``, the ids ``e >= 0`` of ``root_expert_ids[l]`` whose bit ``e % 64`` of word
    ``e // 64`` is clear in ``cached_bits[l]``, counted into ``out[l]``.

    Args:
        cached_bits: uint64[L, W] cache bitsets (``ExpertCache.cached_bits``).
        root_expert_ids: int[L, K] the root's routed experts (negative ids: padding, not counted).
        out: int64[L], overwritten.

    Returns:
        -1 when every id is below ``64 * W`` (``out`` filled), else the first id at or above it
        (``out`` then partly filled): the caller raises.
    """
    num_layers, k = root_expert_ids.shape
    num_words = cached_bits.shape[1]
    for layer in range(num_layers):
        n = 0
        for j in range(k):
            e = np.int64(root_expert_ids[layer, j])
            if e < 0:
                continue
            word = e >> 6
            if word >= num_words:
                return e
            if (cached_bits[layer, word] >> np.uint64(e & 63)) & np.uint64(1) == 0:
                n += 1
        out[layer] = n
    return -1
