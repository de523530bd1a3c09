"""benchmarks/lossless_dtype.py runs end to end; in float32 speculative and causal decoding agree."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_benchmark


def _load():
    return load_benchmark("lossless_dtype")


def test_float32_speculative_equals_causal(tiny_checkpoint, tiny_draft, capsys):
    target = tiny_checkpoint("qwen3_moe")  # with the tiny tokenizer
    bench = _load()
    argv = ["--model", str(target), "--draft", str(tiny_draft), "--dtypes", "float32", "--num-prompts", "2"]
    assert (
        bench.main([*argv, "--max-new-tokens", "6", "--depth", "2", "--topk", "2", "--max-nodes", "5"]) == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    result = summary["results"]["float32/model-logits"]
    assert result["prompts"] == 2 and result["prompts_diverged"] == 0 and result["token_agreement"] == 1.0


def test_first_difference_and_bad_flags():
    bench = _load()
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_difference([1, 2], [1, 2, 3]) == 2
    with pytest.raises(SystemExit) as err:
        bench.main(["--dtypes", "float64"])
    assert err.value.code == 2
