"""Hand-computed cases for analysis.metrics (conventions in docs/metrics.md)."""

import math

import numpy as np
import pandas as pd
import pytest

from analysis import metrics


def test_tau_counts_bonus_and_averages_all_rounds() -> None:
    # Rounds with 0, 2 and 3 accepted drafts: (1 + 3 + 4) / 3 = 2.666...
    assert metrics.tau([0, 2, 3]) == pytest.approx(8 / 3)
    assert round(metrics.tau([0, 2, 3]), 2) == 2.67
    # Not the last round's value, not the mean without bonus.
    assert metrics.tau([0, 2, 3]) != pytest.approx(4.0)
    assert metrics.tau([0, 2, 3]) != pytest.approx(5 / 3)


def test_tau_from_committed_handles_cut_cycles() -> None:
    # The last cycle hit EOS after 1 accepted draft: committed 1 (no bonus).
    assert metrics.tau_from_committed([1, 3, 4, 1]) == pytest.approx(9 / 4)


def test_per_depth_acceptance_is_conditional() -> None:
    acc = metrics.per_depth_acceptance([0, 2, 3], [3, 3, 3])
    # depth1: reached 3, accepted 2; depth2: reached 2 (those with >=1), accepted 2;
    # depth3: reached 2 (those with >=2), accepted 1.
    np.testing.assert_allclose(acc, [2 / 3, 1.0, 0.5])


def test_per_depth_acceptance_respects_verified_depth() -> None:
    # Second cycle verified only depth 1 and accepted it: it does not reach depth 2.
    acc = metrics.per_depth_acceptance([1, 1, 0], [2, 1, 0])
    # depth1: reached by cycles 0 and 1 (cycle 2 is root-only) -> 2/2; depth2: cycle 0 only -> 0/1.
    np.testing.assert_allclose(acc, [1.0, 0.0])


def test_per_depth_acceptance_on_a_path_ending_at_a_verified_leaf() -> None:
    # docs/metrics.md: the second round's accepted path ends at a leaf of its verified subtree
    # (its subtree reached depth 3 on another branch): it does not reach depth 3 along its path.
    np.testing.assert_allclose(metrics.per_depth_acceptance([0, 2, 3], [1, 2, 3]), [2 / 3, 1.0, 1.0])
    np.testing.assert_allclose(metrics.per_depth_acceptance([0, 2, 3], [1, 3, 3]), [2 / 3, 1.0, 0.5])


def test_per_depth_acceptance_nan_where_unreached() -> None:
    acc = metrics.per_depth_acceptance([0, 0], [3, 3])
    assert acc[0] == 0.0
    assert math.isnan(acc[1]) and math.isnan(acc[2])


def test_per_depth_acceptance_rejects_impossible() -> None:
    with pytest.raises(ValueError, match="num_accepted"):
        metrics.per_depth_acceptance([3], [2])


def test_tokens_per_forward_vs_per_draft_round_differ() -> None:
    committed = [1, 3, 4, 1]  # the 1st and 4th cycles did not speculate
    levels = [0, 3, 3, 0]
    assert metrics.tokens_per_target_forward(committed) == pytest.approx(9 / 4)
    assert metrics.tokens_per_draft_round(committed, levels) == pytest.approx(7 / 2)
    assert math.isnan(metrics.tokens_per_draft_round([1, 1], [0, 0]))
    # with the prefill forward counted explicitly
    assert metrics.tokens_per_target_forward(committed, num_target_forwards=5) == pytest.approx(9 / 5)


def test_throughput_and_hit_rate() -> None:
    assert metrics.throughput_tokens_per_s(120, 4.0) == pytest.approx(30.0)
    with pytest.raises(ValueError, match="wall_s"):
        metrics.throughput_tokens_per_s(10, 0.0)
    assert metrics.hit_rate(3, 1) == pytest.approx(0.75)
    assert math.isnan(metrics.hit_rate(0, 0))
    assert metrics.hit_rate_difference_points(0.755, 0.75) == pytest.approx(0.5)


def test_error_summary_hand_computed() -> None:
    measured = np.array([1.0, 2.0, 4.0, 5.0])
    predicted = np.array([1.1, 1.8, 4.0, 5.5])
    # pct errors: +10, -10, 0, +10 -> abs 10, 10, 0, 10; median 10; p90 = 10.
    s = metrics.error_summary(predicted, measured)
    assert s.num_samples == 4
    assert s.median_abs_pct_error == pytest.approx(10.0)
    assert s.p90_abs_pct_error == pytest.approx(10.0)
    assert s.mean_pct_error == pytest.approx(2.5)
    ss_res = 0.01 + 0.04 + 0 + 0.25
    ss_tot = np.sum((measured - 3.0) ** 2)
    assert s.r2 == pytest.approx(1 - ss_res / ss_tot)


def test_error_summary_p90_interpolates() -> None:
    measured = np.ones(11)
    predicted = 1 + np.arange(11) / 100  # abs pct 0..10
    s = metrics.error_summary(predicted, measured)
    assert s.median_abs_pct_error == pytest.approx(5.0)
    assert s.p90_abs_pct_error == pytest.approx(9.0)
    assert math.isnan(s.r2)  # constant measured


def test_percentage_error_rejects_bad_measured() -> None:
    with pytest.raises(ValueError, match="measured"):
        metrics.percentage_error([1.0], [0.0])
    with pytest.raises(ValueError, match="lengths differ"):
        metrics.percentage_error([1.0, 2.0], [1.0])


def test_cycle_summary_from_table() -> None:
    df = pd.DataFrame(
        {
            "num_accepted": [0, 2, 3],
            "num_committed": [1, 3, 4],
            "num_draft_levels": [3, 3, 3],
            "cycle_s": [0.5, 1.0, 1.5],
            "cache_hits": [1, 2, 3],
            "cache_misses": [1, 1, 0],
        }
    )
    s = metrics.cycle_summary(df)
    assert s["tau"] == pytest.approx(8 / 3)
    assert s["tokens_per_s"] == pytest.approx(8 / 3.0)
    assert s["hit_rate"] == pytest.approx(6 / 8)
    with pytest.raises(ValueError, match="cycle_s"):
        metrics.cycle_summary(df.drop(columns=["cycle_s"]))


def test_calibration_term_error_uses_the_same_definitions() -> None:
    # calibration cannot import analysis (import direction), so it summarises errors itself;
    # both must agree with the definitions stated in docs/metrics.md.
    from calibration.costfit import TermError

    rng = np.random.default_rng(0)
    measured = rng.uniform(0.5, 2.0, 101)
    predicted = measured * (1 + rng.normal(0, 0.05, 101))
    a = metrics.error_summary(predicted, measured)
    b = TermError.of(predicted, measured)
    assert b.num_samples == a.num_samples
    assert b.median_abs_pct_error == pytest.approx(a.median_abs_pct_error)
    assert b.p90_abs_pct_error == pytest.approx(a.p90_abs_pct_error)
    assert b.r2 == pytest.approx(a.r2)
