"""Real prompt sets: the MT-bench question.jsonl layout, --category, the shared Spec-Bench / EAGLE
files (read from ../shared, skipped where absent), categories in the trace, and prompts cut to the
model's max_position_embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from live.prompts import (
    SHARED_PROMPT_FILES,
    Prompt,
    SharedDataError,
    UnknownCategoryError,
    filter_categories,
    fit_prompts_to_positions,
    load_prompts,
    parse_categories,
    prompt_budget,
    prompt_categories,
    shared_prompt_file,
)

ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["w5 w6 w7", "w8 w9"]},
    {"question_id": 82, "category": "math", "turns": ["w10 w11"], "reference": ["w12"]},
    {"question_id": 83, "category": "writing", "turns": ["w13 w14 w15 w16"]},
    {"question_id": 84, "category": "summarization", "turns": ["w20 w21 w22"]},
]


def _mtbench_file(folder: Path, rows=ROWS) -> Path:
    path = folder / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_mtbench_layout_first_turn_and_category(tmp_path):
    path = _mtbench_file(tmp_path)
    got = load_prompts(str(path))
    assert [p.text for p in got] == ["w5 w6 w7", "w10 w11", "w13 w14 w15 w16", "w20 w21 w22"]
    assert [p.category for p in got] == ["writing", "math", "writing", "summarization"]
    assert got[0].source == f"file:{path}:1"
    assert prompt_categories(got) == {"writing": 2, "math": 1, "summarization": 1}


def test_category_filter_keeps_file_order(tmp_path):
    path = str(_mtbench_file(tmp_path))
    got = load_prompts(path, ("summarization", "writing"))
    assert [p.source.rsplit(":", 1)[1] for p in got] == ["1", "3", "4"]
    assert load_prompts(path, None) == load_prompts(path, ())  # no filter
    with pytest.raises(
        UnknownCategoryError,
        match=r"unknown category poetry.*available: math \(1\), summarization \(1\), writing \(2\)",
    ):
        load_prompts(path, ("writing", "poetry"))


def test_category_filter_on_a_set_without_categories():
    with pytest.raises(UnknownCategoryError, match="carry no categories"):
        filter_categories([Prompt("a", "x")], ["math"], "default")
    assert all(p.category is None for p in load_prompts("default"))


def test_parse_categories():
    assert parse_categories(None) is None and parse_categories(" ") is None
    assert parse_categories("math, writing,math") == ("math", "writing")
    with pytest.raises(ValueError, match="empty names"):
        parse_categories("math,,writing")


def test_bad_category_field_names_the_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"turns": ["x"], "category": 3}) + "\n")
    with pytest.raises(ValueError, match=r"q.jsonl:1: 'category' must be a non-empty string"):
        load_prompts(str(path))


@pytest.mark.parametrize(
    ("name", "rows", "categories"),
    [
        (
            "spec_bench.jsonl",
            480,
            {
                "translation": 80,
                "summarization": 80,
                "qa": 80,
                "math_reasoning": 80,
                "rag": 80,
                "writing": 10,
            },
        ),
        ("eagle_cnndm.jsonl", 80, {"summarization": 80}),
        ("eagle_gsm8k.jsonl", 80, {"math": 80}),
    ],
)
def test_shared_prompt_sets_load(name, rows, categories):
    try:
        path = shared_prompt_file(name)
    except SharedDataError as exc:  # absent, or a stale / unrelated folder named shared
        pytest.skip(str(exc))
    prompts = load_prompts(str(path))
    assert len(prompts) == rows
    counts = prompt_categories(prompts)
    assert {k: counts[k] for k in categories} == categories
    first_turns = [
        json.loads(line)["turns"][0].strip() for line in path.read_text().splitlines() if line.strip()
    ]
    assert [p.text for p in prompts] == first_turns
    some = next(iter(categories))
    assert len(load_prompts(str(path), (some,))) == categories[some]


def test_shared_prompt_file_names_an_absent_or_unexpected_file(tmp_path, monkeypatch):
    """A folder named shared is read only where it holds the expected file (SHA-256); otherwise
    the error names the file and says what was expected (tests skip with it)."""
    import hashlib

    folder = tmp_path / "shared"
    with pytest.raises(SharedDataError, match=r"spec_bench\.jsonl: absent .*data/prompts/spec_bench\.jsonl"):
        shared_prompt_file("spec_bench.jsonl", folder)
    path = folder / "data" / "prompts" / "spec_bench.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["old"]}\n')
    with pytest.raises(SharedDataError, match=r"not the expected file .*stale or unrelated folder named 'shared'"):
        shared_prompt_file("spec_bench.jsonl", folder)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setitem(SHARED_PROMPT_FILES, "spec_bench.jsonl", digest)
    assert shared_prompt_file("spec_bench.jsonl", folder) == path
    with pytest.raises(KeyError):
        shared_prompt_file("unknown.jsonl", folder)


def test_prompt_budget_and_left_truncation():
    assert prompt_budget(100, 10, 3) == 87
    with pytest.raises(ValueError, match="--max-new-tokens <= 96"):
        prompt_budget(100, 97, 3)
    warnings: list[str] = []
    prompts = [list(range(5)), list(range(200)), list(range(90))]
    got = fit_prompts_to_positions(prompts, 10, 3, 100, warn=warnings.append)
    assert got[0] == list(range(5))
    assert got[1] == list(range(200))[-87:] and got[2] == list(range(90))[-87:]
    assert len(warnings) == 1  # once, for every cut prompt together
    assert "--max-new-tokens 10" in warnings[0] and "2 of 3 prompts" in warnings[0]
    assert "max_position_embeddings 100" in warnings[0] and "truncated from the left" in warnings[0]
    assert fit_prompts_to_positions(prompts, 10, 3, None, warn=warnings.append) == prompts
    assert fit_prompts_to_positions(prompts[:1], 10, 3, 100, warn=warnings.append) == prompts[:1]
    assert len(warnings) == 1  # nothing cut: no warning


# ---------------------------------------------------------------- live.record (tiny checkpoints)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, request):
    pytest.importorskip("torch")
    target, draft = (
        request.getfixturevalue("tiny_checkpoint")("qwen3_moe"),
        request.getfixturevalue("tiny_draft"),
    )
    root = tmp_path_factory.mktemp("prompt_sets")
    long_prompt = " ".join(f"w{4 + i % 90}" for i in range(300))  # 300 tokens > 256 positions
    rows = [*ROWS, {"question_id": 90, "category": "long", "turns": [long_prompt]}]
    return {"target": str(target), "draft": str(draft), "prompts": str(_mtbench_file(root, rows))}


def _record(tiny, out, *extra):
    from live.record import main

    return main(
        [
            "--model", tiny["target"], "--draft", tiny["draft"], "--prompts", tiny["prompts"],
            "--max-new-tokens", "4", "--depth", "2", "--topk", "2", "--max-nodes", "4",
            "--out", str(out), "--no-progress", *extra,
        ]
    )  # fmt: skip


def test_record_unknown_category_exits_2_listing_the_available_ones(tiny, tmp_path, capsys):
    out = tmp_path / "bad"
    with pytest.raises(SystemExit) as exc:
        _record(tiny, out, "--category", "writing,poetry")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--category" in err and "poetry" in err
    assert "available: long (1), math (1), summarization (1), writing (2)" in err
    assert not out.exists()
    with pytest.raises(SystemExit) as exc:
        _record(tiny, out, "--category", "math", "--prompts", "default")
    assert exc.value.code == 2 and "carry no categories" in capsys.readouterr().err


def test_record_filters_by_category_and_records_it(tiny, tmp_path, capsys):
    from traces.reader import open_run

    out = tmp_path / "run"
    assert _record(tiny, out, "--category", "summarization,writing") == 0
    err = capsys.readouterr().err
    assert "max_position_embeddings" not in err  # short prompts: no warning
    assert "live.record dense" not in err  # --no-progress: no progress bar
    requests = open_run(out).requests.sort_values("request_id")
    assert requests["category"].tolist() == ["writing", "writing", "summarization"]
    assert json.loads((out / "summary.json").read_text())["config"]["category"] == "summarization,writing"


def test_record_truncates_a_prompt_past_max_positions_with_one_warning(tiny, tmp_path, capsys):
    from traces.reader import open_run

    out = tmp_path / "long"
    assert _record(tiny, out, "--category", "long,math") == 0
    err = capsys.readouterr().err
    assert err.count("max_position_embeddings 256") == 1 and "--max-new-tokens 4" in err
    requests = open_run(out).requests.set_index("category")
    assert len(requests.loc["long", "prompt_token_ids"]) == 256 - 4 - 2  # kept its last 250 tokens
    assert len(requests.loc["math", "prompt_token_ids"]) == 2
    with pytest.raises(SystemExit) as exc:
        _record(tiny, tmp_path / "none", "--max-new-tokens", "255")
    assert exc.value.code == 2 and "--max-new-tokens" in capsys.readouterr().err


def test_report_groups_runs_by_prompt_category(tiny, tmp_path, capsys):
    from analysis.inputs import collect
    from analysis.report import main as report_main

    dense, policy = tmp_path / "dense", tmp_path / "policy"
    assert _record(tiny, dense, "--category", "writing,math") == 0
    assert _record(tiny, policy, "--category", "writing,math", "--mode", "policy", "--policy", "ar") == 0
    table = collect([dense, policy]).categories.set_index(["run", "category"])
    assert sorted(table.index) == [
        ("dense", "math"),
        ("dense", "writing"),
        ("policy", "math"),
        ("policy", "writing"),
    ]
    assert (
        table.loc[("dense", "writing"), "num_requests"] == 2
        and table.loc[("policy", "math"), "num_requests"] == 1
    )
    assert table.loc[("dense", "writing"), "num_cycles"] == 2 * 4  # one tree per generated token
    assert table.loc[("policy", "writing"), "tau"] == 1.0  # ar commits one token per cycle
    assert table.loc[("policy", "math"), "tokens_per_s"] > 0 and pd.isna(
        table.loc[("dense", "math"), "tokens_per_s"]
    )
    capsys.readouterr()
    assert report_main([str(dense), str(policy), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "## Prompt categories" in text and "| policy | policy | writing | 2 |" in text


def test_validate_checks_category_before_any_work(tmp_path, capsys):
    from analysis.validate import main as validate_main

    prompts = _mtbench_file(tmp_path)
    out = tmp_path / "val"
    with pytest.raises(SystemExit) as exc:
        validate_main(["--prompts", str(prompts), "--category", "poetry", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--category" in err and "available: math (1)" in err
    assert not out.exists()
