"""Every link and repository path in the README and docs resolves in a clone of the repository.

A user's clone has only the repository: a link (or a path named in backticks) that points at a
missing file, or outside the repository (e.g. ``../shared/...``, present only on the development
machine), is a broken promise. Checked in every tracked ``*.md`` file: Markdown links
``[text](target)``, ``<img src=...>`` and bare ``../`` paths in prose (relative to that file;
web links and pure anchors skipped; code is not prose), and paths in backticks that start with
a top-level folder of the repository (relative to the root).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMG = re.compile(r"<img[^>]*\bsrc=\"([^\"]+)\"")
_REF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
_PROSE_PATH = re.compile(r"(?<![\w/.(\]])(\.\./[A-Za-z0-9_./-]*[A-Za-z0-9_/])")  # a bare ../path in prose
_CODE_PATH = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+/?)`")
_CODE = re.compile(r"```.*?```|`[^`]+`", re.S)  # code is not Markdown: no links inside
_EXTERNAL = ("http://", "https://", "mailto:", "ftp://", "#")


def _markdown_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        files = [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (e.g. an sdist)
        files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [f for f in files if f.is_file()]


def _top_level_dirs() -> set[str]:
    """The repository's own top-level folders: not the git-ignored ones a run leaves in a checkout
    (``runs/`` after the README's first command, a ``build/`` or a ``.venv``)."""
    ignored = {
        line.strip().strip("/")
        for line in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#") and "*" not in line
    }
    return {
        p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in ignored
    }


def _inside_repo(path: Path) -> bool:
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return True


def broken_links(text: str, base: Path, top_dirs: set[str]) -> list[str]:
    """``"target (why)"`` for each link (relative to folder ``base``) or backticked repository path
    (relative to the root) of Markdown ``text`` that does not resolve inside the repository."""
    bad = []
    prose = _CODE.sub("", text)
    for target in [*_LINK.findall(prose), *_IMG.findall(prose), *_REF.findall(prose)]:
        if target.startswith(_EXTERNAL):
            continue
        path = (base / target.split("#", 1)[0]).resolve()
        if not _inside_repo(path):
            bad.append(f"{target} (outside the repository)")
        elif not path.exists():
            bad.append(f"{target} (missing)")
    for target in _PROSE_PATH.findall(_LINK.sub("", prose)):
        path = (base / target).resolve()
        if not _inside_repo(path) or not path.exists():
            bad.append(f"{target} (not in the repository)")
    for target in _CODE_PATH.findall(text):
        first = target.split("/", 1)[0]
        if first == "..":
            bad.append(f"`{target}` (outside the repository)")
        elif first in top_dirs and not (ROOT / target).exists():
            bad.append(f"`{target}` (missing)")
    return bad


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repo(md):
    assert broken_links(md.read_text(encoding="utf-8"), md.parent, _top_level_dirs()) == []


def test_the_checker_finds_broken_links():
    text = (
        "[ok](../README.md) [gone](missing.md) [out](../../shared/data/x.gz) [web](https://x.org) "
        "[anchor](#notes) ![fig](../README.md#top) `tests/conftest.py` `tests/nope.py` `runs/out.csv` "
        "`../shared/data/planner_cases.jsonl.gz` `E[x](S)`\n```\n[in code](nowhere.md)\n```\n"
        "Golden cases are in ../shared/data/planner_cases.jsonl.gz. See ../README.md.\n"
    )
    assert broken_links(text, ROOT / "docs", _top_level_dirs()) == [
        "missing.md (missing)",
        "../../shared/data/x.gz (outside the repository)",
        "../shared/data/planner_cases.jsonl.gz (not in the repository)",
        "`tests/nope.py` (missing)",
        "`../shared/data/planner_cases.jsonl.gz` (outside the repository)",
    ]
