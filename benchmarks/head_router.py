"""Recall and precision of the head-router expert predictor beside the existing ones (embedded default).

Decodes ``--prompts`` (default: the embedded default's prompts) greedily in dense mode with the
embedded EAGLE-3 head (``live/assets/default/eagle3``): every cycle the whole drafted tree is
verified, so the target's true top-k experts of every node are known. For each tree the
predictors of :mod:`specfit.predictors` are scored with :func:`specfit.predictors.score_predictor`
(micro-averaged over nodes and layers):

- ``head-router``: each node's head state (``Eagle3Drafter.node_states``) routed by the target's
  own routers (``live.eagle3_draft.HeadRouter``);
- ``recent``: the union of the last 4 committed tokens' experts (the same for every node);
- ``token-table``: per token id the experts it was routed to most often, fitted IN-SAMPLE on the
  same trees (an optimistic upper bound for that predictor);
- ``oracle``: the truth (1.0 / 1.0, a check);
- two variants of the head-router input: the head state plus the node token's embedding, and
  the token embedding alone (the target's routers applied to it: no head involved).

Usage::

    python benchmarks/head_router.py --num-prompts 8 --max-new-tokens 24

The last stdout line is a JSON object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import _root  # benchmarks/ is first on sys.path when a script runs by its path
import numpy as np

_root.put_root_first()

from benchmarks._threads import add_threads_flag, apply_threads  # noqa: E402
from specfit.cli import ArgumentParser, cli_main, positive_int, print_summary  # noqa: E402


def collect_cases(
    num_prompts: int, max_new_tokens: int, prompts: str = "default", head_dir: Path | None = None
) -> list[dict]:
    """Per dense cycle: tree, true expert ids [N, L, K], head-routed ids [N, L, K], recent ids [m, L, K]."""
    import torch
    from transformers import AutoTokenizer

    from live.assets import DEFAULT_DIR, default_model_paths
    from live.eagle3 import load_head
    from live.eagle3_draft import Eagle3Drafter, HeadRouter, features_for
    from live.loader import load_target
    from live.prompts import load_prompts
    from live.spec.draft import TreeShape
    from live.spec.engine import FullTreeChooser, SpecDecoder
    from live.spec.verify import TreeVerifier

    target_dir, _ = default_model_paths()
    target = load_target(target_dir, experts_on_device=True)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    head = load_head(head_dir or DEFAULT_DIR / "eagle3", target)
    features = features_for(head, target)
    drafter = Eagle3Drafter(head, features)
    verifier = TreeVerifier(target, eos_token_ids=[tokenizer.eos_token_id], features=features)
    router = HeadRouter(target)
    cases: list[dict] = []
    pending: dict = {}

    class Spy(FullTreeChooser):
        def choose(self, state):
            choice = super().choose(state)
            states = drafter.node_states()
            emb = target.get_input_embeddings()(torch.as_tensor(choice.draft.tree.token_ids))
            pending.update(
                tree=choice.draft.tree,
                head=None if states is None else router.route(states),
                head_emb=None if states is None else router.route(states + emb),
                emb=router.route(emb),
                recent=np.asarray(state.recent_experts),
            )
            return choice

    def on_cycle(event) -> None:
        if pending.get("head") is not None:
            cases.append({**pending, "truth": np.asarray(event.verification.expert_ids)})

    chooser = Spy(drafter, TreeShape(6, 4, 32))
    with torch.inference_mode():
        for prompt in load_prompts(prompts)[:num_prompts]:
            ids = tokenizer.encode(prompt.text)[-512:]
            SpecDecoder(verifier, drafter).generate(
                ids, max_new_tokens, chooser, dense=True, on_cycle=on_cycle
            )
    return cases


def score_all(cases: Sequence[dict], num_experts: int, window: int = 4) -> dict[str, dict[str, float]]:
    """``{predictor: {"recall", "precision"}}`` over ``cases`` (see module docstring)."""
    from specfit import bitsets
    from specfit.predictors import PredictContext, make_predictor, score_predictor, token_table_from_routing

    tokens = np.concatenate([c["tree"].token_ids for c in cases])
    table = token_table_from_routing(tokens, np.concatenate([c["truth"] for c in cases]), num_experts)
    contexts, variants = [], {}
    for c in cases:
        num_layers = c["truth"].shape[1]
        recent = bitsets.pack(c["recent"], num_experts) if len(c["recent"]) else None
        ctx = PredictContext(
            tree=c["tree"],
            num_experts=num_experts,
            num_layers=num_layers,
            recent_experts=recent,
            true_experts=bitsets.pack(c["truth"], num_experts),
            head_experts=bitsets.pack(c["head"], num_experts),
        )
        contexts.append((ctx, ctx.true_experts))
        for variant in ("head_emb", "emb"):
            variants.setdefault(variant, []).append(
                (
                    dataclasses.replace(ctx, head_experts=bitsets.pack(c[variant], num_experts)),
                    ctx.true_experts,
                )
            )
    predictors = {
        "oracle": make_predictor("oracle"),
        "head-router": make_predictor("head-router"),
        "recent": make_predictor("recent", window=window),
        "token-table (in-sample)": make_predictor("token-table", table=table, fallback_window=window),
    }
    scores = {name: score_predictor(p, contexts)._asdict() for name, p in predictors.items()}
    head = make_predictor("head-router")
    scores["head-router (state + token embedding)"] = score_predictor(head, variants["head_emb"])._asdict()
    scores["target routers on the token embedding"] = score_predictor(head, variants["emb"])._asdict()
    return scores


def build_parser() -> ArgumentParser:
    """The flags (``--help`` lists units and defaults)."""
    p = ArgumentParser(prog="python benchmarks/head_router.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=positive_int, default=8, help="prompts (count)")
    p.add_argument("--max-new-tokens", type=positive_int, default=24, help="tokens per prompt (count)")
    p.add_argument("--prompts", default="default", help="prompt set (as live.record --prompts)")
    p.add_argument("--head", type=Path, default=None, help="EAGLE-3 head folder (default: the embedded one)")
    add_threads_flag(p)
    return p


def _check_args(parser: ArgumentParser, args) -> int:
    """Check the flags before any model load (exit 2 naming the flag); return the embedded
    target's routed experts per layer, read from its ``config.json``."""
    from live.eagle3 import is_eagle3_checkpoint
    from live.loader import experts_per_layer
    from live.prompts import load_prompts

    if args.head is not None and not is_eagle3_checkpoint(args.head):
        parser.fail(
            "--head", f"{args.head}: expected an EAGLE-3 head folder (config.json with draft_vocab_size)"
        )
    try:
        load_prompts(args.prompts)
    except (OSError, ValueError) as exc:
        parser.fail("--prompts", str(exc))
    num_experts = experts_per_layer("default")
    if num_experts is None:
        parser.fail("live/assets/default", "the embedded target's config.json states no expert count")
    return num_experts


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Decode, score and print the table; returns 0 (``SystemExit(2)`` on a bad flag, see ``specfit.cli``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    num_experts = _check_args(parser, args)
    apply_threads(args.threads)
    cases = collect_cases(args.num_prompts, args.max_new_tokens, args.prompts, args.head)
    scores = score_all(cases, num_experts)
    print(f"{'predictor':<26} {'recall':>7} {'precision':>9}   ({len(cases)} dense trees)")
    for name, s in scores.items():
        print(f"{name:<26} {s['recall']:>7.3f} {s['precision']:>9.3f}")
    print_summary({"trees": len(cases), "num_experts": num_experts, "scores": scores})
    return 0


if __name__ == "__main__":
    from specfit.cli import run_main

    run_main(main)
