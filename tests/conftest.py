"""Shared pytest fixtures. Tiny random checkpoint factories live in tests/live_fixtures.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

# One torch thread: the tiny test models run fastest so, and a busy 2-core CI machine does not
# oversubscribe (set before any test imports torch; a user's explicit setting wins).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_checkpoint(arch) -> Path``: a tiny random MoE checkpoint (``live_fixtures``, seed 0)
    with the tiny word-level tokenizer, written once per session. Tests must not change it.

    Needs torch and transformers (imported lazily, so packages without them are unaffected).
    """
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    made: dict[str, Path] = {}

    def make(arch: str = "qwen3_moe") -> Path:
        if arch not in made:
            from live_fixtures import make_tiny_checkpoint, save_tiny_tokenizer

            made[arch] = make_tiny_checkpoint(root, arch)
            save_tiny_tokenizer(made[arch])
        return made[arch]

    return make


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch):
    """A :class:`fake_clock.FakeClock` installed as ``time.perf_counter``/``time.sleep`` for one test."""
    from fake_clock import FakeClock

    return FakeClock().install(monkeypatch)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense draft checkpoint sharing the tiny vocabulary (``live_fixtures``, seed 1), with the
    tiny tokenizer. Tests must not change it."""
    from live_fixtures import make_tiny_draft, save_tiny_tokenizer

    draft = make_tiny_draft(tmp_path_factory.mktemp("tiny-draft"))
    save_tiny_tokenizer(draft)
    return draft
