"""Expert sets as bitsets of uint64 words, vectorised over any leading axes.

Expert ``e`` of a layer is bit ``e % 64`` of word ``e // 64`` (little-endian bit order), so a
set over ``E`` experts takes ``W = ceil(E / 64)`` words. Arrays keep the words on the LAST
axis: ``uint64[..., W]``. Negative expert ids are padding and are ignored by :func:`pack`.
"""

from __future__ import annotations

import math

import numpy as np

WORD_BITS = 64
_HAS_BITWISE_COUNT = hasattr(np, "bitwise_count")  # numpy >= 2.0
_BYTE_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


def num_words(num_experts: int) -> int:
    """Words per bitset, ``ceil(num_experts / 64)``.

    Raises:
        ValueError: ``num_experts`` is not a positive integer.
    """
    if isinstance(num_experts, bool) or int(num_experts) != num_experts or num_experts <= 0:
        raise ValueError(f"num_experts: expected a positive integer, got {num_experts!r}")
    return math.ceil(int(num_experts) / WORD_BITS)


def empty(shape: tuple[int, ...], num_experts: int) -> np.ndarray:
    """All-zero bitsets ``uint64[*shape, W]``."""
    return np.zeros((*tuple(shape), num_words(num_experts)), dtype=np.uint64)


def pack(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Pack expert ids ``int[..., K]`` into bitsets ``uint64[..., W]`` (set over the last axis).

    Negative ids are padding and ignored; duplicates are fine.

    Raises:
        ValueError: an id ``>= num_experts``, a non-integer array, or a 0-d input.
    """
    ids = np.asarray(expert_ids)
    if ids.ndim == 0:
        raise ValueError("pack: expert_ids needs a last axis of ids (shape [..., K])")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"pack: expert_ids must be integers, got dtype {ids.dtype}")
    words = num_words(num_experts)
    lead = ids.shape[:-1]
    flat = ids.reshape(-1, ids.shape[-1]).astype(np.int64, copy=False)
    if flat.size and flat.max() >= num_experts:
        raise ValueError(f"pack: expert id {int(flat.max())} out of range [0, {num_experts})")
    onehot = np.zeros((flat.shape[0], words * WORD_BITS), dtype=bool)
    rows, cols = np.nonzero(flat >= 0)
    onehot[rows, flat[rows, cols]] = True
    packed = np.packbits(onehot, axis=-1, bitorder="little").view("<u8").astype(np.uint64, copy=False)
    return packed.reshape(*lead, words)


def unpack(bits: np.ndarray, num_experts: int) -> np.ndarray:
    """Bitsets ``uint64[..., W]`` -> membership ``bool[..., num_experts]``.

    Raises:
        ValueError: the last axis is not ``ceil(num_experts / 64)`` words.
    """
    arr = np.ascontiguousarray(bits, dtype=np.uint64)
    words = num_words(num_experts)
    if arr.ndim == 0 or arr.shape[-1] != words:
        raise ValueError(
            f"unpack: expected last axis of {words} words for {num_experts} experts, got {arr.shape}"
        )
    as_bytes = arr.astype("<u8", copy=False).view(np.uint8)
    flags = np.unpackbits(as_bytes, axis=-1, bitorder="little").astype(bool)
    return flags[..., :num_experts]


def to_ids(bits: np.ndarray, num_experts: int) -> np.ndarray:
    """One bitset ``uint64[W]`` -> ascending expert ids ``int64[]``."""
    arr = np.asarray(bits, dtype=np.uint64)
    if arr.ndim != 1:
        raise ValueError(f"to_ids: expected one bitset uint64[W], got shape {arr.shape}")
    return np.flatnonzero(unpack(arr, num_experts)).astype(np.int64)


def union(bits: np.ndarray, axis: int | tuple[int, ...] = 0) -> np.ndarray:
    """OR-reduce bitsets over ``axis`` (never the word axis).

    Raises:
        ValueError: ``axis`` names the last (word) axis.
    """
    arr = np.asarray(bits, dtype=np.uint64)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if any(a % arr.ndim == arr.ndim - 1 for a in axes):
        raise ValueError("union: axis must not be the last (word) axis")
    return np.bitwise_or.reduce(arr, axis=axis)


def intersection(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise ``a AND b`` (broadcasting)."""
    return np.bitwise_and(np.asarray(a, dtype=np.uint64), np.asarray(b, dtype=np.uint64))


def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise ``a AND NOT b`` (experts in ``a`` missing from ``b``; broadcasting)."""
    return np.bitwise_and(np.asarray(a, dtype=np.uint64), np.invert(np.asarray(b, dtype=np.uint64)))


def popcount(bits: np.ndarray) -> np.ndarray:
    """Number of set bits summed over the last (word) axis: ``uint64[..., W] -> int64[...]``."""
    arr = np.asarray(bits, dtype=np.uint64)
    if _HAS_BITWISE_COUNT:
        return np.bitwise_count(arr).sum(axis=-1, dtype=np.int64)
    as_bytes = np.ascontiguousarray(arr).view(np.uint8).reshape(*arr.shape[:-1], -1)
    return _BYTE_POPCOUNT[as_bytes].sum(axis=-1)


def to_int(bits: np.ndarray) -> int:
    """Any bitset array -> one Python int (C-order words, little-endian), for fast scalar set ops."""
    return int.from_bytes(np.ascontiguousarray(bits, dtype="<u8").tobytes(), "little")
