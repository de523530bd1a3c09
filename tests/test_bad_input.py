"""The CLI contract on bad input, one table for every CLI (README "The command-line tools").

Each row runs one CLI in-process (``main(argv)``) on one bad input a user can hand us and checks:
the exit status (2 for bad input); ONE ``error:`` line on stderr naming the flag or file (and the
row where it applies) and what was expected, no traceback; the last stdout line is JSON with
``"ok": false`` and ``exit_code``; and nothing on disk changed (every file of the shared
workspace, pre-existing runs and output folders included, hashed before and after; no new file or
folder, so no empty ``runs/<time>/`` either). Rows marked ``before_load`` must fail before any
model loads (transformers' ``from_pretrained`` is replaced by a function that fails the test).

The workspace (tiny traces, runs, checkpoints, broken files) is built once per session.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny_shapes import TINY_COST, TINY_MOE, tiny_shape

SHAPE = tiny_shape(12_288, "tiny")


@dataclass(frozen=True)
class Case:
    """One bad input: ``cli`` module, ``argv`` and ``needles`` with ``{name}`` workspace paths."""

    id: str
    cli: str
    argv: tuple[str, ...]
    needles: tuple[str, ...]
    code: int = 2
    forbidden: tuple[str, ...] = ()
    before_load: bool = True


def C(id: str, cli: str, argv: str | list[str], *needles: str, **kw) -> Case:  # noqa: N802 - table row
    args = tuple(argv.split()) if isinstance(argv, str) else tuple(argv)
    return Case(id, cli, args, tuple(needles), **kw)


REC, SWEEP, FIT, H2D = "live.record", "sim.sweep", "calibration.fit", "calibration.h2d"
INSPECT, REPORT, VALIDATE, SYNTH, TRAIN = (
    "traces.inspect",
    "analysis.report",
    "analysis.validate",
    "traces.synthetic",
    "live.train_default",
)
TVALIDATE, REWRITE, CLI = "traces.validate", "traces.rewrite", "specfit.cli"

CASES = [
    # live.record: flags, checked before any model load
    C("rec-latency-without-bandwidth", REC, "--latency-us 50", "--latency-us", "--bandwidth"),
    C("rec-bandwidth-bytes", REC, "--bandwidth 16e9", "--bandwidth", "bytes/s"),
    C("rec-bandwidth-zero", REC, "--bandwidth 0", "--bandwidth", "GB/s"),
    C("rec-num-prompts-zero", REC, "--num-prompts 0", "--num-prompts", "integer > 0"),
    C("rec-max-new-tokens-text", REC, "--max-new-tokens many", "--max-new-tokens", "'many'"),
    C("rec-mode-unknown", REC, "--mode fast", "--mode", "invalid choice"),
    C("rec-policy-unknown", REC, "--mode policy --policy best", "--policy", "invalid choice"),
    C("rec-policy-in-dense", REC, "--policy ar", "--policy", "--mode policy"),
    C("rec-stopping-without-specfit", REC, "--mode policy --policy ar --stopping bound", "--stopping"),
    C("rec-dtype-unknown", REC, "--dtype int8", "--dtype", "invalid choice"),
    C("rec-device-absent", REC, "--device cuda:7", "--device", "cuda:7"),
    C("rec-unknown-flag", REC, "--bandwith 4", "--bandwith", "unrecognized"),
    C("rec-resume-without-out", REC, "--resume", "--resume", "--out"),
    C("rec-resume-no-manifest", REC, "--resume --out {empty}", "--resume", "manifest.json"),
    C("rec-out-not-empty", REC, "--out {existing}", "--out", "not empty"),
    C("rec-out-under-a-file", REC, "--out {afile}/sub", "--out", "is a file"),
    C("rec-prompts-missing", REC, "--prompts {root}/absent.jsonl", "--prompts", "absent.jsonl"),
    C("rec-cost-missing", REC, "--mode policy --cost {root}/absent.json", "--cost", "absent.json"),
    C("rec-cost-corrupt", REC, "--mode policy --cost {bad_json}", "--cost", "bad.json", "CycleCostModel"),
    C("rec-cost-wrong-fields", REC, "--mode policy --cost {acceptance}", "--cost", "acceptance.json"),
    C("rec-acceptance-corrupt", REC, "--mode policy --acceptance {bad_json}", "--acceptance", "bad.json"),
    C(
        "rec-predictor-tables-text",
        REC,
        "--mode policy --predictor-tables {notes}",
        "--predictor-tables",
        "notes.txt",
        ".npz",
        forbidden=("allow_pickle", "pickled"),
    ),
    C("rec-predictor-tables-missing", REC, "--mode policy --predictor-tables {root}/nope.npz", "--predictor-tables"),
    C(
        "rec-predictor-tables-other-model",
        REC,
        "--mode policy --predictor-tables {trace}",
        "--predictor-tables",
        "4 MoE layers x 16 experts",
    ),
    C("rec-predictor-tables-folder", REC, "--mode policy --predictor-tables {empty}", "--predictor-tables", "manifest"),
    C("rec-cost-is-a-folder", REC, "--mode policy --cost {empty}", "--cost", "is a folder, not a file"),
    C("rec-prompts-empty", REC, "--prompts {empty_txt}", "--prompts", "no prompts"),
    C("rec-prompts-wrong-kind", REC, "--prompts {bad_json}", "--prompts", ".jsonl or .txt"),
    C("rec-max-nodes-zero", REC, "--max-nodes 0", "--max-nodes", "integer > 0"),
    C("rec-cache-experts-too-large", REC, "--cache-experts 999", "--cache:", "999"),
    C("rec-cost-other-model", REC, "--mode policy --cost {cost_other}", "--cost", "num_layers"),
    C("rec-resume-conflicting-flag", REC, "--out {recorded} --resume --depth 2", "--depth", "recorded: 6"),
    C("rec-resume-corrupt-manifest", REC, "--out {bad_manifest} --resume", "--resume", "manifest.json"),
    # live.record: checkpoints
    C("rec-model-missing", REC, "--model {root}/no-such-model", "--model", "no-such-model"),
    C("rec-model-no-config", REC, "--model {empty}", "--model", "config.json"),
    C("rec-model-config-not-json", REC, "--model {ck_badjson} --mode policy --policy ar", "--model", "config.json", "JSON"),
    C("rec-model-remote-code", REC, "--model {ck_automap} --mode policy --policy ar", "--model", "auto_map"),
    C("rec-model-not-moe", REC, "--model {ck_bigvocab} --mode policy --policy ar", "--model", "'qwen3'", "supported"),
    C("rec-model-pickle-only", REC, "--model {ck_pickle} --mode policy --policy ar", "--model", "pytorch_model.bin"),
    C(
        "rec-model-truncated-safetensors",
        REC,
        "--model {ck_truncated} --mode policy --policy ar",
        "--model",
        "{ck_truncated}/model.safetensors",
        "truncated",
    ),
    C(
        "rec-draft-truncated-safetensors",
        REC,
        "--model {ck_target} --draft {ck_truncated}",
        "--draft",
        "{ck_truncated}/model.safetensors",
    ),
    C(
        "rec-dense-without-draft",
        REC,
        "--model {ck_target}",
        "--draft",
        "--mode dense",
        forbidden=("--policy specfit",),
    ),
    C("rec-chain-without-draft", REC, "--model {ck_target} --mode policy --policy chain", "--draft", "--policy chain"),
    C("rec-draft-missing", REC, "--draft {root}/no-draft", "--draft", "no-draft"),
    C(
        "rec-draft-vocab-larger",
        REC,
        "--model {ck_target} --draft {ck_bigvocab}",
        "--draft",
        "192",
        "96",
    ),
    C(
        "rec-model-transformers-cannot-run",
        REC,
        "--model {ck_unrunnable} --mode policy --policy ar",
        "--model",
        "transformers cannot run this checkpoint",
        before_load=False,
    ),
    # sim.sweep
    C("sweep-bandwidth-empty-item", SWEEP, "--trace {trace} --bandwidth 16,,32", "--bandwidth", "empty item"),
    C("sweep-bandwidth-bytes", SWEEP, "--trace {trace} --bandwidth 16e9", "--bandwidth", "bytes/s"),
    C("sweep-trace-missing", SWEEP, "--trace {root}/no-trace", "--trace", "no-trace"),
    C("sweep-trace-bad-manifest", SWEEP, "--trace {bad_manifest}", "--trace", "manifest.json"),
    C("sweep-trace-not-a-trace", SWEEP, "--trace {empty}", "--trace"),
    C("sweep-cost-corrupt", SWEEP, "--trace {trace} --cost {bad_json}", "--cost", "bad.json"),
    C("sweep-policy-unknown", SWEEP, "--trace {trace} --policy ar,best", "--policy", "best"),
    C("sweep-jobs-zero", SWEEP, "--trace {trace} --jobs 0", "--jobs"),
    C("sweep-executor-unknown", SWEEP, "--trace {trace} --executor slurm", "--executor", "invalid choice"),
    C("sweep-out-under-a-file", SWEEP, "--trace {trace} --out {afile}/sub", "--out", "is a file"),
    C("sweep-acceptance-corrupt", SWEEP, "--trace {trace} --acceptance {bad_json}", "--acceptance", "bad.json"),
    C("sweep-trace-corrupt-part", SWEEP, "--trace {corrupt_part} --out {root}/sw --no-figures", "--trace", "part-00000"),
    C("sweep-max-requests-zero", SWEEP, "--trace {trace} --max-requests 0", "--max-requests"),
    # calibration.fit
    C("fit-run-dir-missing", FIT, "{root}/no-run --out {root}/cal/cost.json", "RUN_DIR", "no-run"),
    C("fit-run-dir-not-a-trace", FIT, "{empty} --out {root}/cal/cost.json", "RUN_DIR", "manifest.json"),
    C("fit-run-bad-manifest", FIT, "{bad_manifest} --out {root}/cal/cost.json", "RUN_DIR", "manifest.json"),
    C("fit-run-corrupt-part", FIT, "{corrupt_part} --out {root}/cal/cost.json", "RUN_DIR", "part-00000.parquet"),
    C("fit-holdout-too-large", FIT, "{policy} --holdout 2", "--holdout", "[0, 0.9]"),
    C("fit-too-few-cycles", FIT, "{policy} --min-cycles 1000 --out {root}/cal/cost.json", "{policy}", "--min-cycles"),
    C("fit-model-mismatch", FIT, "{policy} --model qwen3-30b-a3b --out {root}/cal/cost.json", "{policy}", "model.name"),
    C("fit-h2d-table-missing", FIT, "{policy} --h2d-table {root}/h2d.json", "--h2d-table", "h2d.json"),
    C("fit-h2d-table-and-latency", FIT, "{policy} --h2d-table {bad_json} --h2d-latency-us 3", "--h2d-table"),
    C("fit-h2d-table-corrupt", FIT, "{policy} --h2d-table {bad_json} --out {root}/cal/cost.json", "--h2d-table", "bad.json"),
    C("fit-h2d-table-no-fits", FIT, "{policy} --h2d-table {acceptance} --out {root}/cal/cost.json", "--h2d-table", "fits"),
    C("fit-out-is-a-folder", FIT, "{policy} --out {empty}", "--out", "folder"),
    C("fit-threshold-zero", FIT, "{policy} --max-median-pct 0", "--max-median-pct", "> 0"),
    # calibration.h2d
    C("h2d-one-size", H2D, "--sizes-mib 1", "--sizes-mib", ">= 2 sizes"),
    C("h2d-cuda-absent", H2D, "--device cuda --out-dir {root}/h2d", "--device", "cuda"),
    C("h2d-warmup-negative", H2D, "--warmup -1 --out-dir {root}/h2d", "--warmup"),
    C("h2d-bandwidth-zero", H2D, "--bandwidth 0 --out-dir {root}/h2d", "--bandwidth"),
    C("h2d-out-under-a-file", H2D, "--out-dir {afile}/sub", "--out", "is a file"),  # --out-dir: --out's old spelling
    # traces.inspect
    C("inspect-missing", INSPECT, "{root}/no-run", "run_dir", "no-run"),
    C("inspect-no-manifest", INSPECT, "{empty}", "run_dir", "manifest.json"),
    C("inspect-corrupt-part", INSPECT, "{corrupt_part} --validate", "part-00000.parquet"),
    C("inspect-orphan-row", INSPECT, "{orphan} --validate", "part-00000.parquet", "row 3"),
    C("inspect-union-sizes-zero", INSPECT, "{trace} --union-sizes 0,4", "--union-sizes"),
    # traces.validate, traces.rewrite
    C("trace-validate-no-run", TVALIDATE, [], "run_dir", "required"),
    C("trace-validate-missing", TVALIDATE, "{root}/no-run", "run_dir", "no-run"),
    C("trace-validate-corrupt-part", TVALIDATE, "{corrupt_part}", "run_dir", "part-00000.parquet"),
    C("trace-validate-orphan-row", TVALIDATE, "{orphan}", "run_dir", "part-00000.parquet", "row 3"),
    C("trace-validate-transfers-no-cycle-index", TVALIDATE, "{no_cycle_index}", "transfers", "cycle_index"),
    C("rewrite-no-out", REWRITE, "{trace}", "--out", "required"),
    C("rewrite-corrupt-part", REWRITE, "{corrupt_part} --out {root}/rw", "run_dir", "part-00000.parquet"),
    C("rewrite-out-not-empty", REWRITE, "{trace} --out {existing}", "--out", "not empty"),
    # specfit.cli: the shared helpers, not a tool
    C("specfit-cli-is-not-a-tool", CLI, [], "not a tool", "python -m live.record"),
    # analysis.report
    C("report-missing-input", REPORT, "{root}/no-dir --out {root}/rep", "DIR", "no-dir"),
    C("report-unrecognised-folder", REPORT, "{empty} --out {root}/rep", "DIR", "manifest.json"),
    C("report-corrupt-results-parquet", REPORT, "{sweep_corrupt} --out {root}/rep", "{sweep_corrupt}/results.parquet", "Parquet"),
    C("report-results-lack-columns", REPORT, "{sweep_nocols} --out {root}/rep", "results.csv", "column"),
    C("report-calibration-csv-lacks-columns", REPORT, "{calib_nocols} --out {root}/rep", "cost_fit_cycles.csv"),
    C("report-bad-manifest", REPORT, "{bad_manifest} --out {root}/rep", "manifest.json"),
    C("report-out-under-a-file", REPORT, "{trace} --out {afile}/sub", "--out", "is a file"),
    # analysis.validate
    C("validate-policy-unknown", VALIDATE, "--policies ar,best", "--policy", "best"),  # --policies: an alias
    C("validate-model-missing", VALIDATE, "--model {root}/no-model", "--model", "no-model"),
    C("validate-bandwidth-zero", VALIDATE, "--bandwidth 0", "--bandwidth"),
    C("validate-cost-corrupt", VALIDATE, "--cost {bad_json}", "--cost", "bad.json"),
    C("validate-repeats-zero", VALIDATE, "--repeats 0", "--repeats"),
    C("validate-cache-too-large", VALIDATE, "--cache 9999", "--cache:", "9999"),
    C("validate-model-truncated", VALIDATE, "--model {ck_truncated}", "--model", "{ck_truncated}/model.safetensors"),
    C("validate-model-not-moe", VALIDATE, "--model {ck_bigvocab}", "--model", "'qwen3'"),
    C("validate-draft-vocab-larger", VALIDATE, "--model {ck_target} --draft {ck_bigvocab}", "--draft", "192", "96"),
    C("validate-prompts-missing", VALIDATE, "--prompts {root}/absent.txt", "--prompts", "absent.txt"),
    # traces.synthetic
    C("synthetic-shape-unknown", SYNTH, "--shape gpt-5 --out {root}/syn", "--model-shape", "gpt-5"),
    C("synthetic-locality-one", SYNTH, "--expert-locality 1 --out {root}/syn", "--expert-locality", "[0, 1)"),
    C("synthetic-out-not-empty", SYNTH, "--out {existing}", "--out", "not empty"),
    C("synthetic-requests-zero", SYNTH, "--num-requests 0 --out {root}/syn", "--num-requests"),
    # live.train_default
    C("train-vocab-too-small", TRAIN, "--vocab-size 10 --out {root}/train", "--vocab-size", ">= 300"),
    C("train-docs-missing", TRAIN, "--docs-dir {root}/no-docs --out {root}/train", "--docs-dir", "no-docs"),
    C("train-evaluate-only-truncated", TRAIN, "--evaluate-only --out {ck_trained}", "--out", "target/model.safetensors"),
    C("train-evaluate-only-no-checkpoint", TRAIN, "--evaluate-only --out {empty}", "--out", "model.safetensors"),
]


def _no_model_load(*args, **kwargs):
    raise AssertionError("a model was loaded before the flags and input files were checked")


def _snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file ("dir" for folders) under ``root``."""
    snap = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            snap[os.path.relpath(os.path.join(folder, name), root)] = "dir"
        for name in files:
            path = os.path.join(folder, name)
            snap[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return snap


@pytest.fixture(scope="session")
def ws(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint) -> dict[str, str]:
    """The shared workspace: every path a case may name (``{name}`` in the table)."""
    from test_traces_helpers import edit_part, first_part, set_value

    from calibration.synthetic import write_synthetic_cycles_run
    from traces.synthetic import generate_dense_trace

    root = tmp_path_factory.mktemp("bad-input")
    paths: dict[str, Path] = {"root": root}
    paths["trace"] = generate_dense_trace(
        root / "trace", SHAPE, num_requests=1, positions_per_request=6, prompt_len=4,
        tree_depth=2, tree_topk=2, max_nodes=5, seed=3,
    )  # fmt: skip
    paths["policy"] = write_synthetic_cycles_run(
        root / "policy", TINY_MOE, TINY_COST, num_cycles=40, noise_rel=0.01, seed=2
    )
    paths["existing"] = Path(shutil.copytree(paths["trace"], root / "existing"))
    paths["empty"] = root / "empty"
    paths["empty"].mkdir()
    (root / "cwd").mkdir()
    for name, text in (("afile", "x"), ("notes.txt", "not an archive\n"), ("bad.json", "{not json")):
        (root / name).write_text(text)
    paths["afile"], paths["notes"], paths["bad_json"] = root / "afile", root / "notes.txt", root / "bad.json"
    paths["acceptance"] = root / "acceptance.json"
    paths["acceptance"].write_text(json.dumps({"knots_x": [0.0, 1.0], "knots_y": [0.0, 0.5]}))
    paths["empty_txt"] = root / "empty.txt"
    paths["empty_txt"].write_text("")
    paths["cost_other"] = root / "cost-4-layers.json"
    TINY_COST.save(paths["cost_other"])  # 4 MoE layers; the embedded default has 6
    paths["recorded"] = root / "recorded"  # a recorded run's manifest (the shipped sample's), for --resume
    paths["recorded"].mkdir()
    sample = Path(__file__).resolve().parents[1] / "traces" / "samples" / "default"
    shutil.copy(sample / "manifest.json", paths["recorded"] / "manifest.json")
    paths["bad_manifest"] = Path(shutil.copytree(paths["trace"], root / "bad-manifest"))
    (paths["bad_manifest"] / "manifest.json").write_text("{")
    paths["corrupt_part"] = Path(shutil.copytree(paths["trace"], root / "corrupt-part"))
    first_part(paths["corrupt_part"], "nodes").write_bytes(b"not parquet")
    paths["orphan"] = Path(shutil.copytree(paths["trace"], root / "orphan"))
    edit_part(first_part(paths["orphan"], "nodes"), lambda t: set_value(t, "parent", 3, 4))
    paths["no_cycle_index"] = Path(shutil.copytree(paths["policy"], root / "no-cycle-index"))  # format v3 transfers
    edit_part(first_part(paths["no_cycle_index"], "transfers"), lambda t: t.drop_columns(["cycle_index"]))
    paths["sweep_corrupt"] = root / "sweep-corrupt"
    paths["sweep_corrupt"].mkdir()
    (paths["sweep_corrupt"] / "results.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    paths["sweep_nocols"] = root / "sweep-nocols"
    paths["sweep_nocols"].mkdir()
    (paths["sweep_nocols"] / "results.csv").write_text("policy,tokens_per_s\nar,1.0\n")
    paths["calib_nocols"] = root / "calib-nocols"
    paths["calib_nocols"].mkdir()
    (paths["calib_nocols"] / "cost_fit_cycles.csv").write_text("a,b\n1,2\n")
    paths.update(_checkpoints(root / "ck", tiny_checkpoint("qwen3_moe")))
    return {k: str(v) for k, v in paths.items()}


def _checkpoints(root: Path, good: Path) -> dict[str, Path]:
    """Tiny checkpoints: a good target (a copy of the session's ``good``, without its tokenizer, so
    the workspace snapshot covers it), its truncated copy, a pickle-only one, one asking for remote
    code, one with an unreadable config, one transformers loads but cannot run, and a draft with
    twice the target's vocabulary."""
    from live_fixtures import TINY_VOCAB_SIZE, make_tiny_checkpoint, make_tiny_draft

    target = Path(shutil.copytree(good, root / "target", ignore=shutil.ignore_patterns("tokenizer*")))
    out = {"ck_target": target}
    out["ck_truncated"] = Path(shutil.copytree(target, root / "truncated"))
    weights = (target / "model.safetensors").read_bytes()
    (out["ck_truncated"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    out["ck_pickle"] = root / "pickle-only"
    out["ck_pickle"].mkdir()
    shutil.copy(target / "config.json", out["ck_pickle"] / "config.json")
    (out["ck_pickle"] / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    out["ck_automap"] = Path(shutil.copytree(target, root / "automap"))
    config = json.loads((target / "config.json").read_text())
    (out["ck_automap"] / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    out["ck_badjson"] = Path(shutil.copytree(target, root / "badjson"))
    (out["ck_badjson"] / "config.json").write_text("{'model_type': 'qwen3_moe'")
    # 4 query heads over 3 key/value heads: transformers builds and loads it, its attention cannot run
    out["ck_unrunnable"] = make_tiny_checkpoint(root / "unrunnable", num_key_value_heads=3)
    out["ck_bigvocab"] = make_tiny_draft(root, vocab_size=2 * TINY_VOCAB_SIZE)
    out["ck_trained"] = root / "trained"  # live.train_default's --out layout, the target cut short
    shutil.copytree(out["ck_truncated"], out["ck_trained"] / "target")
    shutil.copytree(target, out["ck_trained"] / "draft")
    return out


def _exit_code(cli: str, argv: list[str]) -> int:
    main = importlib.import_module(cli).main
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, ws: dict[str, str], capsys, monkeypatch) -> None:
    monkeypatch.chdir(Path(ws["root"]) / "cwd")  # default outputs (runs/...) land inside the workspace
    if case.before_load and case.cli in (REC, VALIDATE):
        import live.loader

        monkeypatch.setattr(live.loader, "_from_pretrained", _no_model_load)
    argv = [a.format(**ws) for a in case.argv]
    before = _snapshot(Path(ws["root"]))
    capsys.readouterr()
    code = _exit_code(case.cli, argv)
    out, err = capsys.readouterr()
    assert code == case.code, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    if case.before_load:  # nothing else said on stderr before the one line
        assert len(err.strip().splitlines()) == 1, err
    for needle in case.needles:
        assert needle.format(**ws) in errors[0], errors[0]
    for text in case.forbidden:
        assert text not in err and text not in out, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is False and summary["exit_code"] == case.code, summary
    assert _snapshot(Path(ws["root"])) == before, "a failed run changed or added files"


def test_the_table_covers_every_cli_and_is_large() -> None:
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
    assert {c.cli for c in CASES} == {
        REC, SWEEP, FIT, H2D, INSPECT, REPORT, VALIDATE, SYNTH, TRAIN, TVALIDATE, REWRITE, CLI
    }


@pytest.mark.parametrize(
    ("cli", "argv", "needle"),
    [
        (INSPECT, ["{root}/no-run"], "run_dir: "),
        (FIT, ["{policy}", "--h2d-table", "{bad_json}", "--out", "{root}/cal/cost.json"], "--h2d-table: "),
        (REPORT, ["{sweep_corrupt}", "--out", "{root}/rep"], "results.parquet"),
        (TVALIDATE, [], "run_dir"),
        (CLI, [], "not a tool"),
    ],
    ids=["argparse-path", "input-error-path", "read-table-path", "trace-validate-no-args", "specfit-cli-no-args"],
)
def test_bad_input_through_python_m(cli: str, argv: list[str], needle: str, ws: dict[str, str]) -> None:
    """The same contract through ``python -m`` (a real process): exit 2, one stderr line naming the
    tool, no traceback, a JSON line last on stdout, nothing written."""
    import subprocess
    import sys

    before = _snapshot(Path(ws["root"]))
    proc = subprocess.run(
        [sys.executable, "-m", cli, *(a.format(**ws) for a in argv)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m {cli}: error: ") and needle in lines[0], lines
    assert json.loads(proc.stdout.strip().splitlines()[-1])["exit_code"] == 2
    assert _snapshot(Path(ws["root"])) == before
