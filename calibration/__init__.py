"""Fits the cost model, acceptance calibration and expert predictors from traces (`python -m calibration.fit`).

Modules: ``lsq`` (non-negative / robust least squares), ``checks`` (table checks and the data
error), ``link`` (bandwidth and per-copy latency fit), ``costfit`` (per-term fits of
``specfit.cost.CycleCostModel`` and held-out errors), ``acceptance_fit`` (isotonic
acceptance map and reliability table), ``predictor_tables`` (token-table and union-size tables),
``runs`` (loading and checking run directories), ``synthetic`` (cycles from known parameters),
``fit`` (the CLI) and ``h2d`` (``python -m calibration.h2d``, the H2D microbenchmark). No module
imports torch at import time (``h2d`` imports it inside the measurement).
"""
