"""Expert-predictor tables fitted from dense traces (``token-table`` and ``union-size`` predictors).

The fitting rules live in :mod:`specfit.predictors` (one implementation for everyone); this module
feeds them the dense trees of recorded runs and stores the result:

- ``union_size``: float64[L, M+1], mean distinct experts the ``n`` most probable nodes of a tree
  route to at each layer (:func:`specfit.predictors.union_size_from_node_arrays`, root first), ranked
  the way SpecFit's planner takes its prefixes: by calibrated acceptance with the acceptance map
  fitted in the same ``calibration.fit`` run (``node_rank`` ``calibrated-acceptance``, the map in
  ``acceptance_json``), or by draft path probability where no map was fitted (``node_rank``
  ``draft-path-probability``, what the planner ranks by without a map).
- token table: for each node token seen at least ``min_token_count`` times, its ``K`` most
  frequent experts per layer (:func:`specfit.predictors.token_table_from_routing`), stored as
  ``token_ids`` int64[V] and ``token_bits`` uint64[V, L, W].
- ``layer_frequency``: float64[L, E], the share of node routings that picked each expert (sums to
  ``K`` per layer); usable as the ``static`` cache's frequency.

Saved with :func:`numpy.savez_compressed` and read back with ``allow_pickle=False`` (no pickle for
user data). Format 2 (:data:`FORMAT_VERSION`) adds ``format_version``, ``node_rank`` and
``acceptance_json``; a format-1 file (no such arrays) loads as ``node_rank``
``draft-path-probability`` with no map, which is how every format-1 table was fitted. :meth:`PredictorTables.predictor_kwargs` gives the keyword arguments of
``specfit.predictors.make_predictor``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specfit import bitsets
from specfit.predictors import (
    CALIBRATED_RANK,
    DRAFT_RANK,
    token_table_from_routing,
    union_size_from_node_arrays,
)
from traces.reader import NodeArrays

_ARRAYS = ("union_size", "token_ids", "token_bits", "layer_frequency", "num_trees")
#: 2: ``union_size`` ranked by calibrated acceptance where a map was fitted (``node_rank``).
FORMAT_VERSION = 2


@dataclass(frozen=True, eq=False)
class PredictorTables:
    """Fitted predictor tables (see the module docstring for each array).

    Attributes:
        union_size: float64[L, M+1]; token_ids: int64[V]; token_bits: uint64[V, L, W];
        layer_frequency: float64[L, E]; num_trees: trees used.
        node_rank: how ``union_size``'s nodes were ranked (``specfit.predictors.DRAFT_RANK`` or
            ``CALIBRATED_RANK``); acceptance_json: the acceptance map of that ranking as JSON
            (``""`` for the draft ranking).
    """

    union_size: np.ndarray
    token_ids: np.ndarray
    token_bits: np.ndarray
    layer_frequency: np.ndarray
    num_trees: int
    node_rank: str = DRAFT_RANK
    acceptance_json: str = ""

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
            format_version=np.array(FORMAT_VERSION),
            node_rank=np.array(self.node_rank),
            acceptance_json=np.array(self.acceptance_json),
        )
        return out

    @classmethod
    def load(cls, path: str | Path) -> PredictorTables:
        """Read a file written by :meth:`save` (format 1 files: ranked by draft path probability).

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
            node_rank=str(arrays["node_rank"]) if "node_rank" in arrays else DRAFT_RANK,
            acceptance_json=str(arrays["acceptance_json"]) if "acceptance_json" in arrays else "",
        )


def fit_predictor_tables(
    arrays: list[NodeArrays], num_experts: int, *, min_token_count: int = 2, calibration: Any = None
) -> PredictorTables:
    """Fit all tables from the dense trees of one or more runs.

    Args:
        arrays: one :class:`traces.reader.NodeArrays` per dense run.
        num_experts: experts per layer ``E``.
        min_token_count: node-token occurrences needed for a token-table entry.
        calibration: the acceptance map the planner will use
            (:class:`specfit.acceptance.AcceptanceCalibration`): ``union_size`` ranks nodes by it,
            as the planner does; None ranks by draft path probability (the planner's order without
            a map; a planner run with a map then asks in another order than the table was fitted in).

    Returns:
        :class:`PredictorTables`.

    Raises:
        ValueError: no dense trees.
    """
    arrays = [a for a in arrays if a.num_trees > 0]
    if not arrays:
        raise ValueError("predictor tables: no dense trees in the given runs")
    union = union_size_from_node_arrays(arrays, num_experts, calibration)
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
    if calibration is None:
        rank, acceptance = DRAFT_RANK, ""
    else:
        rank, acceptance = CALIBRATED_RANK, json.dumps(calibration.to_dict(), sort_keys=True)
    num_trees = sum(a.num_trees for a in arrays)
    return PredictorTables(union, token_ids, token_bits, freq, num_trees, rank, acceptance)
