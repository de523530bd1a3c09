"""Fits the cycle cost model, acceptance calibration and expert predictors from traces (`python -m calibration.fit`)."""
