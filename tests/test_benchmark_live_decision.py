"""benchmarks/live_decision.py runs end to end: the replayed cycles make the live run's decisions."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_benchmark


def test_replay_makes_the_live_decisions(capsys):
    pytest.importorskip("live.assets")
    bench = load_benchmark("live_decision")
    assert bench.main(["--num-prompts", "1", "--max-new-tokens", "10", "--repeats", "1", "--cold-gap-ms", "0.2", "--cold-calls", "3"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_cycles"] >= 1 and summary["predictor"] == "union-size"
    assert summary["same_decisions"] is True  # both replays time the decisions the live run made
    assert summary["cold_gap_ms"] == 0.2  # the --cold-gap-ms value echoed in the JSON line, not a timing
    assert summary["questions_per_cycle"] >= 1.0
    for key in (
        "live_decision_s_per_cycle",
        "replay_decision_cpu_s_per_cycle",
        "replay_decision_s_per_cycle",
        "cold_replay_decision_s_per_cycle",
        "cold_replay_decision_cpu_s_per_cycle",
        "cold_empty_call_s",  # the cold call split: the default predictor has compiled questions
        "cold_ask_s",
    ):
        assert summary[key] >= 0.0


def test_fixed_cost_asks_the_same_questions_in_every_run(capsys):
    """``--cost fixed``: the planner's cost model is the benchmark's constant one, not a quick
    estimate timed per run, so two runs make the same decisions (the same digest of questions and
    subtrees); the JSON line says which cost model ran and gives the per-question figure."""
    pytest.importorskip("live.assets")
    bench = load_benchmark("live_decision")
    argv = ["--num-prompts", "1", "--max-new-tokens", "10", "--repeats", "1", "--cold-gap-ms", "0", "--cost", "fixed"]
    summaries = []
    for _ in range(2):
        assert bench.main(argv) == 0
        summaries.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    first, second = summaries
    assert first["cost"] == "fixed" and "FIXED_COST" in first["cost_source"]
    assert first["decisions_sha256"] == second["decisions_sha256"]
    assert first["same_decisions"] and second["same_decisions"]
    n = first["num_cycles"] * first["questions_per_cycle"]
    assert first["live_decision_s_per_question"] == pytest.approx(first["live_decision_s_per_cycle"] * first["num_cycles"] / n)


def test_fixed_cost_reads_the_model_off_the_embedded_default(monkeypatch, capsys):
    """``--cost fixed``'s layers and expert bytes are the embedded default's (its config.json, at
    live.record's default dtype), not numbers written in the benchmark: another default shape moves
    them, and a config that does not state them fails with one line naming ``--cost``."""
    pytest.importorskip("live.assets")
    import live.loader
    from live.record import build_parser

    bench = load_benchmark("live_decision")
    shipped = bench.fixed_cost_model()
    assert (shipped.num_layers, shipped.expert_bytes) == (live.loader.moe_layer_count("default"), 98304)
    assert build_parser().get_default("dtype") == "float32"  # 98,304 = 3 x 128 x 64 x 4 bytes
    shape = {"num_hidden_layers": 4, "num_local_experts": 8, "hidden_size": 256, "moe_intermediate_size": 32}
    monkeypatch.setattr(live.loader, "checkpoint_config", lambda model: dict(shape))
    other = bench.fixed_cost_model()
    assert (other.num_layers, other.expert_bytes) == (4, 3 * 256 * 32 * 4)
    assert other.verify_base_s == shipped.verify_base_s  # the fixed terms stay
    monkeypatch.setattr(live.loader, "checkpoint_config", lambda model: {})
    with pytest.raises(SystemExit) as exc:
        bench.main(["--cost", "fixed", "--num-prompts", "1"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--cost" in line and "embedded default" in line


def test_decisions_digest_sees_each_question_and_decision():
    """The digest changes with the levels or size of an asked tree and with the chosen nodes."""
    import numpy as np

    from specfit.tree import DraftTree

    bench = load_benchmark("live_decision")
    small = DraftTree.from_parents(np.arange(2), [-1, 0], np.log([1.0, 0.5]))
    large = DraftTree.from_parents(np.arange(3), [-1, 0, 0], np.log([1.0, 0.5, 0.4]))
    base = [{"trees": [(small, 1)], "nodes": [0, 1]}]
    digest = bench.decisions_digest(base)
    assert digest == bench.decisions_digest([{"trees": [(small, 1)], "nodes": [0, 1]}])
    assert digest != bench.decisions_digest([{"trees": [(small, 2)], "nodes": [0, 1]}])
    assert digest != bench.decisions_digest([{"trees": [(large, 1)], "nodes": [0, 1]}])
    assert digest != bench.decisions_digest([{"trees": [(small, 1)], "nodes": [0]}])


def test_bad_flags_exit_2(tmp_path, capsys):
    bench = load_benchmark("live_decision")
    with pytest.raises(SystemExit) as err:
        bench.main(["--repeats", "0"])
    assert err.value.code == 2
    with pytest.raises(SystemExit) as err:
        bench.main(["--cold-gap-ms", "-1"])
    assert err.value.code == 2
    with pytest.raises(SystemExit) as err:
        bench.main(["--cold-calls", "0"])
    assert err.value.code == 2
    with pytest.raises(SystemExit) as err:
        bench.main(["--cost", "/nonexistent/cost.json"])
    assert err.value.code == 2
    bad = tmp_path / "cost.json"
    bad.write_text("{not json")
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:  # rev3: the line named live.record, not this benchmark
        bench.main(["--cost", str(bad)])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("python benchmarks/live_decision.py: error:") and "--cost" in line and str(bad) in line


def test_cold_calls_skip_the_unchecked_entry_point_for_other_types():
    """The empty-call timing calls the compiled entry point UNCHECKED: when the questions are not
    typed for it (``UnionSizeQuestions._typed`` false) or the tree's arrays have other dtypes,
    ``cold_calls`` returns None instead of handing it arrays it would misread (review M4)."""
    from types import SimpleNamespace

    import numpy as np

    from specfit.tree import DraftTree

    bench = load_benchmark("live_decision")

    class Chooser:
        policy = SimpleNamespace(root_alpha=0.5)
        drafter = None

        def __init__(self, typed):
            self._questions = SimpleNamespace(_typed=typed)

        def choose(self, state):
            return None

    tree = DraftTree.from_parents(np.arange(3), [-1, 0, 1], np.log([1.0, 0.5, 0.5]))
    cycles = [{"trees": [(tree, 2)], "state": None}]
    assert bench.cold_calls(Chooser(False), cycles, 1e-5, 1) is None
    narrow = SimpleNamespace(parents=tree.parents.astype(np.int32), draft_logprobs=tree.draft_logprobs)
    assert bench.cold_calls(Chooser(True), [{"trees": [(narrow, 2)], "state": None}], 1e-5, 1) is None
