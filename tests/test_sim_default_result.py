"""The default sweep answers its question: on the shipped sample, SpecFit is never below AR or top-N."""

import pandas as pd

from sim.sweep import main


def test_specfit_beats_baselines_on_the_shipped_sample(tmp_path, capsys) -> None:
    out = tmp_path / "sweep"
    rc = main(
        ["--bandwidth", "16,64", "--cache", "0.125,0.5", "--out", str(out), "--no-figures", "--no-progress"]
    )
    assert rc == 0
    assert "acceptance calibration.fit traces/samples/default" in capsys.readouterr().out
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 12
    for _, cell in df.groupby(["bandwidth_gb_per_s", "cache_experts_per_layer"]):
        rate = dict(zip(cell["policy"], cell["tokens_per_s"]))
        assert rate["specfit"] >= max(rate["ar"], rate["topn"])
    assert not df["specfit_below_baseline"].fillna(False).astype(bool).any()
