"""Conventions shared by every command-line tool of the toolkit.

Every CLI exposes ``main(argv=None) -> int``; ``--help`` lists each flag with its unit and
default; an invalid flag value exits with status 2 and a message that names the flag
(argparse's own behaviour, kept by raising :class:`argparse.ArgumentTypeError` from the
parsers below); the LAST line printed on stdout is a one-line JSON summary
(:func:`print_summary`), so scripts and benchmarks can read it with ``tail -n 1``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults; a list default prints as it is typed (``16,32,64``), not as a Python list."""

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, (list, tuple)):
            action = copy.copy(action)
            action.default = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in action.default)
        return super()._expand_help(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse parser whose help shows defaults; errors exit 2 naming the flag.

    Use :meth:`fail` for checks made after parsing (file missing, cache larger than the
    experts per layer, ...): it prints ``error: --flag: message`` and exits 2.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def fail(self, flag: str, message: str) -> None:
        """Exit with status 2 and ``error: FLAG: MESSAGE`` on stderr (a message already naming FLAG keeps it once)."""
        message = str(message)
        if message.startswith(f"{flag}:"):
            message = message[len(flag) + 1 :].lstrip()
        self.error(f"{flag}: {message}")

    def ensure_out_dir(self, flag: str, path: Any) -> Path:
        """Create output folder ``path`` (and parents) now, before any work; exit 2 naming ``flag``
        when it cannot be created or written (a file in the way, no permission, read-only disk).

        Returns:
            the folder as a :class:`pathlib.Path`.
        """
        folder = Path(path)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            blocker = next((q for q in (folder, *folder.parents) if q.exists() and not q.is_dir()), None)
            why = f"{str(blocker)!r} is a file, not a folder" if blocker is not None else exc.strerror or exc
            self.fail(flag, f"cannot create or write the output folder {str(folder)!r}: {why}")
        return folder


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from exc
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from exc
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


MAX_GB_PER_S = 10_000.0
"""Largest bandwidth :func:`gb_per_s` accepts (GB/s): far above any host-to-device link, far
below a byte count per second typed by mistake (``16e9``)."""


def gb_per_s(text: str) -> float:
    """argparse type: a bandwidth in GB/s (1 GB = 1e9 bytes): finite, > 0 and <= :data:`MAX_GB_PER_S`.

    A larger value is rejected with a message saying the flag is in GB/s and the value looks like
    bytes/s (``16e9`` -> "did you mean 16 GB/s?").
    """
    try:
        value = positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a bandwidth in GB/s (a number > 0), got {text!r}") from None
    if value > MAX_GB_PER_S:
        hint = f" (did you mean {value / 1e9:g} GB/s?)" if value >= 1e7 else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} GB/s is above {MAX_GB_PER_S:,.0f} GB/s: this flag is in GB/s (1 GB = 1e9 bytes) and "
            f"the value looks like bytes/s{hint}"
        )
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from exc
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def comma_list(item_type: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """argparse type factory: ``"16,32,64"`` -> ``[item_type("16"), ...]`` (non-empty).

    An empty item (``"16,,32"``, a leading or trailing comma) is an error, not dropped.
    """

    def parse(text: str) -> list[Any]:
        parts = [p.strip() for p in text.split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        if not all(parts):
            raise argparse.ArgumentTypeError(
                f"empty item in {text!r} (expected comma-separated values, no empty or trailing items)"
            )
        return [item_type(p) for p in parts]

    parse.__name__ = f"comma_list({getattr(item_type, '__name__', 'item')})"
    return parse


def print_summary(summary: dict[str, Any], stream: Any = None) -> None:
    """Print ``summary`` as one JSON line (sorted keys, NaN as null); call it last."""
    stream = stream or sys.stdout

    def clean(obj: Any) -> Any:
        if isinstance(obj, float) and not math.isfinite(obj):
            return None
        if isinstance(obj, dict):
            return {str(k): clean(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [clean(v) for v in obj]
        if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
            return clean(obj.item())
        return obj

    stream.write(json.dumps(clean(summary), sort_keys=True) + "\n")
    stream.flush()


def run_main(main: Callable[[Sequence[str] | None], int]) -> None:
    """``if __name__ == "__main__": run_main(main)`` -> ``sys.exit(main())``."""
    sys.exit(main(None))
