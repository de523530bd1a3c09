"""`python -m live.record`: flags, bad values, dense and policy runs, resume (tiny random checkpoints)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch
from live_fixtures import TINY_VOCAB_SIZE, replay_test_cost

from live.record import main

pytest.importorskip("traces.writer")
from traces.reader import open_run  # noqa: E402

PROMPT_LINES = ["w5 w9 w33 w12", "w7", "w40 w41 w42 w43 w44 w45 w46 w47 w48"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny shapes run fastest single-threaded; avoids thread oversubscription on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, tiny_draft, tmp_path_factory):
    """The session's tiny target and draft (with tokenizers), a prompt file and a folder for runs."""
    root = tmp_path_factory.mktemp("record")
    target, draft = tiny_checkpoint("qwen3_moe"), tiny_draft
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPT_LINES) + "\n")
    return {"target": str(target), "draft": str(draft), "prompts": str(prompts), "root": root}


def _args(tiny, out, *extra):
    return [
        "--model", tiny["target"], "--draft", tiny["draft"], "--prompts", tiny["prompts"],
        "--max-new-tokens", "8", "--depth", "3", "--topk", "2", "--max-nodes", "7",
        "--cache-experts", "6", "--out", str(out), *extra,
    ]  # fmt: skip


def _last_json(capsys) -> dict:
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])


def test_help_lists_units_and_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in (
        "--bandwidth",
        "GB/s",
        "--cache-experts",
        "--max-new-tokens",
        "(default: 32)",
        "--resume",
        "us)",
        "--stopping {expected,bound}",
    ):
        assert needle in text
    assert "pay (default: expected)" in " ".join(text.split())


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--bandwidth", "0"], "--bandwidth"),
        (["--bandwidth", "-2"], "--bandwidth"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompts", "/nonexistent/prompts.txt"], "--prompts"),
        (["--model", "/nonexistent/model"], "--model"),
        (["--policy", "bogus"], "--policy"),
        (["--resume"], "--resume"),
        (["--acceptance", "/nonexistent/acceptance.json"], "--acceptance"),
        (["--cost", "/nonexistent/cost.json"], "--cost"),
        (["--device", "tpu"], "--device"),
        (["--mode", "policy", "--predictor", "union-size"], "--predictor"),
        (["--predictor-tables", "/nonexistent/tables.npz"], "--predictor-tables"),
        (["--stopping", "never"], "--stopping"),
        (["--stopping", "bound"], "--stopping"),  # dense mode has no stopping rule
        (["--mode", "policy", "--policy", "topn", "--stopping", "bound"], "--stopping"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cache_larger_than_experts_and_empty_prompt_file_exit_2(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, tmp_path / "a") + ["--cache-experts", "17"])
    assert exc.value.code == 2 and "--cache:" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, tmp_path / "b") + ["--prompts", str(empty)])
    assert exc.value.code == 2 and "--prompts" in capsys.readouterr().err


def test_dense_run_writes_a_valid_trace(tiny, tmp_path, capsys):
    out = tmp_path / "dense"
    assert main(_args(tiny, out, "--bandwidth", "2")) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary["num_requests"] == 3 and summary["num_tokens"] == 24 and summary["tau"] == 1.0
    # the table says what dense figures are: the full tree's tau, 1 committed per cycle by design,
    # tokens/s of recording (not a policy's), and how to get a policy's figures
    table = dict(line.split("  ", 1) for line in printed.splitlines() if "  " in line and not line.startswith("{"))
    assert table["tau of the full tree"].strip().startswith(f"{summary['full_tree_tau']:.3f}")
    assert "1 by design" in table["committed per cycle"] and "not a policy's throughput" in printed
    assert f"python -m sim.sweep --trace {out}" in printed and "tau (committed per cycle)" not in printed
    assert summary["h2d_bytes"] > 0 and 0 <= summary["hit_rate"] <= 1
    assert json.loads((out / "summary.json").read_text())["summary"]["num_tokens"] == 24
    run = open_run(out)
    assert run.manifest.complete and run.manifest.run.mode == "dense"
    trees = list(run.iter_trees())
    assert len(trees) == 24  # one tree per committed position
    accepted_lengths, reached = [], []
    for t in trees:
        # the union of the per-level trees: the final tree (last_level = levels drafted) has
        # max_nodes nodes, the nodes a later level pushed out come on top (issue 13)
        n = t.tree.num_nodes
        assert t.last_level is not None and t.num_levels == 3
        assert int((t.last_level == t.num_levels).sum()) == 7 and t.expert_ids.shape == (n, 2, 4)
        path_ok = t.accepted.copy()
        for v in range(1, t.tree.num_nodes):
            path_ok[v] &= path_ok[t.tree.parents[v]]
        accepted_lengths.append(int(t.tree.depths[path_ok].max()))
        last = int(np.flatnonzero(path_ok & (t.tree.depths == accepted_lengths[-1]))[0])
        reached.append(accepted_lengths[-1] + int((t.tree.parents == last).any()))
    # the cycle's num_accepted is the accepted path length of the whole tree; reached_depth adds
    # one where the path's last node has a child (verified and rejected)
    by_position = run.cycles.sort_values(["request_id", "position"])
    assert by_position["num_accepted"].tolist() == accepted_lengths
    assert by_position["reached_depth"].tolist() == reached
    generated = {int(r.request_id): list(r.generated_token_ids) for r in run.requests.itertuples()}
    # the committed token at each position is the target's greedy token at the tree's root
    by_request = {}
    for t in trees:
        by_request.setdefault(t.request_id, []).append(int(t.target_tokens[0]))
    assert by_request == generated
    assert len(run.cycles) == 24 and (run.cycles["num_committed"] == 1).all()
    assert run.has_level_trees  # (the tiny random draft is too flat to push nodes out: see test_sim_level_trees)
    _assert_transfers_match_cycles(run)


def _assert_transfers_match_cycles(run) -> None:
    """The transfers table has one row per tensor copy (2 per expert); bytes and seconds per cycle
    add up to the cycle's ``layer_h2d_bytes`` and ``h2d_s``."""
    transfers, cycles = run.transfers, run.cycles
    assert len(transfers) > 0
    assert int(transfers["bytes"].sum()) == int(np.stack(cycles["layer_h2d_bytes"]).sum())
    assert set(transfers["bytes"].unique()) == {4096, 2048}  # gate/up [32, 32] and down [32, 16] fp32
    by_cycle = transfers.groupby(["request_id", "cycle_index"])["h2d_s"].sum()
    h2d = cycles.set_index(["request_id", "cycle_index"])["h2d_s"].loc[by_cycle.index].to_numpy()
    # the cycle's h2d_s = its copies + the host time placing the misses just before them
    assert np.all(by_cycle.to_numpy() <= h2d + 1e-12) and np.all(by_cycle.to_numpy() > 0)
    misses = int(np.stack(cycles["layer_misses"]).sum())
    assert len(transfers) >= 2 * misses  # every miss is fetched (re-syncs may add more)


@pytest.fixture(scope="module")
def dense_run(tiny):
    out = tiny["root"] / "dense-reference"
    main(_args(tiny, out))
    return out


@pytest.mark.parametrize(
    ("policy", "overlap", "prefetch"),
    [
        ("specfit", "off", "none"),
        ("topn", "off", "none"),
        ("chain", "off", "none"),
        ("ar", "off", "none"),
        ("specfit", "on", "both"),
        ("topn", "on", "none"),
        ("topn", "off", "draft"),
    ],
)
def test_policy_runs_are_lossless(tiny, dense_run, tmp_path, capsys, policy, overlap, prefetch):
    dense = dense_run
    capsys.readouterr()
    out = tmp_path / f"{policy}-{overlap}-{prefetch}"
    argv = ["--mode", "policy", "--policy", policy, "--bandwidth", "1", "--overlap", overlap]
    argv += ["--prefetch", prefetch]
    if prefetch == "draft":  # per-token predictions name experts the cache may lack ("recent" never)
        argv += ["--predictor", "token-table"]
    assert main(_args(tiny, out, *argv)) == 0
    summary = _last_json(capsys)
    assert summary["policy"] == policy and summary["num_tokens"] == 24
    # the planner's time per cycle, as the summary table and JSON line state it (issue 14)
    assert summary["decision_s_per_cycle"] == pytest.approx(summary["decision_s"] / summary["num_cycles"])
    assert summary["planner_deadline_hits"] <= summary["num_cycles"] and summary["planner_mean_gap"] >= 0
    want = open_run(dense).requests.sort_values("request_id")["generated_token_ids"].map(list).tolist()
    run = open_run(out)
    got = run.requests.sort_values("request_id")["generated_token_ids"].map(list).tolist()
    assert got == want
    cycles = run.cycles
    if policy in ("specfit", "topn", "chain"):
        assert (
            cycles["predicted_cycle_s"].notna().all() and (cycles["predicted_expected_committed"] >= 1).all()
        )
    assert (cycles["num_committed"] == cycles["num_accepted"] + 1).sum() >= len(cycles) - 3
    assert cycles["reached_depth"].notna().all()  # bounds: checked by open_run
    if policy == "ar":
        assert (cycles["reached_depth"] == 0).all()
    stall, h2d = np.stack(cycles["layer_stall_s"]), np.stack(cycles["layer_h2d_s"])
    assert np.all(stall >= 0)
    pre, compute = np.stack(cycles["layer_pre_router_s"]), np.stack(cycles["layer_compute_s"])
    assert np.all(pre > 0) and np.all(pre <= compute)  # attention + router: part of each layer's compute
    if overlap == "off" and prefetch == "none":  # no copy stream: the whole H2D time is stall
        np.testing.assert_array_equal(stall, h2d)
    issued, used, wasted = (
        int(cycles[c].sum()) for c in ("num_prefetch_issued", "num_prefetch_used", "num_prefetch_wasted")
    )
    # (the prefill's prefetches, not in the cycles table, may be used or wasted in a cycle)
    assert (issued > 0) == (prefetch != "none") and (used + wasted > 0) == (prefetch != "none")
    transfers = run.transfers
    assert (transfers["enqueued_at_s"] <= transfers["started_at_s"]).all()
    assert (transfers["started_at_s"] <= transfers["landed_at_s"]).all()


def test_policy_run_transfers_recover_the_emulated_link(tiny, tmp_path, capsys, fake_clock):
    """Per-copy timings of an emulated 0.2 GB/s + 20 us link: calibration.fit separates bandwidth
    and per-expert latency (copies of 4096 and 2048 bytes identify both). On a fake clock
    (tests/fake_clock.py) the copies last exactly what the link charges, so the fit is checked
    within clock reads; on the real clock the same run is ``benchmarks/h2d_link.py``."""
    from calibration.fit import main as fit_main

    out = tmp_path / "topn-link"
    argv = _args(
        tiny, out, "--mode", "policy", "--policy", "topn", "--bandwidth", "0.2", "--latency-us", "20"
    )
    assert main(argv + ["--cache-experts", "2"]) == 0
    run = open_run(out)
    _assert_transfers_match_cycles(run)
    ar = tmp_path / "ar-link"  # a second tree size, so the verify term is identifiable too
    argv = _args(tiny, ar, "--mode", "policy", "--policy", "ar", "--bandwidth", "0.2", "--latency-us", "20")
    assert main(argv + ["--cache-experts", "2"]) == 0
    capsys.readouterr()
    # the link is what is checked here, not the fit's accuracy verdict (timings on a loaded CPU)
    cal = ["--out", str(tmp_path / "cal" / "cost.json"), "--min-cycles", "4", "--max-median-pct", "1e9"]
    cal += ["--max-p90-pct", "1e9"]
    with pytest.raises(SystemExit) as exc:  # one tree size: the verify term cannot be fitted (bad input)
        fit_main([str(out), *cal])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "every cycle verified" in captured.err
    assert "every cycle verified" in json.loads(captured.out.strip().splitlines()[-1])["error"]
    assert json.loads(captured.out.strip().splitlines()[-1])["ok"] is False
    assert fit_main([str(out), str(ar), *cal]) == 0
    fit = _last_json(capsys)
    assert fit["h2d_identifiable"] is True
    tick = fake_clock.tick_s  # a copy overruns its charge by less than one clock read
    assert 1 / fit["h2d_bytes_per_s"] == pytest.approx(1 / 0.2e9, abs=2 * tick / 2048)
    assert fit["h2d_link_us_per_transfer"] == pytest.approx(20.0, abs=10 * tick * 1e6)
    assert fit["h2d_host_us_per_transfer"] >= 0
    total = fit["h2d_link_us_per_transfer"] + fit["h2d_host_us_per_transfer"]
    assert fit["h2d_us_per_transfer"] == pytest.approx(total, rel=1e-9)


def test_resume_skips_finished_prompts(tiny, tmp_path, capsys):
    out = tmp_path / "resume"
    main(_args(tiny, out, "--num-prompts", "1"))
    first = _last_json(capsys)
    assert first["num_requests"] == 1
    main(_args(tiny, out, "--num-prompts", "3", "--resume"))
    second = _last_json(capsys)
    run = open_run(out)
    assert sorted(run.requests["request_id"].tolist()) == [0, 1, 2]
    assert np.array_equal(np.sort(run.cycles["request_id"].unique()), [0, 1, 2])
    # the summary covers the whole run: the first call's request and the two decoded now
    assert second["summary_covers"] == "whole run" and second["num_requests"] == 3
    assert second["num_tokens"] == sum(len(t) for t in run.requests["generated_token_ids"])
    assert second["num_cycles"] == len(run.cycles)
    assert second["decode_s"] > first["decode_s"]
    # a run recorded before per-request totals existed: the summary says which share it covers
    (out / "request_totals.json").unlink()
    out2 = tmp_path / "resume2"
    main(_args(tiny, out2, "--num-prompts", "1"))
    (out2 / "request_totals.json").unlink()
    capsys.readouterr()
    main(_args(tiny, out2, "--num-prompts", "2", "--resume"))
    third = _last_json(capsys)
    assert third["num_requests"] == 1 and third["summary_covers"].startswith("1 of 2 recorded requests")


def test_resume_continues_the_recorded_configuration(tiny, tmp_path, capsys):
    """`--out DIR --resume` alone continues the same policy run (not dense mode, not another policy);
    a flag given with another value exits 2 naming it and both values; a complete run says so."""
    out = tmp_path / "r3"
    argv = _args(tiny, out, "--mode", "policy", "--policy", "topn", "--bandwidth", "4", "--num-prompts", "1")
    assert main(argv) == 0
    capsys.readouterr()
    # another setup given explicitly: exit 2 naming the flags and both values, nothing decoded
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(out), "--resume", "--policy", "ar", "--bandwidth", "8"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--policy ar (recorded: topn)" in err and "--bandwidth 8" in err
    assert "(recorded: 4.0)" in err
    # a stopping rule for a topn run: exit 2, it has none (not "recorded: None")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(out), "--resume", "--stopping", "bound"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--stopping: only with --mode policy --policy specfit" in err
    assert "--policy topn has no stopping rule" in err and "None" not in err
    # complete run, same prompt count: "already complete", exit 0, JSON line last
    assert main(["--out", str(out), "--resume"]) == 0
    captured = capsys.readouterr().out
    assert "already complete" in captured
    assert json.loads(captured.strip().splitlines()[-1])["already_complete"] is True
    # only --num-prompts given: the same topn run at 4 GB/s goes on; 5 > 3 prompts says how many are used
    assert main(["--out", str(out), "--resume", "--num-prompts", "5"]) == 0
    captured = capsys.readouterr()
    assert "--num-prompts 5: only 3 prompts" in captured.err and "using 3" in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["mode"] == "policy" and summary["policy"] == "topn"
    assert summary["num_requests"] == 3 and summary["num_requests_recorded"] == 3
    assert summary["summary_covers"] == "whole run"
    run = open_run(out)
    assert run.manifest.config["bandwidth_gb_per_s"] == 4.0 and run.manifest.run.tree_policy == "topn"
    assert set(run.cycles["policy"]) == {"topn"} and sorted(run.requests["request_id"]) == [0, 1, 2]


def test_resume_of_a_dense_run_stays_dense(tiny, dense_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(dense_run), "--resume", "--mode", "policy"])
    assert exc.value.code == 2 and "--mode policy (recorded: dense)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(dense_run), "--resume", "--policy", "topn"])
    assert exc.value.code == 2 and "--policy" in capsys.readouterr().err


def test_interrupt_prints_the_json_line_last(tiny, tmp_path, capsys, monkeypatch):
    from live.spec import session as session_mod

    class Interrupted:
        def run(self, progress=True):
            raise KeyboardInterrupt

    monkeypatch.setattr(session_mod.RecordSession, "open", classmethod(lambda cls, config: Interrupted()))
    out = tmp_path / "int"
    assert main(_args(tiny, out)) == 130
    captured = capsys.readouterr()
    assert "--resume" in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["run_dir"] == str(out)


def test_interrupt_while_loading_prints_the_json_line_too(tiny, tmp_path, capsys, monkeypatch):
    from live.spec import session as session_mod

    def loading(cls, config):
        raise KeyboardInterrupt

    monkeypatch.setattr(session_mod.RecordSession, "open", classmethod(loading))
    assert main(_args(tiny, tmp_path / "int-load")) == 130
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["interrupted"] is True and not summary["num_requests_recorded"]  # nothing recorded yet


def test_model_folder_without_config_names_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the error line (the usage lists --draft)
    assert exc.value.code == 2 and "--model" in err and "config.json" in err
    assert "Hugging Face checkpoint" in err and "--draft" not in err


def test_explicit_policy_with_dense_mode_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--mode", "dense", "--policy", "topn"])
    assert exc.value.code == 2 and "--policy" in capsys.readouterr().err


def test_default_acceptance_is_the_shipped_calibration(tmp_path, capsys):
    from live.record import resolve_acceptance, sample_acceptance_path

    sample = sample_acceptance_path()
    if not sample.is_file():
        pytest.skip("shipped sample acceptance.json not in this checkout")
    assert resolve_acceptance(None, "default", "policy", "specfit") == str(sample)
    assert resolve_acceptance("a.json", "default", "policy", "specfit") == "a.json"
    assert resolve_acceptance(None, str(tmp_path), "policy", "specfit") is None  # user checkpoint
    assert resolve_acceptance(None, "default", "dense", "full") is None
    assert resolve_acceptance(None, "default", "policy", "ar") is None
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "traces/samples/default/acceptance.json" in capsys.readouterr().out


@pytest.mark.parametrize("cache_policy", ["lfu", "static"])
def test_other_cache_policies_run(tiny, tmp_path, capsys, cache_policy):
    out = tmp_path / cache_policy
    argv = _args(tiny, out, "--mode", "policy", "--policy", "full", "--cache-policy", cache_policy)
    assert main(argv + ["--num-prompts", "1"]) == 0
    summary = _last_json(capsys)
    assert summary["num_tokens"] == 8 and summary["cache_hits"] + summary["cache_misses"] > 0
    assert open_run(out).manifest.run.cache_policy == cache_policy


def _replay_full_tree(run_dir, max_new_tokens: int) -> dict[int, list[int]]:
    """Committed tokens per cycle when the whole recorded tree is verified, replayed from a dense trace."""
    trees = {(t.request_id, t.position): t for t in open_run(run_dir).iter_trees()}
    out: dict[int, list[int]] = {}
    for rid in sorted({k[0] for k in trees}):
        position = 0
        while (rid, position) in trees and position < max_new_tokens:
            t = trees[(rid, position)]
            on_path = t.accepted.copy()
            for v in range(1, t.tree.num_nodes):
                on_path[v] &= on_path[t.tree.parents[v]]
            committed = min(int(t.tree.depths[on_path].max()) + 1, max_new_tokens - position)
            out.setdefault(rid, []).append(committed)
            position += committed
    return out


def test_dense_trace_replays_the_live_full_tree_policy(tiny, dense_run, tmp_path, capsys):
    out = tmp_path / "full"
    assert main(_args(tiny, out, "--mode", "policy", "--policy", "full")) == 0
    cycles = open_run(out).cycles.sort_values(["request_id", "cycle_index"])
    live = {int(rid): g["num_committed"].tolist() for rid, g in cycles.groupby("request_id")}
    assert live == _replay_full_tree(dense_run, 8)


def test_planner_inputs_from_files(tiny, tmp_path, capsys):
    from specfit.acceptance import AcceptanceCalibration
    from specfit.cost import CycleCostModel

    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps(AcceptanceCalibration.identity().to_dict()))
    cost = CycleCostModel(1e-3, 5e-3, 1e-4, 0.0, 1e9, 0.0, 6144, 2, source="test")  # the tiny model's sizes
    cost_path = tmp_path / "cost.json"
    cost.save(cost_path)
    out = tmp_path / "run"
    argv = _args(tiny, out, "--mode", "policy", "--policy", "specfit", "--num-prompts", "1")
    assert main(argv + ["--acceptance", str(acceptance), "--cost", str(cost_path)]) == 0
    assert _last_json(capsys)["num_tokens"] == 8
    assert open_run(out).manifest.config["cost_model"]["verify_base_s"] == 5e-3
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, tmp_path / "run2", "--mode", "policy", "--acceptance", str(bad)))
    assert exc.value.code == 2 and "--acceptance" in capsys.readouterr().err
    other = tmp_path / "other_model.json"  # fitted for a 48-layer model
    dataclasses.replace(cost, num_layers=48).save(other)
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, tmp_path / "run3", "--mode", "policy", "--policy", "specfit", "--cost", str(other)))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--cost" in err and "'num_layers' is 48 but the model has 2" in err
    assert not (tmp_path / "run3" / "manifest.json").exists()


def test_embedded_default_model_short_dense_run(tmp_path, capsys):
    from live.assets import default_model_paths

    try:
        default_model_paths()
    except FileNotFoundError:
        pytest.skip("embedded default checkpoints not in this checkout")
    out = tmp_path / "default"
    assert main(["--num-prompts", "2", "--max-new-tokens", "4", "--out", str(out)]) == 0
    summary = _last_json(capsys)
    # the union of the per-level trees: the 32-node final tree plus any node a later level pushed out
    assert summary["num_tokens"] == 8 and summary["mean_nodes_verified"] >= 32.0
    assert summary["full_tree_tau"] >= 1.0
    run = open_run(out)
    assert run.manifest.model.num_experts == 64 and run.manifest.run.prompt_source == "default"
    assert len(list(run.iter_trees())) == 8


@pytest.mark.parametrize("predictor", ["union-size", "token-table"])
def test_fitted_predictor_tables(tiny, tmp_path, capsys, predictor):
    from specfit import bitsets

    tables = tmp_path / "predictor_tables.npz"
    union = np.minimum(np.arange(33, dtype=np.float64) * 2.0, 16.0)[None].repeat(2, axis=0)
    token_bits = bitsets.pack(np.array([[[0, 1, 2, 3], [4, 5, 6, 7]]]), 16)
    np.savez_compressed(tables, union_size=union, token_ids=np.array([9]), token_bits=token_bits)
    out = tmp_path / predictor
    argv = _args(tiny, out, "--mode", "policy", "--policy", "specfit", "--num-prompts", "2")
    assert main(argv + ["--predictor", predictor, "--predictor-tables", str(tables), "--bandwidth", "1"]) == 0
    assert _last_json(capsys)["num_tokens"] == 16
    run = open_run(out)
    assert run.manifest.run.predictor == predictor
    assert run.cycles["predicted_cycle_s"].notna().all()


def test_ar_needs_no_draft_but_trees_do(tiny, tmp_path, capsys):
    base = [
        "--model",
        tiny["target"],
        "--prompts",
        tiny["prompts"],
        "--max-new-tokens",
        "4",
        "--cache-experts",
        "4",
    ]
    assert main([*base, "--mode", "policy", "--policy", "ar", "--out", str(tmp_path / "ar")]) == 0
    assert _last_json(capsys)["num_tokens"] == 12
    with pytest.raises(SystemExit) as exc:
        main([*base, "--out", str(tmp_path / "dense")])
    assert exc.value.code == 2 and "--draft" in capsys.readouterr().err


def test_auto_predictor_resolution(tmp_path):
    from live.record import resolve_predictor, sample_trace_dir

    assert resolve_predictor("recent", None, "default") == ("recent", None)
    assert resolve_predictor("auto", "t.npz", "/m") == ("union-size", "t.npz")
    assert resolve_predictor("auto", None, str(tmp_path)) == ("recent", None)
    if (sample_trace_dir() / "manifest.json").is_file():
        assert resolve_predictor("auto", None, "default") == ("union-size", str(sample_trace_dir()))


def test_dense_trace_as_predictor_tables(tiny, dense_run, tmp_path, capsys):
    """A dense run directory gives the union-size table calibration.fit (and sim.replay) fit from it."""
    from calibration.predictor_tables import fit_predictor_tables
    from live.spec.session import union_size_from_dense_trace

    dense = open_run(dense_run)
    table = union_size_from_dense_trace(dense_run, 2, 16)
    want = fit_predictor_tables([dense.node_arrays()], 16).union_size
    assert table.shape == (2, 8) and np.array_equal(table, want)
    out = tmp_path / "specfit-dir-tables"
    argv = _args(tiny, out, "--mode", "policy", "--policy", "specfit", "--predictor-tables", str(dense_run))
    assert main(argv + ["--bandwidth", "1"]) == 0
    assert open_run(out).manifest.run.predictor == "union-size"
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, tmp_path / "bad", "--mode", "policy", "--predictor-tables", str(tmp_path)))
    assert exc.value.code == 2 and "--predictor-tables" in capsys.readouterr().err


def test_stopping_rule_is_recorded_and_followed_on_resume(tiny, planned_setup, tmp_path, capsys, monkeypatch):
    """--stopping reaches SpecFitPolicy and the manifest; --resume keeps it and refuses another.
    (The throughput guard is held open: the depth comparison is about the two stopping rules. Both
    runs plan with one fixed cost file and the union-size predictor, so no decision depends on a
    timing: not a quick cost measured at start, nor a search deadline.)"""
    from live.record import build_parser, resolve_config
    from specfit.policies import ThroughputGuard

    monkeypatch.setattr(ThroughputGuard, "allows_drafting", lambda self: True)

    out = tmp_path / "bound"
    argv = _planned_args(tiny, out, tiny["prompts"], planned_setup)
    assert main([*argv, "--stopping", "bound", "--num-prompts", "1"]) == 0
    assert _last_json(capsys)["num_tokens"] == 8
    run = open_run(out)
    assert run.manifest.config["stopping"] == "bound"
    other = tmp_path / "expected"
    assert main([*_planned_args(tiny, other, tiny["prompts"], planned_setup), "--num-prompts", "1"]) == 0
    capsys.readouterr()
    exp = open_run(other)
    assert exp.manifest.config["stopping"] == "expected"
    # both lossless (same tokens); the bound rule drafts at least as deep on average
    tokens = [r.requests["generated_token_ids"].map(list).tolist() for r in (run, exp)]
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 8
    assert run.cycles["num_draft_levels"].mean() >= exp.cycles["num_draft_levels"].mean()
    assert (run.cycles["num_draft_levels"] <= 3).all()
    # the resumed configuration follows the manifest; a contradicting flag exits 2 naming both values
    parser = build_parser()
    args = parser.parse_args(["--out", str(out), "--resume"])
    assert resolve_config(args, parser, {"out", "resume"}).stopping == "bound"
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(out), "--resume", "--stopping", "expected"])
    assert exc.value.code == 2 and "--stopping expected (recorded: bound)" in capsys.readouterr().err
    # the default rule is recorded too; policies without a stopping rule record none
    args = parser.parse_args(_args(tiny, tmp_path / "e", "--mode", "policy"))
    assert resolve_config(args, parser).stopping == "expected"
    args = parser.parse_args(_args(tiny, tmp_path / "t", "--mode", "policy", "--policy", "topn"))
    assert resolve_config(args, parser, {"mode", "policy"}).stopping is None


def test_planned_chooser_builds_the_chosen_stopping_rule():
    from live.spec.draft import TreeShape
    from live.spec.planning import PlannedChooser

    shape = TreeShape(3, 2, 7)
    for rule in ("expected", "bound"):
        chooser = PlannedChooser(None, shape, "specfit", "recent", None, 16, stopping=rule)
        assert chooser.policy.stopping == rule
    assert PlannedChooser(None, shape, "specfit", "recent", None, 16).policy.stopping == "expected"
    with pytest.raises(ValueError, match="only policy 'specfit'"):
        PlannedChooser(None, shape, "topn", "recent", None, 16, stopping="bound")
    with pytest.raises(ValueError, match="stopping must be one of"):
        PlannedChooser(None, shape, "specfit", "recent", None, 16, stopping="never")


# resume after a stop or a SIGKILL: the same run as an uninterrupted one, timings aside


def _timing_columns() -> set[str]:
    """Measured times: the columns in seconds (their values differ run to run)."""
    from traces.schema import TABLES

    return {spec.name for specs in TABLES.values() for spec in specs if spec.unit == "s"}


def _many_prompts(tiny, count: int) -> str:
    path = tiny["root"] / f"prompts-{count}.txt"
    rng = np.random.default_rng(count)
    lines = [
        " ".join(f"w{w}" for w in rng.integers(4, TINY_VOCAB_SIZE, size=rng.integers(1, 9)))
        for _ in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _planned_args(tiny, out, prompts: str, cost_path, policy: str = "specfit") -> list[str]:
    """A planned policy with the union-size predictor (priced at the cache's observed miss
    fraction) and a fixed cost model: SpecFit's choices depend on the cache's state and statistics."""
    argv = _args(tiny, out, "--mode", "policy", "--policy", policy, "--cost", str(cost_path))
    argv[argv.index("--prompts") + 1] = prompts
    return [*argv, "--predictor", "union-size", "--predictor-tables", str(tiny["dense_tables"])]


def _values(column) -> list:
    """A column's values as plain lists, nulls as None (comparable with ==)."""
    return [None if np.ndim(v) == 0 and v != v or v is None else np.asarray(v).tolist() for v in column]


def _assert_same_run_but_timings(a, b) -> None:
    """Every column of requests, cycles and transfers equal except the measured times."""
    ra, rb = open_run(a), open_run(b)
    assert rb.complete and ra.request_ids.tolist() == rb.request_ids.tolist()
    for table, keys in (("requests", ["request_id"]), ("cycles", ["request_id", "cycle_index"])):
        fa = getattr(ra, table).sort_values(keys).reset_index(drop=True)
        fb = getattr(rb, table).sort_values(keys).reset_index(drop=True)
        columns = [c for c in fa.columns if c not in _timing_columns()]
        for column in columns:
            assert _values(fa[column]) == _values(fb[column]), column
    ta, tb = (r.transfers.sort_values(["request_id", "cycle_index"], kind="stable") for r in (ra, rb))
    for column in ("request_id", "cycle_index", "layer", "expert", "bytes"):
        assert ta[column].tolist() == tb[column].tolist(), column


@pytest.fixture(scope="module")
def planned_setup(tiny, dense_run):
    from specfit.cost import CycleCostModel

    cost_path = tiny["root"] / "resume-cost.json"
    CycleCostModel(1e-3, 5e-3, 1e-4, 0.0, 1e9, 0.0, 6144, 2, source="test").save(cost_path)
    tiny["dense_tables"] = dense_run
    return cost_path


NUM_RESUME_PROMPTS = 8


def _whole_run(tiny, planned_setup, out, policy: str) -> str:
    """The uninterrupted reference: 8 prompts in one call; returns the prompts file."""
    prompts = _many_prompts(tiny, NUM_RESUME_PROMPTS)
    argv = _planned_args(tiny, out, prompts, planned_setup, policy)
    assert main([*argv, "--num-prompts", str(NUM_RESUME_PROMPTS)]) == 0
    return prompts


def test_resume_rebuilds_the_expert_cache_and_the_planner_state(
    tiny, planned_setup, tmp_path, capsys
):
    """SpecFit, 8 prompts at once, and 2 then --resume to 8: the same cycles, hits, misses, H2D
    bytes and tokens (the resumed call replays the first 2 requests' cache accesses and restores
    the planner's root-acceptance estimate and the throughput guard's history; the guard prices
    cycles with the cost model, so the choices depend on no timing)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    prompts = _whole_run(tiny, planned_setup, whole, "specfit")
    assert main([*_planned_args(tiny, split, prompts, planned_setup), "--num-prompts", "2"]) == 0
    capsys.readouterr()
    assert main(["--out", str(split), "--resume", "--num-prompts", str(NUM_RESUME_PROMPTS)]) == 0
    captured = capsys.readouterr()
    assert "resuming" in captured.err and "2 of 8 requests finished; continuing at request 2" in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["resumed"] is True and summary["resumed_from_request"] == 2
    assert summary["requests_finished_before"] == 2 and summary["cache"] == "rebuilt"
    assert summary["planner_state"] == "restored"
    assert summary["cache_cycles_replayed"] == int((open_run(split).cycles["request_id"] < 2).sum()) > 0
    resumes = open_run(split).manifest.config["resumes"]
    assert len(resumes) == 1 and resumes[0]["resumed_from_request"] == 2
    _assert_same_run_but_timings(whole, split)


def test_sigkill_loses_at_most_the_request_in_progress_and_resume_equals_an_uninterrupted_run(
    tiny, planned_setup, tmp_path, capsys
):
    """A real SIGKILL of `python -m live.record` mid-run: every finished request is on disk (the
    writer flushes each one), the trace validates, and --resume ends with the same run as an
    uninterrupted one, timings aside (top-N: its choices depend on no timing; the hits, misses and
    H2D bytes depend on the rebuilt cache)."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    from paused_child import paused_command, wait_for_pause

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    prompts = _whole_run(tiny, planned_setup, whole, "topn")
    marker = tmp_path / "paused"
    proc = subprocess.Popen(
        paused_command("live.record", marker, _planned_args(tiny, killed, prompts, planned_setup, "topn")),
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_pause(proc, marker)  # request 0 finished, request 1 in progress
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    run = open_run(killed)  # validates: every finished request whole
    assert not run.complete
    recorded = len(run.requests)
    totals = len(json.loads((killed / "request_totals.json").read_text()))
    # every finished request is on disk, with its totals; the one in progress is lost
    assert recorded == totals == 1
    capsys.readouterr()
    assert main(["--out", str(killed), "--resume"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["resumed_from_request"] == recorded and summary["cache"] == "rebuilt"
    assert summary["planner_state"] == "restored"
    assert (
        f"{recorded} of {NUM_RESUME_PROMPTS} requests finished; continuing at request {recorded}"
        in captured.err
    )
    _assert_same_run_but_timings(whole, killed)


def test_sigterm_stops_like_ctrl_c(tiny, tmp_path):
    """`kill` (SIGTERM) of a running `python -m live.record`: the finished requests are kept, a JSON
    line ends stdout, exit 143, and the run continues with --resume."""
    import signal
    import subprocess
    from pathlib import Path

    from paused_child import paused_command, wait_for_pause

    out, marker = tmp_path / "terminated", tmp_path / "paused"
    argv = _args(tiny, out)
    argv[argv.index("--prompts") + 1] = _many_prompts(tiny, NUM_RESUME_PROMPTS)
    proc = subprocess.Popen(
        paused_command("live.record", marker, [*argv, "--no-progress"]),
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_pause(proc, marker)  # request 0 finished, request 1 in progress
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["signal"] == "SIGTERM"
    assert "Traceback" not in stderr and "--resume" in stderr
    assert "Loading weights" not in stderr  # --no-progress silences transformers' loading bars too
    run = open_run(out)  # validates
    assert not run.complete and summary["num_requests_recorded"] == len(run.requests) == 1


def test_dense_trace_carries_next_layer_guesses(dense_run):
    """Dense mode records every node's and prefill token's next-layer guesses (layer l+1's router
    on layer l's MoE input), distinct valid ids per layer, so the simulator can replay them."""
    run = open_run(dense_run)
    model = run.manifest.model
    assert run.has_next_layer_guesses
    arrays = run.node_arrays()
    guesses = arrays.next_layer_expert_ids
    assert guesses.shape == (len(arrays.parent), model.num_layers - 1, model.top_k)
    assert guesses.min() >= 0 and guesses.max() < model.num_experts
    rid = int(run.request_ids[0])
    assert run.prefill_next_layer_experts(rid).shape == (*run.prefill_experts(rid).shape[:1], model.num_layers - 1, model.top_k)
    # the router's own choice at layer l+1 often is among the guess made at layer l
    from traces.stats import next_layer_guess_recall, summarize

    agree = (guesses[:, :, :, None] == arrays.expert_ids[:, 1:, None, :]).any(axis=2).mean()
    assert agree > 1.5 * model.top_k / model.num_experts
    assert next_layer_guess_recall(arrays) == pytest.approx(agree) == summarize(run)["next_layer_guess_recall"]


def test_the_live_deadline_cuts_searches_and_the_summary_counts_them(tiny, tmp_path, capsys, monkeypatch):
    """rev7: no live test could fail on the planner deadline (the one check passed with 0 hits).
    Here the live path (live.spec.planning passing LIVE_DEADLINE_FRACTION, patched to 0: every
    search stops before its first state) runs on trees whose plans need a search: self-drafting
    (long accepted paths), per-token predicted experts (token-table), the bound stopping rule
    (deep trees) and a cost whose nodes are free and whose experts cost about what a token gains.
    A 0 s deadline stops every search before its first state whatever the clock reads, so the
    cut searches are the same in every run."""
    from transformers import AutoConfig

    import specfit.policies
    from specfit.cost import CycleCostModel

    monkeypatch.setattr(specfit.policies, "LIVE_DEADLINE_FRACTION", 0.0)
    config = AutoConfig.from_pretrained(tiny["target"])
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * 4  # gate, up, down in fp32
    CycleCostModel(
        draft_s_per_level=1e-4, verify_base_s=1e-3, verify_s_per_node=0.0, verify_s_per_context_token=0.0,
        h2d_bytes_per_s=3e7, h2d_s_per_transfer=0.0, expert_bytes=expert_bytes,
        num_layers=config.num_hidden_layers, source="test",
    ).save(tmp_path / "cost.json")  # fmt: skip
    argv = ["--mode", "policy", "--policy", "specfit", "--predictor", "token-table", "--stopping", "bound"]
    argv += ["--bandwidth", "1", "--depth", "6", "--topk", "4", "--max-nodes", "40", "--cache-experts", "2"]
    argv += ["--cost", str(tmp_path / "cost.json"), "--draft", tiny["target"]]
    assert main([*_args(tiny, tmp_path / "cut", *argv)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    hits, gap = summary["planner_deadline_hits"], summary["planner_mean_gap"]
    assert 0 < hits <= summary["num_cycles"] and gap > 0
    assert f"deadline hit in {hits} cycles, mean gap {gap:.2%}" in printed
    saved = json.loads((tmp_path / "cut" / "summary.json").read_text())["summary"]
    assert saved["planner_deadline_hits"] == hits and saved["planner_mean_gap"] == gap


@pytest.mark.parametrize("policy", ["ar", "topn"])
def test_next_layer_prefetch_counts_equal_the_simulator_cycle_by_cycle(tiny, dense_run, tmp_path, capsys, policy):
    """Prefetch issued/used/wasted do not depend on timing: the live engine's --prefetch
    next-layer and sim.replay on the dense trace's recorded guesses count the same, per cycle."""
    from sim.config import SimConfig
    from sim.replay import replay_policy

    out = tmp_path / policy
    argv = ["--mode", "policy", "--policy", policy, "--bandwidth", "1", "--prefetch", "next-layer"]
    assert main(_args(tiny, out, *argv)) == 0
    live = open_run(out).cycles.sort_values(["request_id", "cycle_index"])
    dense = open_run(dense_run)
    model = dense.manifest.model
    cost = replay_test_cost(model)
    config = SimConfig(cost=cost, policy=policy, cache_capacity_per_layer=6, prefetch="next-layer")
    sim = sorted(replay_policy(dense, config).cycles, key=lambda c: (c.request_id, c.cycle_index))
    assert len(sim) == len(live)
    assert [c.verified_nodes for c in sim] == live["verified_nodes"].map(list).tolist()
    for name in (
        "num_prefetch_issued",
        "num_prefetch_used",
        "num_prefetch_wasted",
        "cache_hits",
        "cache_misses",
        "num_accepted",
        "reached_depth",  # per-depth acceptance of a replayed policy conditions as live
    ):
        assert [getattr(c, name) for c in sim] == live[name].astype(int).tolist(), name
    assert live["num_prefetch_issued"].sum() > 0 and live["num_prefetch_used"].sum() > 0


def test_sweep_replays_next_layer_prefetch_on_a_dense_trace_with_guesses(dense_run, tmp_path, capsys):
    """sim.sweep --prefetch none,next-layer,both runs on a trace that carries the guesses: a cell
    per mode, next-layer copies counted as prefetch bytes."""
    from sim.sweep import main as sweep_main

    out = tmp_path / "sweep"
    argv = ["--trace", str(dense_run), "--cache", "6", "--bandwidth", "1", "--policy", "ar,topn"]
    argv += ["--prefetch", "none,next-layer,both", "--out", str(out), "--no-progress", "--no-figures", "--jobs", "1"]
    assert sweep_main(argv) == 0
    results = pd.read_csv(out / "results.csv")
    assert sorted(results["prefetch"].unique()) == ["both", "next-layer", "none"]
    by_mode = results.groupby("prefetch")["prefetch_bytes"].sum()
    assert by_mode["none"] == 0 and by_mode["next-layer"] > 0
    # the preset has no next-layer share: the sweep estimates it from pilot replays and says so
    out, err = capsys.readouterr()
    assert "no next-layer prefetch share" not in err
    said = [line for line in out.splitlines() if line.startswith("next-layer prefetch:")]
    assert len(said) == 1 and "pilot replays of ar, chain and topn" in said[0] and "cache 6 lru:" in said[0]


def test_decoding_runs_with_the_loaded_objects_frozen_out_of_gc(tiny, tmp_path, capsys, monkeypatch):
    """Python's full collections would walk the loaded models inside timed cycles (0.1-1 s pauses):
    the session collects and freezes them before decoding (gc.freeze) and unfreezes after, also
    when a request fails, so the next run in the process can free them."""
    import gc

    from live.spec.engine import SpecDecoder

    generate, frozen = SpecDecoder.generate, []

    def spy(self, *args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(SpecDecoder, "generate", spy)
    assert main(_args(tiny, tmp_path / "run", "--num-prompts", "2", "--no-progress")) == 0
    assert len(frozen) == 2 and min(frozen) > 0 and gc.get_freeze_count() == 0

    def fail(self, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(SpecDecoder, "generate", fail)
    with pytest.raises(RuntimeError, match="boom"):
        main(_args(tiny, tmp_path / "fail", "--no-progress"))
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--mode", "dense", "--prefetch", "draft"], "dense mode"),
        (["--mode", "policy", "--policy", "ar", "--prefetch", "both"], "autoregressive"),
        (["--mode", "policy", "--policy", "specfit", "--prefetch", "draft"], "union-size"),
        (["--mode", "policy", "--policy", "topn", "--predictor", "recent", "--prefetch", "draft"], None),
        (["--mode", "policy", "--policy", "specfit", "--prefetch", "next-layer"], None),
    ],
)
def test_a_draft_prefetch_that_issues_nothing_is_said(flags, said, tmp_path) -> None:
    """--prefetch draft|both where no chosen subtree has predicted experts (dense mode, ar, the
    union-size predictor) is said in one line, not silently recorded as prefetching."""
    from live.record import build_parser, draft_prefetch_note, explicit_flags, resolve_config

    parser, argv = build_parser(), [*flags, "--out", str(tmp_path / "run")]
    config = resolve_config(parser.parse_args(argv), parser, explicit_flags(argv))
    note = draft_prefetch_note(config)
    assert (note is None) == (said is None)
    if said is not None:
        assert said in note and "\n" not in note


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--mode", "policy", "--policy", "specfit", "--prefetch", "next-layer"], True),
        (["--mode", "policy", "--policy", "topn", "--prefetch", "both"], True),
        (["--mode", "policy", "--policy", "specfit", "--prefetch", "draft"], False),
        (["--mode", "policy", "--policy", "ar", "--prefetch", "next-layer"], False),  # no planner
        (["--mode", "dense", "--prefetch", "next-layer"], False),
        (["--mode", "policy", "--policy", "specfit", "--prefetch", "next-layer", "--cost", "c.json"], False),
    ],
)
def test_the_quick_cost_estimate_without_a_next_layer_share_is_said(flags, warned, tmp_path) -> None:
    """live.record without --cost prices a planned policy's cycles with its quick estimate, which has
    no next-layer share: with --prefetch next-layer|both one line says so (a --cost file is checked
    by check_input_files, as sim.sweep does)."""
    from live.record import build_parser, explicit_flags, quick_cost_next_layer_note, resolve_config
    from specfit.cost import CycleCostModel

    CycleCostModel(1e-3, 5e-3, 1e-4, 0.0, 1e9, 2e-5, 98304, 6, source="test").save(tmp_path / "c.json")
    flags = [str(tmp_path / f) if f == "c.json" else f for f in flags]
    parser, argv = build_parser(), [*flags, "--out", str(tmp_path / "run")]
    note = quick_cost_next_layer_note(resolve_config(parser.parse_args(argv), parser, explicit_flags(argv)))
    assert (note is not None) == warned
    if warned:
        assert "no next-layer prefetch share" in note and "--cost" in note and "\n" not in note


@pytest.mark.parametrize(("overlap", "prefetch"), [("off", "next-layer"), ("on", "both")])
def test_live_and_sim_price_next_layer_prefetch_with_the_same_cost(tiny, tmp_path, capsys, overlap, prefetch):
    """Issue 13: --prefetch next-layer|both sets the cost model's next_layer_prefetch on the live
    side (the planner's cost, recorded in the manifest) exactly as sim.config does for the same
    file and flags, so both price next-layer prefetch with the same fitted share."""
    from sim.config import SimConfig
    from specfit.cost import CycleCostModel

    cost = CycleCostModel(
        1e-3, 5e-3, 1e-4, 0.0, 1e9, 2e-5, 6144, 2, source="test", next_layer_cover_fraction=0.5, next_layer_waste_per_miss=0.25
    )  # the tiny model's sizes
    cost_path = tmp_path / "cost.json"
    cost.save(cost_path)
    out = tmp_path / "run"
    argv = _args(tiny, out, "--mode", "policy", "--policy", "specfit", "--num-prompts", "1", "--cost", str(cost_path))
    assert main(argv + ["--overlap", overlap, "--prefetch", prefetch]) == 0
    live = CycleCostModel.from_dict(open_run(out).manifest.config["cost_model"])
    sim = SimConfig(cost=CycleCostModel.load(cost_path), policy="specfit", cache_capacity_per_layer=6,
                    overlap=overlap, prefetch=prefetch).cost  # fmt: skip
    assert live == sim and live.next_layer_prefetch and live.next_layer_priced
    misses = np.array([2.0, 1.0])
    unpriced = dataclasses.replace(live, next_layer_cover_fraction=0.0, next_layer_waste_per_miss=0.0)
    assert live.cycle_s(2, 5, 30, misses) == sim.cycle_s(2, 5, 30, misses)
    if overlap == "off":  # half the copies a layer early: less of them after each router
        assert live.cycle_s(2, 5, 30, misses) < unpriced.cycle_s(2, 5, 30, misses)


def test_speed_probe_runs_between_requests_never_inside_a_cycle(tiny, tmp_path, capsys, monkeypatch):
    """The machine-speed probes (live.speed_probe: the target's own attention + router, and the
    matrix chain) are timed before the first request and after each request, never between two
    cycles of a request, and land in summary.json; the cycle table keeps exactly the schema's
    columns."""
    import live.speed_probe as speed_probe
    from traces.schema import CycleRecord
    from traces.writer import TraceWriter

    events: list[str] = []
    fake_s = iter(np.arange(1, 1000) * 1e-3)  # distinct fake seconds, in call order
    real_model_probe = speed_probe.probe_model_once
    model_layers = []

    def model_probe(inputs):
        model_layers.append(len(inputs.layers))
        real_model_probe(inputs)  # the real call runs on the tiny target (its timing is not kept)
        events.append("model")
        return float(next(fake_s))

    monkeypatch.setattr(speed_probe, "probe_once", lambda x, w: (events.append("probe"), float(next(fake_s)))[1])
    monkeypatch.setattr(speed_probe, "probe_model_once", model_probe)
    for name in ("add_cycle", "add_request"):
        real = getattr(TraceWriter, name)

        def logged(self, *a, _real=real, _name=name, **k):
            events.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(TraceWriter, name, logged)
    out = tmp_path / "probe"
    assert main(_args(tiny, out, "--mode", "policy", "--policy", "topn")) == 0
    line = _last_json(capsys)
    per_point, model_per_point = speed_probe.PROBES_PER_POINT, speed_probe.MODEL_PROBES_PER_POINT
    assert set(model_layers) == {2}  # every MoE decoder layer of the tiny target (2)
    # a point: the chain's probes with the model's spread evenly among them
    assert per_point == 2 * model_per_point  # as shipped: every other chain probe follows a model probe
    point = " ".join(["probe model probe"] * model_per_point)
    # probes, then per request: its cycles, the request row, probes
    text = " ".join(events)
    assert text.startswith(point + " add_cycle")
    for request_block in text.split("add_request")[:-1]:
        cycles_then_probes = request_block.split()
        first_cycle = cycles_then_probes.index("add_cycle")
        assert set(cycles_then_probes[first_cycle:]) == {"add_cycle"}  # no probe among a request's cycles
    assert text.endswith("add_request " + point)
    recorded = json.loads((out / "summary.json").read_text())["summary"]
    # 4 points (before + after each of 3 requests); fake seconds in call order, split per workload
    taken = [e for e in events if e in ("model", "probe")]
    seconds = np.arange(1, 1 + len(taken)) * 1e-3
    model_s = [float(t) for t, e in zip(seconds, taken) if e == "model"]
    chain_s = [float(t) for t, e in zip(seconds, taken) if e == "probe"]
    assert len(model_s) == model_per_point * 4 and len(chain_s) == per_point * 4
    assert recorded["speed_probe_s"] == pytest.approx(model_s)  # the gauge: the target's own compute
    assert recorded["speed_probe_chain_s"] == pytest.approx(chain_s)
    assert recorded["speed_probe_median_s"] == pytest.approx(float(np.median(model_s)))
    assert line["speed_probe_median_s"] == pytest.approx(float(np.median(model_s)))
    assert recorded["speed_probe_workload"].startswith("the target's own attention + router")
    run = open_run(out)
    assert list(run.cycles.columns) == [f.name for f in dataclasses.fields(CycleRecord)]
