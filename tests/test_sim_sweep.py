"""sim.sweep: the CLI, resumability, determinism and the executors (local pool, Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from tiny_shapes import tiny_shape

from sim.cells import CellSpec, make_cells, parse_cache_sizes, run_cell
from sim.config import ORACLE_VARIANTS, SimConfig
from sim.presets import cost_from_preset
from sim.replay import replay_policy
from sim.report import REGRET_COLUMNS, results_frame
from sim.sweep import main, run_sweep
from traces.reader import open_run
from traces.synthetic import generate_dense_trace

SHAPE = tiny_shape(12_288, "tiny")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = generate_dense_trace(
        tmp_path_factory.mktemp("sim-sweep") / "tiny",
        SHAPE,
        num_requests=2,
        positions_per_request=16,
        prompt_len=8,
        tree_depth=3,
        tree_topk=3,
        max_nodes=12,
        seed=5,
    )
    return str(path)


def _cells(trace: str):
    cost = cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=9_437_184, num_layers=SHAPE.num_layers)
    return make_cells(
        trace_path=trace,
        cost=cost,
        bandwidths_gb_per_s=[16, 64],
        caches=parse_cache_sizes(["0.25", "8"], SHAPE.num_experts),
        policies=["ar", "topn", "specfit"],
    )


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_cli_runs_writes_tidy_results_and_resumes(trace: str, tmp_path, capsys) -> None:
    out = tmp_path / "sweep"
    argv = [
        "--trace",
        trace,
        "--bandwidth",
        "16,64",
        "--cache",
        "0.25,8",
        "--out",
        str(out),
        "--jobs",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    summary = _last_json(printed)
    assert summary["num_cells"] == 12 and summary["cells_run"] == 12 and summary["cells_skipped"] == 0
    assert summary["expert_bytes"] == 9_437_184
    lines = printed.splitlines()
    # the first line says in words what is replayed and priced, and that the tokens/s are simulated
    assert lines[0].startswith("SIMULATED tokens/s: tiny's recorded routing and acceptance")
    assert "priced at qwen3-30b-a3b expert size" in lines[0]
    lines = lines[1:]
    assert (
        lines[0] == f"trace: {trace}"  # the path once, not "trace: trace PATH"
        and "model shape: qwen3-30b-a3b expert size, 9,437,184 bytes/expert" in lines[1]
    )
    assert lines[2].startswith("cost: preset qwen3-30b-a3b-2gpu+pcie5-x16")
    # a trace without per-level trees (synthetic) says that SpecFit's stopping rule approximates them
    assert sum(line.startswith("level trees approximated: ") for line in lines) == 1
    df = pd.read_parquet(out / "results.parquet")
    assert len(df) == 12
    for column in (
        "bandwidth_gb_per_s",
        "cache_experts_per_layer",
        "policy",
        "tokens_per_s",
        "tau",
        "hit_rate",
        "h2d_gb",
        "speedup_vs_ar",
        "speedup_vs_topn",
        "specfit_below_baseline",
    ):
        assert column in df.columns
    assert set(df["cache_experts_per_layer"]) == {4, 8}
    assert (df.loc[df["policy"] == "ar", "speedup_vs_ar"] == 1.0).all()
    assert (df.loc[df["policy"] == "ar", "tau"] == 1.0).all()
    assert pd.read_csv(out / "results.csv").shape == df.shape
    assert (out / "throughput_vs_bandwidth.png").stat().st_size > 1000
    assert len(list((out / "cells").glob("*.json"))) == 12
    first = (out / "results.parquet").read_bytes(), (out / "results.csv").read_bytes()

    # resume: drop two finished cells; the re-run redoes only those, results byte-identical
    for path in sorted((out / "cells").glob("*.json"))[:2]:
        path.unlink()
    assert main(argv) == 0
    again = _last_json(capsys.readouterr().out)
    assert again["cells_run"] == 2 and again["cells_skipped"] == 10
    assert ((out / "results.parquet").read_bytes(), (out / "results.csv").read_bytes()) == first

    # a fresh directory with the same seed: byte-identical too
    other = tmp_path / "other"
    assert main([*argv[:-5], "--out", str(other), "--jobs", "2", "--no-progress", "--no-figures"]) == 0
    capsys.readouterr()
    assert (other / "results.csv").read_bytes() == first[1]


def test_help_lists_flags_with_units_and_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--bandwidth",
        "--cache",
        "--policy",
        "--cache-policy",
        "--predictor",
        "--overlap",
        "--prefetch",
        "--cost",
        "--expert-bytes",
        "--model-shape",
        "--trace",
        "--out",
        "--jobs",
        "--executor",
        "--ray-address",
        "--seed",
        "--stopping",
        "--planner-deadline-fraction",
    ):
        assert flag in text
    assert "depend on this machine's speed and load" in text
    assert "GB/s (1 GB = 1e9 bytes)" in text and "default: 16,32,64" in text
    assert "--stopping {expected,bound}" in text and "can pay (default: expected)" in text


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--bandwidth", "-3"], "--bandwidth"),
        (["--policy", "greedy"], "--policy"),
        (["--cache-policy", "fifo"], "--cache-policy"),
        (["--predictor", "psychic"], "--predictor"),
        (["--executor", "slurm"], "--executor"),
        (["--cache", "2.5"], "--cache"),
        (["--cache", "99"], "--cache"),
        (["--cost", "tpu-v9"], "--cost"),
        (["--model-shape", "gpt-5"], "--model-shape"),
        (["--acceptance", "/nonexistent.json"], "--acceptance"),
        (["--trace", "/nonexistent-trace"], "--trace"),
        (["--bandwidth", "16,,32"], "--bandwidth"),
        (["--bandwidth", "16e9"], "--bandwidth"),
        (["--cache", "0.001"], "--cache"),
        (["--stopping", "never"], "--stopping"),
        (["--prefetch", "sometimes"], "--prefetch"),
        (["--policy", "ar,topn", "--stopping", "bound"], "--stopping"),  # no SpecFit cell to apply it to
        (["--planner-deadline-fraction", "-0.1"], "--planner-deadline-fraction"),
        (["--planner-deadline-fraction", "soon"], "--planner-deadline-fraction"),
        (["--policy", "ar,topn", "--planner-deadline-fraction", "0.1"], "--planner-deadline-fraction"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(trace: str, argv: list[str], flag: str, capsys, tmp_path) -> None:
    full = ["--trace", trace, "--out", str(tmp_path / "x"), "--no-progress", *argv]
    with pytest.raises(SystemExit) as exc:
        main(full)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("prefetch", ["next-layer", "none,both"])
def test_next_layer_prefetch_on_a_trace_without_guesses_exits_2_in_one_line(
    trace: str, prefetch: str, capsys, tmp_path
) -> None:
    """A dense trace recorded before the next-layer guesses existed (or a synthetic one) cannot
    replay next-layer prefetch: exit 2, one stderr line naming --prefetch and the trace, no output."""
    out = tmp_path / "x"
    with pytest.raises(SystemExit) as exc:
        main(["--trace", trace, "--out", str(out), "--no-progress", "--prefetch", prefetch])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert "--prefetch" in err[0] and "next_layer_expert_ids" in err[0] and trace in err[0]
    assert not out.exists()


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_pre_v4_cost_file_swept_with_overlap_on_is_warned_about(trace: str, overlap: str, tmp_path, capsys) -> None:
    """A cost JSON written before pre_router_fraction existed (version 3, fitted without overlap) loads
    with pre_router_fraction 0; swept with --overlap on, that prices copies enqueued at the layer's
    start (optimistic), so the sweep says so on stderr; with --overlap off nothing is said."""
    cost = cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=1_000, num_layers=SHAPE.num_layers)
    data = json.loads(cost.save(tmp_path / "cost.json").read_text())
    data.pop("pre_router_fraction")
    data["units"].pop("pre_router_fraction", None)
    data["version"] = 3
    (tmp_path / "cost.json").write_text(json.dumps(data))
    argv = ["--trace", trace, "--bandwidth", "16", "--cache", "4", "--policy", "ar", "--no-progress"]
    argv += ["--no-figures", "--jobs", "1", "--cost", str(tmp_path / "cost.json"), "--overlap", overlap]
    assert main([*argv, "--out", str(tmp_path / "sweep")]) == 0
    err = capsys.readouterr().err
    assert ("pre_router_fraction" in err and "version-3" in err) == (overlap == "on")


def test_expert_bytes_and_cost_file(trace: str, tmp_path, capsys) -> None:
    cost = cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=1_000, num_layers=SHAPE.num_layers)
    cost_path = cost.save(tmp_path / "cal" / "cost.json")
    (tmp_path / "cal" / "acceptance.json").write_text(
        json.dumps({"knots_x": [0.0, 1.0], "knots_y": [0.0, 0.5], "source": "test-fit"})
    )
    base = [
        "--trace",
        trace,
        "--bandwidth",
        "16",
        "--cache",
        "4",
        "--policy",
        "ar,topn",
        "--no-progress",
        "--no-figures",
        "--jobs",
        "1",
    ]
    assert main([*base, "--cost", str(cost_path), "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert _last_json(printed)["expert_bytes"] == 1_000
    # the map beside --cost was fitted elsewhere: its source's "this trace" is not the swept one
    assert "fitted on another trace than the one swept (its source: test-fit)" in printed
    assert main([*base, "--expert-bytes", "352321536", "--out", str(tmp_path / "b")]) == 0
    assert _last_json(capsys.readouterr().out)["expert_bytes"] == 352_321_536
    small = pd.read_parquet(tmp_path / "a" / "results.parquet")
    big = pd.read_parquet(tmp_path / "b" / "results.parquet")
    assert (big["tokens_per_s"].to_numpy() < small["tokens_per_s"].to_numpy()).all()


def test_local_pool_equals_in_process(trace: str, tmp_path) -> None:
    cells = _cells(trace)
    one, _, _ = run_sweep(cells, tmp_path / "one", jobs=1, progress=False)
    two, run, skipped = run_sweep(cells, tmp_path / "two", jobs=2, progress=False)
    assert (run, skipped) == (12, 0)
    pd.testing.assert_frame_equal(one, two)


@pytest.mark.slow
def test_ray_executor_equals_local(trace: str, tmp_path) -> None:
    pytest.importorskip("ray")
    cells = _cells(trace)[:6]
    local, _, _ = run_sweep(cells, tmp_path / "local", jobs=1, progress=False)
    remote, run, _ = run_sweep(cells, tmp_path / "ray", executor="ray", jobs=2, progress=False)
    assert run == 6
    pd.testing.assert_frame_equal(local, remote)


def test_per_cycle_records_use_the_trace_cycles_schema(trace: str, tmp_path, capsys) -> None:
    from traces.reader import read_manifest, read_part

    out = tmp_path / "pc"
    argv = [
        "--trace",
        trace,
        "--bandwidth",
        "32",
        "--cache",
        "4",
        "--policy",
        "specfit",
        "--overlap",
        "both",
        "--prefetch",
        "on",
        "--predictor",
        "recent",
        "--per-cycle",
        "--out",
        str(out),
        "--no-progress",
        "--no-figures",
        "--jobs",
        "1",
    ]
    assert main(argv) == 0
    capsys.readouterr()
    results = pd.read_parquet(out / "results.parquet")
    assert len(results) == 2 and set(results["overlap"]) == {"off", "on"}
    for _, row in results.iterrows():
        table = read_part(out / "cycles" / f"{row['cell_id']}.parquet", "cycles", read_manifest(trace))
        cycles = table.to_pandas()
        assert len(cycles) == row["num_cycles"]
        assert cycles["num_committed"].sum() == row["num_committed"]
        assert cycles["cycle_s"].sum() == pytest.approx(row["decode_s"])


def test_trace_selection(trace: str, tmp_path, monkeypatch) -> None:
    import sim.traceselect as ts

    monkeypatch.setattr(ts, "sample_trace_dir", lambda: tmp_path / "no-sample")
    with pytest.raises(ValueError, match="--trace: no sample trace shipped"):
        ts.resolve_trace("sample", synthetic=ts.SyntheticSpec(), root=tmp_path)
    with pytest.raises(ValueError, match="not a trace run directory"):
        ts.resolve_trace(str(tmp_path), synthetic=ts.SyntheticSpec(), root=tmp_path)
    with pytest.raises(ValueError, match=r"--trace: .*nowhere does not exist \(expected a trace run directory"):
        ts.resolve_trace(str(tmp_path / "nowhere"), synthetic=ts.SyntheticSpec(), root=tmp_path)
    spec = ts.SyntheticSpec(
        shape="olmoe-1b-7b",
        num_requests=1,
        positions_per_request=3,
        prompt_len=4,
        tree_depth=2,
        tree_topk=2,
        max_nodes=5,
    )
    path, desc = ts.resolve_trace("auto", synthetic=spec, root=tmp_path / "gen")
    assert desc.startswith("synthetic olmoe-1b-7b trace") and (path / "manifest.json").is_file()
    stamp = (path / "manifest.json").stat().st_mtime_ns
    again, _ = ts.resolve_trace("synthetic:olmoe-1b-7b", synthetic=spec, root=tmp_path / "gen")
    assert again == path and (path / "manifest.json").stat().st_mtime_ns == stamp  # reused, not regenerated
    monkeypatch.setattr(ts, "sample_trace_dir", lambda: Path(trace))
    chosen, desc = ts.resolve_trace("auto", synthetic=spec, root=tmp_path / "gen")
    assert str(chosen) == trace and desc.startswith("shipped sample trace")


def test_out_file_and_policy_mode_trace_are_flag_errors(trace: str, tmp_path, capsys) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["--trace", trace, "--out", str(afile), "--no-progress"])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
    synthetic = pytest.importorskip("calibration.synthetic")
    cost = cost_from_preset(
        "qwen3-30b-a3b-2gpu", expert_bytes=SHAPE.bytes_per_expert, num_layers=SHAPE.num_layers
    )
    policy_run = synthetic.write_synthetic_cycles_run(
        tmp_path / "policy", SHAPE, cost, num_cycles=20, noise_rel=0.0, seed=1
    )
    with pytest.raises(SystemExit) as exc:
        main(["--trace", str(policy_run), "--out", str(tmp_path / "o"), "--no-progress"])
    assert exc.value.code == 2 and "replays dense traces" in capsys.readouterr().err
    from sim.config import SimConfig
    from sim.replay import ReplayError, replay_policy
    from traces.reader import open_run

    with pytest.raises(ReplayError, match="no dense trees to replay"):
        replay_policy(open_run(policy_run), SimConfig(cost=cost, cache_capacity_per_layer=4))


def test_stopping_rule_is_part_of_the_cell_and_recorded(trace: str, tmp_path, capsys) -> None:
    """--stopping reaches SpecFitPolicy: the bound rule drafts at least as many levels per cycle as
    the expected rule in every cell; the rule is in the specfit cells' ids and results, so a sweep
    with the other rule in the same --out redoes the specfit cells, reuses the others and keeps
    the first rule's rows (results hold both; the table shows the rule when it varies)."""
    out = tmp_path / "stop"
    base = [
        "--trace",
        trace,
        "--bandwidth",
        "16,64",
        "--cache",
        "4",
        "--policy",
        "ar,specfit",
        "--out",
        str(out),
    ]
    base += ["--jobs", "1", "--no-progress", "--no-figures"]
    assert main(base) == 0  # default: expected
    printed = capsys.readouterr().out
    assert "SpecFit stopping rule expected (--stopping)" in printed
    expected = pd.read_parquet(out / "results.parquet")
    assert main([*base, "--stopping", "bound"]) == 0
    printed = capsys.readouterr().out
    summary = _last_json(printed)
    assert "SpecFit stopping rule bound (--stopping)" in printed
    assert summary["cells_run"] == 2 and summary["cells_skipped"] == 2  # the 2 ar cells reused
    assert summary["cells_kept_from_earlier_sweeps"] == 2  # the expected rule's specfit cells
    table = (out / "table.txt").read_text()
    titles = next(line for line in table.splitlines() if line.split()[:3] == ["cache", "exp/layer", "cache"])
    assert "stopping" in titles.split()  # the table shows the rule where it varies
    assert sum(" expected " in line for line in table.splitlines()) == 2
    union = pd.read_parquet(out / "results.parquet")
    assert len(union) == 6
    spec_e = expected[expected["policy"] == "specfit"].reset_index(drop=True)
    kept = union[(union["policy"] == "specfit") & (union["stopping"] == "expected")]
    assert sorted(kept["cell_id"]) == sorted(spec_e["cell_id"])
    bound = union[union["stopping"] != "expected"]
    spec_b = bound[bound["policy"] == "specfit"].reset_index(drop=True)
    assert spec_e["stopping"].tolist() == ["expected", "expected"]
    assert spec_b["stopping"].tolist() == ["bound", "bound"]
    assert bound.loc[bound["policy"] == "ar", "stopping"].isna().all()
    assert set(spec_e["cell_id"]).isdisjoint(spec_b["cell_id"])
    # the rules differ in every cell; which drafts more levels on average is not fixed: the bound
    # rule drafts deeper once drafting, but the throughput guard (issue 12) declines on the root by
    # the realised rates (its paired root-alone prices judge those deeper cycles), and on this tiny
    # trace it declines more of the bound rule's cycles at 64 GB/s
    assert (spec_b["mean_draft_levels"] != spec_e["mean_draft_levels"]).all()
    cells = json.loads((out / "sweep.json").read_text())["cells"]
    options = [c["policy_options"] for c in cells if c["policy"] == "specfit"]
    assert options == [{"stopping": "expected"}] * 2 + [{"stopping": "bound"}] * 2
    assert all(c["policy_options"] is None for c in cells if c["policy"] == "ar")


def test_cell_options_keep_ids_and_are_checked(trace: str) -> None:
    import dataclasses

    from sim.cells import CellSpec

    cell = _cells(trace)[2]
    assert cell.policy == "specfit" and cell.policy_options is None
    # a cell without options hashes as before the field existed
    legacy = {k: v for k, v in cell.to_dict().items() if k not in ("policy_options", "planner_deadline_fraction")}
    assert cell.cell_id == CellSpec(**legacy).cell_id
    timed = dataclasses.replace(cell, planner_deadline_fraction=0.1)
    assert timed.cell_id != cell.cell_id and timed.sim_config().planner_deadline_fraction == 0.1
    bound = dataclasses.replace(cell, policy_options={"stopping": "bound"})
    assert bound.cell_id != cell.cell_id
    assert bound.sim_config().policy_options == (("stopping", "bound"),)
    with pytest.raises(ValueError, match="SimConfig.policy_options: .*stopping must be one of"):
        dataclasses.replace(cell, policy_options={"stopping": "never"}).sim_config()


def test_planner_deadline_reaches_the_specfit_cells_and_their_rows(trace: str, tmp_path, capsys) -> None:
    """rev7 (issue 14 item 2): --planner-deadline-fraction gives SpecFit's search the live
    engine's deadline rule; every row has planner_deadline_hits and planner_mean_gap (both 0
    without a deadline, as live). A fraction of 0 cuts every search past the seed (oracle experts, overlap
    on: the plans need searching), so hits are counted; the header and table say so."""
    base = ["--trace", trace, "--bandwidth", "16", "--cache", "4", "--policy", "ar,specfit", "--predictor", "oracle"]
    base += ["--overlap", "on", "--jobs", "1", "--no-progress", "--no-figures"]
    assert main([*base, "--out", str(tmp_path / "free")]) == 0
    assert "planner deadline" not in capsys.readouterr().out
    free = pd.read_parquet(tmp_path / "free" / "results.parquet")
    assert (free["planner_deadline_hits"] == 0).all() and (free["planner_mean_gap"] == 0).all()
    assert free["planner_deadline_fraction"].isna().all()
    assert "dl hits" not in (tmp_path / "free" / "table.txt").read_text()
    assert main([*base, "--planner-deadline-fraction", "0", "--out", str(tmp_path / "cut")]) == 0
    printed = capsys.readouterr().out
    assert "planner deadline: SpecFit's exact search stops at 0 of the cycle's least predicted time" in printed
    assert "nothing to cut" not in printed  # the oracle predictor's plans are searched
    cut = pd.read_parquet(tmp_path / "cut" / "results.parquet").set_index("policy")
    assert cut.loc["specfit", "planner_deadline_fraction"] == 0.0
    assert cut.loc["specfit", "planner_deadline_hits"] > 0 and cut.loc["specfit", "planner_mean_gap"] > 0
    assert cut.loc["ar", "planner_deadline_hits"] == 0 and np.isnan(cut.loc["ar", "planner_deadline_fraction"])
    assert cut.loc["ar", "cell_id"] in set(free["cell_id"])  # ar cells unchanged, specfit cells new
    assert cut.loc["specfit", "cell_id"] not in set(free["cell_id"])
    table = (tmp_path / "cut" / "table.txt").read_text()
    assert "dl hits" in table and "dl gap" in table
    # a sweep into that folder with another deadline cannot tell its rows apart: refused, naming the field
    for deadline, folder in (([], "cut"), (["--planner-deadline-fraction", "0"], "free")):
        with pytest.raises(SystemExit) as exc:
            main([*base, *deadline, "--out", str(tmp_path / folder)])
        assert exc.value.code == 2
        assert "another planner_deadline_fraction;" in capsys.readouterr().err


def test_cost_file_without_bandwidth_sweeps_its_own_link(trace: str, tmp_path, capsys) -> None:
    """A calibrated cost JSON and no --bandwidth: the sweep runs at the file's h2d_bytes_per_s (in
    GB/s) and says so; --bandwidth given still replaces it."""
    import dataclasses

    cost = cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=1_000, num_layers=SHAPE.num_layers)
    cost = dataclasses.replace(cost, h2d_bytes_per_s=4.25e9)
    cost_path = cost.save(tmp_path / "cal" / "cost.json")
    base = ["--trace", trace, "--cache", "4", "--policy", "ar", "--cost", str(cost_path)]
    base += ["--jobs", "1", "--no-progress", "--no-figures", "--acceptance", "draft"]
    assert main([*base, "--out", str(tmp_path / "own")]) == 0
    printed = capsys.readouterr().out
    own = pd.read_parquet(tmp_path / "own" / "results.parquet")
    assert own["bandwidth_gb_per_s"].tolist() == [pytest.approx(4.25)]
    line = next(x for x in printed.splitlines() if x.startswith("bandwidth: "))
    assert line == (
        "bandwidth: the cost file's 4.25 GB/s (its h2d_bytes_per_s 4.25e+09 B/s; --bandwidth not given)"
    )
    assert main([*base, "--bandwidth", "16,64", "--out", str(tmp_path / "given")]) == 0
    printed = capsys.readouterr().out
    given = pd.read_parquet(tmp_path / "given" / "results.parquet")
    assert given["bandwidth_gb_per_s"].tolist() == [16.0, 64.0]
    assert "bandwidth: 16, 64 GB/s (--bandwidth) replaces the cost file's 4.25 GB/s" in printed
    assert (given["tokens_per_s"] > own["tokens_per_s"].iloc[0]).all()  # a faster link than the file's


# ---- decision regret (issue 12, item 2): SpecFit with oracle inputs and the per-cell decomposition


def _regret_cost():
    return cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=9_437_184, num_layers=SHAPE.num_layers)


def _cycles(trace: str, policy: str):
    config = SimConfig(cost=_regret_cost().with_bandwidth(16e9), policy=policy, cache_capacity_per_layer=4)
    return replay_policy(open_run(trace), config).cycles


def test_oracle_acceptance_predicts_the_realised_acceptance_exactly(trace: str) -> None:
    cycles = _cycles(trace, "specfit-oracle-accept")
    assert cycles
    for c in cycles:  # P = recorded path-accepted flags: E[committed] is what the cycle commits
        assert c.predicted_expected_committed == pytest.approx(c.num_accepted + 1)
    drafted = _cycles(trace, "specfit")
    assert any(c.predicted_expected_committed != pytest.approx(c.num_accepted + 1) for c in drafted)


def test_oracle_experts_predict_the_realised_transfers(trace: str) -> None:
    """With the true experts (no overlap, no planner time) the predicted cycle time is the simulated one."""
    for c in _cycles(trace, "specfit-oracle-experts"):
        assert c.predicted_cycle_s == pytest.approx(c.cycle_s, rel=1e-6, abs=1e-8)


def test_regret_decomposition_per_cell(trace: str) -> None:
    cells = make_cells(
        trace_path=trace,
        cost=_regret_cost(),
        bandwidths_gb_per_s=[4, 64],
        caches=parse_cache_sizes(["0.25"], SHAPE.num_experts),
        policies=["ar", "chain", "topn", "cascade", "specfit", *ORACLE_VARIANTS],
        policy_options={"specfit": {"stopping": "expected"}},
    )
    assert {c.policy_options["stopping"] for c in cells if "specfit" in c.policy} == {"expected"}
    df = results_frame([run_cell(c) for c in cells])
    spec = df[df["policy"] == "specfit"]
    assert len(spec) == 2 and spec[list(REGRET_COLUMNS)].notna().all().all()
    lossless = df.groupby("bandwidth_gb_per_s")["tokens_per_s"].max()
    for _, row in spec.iterrows():
        best = lossless[row["bandwidth_gb_per_s"]]
        assert row["best_in_hindsight_tokens_per_s"] == pytest.approx(best)
        assert row["regret_total"] == pytest.approx((best - row["tokens_per_s"]) / best)
        parts = row[["regret_acceptance", "regret_experts", "regret_myopic", "regret_interaction"]]
        assert float(np.sum(parts)) == pytest.approx(row["regret_total"])
        assert row["regret_total"] >= 0 and row["regret_myopic"] >= 0
    assert df[df["policy"] != "specfit"][list(REGRET_COLUMNS)].isna().all().all()


# ---- a planner that never loses (issue 12, item 3) and the lossy MoE-Spec baseline


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> str:
    from traces.synthetic import resolve_config

    cfg = resolve_config("qwen3-30b-a3b", num_requests=1, positions_per_request=48)
    return str(generate_dense_trace(tmp_path_factory.mktemp("cal") / "q", "qwen3-30b-a3b", **cfg.__dict__))


def test_specfit_never_below_a_baseline_on_a_calibrated_trace(calibrated: str) -> None:
    """Calibrated Qwen3-30B-A3B-shape trace (speculation barely pays there): SpecFit (with its
    throughput guard) is at least max(ar, chain, topn, cascade) of each cell within NOISE_REL."""
    from sim.report import NOISE_REL

    cost = cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=9_437_184, num_layers=48)
    cells = make_cells(
        trace_path=calibrated,
        cost=cost,
        bandwidths_gb_per_s=[2, 64],
        caches=parse_cache_sizes(["0.125", "0.5"], 128),
        policies=["ar", "chain", "topn", "cascade", "specfit"],
        overlaps=[False, True],
    )
    df = results_frame([run_cell(c) for c in cells])
    spec = df[df["policy"] == "specfit"]
    assert len(spec) == 8
    assert (spec["specfit_vs_best_baseline"] >= 1.0 - NOISE_REL).all(), spec["specfit_vs_best_baseline"].tolist()
    assert not df["specfit_below_baseline_beyond_noise"].any()
    unguarded = [
        run_cell(CellSpec(**{**c.to_dict(), "policy_options": {"guard": False}}))["tokens_per_s"]
        for c in cells
        if c.policy == "specfit"
    ]
    assert min(u / g for u, g in zip(unguarded, spec["tokens_per_s"])) < 1.0  # the guard is what holds it


def test_moespec_is_lossy_budgeted_and_needs_the_flag(trace: str, tmp_path, capsys) -> None:
    base = ["--trace", trace, "--bandwidth", "16", "--cache", "4", "--jobs", "1", "--no-progress", "--no-figures"]
    with pytest.raises(SystemExit) as exc:
        main([*base, "--policy", "ar,moespec", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "--policy" in capsys.readouterr().err
    out = tmp_path / "lossy"
    assert main([*base, "--policy", "ar,topn", "--lossy", "--expert-budget", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "moespec (lossy)" in printed and "lossy baseline moespec (--lossy)" in printed
    df = pd.read_parquet(out / "results.parquet")
    rows = df.set_index("policy")
    assert rows.loc["moespec", "lossy"] and not rows.loc["topn", "lossy"]
    # the budget caps each cycle's per-layer transfers: at most 2 experts per layer per cycle
    per_cycle = rows.loc["moespec", "num_transfers"] / rows.loc["moespec", "num_cycles"]
    assert per_cycle <= 2 * SHAPE.num_layers
    assert rows.loc["moespec", "h2d_bytes"] < rows.loc["topn", "h2d_bytes"]


def test_synthetic_real_shape_trace_is_priced_at_its_own_expert_size(tmp_path, monkeypatch, capsys) -> None:
    """A calibrated synthetic trace of a named shape is priced at that shape's expert size (Mixtral's
    352 MB experts, not Qwen3's 9.4 MB), unless --model-shape / --expert-bytes say otherwise."""
    from specfit.shapes import get_model_shape

    monkeypatch.chdir(tmp_path)  # the synthetic trace is generated under ./runs/sim/traces
    base = ["--trace", "synthetic:mixtral-8x7b", "--synthetic-requests", "1", "--synthetic-positions", "6"]
    base += ["--bandwidth", "16", "--cache", "0.5", "--policy", "ar", "--jobs", "1", "--no-progress"]
    assert main([*base, "--out", "own"]) == 0
    out = capsys.readouterr().out
    assert _last_json(out)["expert_bytes"] == get_model_shape("mixtral-8x7b").bytes_per_expert
    assert "mixtral-8x7b expert size" in out
    assert main([*base, "--out", "qwen", "--model-shape", "qwen3-30b-a3b"]) == 0
    assert _last_json(capsys.readouterr().out)["expert_bytes"] == 9_437_184


@pytest.fixture(scope="module")
def guessed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A hand-made dense trace WITH next-layer guesses (synthetic traces carry none): one request,
    8 positions of 6-node trees, 3 layers x 8 experts, top-2 (``test_traces_helpers``)."""
    from test_traces_helpers import random_routing, small_manifest, tree_rows

    from traces.writer import TraceWriter

    rng = np.random.default_rng(3)

    def guesses(rows: int) -> np.ndarray:  # a router's top-2 of 8 per layer l+1, distinct ids
        return np.stack([[rng.permutation(8)[:2] for _ in range(2)] for _ in range(rows)])

    path = tmp_path_factory.mktemp("guessed") / "hand"
    generated = rng.integers(0, 100, size=10)
    with TraceWriter(path, small_manifest("dense")) as writer:
        writer.add_prefill(0, *random_routing(rng, 4), guesses(4))
        for pos in range(8):
            rows = tree_rows(rng, pos, generated)
            ids, weights = random_routing(rng, 6)
            writer.add_tree(0, pos, 4 + pos, expert_ids=ids, router_weights=weights, next_layer_expert_ids=guesses(6), **rows)
        writer.add_request(0, rng.integers(0, 100, size=4), generated[:8], "hand-made")
    return str(path)


def _guessed_sweep(trace: str, tmp_path, *extra: str) -> list[str]:
    argv = ["--trace", trace, "--bandwidth", "4", "--cache", "2", "--policy", "ar,specfit"]
    return [*argv, "--no-progress", "--no-figures", "--jobs", "1", "--out", str(tmp_path / "sweep"), *extra]


def _sweep_cells(out: Path) -> list[dict]:
    return json.loads((out / "sweep.json").read_text())["cells"]


def test_pilot_share_is_fit_next_layer_terms_of_the_ar_chain_and_topn_counts(guessed: str) -> None:
    """Issue 13 item 3: the share a cost without one gets is calibration.costfit's fit on the
    per-cycle used/wasted/demand-miss counts and verified nodes of ar, chain and topn replayed
    with --prefetch next-layer at the cell's cache, pooled and per tree size (knots), and those
    counts do not depend on the bandwidth or the overlap (one pilot per cache)."""
    import dataclasses

    from calibration.costfit import fit_next_layer_terms
    from sim.sweep import pilot_next_layer_share

    cost = cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=9_437_184, num_layers=3)
    (cell,) = make_cells(
        trace_path=guessed, cost=cost, bandwidths_gb_per_s=[4], caches=[(2, 0.25)], policies=["specfit"],
        overlaps=["on"], prefetches=["both"],
    )  # fmt: skip
    fit = pilot_next_layer_share(cell)
    counts = {"num_nodes_verified": [], "cache_misses": [], "num_prefetch_used": [], "num_prefetch_wasted": [], "layer_misses": []}
    run = open_run(guessed)
    for policy in ("ar", "chain", "topn"):
        for bandwidth, overlap in ((4.0, "off"), (64.0, "on")):  # timing never changes the counts
            other = dataclasses.replace(cell, policy=policy, policy_options=None, bandwidth_gb_per_s=bandwidth)
            config = dataclasses.replace(other, overlap=overlap, prefetch="next-layer").sim_config(record_cycles=True)
            cycles = replay_policy(run, config).cycles
            per_policy = {name: [getattr(c, name) for c in cycles] for name in counts}
            if overlap == "off":
                for name in counts:
                    counts[name] += per_policy[name]
            else:
                assert per_policy == {name: values[-len(cycles):] for name, values in counts.items()}
    expected = fit_next_layer_terms(pd.DataFrame(counts))
    assert (fit.cover_fraction, fit.waste_per_miss) == (expected.cover_fraction, expected.waste_per_miss)
    assert (fit.nodes, fit.cover_fractions, fit.waste_per_misses) == (expected.nodes, expected.cover_fractions, expected.waste_per_misses)
    assert fit.nodes and fit.nodes[0] >= 1.0  # (the tiny trace has too few misses for a knot per size)
    assert fit.num_used > 0 and fit.num_wasted > 0 and fit.num_misses > 0 and 0.0 < fit.cover_fraction < 1.0
    used, misses = sum(counts["num_prefetch_used"]), sum(counts["cache_misses"])
    misses -= sum(int(m[0]) for m in counts["layer_misses"])  # layer 0: no guess, left out
    assert fit.cover_fraction == pytest.approx(used / (used + misses))


def test_sweep_prices_next_layer_prefetch_with_the_pilot_share_and_says_so(guessed: str, tmp_path, capsys) -> None:
    """A preset has no next-layer share: the next-layer cells' cost carries the pilot's share, the
    header says the values and where they came from, no warning is printed, and the cells
    without next-layer prefetch keep the preset's cost (and their ids)."""
    from sim.sweep import pilot_next_layer_share

    assert main(_guessed_sweep(guessed, tmp_path, "--prefetch", "none,next-layer")) == 0
    out, err = capsys.readouterr()
    assert "no next-layer prefetch share" not in err
    cells = {c["prefetch"]: c for c in _sweep_cells(tmp_path / "sweep") if c["policy"] == "specfit"}
    fit = pilot_next_layer_share(CellSpec(**{k: v for k, v in cells["none"].items() if k != "cell_id"}))
    share = (cells["next-layer"]["cost"]["next_layer_cover_fraction"], cells["next-layer"]["cost"]["next_layer_waste_per_miss"])
    assert share == (fit.cover_fraction, fit.waste_per_miss) and fit.cover_fraction > 0
    assert tuple(cells["next-layer"]["cost"]["next_layer_nodes"]) == fit.nodes and fit.nodes
    assert tuple(cells["next-layer"]["cost"]["next_layer_cover_fractions"]) == fit.cover_fractions
    assert cells["none"]["cost"]["next_layer_cover_fraction"] == 0.0
    line = next(h for h in out.splitlines() if h.startswith("next-layer prefetch:"))
    assert "pilot replays of ar, chain and topn" in line and "has no share" in line
    assert fit.knots_text() in line and "per tree size" in line
    assert f"cache 2 lru: {fit.cover_fraction:.3f} covered, {fit.waste_per_miss:.3f} wasted/miss" in line
    assert f"{fit.num_used} used, {fit.num_wasted} wasted, {fit.num_misses} demand misses" in line
    results = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert len(results) == 4 and results["tokens_per_s"].gt(0).all()


def test_a_cost_file_with_its_own_next_layer_share_keeps_it(guessed: str, tmp_path, capsys) -> None:
    """A fitted cost JSON with a next-layer share prices the next-layer cells with that share (no
    pilot), and the header says so."""
    import dataclasses

    cost = cost_from_preset("qwen3-30b-a3b-2gpu", expert_bytes=9_437_184, num_layers=3)
    cost = dataclasses.replace(cost, next_layer_cover_fraction=0.3, next_layer_waste_per_miss=0.125)
    cost.save(tmp_path / "cost.json")
    argv = _guessed_sweep(guessed, tmp_path, "--prefetch", "next-layer", "--cost", str(tmp_path / "cost.json"))
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "no next-layer prefetch share" not in err
    line = next(h for h in out.splitlines() if h.startswith("next-layer prefetch:"))
    assert "own share 0.300" in line and "0.125 wasted" in line and str(tmp_path / "cost.json") in line
    assert "at every tree size" in line
    assert "pilot" not in line
    for cell in _sweep_cells(tmp_path / "sweep"):
        assert (cell["cost"]["next_layer_cover_fraction"], cell["cost"]["next_layer_waste_per_miss"]) == (0.3, 0.125)


def test_overlap_ideal_runs_no_pilot_and_says_no_share_is_priced(guessed: str, tmp_path, capsys) -> None:
    """--overlap ideal is a bound that prices no next-layer share: no pilot replay runs for its
    cells, their cost keeps the preset's zero share, and the header does not print a pilot share."""
    argv = _guessed_sweep(guessed, tmp_path, "--prefetch", "next-layer", "--overlap", "ideal")
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    line = next(h for h in out.splitlines() if h.startswith("next-layer prefetch:"))
    assert "no share priced" in line and "--overlap ideal" in line and "pilot" not in line
    for cell in _sweep_cells(tmp_path / "sweep"):
        assert cell["overlap"] == "ideal" and cell["cost"]["next_layer_cover_fraction"] == 0.0


def test_the_pilot_line_without_knots_ends_cleanly(guessed: str, tmp_path, capsys, monkeypatch) -> None:
    """A pilot share without knots (too few misses for one per tree size): its cache's part of the
    header line ends with the demand misses, no dangling comma."""
    import sim.sweep
    from specfit.prefetch import NextLayerShare

    monkeypatch.setattr(sim.sweep, "pilot_next_layer_share", lambda cell: NextLayerShare(0.25, 0.125, 3, 1, 9, (), (), ()))
    assert main(_guessed_sweep(guessed, tmp_path, "--prefetch", "next-layer")) == 0
    line = next(h for h in capsys.readouterr().out.splitlines() if h.startswith("next-layer prefetch:"))
    assert line.endswith("cache 2 lru: 0.250 covered, 0.125 wasted/miss (1 used, 9 wasted, 3 demand misses)"), line
    assert ", ," not in line and not line.rstrip().endswith(",")


def test_planner_deadline_with_union_size_says_there_is_nothing_to_cut(trace: str, tmp_path, capsys) -> None:
    """The default union-size predictor plans without a search: a deadline cuts nothing and the
    results stay deterministic; the header says so instead of 'results depend on its speed' alone
    (a fresh-clone user found the README's example changed nothing)."""
    base = ["--trace", trace, "--bandwidth", "16", "--cache", "4", "--policy", "ar,specfit"]
    base += ["--jobs", "1", "--no-progress", "--no-figures", "--planner-deadline-fraction", "0"]
    assert main([*base, "--out", str(tmp_path / "u")]) == 0
    assert "union-size predictor plans without a search: nothing to cut" in capsys.readouterr().out
    rows = pd.read_parquet(tmp_path / "u" / "results.parquet").set_index("policy")
    assert rows.loc["specfit", "planner_deadline_hits"] == 0


def test_a_folder_from_before_an_optional_cell_field_still_takes_new_cells(trace: str, tmp_path) -> None:
    """rev8: sweep.json written before ``planner_deadline_fraction`` existed lacks the key; a
    default sweep (no deadline) into that folder keeps its cells instead of refusing them as
    'another planner_deadline_fraction'."""
    out = tmp_path / "old"
    base = ["--trace", trace, "--cache", "4", "--policy", "ar,specfit", "--jobs", "1", "--no-progress", "--no-figures"]
    assert main([*base, "--bandwidth", "16", "--out", str(out)]) == 0
    recorded = json.loads((out / "sweep.json").read_text())
    for cell in recorded["cells"]:
        cell.pop("planner_deadline_fraction", None)  # as the sweep wrote it before e7eb933
    (out / "sweep.json").write_text(json.dumps(recorded))
    assert main([*base, "--bandwidth", "32", "--out", str(out)]) == 0
    rows = pd.read_parquet(out / "results.parquet")
    assert sorted(rows["bandwidth_gb_per_s"].unique()) == [16.0, 32.0] and len(rows) == 4
