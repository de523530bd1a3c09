"""One spelling per flag across the tools, the older spelling kept as an alias (README, "Flag
spellings"): both parse to the same value, and ``--help`` shows both."""

from __future__ import annotations

import contextlib

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
    (lambda: _bench_parser("sim_speed"), "--num-requests", "--requests", "2", "requests"),
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


# The spellings 82fdcdf added (README "Flag spellings"), per tool: every abbreviation that parsed
# before they were added must still parse to the same flag (argparse takes unique prefixes).
ADDED = [
    (lambda: _module_parser("analysis.validate"), {"--cache", "--policy", "--threads"}),
    (lambda: _module_parser("calibration.h2d"), {"--threads", "--out"}),
    (lambda: _module_parser("sim.sweep"), {"--policies", "--latency-us"}),
    (lambda: _module_parser("live.record"), {"--cache"}),
    (lambda: _module_parser("traces.synthetic"), {"--model-shape", "--depth", "--topk"}),
    (lambda: _bench_parser("wait_step"), {"--bandwidth", "--cache"}),
    (lambda: _bench_parser("planner"), {"--cache"}),
    (lambda: _bench_parser("trace_size"), {"--model-shape"}),
    (lambda: _bench_parser("live_overhead"), {"--max-new-tokens"}),
    (lambda: _bench_parser("lossless_dtype"), {"--dtype"}),
    (lambda: _bench_parser("drafters"), {"--category", "--policy"}),
    (lambda: _bench_parser("sim_speed"), {"--num-requests"}),
]


def _optional_action(parser, arg: str):
    """The action argparse takes option ``arg`` for. ``_parse_optional`` (private) returns an
    ``(action, option_string, explicit_arg)`` tuple up to CPython 3.12 (checked on 3.12.1), a
    4-tuple with the ``=`` separator third on 3.13.0 (checked); a list of tuples is accepted too in
    case a later release returns one per matching option."""
    got = parser._parse_optional(arg)
    if isinstance(got, list):
        assert len(got) == 1, got
        (got,) = got
    return got[0]


def _prefix_targets(strings: dict, prefix: str) -> set[str]:
    """The option strings stock argparse would take ``prefix`` for among ``strings``: itself if
    exact, else every string it starts (more than one = ambiguous there)."""
    return {prefix} if prefix in strings else {s for s in strings if s.startswith(prefix)}


@pytest.mark.parametrize(("factory", "added"), ADDED, ids=lambda v: "" if callable(v) else ",".join(sorted(v)))
def test_old_abbreviations_keep_their_flag(factory, added, capsys) -> None:
    parser = factory()
    everything = dict(parser._option_string_actions)
    assert added <= set(everything)
    old = {s: a for s, a in everything.items() if s not in added and s.startswith("--")}
    checked = ambiguous = 0
    for flag in old:
        for end in range(3, len(flag) + 1):
            prefix = flag[:end]
            before = _prefix_targets(old, prefix)
            if len(before) != 1:
                continue  # ambiguous before the aliases too: no user's command relied on it
            (target,) = before
            action = _optional_action(parser, prefix)
            assert action is old[target], (prefix, target)
            # and through a whole parse (the value of a flag taking one, or none)
            argv = [prefix] if action.nargs == 0 else [prefix, "1"]
            with contextlib.suppress(SystemExit):  # a value the flag rejects still named it
                parser.parse_known_args(argv)
            assert "ambiguous" not in capsys.readouterr().err
            checked += 1
    assert checked > 10
    # a prefix of two different flags stays an error (exit 2, naming both)
    for prefix in {flag[:end] for flag in everything if flag.startswith("--") for end in range(3, len(flag))}:
        actions = {id(a) for s, a in everything.items() if s.startswith(prefix)}
        older = {id(a) for s, a in old.items() if s.startswith(prefix)}
        if prefix not in everything and len(actions) > 1 and len(older) != 1:
            with pytest.raises(SystemExit) as exc:
                parser.parse_args([prefix, "1"])
            assert exc.value.code == 2 and "ambiguous option" in capsys.readouterr().err
            ambiguous += 1
    # the added spellings' own abbreviations work where they name one flag
    for flag in added:
        for end in range(3, len(flag) + 1):
            prefix = flag[:end]
            if len({id(a) for s, a in everything.items() if s.startswith(prefix)}) == 1:
                assert _optional_action(parser, prefix) is everything[flag]


def test_reported_prefixes_parse(capsys) -> None:
    """The abbreviations that 82fdcdf's aliases had made 'ambiguous' (exit 2)."""
    assert _bench_parser("wait_step").parse_args(["--bandw", "8"]).bandwidths == [8.0]
    assert _bench_parser("planner").parse_args(["--cach", "0.5"]).cache_fraction == [0.5]
    assert _module_parser("sim.sweep").parse_args(["--polic", "ar"]).policy == ["ar"]
    assert _module_parser("calibration.h2d").parse_args(["--ou", "runs/x"]).out_dir == "runs/x"
    assert _module_parser("traces.synthetic").parse_args(["--m", "5"]).max_nodes == 5  # --m was --max-nodes
    with pytest.raises(SystemExit) as exc:
        _module_parser("sim.sweep").parse_args(["--p", "ar"])
    assert exc.value.code == 2 and "ambiguous option: --p" in capsys.readouterr().err


@pytest.mark.parametrize(("factory", "new", "old", "value", "dest"), CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_unified_spelling_comes_first(factory, new, old, value, dest) -> None:
    """argparse names a flag by its first spelling (``argument --cache/--cache-fraction: ...``,
    ``--help``): the unified one (``sim.sweep``'s unified ``--policy`` is its own first)."""
    if dest in ("new_tokens", "dtypes"):
        pytest.importorskip("torch")
    first = factory()._option_string_actions[new].option_strings[0]
    assert first == ("--policy" if new == "--policies" else new)


def test_planner_cache_message_names_cache(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        load_benchmark("planner").main(["--cache", "8"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "error: --cache: expected fractions in [0, 1)" in err, err


@pytest.mark.parametrize(
    "factory",
    [
        lambda: _module_parser("analysis.validate"),
        lambda: _module_parser("calibration.h2d"),
        lambda: _module_parser("live.record"),
        lambda: _bench_parser("wait_step"),
    ],
)
def test_threads_is_a_count_with_0_for_torchs_default_everywhere(factory, capsys) -> None:
    """``--threads 0`` is torch's own default in every tool (it had to be >= 1 in analysis.validate
    and took any integer in calibration.h2d); a negative count exits 2 naming the flag."""
    parser = factory()
    dest = parser._option_string_actions["--threads"].dest
    assert getattr(parser.parse_args(["--threads", "0"]), dest) == 0
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--threads", "-1"])
    assert exc.value.code == 2 and "--threads" in capsys.readouterr().err
