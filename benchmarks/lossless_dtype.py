"""How lossless is tree verification in each dtype? Speculative vs causal greedy decoding.

Greedy speculative decoding commits, in exact arithmetic, the tokens of plain causal greedy
decoding. In float32 it does so here token for token (tests/test_live_spec_verify.py). In
bfloat16/float16 the tree forward (many nodes, a tree mask) and the causal one-token forward round
differently, so where the two best logits are within rounding of each other the greedy token can
differ, and the continuation diverges from there. This measures how often, on the embedded
default model (or ``--model``), as ``live.record`` runs it (offloaded target, LRU expert cache,
the embedded draft, the default tree shape):

- reference: causal decoding (``ar`` policy: one token per verification, the root alone);
- speculative: the full draft tree verified every cycle (``full``), the most nodes per forward.

Per (dtype, verify logits) it prints the prompts whose outputs differ, the tokens generated before
the first difference, and the share of all tokens up to the first difference. ``--verify-logits
float32`` (:func:`live.spec.runner.float32_output_head`) keeps the model in the low precision but
computes the final logits in float32, for both decodings. Usage::

    python benchmarks/lossless_dtype.py                      # 24 default prompts x 48 tokens
    python benchmarks/lossless_dtype.py --num-prompts 8 --max-new-tokens 32 --dtype bfloat16
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import _root  # benchmarks/ is first on sys.path when a script runs by its path

_root.put_root_first()

from benchmarks._threads import add_threads_flag, apply_threads  # noqa: E402
from specfit.cli import ArgumentParser, cli_main, positive_int, print_summary, run_main  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")


def _dtypes(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in DTYPES]
    if not names or bad:
        raise ValueError(f"expected a comma-separated subset of {', '.join(DTYPES)}, got {text!r}")
    return names


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python benchmarks/lossless_dtype.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="target checkpoint dir, or 'default' (embedded)")
    p.add_argument("--draft", default=None, help="draft checkpoint dir (default: the embedded draft)")
    p.add_argument("--num-prompts", type=positive_int, default=24, help="default prompts used (count)")
    p.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens per prompt")
    p.add_argument(
        "--dtype", "--dtypes", dest="dtypes", default="bfloat16,float16,float32", help="comma-separated weight dtypes"
    )
    p.add_argument(
        "--depth", type=positive_int, default=None, help="draft tree depth (default: live.record's)"
    )
    p.add_argument(
        "--topk", type=positive_int, default=None, help="children per node (default: live.record's)"
    )
    p.add_argument("--max-nodes", type=positive_int, default=None, help="tree size (default: live.record's)")
    add_threads_flag(p)
    p.later_spellings("--dtype")  # README "Flag spellings": old abbreviations keep their flag
    return p


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_pair(target_dir, draft_dir, dtype: str, float32_logits: bool, prompts, max_new_tokens, shape):
    """(causal outputs, speculative outputs, tau of the speculative run) per prompt, one dtype."""
    from live.loader import load_draft, load_target
    from live.offload import make_link, offload_model
    from live.spec.draft import ModelDrafter
    from live.spec.engine import AutoregressiveChooser, FullTreeChooser, SpecDecoder
    from live.spec.verify import TreeVerifier

    target = load_target(target_dir, "cpu", dtype)
    offload = offload_model(target, cache_experts=None, link=make_link("cpu"))  # live.record's default cache
    verifier = TreeVerifier(target, float32_logits=float32_logits)
    drafter = ModelDrafter(load_draft(draft_dir, "cpu", dtype))
    causal, spec, committed, cycles = [], [], 0, 0
    for ids in prompts:
        ar = SpecDecoder(verifier, None, stats=offload).generate(ids, max_new_tokens, AutoregressiveChooser())
        full = SpecDecoder(verifier, drafter, stats=offload).generate(
            ids, max_new_tokens, FullTreeChooser(drafter, shape)
        )
        causal.append(list(ar.generated_ids))
        spec.append(list(full.generated_ids))
        committed += sum(len(c.committed) for c in full.cycles)
        cycles += len(full.cycles)
    return causal, spec, committed / max(cycles, 1)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        dtypes = _dtypes(args.dtypes)
    except ValueError as exc:
        parser.fail("--dtype", str(exc))
    import torch
    from tqdm import tqdm

    from live.prompts import default_prompts
    from live.record import build_parser
    from live.spec.draft import TreeShape
    from live.spec.session import _load_tokenizer

    record = build_parser()  # unset flags take live.record's defaults, so the figures match a run
    for name in ("depth", "topk", "max_nodes"):
        if getattr(args, name) is None:
            setattr(args, name, int(record.get_default(name)))
    apply_threads(args.threads)
    if args.model == "default":
        from live.assets import default_model_paths

        target_dir, draft_dir = default_model_paths()
    else:
        target_dir, draft_dir = Path(args.model), Path(args.draft) if args.draft else None
        if draft_dir is None:
            parser.fail("--draft", "a draft checkpoint is needed with --model")
    tokenizer = _load_tokenizer(Path(target_dir), Path(draft_dir))
    prompts = [list(tokenizer.encode(p.text)) for p in default_prompts(args.num_prompts)]
    shape = TreeShape(args.depth, args.topk, args.max_nodes)
    combos = [(d, f) for d in dtypes for f in ((False, True) if d != "float32" else (False,))]
    results = {}
    for dtype, f32 in tqdm(combos, desc="dtype x logits", file=sys.stderr):
        causal, spec, tau = decode_pair(
            target_dir, draft_dir, dtype, f32, prompts, args.max_new_tokens, shape
        )
        firsts = [first_difference(a, b) for a, b in zip(causal, spec)]
        diverged = [i for i in firsts if i is not None]
        total = sum(len(a) for a in causal)
        agreeing = sum(len(a) if i is None else i for a, i in zip(causal, firsts))
        results[f"{dtype}/{'float32' if f32 else 'model'}-logits"] = {
            "dtype": dtype,
            "verify_logits": "float32" if f32 else "model",
            "prompts": len(prompts),
            "prompts_diverged": len(diverged),
            "tokens_before_first_difference": diverged,
            "token_agreement": agreeing / max(total, 1),
            "tau": tau,
        }
    print(
        f"speculative (full tree {shape.depth}/{shape.topk}/{shape.max_nodes}) vs causal greedy decoding, "
        f"{len(prompts)} default prompts x {args.max_new_tokens} tokens (measured)"
    )
    print(
        f"{'dtype':>9} {'logits':>8} {'diverged':>9} {'agreement':>10} {'tau':>5}  first difference at token"
    )
    for r in results.values():
        print(
            f"{r['dtype']:>9} {r['verify_logits']:>8} {r['prompts_diverged']:>4} / {r['prompts']:<3}"
            f"{100 * r['token_agreement']:>9.1f}% {r['tau']:>5.2f}  {r['tokens_before_first_difference']}"
        )
    print_summary(
        {"benchmark": "lossless_dtype", "torch_threads": torch.get_num_threads(), "results": results}
    )
    return 0


if __name__ == "__main__":
    run_main(main)
