"""Load a script of benchmarks/ as a module, for the tests that smoke-test the benchmarks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(stem: str) -> ModuleType:
    """``benchmarks/<stem>.py`` imported afresh (benchmarks/ is not a package), with benchmarks/
    first on ``sys.path`` while it loads, as when the script runs by its path (its ``import _root``)."""
    spec = importlib.util.spec_from_file_location(f"{stem}_benchmark", BENCHMARKS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
