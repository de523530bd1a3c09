"""``specfit.planner.warm_up`` loads every compiled kernel a live cycle calls, before the first
timed cycle (rev6: the guard's root-alone kernels loaded, or compiled, inside the first drafting
cycle's decode time: 8-17 ms from numba's cache, 0.3-2.6 s on a fresh install)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json
from specfit import cache_kernels, decide_kernels, planner
planner.warm_up(search=False)
loaded = {
    name: len(getattr(module, name).signatures)
    for module, name in (
        (cache_kernels, "root_layer_misses"),
        (cache_kernels, "root_alone_copies"),
        (decide_kernels, "union_size_plan_rule"),
    )
}
print(json.dumps(loaded))
"""


def test_warm_up_loads_the_guards_root_alone_kernels() -> None:
    """In a fresh process (no kernel called yet), ``warm_up`` leaves the guard's two root-alone
    kernels loaded for the live types, as it does the decide path's."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(count >= 1 for count in loaded.values()), loaded
