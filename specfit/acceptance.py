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
        runner_up_knots_x, runner_up_knots_y: optional second map (edge scope) for children that
            are not their parent's most probable child; ``None``: one map for all.

    Raises:
        ValueError: fewer than 1 knot, mismatched lengths, values outside [0, 1], ``knots_x`` not
            strictly increasing or ``knots_y`` decreasing, unknown scope; the message names the field.
    """

    knots_x: np.ndarray
    knots_y: np.ndarray
    source: str = "manual"
    scope: str = "path"
    runner_up_knots_x: np.ndarray | None = None
    runner_up_knots_y: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.runner_up_knots_x is None) != (self.runner_up_knots_y is None):
            raise ValueError(
                "AcceptanceCalibration.runner_up_knots_y: give both runner-up knot arrays or neither"
            )
        if self.runner_up_knots_x is not None:
            if self.scope != "edge":
                raise ValueError("AcceptanceCalibration.runner_up_knots_x: only meaningful with scope 'edge'")
            runner = AcceptanceCalibration(self.runner_up_knots_x, self.runner_up_knots_y, scope="edge")
            object.__setattr__(self, "runner_up_knots_x", runner.knots_x)
            object.__setattr__(self, "runner_up_knots_y", runner.knots_y)
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

    def apply_edges(self, draft_probs: np.ndarray, is_top_child: np.ndarray) -> np.ndarray:
        """Edge scope: per-token acceptance float[n] of children with own draft probabilities float[n].

        ``is_top_child`` bool[n] marks each parent's most probable child; the runner-up map (when
        present) serves the others.
        """
        out = self.apply(draft_probs)
        if self.runner_up_knots_x is not None:
            others = ~np.asarray(is_top_child, dtype=bool)
            p = np.clip(np.asarray(draft_probs, dtype=np.float64)[others], 0.0, 1.0)
            out[others] = np.interp(p, self.runner_up_knots_x, self.runner_up_knots_y)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict ``{"knots_x": [...], "knots_y": [...], "source": ..., "scope": ...}``."""
        return {
            "knots_x": self.knots_x.tolist(),
            "knots_y": self.knots_y.tolist(),
            "source": self.source,
            "scope": self.scope,
            **(
                {
                    "runner_up_knots_x": self.runner_up_knots_x.tolist(),
                    "runner_up_knots_y": self.runner_up_knots_y.tolist(),
                }
                if self.runner_up_knots_x is not None
                else {}
            ),
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
            runner_up_knots_x=data.get("runner_up_knots_x"),
            runner_up_knots_y=data.get("runner_up_knots_y"),
        )

    @classmethod
    def identity(cls) -> AcceptanceCalibration:
        """The map p -> p."""
        return cls(knots_x=np.array([0.0, 1.0]), knots_y=np.array([0.0, 1.0]), source="identity")


def top_child_mask(parents: np.ndarray, draft_logprobs: np.ndarray) -> np.ndarray:
    """bool[N]: True for each parent's most probable child (ties: the lowest node id); False at roots.

    ``parents`` int[N] (-1 for a root), ``draft_logprobs`` float[N]; several trees may be
    concatenated when ``parents`` hold global row indices.
    """
    parents = np.asarray(parents)
    logp = np.asarray(draft_logprobs, dtype=np.float64)
    ids = np.arange(parents.shape[0])
    order = np.lexsort((ids, -logp, parents))
    sorted_parents = parents[order]
    first = np.r_[True, sorted_parents[1:] != sorted_parents[:-1]]
    mask = np.zeros(parents.shape[0], dtype=bool)
    mask[order[first]] = True
    mask[parents < 0] = False
    return mask


def path_accept_probs(tree: DraftTree, calibration: AcceptanceCalibration | None = None) -> np.ndarray:
    """P(v) for every node: float64[N], ``P(root) = 1``, non-increasing from parent to child.

    Without calibration ``P(v) = exp(path_logprobs[v])``. With an ``"edge"`` map
    ``P(v) = P(parent) * calibration.apply(exp(draft_logprobs[v]))`` (per-token acceptance
    multiplied along the path); with a ``"path"`` map ``P(v) = calibration.apply(exp(path_logprobs[v]))``
    clamped to its parent's value so a path is never more likely than its prefix (a monotone map
    already keeps that order; the clamp guards the root, whose value is fixed at 1).

    Siblings are disjoint events (the target's greedy token matches at most one child), so a
    calibrated map must also keep ``sum of P over a node's children <= P(node)``; a map fitted
    per node does not guarantee it (four children of draft probability 0.2 mapped to 0.98 each).
    Where the children of a node sum to more than its P, they are scaled by ``P(node) / sum``
    (level by level, so deeper nodes build on the scaled values). The draft model's own path
    probabilities already satisfy it (a softmax over distinct tokens) and are left as they are;
    uncalibrated path probabilities that do not (a node's children summing to more than
    ``P(node) * (1 + 1e-9)``, e.g. :func:`specfit.synthetic.random_small_context` with
    ``sibling_mass=False``) get the same level-by-level renormalisation
    (:func:`specfit.decide_kernels.renormalise_uncalibrated_siblings`; within the tolerance,
    float rounding of a softmax's sums, P is bit-identical).
    ``SpecFitPolicy``'s ``stopping="bound"`` rule relies on this (each level adds at most the
    mass of the level above). With a map the level-by-level pass runs compiled
    (:func:`specfit.decide_kernels.level_accept_probs`: the numpy pass's operations in the same
    order; its ``exp`` is libm's, ``math.exp``, the values of ``np.exp`` wherever numpy calls libm,
    which is everywhere but its AVX-512 loops; the live planner's questions run the same code).
    """
    parents, depths = tree.parents, tree.depths
    if parents.shape[0] == 1:
        return np.ones(1)  # the root alone (the first question of every live cycle)
    if calibration is None:
        p = np.clip(np.exp(tree.path_logprobs), 0.0, 1.0)
        p[0] = 1.0
        if p.shape[0] > 1 and np.any(p[1:] > p[parents[1:]]):  # never for a consistent tree
            for v in range(1, p.shape[0]):
                p[v] = min(p[v], p[parents[v]])
        from specfit import decide_kernels as kernels  # numba, loaded on first use

        # one compiled pass sums each family and checks it (a softmax's tree: nothing changes);
        # numpy's bincount + compare cost ~6-9 us more per call (rev8, /tmp/rev8/bench_pap.py)
        kernels.renormalise_uncalibrated_siblings(
            parents, depths, int(tree.max_depth), p, np.empty(p.shape[0]), _SIBLING_MASS_TOLERANCE
        )
        return p
    from specfit import decide_kernels as kernels  # numba, loaded on first use

    edge = calibration.scope == "edge"
    runner_x, runner_y = calibration.runner_up_knots_x, calibration.runner_up_knots_y
    if runner_x is None or not edge:
        runner_x = runner_y = _NO_VALUES
    return kernels.level_accept_probs(
        parents,
        depths,
        int(tree.max_depth),
        tree.draft_logprobs if edge else tree.path_logprobs,  # exp taken there (libm's, as math.exp)
        edge,
        calibration.knots_x,
        calibration.knots_y,
        runner_x,
        runner_y,
        tree.draft_logprobs,
    )


_SIBLING_MASS_TOLERANCE = 1e-9  # specfit.decide_kernels.SIBLING_MASS_TOLERANCE (numba-free here; a test checks)
_NO_VALUES = np.zeros(0, dtype=np.float64)
_NO_VALUES.setflags(write=False)  # read-only like the knots: one compiled signature
