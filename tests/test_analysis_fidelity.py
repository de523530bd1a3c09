"""analysis.fidelity on hand-made live and simulated cycles (no live engine needed)."""

import dataclasses

import numpy as np
import pandas as pd
import pytest
from tiny_shapes import TINY_COST

from analysis import fidelity
from calibration.synthetic import synthetic_tables

COST = TINY_COST  # 2 MB experts, 4 layers (tests/tiny_shapes.py)
KEY = {"bandwidth_gb_per_s": 5.0, "cache_experts_per_layer": 4, "policy": "specfit"}


@pytest.fixture()
def live() -> tuple[pd.DataFrame, pd.DataFrame]:
    return synthetic_tables(COST, num_cycles=50, noise_rel=0.0, seed=0)


def test_same_subtree_matches_on_request_and_position() -> None:
    live = pd.DataFrame(
        {"request_id": [0, 0, 1], "position": [0, 2, 0], "verified_nodes": [[0, 1], [0], [0, 2, 1]]}
    )
    sim = pd.DataFrame(
        {"request_id": [0, 0, 1], "position": [0, 3, 0], "verified_nodes": [[0, 1], [0], [0, 1]]}
    )
    # positions (0,0) and (1,0) are compared; (0,2)/(0,3) were not both reached
    assert fidelity.same_subtree(live, sim) == (2, 1)


def test_exact_cell_passes_every_target(live) -> None:
    cycles, transfers = live
    totals = fidelity.live_totals(cycles)
    sim_totals = {
        "tokens_per_s": totals["tokens_per_s"],
        "hit_rate": totals["hit_rate"],
        "tau": totals["tau"],
    }
    row = fidelity.compare_cell(KEY, cycles, transfers, sim_totals, cycles, COST)
    assert row["ok"] and row["off_terms"] == ""
    assert row["throughput_error_pct"] == pytest.approx(0.0)
    assert row["same_subtree_fraction"] == 1.0 and row["num_decisions_compared"] == 50
    assert row["cycle_error_median_pct"] == pytest.approx(0.0, abs=1e-9)
    assert row["policy"] == "specfit"


def test_missed_targets_name_the_off_term(live) -> None:
    cycles, transfers = live
    slow = cycles.copy()
    slow["draft_s"] *= 1.5  # the draft term is off by 50 %
    slow["cycle_s"] = slow["draft_s"] + slow["verify_s"] + slow["h2d_s"]
    totals = fidelity.live_totals(slow)
    sim = {"tokens_per_s": totals["tokens_per_s"] * 1.05, "hit_rate": totals["hit_rate"] - 0.01, "tau": 1.0}
    other = slow.copy()
    other["verified_nodes"] = [[0]] * len(other)
    row = fidelity.compare_cell(KEY, slow, transfers, sim, other, COST)
    assert not row["ok"]
    assert row["off_terms"].split(";") == ["draft", "cache", "decisions"]
    assert row["throughput_error_pct"] == pytest.approx(5.0)
    assert row["hit_rate_diff_points"] == pytest.approx(-1.0)


def test_overall_pools_cycles() -> None:
    rows = [
        {"ok": True, "throughput_error_pct": 1.0, "hit_rate_diff_points": 0.1, "same_subtree_fraction": 1.0},
        {
            "ok": False,
            "throughput_error_pct": -3.0,
            "hit_rate_diff_points": 0.2,
            "same_subtree_fraction": np.nan,
        },
    ]
    out = fidelity.overall(rows, [np.array([1.0, -2.0]), np.array([3.0])])
    assert out["cycle_error_median_pct"] == pytest.approx(2.0)
    assert out["num_cells_ok"] == 1 and out["max_abs_throughput_error_pct"] == 3.0
    assert out["min_same_subtree_fraction"] == 1.0


def _repeat(cycle_ms, decision_ms, nodes, misses=None, keys=((0, 0), (0, 1))) -> pd.DataFrame:
    """A hand-built cycles table: one row per (request_id, cycle_index) in ``keys``."""
    n = len(keys)
    return pd.DataFrame(
        {
            "request_id": [k[0] for k in keys],
            "cycle_index": [k[1] for k in keys],
            "position": [k[1] for k in keys],
            "context_len": [10 + k[1] for k in keys],
            "num_draft_levels": [1] * n,
            "num_nodes_verified": [len(v) for v in nodes],
            "verified_nodes": nodes,
            "layer_misses": misses or [[1, 0, 0, 0]] * n,
            "draft_s": [1e-3] * n,
            "verify_s": [2e-3] * n,
            "h2d_s": [0.0] * n,
            "cycle_s": [v * 1e-3 for v in cycle_ms],
            "decision_s": [np.nan if v is None else v * 1e-3 for v in decision_ms],
        }
    )


def test_match_repeats_drops_cycles_whose_subtrees_or_work_differ() -> None:
    keys1 = ((0, 0), (0, 1), (1, 0), (1, 1))
    keys2 = ((1, 1), (1, 0), (0, 1), (0, 0), (2, 0))  # other order, one cycle repeat 1 lacks
    r1 = _repeat([10, 11, 12, 13], [None] * 4, [[0, 1], [0], [0, 2], [0]], keys=keys1)
    # repeat 2 (rows in keys2 order): (1,1) same; (1,0) same nodes other order; (0,1) other
    # subtree; (0,0) same subtree but other misses (other cache state): not the same work
    r2 = _repeat(
        [23, 22, 21, 20, 30],
        [None] * 5,
        [[0], [2, 0], [0, 1], [0, 1], [0]],
        misses=[[1, 0, 0, 0]] * 3 + [[2, 0, 0, 0], [1, 0, 0, 0]],
        keys=keys2,
    )
    match = fidelity.match_repeats([r1, r2])
    assert match.num_repeats == 2 and match.num_compared == 4 and match.num_same_subtree == 3
    assert match.same_subtree_fraction == pytest.approx(0.75)
    assert match.num_matched == 2  # (1,0) and (1,1), sorted by key, aligned row for row
    for table in match.tables:
        assert list(zip(table["request_id"], table["cycle_index"])) == [(1, 0), (1, 1)]
    assert list(match.tables[0]["cycle_s"] * 1e3) == pytest.approx([12, 13])
    assert list(match.tables[1]["cycle_s"] * 1e3) == pytest.approx([22, 23])
    single = fidelity.match_repeats([r1])
    assert single.num_matched == 4 and np.isnan(single.same_subtree_fraction)
    with pytest.raises(ValueError, match="repeat 2 .*cycle_index"):
        fidelity.match_repeats([r1, r1.drop(columns="cycle_index")])
    with pytest.raises(ValueError, match="repeat 1 has a"):
        fidelity.match_repeats([pd.concat([r1, r1])])
    with pytest.raises(ValueError, match="repeats"):
        fidelity.match_repeats([])


def test_mean_table_and_cycle_noise_on_two_repeats() -> None:
    # model cycle = cycle_s - decision_s: cycle (0,0) 10 and 12 ms; cycle (0,1) 19 and 17 ms
    r1 = _repeat([10, 20], [None, 1], [[0], [0, 1]])
    r2 = _repeat([12, 20], [None, 3], [[0], [0, 1]])
    match = fidelity.match_repeats([r1, r2])
    mean = fidelity.mean_repeat_cycles(match)
    assert list(mean["cycle_s"] * 1e3) == pytest.approx([11.0, 20.0])
    assert np.isnan(mean["decision_s"].iloc[0]) and mean["decision_s"].iloc[1] == pytest.approx(2e-3)
    noise = fidelity.cycle_noise_pct(match)
    # sample std of (10, 12) is sqrt(2): CV = 100 * 1.41421 / 11; of (19, 17): 100 * 1.41421 / 18
    assert noise == pytest.approx([100 * np.sqrt(2) / 11, 100 * np.sqrt(2) / 18])
    assert np.isnan(fidelity.cycle_noise_pct(fidelity.match_repeats([r1]))).all()
    table = fidelity.cycle_error_table(COST, match)
    assert list(table["measured_cycle_s"] * 1e3) == pytest.approx([11.0, 18.0])
    expected = 100 * (table["predicted_cycle_s"] - table["measured_cycle_s"]) / table["measured_cycle_s"]
    assert list(table["cycle_error_pct"]) == pytest.approx(list(expected))
    assert list(table["cycle_noise_pct"]) == pytest.approx(list(noise))


def test_run_speed_factors_take_the_whole_run_speed_out_of_the_noise() -> None:
    # three repeats of five cycles: repeat 2 ran 20 % slower on every cycle, repeat 3 10 % faster,
    # and one cycle of repeat 1 had a per-cycle hiccup of +3 ms
    keys = tuple((0, i) for i in range(5))
    base = np.array([10.0, 12.0, 14.0, 16.0, 18.0])
    nodes = [[0]] * 5
    r1 = _repeat(list(base + np.array([0, 0, 3.0, 0, 0])), [None] * 5, nodes, keys=keys)
    r2 = _repeat(list(base * 1.2), [None] * 5, nodes, keys=keys)
    r3 = _repeat(list(base * 0.9), [None] * 5, nodes, keys=keys)
    match = fidelity.match_repeats([r1, r2, r3])
    factors = fidelity.run_speed_factors(match)
    assert factors == pytest.approx([1.0, 1.2, 0.9] / np.mean([1.0, 1.2, 0.9]))
    raw = fidelity.cycle_noise_pct(match)
    normed = fidelity.cycle_noise_pct(match, run_normalised=True)
    # the whole-run part is gone: the four cycles without the hiccup have no noise left
    assert np.delete(normed, 2) == pytest.approx(np.zeros(4), abs=1e-9)
    assert normed[2] > 5.0 and np.all(np.delete(raw, 2) > 10.0)
    table = fidelity.cycle_error_table(COST, match)
    assert list(table["cycle_run_noise_pct"]) == pytest.approx(list(normed))
    one = fidelity.match_repeats([r1])
    assert fidelity.run_speed_factors(one) == pytest.approx([1.0])
    assert np.isnan(fidelity.cycle_noise_pct(one, run_normalised=True)).all()


def test_error_decomposition_separates_cell_offsets_from_within_cell_error() -> None:
    rng = np.random.default_rng(0)
    # cell A: +10 % on every cycle (a whole-cell offset); cell B: unbiased; no per-cycle noise
    a, b = np.full(400, 10.0), rng.normal(0.0, 1.0, 400)
    zero = [np.zeros(400), np.zeros(400)]
    out = fidelity.error_decomposition([a, b], zero, zero, repeats=3)
    assert out["cycle_error_cell_offset_rms_pct"] == pytest.approx(np.sqrt((100 + np.median(b) ** 2) / 2))
    assert out["cycle_error_within_cell_median_pct"] == pytest.approx(
        np.median(np.abs(np.concatenate([a - 10.0, b - np.median(b)])))
    )
    assert out["cycle_error_bias_rms_pct"] == pytest.approx(np.sqrt(np.mean(np.concatenate([a, b]) ** 2)))
    assert out["repeats_for_aim_median"] is None and np.isnan(out["noise_run_speed_fraction"])
    # errors that are exactly the noise of 3-repeat means: no bias left; the run speed explains
    # 3/4 of the noise variance (12 % raw, 6 % once each run is divided by its speed factor)
    noise = np.full(20000, 12.0)
    err = rng.normal(0.0, 12.0 / np.sqrt(3), 20000)
    deviation = rng.normal(0.0, 12.0, (3, 20000))  # the 1-repeat errors of a bias-free model
    out = fidelity.error_decomposition([err], [noise], [np.full(20000, 6.0)], repeats=3, per_cycle_deviation=[deviation])
    assert out["cycle_error_bias_rms_pct"] < 0.5
    assert out["noise_run_speed_fraction"] == pytest.approx(0.75)
    assert out["noise_cycle_run_normalised_median_pct"] == pytest.approx(6.0)
    # an unbiased model meets the 3 % median aim once 0.6745 * 12 / sqrt(R) <= 3: R >= 7.28 -> 8
    assert out["repeats_for_aim_median"] == 8
    assert out["repeats_for_aim_p90"] == int(np.ceil((1.64485 * 12 / 8.0) ** 2))  # 6.09 -> 7
    assert fidelity.noise_floor_pct(deviation, 8, 0.5) <= 3.0 < fidelity.noise_floor_pct(deviation, 7, 0.5)
    # one repeat measures no noise: no bias figure
    assert np.isnan(fidelity.error_decomposition([err], [noise], None, repeats=1)["cycle_error_bias_rms_pct"])
    # a cell of few cycles is left out of the run-speed fraction (its speed factor is fitted on the
    # cycles it normalises: one cycle is all "run speed"); no noise at all: 2 repeats suffice
    few = fidelity.error_decomposition([err[:5]], [noise[:5]], [np.zeros(5)], 3, per_cycle_deviation=[np.zeros(5)])
    assert np.isnan(few["noise_run_speed_fraction"])
    assert few["repeats_for_aim_median"] == few["repeats_for_aim_p90"] == 2


def test_repeat_spread_pct() -> None:
    assert fidelity.repeat_spread_pct([9.0, 10.0, 11.0]) == pytest.approx(20.0)
    assert np.isnan(fidelity.repeat_spread_pct([10.0]))


def _mixture_quantile(sigma: np.ndarray, quantile: float) -> float:
    """The ``quantile`` of the equal-weight mixture of |N(0, sigma_i)| (the exact truth)."""
    from scipy.optimize import brentq
    from scipy.special import ndtr

    return brentq(lambda x: np.mean(2 * ndtr(x / sigma) - 1) - quantile, 0.0, 10 * sigma.max(), xtol=1e-9)


@pytest.mark.parametrize("repeats", [2, 3, 6])
def test_noise_floor_and_repeats_needed_match_the_truth_of_simulated_noise(repeats: int) -> None:
    # Gaussian per-cycle noise whose level is spread over the cycles (lognormal, median 12 %): the
    # bias-free floor against R-repeat means is the mixture quantile of |N(0, s_i / sqrt(R))|. The
    # per-cycle CVs estimated from R samples scatter, and the mixture of their half-normals has a
    # median ~2x too low at R = 2-3 (the former estimator: 4 repeats at R = 3 where 7 are needed);
    # the leave-one-out deviations are each N(0, s_i) and give the truth from any R
    rng = np.random.default_rng(1)
    num_cycles = 1500
    sigma = np.clip(12.0 * np.exp(rng.normal(0.0, 0.4, num_cycles)), 1.0, 30.0)
    base = rng.uniform(10.0, 20.0, num_cycles)
    keys = tuple((0, i) for i in range(num_cycles))
    nodes = [[0]] * num_cycles
    tables = [
        _repeat(list(base * (1 + sigma / 100 * rng.normal(size=num_cycles))), [None] * num_cycles, nodes, keys=keys)
        for _ in range(repeats)
    ]
    deviation = fidelity.cycle_deviation_pct(fidelity.match_repeats(tables))
    assert deviation.shape == (repeats, num_cycles)
    for q, aim in ((0.5, 3.0), (0.9, 8.0)):
        truth = _mixture_quantile(sigma, q)
        assert fidelity.noise_floor_pct(deviation, repeats, q) == pytest.approx(truth / np.sqrt(repeats), rel=0.07)
        need = fidelity.repeats_for_aim(deviation, aim, q)
        assert abs(need - max(2, int(np.ceil((truth / aim) ** 2)))) <= 1
    assert fidelity.repeats_for_aim(deviation, 3.0, 0.5) >= 6  # truth ~7-8; the CV-based figure was 3-4


def test_noise_floor_and_repeats_edge_cases() -> None:
    dev = np.array([[3.0, -1.0, np.nan], [-3.0, 1.0, np.nan]])
    assert fidelity.noise_floor_pct(dev, 4, 0.5) == pytest.approx(2.0 / 2)  # median |dev| 2, / sqrt(4)
    assert fidelity.noise_floor_pct(np.zeros(4), 3, 0.5) == 0.0  # no noise: an exact model meets any aim
    assert fidelity.repeats_for_aim(np.zeros(4), 3.0, 0.5) == 2
    assert np.isnan(fidelity.noise_floor_pct(dev, 1, 0.5))  # one repeat measures nothing
    assert np.isnan(fidelity.noise_floor_pct(np.full(3, np.nan), 3, 0.5))
    assert fidelity.repeats_for_aim(np.full(3, np.nan), 3.0, 0.5) is None
    with pytest.raises(ValueError, match="quantile"):
        fidelity.noise_floor_pct(dev, 3, 1.0)
    with pytest.raises(ValueError, match="aim_pct"):
        fidelity.repeats_for_aim(dev, 0.0, 0.5)
    one = fidelity.match_repeats([_repeat([10.0, 12.0], [None, None], [[0], [0]])])
    assert fidelity.cycle_deviation_pct(one).shape == (1, 2) and np.isnan(fidelity.cycle_deviation_pct(one)).all()


def _pre_router_cycles(speed: float, nodes: list[int], seed: int) -> pd.DataFrame:
    """Cycles whose attention + router time is ``speed * (2 ms + 0.3 ms/node + 1 us/token)``
    split over 4 layers (the rest of each layer's compute 3x that, irrelevant to the gauge)."""
    rng = np.random.default_rng(seed)
    ctx = rng.integers(20, 200, size=len(nodes))
    pre = speed * (2e-3 + 0.3e-3 * np.asarray(nodes) + 1e-6 * ctx)
    return pd.DataFrame(
        {
            "num_nodes_verified": nodes,
            "context_len": ctx,
            "layer_pre_router_s": [[p / 4] * 4 for p in pre],
            "layer_compute_s": [[p] * 4 for p in pre],
        }
    )


def test_compute_speed_is_the_cells_attention_router_time_against_the_fit_runs() -> None:
    reference = [_pre_router_cycles(1.0, [1] * 20, 0), _pre_router_cycles(1.0, [8] * 20, 1)]
    # a cell of other tree sizes, its compute 30 % slower than the fit runs'
    cell = [_pre_router_cycles(1.3, [2, 3, 4, 5] * 5, 2), _pre_router_cycles(1.3, [3] * 10, 3)]
    assert fidelity.compute_speed(reference, cell) == pytest.approx(1.3, rel=1e-6)
    assert fidelity.compute_speed(reference, reference) == pytest.approx(1.0)
    # fit runs at two speeds: the cell is measured against their middle
    mixed = [_pre_router_cycles(0.8, [1] * 20, 0), _pre_router_cycles(1.2, [1] * 20, 1), _pre_router_cycles(1.0, [8] * 21, 4)]
    assert fidelity.compute_speed(mixed, [_pre_router_cycles(1.0, [1] * 9, 5)]) == pytest.approx(1.0, rel=0.05)
    # traces without the column (recorded before it) measure nothing
    old = [c.drop(columns=["layer_pre_router_s"]) for c in reference]
    assert np.isnan(fidelity.compute_speed(old, cell)) and np.isnan(fidelity.compute_speed(reference, old))
    assert np.isnan(fidelity.compute_speed([], cell))


def _scaled(cycles: pd.DataFrame, factor: float) -> pd.DataFrame:
    out = cycles.copy()
    for col in ("draft_s", "verify_s", "h2d_s", "cycle_s"):
        out[col] = out[col] * factor
    return out


def test_two_repeats_pooled_throughput_mean_error_and_noise_floor(live) -> None:
    cycles, transfers = live  # noise-free: the cost model is exact on repeat 1
    slow = _scaled(cycles, 1.1)  # repeat 2: every cycle 10 % slower
    pooled = fidelity.live_totals(pd.concat([cycles, slow]))["tokens_per_s"]
    tps1 = fidelity.live_totals(cycles)["tokens_per_s"]
    assert pooled == pytest.approx(2 * tps1 / 2.1)  # total tokens / total seconds

    def row(sim_factor: float) -> dict:
        sim = {"tokens_per_s": pooled * sim_factor, "hit_rate": fidelity.live_totals(cycles)["hit_rate"]}
        return fidelity.compare_cell(KEY, [cycles, slow], [transfers, transfers], sim, cycles, COST)

    inside = row(1.05)
    assert inside["live_tokens_per_s"] == pytest.approx(pooled)
    assert inside["throughput_error_pct"] == pytest.approx(5.0)
    # spread of (tps1, tps1 / 1.1): (1 - 1/1.1) / ((1 + 1/1.1) / 2) = 9.524 %
    assert inside["live_repeat_spread_pct"] == pytest.approx(100 * (1 - 1 / 1.1) / ((1 + 1 / 1.1) / 2))
    # the error is against the per-cycle mean (1.05x the prediction): -4.76 %, not repeat 2's -9.09 %
    assert inside["cycle_error_median_pct"] == pytest.approx(100 * (1 - 1 / 1.05))
    assert inside["cycle_error_p90_pct"] == pytest.approx(100 * (1 - 1 / 1.05))
    assert inside["draft_error_median_pct"] == pytest.approx(100 * (1 - 1 / 1.05))
    # CV of (x, 1.1x) with ddof=1: (0.1 / sqrt(2)) / 1.05 = 6.73 %
    assert inside["cycle_noise_median_pct"] == pytest.approx(100 * 0.1 / np.sqrt(2) / 1.05)
    assert inside["cycle_noise_p90_pct"] == pytest.approx(100 * 0.1 / np.sqrt(2) / 1.05)
    assert inside["num_repeats"] == 2 and inside["num_cycles_live"] == 100
    assert inside["num_cycles_matched"] == 50 and inside["repeat_same_subtree_fraction"] == 1.0
    # the aims are relative to the cell's measured noise: 5 % <= 9.5 % spread, 4.76 % <= 6.73 %
    assert inside["aim_throughput"] and inside["aim_cycle_median"] and inside["ok"]
    assert inside["within_noise"] and fidelity.missed_aims(inside) == []
    outside = row(1.12)  # 12 % off: beyond the 9.5 % spread
    assert not outside["ok"] and not outside["within_noise"] and not outside["aim_throughput"]
    assert outside["aim_cycle_median"] and outside["off_terms"] == "throughput"
    assert fidelity.missed_aims(outside) == ["throughput error +12 % > repeat spread 9.5 %"]


def test_single_repeat_is_todays_comparison_and_within_noise_equals_ok(live) -> None:
    cycles, transfers = live
    sim = {"tokens_per_s": fidelity.live_totals(cycles)["tokens_per_s"] * 1.03, "hit_rate": 0.5}
    one = fidelity.compare_cell(KEY, cycles, transfers, sim, cycles, COST)
    listed = fidelity.compare_cell(KEY, [cycles], [transfers], sim, cycles, COST)
    assert one["throughput_error_pct"] == pytest.approx(3.0)
    assert pd.Series(one).equals(pd.Series(listed))  # NaN-aware: a lone table = a one-item list
    assert np.isnan(one["live_repeat_spread_pct"]) and np.isnan(one["cycle_noise_median_pct"])
    assert np.isnan(one["repeat_same_subtree_fraction"]) and one["num_repeats"] == 1
    assert one["within_noise"] == one["ok"]
    with pytest.raises(ValueError, match="live_transfers"):
        fidelity.compare_cell(KEY, [cycles, cycles], [transfers], sim, cycles, COST)


def test_overall_reports_the_noise_floor() -> None:
    rows = [
        {"ok": False, "within_noise": True, "throughput_error_pct": 3.0, "hit_rate_diff_points": 0.0,
         "same_subtree_fraction": 1.0, "live_repeat_spread_pct": 4.0},
        {"ok": True, "within_noise": True, "throughput_error_pct": 1.0, "hit_rate_diff_points": 0.0,
         "same_subtree_fraction": 1.0, "live_repeat_spread_pct": 2.0},
        {"ok": False, "within_noise": False, "throughput_error_pct": 9.0, "hit_rate_diff_points": 0.0,
         "same_subtree_fraction": 1.0, "live_repeat_spread_pct": 9.0},
    ]  # fmt: skip
    errors = [np.array([1.0, np.nan]), np.array([-3.0]), np.array([2.0])]
    noise = [np.array([1.0, 2.0]), np.array([3.0]), np.array([np.nan, 4.0])]
    out = fidelity.overall(rows, errors, noise)
    assert out["cycle_error_median_pct"] == pytest.approx(2.0)  # |1|, |-3|, |2|: NaN left out
    assert out["noise_cycle_median_pct"] == pytest.approx(2.5)
    assert out["noise_cycle_p90_pct"] == pytest.approx(np.percentile([1, 2, 3, 4], 90))
    assert out["median_live_repeat_spread_pct"] == 4.0 and out["max_live_repeat_spread_pct"] == 9.0
    assert out["num_cells_within_noise"] == 2 and out["all_within_noise"] is False
    assert fidelity.overall(rows[:2], errors[:2], noise[:2])["all_within_noise"] is True
    assert np.isnan(fidelity.overall(rows, errors)["noise_cycle_median_pct"])


def test_cycle_error_figure_adds_a_noise_panel_only_with_noise(tmp_path, monkeypatch) -> None:
    from analysis import figures

    drawn: list = []
    save = figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, path: (drawn.append(len(fig.axes)), save(fig, path))[1])
    errors = pd.DataFrame({"policy": ["ar"] * 4, "cycle_error_pct": [-3.0, -1.0, 1.0, 4.0]})
    assert figures.cycle_error_distribution(errors, tmp_path / "a.png").stat().st_size > 1000
    noisy = errors.assign(cycle_noise_pct=[0.5, 1.0, np.nan, 2.0])
    assert figures.cycle_error_distribution(noisy, tmp_path / "b.png").stat().st_size > 1000
    unmeasured = errors.assign(cycle_noise_pct=np.nan)  # --repeats 1: no noise panel
    assert figures.cycle_error_distribution(unmeasured, tmp_path / "c.png").stat().st_size > 1000
    assert figures.cycle_error_distribution(errors.iloc[:0], tmp_path / "d.png") is None
    assert drawn == [1, 2, 1]


def test_docs_define_every_fidelity_csv_column(live) -> None:
    """docs/metrics.md has a column table for fidelity.csv: every column compare_cell writes, with
    a unit and a definition (off_terms, planner/draft/verify/h2d errors, counts, tau included)."""
    from pathlib import Path

    cycles, transfers = live
    totals = fidelity.live_totals(cycles)
    row = fidelity.compare_cell(KEY, [cycles, cycles], [transfers, transfers], totals, cycles, COST)
    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    table = text[text.index("### `fidelity.csv` columns") :]
    defined = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            defined[cells[0].strip("`")] = cells
    missing = [c for c in row if c not in defined]
    assert missing == []
    for name in row:
        unit, definition = defined[name][1], " ".join(defined[name][2:])
        assert unit and len(definition) >= 10, name
    for name in ("off_terms", "planner_error_median_pct", "num_decisions_compared", "live_tau", "sim_tau"):
        assert name in defined


def test_short_table_maps_every_short_header_to_its_csv_name() -> None:
    table = pd.DataFrame([{"policy": "ar", "cycle_noise_p90_pct": 6.5, "ok": True, "extra": 1}])
    short, legend = fidelity.short_table(table, ["policy", "cycle_noise_p90_pct", "ok", "absent"])
    assert list(short.columns) == ["policy", "noise_p90%", "ok"]
    assert legend == "columns (fidelity.csv names): noise_p90% = cycle_noise_p90_pct"


def test_sim_cycle_agreement_hand_computed() -> None:
    """Errors on the shared cycles (+10 %, -10 %, 0 %): mean |error| 6.67 %, signed 0 %; the KS
    test compares all cycle times of each side (identical samples: statistic 0, p-value 1)."""
    import pandas as pd

    from analysis.fidelity import sim_cycle_agreement

    live = pd.DataFrame({"request_id": [0, 0, 1], "cycle_index": [0, 1, 0], "cycle_s": [1.0, 2.0, 4.0]})
    sim = pd.DataFrame(
        {"request_id": [0, 0, 1, 1], "cycle_index": [0, 1, 0, 1], "cycle_s": [1.1, 1.8, 4.0, 9.0]}
    )
    got = sim_cycle_agreement(live, sim)
    assert got["sim_cycle_mean_abs_pct_error"] == pytest.approx(20 / 3)
    assert got["sim_cycle_mean_signed_pct_error"] == pytest.approx(0.0, abs=1e-12)
    assert 0 < got["cycle_ks_statistic"] <= 1 and 0 <= got["cycle_ks_pvalue"] <= 1
    same = sim_cycle_agreement(live, live)
    assert same["cycle_ks_statistic"] == 0.0 and same["cycle_ks_pvalue"] == pytest.approx(1.0)
    assert np.isnan(sim_cycle_agreement(live, sim.iloc[:0])["cycle_ks_pvalue"])


def _split_tables():
    """Two cycles, live and simulated, with hand-set phase times (ms) and misses."""
    base = {"request_id": [0, 0], "cycle_index": [0, 1], "verified_nodes": [[0, 1], [0]]}
    live = pd.DataFrame(
        dict(
            base,
            draft_s=[2e-3, 0.0],
            decision_s=[1e-3, np.nan],
            verify_s=[10e-3, 8e-3],
            h2d_s=[4e-3, 2e-3],
            cycle_s=[18e-3, 11e-3],
            cache_misses=[4, 2],
        )
    )  # rest (bookkeeping): 1 ms in each cycle
    sim = pd.DataFrame(
        dict(base, draft_s=[3e-3, 0.0], decision_s=[0.5e-3, 0.5e-3], verify_s=[9e-3, 9e-3],
             h2d_s=[5e-3, 2e-3], cycle_s=[17.5e-3, 11.5e-3], cache_misses=[5, 2])
    )  # fmt: skip
    return live, sim


def test_error_split_adds_up_to_the_time_error_term_by_term() -> None:
    live, sim = _split_tables()
    cost = dataclasses.replace(COST, h2d_s_per_transfer=1e-3 - COST.expert_bytes / COST.h2d_bytes_per_s)
    assert cost.s_per_miss == pytest.approx(1e-3)  # 1 ms per miss, 0.25 ms of it compute
    got = fidelity.error_split(live, sim, cost, compute_s_per_miss=0.25e-3)
    total = 29e-3
    expected_ms = {
        "draft": 1.0,  # 3 - 2
        "decision": 0.5 + 0.5 - 1.0,  # the live null decision is 0
        "verify": (9 + 0.25 * 4 - 10 - 1) + (9 + 0.25 * 2 - 8 - 1),  # compute per live miss, rest
        "h2d": (4 * 0.75 - 4) + (2 * 0.75 - 2),  # per-miss H2D at the live miss count
        "cache": (5 - 4) * 1.0,  # one more miss in the simulator
        "overlap": 0.0,
    }
    for term, ms in expected_ms.items():
        assert got[f"split_{term}_pct"] == pytest.approx(100 * ms * 1e-3 / total), term
    signed = 100 * (sim["cycle_s"].sum() - live["cycle_s"].sum()) / total
    assert sum(got[f"split_{t}_pct"] for t in fidelity.SPLIT_TERMS) == pytest.approx(signed)
    assert got["split_num_cycles"] == 2 and got["split_live_s"] == pytest.approx(total)
    other = sim.assign(verified_nodes=[[0], [0]])  # cycle 0 chose another subtree: left out
    assert fidelity.error_split(live, other, cost)["split_num_cycles"] == 1
    assert np.isnan(fidelity.error_split(live, sim.iloc[:0], cost)["split_draft_pct"])


def test_error_split_with_prefetch_prices_the_prefetch_copies_apart() -> None:
    """Next-layer (or draft) prefetch, overlap off: the live cycle copied 2 demand misses and 2
    prefetched experts (1 ms each, h2d_s 4 ms) and waited 3 ms for them (one prefetch copy hidden
    behind compute), with 1 ms of bookkeeping; the simulator made the same copies and hid both
    prefetch copies. The per-copy price is exact (1 ms), so ``h2d`` and ``prefetch`` are 0, the
    bookkeeping stays in ``verify`` and ``overlap`` is the copy the simulator hides beyond the
    live run's (before: the prefetch copies were charged to ``h2d``, -2 ms, the bookkeeping to
    nothing)."""
    base = {"request_id": [0], "cycle_index": [0], "verified_nodes": [[0, 1]], "draft_s": [0.0],
            "decision_s": [0.0], "verify_s": [10e-3], "cache_misses": [2], "num_prefetch_issued": [2]}
    live = pd.DataFrame(dict(base, h2d_s=[4e-3], cycle_s=[14e-3], layer_stall_s=[[1.5e-3, 1.5e-3]]))
    sim = pd.DataFrame(dict(base, h2d_s=[4e-3], cycle_s=[12e-3]))
    cost = dataclasses.replace(
        COST, h2d_s_per_transfer=1e-3 - COST.expert_bytes / COST.h2d_bytes_per_s, overlap_h2d=False
    )
    got = fidelity.error_split(live, sim, cost)
    expected_ms = {"draft": 0.0, "decision": 0.0, "verify": -1.0, "h2d": 0.0, "prefetch": 0.0, "cache": 0.0,
                   "overlap": -1.0}  # fmt: skip
    for term, ms in expected_ms.items():
        assert got[f"split_{term}_pct"] == pytest.approx(100 * ms / 14, abs=1e-9), term
    # a fitted compute per miss moves c per live miss from ``h2d`` to ``verify``; a prefetch copy
    # is no miss: the simulator charges it the whole s (sim.replay.link_from_cost keeps c in the
    # link's latency), so ``prefetch`` and ``overlap`` do not change (before: prefetch -0.4 ms,
    # overlap -0.6 ms)
    withc = fidelity.error_split(live, sim, cost, compute_s_per_miss=0.2e-3)
    expected_c = dict(expected_ms, verify=-0.6, h2d=-0.4)
    for term, ms in expected_c.items():
        assert withc[f"split_{term}_pct"] == pytest.approx(100 * ms / 14, abs=1e-9), term
    # one prefetch more in the simulator shows in ``prefetch``, at the per-copy price
    more = fidelity.error_split(live, sim.assign(num_prefetch_issued=[3], cycle_s=[13e-3]), cost)
    assert more["split_prefetch_pct"] == pytest.approx(100 * 1 / 14)
    # the repeats' mean keeps the stall: the same split from mean_repeat_cycles' table
    mean = fidelity.mean_repeat_cycles(fidelity.match_repeats([live, live]))
    assert mean["stall_s"].tolist() == pytest.approx([3e-3])
    assert fidelity.error_split(mean, sim, cost) == pytest.approx(got)


def test_by_policy_pools_cycles_and_weights_the_split() -> None:
    table = pd.DataFrame(
        {"policy": ["ar", "specfit", "specfit"], "bandwidth_gb_per_s": [1.0, 1.0, 1.0],
         "throughput_error_pct": [1.0, 10.0, 20.0], "split_live_s": [1.0, 1.0, 3.0],
         **{f"split_{t}_pct": [0.0, 4.0, 8.0] for t in fidelity.SPLIT_TERMS}}
    )  # fmt: skip
    errors = pd.DataFrame(
        {"policy": ["ar", "specfit", "specfit", "specfit"], "bandwidth_gb_per_s": [1.0] * 4,
         "cycle_error_pct": [1.0, -2.0, -4.0, 6.0]}
    )  # fmt: skip
    out = fidelity.by_policy(table, errors).set_index("policy")
    spec = out.loc["specfit"]
    assert spec["cells"] == 2 and spec["cycles"] == 3 and spec["throughput_error_pct"] == 15.0
    assert spec["cycle_error_median_pct"] == 4.0 and spec["cycle_error_signed_median_pct"] == -2.0
    assert spec["split_verify_pct"] == pytest.approx((4.0 * 1 + 8.0 * 3) / 4)
    assert out.loc["ar", "cycles"] == 1


def test_overall_states_the_grid_aims() -> None:
    rows = [
        {"ok": True, "throughput_error_pct": 1.0, "hit_rate_diff_points": 0.0, "same_subtree_fraction": 1.0}
    ]
    met = fidelity.overall(rows, [np.array([1.0, -2.5, 7.0])])
    assert met["aim_cycle_median"] and met["aim_cycle_p90"] and met["all_aims_met"]
    wide = fidelity.overall(rows, [np.array([1.0, -2.5, 2.0, 30.0])])
    assert wide["aim_cycle_median"] and not wide["aim_cycle_p90"] and not wide["all_aims_met"]
    assert not fidelity.overall([dict(rows[0], ok=False)], [np.array([1.0])])["all_aims_met"]


def test_error_split_with_overlap_on_books_live_compute_as_compute() -> None:
    """Overlap mode "on": the live forward computed 10 ms (its late-expert calls included, as
    ``verify_s`` = wall - stall), stalled 2 ms (placing and waits, ``layer_stall_s``) and spent
    1 ms on bookkeeping outside it; 3 misses over 2 layers. The model charges 1 ms per miss, of it
    0.6 ms on the compute stream (0.2 ms placing, ``c`` = 0.4 ms per-miss work) and a 0.3 ms late
    call per layer with misses; the replay booked 9 ms of verify, 1.8 ms placing and 0.6 ms of
    late calls outside its ``verify_s``. ``verify`` compares the compute the two count as compute
    (bookkeeping, per-miss work and late calls on the simulator's side: -0.2 ms) and ``overlap``
    is what is left of the stall (before: the bookkeeping and late calls fell to ``overlap``,
    verify +0.2 ms, overlap -0.6 ms: the split's verify/overlap pattern that flipped sign with
    the bandwidth)."""
    base = {"request_id": [0], "cycle_index": [0], "verified_nodes": [[0, 1]], "draft_s": [0.0],
            "decision_s": [0.0], "cache_misses": [3], "h2d_s": [3e-3]}  # fmt: skip
    live = pd.DataFrame(
        dict(base, verify_s=[10e-3], cycle_s=[13e-3], layer_stall_s=[[1e-3, 0.0, 1e-3]], layer_misses=[[2, 0, 1]])
    )
    sim = pd.DataFrame(dict(base, verify_s=[9e-3], cycle_s=[11.4e-3]))
    cost = dataclasses.replace(
        COST, h2d_s_per_transfer=1e-3 - COST.expert_bytes / COST.h2d_bytes_per_s, overlap_h2d=True,
        overlap_mode="on", host_s_per_transfer=0.6e-3, late_call_s=0.3e-3,
    )  # fmt: skip
    got = fidelity.error_split(live, sim, cost, compute_s_per_miss=0.4e-3)
    expected_ms = {"draft": 0.0, "decision": 0.0, "verify": 9 + 0.4 * 3 - 10 - 1 + 0.3 * 2, "h2d": 3 * 0.6 - 3,
                   "prefetch": 0.0, "cache": 0.0, "overlap": -0.2}  # fmt: skip
    for term, ms in expected_ms.items():
        assert got[f"split_{term}_pct"] == pytest.approx(100 * ms / 13, abs=1e-9), term
    assert sum(got[f"split_{t}_pct"] for t in fidelity.SPLIT_TERMS) == pytest.approx(100 * (11.4 - 13) / 13)
    # the late calls are priced only in mode "on"; without the live misses per layer, not at all
    assert fidelity.error_split(live.drop(columns="layer_misses"), sim, cost, 0.4e-3)["split_verify_pct"] == (
        pytest.approx(100 * (expected_ms["verify"] - 0.6) / 13)
    )


def test_a_cell_without_matched_cycles_keeps_every_column_and_the_grid_summary_goes_through(tmp_path) -> None:
    # repeat 2 verified one more node on every cycle: no (request, cycle) does the same work, so the
    # cell has no matched cycle (compare_cell accepts it with a warning); validate must still sum up
    # the grid and write its outputs (it crashed with KeyError 'cycle_run_noise_pct' before)
    from analysis import validate

    c1, t1 = synthetic_tables(COST, num_cycles=20, noise_rel=0.0, seed=0)
    c2 = c1.copy()
    c2["verified_nodes"] = [[*v, 99] for v in c2["verified_nodes"]]
    tot = fidelity.live_totals(c1)
    sim = {"tokens_per_s": tot["tokens_per_s"], "hit_rate": tot["hit_rate"], "tau": tot["tau"]}
    row = fidelity.compare_cell(KEY, [c1, c2], [t1, t1], sim, c1, COST)
    assert row["num_cycles_matched"] == 0
    empty = fidelity.cycle_error_table(COST, fidelity.match_repeats([c1, c2]))
    full = fidelity.cycle_error_table(COST, fidelity.match_repeats([c1, c1.copy()]))
    assert len(empty) == 0 and list(empty.columns) == list(full.columns)
    summary = validate.cycle_noise_summary([empty, full], repeats=2)
    assert summary["cycle_error_floor_median_pct"] == 0.0  # identical repeats: no noise anywhere
    assert summary["repeats_for_aim_median"] == 2  # so 2 repeats suffice
    assert np.isnan(validate.cycle_noise_summary([empty], repeats=2)["cycle_error_bias_rms_pct"])
    validate.write_outputs(tmp_path, pd.DataFrame([row]), summary, [empty])
    assert {"fidelity.csv", "fidelity.json", "cycle_errors.csv"} <= {p.name for p in tmp_path.iterdir()}


def test_bias_line_prints_large_figures_and_a_negative_run_speed_fraction_plainly() -> None:
    from analysis import validate

    line = validate.bias_line(
        {"cycle_error_bias_rms_pct": 123.4, "noise_run_speed_fraction": -0.12, "repeats_for_aim_median": 9}, 3
    )
    assert "123 % rms" in line and "e+" not in line  # was "1.2e+02 %"
    assert "0 % of the per-cycle noise variance is whole-run speed" in line  # was "-12 %"
    assert "from 9 / n/a independent repeats" in line and validate.bias_line({}, 1) == ""


@pytest.mark.parametrize("mode", ["draft_prefetch", "next_layer_prefetch"])
def test_error_split_prices_misses_as_the_copy_stream_does(mode) -> None:
    """Overlap off with a prefetch mode and a placing after the enqueue P > 0: the engines run a
    copy stream, so a miss costs host + max(T_link - P, 0) (cost.priced_s_per_miss). A live cycle
    and its replay that both copied 2 misses at that price differ in no term (before: ``h2d``
    priced each miss at s_per_miss, +2 min(P, T_link), and ``overlap`` took it back). With P = 0
    the price is s_per_miss, the same float."""
    plain = dataclasses.replace(COST, overlap_h2d=False, host_s_per_transfer=0.04e-3, **{mode: True})
    cost = dataclasses.replace(plain, placing_after_enqueue_s_per_transfer=0.02e-3)
    s = cost.priced_s_per_miss
    assert s < cost.s_per_miss and plain.priced_s_per_miss == plain.s_per_miss
    base = {"request_id": [0], "cycle_index": [0], "verified_nodes": [[0, 1]], "draft_s": [0.0],
            "decision_s": [0.0], "verify_s": [10e-3], "cache_misses": [2], "num_prefetch_issued": [0]}
    live = pd.DataFrame(dict(base, h2d_s=[2 * s], cycle_s=[10e-3 + 2 * s], layer_stall_s=[[s, s]]))
    sim = pd.DataFrame(dict(base, h2d_s=[2 * s], cycle_s=[10e-3 + 2 * s]))
    got = fidelity.error_split(live, sim, cost)
    for term in fidelity.SPLIT_TERMS:
        assert got[f"split_{term}_pct"] == pytest.approx(0.0, abs=1e-9), term
