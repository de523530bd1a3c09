"""What a new user runs into: unwritable outputs, Ctrl-C, typos in lists, bytes/s for GB/s,
cache fractions that round to nothing, link presets, too few H2D sizes, bad cost files.

Every case exits 2 naming the flag (before any work) or ends with the one-line JSON summary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from tiny_shapes import TINY_COST, TINY_MOE, tiny_shape, tiny_sweep_trace

from traces.synthetic import generate_dense_trace

SHAPE = tiny_shape(12_288, "tiny")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_sweep_trace(tmp_path_factory.mktemp("robust") / "tiny")


@pytest.fixture()
def afile(tmp_path: Path) -> Path:
    path = tmp_path / "afile"
    path.write_text("x")
    return path


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def _exits_2(main, argv: list[str], capsys, *needles: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


# 1. output paths that cannot be created: exit 2 naming the flag, before any work


def test_sweep_out_under_a_file(trace: str, afile: Path, capsys) -> None:
    from sim import sweep

    _exits_2(sweep.main, ["--trace", trace, "--out", str(afile / "sub")], capsys, "--out:", "is a file")


def test_synthetic_out_under_a_file(afile: Path, capsys) -> None:
    from traces import synthetic

    _exits_2(synthetic.main, ["--out", str(afile / "sub")], capsys, "--out:", "is a file")
    _exits_2(synthetic.main, ["--out", str(afile)], capsys, "--out:", "is a file")


def test_record_out_under_a_file_before_the_model_loads(afile: Path, capsys, monkeypatch) -> None:
    import live.spec.session as session
    from live import record

    def no_model(*args, **kwargs):  # the model must not be loaded for a bad --out
        raise AssertionError("model loaded before --out was checked")

    monkeypatch.setattr(session.RecordSession, "open", no_model)
    _exits_2(record.main, ["--out", str(afile / "run")], capsys, "--out:", "is a file")
    _exits_2(record.main, ["--out", str(afile)], capsys, "--out:", "is a file")


def test_fit_out_folder_checked_before_the_fit(afile: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from calibration import fit

    monkeypatch.setattr(fit, "calibrate", lambda *a: pytest.fail("fit ran before --out was checked"))
    _exits_2(fit.main, ["x", "--out", str(afile / "cost.json")], capsys, "--out:", "is a file")
    _exits_2(fit.main, ["x", "--out", str(tmp_path)], capsys, "--out:", "is a folder")


def test_h2d_out_dir_under_a_file(afile: Path, capsys) -> None:
    from calibration import h2d

    _exits_2(h2d.main, ["--device", "cpu", "--out-dir", str(afile / "h")], capsys, "--out:", "is a file")


def test_validate_out_under_a_file(afile: Path, capsys) -> None:
    from analysis import validate

    _exits_2(validate.main, ["--out", str(afile / "v")], capsys, "--out:", "is a file")


# 2. Ctrl-C during a sweep


def _sweep_argv(trace: str, out: Path) -> list[str]:
    return [
        "--trace", trace, "--bandwidth", "8,16", "--cache", "2", "--policy", "ar,chain",
        "--out", str(out), "--no-progress", "--no-figures", "--jobs", "1",
    ]  # fmt: skip


def test_sweep_interrupt_keeps_cells_and_ends_with_json(trace: str, tmp_path: Path, capsys, monkeypatch) -> None:
    from sim import sweep
    from sim.cells import run_cell

    def one_then_ctrl_c(cells, on_result, **kwargs):
        on_result(cells[0], run_cell(cells[0].to_dict()))
        raise KeyboardInterrupt

    out = tmp_path / "s"
    monkeypatch.setattr(sweep, "run_cells", one_then_ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    assert sweep.main(_sweep_argv(trace, out)) == 130
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C handling restored
    captured = capsys.readouterr()
    summary = _last_json(captured.out)
    assert summary["interrupted"] is True and summary["cells_done"] == 1 and summary["num_cells"] == 4
    assert summary["out"] == str(out)
    assert "finished cells are kept" in captured.err and "re-running the same command skips them" in captured.err
    assert "Traceback" not in captured.err
    monkeypatch.undo()
    assert sweep.main(_sweep_argv(trace, out)) == 0
    summary = _last_json(capsys.readouterr().out)
    assert (summary["cells_skipped"], summary["cells_run"]) == (1, 3)


def test_sweep_ctrl_c_stops_the_local_pool(trace: str, tmp_path: Path) -> None:
    """A real SIGINT to the whole process group (a terminal's Ctrl-C) with 2 worker processes."""
    out = tmp_path / "pool"
    argv = _sweep_argv(trace, out)
    argv[argv.index("--bandwidth") + 1] = ",".join(str(b) for b in range(1, 201))  # 400 cells: still running
    argv[argv.index("--jobs") + 1] = "2"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim.sweep", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list((out / "cells").glob("*.json")) and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)  # no hang on the pool's shutdown
    assert proc.returncode == 130, stderr
    summary = _last_json(stdout)
    assert summary["interrupted"] is True and summary["num_cells"] == 400
    assert 1 <= summary["cells_done"] < 400
    assert summary["cells_done"] == len(list((out / "cells").glob("*.json")))
    assert "Traceback" not in stderr and "finished cells are kept" in stderr
    for _ in range(50):  # every worker process has gone
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("worker processes of the interrupted sweep are still running")


# 3-5. list items, bandwidth units, cache fractions


@pytest.mark.parametrize(
    ("argv", "flag", "needle"),
    [
        (["--bandwidth", "16,,32"], "--bandwidth", "empty item in '16,,32'"),
        (["--bandwidth", "16,32,"], "--bandwidth", "empty item in '16,32,'"),
        (["--policy", "ar,,specfit"], "--policy", "empty item"),
        (["--bandwidth", "16e9"], "--bandwidth", "looks like bytes/s"),
        (["--cache", "0.0001"], "--cache", "rounds to 0 (no cache); give 0 explicitly"),
        (["--cache", "1%"], "--cache", "0.16 experts"),
    ],
)
def test_sweep_flag_typos_exit_2(trace: str, tmp_path: Path, capsys, argv, flag, needle) -> None:
    from sim import sweep

    _exits_2(sweep.main, ["--trace", trace, "--out", str(tmp_path / "x"), *argv], capsys, flag, needle)


def test_cache_fraction_rounding_to_zero_is_an_error_but_explicit_zero_is_not() -> None:
    from sim.cells import parse_cache_sizes

    assert parse_cache_sizes(["0", "0.0625", "1"], 16) == [(0, 0.0), (1, 0.0625), (1, 0.0625)]
    with pytest.raises(ValueError, match=r"'0.01' of the trace's 16 experts per layer is 0.16 experts"):
        parse_cache_sizes(["0.01"], 16)


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("live.record", ["--bandwidth", "16e9"]),
        ("analysis.validate", ["--bandwidth", "1,16e9"]),
        ("calibration.h2d", ["--bandwidth", "4e10"]),
    ],
)
def test_every_bandwidth_flag_is_in_gb_per_s(module: str, argv: list[str], capsys) -> None:
    import importlib

    main = importlib.import_module(module).main
    _exits_2(main, argv, capsys, "--bandwidth", "in GB/s", "looks like bytes/s")


# 6. --cost COMPUTE+LINK sets the bandwidth; the header names the acceptance file read


def _run_sweep(trace: str, out: Path, capsys, *extra: str) -> tuple[pd.DataFrame, str]:
    from sim import sweep

    argv = ["--trace", trace, "--cache", "2", "--policy", "ar", "--out", str(out)]
    assert sweep.main([*argv, "--no-progress", "--no-figures", "--jobs", "1", *extra]) == 0
    return pd.read_parquet(out / "results.parquet"), capsys.readouterr().out


def test_link_preset_sets_the_bandwidth(trace: str, tmp_path: Path, capsys) -> None:
    results, printed = _run_sweep(trace, tmp_path / "a", capsys, "--cost", "qwen3-30b-a3b-2gpu+pcie3-x16")
    assert results["bandwidth_gb_per_s"].tolist() == [12.0]
    assert "bandwidth: the pcie3-x16 link's 12 GB/s (--bandwidth not given)" in printed
    results, printed = _run_sweep(
        trace, tmp_path / "b", capsys, "--cost", "qwen3-30b-a3b-2gpu+pcie3-x16", "--bandwidth", "16,32"
    )
    assert results["bandwidth_gb_per_s"].tolist() == [16.0, 32.0]
    assert "bandwidth: 16, 32 GB/s (--bandwidth) replaces the pcie3-x16 link's 12 GB/s" in printed
    header = json.loads((tmp_path / "b" / "sweep.json").read_text())["header"]
    assert any("replaces the pcie3-x16 link's 12 GB/s" in line for line in header)


def test_default_sweep_bandwidths_unchanged(trace: str, tmp_path: Path, capsys) -> None:
    plain, printed = _run_sweep(trace, tmp_path / "plain", capsys)
    assert plain["bandwidth_gb_per_s"].tolist() == [16.0, 32.0, 64.0]
    assert "bandwidth: 16, 32, 64 GB/s (--bandwidth default) replaces the pcie5-x16 link's 55 GB/s" in printed
    # the documented default command is the same sweep: same cells, so it resumes every one
    from sim import sweep

    argv = ["--trace", trace, "--cache", "2", "--policy", "ar", "--out", str(tmp_path / "plain")]
    assert sweep.main([*argv, "--bandwidth", "16,32,64", "--no-progress", "--no-figures"]) == 0
    assert _last_json(capsys.readouterr().out)["cells_skipped"] == 3
    # a cost preset without a link keeps the default bandwidths
    compute_only, _ = _run_sweep(trace, tmp_path / "c", capsys, "--cost", "qwen3-30b-a3b-2gpu")
    assert compute_only["bandwidth_gb_per_s"].tolist() == [16.0, 32.0, 64.0]


def test_header_names_the_acceptance_file_read(tmp_path: Path, capsys) -> None:
    small = generate_dense_trace(
        tmp_path / "t", SHAPE, num_requests=1, positions_per_request=6, prompt_len=4, tree_depth=2,
        tree_topk=2, max_nodes=5, seed=1,
    )  # fmt: skip
    # as `calibration.fit T --out T/cost.json` leaves it on a trace without timed cycles: no cost.json
    acceptance = {"knots_x": [0.0, 1.0], "knots_y": [0.0, 0.5], "source": f"calibration.fit {small}/cost.json"}
    (Path(small) / "acceptance.json").write_text(json.dumps(acceptance))
    _, printed = _run_sweep(str(small), tmp_path / "s", capsys, "--bandwidth", "16")
    assert f"(map read from {small}/acceptance.json)" in printed


# 7. calibration.h2d


def test_h2d_needs_two_sizes(tmp_path: Path, capsys) -> None:
    from calibration import h2d

    for sizes in ("1", "1,1"):
        _exits_2(
            h2d.main,
            ["--sizes-mib", sizes, "--out-dir", str(tmp_path / "h")],
            capsys,
            "--sizes-mib:",
            "needs >= 2 sizes to separate bandwidth and latency",
        )
    assert not (tmp_path / "h").exists()  # flag errors come before the output folder


def test_h2d_cuda_without_cuda_exits_2(tmp_path: Path, capsys) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from calibration import h2d

    _exits_2(h2d.main, ["--device", "cuda", "--out-dir", str(tmp_path / "h")], capsys, "--device:", "'cuda'")
    assert not (tmp_path / "h").exists()


# 8. analysis.validate --cost checked before any work


def _cost_file(tmp_path: Path, **changes) -> Path:
    data = TINY_COST.to_dict()
    for key, value in changes.items():
        if key == "units":
            data["units"] = {**data["units"], **value}
        else:
            data[key] = value
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    return path


def test_validate_rejects_a_bad_cost_file_before_recording(tmp_path: Path, capsys, monkeypatch) -> None:
    from analysis import validate

    monkeypatch.setattr(validate.Validator, "run", lambda self: pytest.fail("validation ran"))
    out = tmp_path / "v"
    bad_unit = _cost_file(tmp_path, units={"h2d_bytes_per_s": "GB/s"})
    _exits_2(validate.main, ["--cost", str(bad_unit), "--out", str(out)], capsys, "--cost:", "h2d_bytes_per_s")
    bad_field = _cost_file(tmp_path, verify_base_s=-1.0)
    _exits_2(validate.main, ["--cost", str(bad_field), "--out", str(out)], capsys, "--cost:", "verify_base_s")
    # the embedded default model has 6 MoE layers; TINY_COST was calibrated for 4
    assert TINY_COST.num_layers == 4 and validate._moe_layers("default") == 6
    other_model = _cost_file(tmp_path)
    _exits_2(
        validate.main,
        ["--cost", str(other_model), "--out", str(out)],
        capsys,
        "--cost:",
        "field 'num_layers' is 4",
        "has 6 MoE layers",
    )
    assert not out.exists()


def test_validate_accepts_a_cost_of_the_right_model(tmp_path: Path) -> None:
    import dataclasses

    from analysis import validate
    from specfit.cli import ArgumentParser

    good = dataclasses.replace(TINY_COST, num_layers=6).save(tmp_path / "good.json")
    args = validate.build_parser().parse_args(["--cost", str(good)])
    assert validate.check_cost(args, ArgumentParser(prog="t")) == dataclasses.replace(TINY_COST, num_layers=6)


def test_moe_layers_of_checkpoint_configs(tmp_path: Path) -> None:
    from analysis import validate

    def layers(config: dict) -> int | None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return validate._moe_layers(str(tmp_path))

    assert layers({"num_hidden_layers": 48, "num_experts": 128, "mlp_only_layers": [0, 1]}) == 46
    assert layers({"num_hidden_layers": 24, "num_experts": 60, "decoder_sparse_step": 2}) == 12
    assert layers({"num_hidden_layers": 27, "n_routed_experts": 64, "first_k_dense_replace": 1}) == 26
    assert layers({"num_hidden_layers": 32, "num_local_experts": 8}) == 32
    assert layers({"num_hidden_layers": 32}) is None  # not an MoE config


# 9. calibration.fit --holdout 0


def test_fit_holdout_0_says_no_held_out_cycles(tmp_path: Path, capsys) -> None:
    from calibration import fit
    from calibration.synthetic import write_synthetic_cycles_run

    run = write_synthetic_cycles_run(tmp_path / "policy", TINY_MOE, TINY_COST, num_cycles=40, noise_rel=0.01, seed=2)
    assert fit.main([str(run), "--out", str(tmp_path / "cal" / "cost.json"), "--holdout", "0"]) == 0
    printed = capsys.readouterr().out
    assert "no held-out cycles (--holdout 0)" in printed
    assert "nan%" not in printed
    summary = _last_json(printed)
    assert summary["ok"] is True and summary["num_cycles"] == 40


# 10. trace check messages count in words


def test_lost_part_message_counts_one_part_in_the_singular(tmp_path: Path) -> None:
    from traces.errors import TraceError
    from traces.reader import open_run

    run = generate_dense_trace(
        tmp_path / "t", SHAPE, num_requests=1, positions_per_request=4, prompt_len=4, tree_depth=2,
        tree_topk=2, max_nodes=5, seed=1,
    )  # fmt: skip
    assert json.loads((Path(run) / "manifest.json").read_text())["table_counts"]["prefill"]["parts"] == 1
    (Path(run) / "prefill" / "part-00000.parquet").unlink()
    with pytest.raises(TraceError) as exc:
        open_run(run)
    message = str(exc.value)
    assert "manifest.table_counts records 1 part, found 0" in message and "1 parts" not in message


def test_fit_and_sweep_refuse_a_broken_trace_alike(trace: str, tmp_path: Path, capsys) -> None:
    """The same unreadable trace: both exit 2, naming their trace argument, the error said once."""
    import shutil

    from calibration import fit
    from sim import sweep

    broken = tmp_path / "broken"
    shutil.copytree(trace, broken)
    (broken / "manifest.json").write_text("{")
    argv = ["--trace", str(broken), "--out", str(tmp_path / "s"), "--no-progress"]
    err = _exits_2(sweep.main, argv, capsys)
    assert "error: --trace: " in err and err.count("not valid JSON") == 1
    err = _exits_2(fit.main, [str(broken), "--out", str(tmp_path / "c" / "cost.json")], capsys)
    assert f"error: RUN_DIR: {broken}" in err and err.count("not valid JSON") == 1
