"""One spelling per flag across the tools, the older spelling kept as an alias (README, "Flag
spellings"): both parse to the same value, and ``--help`` shows both."""

from __future__ import annotations

import pytest
from bench_loader import load_benchmark


def _module_parser(module: str):
    import importlib

    return importlib.import_module(module).build_parser()


def _bench_parser(stem: str):
    bench = load_benchmark(stem)
    return (bench.build_parser if hasattr(bench, "build_parser") else bench._parser)()


# (parser factory, unified spelling, old spelling, a value, the attribute both set)
CASES = [
    (lambda: _module_parser("analysis.validate"), "--threads", "--torch-threads", "2", "torch_threads"),
    (lambda: _module_parser("analysis.validate"), "--policy", "--policies", "ar,topn", "policies"),
    (lambda: _module_parser("analysis.validate"), "--cache", "--cache-experts", "8,16", "cache_experts"),
    (lambda: _module_parser("calibration.h2d"), "--out", "--out-dir", "runs/x", "out_dir"),
    (lambda: _module_parser("calibration.h2d"), "--threads", "--torch-threads", "2", "torch_threads"),
    (lambda: _module_parser("sim.sweep"), "--latency-us", "--transfer-latency-us", "20", "transfer_latency_us"),
    (lambda: _module_parser("sim.sweep"), "--policies", "--policy", "ar,topn", "policy"),
    (lambda: _module_parser("live.record"), "--cache", "--cache-experts", "8", "cache_experts"),
    (lambda: _bench_parser("wait_step"), "--bandwidth", "--bandwidths", "8,1", "bandwidths"),
    (lambda: _bench_parser("wait_step"), "--cache", "--cache-experts", "8", "cache_experts"),
    (lambda: _bench_parser("planner"), "--cache", "--cache-fraction", "0.25,0.5", "cache_fraction"),
    (lambda: _bench_parser("trace_size"), "--model-shape", "--shape", "mixtral-8x7b", "shape"),
    (lambda: _bench_parser("live_overhead"), "--max-new-tokens", "--new-tokens", "8", "new_tokens"),
    (lambda: _bench_parser("lossless_dtype"), "--dtype", "--dtypes", "float32", "dtypes"),
    (lambda: _bench_parser("drafters"), "--category", "--categories", "coding", "categories"),
    (lambda: _bench_parser("drafters"), "--policy", "--policies", "full", "policies"),
]


@pytest.mark.parametrize(("factory", "new", "old", "value", "dest"), CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_both_spellings_parse_alike_and_help_shows_both(factory, new, old, value, dest, monkeypatch) -> None:
    if dest in ("new_tokens", "dtypes"):
        pytest.importorskip("torch")
    monkeypatch.setenv("COLUMNS", "100000")
    parser = factory()
    assert getattr(parser.parse_args([new, value]), dest) == getattr(parser.parse_args([old, value]), dest)
    assert f"{new} " in parser.format_help() or f"{new}," in parser.format_help()
    assert f"{old} " in parser.format_help() or f"{old}," in parser.format_help()
    # both spellings are registered (not an abbreviation of a longer flag, which a new flag could break)
    assert {new, old} <= set(parser._option_string_actions)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model-shape", "gpt-5"], "--model-shape"),
        (["--shape", "gpt-5"], "--model-shape"),
        (["--depth", "0"], "--depth"),
        (["--tree-depth", "0"], "--depth"),
        (["--topk", "0"], "--topk"),
        (["--tree-topk", "0"], "--topk"),
    ],
)
def test_synthetic_spellings(argv, named, capsys, tmp_path) -> None:
    from traces.synthetic import main

    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "s")])
    assert exc.value.code == 2 and named in capsys.readouterr().err
