"""SimPy discrete-event replay of dense traces across bandwidths, caches and policies (`python -m sim.sweep`).

Modules (no torch anywhere):

* :mod:`sim.engine`: one cycle's timeline on the compute stream and the FIFO H2D link, integer ns
  (SimPy reference engine and an equivalent fast recurrence).
* :mod:`sim.replay`: ``replay_policy(trace_run, SimConfig) -> ReplayResult`` (cycle records in
  the trace format's ``cycles`` schema, plus totals).
* :mod:`sim.config`: :class:`~sim.config.SimConfig`, policy name aliases.
* :mod:`sim.presets`: named hardware cost presets (GPU compute from public figures, PCIe links).
* :mod:`sim.cells`, :mod:`sim.executors`, :mod:`sim.report`, :mod:`sim.traceselect`: sweep cells,
  local/Ray execution, result tables/checks/figures, trace selection.
* :mod:`sim.sweep`: the CLI and ``run_sweep``.
"""
