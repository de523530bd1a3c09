"""`python -m calibration.h2d` on the CPU: memcpy and the emulated link, table, JSON and figure."""

import json

import pytest

from calibration import fit as fit_cli
from calibration import h2d


def test_h2d_cli_fits_the_emulated_link(tmp_path, capsys, fake_clock) -> None:
    """The CLI's table, fit, JSON and figure, on a fake clock (tests/fake_clock.py): the emulated
    link's transfers last exactly what it charges, so the fit is exact within clock reads (the
    memcpy link's copies take no fake time; real figures: ``benchmarks/h2d_link.py``)."""
    pytest.importorskip("torch")
    out = tmp_path / "h2d"
    argv = ["--device", "cpu", "--sizes-mib", "4,16,64", "--repeats", "5", "--warmup", "1"]
    argv += ["--bandwidth", "1", "--latency-us", "1000", "--out-dir", str(out)]
    assert h2d.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] and summary["device"] == "cpu"
    # emulated link: 1 GB/s and 1 ms per transfer; each transfer overruns by a few clock reads
    tick_us = fake_clock.tick_s * 1e6
    assert summary["emulated_gb_per_s"] == pytest.approx(1.0, rel=1e-6)
    assert summary["emulated_latency_us"] == pytest.approx(1000.0, abs=5 * tick_us)
    assert summary["memcpy_gb_per_s"] > summary["emulated_gb_per_s"]
    data = json.loads((out / "h2d.json").read_text())
    assert (
        data["fits"]["emulated"] is data["fits"]["cpu-emulated"]
        or data["fits"]["emulated"] == data["fits"]["cpu-emulated"]
    )
    assert data["medians"]["emulated"]["bytes"] == [1 << 22, 1 << 24, 1 << 26]
    rows = (out / "h2d.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 3 * 5
    assert (out / "h2d.png").stat().st_size > 1000
    # the table feeds calibration.fit --h2d-table
    assert fit_cli.latency_from_h2d_table(str(out / "h2d.json"), ["cpu-emulated"]) == pytest.approx(
        data["fits"]["emulated"]["s_per_transfer"]
    )
    with pytest.raises(ValueError, match="available"):
        fit_cli.latency_from_h2d_table(str(out / "h2d.json"), ["cuda-pinned"])


def test_h2d_cli_bad_flags_exit_2(capsys) -> None:
    cases = (
        (["--sizes-mib", "0"], "--sizes-mib"),
        (["--sizes-mib", "1"], "--sizes-mib"),
        (["--sizes-mib", "4,,16"], "--sizes-mib"),
        (["--bandwidth", "-1"], "--bandwidth"),
        (["--bandwidth", "16e9"], "--bandwidth"),
    )
    for argv, flag in cases:
        with pytest.raises(SystemExit) as exc:
            h2d.main(argv)
        assert exc.value.code == 2
        assert flag in capsys.readouterr().err


@pytest.mark.gpu
def test_h2d_cli_cuda_pinned_and_pageable(tmp_path, capsys) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = tmp_path / "h2d"
    assert (
        h2d.main(["--device", "cuda", "--sizes-mib", "1,16,64", "--repeats", "5", "--out-dir", str(out)]) == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["device"] == "cuda"
    # both kinds measured (pinned vs pageable speed is a figure of benchmarks/gpu_check.sh, not a test)
    assert summary["pinned_gb_per_s"] > 0 and summary["pageable_gb_per_s"] > 0
