"""live.spec.session.heap_frozen (RecordSession.run decodes inside it): the objects alive before decoding are frozen during it (no full
collection traverses them inside a cycle) and collectable again after it."""

from __future__ import annotations

import gc
import weakref

import pytest

from live.spec.session import heap_frozen


class _Node:
    pass


def _cycle() -> weakref.ref:
    """A reference cycle reachable from nothing but itself; returns a weak reference to it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_objects_alive_before_decoding_are_frozen_during_it_and_collected_after() -> None:
    keep = [_Node(), _Node()]
    keep[0].other, keep[1].other = keep[1], keep[0]
    ref = weakref.ref(keep[0])
    assert gc.get_freeze_count() == 0
    with heap_frozen():
        assert gc.get_freeze_count() > 0
        del keep  # garbage now, but frozen: the collector does not look at it
        gc.collect()
        assert ref() is not None
        made_inside = _cycle()
        gc.collect()
        assert made_inside() is None  # what the run allocates is collected as before
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # an in-process caller (analysis.validate) can free the run's models


def test_unfreezes_after_an_exception_and_leaves_a_heap_frozen_by_others_alone() -> None:
    with pytest.raises(KeyboardInterrupt), heap_frozen():
        raise KeyboardInterrupt
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with heap_frozen():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_the_session_decodes_inside_heap_frozen() -> None:
    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "live" / "spec" / "session.py").read_text()
    (session,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "RecordSession"]
    (run,) = [n for n in session.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    blocks = [n for n in ast.walk(run) if isinstance(n, ast.With)]
    frozen = [w for w in blocks if any(ast.unparse(i.context_expr) == "heap_frozen()" for i in w.items)]
    assert len(frozen) == 1 and "self.decoder.generate(" in ast.unparse(frozen[0])
