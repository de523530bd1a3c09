"""Metrics with stated conventions, sim-vs-live fidelity, figures and reports (`python -m analysis.report`)."""
