"""Metrics with stated conventions, sim-vs-live fidelity, figures and reports (`python -m analysis.report`).

Modules: ``metrics`` (tau, per-depth acceptance, throughput, errors; docs/metrics.md), ``inputs``
(reads runs, sweeps, calibration and validation folders), ``figures`` (one function per figure),
``report`` (the Markdown report CLI), ``fidelity`` (one cell, sim vs live) and ``validate``
(``python -m analysis.validate``, the live validation grid).
"""
