"""Checks of the cycles and transfers tables a calibration reads (errors name run, row and field)."""

from __future__ import annotations

import numpy as np
import pandas as pd

CYCLE_COLUMNS = (
    "request_id",
    "cycle_index",
    "context_len",
    "num_draft_levels",
    "num_nodes_verified",
    "draft_s",
    "verify_s",
    "h2d_s",
    "cycle_s",
    "layer_misses",
    "layer_h2d_bytes",
    "layer_h2d_s",
)
CYCLE_TIME_COLUMNS = ("draft_s", "verify_s", "h2d_s", "cycle_s")
CYCLE_LAYER_TIME_COLUMNS = ("layer_h2d_s", "layer_compute_s")
TRANSFER_COLUMNS = ("request_id", "cycle_index", "bytes", "h2d_s")


class CalibrationDataError(ValueError):
    """Bad or insufficient calibration data; the message names the run and the field."""


def _where(df: pd.DataFrame, row: int) -> str:
    run = df["run"].iloc[row] if "run" in df.columns else "<table>"
    return f"run {run}, request {df['request_id'].iloc[row]}, cycle {df['cycle_index'].iloc[row]}"


def validate_cycles(cycles: pd.DataFrame, num_layers: int, label: str = "cycles") -> None:
    """Check the columns the fit uses; raise :class:`CalibrationDataError` naming run and field.

    Args:
        cycles: cycles table (CycleRecord columns; an optional ``run`` column names the run).
        num_layers: expected length ``L`` of the per-layer lists.
        label: prefix of messages (e.g. the run directory) when there is no ``run`` column.

    Raises:
        CalibrationDataError: missing column, NaN / inf / negative duration, per-layer list of the
            wrong length, negative counts.
    """
    missing = [c for c in CYCLE_COLUMNS if c not in cycles.columns]
    if missing:
        raise CalibrationDataError(f"{label}: cycles table lacks column(s) {missing}")
    for col in CYCLE_TIME_COLUMNS + ("num_draft_levels", "num_nodes_verified", "context_len"):
        values = cycles[col].to_numpy(dtype=np.float64)
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise CalibrationDataError(
                f"{label}: {_where(cycles, i)}: field {col!r} is {values[i]!r}; expected a finite value >= 0"
            )
    for col in ("layer_misses", "layer_h2d_bytes") + CYCLE_LAYER_TIME_COLUMNS:
        if col not in cycles.columns:
            continue
        for i, value in enumerate(cycles[col]):
            arr = np.asarray(value, dtype=np.float64)
            if arr.shape != (num_layers,):
                raise CalibrationDataError(
                    f"{label}: {_where(cycles, i)}: field {col!r} has {arr.size} values; expected {num_layers} (one per layer)"
                )
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise CalibrationDataError(
                    f"{label}: {_where(cycles, i)}: field {col!r} holds NaN/inf or negative values"
                )


def validate_transfers(transfers: pd.DataFrame, label: str = "transfers") -> None:
    """Check the transfers table (columns, finite non-negative bytes and seconds).

    Args:
        transfers: the runs' transfers table (``traces.schema`` transfer columns; ``bytes``,
            seconds per copy).
        label: the name the messages give the table (e.g. a run's folder).

    Raises:
        CalibrationDataError: naming the run, the field and the row.
    """
    missing = [c for c in TRANSFER_COLUMNS if c not in transfers.columns]
    if missing:
        raise CalibrationDataError(f"{label}: transfers table lacks column(s) {missing}")
    for col in ("bytes", "h2d_s"):
        values = transfers[col].to_numpy(dtype=np.float64)
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            i = int(np.argmax(bad))
            run = transfers["run"].iloc[i] if "run" in transfers.columns else label
            raise CalibrationDataError(
                f"run {run}: transfers row {i}: field {col!r} is {values[i]!r}; expected a finite value >= 0"
            )
