"""Expert predictors for draft nodes: which experts will the target route each node to?

The target's routing of a draft token is only known after verification, so the planner works
from a prediction (a :class:`~specfit.node_experts.NodeExperts`):

* ``oracle``: the true experts from a dense trace (simulator only; an upper bound).
* ``recent``: every node gets, per layer, the union of the experts the last ``m`` committed
  tokens used (temporal locality of routing, as exploited by expert-caching engines).
* ``token-table``: per input token id and layer, the experts it was most often routed to in
  traces (token-level routing affinity); unknown tokens fall back to ``recent``'s sets or nothing.
* ``union-size``: no per-node sets, only the expected number of distinct experts ``n`` nodes
  touch per layer, measured from traces (see node_experts.py for how the planner uses it).
* ``head-router``: with an EAGLE-3 head, each node's head state routed by the target's own
  routers (``live.eagle3_draft.HeadRouter``), handed in as ``PredictContext.head_experts``. Not
  in :data:`PREDICTORS` (what ``sim.sweep`` replays): dense traces do not record head routing yet.

:func:`predictor_recall_precision` scores per-node predictions against the truth.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from specfit import bitsets
from specfit.node_experts import NodeExperts
from specfit.tree import DraftTree

PREDICTORS: tuple[str, ...] = ("oracle", "recent", "token-table", "union-size")
ALL_PREDICTORS: tuple[str, ...] = (*PREDICTORS, "head-router")
#: One line per predictor for ``--help`` (the classes below say exactly what each does).
PREDICTOR_HELP: dict[str, str] = {
    "oracle": "the true experts of every node (simulator only; an upper bound)",
    "recent": "the experts of the last committed tokens, for every node",
    "token-table": "per draft token id and layer, the experts it was most often routed to (fitted)",
    "union-size": "no per-node sets: expected distinct experts per layer against node count (fitted "
    "on dense trees)",
    "head-router": "an EAGLE-3 head's state of each node routed by the target's own routers (live only)",
}

__all__ = [
    "ALL_PREDICTORS",
    "PREDICTORS",
    "NodeExperts",
    "PredictContext",
    "PredictorScore",
    "make_predictor",
    "predictor_recall_precision",
    "score_predictor",
    "token_table_from_routing",
    "union_size_from_node_arrays",
    "union_size_from_trees",
]


@dataclass(frozen=True, eq=False)
class PredictContext:
    """Inputs of a prediction for one draft tree.

    Attributes:
        tree: the draft tree (``N`` nodes).
        num_experts: ``E``.
        num_layers: ``L``.
        context_len: tokens before the tree (count).
        recent_experts: uint64[m, L, W], experts of the last ``m`` committed tokens (oldest
            first), or ``None``.
        true_experts: uint64[N, L, W], the target's real routing (oracle only), or ``None``.
        miss_fraction: float64[L], the expert cache's observed miss fraction per layer
            (``cache.stats.layer_miss_fraction``; NaN where not yet observed), or ``None``.
            Used by the union-size predictor.
        head_experts: uint64[N, L, W], the experts the target's routers pick for each node's
            EAGLE-3 head state (head-router only), or ``None``.
    """

    tree: DraftTree
    num_experts: int
    num_layers: int
    context_len: int = 0
    recent_experts: np.ndarray | None = None
    true_experts: np.ndarray | None = None
    miss_fraction: np.ndarray | None = None
    head_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        words = bitsets.num_words(self.num_experts)
        nodes = self.tree.num_nodes
        for name, lead in (("recent_experts", None), ("true_experts", nodes), ("head_experts", nodes)):
            arr = getattr(self, name)
            if arr is None:
                continue
            arr = np.asarray(arr)
            ok = arr.dtype == np.uint64 and arr.ndim == 3 and arr.shape[1:] == (self.num_layers, words)
            if not ok or (lead is not None and arr.shape[0] != lead):
                want = f"uint64[{'m' if lead is None else lead}, {self.num_layers}, {words}]"
                raise ValueError(f"PredictContext.{name}: expected {want}, got {arr.dtype}{list(arr.shape)}")

    @classmethod
    def trusted(cls, **fields: Any) -> PredictContext:
        """A context built WITHOUT the ``__post_init__`` checks, for a caller that validated its
        inputs once (the simulator: trees validated once per trace, bitsets it packs itself).

        ``fields`` are the attributes above by name (unset ones take the class defaults); the
        caller guarantees the shapes and dtypes the constructor checks. Use the constructor for
        anything external.
        """
        ctx = object.__new__(cls)
        ctx.__dict__.update(_PREDICT_DEFAULTS, **fields)
        return ctx


_PREDICT_DEFAULTS = {
    "context_len": 0,
    "recent_experts": None,
    "true_experts": None,
    "miss_fraction": None,
    "head_experts": None,
}


class PredictorScore(NamedTuple):
    """Recall and precision of predicted expert sets (micro-averaged over nodes and layers)."""

    recall: float
    precision: float


class Predictor:
    """Base: ``name`` and ``predict(ctx) -> NodeExperts``."""

    name = "base"
    #: whether :meth:`predict` reads ``PredictContext.recent_experts`` (callers may skip building it)
    uses_recent = False

    def predict(self, ctx: PredictContext) -> NodeExperts:  # pragma: no cover - interface
        """Predicted experts for every node of ``ctx.tree``."""
        raise NotImplementedError


class OraclePredictor(Predictor):
    """The true experts (``ctx.true_experts``); simulator only."""

    name = "oracle"

    def predict(self, ctx: PredictContext) -> NodeExperts:
        """``NodeExperts(bits=ctx.true_experts)``.

        Raises:
            ValueError: ``ctx.true_experts`` is missing.
        """
        if ctx.true_experts is None:
            raise ValueError("oracle predictor: PredictContext.true_experts is required (dense trace)")
        return NodeExperts(ctx.num_experts, bits=np.asarray(ctx.true_experts), source=self.name)


class HeadRouterPredictor(Predictor):
    """Per node, the experts the target's routers choose for the node's EAGLE-3 head state.

    Source: EAGLE-3 heads draft from the target's hidden states (Li et al. 2025), so a node's head
    state is an estimate of the target's state there; applying the target's per-layer router to it
    predicts the node's routing before verification (computed live by ``live.eagle3_draft``).
    """

    name = "head-router"

    def predict(self, ctx: PredictContext) -> NodeExperts:
        """``NodeExperts(bits=ctx.head_experts)``.

        Raises:
            ValueError: ``ctx.head_experts`` is missing (no EAGLE-3 head).
        """
        if ctx.head_experts is None:
            raise ValueError(
                "head-router predictor: PredictContext.head_experts is required (an EAGLE-3 head)"
            )
        return NodeExperts(ctx.num_experts, bits=np.asarray(ctx.head_experts), source=self.name)


def _recent_union(ctx: PredictContext, window: int) -> np.ndarray:
    """uint64[L, W] union of the last ``window`` committed tokens' experts (empty if none)."""
    if ctx.recent_experts is None or ctx.recent_experts.shape[0] == 0:
        return bitsets.empty((ctx.num_layers,), ctx.num_experts)
    return bitsets.union(ctx.recent_experts[-window:], axis=0)


class RecentPredictor(Predictor):
    """Every node gets the union of the experts of the last ``window`` committed tokens.

    Raises:
        ValueError: ``window`` < 1.
    """

    name = "recent"
    uses_recent = True

    def __init__(self, window: int = 4) -> None:
        if int(window) < 1:
            raise ValueError(f"recent predictor: window must be >= 1, got {window}")
        self.window = int(window)

    def predict(self, ctx: PredictContext) -> NodeExperts:
        """Same per-layer set for all ``N`` nodes."""
        union = _recent_union(ctx, self.window)
        bits = np.broadcast_to(union, (ctx.tree.num_nodes, *union.shape)).copy()
        return NodeExperts(ctx.num_experts, bits=bits, source=self.name)


class TokenTablePredictor(Predictor):
    """Per token id and layer, the experts the token was most often routed to.

    Args:
        table: mapping token id -> uint64[L, W] predicted set (e.g. from
            :func:`token_table_from_routing`).
        fallback_window: unknown tokens get the ``recent`` union over this window (0: empty set).
    """

    name = "token-table"
    uses_recent = True

    def __init__(self, table: Mapping[int, np.ndarray], fallback_window: int = 4) -> None:
        self.table = {int(k): np.asarray(v, dtype=np.uint64) for k, v in table.items()}
        self.fallback_window = int(fallback_window)

    def predict(self, ctx: PredictContext) -> NodeExperts:
        """Per-node sets from the table (fallback for unknown tokens)."""
        if self.fallback_window > 0:
            fallback = _recent_union(ctx, self.fallback_window)
        else:
            fallback = bitsets.empty((ctx.num_layers,), ctx.num_experts)
        rows = [self.table.get(int(t), fallback) for t in ctx.tree.token_ids]
        bad = [int(t) for t, r in zip(ctx.tree.token_ids, rows) if r.shape != fallback.shape]
        if bad:
            raise ValueError(
                f"token-table predictor: entry for token {bad[0]} must be uint64{list(fallback.shape)}"
            )
        bits = np.stack(rows).astype(np.uint64, copy=False)
        return NodeExperts(ctx.num_experts, bits=bits, source=self.name)


def clean_miss_fraction(observed: np.ndarray) -> np.ndarray:
    """float64[L] an observed miss fraction per layer made usable: 1 where not finite (NaN before
    a layer's first access), the rest clipped to [0, 1] (``specfit.decide_kernels`` repeats this
    element by element inside the live planner's compiled question)."""
    # clip(0, 1)'s values bit for bit (-0.0 included; tested), without np.clip's Python wrappers
    # (called per simulated cycle); NaN and infinities are replaced by the where
    return np.where(np.isfinite(observed), np.minimum(np.maximum(0.0, observed), 1.0), 1.0)


class UnionSizePredictor(Predictor):
    """No per-node sets: the expected distinct experts per layer as a function of node count.

    Args:
        union_size: float[L, M+1] (``union_size[l, n]`` for ``n`` nodes), e.g. from
            :func:`union_size_from_trees`.
        miss_fraction: optional fixed float[L] (see :class:`~specfit.node_experts.NodeExperts`).
            When ``None`` (the default) the predictor uses the cache's OBSERVED miss fraction
            per layer from :attr:`PredictContext.miss_fraction` (a moving average over recent
            accesses, so it reflects the locality the cache actually sees), and only where that
            is absent ``1 - |C_l| / E``. Pricing the expected union at ``1 - |C_l|/E`` alone
            ignores that caches hold the hot experts: on the shipped sample trace it predicted
            ~50% misses where the cache saw ~8%, and SpecFit verified too few nodes.
    """

    name = "union-size"

    def __init__(self, union_size: np.ndarray, miss_fraction: np.ndarray | None = None) -> None:
        self.union_size = np.asarray(union_size, dtype=np.float64)
        self.miss_fraction = miss_fraction
        self._checked: tuple[int, int] | None = None  # (E, L) the sizes were validated for

    def predict(self, ctx: PredictContext) -> NodeExperts:
        """``NodeExperts(union_size=..., miss_fraction=...)`` (the same sizes for every tree).

        The sizes (and a fixed ``miss_fraction``) are validated by the first prediction for a
        model shape; later ones build the output unchecked (its only per-tree part, the observed
        miss fraction, is clipped into [0, 1] here).

        Raises:
            ValueError: the sizes or the fixed miss fraction are not what ``NodeExperts`` accepts,
                or ``ctx.miss_fraction`` is not float[L].
        """
        frac = self.miss_fraction
        if frac is None and ctx.miss_fraction is not None:
            observed = np.asarray(ctx.miss_fraction, dtype=np.float64)
            if observed.shape != (ctx.num_layers,):
                raise ValueError(
                    f"PredictContext.miss_fraction: expected float[{ctx.num_layers}], got shape {observed.shape}"
                )
            frac = clean_miss_fraction(observed)
        shape = (int(ctx.num_experts), int(ctx.num_layers))
        if self._checked != shape:
            out = NodeExperts(
                ctx.num_experts, union_size=self.union_size, miss_fraction=frac, source=self.name
            )
            self.union_size = out.union_size
            if self.miss_fraction is not None:
                self.miss_fraction = out.miss_fraction
            self._checked = shape
            return out
        return NodeExperts.trusted(
            ctx.num_experts, union_size=self.union_size, miss_fraction=frac, source=self.name
        )


def token_table_from_routing(
    token_ids: np.ndarray, expert_ids: np.ndarray, num_experts: int, keep_top: int | None = None
) -> dict[int, np.ndarray]:
    """Fit a token table: for each input token id and layer, its ``keep_top`` most frequent experts.

    Args:
        token_ids: int[T] input token of each routed position.
        expert_ids: int[T, L, K] the target's top-k expert ids at those positions (-1 = padding).
        num_experts: ``E``.
        keep_top: experts kept per token and layer (default ``K``); ties: smaller id.

    Returns:
        dict token id -> uint64[L, W].

    Raises:
        ValueError: mismatched lengths or shapes.
    """
    tokens = np.asarray(token_ids, dtype=np.int64).ravel()
    experts = np.asarray(expert_ids)
    if experts.ndim != 3 or experts.shape[0] != tokens.shape[0]:
        raise ValueError(f"expert_ids: expected int[{tokens.shape[0]}, L, K], got {list(experts.shape)}")
    num_layers, k = experts.shape[1], experts.shape[2]
    keep = k if keep_top is None else int(keep_top)
    table: dict[int, np.ndarray] = {}
    for token in np.unique(tokens):
        rows = experts[tokens == token]  # [n, L, K]
        counts = np.zeros((num_layers, num_experts), dtype=np.int64)
        for layer in range(num_layers):
            ids = rows[:, layer, :].ravel()
            ids = ids[ids >= 0]
            counts[layer] = np.bincount(ids, minlength=num_experts)[:num_experts]
        order = np.argsort(-counts, axis=1, kind="stable")[:, :keep]
        chosen = np.where(np.take_along_axis(counts, order, axis=1) > 0, order, -1)
        table[int(token)] = bitsets.pack(chosen, num_experts)
    return table


def union_size_from_trees(
    tree_experts: Sequence[np.ndarray], tree_probs: Sequence[np.ndarray], num_experts: int, max_nodes: int
) -> np.ndarray:
    """Measure ``union_size[l, n]``: mean distinct experts at layer l among a tree's top-n nodes by P.

    Args:
        tree_experts: per tree, int[N, L, K] expert ids of its nodes (-1 = padding).
        tree_probs: per tree, float[N] path probabilities (the root first).
        num_experts: ``E``.
        max_nodes: largest ``n`` measured (``M``); trees smaller than ``n`` are left out of that mean.

    Returns:
        float64[L, M+1], column 0 is 0.

    Raises:
        ValueError: no trees, or mismatched lists.
    """
    if not tree_experts or len(tree_experts) != len(tree_probs):
        raise ValueError("union_size_from_trees: need one probability array per tree (at least one tree)")
    num_layers = np.asarray(tree_experts[0]).shape[1]
    sums = np.zeros((num_layers, max_nodes + 1))
    counts = np.zeros(max_nodes + 1)
    for experts, probs in zip(tree_experts, tree_probs):
        bits = bitsets.pack(np.asarray(experts), num_experts)  # [N, L, W]
        p = np.asarray(probs, dtype=np.float64)
        order = np.lexsort((np.arange(p.shape[0]), -p))
        order = np.concatenate(([0], order[order != 0]))
        running = bitsets.empty((num_layers,), num_experts)
        for n, v in enumerate(order[:max_nodes], start=1):
            running = running | bits[v]
            sums[:, n] += bitsets.popcount(running)
            counts[n] += 1
    out = np.zeros_like(sums)
    seen = counts > 0
    out[:, seen] = sums[:, seen] / counts[seen]
    last = int(np.flatnonzero(seen).max())
    out[:, last + 1 :] = out[:, [last]]  # unmeasured sizes: flat (no data beyond the largest tree)
    return np.maximum.accumulate(out, axis=1)


def union_size_from_node_arrays(
    node_arrays: Any, num_experts: int, tree_probs: Sequence[np.ndarray] | None = None
) -> np.ndarray:
    """The ``union_size`` table of dense trees stored as flat node arrays (:func:`union_size_from_trees`).

    The one place the planner's union-size table is fitted from a trace's dense trees
    (``calibration.predictor_tables``, ``sim.replay``, ``live.spec.session``'s dense-trace tables
    and ``analysis.figures``' union growth): each tree's nodes ranked by draft path probability
    ``exp(path_logprob)`` (the root first), every size measured up to the largest tree.

    Args:
        node_arrays: one ``traces.reader.NodeArrays`` or any iterable of them (duck-typed:
            ``offsets`` int[T+1], ``expert_ids`` int[R, L, K], ``path_logprob`` float[R]);
            their trees are pooled in order.
        num_experts: experts per layer ``E``.
        tree_probs: None for draft path probabilities; or one float[N_i] per pooled tree to rank
            its nodes by instead (e.g. calibrated acceptance, ``analysis.figures.union_growth``).

    Returns:
        float64[L, M+1] (M = the largest tree's node count; column 0 is 0).

    Raises:
        ValueError: no dense trees, an item that is not NodeArrays, or ``tree_probs`` not of one
            array per tree with one probability per node.
    """
    runs = [node_arrays] if hasattr(node_arrays, "offsets") else list(node_arrays)
    trees, logprobs = [], []
    for i, na in enumerate(runs):
        if not all(hasattr(na, name) for name in ("offsets", "expert_ids", "path_logprob")):
            raise ValueError(
                f"union_size_from_node_arrays: item {i} is a {type(na).__name__}, expected NodeArrays "
                "(offsets, expert_ids, path_logprob)"
            )
        offsets = np.asarray(na.offsets, dtype=np.int64)
        for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            trees.append(na.expert_ids[lo:hi])
            logprobs.append(na.path_logprob[lo:hi])
    if not trees:
        raise ValueError("union_size_from_node_arrays: no dense trees")
    if tree_probs is None:
        probs = [np.exp(lp) for lp in logprobs]
    else:
        probs = [np.asarray(p) for p in tree_probs]
        if len(probs) != len(trees):
            raise ValueError(
                f"union_size_from_node_arrays: {len(probs)} probability arrays for {len(trees)} trees"
            )
        short = [i for i, (p, t) in enumerate(zip(probs, trees)) if p.shape != (t.shape[0],)]
        if short:
            raise ValueError(
                f"union_size_from_node_arrays: tree_probs[{short[0]}] has shape {probs[short[0]].shape}, "
                f"expected ({trees[short[0]].shape[0]},), one probability per node"
            )
    return union_size_from_trees(trees, probs, num_experts, max(t.shape[0] for t in trees))


_PREDICTORS: dict[str, Any] = {
    "oracle": OraclePredictor,
    "recent": RecentPredictor,
    "token-table": TokenTablePredictor,
    "union-size": UnionSizePredictor,
    "head-router": HeadRouterPredictor,
}


def make_predictor(name: str, **tables: Any) -> Predictor:
    """Build a predictor by name (one of :data:`ALL_PREDICTORS`); ``tables`` go to its constructor.

    ``oracle``: none; ``recent``: ``window``; ``token-table``: ``table``, ``fallback_window``;
    ``union-size``: ``union_size``, ``miss_fraction``.

    Raises:
        ValueError: unknown name (lists the valid ones) or bad/missing arguments.
    """
    if name not in _PREDICTORS:
        raise ValueError(f"unknown expert predictor {name!r}; expected one of {list(ALL_PREDICTORS)}")
    try:
        return _PREDICTORS[name](**tables)
    except TypeError as exc:
        raise ValueError(f"expert predictor {name!r}: bad arguments {sorted(tables)}: {exc}") from None


def _overlap_counts(pred: NodeExperts, truth: np.ndarray) -> tuple[float, float, float]:
    """``(|pred & truth|, |truth|, |pred|)`` summed over nodes and layers (counts for union-size)."""
    truth = np.asarray(truth, dtype=np.uint64)
    if pred.is_union_size:
        true_union = bitsets.popcount(bitsets.union(truth, axis=0)).astype(np.float64)
        pred_union = pred.expected_union(truth.shape[0])
        if pred_union.shape != true_union.shape:
            raise ValueError(f"truth: {true_union.shape[0]} layers, prediction has {pred_union.shape[0]}")
        return (
            float(np.minimum(pred_union, true_union).sum()),
            float(true_union.sum()),
            float(pred_union.sum()),
        )
    if pred.bits.shape != truth.shape:
        raise ValueError(f"truth: expected shape {list(pred.bits.shape)}, got {list(truth.shape)}")
    inter = bitsets.popcount(bitsets.intersection(pred.bits, truth)).sum()
    return float(inter), float(bitsets.popcount(truth).sum()), float(bitsets.popcount(pred.bits).sum())


def _score(inter: float, total_true: float, total_pred: float) -> PredictorScore:
    recall = inter / total_true if total_true else float("nan")
    precision = inter / total_pred if total_pred else float("nan")
    return PredictorScore(recall=float(recall), precision=float(precision))


def predictor_recall_precision(pred: NodeExperts, truth: np.ndarray) -> PredictorScore:
    """Recall = |pred & truth| / |truth|, precision = |pred & truth| / |pred| over all nodes and layers.

    For a union-size prediction (no sets) both compare COUNTS of the tree's distinct experts per
    layer: recall = sum min(pred, true) / sum true, precision = sum min(pred, true) / sum pred.
    NaN where the denominator is 0.

    Args:
        pred: the prediction for one tree.
        truth: uint64[N, L, W] true experts of the same tree.

    Raises:
        ValueError: shapes disagree.
    """
    return _score(*_overlap_counts(pred, truth))


def score_predictor(
    predictor: Predictor, cases: Iterable[tuple[PredictContext, np.ndarray]]
) -> PredictorScore:
    """Micro-averaged recall / precision of ``predictor`` over a dense trace's trees.

    Args:
        predictor: any predictor (the oracle reads ``ctx.true_experts``).
        cases: pairs ``(PredictContext, truth uint64[N, L, W])``, one per tree.

    Raises:
        ValueError: shapes disagree (from :func:`predictor_recall_precision`).
    """
    inter = total_true = total_pred = 0.0
    for ctx, truth in cases:
        i, t, p = _overlap_counts(predictor.predict(ctx), truth)
        inter, total_true, total_pred = inter + i, total_true + t, total_pred + p
    return _score(inter, total_true, total_pred)
