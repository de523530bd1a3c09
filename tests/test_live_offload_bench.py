"""benchmarks/live_overhead.py runs end to end on a tiny checkpoint (figures not asserted: speed
targets live in the benchmark's own output)."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_benchmark


def _load():
    return load_benchmark("live_overhead")


def test_benchmark_smoke(tiny_checkpoint, capsys):
    import torch

    from live.record import build_parser

    bench = _load()
    argv = ["--model", str(tiny_checkpoint("qwen3_moe")), "--new-tokens", "3", "--prompt-tokens", "4"]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert bench.main([*argv, "--repeats", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["torch_threads"] == build_parser().get_default("threads")  # live.record's default
    assert summary["benchmark"] == "live_overhead"
    assert summary["same_tokens"] is True
    assert summary["cache_misses_after_warm"] == 0
    assert summary["h2d_bytes_measured"] == 2 * 16 * 3 * 32 * 16 * 4
    assert summary["h2d_link_gb_per_s"] > 0 and summary["offload_s"] > 0


def test_benchmark_bad_flags_exit_2(tmp_path):
    bench = _load()
    with pytest.raises(SystemExit) as err:
        bench.main(["--model", str(tmp_path / "missing")])
    assert err.value.code == 2
    with pytest.raises(SystemExit) as err:
        bench.main(["--repeats", "0"])
    assert err.value.code == 2
