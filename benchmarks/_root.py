"""Put the checkout a benchmark script lives in first on ``sys.path``.

A script run by its path (``python benchmarks/X.py``) gets its own folder first on ``sys.path``,
not the repository root, so ``import sim`` would find whatever copy of the project is installed
(an editable install of another clone, say) and the benchmark would measure that copy's code.
Each benchmark therefore starts with::

    import _root  # benchmarks/ is first on sys.path when a script runs by its path

    _root.put_root_first()

before it imports the project. ``tests/bench_loader.py`` loads the scripts the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def put_root_first() -> Path:
    """Put this checkout's root at ``sys.path[0]`` (moved there when it is on ``sys.path`` behind
    another copy, e.g. ``PYTHONPATH=/other:/this``); return it.

    Nothing is raised; ``sys.path`` is changed in place. The root is where ``specfit``, ``sim``,
    ``live`` and ``benchmarks`` of this clone live (the folder above this file).
    """
    root = str(ROOT)
    if sys.path[:1] != [root]:
        sys.path[:] = [root] + [entry for entry in sys.path if entry != root]
    return ROOT
