"""Expert-predictor tables fitted from dense traces (``token-table`` and ``union-size`` predictors).

The fitting rules live in :mod:`specfit.predictors` (one implementation for everyone); this module
feeds them the dense trees of recorded runs and stores the result:

- ``union_size``: float64[L, M+1], mean distinct experts the ``n`` most probable nodes of a tree
  route to at each layer (:func:`specfit.predictors.union_size_from_node_arrays`, ranked by draft path
  probability, root first). It is also the report's "expert-union growth against tree size".
- token table: for each node token seen at least ``min_token_count`` times, its ``K`` most
  frequent experts per layer (:func:`specfit.predictors.token_table_from_routing`), stored as
  ``token_ids`` int64[V] and ``token_bits`` uint64[V, L, W].
- ``layer_frequency``: float64[L, E], the share of node routings that picked each expert (sums to
  ``K`` per layer); usable as the ``static`` cache's frequency.

Saved with :func:`numpy.savez_compressed` and read back with ``allow_pickle=False`` (no pickle for
user data). :meth:`PredictorTables.predictor_kwargs` gives the keyword arguments of
``specfit.predictors.make_predictor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specfit import bitsets
from specfit.predictors import token_table_from_routing, union_size_from_node_arrays
from traces.reader import NodeArrays

_ARRAYS = ("union_size", "token_ids", "token_bits", "layer_frequency", "num_trees")


@dataclass(frozen=True, eq=False)
class PredictorTables:
    """Fitted predictor tables (see the module docstring for each array).

    Attributes:
        union_size: float64[L, M+1]; token_ids: int64[V]; token_bits: uint64[V, L, W];
        layer_frequency: float64[L, E]; num_trees: trees used.
    """

    union_size: np.ndarray
    token_ids: np.ndarray
    token_bits: np.ndarray
    layer_frequency: np.ndarray
    num_trees: int

    def token_table(self) -> dict[int, np.ndarray]:
        """``{token id: uint64[L, W]}``, the ``table`` argument of the token-table predictor."""
        return {int(t): self.token_bits[i] for i, t in enumerate(self.token_ids)}

    def predictor_kwargs(self, name: str) -> dict[str, Any]:
        """Keyword arguments of ``make_predictor(name, ...)`` for ``token-table`` / ``union-size``.

        Raises:
            ValueError: another predictor name.
        """
        if name == "token-table":
            return {"table": self.token_table()}
        if name == "union-size":
            return {"union_size": self.union_size}
        raise ValueError(f"predictor {name!r}: tables exist for 'token-table' and 'union-size' only")

    def save(self, path: str | Path) -> Path:
        """Write an ``.npz`` file (parents created); returns its path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            out,
            union_size=self.union_size,
            token_ids=self.token_ids,
            token_bits=self.token_bits,
            layer_frequency=self.layer_frequency,
            num_trees=np.array(self.num_trees),
        )
        return out

    @classmethod
    def load(cls, path: str | Path) -> PredictorTables:
        """Read a file written by :meth:`save`.

        Raises:
            ValueError: unreadable file or a missing array (named).
        """
        try:
            with np.load(Path(path), allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read predictor tables: {exc}") from None
        for key in _ARRAYS:
            if key not in arrays:
                raise ValueError(f"{path}: missing array {key!r}")
        return cls(
            union_size=arrays["union_size"],
            token_ids=arrays["token_ids"].astype(np.int64),
            token_bits=arrays["token_bits"].astype(np.uint64),
            layer_frequency=arrays["layer_frequency"],
            num_trees=int(arrays["num_trees"]),
        )


def fit_predictor_tables(
    arrays: list[NodeArrays], num_experts: int, *, min_token_count: int = 2
) -> PredictorTables:
    """Fit all tables from the dense trees of one or more runs.

    Args:
        arrays: one :class:`traces.reader.NodeArrays` per dense run.
        num_experts: experts per layer ``E``.
        min_token_count: node-token occurrences needed for a token-table entry.

    Returns:
        :class:`PredictorTables`.

    Raises:
        ValueError: no dense trees.
    """
    arrays = [a for a in arrays if a.num_trees > 0]
    if not arrays:
        raise ValueError("predictor tables: no dense trees in the given runs")
    union = union_size_from_node_arrays(arrays, num_experts)
    tokens = np.concatenate([na.token_id for na in arrays]).astype(np.int64)
    routed = np.concatenate([na.expert_ids for na in arrays]).astype(np.int64)  # [R, L, K]
    uniq, counts = np.unique(tokens, return_counts=True)
    frequent = np.isin(tokens, uniq[counts >= min_token_count])
    table = token_table_from_routing(tokens[frequent], routed[frequent], num_experts)
    num_layers = routed.shape[1]
    token_ids = np.array(sorted(table), dtype=np.int64)
    words = bitsets.num_words(num_experts)
    token_bits = (
        np.stack([table[int(t)] for t in token_ids])
        if token_ids.size
        else np.zeros((0, num_layers, words), np.uint64)
    )
    freq = np.zeros((num_layers, num_experts))
    for layer in range(num_layers):
        ids = routed[:, layer].ravel()
        freq[layer] = np.bincount(ids[ids >= 0], minlength=num_experts)[:num_experts]
    freq /= max(tokens.size, 1)
    return PredictorTables(union, token_ids, token_bits, freq, sum(na.num_trees for na in arrays))
