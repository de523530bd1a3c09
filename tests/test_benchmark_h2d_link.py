"""benchmarks/h2d_link.py runs end to end (its figures are not asserted on the real clock: on a
fake clock, where the emulated link is exact, every case meets its aim)."""

from __future__ import annotations

import json

import pytest
from bench_loader import load_benchmark


def _load():
    return load_benchmark("h2d_link")


def test_h2d_link_benchmark_on_a_fake_clock(fake_clock, capsys):
    torch = pytest.importorskip("torch")
    from live.record import build_parser

    bench = _load()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert bench.main(["--transfers", "4", "--repeats", "1"]) == 0
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert "real clock" in out[0] and summary["benchmark"] == "h2d_link"
    assert summary["torch_threads"] == threads == build_parser().get_default("threads")  # live.record's
    assert set(summary["cases"]) == {"default-shape", "tiny"}
    for case in summary["cases"].values():
        assert case["ok"]  # within 5 %: exact but for clock reads
        # each fit prices the timed copies at their summed time: the fit exactly (price_at_mean, as
        # calibration.fit), the quick estimate's per-size means but for clock reads
        assert case["fit_priced_over_timed"] == pytest.approx(1.0, rel=1e-6)
        assert case["quick_priced_over_timed"] == pytest.approx(1.0, rel=0.05)
    assert summary["ok"] is True


def test_h2d_link_benchmark_bad_flags_exit_2():
    bench = _load()
    with pytest.raises(SystemExit) as err:
        bench.main(["--transfers", "0"])
    assert err.value.code == 2
