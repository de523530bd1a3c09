"""Synthetic dense traces at any model shape (no GPU, no model): for planner and simulator work.

Model of the data (all vectorised numpy; one seed fixes everything):

- Tokens: random prompt and greedy output ids in ``0..vocab_size-1``.
- Routing: per layer, expert popularity follows a Zipf law ``p(e) ~ 1 / rank(e)^routing_skew``
  over a random ranking. A token's router logits are ``log p + z`` with a latent ``z`` that is
  an AR(1) process along the sequence, ``z_t = rho z_(t-1) + sqrt(1 - rho^2) eps_t`` with
  ``rho = expert_locality`` (0: independent tokens; towards 1: consecutive tokens share experts).
  Top-k of the logits are the experts; router weights are the softmax over all experts
  renormalised over the top-k (Mixtral / Qwen3 ``norm_topk_prob``).
- Trees (EAGLE-2 style, Li et al. 2024): the root expands into ``tree_topk`` children; at each
  further level the ``tree_topk`` best nodes of the previous level (by path log-prob) expand into
  ``tree_topk`` children each; draft child probabilities are sorted Dirichlet draws; finally
  the best ``max_nodes - 1`` nodes by path log-prob are kept (ancestor-closed, because path
  probabilities never increase along a path) and numbered breadth-first.
- Acceptance: for every expanded node, with probability ``acceptance`` one child carries the
  target's greedy token after that node, chosen with probability proportional to its draft
  probability; all other tokens are random. So per-depth conditional acceptance is about
  ``acceptance`` times the chance the matching child survived pruning.
- Draft calibration: the stored draft probabilities are the Dirichlet draw times
  ``draft_confidence`` in (0, 1] (same ranking; smaller = less confident draft; 1 = as drawn).
- Calibrated presets: :mod:`traces.synthcal` holds per-model parameters fitted to public figures
  (docs/reference-figures.md) and the statistics that check them.
- Consistency with a real dense trace: a node on the accepted path at depth ``d`` of the tree at
  ``position`` carries generated token ``position + d - 1`` and routes exactly like that token
  in the sequence; every other node routes with locality ``rho`` to its parent's latent.

Each request gets ``positions_per_request`` trees (positions ``0..P-1``) and
``P + tree_depth`` generated tokens, so every accepted path has its committed token.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.signal import lfilter

from specfit.cli import (
    ArgumentParser,
    cli_main,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    print_summary,
    run_main,
)
from specfit.shapes import MODEL_SHAPES, ModelShape, get_model_shape
from traces.schema import DraftSpec, HardwareSpec, Manifest, ModelSpec, RunConfig
from traces.writer import TraceWriter

NODE_BATCH = 1024  # nodes routed per numpy batch (bounds memory: batch x L x E float32)


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of :func:`generate_dense_trace` (see the module docstring for the model).

    Raises:
        ValueError: a parameter out of range, naming it.
    """

    num_requests: int = 4
    positions_per_request: int = 64
    prompt_len: int = 32
    tree_depth: int = 6
    tree_topk: int = 4
    max_nodes: int = 32
    routing_skew: float = 1.0
    expert_locality: float = 0.5
    acceptance: float = 0.7
    draft_concentration: float = 0.5
    vocab_size: int = 32000
    seed: int = 0
    draft_confidence: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_requests", "positions_per_request", "prompt_len", "tree_depth", "tree_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}: expected an integer > 0, got {value!r}")
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes: expected >= 1, got {self.max_nodes!r}")
        if not self.vocab_size >= 2 * self.tree_topk + 2:
            raise ValueError(f"vocab_size: expected >= 2 * tree_topk + 2, got {self.vocab_size!r}")
        if not (math.isfinite(self.routing_skew) and self.routing_skew >= 0):
            raise ValueError(f"routing_skew: expected a number >= 0, got {self.routing_skew!r}")
        if not 0 <= self.expert_locality < 1:
            raise ValueError(f"expert_locality: expected 0 <= value < 1, got {self.expert_locality!r}")
        if not 0 <= self.acceptance <= 1:
            raise ValueError(f"acceptance: expected 0 <= value <= 1, got {self.acceptance!r}")
        if not self.draft_concentration > 0:
            raise ValueError(f"draft_concentration: expected > 0, got {self.draft_concentration!r}")
        if not 0 < self.draft_confidence <= 1:
            raise ValueError(f"draft_confidence: expected 0 < value <= 1, got {self.draft_confidence!r}")


@dataclass(frozen=True)
class _Trees:
    """Trees of one request, flat: tree i owns rows offsets[i]:offsets[i+1] (BFS numbered)."""

    offsets: np.ndarray
    parent: np.ndarray  # local parent id, -1 at roots
    depth: np.ndarray
    draft_logprob: np.ndarray
    path_logprob: np.ndarray
    match: np.ndarray  # bool: the node carries its parent's target token


def _grow_trees(cfg: SyntheticConfig, num_trees: int, rng: np.random.Generator) -> _Trees:
    """Candidate trees for ``num_trees`` positions, pruned to ``max_nodes``, vectorised over trees."""
    k = cfg.tree_topk
    # candidate arrays [num_trees, C]; candidate 0 is the root
    parent = [np.full((num_trees, 1), -1)]
    depth = [np.zeros((num_trees, 1), dtype=np.int64)]
    draft = [np.zeros((num_trees, 1))]
    path = [np.zeros((num_trees, 1))]
    match = [np.ones((num_trees, 1), dtype=bool)]
    level_ids = np.zeros((num_trees, 1), dtype=np.int64)  # candidate ids of the previous level
    count = 1
    for level in range(1, cfg.tree_depth + 1):
        all_path = np.concatenate(path, axis=1)
        if level > 1 and level_ids.shape[1] > k:  # expand the k best of the previous level
            best = np.argsort(-np.take_along_axis(all_path, level_ids, axis=1), axis=1, kind="stable")[:, :k]
            level_ids = np.take_along_axis(level_ids, best, axis=1)
        num_parents = level_ids.shape[1]
        q = np.sort(
            rng.dirichlet(np.full(k + 1, cfg.draft_concentration), size=(num_trees, num_parents)), axis=2
        )
        q = np.clip(q[:, :, ::-1], 1e-12, 1.0)  # descending; the last share = all other tokens
        chosen = rng.random((num_trees, num_parents)) < cfg.acceptance
        cdf = np.cumsum(q[:, :, :k] / q[:, :, :k].sum(axis=2, keepdims=True), axis=2)
        # the draft's stored probabilities: scaled by draft_confidence (< 1: mass left to other tokens)
        q = cfg.draft_confidence * q[:, :, :k]
        which = (rng.random((num_trees, num_parents, 1)) > cdf).sum(axis=2)
        child_match = chosen[:, :, None] & (np.arange(k) == np.minimum(which, k - 1)[:, :, None])
        parents = np.repeat(level_ids, k, axis=1)
        parent.append(parents)
        depth.append(np.full(parents.shape, level, dtype=np.int64))
        lp = np.log(q).reshape(num_trees, -1)
        draft.append(lp)
        path.append(np.take_along_axis(all_path, parents, axis=1) + lp)
        match.append(child_match.reshape(num_trees, -1))
        level_ids = count + np.arange(num_parents * k)[None, :].repeat(num_trees, axis=0)
        count += num_parents * k
    parent_c, depth_c, draft_c, path_c, match_c = (
        np.concatenate(a, axis=1) for a in (parent, depth, draft, path, match)
    )
    keep_n = min(cfg.max_nodes, count)
    # best keep_n by path log-prob (root first; ties: shallower, then earlier) -> ancestor-closed
    order = np.lexsort((np.arange(count)[None, :].repeat(num_trees, 0), depth_c, -path_c), axis=1)[:, :keep_n]
    # breadth-first numbering: sort the kept candidates by (depth, candidate id)
    kept = np.sort(order, axis=1)
    kept = np.take_along_axis(
        kept, np.argsort(np.take_along_axis(depth_c, kept, 1), axis=1, kind="stable"), 1
    )
    new_id = np.full((num_trees, count), -1, dtype=np.int64)
    np.put_along_axis(new_id, kept, np.arange(keep_n)[None, :].repeat(num_trees, 0), axis=1)
    old_parent = np.take_along_axis(parent_c, kept, 1)
    local_parent = np.where(old_parent >= 0, np.take_along_axis(new_id, np.maximum(old_parent, 0), 1), -1)
    if (local_parent[:, 1:] < 0).any():  # pruning must keep parents (path log-probs never increase)
        raise AssertionError("synthetic tree pruning broke ancestor closure")
    offsets = np.arange(num_trees + 1, dtype=np.int64) * keep_n
    depth_k = np.take_along_axis(depth_c, kept, 1)
    draft_k = np.take_along_axis(draft_c, kept, 1)
    draft_k[:, 0] = 0.0
    path_k = np.zeros_like(draft_k)
    for level in range(1, cfg.tree_depth + 1):  # recompute path sums in the stored precision
        at = depth_k == level
        parent_path = np.take_along_axis(path_k, np.maximum(local_parent, 0), 1)
        path_k = np.where(at, parent_path + draft_k, path_k)
    return _Trees(
        offsets=offsets,
        parent=local_parent.reshape(-1),
        depth=depth_k.reshape(-1),
        draft_logprob=draft_k.reshape(-1),
        path_logprob=path_k.reshape(-1),
        match=np.take_along_axis(match_c, kept, 1).reshape(-1),
    )


def _route(log_pop: np.ndarray, latent: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts and renormalised softmax weights of logits ``log_pop[L, E] + latent[n, L, E]``.

    ``latent`` is overwritten (it becomes the logits).
    """
    logits = latent
    logits += log_pop[None]  # in place: the caller's latent is scratch
    top = np.argpartition(logits, -top_k, axis=-1)[..., -top_k:]
    top_logits = np.take_along_axis(logits, top, axis=-1)
    order = np.argsort(-top_logits, axis=-1, kind="stable")
    top = np.take_along_axis(top, order, axis=-1)
    top_logits = np.take_along_axis(top_logits, order, axis=-1)
    weights = np.exp(top_logits - top_logits[..., :1])
    return top.astype(np.int16), (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)


def _random_tokens(rng: np.random.Generator, avoid: np.ndarray, vocab: int) -> np.ndarray:
    """Random token ids, each different from ``avoid`` (same shape)."""
    tokens = rng.integers(0, vocab - 1, size=avoid.shape)
    return tokens + (tokens >= avoid)


def _request(
    writer: TraceWriter,
    request_id: int,
    cfg: SyntheticConfig,
    shape: ModelShape,
    log_pop: np.ndarray,
    rng: np.random.Generator,
) -> int:
    """Generate and write one request; return its number of nodes."""
    num_positions, depth = cfg.positions_per_request, cfg.tree_depth
    num_generated = num_positions + depth
    seq_len = cfg.prompt_len + num_generated
    sequence = rng.integers(0, cfg.vocab_size, size=seq_len)
    rho = cfg.expert_locality
    shape_le = (shape.num_layers, shape.num_experts)
    eps = rng.standard_normal((seq_len, *shape_le), dtype=np.float32)
    eps[0] /= math.sqrt(1 - rho * rho)
    seq_latent = lfilter([math.sqrt(1 - rho * rho)], [1.0, -rho], eps, axis=0).astype(np.float32)
    ids, weights = _route(log_pop, seq_latent[: cfg.prompt_len].copy(), shape.top_k)
    writer.add_prefill(request_id, ids, weights)

    trees = _grow_trees(cfg, num_positions, rng)
    n_per_tree = int(trees.offsets[1])
    total = num_positions * n_per_tree
    position = np.repeat(np.arange(num_positions), n_per_tree)
    start = np.repeat(trees.offsets[:-1], n_per_tree)
    parent_row = np.where(trees.parent >= 0, start + trees.parent, np.arange(total))
    is_root = trees.parent < 0
    # tokens, targets and path acceptance, level by level (parents precede children)
    on_path = is_root.copy()
    token = np.where(is_root, sequence[cfg.prompt_len + position - 1], 0)
    seq_index = np.where(is_root, cfg.prompt_len + position - 1, -1)  # sequence token the node equals
    target = np.where(is_root, sequence[cfg.prompt_len + position], 0)
    for level in range(1, depth + 1):
        at = trees.depth == level
        parent_target = target[parent_row]
        token = np.where(
            at,
            np.where(trees.match, parent_target, _random_tokens(rng, parent_target, cfg.vocab_size)),
            token,
        )
        on_path = np.where(at, on_path[parent_row] & trees.match, on_path)
        seq_index = np.where(at & on_path, cfg.prompt_len + position + level - 1, seq_index)
        next_true = sequence[np.minimum(cfg.prompt_len + position + level, seq_len - 1)]
        target = np.where(
            at, np.where(on_path, next_true, _random_tokens(rng, next_true, cfg.vocab_size)), target
        )
    accepted = is_root | (token == target[parent_row])

    # routing: on-path nodes copy the sequence latent; others follow their parent's latent
    expert_ids = np.empty((total, shape.num_layers, shape.top_k), dtype=np.int16)
    router_weights = np.empty((total, shape.num_layers, shape.top_k), dtype=np.float32)
    step = max(1, NODE_BATCH // n_per_tree) * n_per_tree
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        latent = np.empty((hi - lo, *shape_le), dtype=np.float32)
        local_parent = parent_row[lo:hi] - lo
        for level in range(depth + 1):
            rows = np.flatnonzero(trees.depth[lo:hi] == level)
            if rows.size == 0:
                continue
            copy = seq_index[lo:hi][rows] >= 0
            latent[rows[copy]] = seq_latent[seq_index[lo:hi][rows[copy]]]
            free = rows[~copy]
            if free.size:
                noise = rng.standard_normal((free.size, *shape_le), dtype=np.float32)
                noise *= math.sqrt(1 - rho * rho)
                noise += rho * latent[local_parent[free]]
                latent[free] = noise
        expert_ids[lo:hi], router_weights[lo:hi] = _route(log_pop, latent, shape.top_k)

    writer.add_node_rows(
        request_id=np.full(total, request_id),
        position=position,
        context_len=cfg.prompt_len + position,
        node_id=np.arange(total) - start,
        parent=trees.parent,
        depth=trees.depth,
        token_id=token,
        draft_logprob=trees.draft_logprob,
        path_logprob=trees.path_logprob,
        target_token=target,
        accepted=accepted,
        expert_ids=expert_ids,
        router_weights=router_weights,
    )
    writer.add_request(
        request_id,
        sequence[: cfg.prompt_len],
        sequence[cfg.prompt_len :],
        f"synthetic:seed={cfg.seed}:request={request_id}",
    )
    return total


def synthetic_manifest(
    shape: ModelShape, cfg: SyntheticConfig, command_line: Sequence[str] | None = None
) -> Manifest:
    """The manifest of a synthetic dense trace (hardware ``synthetic``, no transfers)."""
    return Manifest.create(
        model=ModelSpec.from_shape(shape, architecture="synthetic"),
        hardware=HardwareSpec(device_name="synthetic", link_kind="synthetic", h2d_memory="none"),
        draft=DraftSpec(
            model="synthetic", tree_depth=cfg.tree_depth, tree_topk=cfg.tree_topk, max_nodes=cfg.max_nodes
        ),
        run=RunConfig(mode="dense", prompt_source="synthetic"),
        seed=cfg.seed,
        command_line=command_line,
        config={"generator": "traces.synthetic", **asdict(cfg)},
    )


def generate_dense_trace(
    out_dir: str | Path,
    shape: ModelShape | str,
    *,
    num_requests: int = 4,
    positions_per_request: int = 64,
    prompt_len: int = 32,
    tree_depth: int = 6,
    tree_topk: int = 4,
    max_nodes: int = 32,
    routing_skew: float = 1.0,
    expert_locality: float = 0.5,
    acceptance: float = 0.7,
    seed: int = 0,
    draft_concentration: float = 0.5,
    vocab_size: int = 32000,
    draft_confidence: float = 1.0,
    progress: bool = False,
    command_line: Sequence[str] | None = None,
    writer_kwargs: dict[str, Any] | None = None,
) -> Path:
    """Write a valid synthetic dense trace to ``out_dir`` and return the path.

    Args:
        out_dir: new (or empty) run directory.
        shape: a ``ModelShape`` or a preset name (``"qwen3-30b-a3b"``, ``"mixtral-8x7b"``, ...).
        num_requests, positions_per_request, prompt_len: requests, trees per request, prompt tokens.
        tree_depth, tree_topk, max_nodes: maximal draft tree (levels, children per expanded node,
            nodes including the root).
        routing_skew: Zipf exponent of per-layer expert popularity (0 = uniform).
        expert_locality: AR(1) correlation of router logits between consecutive tokens, in [0, 1).
        acceptance: probability that an expanded node has a child with the target's token.
        seed: seed of the numpy Generator (same seed, same files apart from the manifest time).
        draft_concentration: Dirichlet concentration of draft child probabilities (small = peaky).
        vocab_size: token id range.
        draft_confidence: factor in (0, 1] on the stored draft probabilities (1 = as drawn).
        progress: show a tqdm bar over requests.
        command_line: recorded in the manifest (default ``sys.argv``).
        writer_kwargs: extra :class:`~traces.writer.TraceWriter` arguments.

    Raises:
        ValueError: bad parameter (naming it) or unknown shape name (listing the presets).
        FileExistsError: ``out_dir`` is not empty.
    """
    if isinstance(shape, str):
        shape = get_model_shape(shape)
    cfg = SyntheticConfig(
        num_requests=num_requests,
        positions_per_request=positions_per_request,
        prompt_len=prompt_len,
        tree_depth=tree_depth,
        tree_topk=tree_topk,
        max_nodes=max_nodes,
        routing_skew=float(routing_skew),
        expert_locality=float(expert_locality),
        acceptance=float(acceptance),
        draft_concentration=float(draft_concentration),
        vocab_size=vocab_size,
        seed=seed,
        draft_confidence=float(draft_confidence),
    )
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((shape.num_layers, shape.num_experts)), axis=1)
    log_pop = (-cfg.routing_skew * np.log1p(ranks)).astype(np.float32)
    out_dir = Path(out_dir)
    requests = range(cfg.num_requests)
    if progress:
        from tqdm import tqdm

        requests = tqdm(requests, desc="synthetic requests", unit="req")
    with TraceWriter(
        out_dir, synthetic_manifest(shape, cfg, command_line), **(writer_kwargs or {})
    ) as writer:
        for request_id in requests:
            _request(writer, request_id, cfg, shape, log_pop, rng)
    return out_dir


def _fraction(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        import argparse

        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


_FLAGS = {"positions_per_request": "--positions", "tree_depth": "--depth", "tree_topk": "--topk"}
_CALIBRATED = (
    "tree_depth",
    "tree_topk",
    "max_nodes",
    "routing_skew",
    "expert_locality",
    "acceptance",
    "draft_concentration",
    "draft_confidence",
)


def resolve_config(shape: str, calibrated: bool = True, **given: Any) -> SyntheticConfig:
    """The generation parameters of ``shape``: ``SyntheticConfig`` defaults, then the shape's
    calibration (:data:`traces.synthcal.CALIBRATIONS`, when ``calibrated`` and the shape has one),
    then ``given`` (values ``None`` are ignored).

    Raises:
        ValueError: a bad parameter, naming it.
    """
    from traces.synthcal import get_calibration

    fields = asdict(SyntheticConfig())
    calibration = get_calibration(shape) if calibrated else None
    if calibration is not None:
        fields.update(calibration.params)
    fields.update({k: v for k, v in given.items() if v is not None})
    return SyntheticConfig(**fields)


def build_parser() -> ArgumentParser:
    """The flags of ``python -m traces.synthetic``."""
    parser = ArgumentParser(
        prog="python -m traces.synthetic",
        description="Write a synthetic dense trace at a real model shape (see traces/synthetic.py for the "
        "routing, tree and acceptance model) with the parameters calibrated to public figures of that "
        "model (traces/synthcal.py; flags given override them), and print the trace's figures beside "
        "their targets (figure | target | generated | source). The last stdout line is a JSON summary.",
    )
    parser.add_argument(
        "--model-shape",
        "--shape",
        dest="shape",
        default="qwen3-30b-a3b",
        help=f"model shape preset, one of {sorted(MODEL_SHAPES)}",
    )
    parser.add_argument("--out", default="runs/synth", help="output run directory (must be new or empty)")
    parser.add_argument("--num-requests", type=positive_int, default=argparse.SUPPRESS, help="requests (count) (default: 4)")
    parser.add_argument("--positions", type=positive_int, default=argparse.SUPPRESS, help="trees per request (default: 64)")
    parser.add_argument("--prompt-len", type=positive_int, default=argparse.SUPPRESS, help="prompt length (tokens) (default: 32)")
    cal = "(default: the shape's calibration, traces/synthcal.py; else the generator's default)"
    parser.add_argument(
        "--depth", "--tree-depth", dest="tree_depth", type=positive_int, default=argparse.SUPPRESS,
        help=f"draft depth (levels); {cal}",
    )  # fmt: skip
    parser.add_argument(
        "--topk", "--tree-topk", dest="tree_topk", type=positive_int, default=argparse.SUPPRESS,
        help=f"children per expanded node; {cal}",
    )  # fmt: skip
    parser.add_argument("--max-nodes", type=positive_int, default=argparse.SUPPRESS, help=f"nodes per tree incl. root; {cal}")
    parser.add_argument(
        "--routing-skew", type=non_negative_float, default=argparse.SUPPRESS, help=f"Zipf exponent (0 = uniform); {cal}"
    )
    parser.add_argument(
        "--expert-locality", type=_fraction, default=argparse.SUPPRESS, help=f"AR(1) logit correlation, [0, 1); {cal}"
    )
    parser.add_argument("--acceptance", type=_fraction, default=argparse.SUPPRESS, help=f"P(a child matches), [0, 1]; {cal}")
    parser.add_argument(
        "--draft-concentration",
        type=positive_float,
        default=argparse.SUPPRESS,
        help=f"Dirichlet concentration of draft child probabilities (small = confident draft); {cal}",
    )
    parser.add_argument(
        "--draft-confidence",
        type=positive_float,
        default=argparse.SUPPRESS,
        help=f"factor in (0, 1] on the stored draft probabilities; {cal}",
    )
    parser.add_argument("--vocab-size", type=positive_int, default=argparse.SUPPRESS, help="token ids (default: 32000)")
    parser.add_argument("--seed", type=non_negative_int, default=argparse.SUPPRESS, help="random seed (default: 0)")
    parser.add_argument(
        "--uncalibrated", action="store_true", help="ignore the shape's calibration (generator defaults)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.later_spellings("--model-shape", "--depth", "--topk")  # README "Flag spellings": old abbreviations keep their flag
    return parser


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m traces.synthetic``: write a synthetic dense trace, print its calibration table;
    the last line is a JSON summary."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shape = get_model_shape(args.shape)
    except ValueError as exc:
        parser.fail("--model-shape", str(exc))
    if getattr(args, "expert_locality", None) is not None and args.expert_locality >= 1:
        parser.fail("--expert-locality", f"expected a number in [0, 1), got {args.expert_locality}")
    given = {f: getattr(args, f, None) for f in SyntheticConfig.__dataclass_fields__}
    given["positions_per_request"] = getattr(args, "positions", None)
    try:
        cfg = resolve_config(shape.name, not args.uncalibrated, **given)
    except ValueError as exc:
        name = str(exc).split(":")[0]
        parser.fail(_FLAGS.get(name, "--" + name.replace("_", "-")), str(exc))
    out = parser.ensure_out_dir("--out", args.out)
    if any(out.iterdir()):
        parser.fail("--out", f"{out} is not empty; choose a new directory")
    try:
        generate_dense_trace(
            out,
            shape,
            **asdict(cfg),
            progress=not args.no_progress,
            command_line=["python", "-m", "traces.synthetic", *(argv if argv is not None else sys.argv[1:])],
        )
    except ValueError as exc:
        parser.error(str(exc))
    from traces.reader import open_run
    from traces.synthcal import figure_rows, format_figure_table, get_calibration, trace_figures

    run = open_run(out, validate=False)
    num_nodes = run.num_rows("nodes")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: {cfg.num_requests} requests, {num_nodes} nodes, {size} bytes")
    calibration = None if args.uncalibrated else get_calibration(shape.name)
    rows = []
    if calibration is not None:
        overridden = sorted(k for k in _CALIBRATED if given.get(k) is not None)
        rows = figure_rows(calibration, trace_figures(run))
        print(f"calibration of {shape.name} (sources: docs/reference-figures.md)"
              + (f"; overridden by flags: {', '.join(overridden)}" if overridden else ""))
        print(format_figure_table(rows))
    print_summary(
        {
            "out": str(out),
            "shape": shape.name,
            "num_requests": cfg.num_requests,
            "num_trees": cfg.num_requests * cfg.positions_per_request,
            "num_nodes": num_nodes,
            "bytes_on_disk": size,
            "calibrated": calibration is not None,
            "figures_out_of_tolerance": [r["figure"] for r in rows if not r["ok"]],
        }
    )
    return 0


if __name__ == "__main__":
    run_main(main)
