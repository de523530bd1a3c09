"""benchmarks/drafters.py and head_router.py: per-depth acceptance conditions on the depth each cycle
reached; the CLI contract; the expert count read from the model config."""

from __future__ import annotations

import json
import math

import pytest
from bench_loader import load_benchmark
from test_traces_helpers import small_cycle, small_manifest

from traces.writer import TraceWriter


def test_category_figures_condition_on_the_reached_depth(tmp_path):
    """A SpecFit-like run whose paths end at verified leaves: alpha_d = accepted(d) / reached(d),
    not what counting every cycle as reaching every drafted depth gives."""
    drafters = load_benchmark("drafters")
    run_dir = tmp_path / "run"
    # (num_accepted, reached_depth) per cycle: request 0 "math", request 1 "qa"
    cycles = {0: [(2, 2), (1, 2), (0, 1)], 1: [(1, 1), (0, 0)]}
    with TraceWriter(run_dir, small_manifest()) as writer:
        for rid, rows in cycles.items():
            generated: list[int] = []
            for i, (acc, reached) in enumerate(rows):
                tokens = list(range(10 + len(generated), 11 + len(generated) + acc))
                writer.add_cycle(
                    small_cycle(
                        rid, i, position=len(generated), context_len=4 + len(generated), num_accepted=acc,
                        num_committed=acc + 1, committed_token_ids=tokens, reached_depth=reached,
                    )
                )  # fmt: skip
                generated += tokens
            writer.add_request(rid, [1, 2, 3, 4], generated, "t", category=["math", "qa"][rid])
    figures = drafters.category_figures(run_dir, depth=3)
    assert set(figures) == {"math", "qa", "all"}
    # all: depth 1 reached by 4 cycles (not the root-only one), accepted by 3; depth 2 reached by
    # the 2 of those 3 whose accepted node had a verified child, accepted by 1; depth 3 never.
    alphas = figures["all"]["accept_depth"]
    assert alphas[:2] == [3 / 4, 1 / 2] and math.isnan(alphas[2])
    assert figures["qa"]["accept_depth"][0] == 1.0 and math.isnan(figures["qa"]["accept_depth"][1])
    assert figures["all"]["cycles"] == 5 and figures["all"]["cycles_reach_bounded"] == 0
    assert figures["all"]["tau"] == (3 + 2 + 1 + 2 + 1) / 5
    # every cycle reaching every drafted depth (the former formula) would say 3/5 and 1/3
    accepted = [a for rows in cycles.values() for a, _ in rows]
    former = [sum(a >= d for a in accepted) / sum(a >= d - 1 for a in accepted) for d in (1, 2)]
    assert former == [3 / 5, 1 / 3]


@pytest.mark.parametrize(
    ("stem", "argv", "named"),
    [
        ("drafters", ["--policies", "full,bogus"], "--policy"),
        ("drafters", ["--prompts", "{tmp}/absent.jsonl"], "--prompts"),
        ("drafters", ["--per-category", "0"], "--per-category"),
        ("drafters", ["--head", "{tmp}"], "--head"),
        ("drafters", ["--threads", "-1"], "--threads"),
        ("drafters", ["--save", "{tmp}/no/such/folder/x.json", "--prompts", "{tmp}/p.jsonl"], "--save"),
        ("drafters", ["--categories", "nosuch", "--prompts", "{tmp}/p.jsonl"], "--category"),
        ("head_router", ["--num-prompts", "0"], "--num-prompts"),
        ("head_router", ["--prompts", "{tmp}/absent.jsonl"], "--prompts"),
        ("head_router", ["--head", "{tmp}"], "--head"),
        ("head_router", ["--threads", "x"], "--threads"),
    ],
)
def test_benchmark_bad_flags_exit_2_with_one_line_and_the_json_line(stem, argv, named, tmp_path, capsys):
    """The CLI contract (specfit.cli): exit 2 before any decoding, one stderr line naming the flag,
    stdout ending with the JSON line; nothing written."""
    (tmp_path / "p.jsonl").write_text('{"question_id": 1, "category": "qa", "turns": ["w5 w6"]}\n')
    before = sorted(tmp_path.rglob("*"))
    main = load_benchmark(stem).main
    with pytest.raises(SystemExit) as exc:
        main([a.format(tmp=tmp_path) for a in argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and named in err and "Traceback" not in err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["exit_code"] == 2 and last["ok"] is False and named in last["error"]
    assert sorted(tmp_path.rglob("*")) == before


def test_head_router_reads_the_expert_count_from_the_model_config(monkeypatch, capsys):
    from live.loader import experts_per_layer

    head_router = load_benchmark("head_router")
    seen = {}
    monkeypatch.setattr(head_router, "collect_cases", lambda *a: ["case"])
    monkeypatch.setattr(head_router, "score_all", lambda cases, n: seen.setdefault("n", n) and {})
    assert head_router.main(["--num-prompts", "1", "--threads", "1"]) == 0
    assert seen["n"] == experts_per_layer("default") and seen["n"] is not None
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_experts"] == seen["n"]


def test_drafters_skips_naming_the_expected_default_prompt_file(monkeypatch, tmp_path, capsys):
    """Without ``--prompts``, a shared folder without the expected ``spec_bench.jsonl`` (absent or
    another file: a stale folder named shared) is a skip that names the file, exit 0."""
    from live.prompts import shared_prompt_file

    drafters = load_benchmark("drafters")
    stale = tmp_path / "shared" / "data" / "prompts" / "spec_bench.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"question_id": 1, "category": "qa", "turns": ["old"]}\n')
    monkeypatch.setattr(drafters, "shared_prompt_file", lambda name: shared_prompt_file(name, tmp_path / "shared"))
    assert drafters.main([]) == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert "spec_bench.jsonl: not the expected file" in last["skipped"] and "skipped" in out.splitlines()[0]
