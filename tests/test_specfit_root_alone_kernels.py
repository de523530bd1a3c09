"""The guard's root-alone kernels, both in specfit.cache_kernels: the compiled root_layer_misses
gives the numpy form's integers; it and root_alone_copies keep their own count of repeated ids."""

from __future__ import annotations

import numpy as np
import pytest

from specfit.policies import root_alone_copies, root_layer_misses, root_layer_misses_numpy


@pytest.mark.parametrize("seed", range(4))
def test_compiled_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(300):
        num_layers, num_words, k = int(rng.integers(0, 7)), int(rng.integers(1, 4)), int(rng.integers(0, 10))
        bits = rng.integers(0, 2**64, size=(num_layers, num_words), dtype=np.uint64)
        ids = rng.integers(-3, 64 * num_words, size=(num_layers, k)).astype(rng.choice([np.int16, np.int32, np.int64]))
        got, want = root_layer_misses(bits, ids), root_layer_misses_numpy(bits, ids)
        assert got.dtype == want.dtype == np.int64 and got.tolist() == want.tolist()


def test_every_bit_and_padding() -> None:
    """Each of the 128 ids against a cache holding only the even ones; padding never counts."""
    bits = np.array([[0x5555555555555555, 0x5555555555555555]], dtype=np.uint64)
    for e in range(128):
        assert root_layer_misses(bits, np.array([[e, -1]], dtype=np.int16)).tolist() == [e % 2]
    assert root_layer_misses(bits[:, ::2], np.array([[63, 62]])).tolist() == [1]  # a strided view


def test_out_of_range_id_raises_and_other_inputs_take_numpy() -> None:
    bits = np.zeros((2, 1), dtype=np.uint64)
    with pytest.raises(IndexError, match="expert id 64"):
        root_layer_misses(bits, np.array([[0, 64], [1, 2]]))
    with pytest.raises(IndexError):
        root_layer_misses_numpy(bits, np.array([[0, 64], [1, 2]]))
    assert root_layer_misses([[0], [1]], [[0, 1], [0, -1]]).tolist() == [2, 0]  # lists: the numpy form


def test_both_root_alone_kernels_live_in_cache_kernels_and_keep_their_counts(monkeypatch) -> None:
    """One home for the two compiled root-alone questions; the same misses on rows without
    repeats, and on a repeated id each its own count: root_layer_misses every occurrence (as its
    numpy form), root_alone_copies (with prefetch) the id once, as a bitset holds it."""
    from specfit import cache_kernels

    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**64, size=(4, 2), dtype=np.uint64)
    no_draft = np.zeros((4, 2), dtype=np.uint64)  # a draft prefetch that predicts nothing
    for _ in range(50):
        ids = np.stack([rng.permutation(100)[:6] for _ in range(4)]).astype(np.int64)
        out = np.empty(4, dtype=np.int64)
        assert cache_kernels.root_layer_misses(bits, ids, out) == -1
        demand, _ = root_alone_copies(bits, ids, 100, 8, no_draft)
        assert out.tolist() == demand.tolist() == root_layer_misses(bits, ids).tolist()
    ids = np.array([[5, 5, 5]] * 4, dtype=np.int64)  # expert 5, missing at every layer, thrice
    empty = np.zeros((4, 2), dtype=np.uint64)
    assert root_layer_misses(empty, ids).tolist() == root_layer_misses_numpy(empty, ids).tolist() == [3] * 4
    assert root_alone_copies(empty, ids, 100, 8, no_draft)[0].tolist() == [1] * 4
    calls = []  # the policies' compiled call is the cache kernels', looked up there (one home)
    kernel = cache_kernels.root_layer_misses
    monkeypatch.setattr(cache_kernels, "root_layer_misses", lambda *args: calls.append(args) or kernel(*args))
    assert root_layer_misses(bits, ids).tolist() == root_layer_misses_numpy(bits, ids).tolist()
    assert len(calls) == 1 and calls[0][0] is bits and calls[0][1] is ids


@pytest.mark.parametrize("num_experts", [100, 64, 1])
def test_root_alone_copies_ignores_predicted_padding_bits(num_experts: int) -> None:
    """Bits of ``predicted_bits`` at or above E (the last word's padding) are no experts: the
    draft prefetch neither copies them nor spends its capacity on them (as the per-layer numpy
    form it replaced, which read only ids below E)."""
    words = (num_experts + 63) // 64
    cached = np.zeros((2, words), dtype=np.uint64)
    ids = np.array([[0, -1], [num_experts - 1, 0]], dtype=np.int64)
    predicted = np.zeros((2, words), dtype=np.uint64)
    predicted[:, 0] = 1  # expert 0 predicted at both layers
    clean = root_alone_copies(cached, ids, num_experts, 4, predicted)
    if num_experts % 64:
        predicted[:, -1] |= ~np.uint64(0) << np.uint64(num_experts % 64)  # every padding bit set
    padded = root_alone_copies(cached, ids, num_experts, 4, predicted)
    assert clean[1][0].tolist() == [1, 1]  # one draft copy per layer
    assert padded[0].tolist() == clean[0].tolist() and padded[1].tolist() == clean[1].tolist()
