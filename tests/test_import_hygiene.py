"""specfit, traces, calibration and sim never import torch; live never imports simpy (DESIGN.md)."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str) -> list[str]:
    names = [package]
    for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
        names.append(info.name)
    return names


@pytest.mark.parametrize("package", ["specfit", "traces", "calibration", "sim"])
def test_package_never_imports_torch(package: str) -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {_modules(package)!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print('TORCH' if bad else 'CLEAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("CLEAN"), f"{package} imports torch"


def test_live_never_imports_simpy() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {_modules('live')!r}:\n"
        "    importlib.import_module(name)\n"
        "print('SIMPY' if 'simpy' in sys.modules else 'CLEAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("CLEAN"), "live imports simpy"
