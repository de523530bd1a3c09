"""Acceptance estimate: P(v), the probability that the whole path root -> v is accepted.

Without calibration, P(v) is the draft model's path probability ``exp(path_logprobs[v])``, the
score EAGLE-2 (Li et al., 2024, "dynamic draft trees") showed tracks acceptance. A monotone
calibration map fitted from traces (the fit lives in ``calibration/``, e.g. isotonic regression of
accepted flags on draft path probability) corrects its over- or under-confidence; it is applied
here so every caller gets the same P.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specfit.tree import DraftTree

ACCEPTANCE_SCOPES: tuple[str, ...] = ("edge", "path")


@dataclass(frozen=True, eq=False)
class AcceptanceCalibration:
    """Monotone piecewise-linear map from draft probability to acceptance probability.

    ``apply(p) = interp(p, knots_x, knots_y)`` (clamped at the ends).

    Two scopes (see :func:`path_accept_probs`):

    * ``"edge"``: the map takes a node's OWN draft probability ``exp(draft_logprob)`` to the
      probability that the node is accepted given its parent's path was (EAGLE's per-token
      acceptance); P(v) is the product along the path. It keeps depth apart: a depth-3 node
      with draft path probability 0.2 built from three confident steps is far likelier to be
      accepted than a depth-1 sibling whose own draft probability is 0.2.
    * ``"path"``: the map takes the draft PATH probability straight to P(v) (one map for every
      depth; kept for maps fitted that way).

    Attributes:
        knots_x: float64[M], strictly increasing draft probabilities in [0, 1].
        knots_y: float64[M], non-decreasing acceptance probabilities in [0, 1].
        source: provenance (e.g. the trace it was fitted on).
        scope: ``"edge"`` or ``"path"`` (default ``"path"``, the meaning of files without it).

    Raises:
        ValueError: fewer than 1 knot, mismatched lengths, values outside [0, 1], ``knots_x`` not
            strictly increasing or ``knots_y`` decreasing, unknown scope; the message names the field.
    """

    knots_x: np.ndarray
    knots_y: np.ndarray
    source: str = "manual"
    scope: str = "path"

    def __post_init__(self) -> None:
        if self.scope not in ACCEPTANCE_SCOPES:
            raise ValueError(
                f"AcceptanceCalibration.scope: expected one of {list(ACCEPTANCE_SCOPES)}, got {self.scope!r}"
            )
        x = np.asarray(self.knots_x, dtype=np.float64).ravel().copy()
        y = np.asarray(self.knots_y, dtype=np.float64).ravel().copy()
        if x.size == 0:
            raise ValueError("AcceptanceCalibration.knots_x: expected at least one knot")
        if x.shape != y.shape:
            raise ValueError(
                f"AcceptanceCalibration.knots_y: expected {x.size} values (= len(knots_x)), got {y.size}"
            )
        for name, arr in (("knots_x", x), ("knots_y", y)):
            if not np.all(np.isfinite(arr)) or arr.min() < 0 or arr.max() > 1:
                raise ValueError(f"AcceptanceCalibration.{name}: expected probabilities in [0, 1]")
        if np.any(np.diff(x) <= 0):
            raise ValueError("AcceptanceCalibration.knots_x: expected strictly increasing values")
        if np.any(np.diff(y) < 0):
            raise ValueError("AcceptanceCalibration.knots_y: expected non-decreasing values (a monotone map)")
        x.setflags(write=False)
        y.setflags(write=False)
        object.__setattr__(self, "knots_x", x)
        object.__setattr__(self, "knots_y", y)

    def apply(self, draft_path_probs: np.ndarray) -> np.ndarray:
        """Map draft path probabilities (float[...], in [0, 1]) to acceptance probabilities (same shape)."""
        p = np.clip(np.asarray(draft_path_probs, dtype=np.float64), 0.0, 1.0)
        return np.interp(p, self.knots_x, self.knots_y)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict ``{"knots_x": [...], "knots_y": [...], "source": ..., "scope": ...}``."""
        return {
            "knots_x": self.knots_x.tolist(),
            "knots_y": self.knots_y.tolist(),
            "source": self.source,
            "scope": self.scope,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcceptanceCalibration:
        """Inverse of :meth:`to_dict`; a missing field raises ``ValueError`` naming it."""
        for key in ("knots_x", "knots_y"):
            if key not in data:
                raise ValueError(f"AcceptanceCalibration: missing field {key!r}")
        return cls(
            knots_x=data["knots_x"],
            knots_y=data["knots_y"],
            source=data.get("source", "manual"),
            scope=data.get("scope", "path"),
        )

    @classmethod
    def identity(cls) -> AcceptanceCalibration:
        """The map p -> p."""
        return cls(knots_x=np.array([0.0, 1.0]), knots_y=np.array([0.0, 1.0]), source="identity")


def path_accept_probs(tree: DraftTree, calibration: AcceptanceCalibration | None = None) -> np.ndarray:
    """P(v) for every node: float64[N], ``P(root) = 1``, non-increasing from parent to child.

    Without calibration ``P(v) = exp(path_logprobs[v])``. With an ``"edge"`` map
    ``P(v) = P(parent) * calibration.apply(exp(draft_logprobs[v]))`` (per-token acceptance
    multiplied along the path); with a ``"path"`` map ``P(v) = calibration.apply(exp(path_logprobs[v]))``
    clamped to its parent's value so a path is never more likely than its prefix (a monotone map
    already keeps that order; the clamp guards the root, whose value is fixed at 1).
    """
    if calibration is not None and calibration.scope == "edge":
        edge = np.clip(calibration.apply(np.exp(tree.draft_logprobs)), 0.0, 1.0)
        p = np.ones(tree.num_nodes, dtype=np.float64)
        parents, depths = tree.parents, tree.depths
        for d in range(1, int(tree.max_depth) + 1):
            level = np.flatnonzero(depths == d)
            p[level] = p[parents[level]] * edge[level]
        return p
    p = np.exp(tree.path_logprobs)
    if calibration is not None:
        p = calibration.apply(p)
    p = np.clip(p, 0.0, 1.0)
    p[0] = 1.0
    parents = tree.parents
    for v in range(1, p.shape[0]):
        parent_p = p[parents[v]]
        if p[v] > parent_p:
            p[v] = parent_p
    return p
