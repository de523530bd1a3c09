"""Load a script of benchmarks/ as a module, for the tests that smoke-test the benchmarks."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(stem: str) -> ModuleType:
    """``benchmarks/<stem>.py`` imported afresh (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{stem}_benchmark", BENCHMARKS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
