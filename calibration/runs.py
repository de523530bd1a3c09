"""Load the run directories a calibration reads: cycles, transfers and dense trees, checked.

Every run is opened with :func:`traces.reader.open_run` (which validates the format); the tables
of several runs are concatenated with a ``run`` column (the run directory as given) so that every
later error can name the run. All runs must describe the same model (layers, experts, top-k,
bytes per expert); ``expected_model`` additionally checks the manifest's ``model.name``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from traces.errors import TraceError
from traces.reader import NodeArrays, TraceRun, open_run
from traces.schema import Manifest, ModelSpec


class RunInputError(ValueError):
    """A run directory that cannot be used for calibration (message names the run and field)."""


@dataclass(frozen=True)
class LoadedRuns:
    """Tables of one or more runs of the same model.

    Attributes:
        runs: the opened :class:`TraceRun` objects, in the order given.
        labels: run labels (the directories as given), same order.
        model: the common :class:`ModelSpec`.
        cycles: concatenated ``cycles`` tables with a ``run`` column (may be empty).
        transfers: concatenated ``transfers`` tables with a ``run`` column (may be empty).
    """

    runs: tuple[TraceRun, ...]
    labels: tuple[str, ...]
    model: ModelSpec
    cycles: pd.DataFrame
    transfers: pd.DataFrame

    def manifests(self) -> tuple[Manifest, ...]:
        """The runs' manifests."""
        return tuple(r.manifest for r in self.runs)

    def dense_runs(self) -> list[tuple[str, TraceRun]]:
        """``(label, run)`` of the runs that hold dense trees (``nodes`` rows)."""
        return [(label, run) for label, run in zip(self.labels, self.runs) if run.num_rows("nodes") > 0]

    def cost_fit_tables(self) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
        """(cycles, transfers, run labels) the cost model is fitted on.

        Policy-mode runs when any is given (dense-mode cycles verify the whole maximal tree and
        commit one token, a cycle shape no policy runs), else every run. Their links must agree.

        Raises:
            RunInputError: runs with different links (``hardware.link_kind``, emulated bandwidth or
                latency), naming the run and the field.
        """
        policy = [lbl for lbl, run in zip(self.labels, self.runs) if run.manifest.run.mode == "policy"]
        labels = policy or list(self.labels)
        by_label = dict(zip(self.labels, self.runs))
        first = by_label[labels[0]].manifest.hardware
        for label in labels[1:]:
            hw = by_label[label].manifest.hardware
            for name in _SAME_LINK_FIELDS:
                if getattr(hw, name) != getattr(first, name):
                    raise RunInputError(
                        f"{label}: manifest field 'hardware.{name}' is {getattr(hw, name)!r}, but run "
                        f"{labels[0]} has {getattr(first, name)!r}; fit one link at a time"
                    )
        cycles = self.cycles[self.cycles["run"].isin(labels)] if len(self.cycles) else self.cycles
        transfers = (
            self.transfers[self.transfers["run"].isin(labels)] if len(self.transfers) else self.transfers
        )
        return cycles.reset_index(drop=True), transfers.reset_index(drop=True), labels

    def node_arrays(self) -> list[tuple[str, NodeArrays]]:
        """``(label, NodeArrays)`` of every dense run."""
        return [(label, run.node_arrays()) for label, run in self.dense_runs()]


_SAME_MODEL_FIELDS = ("num_layers", "num_experts", "top_k", "bytes_per_expert")
_SAME_LINK_FIELDS = ("device_name", "link_kind", "emulated_bandwidth_bytes_per_s", "emulated_s_per_transfer")


def load_runs(run_dirs: Sequence[str | Path], *, expected_model: str | None = None) -> LoadedRuns:
    """Open and check run directories.

    Args:
        run_dirs: one or more run directories.
        expected_model: when given, every manifest's ``model.name`` must equal it.

    Returns:
        :class:`LoadedRuns`.

    Raises:
        RunInputError: missing directory, unreadable / invalid trace (the trace error's message is
            kept), a model other than ``expected_model``, or runs of different model shapes.
    """
    if not run_dirs:
        raise RunInputError("no run directory given")
    runs, labels = [], []
    for run_dir in run_dirs:
        label = str(run_dir)
        if not Path(run_dir).is_dir():
            raise RunInputError(f"{label}: not a directory (expected a run directory with manifest.json)")
        try:
            run = open_run(run_dir)
        except (TraceError, ValueError, OSError) as exc:
            raise RunInputError(f"{label}: {exc}") from None
        model = run.manifest.model
        if expected_model is not None and model.name != expected_model:
            raise RunInputError(
                f"{label}: manifest field 'model.name' is {model.name!r}; expected {expected_model!r} (flag --model)"
            )
        if runs:
            first = runs[0].manifest.model
            for name in _SAME_MODEL_FIELDS:
                if getattr(model, name) != getattr(first, name):
                    raise RunInputError(
                        f"{label}: manifest field 'model.{name}' is {getattr(model, name)}, but run "
                        f"{labels[0]} has {getattr(first, name)}; calibrate one model at a time"
                    )
        runs.append(run)
        labels.append(label)
    cycles = _concat([(label, run.cycles) for label, run in zip(labels, runs)])
    transfers = _concat([(label, run.transfers) for label, run in zip(labels, runs)])
    return LoadedRuns(tuple(runs), tuple(labels), runs[0].manifest.model, cycles, transfers)


def _concat(tables: list[tuple[str, pd.DataFrame]]) -> pd.DataFrame:
    frames = [df.assign(run=label) for label, df in tables if len(df)]
    if not frames:
        return tables[0][1].assign(run=pd.Series(dtype=str)) if tables else pd.DataFrame()
    return pd.concat(frames, ignore_index=True)
