"""Trace format v1: Parquet tables plus a JSON manifest in one run directory (see docs/trace-format.md)."""
