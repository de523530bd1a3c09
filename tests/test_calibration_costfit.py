"""Cost-model fitting recovers known parameters from noisy synthetic cycles (calibration.costfit)."""

import dataclasses

import numpy as np
import pandas as pd
import pytest

from calibration.checks import CalibrationDataError
from calibration.costfit import FitOptions, fit_cost_model, split_cycles, worst_term
from calibration.link import fit_link
from calibration.lsq import fit_non_negative
from calibration.synthetic import synthetic_size_sweep, synthetic_tables
from specfit.cost import CycleCostModel

TRUTH = CycleCostModel(
    draft_s_per_level=1.5e-3,
    draft_base_s=0.8e-3,
    verify_base_s=12e-3,
    verify_s_per_node=0.25e-3,
    verify_s_per_context_token=4e-6,
    h2d_bytes_per_s=8e9,
    h2d_s_per_transfer=30e-6,
    expert_bytes=4_000_000,
    num_layers=6,
)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    return synthetic_tables(TRUTH, num_cycles=400, noise_rel=0.01, seed=3)


def test_nnls_exact_on_noiseless_data() -> None:
    rng = np.random.default_rng(0)
    a = np.column_stack([np.ones(50), rng.uniform(1, 60, 50)])
    y = a @ np.array([0.01, 2e-4])
    fit = fit_non_negative(a, y, ("base", "slope"))
    np.testing.assert_allclose(fit.coef, [0.01, 2e-4], rtol=1e-6)
    # a negative true slope is clipped to 0, never returned negative
    fit = fit_non_negative(a, 0.05 - 1e-5 * a[:, 1], ("base", "slope"))
    assert fit.coef.min() >= 0.0


def test_plain_residuals_take_non_positive_targets_relative_ones_refuse_them() -> None:
    """A target less the price of other terms may be <= 0: plain residuals fit it (the result is
    BVLS on the unit-max-norm columns, what ``fit_overlap_terms`` solved before calling this),
    relative residuals name the problem."""
    from scipy.optimize import lsq_linear

    rng = np.random.default_rng(3)
    a = np.column_stack([rng.integers(1, 30, 40), rng.integers(1, 6, 40)]).astype(np.float64)
    y = a @ np.array([2e-5, 3e-4]) - 1.5e-3 + rng.normal(0.0, 1e-4, 40)
    assert (y < 0).any() and (y > 0).any()
    scale = a.max(axis=0)
    direct = lsq_linear(a / scale, y, bounds=(0.0, np.inf), method="bvls").x / scale
    fit = fit_non_negative(a, y, ("per_miss", "per_layer"))
    np.testing.assert_allclose(fit.coef, np.maximum(direct, 0.0), rtol=1e-9, atol=1e-15)
    assert fit_non_negative(a, np.zeros(40), ("per_miss", "per_layer")).coef.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="must be > 0 for relative residuals"):
        fit_non_negative(a, y, ("per_miss", "per_layer"), relative=True)


@pytest.mark.parametrize("weighting", ["relative", "absolute"])
def test_fit_recovers_known_parameters_within_2_percent(tables, weighting) -> None:
    cycles, transfers = tables
    result = fit_cost_model(
        cycles,
        transfers,
        expert_bytes=TRUTH.expert_bytes,
        num_layers=TRUTH.num_layers,
        options=FitOptions(seed=1, known_s_per_transfer=TRUTH.h2d_s_per_transfer, weighting=weighting),
    )
    m = result.model
    for name in (
        "draft_s_per_level",
        "draft_base_s",
        "verify_base_s",
        "verify_s_per_node",
        "verify_s_per_context_token",
        "h2d_bytes_per_s",
    ):
        assert _rel(getattr(m, name), getattr(TRUTH, name)) < 0.02, name
    assert m.h2d_s_per_transfer == TRUTH.h2d_s_per_transfer
    assert _rel(m.s_per_miss, TRUTH.s_per_miss) < 0.02
    assert not result.h2d_identifiable  # one expert per copy: latency vs bandwidth not separable
    assert result.num_cycles_heldout == 100 and result.num_cycles_fit == 300
    cyc = result.errors["cycle"]["heldout"]
    assert cyc.num_samples == 100
    assert cyc.median_abs_pct_error < 2.0 and cyc.p90_abs_pct_error < 5.0
    assert cyc.r2 > 0.98


def test_without_known_latency_effective_bandwidth_predicts_the_same(tables) -> None:
    cycles, transfers = tables
    result = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)
    assert result.model.h2d_s_per_transfer == 0.0
    assert _rel(result.model.s_per_miss, TRUTH.s_per_miss) < 0.02
    assert any("effective bandwidth" in n for n in result.notes)


def test_fit_from_per_layer_data_when_no_transfers(tables) -> None:
    cycles, _ = tables
    result = fit_cost_model(cycles, None, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)
    assert _rel(result.model.s_per_miss, TRUTH.s_per_miss) < 0.02
    assert result.errors["h2d_transfer"]["fit"].num_samples == 0


def test_link_fit_separates_bandwidth_and_latency_on_size_sweep() -> None:
    sweep = synthetic_size_sweep(12e9, 15e-6, noise_rel=0.01, seed=2)
    b = sweep["bytes"].to_numpy()
    link = fit_link(b, np.ones_like(b), sweep["h2d_s"].to_numpy())
    assert link.identifiable
    assert _rel(link.bytes_per_s, 12e9) < 0.02
    assert _rel(link.s_per_transfer, 15e-6) < 0.02


def test_robust_fit_resists_outliers(tables) -> None:
    cycles, transfers = tables
    bad = cycles.copy()
    idx = bad.index[::10]
    bad.loc[idx, "cycle_s"] += 4.0 * bad.loc[idx, "verify_s"]  # 10% of cycles hit by a stall
    bad.loc[idx, "verify_s"] *= 5.0
    plain = fit_cost_model(bad, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)
    robust = fit_cost_model(
        bad,
        transfers,
        expert_bytes=TRUTH.expert_bytes,
        num_layers=TRUTH.num_layers,
        options=FitOptions(robust=True),
    )
    err_plain = _rel(plain.model.verify_s(24, 500), TRUTH.verify_s(24, 500))
    err_robust = _rel(robust.model.verify_s(24, 500), TRUTH.verify_s(24, 500))
    assert err_robust < 0.005
    assert err_plain > 3 * err_robust


def test_split_is_deterministic_by_seed() -> None:
    labels = [f"cycle{i // 2}" for i in range(40)]  # every cycle recorded twice (two repeats)
    grouped = split_cycles(40, 0.25, 7, labels)
    assert grouped.sum() == 2 * round(0.25 * 20)
    assert np.array_equal(grouped[0::2], grouped[1::2])  # both copies on the same side
    assert np.array_equal(split_cycles(40, 0.25, 7, [str(i) for i in range(40)]), split_cycles(40, 0.25, 7))
    a, b, c = split_cycles(40, 0.25, 7), split_cycles(40, 0.25, 7), split_cycles(40, 0.25, 8)
    assert a.sum() == 10
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_errors_name_run_and_field(tables) -> None:
    cycles, transfers = tables
    cycles = cycles.assign(run="runs/r1")
    bad = cycles.copy()
    bad.loc[5, "verify_s"] = np.nan
    with pytest.raises(CalibrationDataError, match=r"run runs/r1, request 5, cycle 0: field 'verify_s'"):
        fit_cost_model(bad, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)
    bad = cycles.copy()
    bad.loc[2, "draft_s"] = -1.0
    with pytest.raises(CalibrationDataError, match="'draft_s'"):
        fit_cost_model(bad, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)
    with pytest.raises(CalibrationDataError, match=r"lacks column\(s\) \['h2d_s'\]"):
        fit_cost_model(
            cycles.drop(columns=["h2d_s"]),
            transfers,
            expert_bytes=TRUTH.expert_bytes,
            num_layers=TRUTH.num_layers,
        )
    with pytest.raises(CalibrationDataError, match=r"runs/r1: 5 cycles.*--min-cycles"):
        fit_cost_model(
            cycles.head(5), transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers
        )
    with pytest.raises(CalibrationDataError, match="expected 7"):
        fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=7)
    bad_t = transfers.assign(run="runs/r1")
    bad_t.loc[0, "h2d_s"] = np.inf
    with pytest.raises(CalibrationDataError, match=r"runs/r1: transfers row 0: field 'h2d_s'"):
        fit_cost_model(cycles, bad_t, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)


def test_worst_term_names_the_off_term(tables) -> None:
    cycles, transfers = tables
    result = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)
    from calibration.costfit import evaluate

    skewed = cycles.copy()
    skewed["draft_s"] *= 1.3
    assert worst_term(evaluate(result.model, skewed, transfers)) == "draft"


def test_residual_verify_absorbs_bookkeeping_and_excludes_decision(tables) -> None:
    cycles, transfers = tables
    c = cycles.copy()
    c["decision_s"] = 0.5e-3
    c["cycle_s"] = c["cycle_s"] + 1e-3 + c["decision_s"]  # 1 ms bookkeeping + planner time
    kw = dict(expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)
    res = fit_cost_model(c, transfers, **kw)
    assert res.model.verify_base_s == pytest.approx(TRUTH.verify_base_s + 1e-3, rel=0.03)
    assert res.errors["cycle"]["heldout"].median_abs_pct_error < 2.0
    assert res.bookkeeping_share > 0.01
    raw = fit_cost_model(c, transfers, **kw, options=FitOptions(verify_target="verify_s"))
    assert raw.model.verify_base_s == pytest.approx(TRUTH.verify_base_s, rel=0.03)
    # without the bookkeeping term whole cycles are under-predicted
    assert (
        raw.errors["cycle"]["heldout"].median_abs_pct_error
        > res.errors["cycle"]["heldout"].median_abs_pct_error
    )
    with pytest.raises(ValueError, match="verify_target"):
        FitOptions(verify_target="nope")


def test_host_placing_time_and_compute_per_miss_join_the_per_transfer_cost(tables) -> None:
    """Cycles whose h2d_s carries 6 us of host placing per transfer beyond the timed copies, and
    whose compute carries 40 us per miss: the fit splits link latency, host time and per-miss
    compute, puts all three in h2d_s_per_transfer, and predicts whole cycles as before."""
    from calibration.costfit import host_s_per_transfer, model_cycle_s, predict_terms

    cycles, transfers = tables
    misses = np.stack(cycles["layer_misses"]).sum(axis=1).astype(np.float64)
    cycles = cycles.assign(
        h2d_s=cycles["h2d_s"] + 6e-6 * misses,
        cycle_s=cycles["cycle_s"] + 46e-6 * misses,
    )
    assert host_s_per_transfer(cycles, transfers, 1) == pytest.approx(6e-6, rel=0.02)
    opts = FitOptions(miss_compute=True)
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6, options=opts)
    assert fit.h2d_host_s_per_transfer == pytest.approx(6e-6, rel=0.02)
    assert fit.compute_s_per_miss == pytest.approx(40e-6, rel=0.1)
    total = fit.h2d_link_s_per_transfer + fit.h2d_host_s_per_transfer + fit.compute_s_per_miss
    assert fit.model.h2d_s_per_transfer == pytest.approx(total, rel=1e-12)
    errors = np.abs(predict_terms(fit.model, cycles)["cycle"] / model_cycle_s(cycles) - 1)
    assert np.median(errors) < 0.02
    plain = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    assert plain.compute_s_per_miss == 0.0
    # each term is scored against what it measures: per-copy link time, cycle h2d_s (link + host),
    # and the verify residual (which carries the per-miss compute)
    for term in ("h2d_transfer", "h2d_cycle", "verify"):
        assert fit.errors[term]["heldout"].median_abs_pct_error < 3.0, term
    from calibration.costfit import evaluate

    lumped = evaluate(fit.model, cycles, transfers)  # every per-miss second counted as link time
    assert lumped["h2d_transfer"].median_abs_pct_error > 5.0
    assert lumped["h2d_cycle"].median_abs_pct_error > 5.0


def test_draft_base_is_left_at_zero_when_one_depth_only() -> None:
    """Drafting cycles of one depth cannot separate the base from the per-level cost: base 0,
    the per-level cost carries it (exact at that depth), and a note says so."""
    cycles, transfers = synthetic_tables(TRUTH, num_cycles=200, noise_rel=0.0, seed=5, max_levels=1)
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)
    assert fit.model.draft_base_s == 0.0
    assert fit.model.draft_s_per_level == pytest.approx(TRUTH.draft_s(1), rel=1e-6)
    assert any("draft_base_s is not identifiable" in n for n in fit.notes)


def test_one_tree_size_cannot_separate_verify_base_and_per_node() -> None:
    cycles, transfers = synthetic_tables(TRUTH, num_cycles=80, noise_rel=0.0, seed=2)
    cycles = cycles.assign(num_nodes_verified=32)
    with pytest.raises(CalibrationDataError, match="every cycle verified 32 node.*num_nodes_verified"):
        fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers)


def _overlap_on_cycles(fit, seed: int, placing_s: float, per_miss_s: float, late_s: float, max_misses_per_layer=4, after_s=0.0):
    """Synthetic overlap-on cycles priced by the serial fit's model in mode "on" with ``per_miss_s``
    on the compute stream per miss and ``late_s`` per layer with misses, ``placing_s`` per miss
    recorded in ``h2d_s`` beyond the copies: ``(cycles, transfers, the true model, misses [C, L])``."""
    import dataclasses

    from calibration.costfit import model_cycle_s

    on_cycles, on_transfers = synthetic_tables(
        TRUTH, num_cycles=200, noise_rel=0.0, seed=seed, max_misses_per_layer=max_misses_per_layer
    )
    link_latency_s = fit.model.h2d_s_per_transfer - fit.model.host_s_per_transfer
    truth_on = dataclasses.replace(
        fit.model, overlap_h2d=True, overlap_mode="on", h2d_s_per_transfer=link_latency_s + per_miss_s,
        host_s_per_transfer=per_miss_s, late_call_s=late_s, placing_after_enqueue_s_per_transfer=after_s,
    )  # fmt: skip
    misses = np.stack(on_cycles["layer_misses"])
    priced = [
        truth_on.cycle_s(int(lev), int(n), int(ctx), m)
        for lev, n, ctx, m in zip(
            on_cycles["num_draft_levels"], on_cycles["num_nodes_verified"], on_cycles["context_len"], misses
        )
    ]
    decision_s = on_cycles["cycle_s"].to_numpy() - model_cycle_s(on_cycles)
    on_cycles = on_cycles.assign(h2d_s=on_cycles["h2d_s"] + placing_s * misses.sum(axis=1), cycle_s=priced + decision_s)
    return on_cycles, on_transfers, truth_on, misses


def _with_memcpy_ends(transfers: pd.DataFrame, rng, after_s: float, noise_rel: float) -> pd.DataFrame:
    """``transfers`` (one row per copy) with each (request, cycle, layer) batch enqueued at a random
    instant and its memcpys ending back to back, ``after_s / copies`` each (times ``1 + noise``)."""
    from calibration.costfit import copies_per_transfer

    copies = copies_per_transfer(transfers)
    frame = transfers.reset_index(drop=True)
    batch = frame.groupby(["request_id", "cycle_index", "layer"], sort=False).ngroup().to_numpy()
    enqueued = rng.uniform(0.0, 0.05, batch.max() + 1)[batch]
    each = after_s / copies * (1.0 + noise_rel * rng.standard_normal(len(frame)))
    placed = enqueued + pd.Series(each).groupby(batch).cumsum().to_numpy()
    return frame.assign(enqueued_at_s=enqueued, placed_at_s=placed)


def test_placing_after_the_enqueue_is_fitted_from_memcpy_ends_of_known_truth() -> None:
    """Synthetic copy-stream batches (1-8 experts of 2 copies each) whose memcpys take 40 us per
    expert with 10 % noise per copy, 5 % of the batches descheduled mid-memcpy for 2-20 ms (as
    seen live under load): the fit recovers 40 us within 2 % (least squares through the origin,
    the first form, gave several times that); batches without memcpy ends (synchronous copies,
    older traces: null) are left out, and a table without any gives 0 (the placing before the
    enqueue, the model before)."""
    from calibration.costfit import fit_placing_after_enqueue

    rng = np.random.default_rng(11)
    rows = []
    for cycle in range(300):
        for layer in range(3):
            for expert in range(int(rng.integers(1, 9))):
                rows += [(0, cycle, layer, expert, 1000), (0, cycle, layer, expert, 2000)]
    transfers = pd.DataFrame(rows, columns=["request_id", "cycle_index", "layer", "expert", "bytes"])
    transfers = _with_memcpy_ends(transfers, rng, 40e-6, 0.1)
    batch = transfers.groupby(["cycle_index", "layer"], sort=False).ngroup().to_numpy()
    stalled = rng.random(batch.max() + 1) < 0.05  # descheduled: every later memcpy of the batch ends later
    first = ~pd.Series(batch).duplicated().to_numpy()
    stall_s = np.where(first & stalled[batch], rng.uniform(2e-3, 20e-3, len(batch)), 0.0)
    transfers["placed_at_s"] += pd.Series(stall_s).groupby(batch).cumsum().to_numpy()
    sync = transfers["cycle_index"] >= 250  # these batches: no copy stream, nothing measured
    transfers.loc[sync, "placed_at_s"] = np.nan
    fit = fit_placing_after_enqueue(transfers)
    assert fit.s_per_transfer == pytest.approx(40e-6, rel=0.02)
    assert fit.num_batches == 250 * 3 and fit.num_transfers == int((~sync).sum()) // 2
    kept = transfers[~sync]
    y = kept.groupby(["cycle_index", "layer"])["placed_at_s"].max() - kept.groupby(["cycle_index", "layer"])["enqueued_at_s"].first()
    n = kept.groupby(["cycle_index", "layer"]).size() / 2
    assert float(n @ y / (n @ n)) > 3 * 40e-6  # what least squares through the origin would say
    for without in (transfers.drop(columns=["placed_at_s"]), transfers.assign(placed_at_s=np.nan), transfers.iloc[0:0]):
        assert fit_placing_after_enqueue(without).s_per_transfer == 0.0 and fit_placing_after_enqueue(without).num_batches == 0


def test_placing_after_the_enqueue_is_0_when_every_batch_key_is_null() -> None:
    """rev3: rows with memcpy ends but null batch keys (``request_id``) form no batch; the fit was
    ``nan`` (the median of nothing, ``max(nan, 0.0)``), it is 0 with no batches, as without the column."""
    frame = pd.DataFrame(
        {
            "request_id": [None, None], "cycle_index": [0, 0], "layer": [0, 0], "expert": [1, 2],
            "enqueued_at_s": [1.0, 1.0], "placed_at_s": [1.00003, 1.00006],
        }
    )  # fmt: skip
    from calibration.costfit import fit_placing_after_enqueue

    fitted = fit_placing_after_enqueue(frame)
    assert fitted.s_per_transfer == 0.0 and fitted.num_batches == 0


def test_overlap_fit_prices_the_placing_after_the_enqueue_it_measured(tables) -> None:
    """Overlap-on cycles priced by a known "on" model whose 60 us per-miss placing has 40 us after
    the enqueue (the link copies meanwhile), their transfers carrying those memcpy ends: the fit
    reads the 40 us off the memcpy ends, keeps the per-miss term and the late call, prices the
    cycles exactly (the model without the term, as fitted before, misprices them) and reports it."""
    from calibration.costfit import fit_overlap_terms

    cycles, transfers = tables
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    assert fit.model.placing_after_enqueue_s_per_transfer == 0.0  # serial runs: no memcpy ends
    on_cycles, on_transfers, truth_on, _ = _overlap_on_cycles(fit, 5, 60e-6, 60e-6, 250e-6, after_s=40e-6)
    assert truth_on.overlapped_link_s_per_transfer < truth_on.link_s_per_transfer  # copy-bound layers gain
    on_transfers = _with_memcpy_ends(on_transfers, np.random.default_rng(3), 40e-6, 0.0)
    overlap = fit_overlap_terms(fit, on_cycles, on_transfers)
    m = overlap.model
    assert m.placing_after_enqueue_s_per_transfer == pytest.approx(40e-6, rel=1e-9)
    assert m.host_s_per_transfer == pytest.approx(60e-6, rel=1e-6)
    assert overlap.late_call_s == pytest.approx(250e-6, rel=1e-6)
    assert overlap.cycle_error.median_abs_pct_error < 1e-6
    report = overlap.report_fields()
    assert report["placing_after_enqueue_s_per_transfer"] == m.placing_after_enqueue_s_per_transfer
    assert report["placing_after_enqueue_batches"] > 0
    assert report["placing_after_enqueue_measured_s_per_transfer"] == overlap.placing_after_enqueue.s_per_transfer
    # a measured value above the per-miss term is clipped in the model and still reported as measured
    above = dataclasses.replace(
        overlap, placing_after_enqueue=dataclasses.replace(overlap.placing_after_enqueue, s_per_transfer=90e-6)
    )
    clipped = above.report_fields()
    assert clipped["placing_after_enqueue_measured_s_per_transfer"] == 90e-6
    assert clipped["placing_after_enqueue_s_per_transfer"] == m.placing_after_enqueue_s_per_transfer < 90e-6
    assert any("placing after the enqueue 40 us" in n for n in overlap.notes)
    before = fit_overlap_terms(fit, on_cycles, on_transfers.drop(columns=["placed_at_s"]))
    assert before.model.placing_after_enqueue_s_per_transfer == 0.0
    assert before.cycle_error.p90_abs_pct_error > 100 * overlap.cycle_error.p90_abs_pct_error


def test_overlap_fit_clips_a_measured_placing_above_the_per_miss_term_before_the_step(tables) -> None:
    """rev3: memcpy ends 5 ms after the enqueue (clocks out of step) against a 60 us per-miss term
    and a 250 us late call. The step test read the unclipped 5 ms, so it zeroed the late call and
    fitted nothing, while the model kept a placing clipped below a copy's link time (a late call
    priced at 0). The placing is now capped at the measured placing + memcpy plus the serial
    per-miss compute before the step is tested, with a note: the late call is fitted."""
    from calibration.costfit import fit_overlap_terms

    cycles, transfers = tables
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    on_cycles, on_transfers, truth_on, _ = _overlap_on_cycles(fit, 5, 60e-6, 60e-6, 250e-6)
    on_transfers = _with_memcpy_ends(on_transfers, np.random.default_rng(5), 5e-3, 0.0)
    overlap = fit_overlap_terms(fit, on_cycles, on_transfers)
    m = overlap.model
    assert overlap.placing_after_enqueue.s_per_transfer == pytest.approx(5e-3, rel=1e-9)  # measured, reported
    assert any("clipped to it" in n for n in overlap.notes)
    assert not any("covers each copy's link time" in n for n in overlap.notes)
    assert m.placing_after_enqueue_s_per_transfer <= m.host_s_per_transfer
    assert m.placing_after_enqueue_s_per_transfer < m.link_s_per_transfer and overlap.late_call_s > 0.0


def test_serial_fit_clips_a_placing_above_its_per_miss_term_with_the_overlap_fits_note(tables) -> None:
    """``fit_cost_model`` capped the placing after the enqueue at its per-miss term silently; it
    now goes through the overlap fit's helper: the same cap, and a note of the same form."""
    from calibration.costfit import fit_overlap_terms

    cycles, transfers = tables
    misses = np.stack(cycles["layer_misses"]).sum(axis=1).astype(np.float64)
    cycles = cycles.assign(h2d_s=cycles["h2d_s"] + 6e-6 * misses)  # 6 us host placing per transfer
    late = _with_memcpy_ends(transfers, np.random.default_rng(5), 5e-3, 0.0)  # 5 ms: clocks out of step
    fit = fit_cost_model(cycles, late, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    assert fit.model.placing_after_enqueue_s_per_transfer == fit.model.host_s_per_transfer > 0.0
    (serial,) = [n for n in fit.notes if "clipped to it" in n]
    on_cycles, on_transfers, _, _ = _overlap_on_cycles(fit, 5, 60e-6, 60e-6, 250e-6)
    on_transfers = _with_memcpy_ends(on_transfers, np.random.default_rng(5), 5e-3, 0.0)
    overlap = [n for n in fit_overlap_terms(fit, on_cycles, on_transfers).notes if "clipped to it" in n][0]
    same = "placing after the enqueue: 5e+03 us per transfer exceeds the per-miss term it is part of"
    assert serial.startswith(same) and overlap.startswith(f"overlap on: {same}")
    unclipped = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    assert not any("placing after the enqueue" in n for n in unclipped.notes)


def test_memcpy_ends_before_their_enqueue_are_counted_and_the_fit_called_not_meaningful(tables) -> None:
    """rev3: batches whose memcpys end before their enqueue (the two clocks out of step) were
    clipped to P = 0 with the R^2 of a zero prediction and no note. The fit's notes now name how
    many batches and, when the median is negative, say the fit is not meaningful; a few such
    batches are named but kept in the median; the overlap fit's notes carry them."""
    from calibration.costfit import fit_overlap_terms, fit_placing_after_enqueue

    cycles, transfers = tables
    ends = _with_memcpy_ends(transfers, np.random.default_rng(7), 40e-6, 0.0)
    batch = ends.groupby(["request_id", "cycle_index", "layer"], sort=False).ngroup().to_numpy()
    num_batches = int(batch.max()) + 1
    for shifted, meaningful in ((np.arange(num_batches) % 3 != 0, False), (np.arange(num_batches) < 5, True)):
        out_of_step = ends.assign(placed_at_s=ends["placed_at_s"] - 1.0 * shifted[batch])  # 1 s early
        fitted = fit_placing_after_enqueue(out_of_step)
        (note,) = fitted.notes
        assert f"{int(shifted.sum())} of {num_batches} copy-stream batches end their memcpys before" in note
        assert ("not meaningful" in note) is not meaningful
        assert fitted.s_per_transfer == (pytest.approx(40e-6, rel=1e-6) if meaningful else 0.0)
    assert fit_placing_after_enqueue(ends).notes == ()
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    on_cycles, on_transfers, _, _ = _overlap_on_cycles(fit, 5, 60e-6, 60e-6, 250e-6)
    on_transfers = _with_memcpy_ends(on_transfers, np.random.default_rng(5), 40e-6, 0.0)
    on_transfers["placed_at_s"] -= 1.0
    overlap = fit_overlap_terms(fit, on_cycles, on_transfers)
    assert overlap.model.placing_after_enqueue_s_per_transfer == 0.0
    assert any(n.startswith("overlap on: placing after the enqueue: ") and "not meaningful" in n for n in overlap.notes)


def test_overlap_fit_prices_no_late_call_when_the_placing_covers_each_copy(tables) -> None:
    """The step at ``P = T_link``: a placing after the enqueue (560 us) longer than a copy's link
    time (530 us) lands every copy by the end of its placing, so no late call is priced and the
    late-call column has nothing to fit: the per-miss term is the measured placing (h2d_s beyond the
    copies, 600 us) plus the serial runs' per-miss compute, the late call 0, a note says why, and
    the cycles (priced by such a model) are priced exactly."""
    from calibration.costfit import fit_overlap_terms

    cycles, transfers = tables
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    per_miss_s = 600e-6 + fit.compute_s_per_miss
    on_cycles, on_transfers, truth_on, _ = _overlap_on_cycles(fit, 5, 600e-6, per_miss_s, 250e-6, after_s=560e-6)
    assert truth_on.link_s_per_transfer < 560e-6 and truth_on.priced_late_call_s == 0.0
    on_transfers = _with_memcpy_ends(on_transfers, np.random.default_rng(4), 560e-6, 0.0)
    overlap = fit_overlap_terms(fit, on_cycles, on_transfers)
    assert overlap.model.placing_after_enqueue_s_per_transfer == pytest.approx(560e-6, rel=1e-9)
    assert overlap.model.host_s_per_transfer == pytest.approx(per_miss_s, rel=1e-6)
    assert overlap.late_call_s == 0.0 and not overlap.separable
    assert any("covers each copy's link time" in n for n in overlap.notes)
    assert overlap.cycle_error.median_abs_pct_error < 1e-6


def test_overlap_terms_are_fitted_from_overlap_on_cycles(tables) -> None:
    """Overlap-on cycles priced by a known "on" model (15 us of placing per miss on the compute
    stream, a 250 us late-expert call per layer with misses): the serial fit's link, verify and
    draft terms are kept, the placing is read off h2d_s beyond the copies and the late call is
    recovered, and the fitted model predicts those cycles."""
    from calibration.costfit import fit_overlap_terms

    cycles, transfers = tables
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    assert fit.model.host_s_per_transfer == pytest.approx(fit.h2d_host_s_per_transfer, abs=1e-12)
    host_s, late_s = 15e-6, 250e-6
    on_cycles, on_transfers, truth_on, _ = _overlap_on_cycles(fit, 5, host_s, host_s, late_s)
    overlap = fit_overlap_terms(fit, on_cycles, on_transfers)
    assert overlap.placing_s_per_transfer == pytest.approx(host_s, rel=1e-6)
    assert overlap.late_call_s == pytest.approx(late_s, rel=1e-6)
    m = overlap.model
    assert (m.overlap_h2d, m.overlap_mode) == (True, "on")
    assert m.link_s_per_transfer == pytest.approx(truth_on.link_s_per_transfer, rel=1e-9)
    assert (m.verify_base_s, m.draft_s_per_level) == (fit.model.verify_base_s, fit.model.draft_s_per_level)
    assert overlap.cycle_error.median_abs_pct_error < 1e-6
    with pytest.raises(CalibrationDataError, match="no cycles"):
        fit_overlap_terms(fit, on_cycles.iloc[0:0], None)


def test_overlap_terms_price_what_overlap_costs_per_miss_not_the_placing_alone(tables) -> None:
    """Overlap-on cycles whose compute stream pays 60 us per miss (15 us of it the placing that
    h2d_s records, the rest per-miss work the serial runs do not show) and a 250 us late call per
    layer with misses: the joint fit recovers both from whole cycles (before: the placing plus the
    serial per-miss compute, and a median late call that absorbed the difference per layer, so
    cycles with many misses per layer were priced short); the measured placing is still reported."""
    from calibration.costfit import fit_overlap_terms

    cycles, transfers = tables
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    placing_s, per_miss_s, late_s = 15e-6, 60e-6, 250e-6
    on_cycles, on_transfers, truth_on, misses = _overlap_on_cycles(fit, 7, placing_s, per_miss_s, late_s)
    assert len({int(n) for n in misses.sum(axis=1)}) > 3 and len({int(k) for k in np.count_nonzero(misses, axis=1)}) > 1
    overlap = fit_overlap_terms(fit, on_cycles, on_transfers)
    assert overlap.placing_s_per_transfer == pytest.approx(placing_s, rel=1e-6)  # measured, reported
    assert overlap.model.host_s_per_transfer == pytest.approx(per_miss_s, rel=1e-6)
    assert overlap.late_call_s == overlap.model.late_call_s == pytest.approx(late_s, rel=1e-6)
    assert overlap.model.link_s_per_transfer == pytest.approx(truth_on.link_s_per_transfer, rel=1e-9)
    assert overlap.cycle_error.median_abs_pct_error < 1e-6
    assert any("60 us per miss (fitted" in n for n in overlap.notes)
    split = overlap.term_split()  # analysis.fidelity.error_split's per-miss compute: fitted - placing
    assert split == pytest.approx({"compute_s_per_miss": 45e-6, "host_s_per_transfer": 15e-6}, rel=1e-6)


@pytest.mark.parametrize("placing_s", [60e-6, 15e-6])
def test_overlap_terms_are_not_split_when_no_layer_misses_twice(tables, placing_s) -> None:
    """Review M1: every layer misses at most one expert, so each cycle's misses equal its layers
    with misses and the data fix only their sum per layer (60 us per miss + a 250 us late call
    here). The joint fit split it arbitrarily (310 / 0 us here, 155 / 155 on the review's data:
    exact on these cycles, a 4-miss layer priced 1240 or 775 us instead of 490); now the per-miss term is the measured placing plus the serial
    runs' per-miss compute, only late_call_s is fitted, and a note says why. When the placing is
    the whole per-miss cost (60 us) that recovers the truth; when it is not (15 us) the cycles'
    per-layer sum is still kept and the note warns of layers with more misses."""
    from calibration.costfit import fit_overlap_terms

    cycles, transfers = tables
    fit = fit_cost_model(cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=6)
    per_miss_s, late_s = 60e-6, 250e-6
    on_cycles, on_transfers, truth_on, misses = _overlap_on_cycles(
        fit, 7, placing_s, per_miss_s, late_s, max_misses_per_layer=1
    )
    assert misses.max() == 1 and np.count_nonzero(misses.sum(axis=1)) >= 3
    overlap = fit_overlap_terms(fit, on_cycles, on_transfers)
    assert not overlap.separable
    expected = placing_s + fit.compute_s_per_miss
    assert overlap.model.host_s_per_transfer == pytest.approx(expected, rel=1e-6)
    assert overlap.late_call_s == pytest.approx(per_miss_s + late_s - expected, rel=1e-6)
    assert overlap.cycle_error.median_abs_pct_error < 1e-6  # the per-layer sum is all the data shows
    assert any("not separable" in n and "condition number inf" in n for n in overlap.notes)
    assert any("per miss (not fitted" in n for n in overlap.notes)
    four = np.array([4, 0, 0, 0, 0, 0])
    if placing_s == per_miss_s:
        assert overlap.model.cycle_s(3, 20, 500, four) == pytest.approx(truth_on.cycle_s(3, 20, 500, four), rel=1e-6)


def test_pre_router_fraction_is_fitted_from_the_recorded_split() -> None:
    """Cycles recording ``layer_pre_router_s`` (the live engine's attention + router time per
    layer) give ``pre_router_fraction``, the share of a layer's compute its copies cannot overlap;
    cycles recorded before the column (null, or no column) leave it at 0 with a note."""
    import dataclasses

    from calibration.costfit import fit_overlap_terms, fit_pre_router_fraction

    truth = dataclasses.replace(TRUTH, pre_router_fraction=0.35)
    cycles, transfers = synthetic_tables(truth, num_cycles=200, noise_rel=0.0, seed=4)
    fit = fit_cost_model(cycles, transfers, expert_bytes=truth.expert_bytes, num_layers=truth.num_layers)
    assert fit.model.pre_router_fraction == pytest.approx(0.35, rel=1e-9)
    assert fit_overlap_terms(fit, cycles, transfers).model.pre_router_fraction == fit.model.pre_router_fraction
    notes: list[str] = []
    assert fit_pre_router_fraction(cycles.drop(columns=["layer_pre_router_s"]), notes) == 0.0
    assert notes and "pre_router_fraction set to 0" in notes[0]
    old = cycles.assign(layer_pre_router_s=[None] * len(cycles))
    assert fit_pre_router_fraction(old) == 0.0
    half = cycles.assign(layer_pre_router_s=[None if k % 2 else v for k, v in enumerate(cycles["layer_pre_router_s"])])
    assert fit_pre_router_fraction(half) == pytest.approx(0.35, rel=1e-9)


def test_next_layer_terms_are_recovered_from_a_synthetic_runs_prefetch_counts() -> None:
    """Issue 13: cycles drawn with a known next-layer share (each would-be miss prefetched and
    used with probability 0.35, 0.2 wrong copies per miss) give it back from their counts."""
    from calibration.costfit import fit_next_layer_terms

    truth = dataclasses.replace(TRUTH, next_layer_cover_fraction=0.35, next_layer_waste_per_miss=0.2)
    cycles, _ = synthetic_tables(truth, num_cycles=400, noise_rel=0.01, seed=3)
    fit = fit_next_layer_terms(cycles)
    used, wasted, misses = (int(cycles[c].sum()) for c in ("num_prefetch_used", "num_prefetch_wasted", "cache_misses"))
    misses -= int(sum(int(m[0]) for m in cycles["layer_misses"]))  # layer 0: no guess, left out
    assert fit.cover_fraction == used / (used + misses) and fit.waste_per_miss == wasted / (used + misses)
    assert fit.num_cycles == 400 and used + misses > 2000
    assert fit.cover_fraction == pytest.approx(0.35, abs=0.03) and fit.waste_per_miss == pytest.approx(0.2, abs=0.03)
    assert "0.35" in fit.notes[0] or "covered" in fit.notes[0]
    # without counts (a run recorded without prefetch) or without misses: 0, said in a note
    plain, _ = synthetic_tables(TRUTH, num_cycles=20, noise_rel=0.01, seed=3)
    none = fit_next_layer_terms(plain)
    assert (none.cover_fraction, none.waste_per_miss, none.num_cycles) == (0.0, 0.0, 0) and "no cycle recorded" in none.notes[0]
    bad = cycles.copy()
    bad.loc[0, "num_prefetch_used"] = -1
    with pytest.raises(CalibrationDataError, match="num_prefetch_used.*negative"):
        fit_next_layer_terms(bad)
    # without per-layer misses layer 0 cannot be left out: the all-layer share, said in a note (M12)
    flat = fit_next_layer_terms(cycles.drop(columns=["layer_misses"]))
    assert flat.cover_fraction == used / (used + int(cycles["cache_misses"].sum()))
    assert any("no layer_misses column" in n for n in flat.notes)
    assert not any("no layer_misses column" in n for n in fit.notes)


def test_link_price_is_the_mean_copy_time_on_bimodal_copies(tables) -> None:
    """Copies of one size that are fast (70 %) or 4x slower (30 %), as emulated memcpy-bound links
    record: the cost model sums copy times, so the fitted per-copy price must be their MEAN
    (a relative-error fit follows the fast mode and priced these copies ~30 % low)."""
    cycles, transfers = tables
    rng = np.random.default_rng(11)
    slow = rng.random(len(transfers)) < 0.3
    extra = np.where(slow, 3.0, 0.0) * transfers["h2d_s"].to_numpy()
    transfers = transfers.assign(h2d_s=transfers["h2d_s"] + extra)
    keys = ["request_id", "cycle_index"]
    added = transfers.assign(extra=extra).groupby(keys)["extra"].sum()
    cycles = cycles.join(added, on=keys).fillna({"extra": 0.0})
    cycles = cycles.assign(h2d_s=cycles["h2d_s"] + cycles["extra"], cycle_s=cycles["cycle_s"] + cycles["extra"])
    cycles = cycles.drop(columns="extra")
    for options in (FitOptions(), FitOptions(weighting="relative")):
        fit = fit_cost_model(
            cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers, options=options
        )
        b = transfers["bytes"].to_numpy(dtype=np.float64)
        priced = b / fit.model.h2d_bytes_per_s + fit.h2d_link_s_per_transfer
        measured = transfers["h2d_s"].to_numpy(dtype=np.float64)
        assert priced.mean() == pytest.approx(measured.mean(), rel=0.01), options.weighting
        assert fit.h2d_host_s_per_transfer == pytest.approx(0.0, abs=1e-7)


def test_robust_fit_keeps_the_link_priced_at_the_mean_copy_time(tables) -> None:
    """``calibration.fit --robust``: the soft-L1 loss alone follows the fast mode of bimodal copies
    (priced them at 0.66 of their time here); the link is then scaled to price the copies at their MEAN time,
    which the cost model sums, and the note says by how much."""
    cycles, transfers = tables
    rng = np.random.default_rng(11)
    slow = rng.random(len(transfers)) < 0.3
    transfers = transfers.assign(h2d_s=transfers["h2d_s"] * np.where(slow, 4.0, 1.0))
    fit = fit_cost_model(
        cycles, transfers, expert_bytes=TRUTH.expert_bytes, num_layers=TRUTH.num_layers,
        options=FitOptions(robust=True, holdout_fraction=0.0),  # every copy in the fit
    )
    b = transfers["bytes"].to_numpy(dtype=np.float64)
    priced = b / fit.model.h2d_bytes_per_s + fit.h2d_link_s_per_transfer
    assert priced.sum() == pytest.approx(transfers["h2d_s"].sum(), rel=1e-6)
    assert any("to price the copies at their mean time (robust loss)" in note for note in fit.notes)


@pytest.mark.parametrize("known", [None, 2e-6])
def test_fit_link_price_at_mean_with_copies_of_one_size(known) -> None:
    """Copies of one size (latency not identifiable; given or 0): the robust fit's bandwidth is
    scaled so the copies' summed price is their summed time; a given latency is kept."""
    from calibration.link import fit_link

    rng = np.random.default_rng(5)
    b = np.full(400, 65_536.0)
    s = (2e-6 + b / 4e9) * np.where(rng.random(400) < 0.3, 4.0, 1.0)
    link = fit_link(b, np.ones_like(b), s, robust=True, relative=False, known_s_per_transfer=known, price_at_mean=True)
    assert link.s_per_transfer == (known or 0.0)
    assert (b / link.bytes_per_s + link.s_per_transfer).sum() == pytest.approx(s.sum(), rel=1e-9)


def test_fit_link_price_at_mean_names_why_on_grouped_samples() -> None:
    """Per-layer cycle data groups unequal copy counts: plain absolute least squares (not robust,
    latency above 0) then need not price the mean (its residuals do not sum to 0); the scaling
    makes it, and the note names the grouping, not a bound."""
    from calibration.link import fit_link

    rng = np.random.default_rng(0)
    n = rng.integers(1, 9, 300).astype(np.float64)
    per_copy = rng.choice([49_152.0, 65_536.0, 98_304.0], 300)
    b = n * per_copy
    s = (b / 4e9 + n * 10e-6) * np.where(rng.random(300) < 0.3, 3.0, 1.0)  # bimodal copies
    plain = fit_link(b, n, s, relative=False)
    assert abs((b / plain.bytes_per_s + n * plain.s_per_transfer).sum() / s.sum() - 1) > 1e-3
    fit = fit_link(b, n, s, relative=False, price_at_mean=True)
    assert (b / fit.bytes_per_s + n * fit.s_per_transfer).sum() == pytest.approx(s.sum(), rel=1e-9)
    assert fit.s_per_transfer > 0 and "(copy counts that differ between samples)" in fit.note, fit.note


def test_term_error_r2_is_the_one_shared_form() -> None:
    """TermError's R^2 is calibration.lsq.r_squared (also analysis.metrics.r_squared's) on the rows
    with measured > 0: 1 - 1/2 here by hand; NaN for a constant measurement or one row."""
    from analysis.metrics import r_squared as checked_r_squared
    from calibration.costfit import TermError
    from calibration.lsq import r_squared

    pred, meas = np.array([1.0, 2.0, 4.0, 9.0]), np.array([1.0, 2.0, 3.0, 0.0])  # the 0 s row is left out
    assert TermError.of(pred, meas).r2 == pytest.approx(0.5) == r_squared(pred[:3], meas[:3])
    assert checked_r_squared(pred[:3], meas[:3]) == r_squared(pred[:3], meas[:3])
    assert np.isnan(TermError.of(pred[:2], np.array([2.0, 2.0])).r2) and np.isnan(r_squared(pred[:1], meas[:1]))


def test_r_squared_refuses_predictions_of_another_shape() -> None:
    """A length-1 prediction broadcast against three measurements (R^2 -1.5 before), and one
    value short, raise ValueError naming both shapes; equal shapes still give R^2."""
    from calibration.lsq import r_squared

    for predicted in ([1.0], [1.0, 2.0]):
        with pytest.raises(ValueError, match="shape"):
            r_squared(predicted, [1.0, 2.0, 3.0])
    assert r_squared([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 1.0
