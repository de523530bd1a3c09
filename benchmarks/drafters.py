"""Both drafter kinds on the embedded default, per prompt category: tau, per-depth acceptance, tokens/s.

For each drafter (the 2-layer causal-LM draft ``live/assets/default/draft`` and the EAGLE-3 head
``live/assets/default/eagle3``) and each policy (``full``: the whole drafted tree verified, so
acceptance measures the drafter alone; ``specfit``: ``live.record``'s default policy), one
``python -m live.record --mode policy`` run decodes ``--per-category`` prompts of every category
of a real prompt set (default ``../shared/data/prompts/spec_bench.jsonl``, read with
:func:`live.prompts.load_prompts`, the MT-bench ``question.jsonl`` layout) at the default link
(plain copy, a quarter of the experts cached). From each run's trace, per category:

- ``tau``: committed tokens per cycle, bonus included;
- ``accept_depth``: alpha_d = accepted(d) / reached(d), d = 1..depth (docs/metrics.md): a cycle
  reached depth d when its accepted path got to d - 1 and its verified subtree held a child of the
  path's last node (the ``cycles`` column ``reached_depth``), so ``specfit`` rows, whose subtrees
  stop short of the drafted tree, are conditioned on what was verified; ``full`` rows measure
  the drafter alone;
- ``tokens_per_s``: committed tokens / summed cycle seconds (draft + decision + verify + H2D).

Usage::

    python benchmarks/drafters.py                           # 7 Spec-Bench categories, 2 prompts each
    python benchmarks/drafters.py --prompts ../shared/data/prompts/eagle_gsm8k.jsonl --per-category 4

Timings on a shared, loaded CPU are noisy; compare the drafters within one invocation. Skips
cleanly (exit 0, ``"skipped"`` in the JSON line) when the prompt file is absent. The last stdout
line is a JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import _root  # benchmarks/ is first on sys.path when a script runs by its path
import numpy as np

_root.put_root_first()

from benchmarks._threads import add_threads_flag  # noqa: E402
from live.prompts import SHARED_DIR, SharedDataError, shared_prompt_file  # noqa: E402
from specfit.cli import ArgumentParser, cli_main, comma_list, positive_int, print_summary  # noqa: E402

DEFAULT_PROMPTS = SHARED_DIR / "data" / "prompts" / "spec_bench.jsonl"
DEFAULT_CATEGORIES = "writing,coding,math_reasoning,summarization,translation,qa,rag"


def depth_figures(cycles, depth: int) -> tuple[list[float], int]:
    """alpha_d = accepted(d) / reached(d) for d = 1..depth (NaN where no cycle reached d) of a
    ``cycles`` table (pandas), and how many cycles had no recorded ``reached_depth`` (their reach
    is bounded, ``traces.stats.cycle_reached_depths``)."""
    from analysis.metrics import per_depth_acceptance
    from traces.stats import cycle_reached_depths

    reached, bounded = cycle_reached_depths(cycles)
    alphas = per_depth_acceptance(cycles["num_accepted"].to_numpy(), reached)[:depth].tolist()
    return alphas + [float("nan")] * (depth - len(alphas)), bounded


def category_figures(run_dir: Path, depth: int) -> dict[str, dict[str, object]]:
    """Per category of a recorded run (and ``"all"``): tau, accept_depth, tokens_per_s, cycles."""
    from traces.reader import open_run

    run = open_run(run_dir)
    requests = run.requests
    cats = requests.set_index("request_id")["category"] if "category" in requests else None
    cycles = run.cycles.copy()
    cycles["category"] = cycles["request_id"].map(cats) if cats is not None else "all"
    out = {}
    groups = [*cycles.groupby("category", sort=False), ("all", cycles)]
    for cat, group in groups:
        alphas, bounded = depth_figures(group, depth)
        out[str(cat)] = {
            "tau": float(group["num_committed"].mean()),
            "accept_depth": alphas,
            "tokens_per_s": float(group["num_committed"].sum() / group["cycle_s"].sum()),
            "cycles": len(group),
            "cycles_reach_bounded": bounded,
        }
    return out


def _prompt_file(prompts: dict[str, list], per_category: int, folder: Path) -> Path:
    """A question.jsonl with the first ``per_category`` prompts of each category (``{category: prompts}``)."""
    rows = []
    for cat, items in prompts.items():
        for i, p in enumerate(items[:per_category]):
            rows.append({"question_id": f"{cat}-{i}", "category": cat, "turns": [p.text]})
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _finite(obj):
    """NaN -> None, recursively (strict JSON)."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _save(path: Path, results: dict, args, argv: Sequence[str] | None) -> None:
    """Write the figures (and re-render the default model card when saved beside the head)."""
    import os

    from live.assets import DEFAULT_DIR

    flags = " ".join(sys.argv[1:] if argv is None else argv)
    data = {
        "command": f"python benchmarks/drafters.py {flags}".strip(),
        "note": f"shared 2-core CPU under load from other jobs (load average {os.getloadavg()[0]:.1f}); "
        "timings are noisy, compare the drafters within one invocation",
        "depth": args.depth,
        "results": results,
    }
    path.write_text(json.dumps(_finite(data), indent=2, sort_keys=True) + "\n")
    if (
        path.resolve().parent == (DEFAULT_DIR / "eagle3").resolve()
        and (DEFAULT_DIR / "metrics.json").is_file()
    ):
        from live.train_default import write_model_card

        write_model_card(DEFAULT_DIR, json.loads((DEFAULT_DIR / "metrics.json").read_text()))


def build_parser() -> ArgumentParser:
    """The flags (``--help`` lists units and defaults)."""
    from live.spec.names import LIVE_POLICIES

    p = ArgumentParser(prog="python benchmarks/drafters.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help=f"MT-bench layout .jsonl with categories (default: {DEFAULT_PROMPTS}, skipped when absent or "
        "not the expected file)",
    )
    p.add_argument(
        "--category", "--categories", dest="categories", type=comma_list(str), default=DEFAULT_CATEGORIES,
        help="categories",
    )  # fmt: skip
    p.add_argument("--per-category", type=positive_int, default=2, help="prompts per category (count)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens per prompt (count)")
    p.add_argument(
        "--policy",
        "--policies",
        dest="policies",
        type=comma_list(str),
        default="full,specfit",
        help="live.record policies to run: " + ", ".join(LIVE_POLICIES),
    )
    p.add_argument("--depth", type=positive_int, default=6, help="maximum draft depth (levels)")
    p.add_argument("--head", type=Path, default=None, help="EAGLE-3 head folder (default: the embedded one)")
    add_threads_flag(p)
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument(
        "--save",
        type=Path,
        default=None,
        help="write the figures as JSON here; into live/assets/default/eagle3/drafters.json it also "
        "re-renders the embedded default's MODEL_CARD.md",
    )
    p.later_spellings("--category", "--policy")  # README "Flag spellings": old abbreviations keep their flag
    return p


def _check_flags(parser: ArgumentParser, args) -> None:
    """Check the flags that need no prompt file (exit 2 naming the flag), before the skip for an
    absent default prompt file, so a bad flag is said also where ``../shared`` is absent."""
    from live.eagle3 import is_eagle3_checkpoint
    from live.spec.names import LIVE_POLICIES

    unknown = [x for x in args.policies if x not in LIVE_POLICIES]
    if unknown:
        parser.fail(
            "--policy", f"unknown policy {unknown[0]!r}; expected some of {', '.join(LIVE_POLICIES)}"
        )
    if args.head is not None and not is_eagle3_checkpoint(args.head):
        parser.fail(
            "--head", f"{args.head}: expected an EAGLE-3 head folder (config.json with draft_vocab_size)"
        )
    if args.save is not None and not args.save.parent.is_dir():
        parser.fail("--save", f"folder {str(args.save.parent)!r} does not exist")


def _check_args(parser: ArgumentParser, args) -> dict[str, list]:
    """Check the prompt file and ``--out`` before any decoding (exit 2 naming the flag); return
    ``{category: prompts}``."""
    from live.prompts import UnknownCategoryError, load_prompts

    try:
        prompts = {cat: load_prompts(str(args.prompts), [cat]) for cat in args.categories}
    except UnknownCategoryError as exc:  # the message lists the file's categories
        parser.fail("--category", str(exc))
    except (OSError, ValueError) as exc:  # missing, empty or malformed file
        parser.fail("--prompts", str(exc))
    if args.out is not None:
        parser.ensure_out_dir("--out", args.out)
    return prompts


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; returns 0 (also when skipped), 1 when a ``live.record`` run failed.

    Raises:
        SystemExit(2): a bad flag or prompt file (one line naming it, then the JSON line).
    """
    from live.assets import DEFAULT_DIR
    from live.record import main as record_main

    parser = build_parser()
    args = parser.parse_args(argv)
    _check_flags(parser, args)
    if args.prompts is None:
        try:
            args.prompts = shared_prompt_file(DEFAULT_PROMPTS.name)
        except SharedDataError as exc:  # absent, or another/stale folder named shared
            print(f"{exc}; skipped")
            print_summary({"skipped": str(exc)})
            return 0
    prompts = _check_args(parser, args)
    drafters = {"causal-lm": DEFAULT_DIR / "draft", "eagle3": args.head or DEFAULT_DIR / "eagle3"}
    num_prompts = sum(min(len(v), args.per_category) for v in prompts.values())
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    results: dict[str, dict[str, dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        prompt_file = _prompt_file(prompts, args.per_category, root)
        for kind, folder in drafters.items():
            if not (folder / "config.json").is_file():
                print(f"{kind}: {folder} absent; skipped")
                continue
            for policy in args.policies:
                out = root / f"{kind}-{policy}"
                argv_run = [
                    "--draft", str(folder), "--prompts", str(prompt_file), "--num-prompts", str(num_prompts),
                    "--max-new-tokens", str(args.max_new_tokens), "--mode", "policy", "--policy", policy,
                    "--depth", str(args.depth), *threads, "--out", str(out), "--no-progress",
                ]  # fmt: skip
                code = record_main(argv_run)
                if code != 0:
                    print_summary({"ok": False, "error": f"live.record exited {code} for {kind} {policy}"})
                    return 1
                results[f"{kind}/{policy}"] = category_figures(out, args.depth)
    print()
    print(
        f"{'drafter/policy':<20} {'category':<15} {'tau':>6} {'tok/s':>7}  accept by depth d=1..{args.depth}"
    )
    for key, cats in results.items():
        for cat, fig in cats.items():
            alphas = " ".join("  -  " if np.isnan(a) else f"{a:.2f}" for a in fig["accept_depth"])
            print(f"{key:<20} {cat:<15} {fig['tau']:>6.2f} {fig['tokens_per_s']:>7.2f}  {alphas}")
    summary: dict[str, object] = {"prompts": str(args.prompts), "per_category": args.per_category}
    for key, cats in results.items():
        summary[f"{key}/tokens_per_s"] = cats["all"]["tokens_per_s"]
        summary[f"{key}/tau"] = cats["all"]["tau"]
    summary["results"] = results
    if args.save is not None:
        _save(args.save, results, args, argv)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    from specfit.cli import run_main

    run_main(main)
