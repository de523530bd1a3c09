"""docs/trace-format.md stays in step with the column specs; the traces CLIs follow the CLI rules."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from traces.reader import open_run
from traces.schema import TABLES, HardwareSpec, Manifest, ModelSpec

DOC = Path(__file__).resolve().parents[1] / "docs" / "trace-format.md"


def _section(text: str, title: str) -> str:
    match = re.search(rf"^### `{title}`\n(.*?)(?=^##|\Z)", text, flags=re.S | re.M)
    assert match, f"docs/trace-format.md has no section for table {title}"
    return match.group(1)


@pytest.mark.parametrize("table", list(TABLES))
def test_doc_lists_every_column_with_unit(table):
    section = _section(DOC.read_text(), table)
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)
    assert documented == [spec.name for spec in TABLES[table]]


def test_doc_lists_every_manifest_field():
    text = DOC.read_text()
    for cls, prefix in ((ModelSpec, "model."), (HardwareSpec, "hardware.")):
        for field in dataclasses.fields(cls):
            assert f"`{prefix}{field.name}`" in text
    for field in dataclasses.fields(Manifest):
        if field.name not in ("model", "hardware", "draft", "run"):
            assert f"`{field.name}`" in text


def test_synthetic_cli_writes_a_valid_run(tmp_path, capsys):
    from traces.synthetic import main

    out = tmp_path / "synth"
    code = main(
        [
            "--shape",
            "mixtral-8x7b",
            "--out",
            str(out),
            "--num-requests",
            "2",
            "--positions",
            "4",
            "--no-progress",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = open_run(out)
    assert summary["num_trees"] == 8 and summary["num_nodes"] == 8 * run.manifest.draft.max_nodes
    assert summary["calibrated"] is True  # mixtral-8x7b has a calibration (traces/synthcal.py)
    assert run.manifest.command_line[:3] == ("python", "-m", "traces.synthetic")
    assert run.manifest.config["num_requests"] == 2 and run.manifest.seed == 0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--shape", "gpt-moe"], "--model-shape"),
        (["--acceptance", "1.5"], "--acceptance"),
        (["--expert-locality", "1"], "--expert-locality"),
        (["--positions", "0"], "--positions"),
        (["--vocab-size", "3"], "--vocab-size"),
        (["--max-nodes", "-1"], "--max-nodes"),
    ],
)
def test_synthetic_cli_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, argv, flag):
    from traces.synthetic import main

    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_synthetic_cli_refuses_non_empty_out(tmp_path, capsys):
    from traces.synthetic import main

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "full")])
    assert info.value.code == 2 and "--out" in capsys.readouterr().err


def test_help_lists_flags_with_defaults(capsys):
    from traces.inspect import main as inspect_main
    from traces.synthetic import main as synthetic_main

    for entry in (synthetic_main, inspect_main):
        with pytest.raises(SystemExit) as info:
            entry(["--help"])
        assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--expert-locality" in text and "(default: the shape's calibration" in text
    assert "--union-sizes" in text and "(default: 1,2,4,8,16,32,64,128)" in text


def test_validate_cli_checks_a_run_and_reports_its_rows(tmp_path, capsys):
    from test_traces_helpers import write_small_run

    from traces.validate import main

    run_dir = write_small_run(tmp_path / "run", num_requests=2, positions=3)
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "valid, trace format v3, complete" in out[0]
    summary = json.loads(out[-1])
    assert summary["ok"] and summary["rows"] == {
        "requests": 2, "prefill": 8, "nodes": 36, "cycles": 6, "transfers": 12
    }
