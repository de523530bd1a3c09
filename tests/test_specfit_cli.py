"""specfit.cli: list and bandwidth parser types, output-folder checks (exit 2 naming the flag)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from specfit.cli import MAX_GB_PER_S, ArgumentParser, comma_list, gb_per_s, positive_float


def test_comma_list_parses_and_strips() -> None:
    assert comma_list(positive_float)("16, 32,64") == [16.0, 32.0, 64.0]
    assert comma_list(str)("ar") == ["ar"]


@pytest.mark.parametrize("text", ["16,,32", "16,", ",16", "16, ,32"])
def test_comma_list_rejects_an_empty_item(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="empty item in") as exc:
        comma_list(positive_float)(text)
    assert repr(text) in str(exc.value)


@pytest.mark.parametrize("text", ["", ",", " "])
def test_comma_list_rejects_an_empty_list(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a comma-separated list"):
        comma_list(positive_float)(text)


def test_gb_per_s_accepts_link_bandwidths() -> None:
    assert gb_per_s("16") == 16.0
    assert gb_per_s("0.5") == 0.5
    assert gb_per_s("1e4") == MAX_GB_PER_S == 10_000.0


@pytest.mark.parametrize("text", ["0", "-3", "nan", "inf", "fast"])
def test_gb_per_s_rejects_non_positive_or_non_finite(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="bandwidth in GB/s"):
        gb_per_s(text)


def test_gb_per_s_says_bytes_per_s_was_typed() -> None:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        gb_per_s("16e9")
    message = str(exc.value)
    assert "in GB/s" in message and "looks like bytes/s" in message and "did you mean 16 GB/s" in message
    with pytest.raises(argparse.ArgumentTypeError, match="looks like bytes/s"):
        gb_per_s("10001")


def test_bad_list_item_exits_2_naming_the_flag(capsys) -> None:
    parser = ArgumentParser(prog="t")
    parser.add_argument("--bandwidth", type=comma_list(gb_per_s), default=[16.0])
    assert parser.parse_args(["--bandwidth", "8,16"]).bandwidth == [8.0, 16.0]
    for bad in ("16,,32", "16e9"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["--bandwidth", bad])
        assert exc.value.code == 2
        assert "--bandwidth" in capsys.readouterr().err


def test_ensure_out_dir_creates_the_folder(tmp_path) -> None:
    parser = ArgumentParser(prog="t")
    folder = parser.ensure_out_dir("--out", tmp_path / "a" / "b")
    assert folder.is_dir() and list(folder.iterdir()) == []  # the write probe is removed


def test_ensure_out_dir_names_the_file_in_the_way(tmp_path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    parser = ArgumentParser(prog="t")
    for target in (afile, afile / "sub"):
        with pytest.raises(SystemExit) as exc:
            parser.ensure_out_dir("--out-dir", target)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--out-dir:" in err and f"'{afile}' is a file, not a folder" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_ensure_out_dir_unwritable_folder(tmp_path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(SystemExit) as exc:
            ArgumentParser(prog="t").ensure_out_dir("--out", locked / "run")
        assert exc.value.code == 2
        assert "--out:" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


def test_cli_main_input_error_exits_2_with_one_line_and_json(tmp_path, capsys) -> None:
    import json

    from specfit.cli import InputError, cli_main

    out = tmp_path / "runs" / "t1"

    @cli_main
    def main(argv=None) -> int:
        ArgumentParser(prog="t").ensure_out_dir("--out", out)
        raise InputError("--trace", "--trace: x/part-0.parquet: row 3: expected an expert id < 8")

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["python -m test_specfit_cli: error: --trace: x/part-0.parquet: row 3: expected an expert id < 8"]
    assert json.loads(captured.out) == {
        "ok": False,
        "error": "--trace: x/part-0.parquet: row 3: expected an expert id < 8",
        "exit_code": 2,
    }
    assert not (tmp_path / "runs").exists()  # the folders it created, left empty, are removed


def test_cli_main_keeps_folders_of_a_success_and_non_empty_ones(tmp_path, capsys) -> None:
    from specfit.cli import cli_main

    @cli_main
    def ok(argv=None) -> int:
        ArgumentParser(prog="t").ensure_out_dir("--out", tmp_path / "a")
        return 0

    @cli_main
    def fails_after_work(argv=None) -> int:
        folder = ArgumentParser(prog="t").ensure_out_dir("--out", tmp_path / "b")
        (folder / "cells.json").write_text("{}")
        return 1

    assert ok([]) == 0 and (tmp_path / "a").is_dir()
    assert fails_after_work([]) == 1 and (tmp_path / "b" / "cells.json").is_file()


def test_cli_main_bug_keeps_its_traceback_and_ends_stdout_with_json(capsys) -> None:
    import json

    from specfit.cli import cli_main

    @cli_main
    def buggy(argv=None) -> int:
        raise ZeroDivisionError("division by zero")

    with pytest.raises(ZeroDivisionError):
        buggy([])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == {"ok": False, "error": "internal error (ZeroDivisionError): division by zero", "exit_code": 1}


def test_parser_error_is_one_line_without_usage(capsys) -> None:
    parser = ArgumentParser(prog="python -m t")
    parser.add_argument("--jobs", type=int, default=1)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--jobs", "many"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["python -m t: error: argument --jobs: invalid int value: 'many'"]
    assert '"exit_code": 2' in captured.out


def test_tools_lists_every_python_m_tool() -> None:
    """specfit.cli.TOOLS (what ``python -m specfit.cli`` names) is every module that runs a ``main``."""
    from specfit.cli import TOOLS

    root = Path(__file__).resolve().parents[1]
    found = set()
    for package in ("live", "specfit", "traces", "calibration", "sim", "analysis"):
        for path in (root / package).rglob("*.py"):
            if re.search(r'^if __name__ == "__main__":\n(?:    .*\n|\n)*?    run_main\(main\)', path.read_text(), flags=re.M):
                found.add(".".join(path.relative_to(root).with_suffix("").parts))
    assert set(TOOLS) == found - {"specfit.cli"}


@pytest.mark.parametrize(
    ("marked", "code", "teardown"),
    [(True, 143, False), (True, 130, False), (True, 0, True), (False, 143, True)],
)
def test_run_main_skips_teardown_only_after_a_signal_of_a_marked_cli(marked: bool, code: int, teardown: bool) -> None:
    """A CLI marked with exits_at_once_after_signal (live.record) leaves with os._exit after an
    interrupted run (exit 130/143), its output flushed; every other exit runs the interpreter's
    teardown (atexit) as usual."""
    import subprocess
    import sys

    program = (
        "import atexit\n"
        "from specfit.cli import exits_at_once_after_signal, run_main\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        f"def main(argv):\n    print('saved', end='')\n    return {code}\n"
        f"run_main(exits_at_once_after_signal(main) if {marked} else main)\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.startswith("saved") and ("teardown ran" in proc.stdout) == teardown


@pytest.mark.parametrize("code", [0, 1, 2])
def test_run_main_freezes_the_heap_before_the_interpreter_teardown(code: int) -> None:
    """A normal exit goes through the interpreter's teardown (atexit runs, the exit code passes
    through), but the objects alive when main returned are frozen, so the teardown's full
    collections do not traverse them (specfit.cli.freeze_heap_for_exit): at atexit time the
    collector tracks only what was made after main returned, not the 50,000 tuples main keeps."""
    import subprocess
    import sys

    program = (
        "import atexit, gc\n"
        "from specfit.cli import run_main\n"
        "atexit.register(lambda: print('tracked at teardown', len(gc.get_objects()), 'frozen', gc.get_freeze_count()))\n"
        "kept = []\n"
        f"def main(argv):\n    kept.extend((i, [i]) for i in range(50_000))\n    return {code}\n"
        "run_main(main)\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    _, tracked, _, frozen = proc.stdout.split()[-4:]
    assert int(frozen) >= 100_000 and int(tracked) < 1_000, proc.stdout


def test_live_record_is_marked_to_exit_at_once_after_a_signal() -> None:
    import ast

    source = (Path(__file__).resolve().parents[1] / "live" / "record.py").read_text()
    (main,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert [d.id for d in main.decorator_list] == ["exits_at_once_after_signal", "cli_main"]


def _run_with_stdout_closed(args: list[str], buffered: bool = True) -> tuple[int, str]:
    """Run ``python ARGS`` with its stdout a real pipe whose read end is already closed (as after
    ``| head -1`` has read its line), its stdout block-buffered (Python's default for a pipe) or
    not (``PYTHONUNBUFFERED``): (exit status, stderr)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300,
            cwd=Path(__file__).resolve().parents[1], env=env,
        )
    finally:
        os.close(write_end)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("buffered", [True, False])
@pytest.mark.parametrize(
    ("args", "code", "stderr_lines"),
    [
        (["-m", "traces.validate", "traces/samples/default"], 141, 0),  # a success whose output was cut
        # argparse's --help: SystemExit(0); unbuffered, argparse itself drops the failed write (exit 0)
        (["-m", "traces.validate", "--help"], None, 0),
        (["-m", "traces.validate", "no/such/run"], 2, 1),  # bad input keeps exit 2 and its one line
        (["-m", "specfit.cli"], 2, 1),
    ],
)
def test_cli_exits_quietly_when_stdout_is_closed(args: list[str], code: int | None, stderr_lines: int, buffered: bool) -> None:
    """``python -m traces.validate RUN | head -1`` and the like: a CLI whose stdout reader is gone
    exits 141 (128 + SIGPIPE) without a BrokenPipeError traceback (specfit.cli.cli_main/run_main);
    an exit-2 path keeps its status and its one stderr line."""
    if "traces/samples/default" in args and not (Path(__file__).resolve().parents[1] / args[-1]).is_dir():
        pytest.skip("the sample trace is not in this checkout")
    returncode, stderr = _run_with_stdout_closed(args, buffered)
    assert returncode == (code if code is not None else 141 if buffered else 0), stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert len(stderr.splitlines()) == stderr_lines, stderr


def test_cli_exits_quietly_when_stdout_closes_mid_run() -> None:
    """A CLI still printing when its reader leaves (output far beyond the pipe's buffer) stops at
    its next write with exit 141 and nothing on stderr, as under ``| head -1``."""
    program = (
        "from specfit.cli import cli_main, print_summary, run_main\n"
        "@cli_main\n"
        "def main(argv):\n"
        "    for i in range(200_000):\n        print('line', i)\n"
        "    print_summary({'ok': True})\n    return 0\n"
        "run_main(main)\n"
    )
    for buffered in (True, False):
        assert _run_with_stdout_closed(["-c", program], buffered) == (141, "")


def test_cli_main_broken_pipe_of_something_else_is_a_bug(capsys) -> None:
    """A BrokenPipeError while stdout is open (a socket or worker pipe of the tool) keeps the
    bug path: JSON line with exit_code 1 and the exception re-raised."""
    from specfit.cli import cli_main

    @cli_main
    def main(argv) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        main([])
    assert '"exit_code": 1' in capsys.readouterr().out


def _benchmark_scripts() -> list[Path]:
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    return sorted(p for p in folder.glob("*.py") if "def main(" in p.read_text())


@pytest.mark.parametrize("script", _benchmark_scripts(), ids=lambda p: p.name)
def test_every_benchmark_runs_through_the_cli_contract(script: Path) -> None:
    """``python benchmarks/X.py | head -1`` is held to the tools' contract: ``main`` is decorated
    with ``cli_main`` and the script's ``__main__`` block calls ``run_main(main)``."""
    import ast

    tree = ast.parse(script.read_text())
    (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert "cli_main" in [getattr(d, "id", None) for d in main.decorator_list]
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert "run_main(main)" in ast.unparse(block), ast.unparse(block)


@pytest.mark.parametrize("behind", [False, True], ids=["decoy", "decoy-then-checkout"])
@pytest.mark.parametrize("script", _benchmark_scripts(), ids=lambda p: p.name)
def test_every_benchmark_imports_its_own_checkout(script: Path, behind: bool, tmp_path: Path) -> None:
    """``python /clone/benchmarks/X.py`` imports /clone's code, not another copy of the project that
    Python finds first (an editable install of another clone; here decoy packages on PYTHONPATH),
    also when the checkout itself is on PYTHONPATH behind the decoy (rev6: it was left there)."""
    import subprocess
    import sys

    for name in ("specfit", "sim", "traces", "live", "calibration", "analysis"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('decoy copy of {name} imported')\n")
    paths = [str(tmp_path), str(script.resolve().parents[1])] if behind else [str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    run = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and "decoy" not in run.stderr, run.stderr[-2000:]


def test_benchmark_exits_quietly_when_stdout_is_closed() -> None:
    """``python benchmarks/planner.py | head -1``: exit 141, no BrokenPipeError traceback."""
    args = ["benchmarks/planner.py", "--source", "synthetic", "--nodes", "4", "--trees", "2"]
    for buffered in (True, False):
        assert _run_with_stdout_closed(args, buffered) == (141, "")


def test_prog_of_a_script_run_by_its_path(monkeypatch) -> None:
    """The exit-2 line of a script run by its path names it as it was run, not as a module."""
    import sys
    import types

    from specfit.cli import _prog

    def main(argv=None) -> int:
        return 0

    main.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=None))
    monkeypatch.setattr(sys, "argv", ["benchmarks/planner.py"])
    assert _prog(main) == "python benchmarks/planner.py"


@pytest.mark.parametrize("script", _benchmark_scripts(), ids=lambda p: p.name)
def test_every_benchmark_parser_is_named_as_run(script: Path) -> None:
    """argparse's own error lines (``PROG: error: ...``) name a benchmark as its exit-2 lines from
    ``cli_main`` do when run from the repository root (``python benchmarks/X.py``), not ``X.py``."""
    import ast

    calls = [
        n
        for n in ast.walk(ast.parse(script.read_text()))
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "ArgumentParser"
    ]
    assert calls
    for call in calls:
        prog = {k.arg: k.value for k in call.keywords}.get("prog")
        assert isinstance(prog, ast.Constant) and prog.value == f"python benchmarks/{script.name}", script
