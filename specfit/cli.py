"""Conventions shared by every command-line tool of the toolkit: the CLI contract.

Every CLI exposes ``main(argv=None) -> int`` decorated with :func:`cli_main`; ``--help`` lists
each flag with its unit and default. The contract (README, "The command-line tools"):

- exit 0: done; the LAST stdout line is a one-line JSON summary (:func:`print_summary`), read it
  with ``tail -n 1``;
- exit 2: bad input a user handed us: a bad flag value, or an input file that is missing,
  unreadable, corrupt or does not match the rest. ONE line on stderr names the flag or file (and
  row/column where it applies) and what was expected; stdout ends with
  ``{"ok": false, "error": ..., "exit_code": 2}``; flags are checked before any model load or
  other long work, and nothing already on disk is changed;
- exit 1: the tool ran but its result failed (a replay that failed, a calibration fit that misses
  its accuracy thresholds); the JSON line says why (``"ok": false``);
- exit 130 (Ctrl-C) or 143 (SIGTERM, where handled): interrupted, finished work kept;
- exit 141 (128 + SIGPIPE): stdout was closed before the tool finished writing
  (``python -m traces.validate RUN | head -1``): it stops quietly, no traceback, as a Unix tool
  killed by SIGPIPE would (:func:`cli_main`).

Raise :class:`InputError` (or call :meth:`ArgumentParser.fail`) for bad input; :func:`cli_main`
turns it into the exit-2 line. An unexpected exception (a bug, not bad input) keeps its traceback
and still ends stdout with a JSON line (``exit_code`` 1).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn


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

    def later_spellings(self, *flags: str) -> None:
        """Mark ``flags`` (already added) as spellings added after the tool shipped (the unified
        spellings of README "Flag spellings"): an abbreviation that matched an older flag before
        keeps meaning it (``--m`` stays ``--model`` when ``--max-new-tokens`` is added).

        Raises:
            ValueError: a flag that is not an option of this parser (a typo here).
        """
        unknown = [f for f in flags if f not in self._option_string_actions]
        if unknown:
            raise ValueError(f"later_spellings: not options of this parser: {unknown}")
        self._later_spellings = getattr(self, "_later_spellings", frozenset()) | frozenset(flags)

    def _get_option_tuples(self, option_string: str) -> list[tuple[Any, ...]]:
        """argparse's prefix matching (``--band`` for ``--bandwidth``), one match per action.

        CPython's ``_parse_optional`` calls a prefix ambiguous when it matches two option STRINGS,
        even when both are spellings of the same flag (``--bandw`` for ``--bandwidth`` and its
        alias ``--bandwidths``), so adding an alias would break prefixes that worked before. This
        keeps the first registered spelling of each action (same explicit value). Where the prefix
        still matches several actions, matches through :meth:`later_spellings` are dropped when
        that leaves one action; otherwise all stay and argparse reports the ambiguity (a prefix of
        two different flags stays an error). Source: CPython 3.11 ``Lib/argparse.py``
        (``_parse_optional``, ``_get_option_tuples``): a tuple's first item is the action, its second
        the option string and its last the explicit ``=value``, in 3-tuples and 4-tuples (``sep``
        third) alike. Checked: CPython 3.12.1 (pyenv) returns 3-tuples from both
        ``_get_option_tuples`` and ``_parse_optional``; 3.13.0 returns 4-tuples (with ``sep``) from
        both (a single tuple from ``_parse_optional`` for ``--band=3``);
        ``tests/test_cli_flag_spellings.py`` was run on 3.12.1 and 3.13.0 too.
        """
        later = getattr(self, "_later_spellings", frozenset())
        per_action: dict[tuple[int, Any], list[tuple[Any, ...]]] = {}
        for tup in super()._get_option_tuples(option_string):
            per_action.setdefault((id(tup[0]), tup[-1]), []).append(tup)
        kept = [tups[0] for tups in per_action.values()]
        older = [
            next(t for t in tups if t[1] not in later)
            for tups in per_action.values()
            if any(t[1] not in later for t in tups)
        ]
        return older if len(kept) > 1 and len(older) == 1 else kept

    def fail(self, flag: str, message: str) -> NoReturn:
        """Exit with status 2 and ``PROG: error: FLAG: MESSAGE`` on stderr (a message already naming
        FLAG keeps it once); see :func:`exit_bad_input`."""
        exit_bad_input(flag, message, prog=self.prog)

    def error(self, message: str) -> NoReturn:
        """argparse's error hook (unknown flag, bad value, missing argument): ONE line on stderr
        (no usage block; ``--help`` shows it), the JSON line on stdout, exit 2."""
        exit_bad_input(None, message, prog=self.prog)

    def add_no_progress(self) -> None:
        """Add ``--no-progress`` (``args.no_progress``): no progress bars on stderr."""
        self.add_argument(
            "--no-progress", action="store_true", help="no progress bar on stderr (for logs, CI and scripts)"
        )

    def ensure_out_dir(self, flag: str, path: Any) -> Path:
        """Create output folder ``path`` (and parents) now, before any work; exit 2 naming ``flag``
        when it cannot be created or written (a file in the way, no permission, read-only disk).

        Returns:
            the folder as a :class:`pathlib.Path`.
        """
        folder = Path(path)
        missing = [q for q in (folder, *folder.parents) if not q.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _CREATED_DIRS.extend(reversed(missing))  # removed again if the run fails while still empty
            probe = folder / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            blocker = next((q for q in (folder, *folder.parents) if q.exists() and not q.is_dir()), None)
            why = f"{str(blocker)!r} is a file, not a folder" if blocker is not None else exc.strerror or exc
            self.fail(flag, f"cannot create or write the output folder {str(folder)!r}: {why}")
        return folder


    def ensure_out_file(self, flag: str, path: Any, expected: str) -> Path:
        """Check output file ``path`` now, before any work: exit 2 naming ``flag`` when it is a
        folder (``"'PATH' is a folder; expected <expected>"``), when its folder cannot be created or
        written (:meth:`ensure_out_dir`) or when it exists and this user cannot write it.

        Returns:
            the file as a :class:`pathlib.Path` (its folder made).
        """
        out = Path(path)
        if out.is_dir():
            self.fail(flag, f"{str(path)!r} is a folder; expected {expected}")
        self.ensure_out_dir(flag, out.parent)
        if out.exists() and not os.access(out, os.W_OK):
            self.fail(flag, f"{str(path)!r} is not writable by this user; expected {expected}")
        return out

_CREATED_DIRS: list[Path] = []
"""Folders :meth:`ArgumentParser.ensure_out_dir` created in this process, parents first; a run
that fails (:func:`cli_main`) removes those it left empty."""


def _remove_empty_created(since: int) -> None:
    """Remove the folders created after index ``since`` of :data:`_CREATED_DIRS` that are empty
    (deepest first); non-empty ones (with work in them) stay."""
    for folder in reversed(_CREATED_DIRS[since:]):
        try:
            folder.rmdir()
        except OSError:
            pass
    del _CREATED_DIRS[since:]


def choices_help(
    names: Sequence[str], descriptions: dict[str, str] | None = None, aliases: dict[str, str] | None = None
) -> str:
    """``--help`` text listing every choice: ``"a = what a does; b (or b2) = ..."``.

    ``names``: the accepted values, in order; ``descriptions``: one line per name (names without
    one are listed bare); ``aliases``: other spelling -> name, shown in parentheses.
    """
    descriptions = descriptions or {}
    parts = []
    for name in names:
        others = [alias for alias, target in (aliases or {}).items() if target == name and alias != name]
        label = f"{name} (or {', '.join(others)})" if others else name
        parts.append(f"{label} = {descriptions[name]}" if name in descriptions else label)
    return "; ".join(parts)


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
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from exc
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
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


def json_error_text(exc: json.JSONDecodeError) -> str:
    """``"line L, column C: <what>"`` for a JSON decoding error, for one-line messages naming a file.

    CPython's ``JSONDecodeError.msg`` of some errors ends in a dangling ``" at"`` (``"Invalid
    control character at"``, ``"Unterminated string starting at"``): the position follows in its
    full text only. This says the position first and drops the dangling word.
    """
    what = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"line {exc.lineno}, column {exc.colno}: {what}"


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


class InputError(Exception):
    """Bad input a user handed us; :func:`cli_main` exits 2 with one line naming ``what``.

    Args:
        what: the flag (``"--trace"``), positional (``"RUN_DIR"``) or file path at fault.
        message: what was found and what was expected (row/column where it applies).
    """

    def __init__(self, what: str, message: str) -> None:
        message = str(message)
        if message.startswith(f"{what}:"):
            message = message[len(what) + 1 :].lstrip()
        super().__init__(f"{what}: {message}")
        self.what = what
        self.message = message


def _one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def exit_bad_input(what: str | None, message: str, prog: str | None = None) -> NoReturn:
    """The exit-2 path of the contract: ``PROG: error: WHAT: MESSAGE`` as ONE stderr line,
    ``{"ok": false, "error": "WHAT: MESSAGE", "exit_code": 2}`` as the last stdout line, then
    ``SystemExit(2)``.

    ``what`` (a flag, positional or file) is prefixed unless ``message`` already starts with it;
    ``None`` when ``message`` names it already (argparse's own messages).
    """
    message = _one_line(message)
    if what is not None and not message.startswith(f"{what}:"):
        message = f"{what}: {message}"
    prefix = f"{prog}: error: " if prog else "error: "
    sys.stdout.flush()
    sys.stderr.write(prefix + message + "\n")
    sys.stderr.flush()
    _summary_unless_stdout_closed({"ok": False, "error": message, "exit_code": 2})
    raise SystemExit(2)


def _prog(main: Callable[..., Any]) -> str:
    """``python -m MODULE`` of a CLI's ``main`` (``__main__`` resolved to the module run), or
    ``python SCRIPT`` for a script run by its path (``python benchmarks/planner.py``)."""
    module = main.__module__
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is None:
            return f"python {sys.argv[0]}"
        module = spec.name
    return f"python -m {module}"


class Interrupted(KeyboardInterrupt):
    """A stop signal raised as ``KeyboardInterrupt``: SIGINT (Ctrl-C) or SIGTERM; ``signum`` says
    which. A CLI that catches it keeps what is finished, prints its JSON line and exits
    ``128 + signum`` (130, 143), the shell's convention for a process ended by a signal."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While active, SIGTERM raises :class:`Interrupted` in the main thread, so a CLI stops on
    ``kill`` (or a job scheduler's stop) as it does on Ctrl-C; the previous handler is restored
    after. No-op outside the main thread (Python delivers signals to it only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


STDOUT_CLOSED_EXIT = 128 + 13
"""Exit status of a CLI whose stdout was closed early (128 + SIGPIPE, 141: what a shell reports
for a process killed by SIGPIPE)."""


def stdout_closed() -> bool:
    """Whether the reader of this process's stdout is gone (a pipe whose read end was closed,
    e.g. by ``head``): ``poll`` reports ``POLLERR`` on a pipe's write end once it has no reader
    (Linux ``pipe_poll``) and ``POLLHUP`` on a hung-up socket. ``True`` where ``poll`` is missing,
    so a :class:`BrokenPipeError` is then taken to be stdout's (Python docs, "Note on SIGPIPE")."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced or closed (pytest capture, io.StringIO)
        return False
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _detach_stdout() -> None:
    """Point file descriptor 1 at the null device, so that the interpreter's last flush of what is
    still buffered for the closed stdout does not raise again at exit (``Exception ignored ...
    BrokenPipeError``); the recipe of the Python docs' "Note on SIGPIPE"."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _flush_stdout() -> bool:
    """Flush stdout now, so that what a CLI left buffered fails here rather than in the
    interpreter's teardown; ``False`` (stdout detached, :func:`_detach_stdout`) when it was closed."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _detach_stdout()
        return False
    return True


def _summary_unless_stdout_closed(summary: dict[str, Any]) -> None:
    """:func:`print_summary` on an exit path that already has its status (2, or 1 for a bug): a
    closed stdout (:func:`stdout_closed`) drops the line quietly instead of replacing that status."""
    try:
        print_summary(summary)
    except BrokenPipeError:
        if not stdout_closed():
            raise
        _detach_stdout()


def cli_main(main: Callable[[Sequence[str] | None], int]) -> Callable[[Sequence[str] | None], int]:
    """Decorator for every CLI's ``main(argv) -> int``: enforces the contract (module docstring).

    :class:`InputError` -> exit 2 with one stderr line and the JSON line (``SystemExit(2)``, as
    argparse does); ``SystemExit``/``KeyboardInterrupt`` pass through; a :class:`BrokenPipeError`
    while stdout is closed (:func:`stdout_closed`: ``TOOL | head -1``) returns
    :data:`STDOUT_CLOSED_EXIT` quietly, stdout pointed at the null device; any other exception is
    a bug: the JSON line ``{"ok": false, "error": ..., "exit_code": 1}`` is printed and the
    exception re-raised with its traceback.
    """

    @functools.wraps(main)
    def wrapped(argv: Sequence[str] | None = None) -> int:
        since = len(_CREATED_DIRS)
        code: Any = 1
        try:
            code = _contract(main, argv)
            return code
        except SystemExit as exc:
            code = exc.code
            raise
        except KeyboardInterrupt:
            code = 130
            raise
        except BrokenPipeError:
            if not stdout_closed():
                raise
            code = STDOUT_CLOSED_EXIT
            _detach_stdout()
            return code
        finally:
            if code not in (0, None):
                _remove_empty_created(since)
            else:
                del _CREATED_DIRS[since:]

    return wrapped


def _contract(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
    """``main(argv)`` with :class:`InputError` and bugs turned into the contract's exits (see
    :func:`cli_main`, which also handles a closed stdout)."""
    try:
        return main(argv)
    except InputError as exc:
        exit_bad_input(exc.what, exc.message, prog=_prog(main))
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and stdout_closed():
            raise
        _summary_unless_stdout_closed(
            {"ok": False, "error": f"internal error ({type(exc).__name__}): {_one_line(exc)}", "exit_code": 1}
        )
        raise


def missing_file(path: str | Path) -> str:
    """Why ``path`` is not a readable file, for a message: ``"is a folder, not a file"`` or
    ``"does not exist"``."""
    return "is a folder, not a file" if Path(path).is_dir() else "does not exist"


def read_table(path: str | Path, what: str | None = None, expected: str = "") -> Any:
    """A Parquet (``*.parquet``) or CSV file as a ``pandas.DataFrame``; a file that is missing,
    truncated or not in that format raises :class:`InputError` naming the file (and ``what``, the
    flag it came from, when given) and what was expected, never pyarrow's or pandas' traceback.

    Raises:
        InputError: unreadable or corrupt file.
    """
    import pandas as pd

    path = Path(path)
    kind = "Parquet" if path.suffix == ".parquet" else "CSV"
    try:
        return pd.read_parquet(path) if kind == "Parquet" else pd.read_csv(path)
    except (OSError, ValueError) as exc:  # ArrowInvalid, ParserError, EmptyDataError, UnicodeDecodeError
        why = _one_line(exc) or type(exc).__name__
        raise InputError(
            what or str(path),
            f"{path}: cannot read it as a {kind} file ({why})" + (f"; expected {expected}" if expected else ""),
        ) from None


def exits_at_once_after_signal(main: Callable[[Sequence[str] | None], int]) -> Callable[[Sequence[str] | None], int]:
    """Mark a CLI's ``main`` so that :func:`run_main` leaves with ``os._exit`` after an
    interrupted run (exit 130 or 143: by then the CLI has saved what was finished and printed its
    JSON line): the interpreter's teardown of a process holding torch and a model (module and
    object finalisation, 2-6 s measured on this project's 2-core VM after ``live.record`` was sent
    SIGTERM) would otherwise delay the exit a scheduler or a user waits for. Only for CLIs that
    leave nothing to ``atexit`` (no worker pools, no open files): stdout and stderr are flushed."""
    main.exits_at_once_after_signal = True  # type: ignore[attr-defined]
    return main


def run_main(main: Callable[[Sequence[str] | None], int]) -> None:
    """``if __name__ == "__main__": run_main(main)`` -> ``sys.exit(main())``, with the heap frozen
    first (see :func:`freeze_heap_for_exit`); see :func:`exits_at_once_after_signal` for the one
    exception. Stdout is flushed before the exit: a closed stdout turns a 0 status (``--help``
    included) into :data:`STDOUT_CLOSED_EXIT`, quietly."""
    try:
        code = main(None)
    except SystemExit as exc:  # argparse's --help (0) and bad flags (2), exit_bad_input
        if not _flush_stdout() and exc.code in (0, None):
            raise SystemExit(STDOUT_CLOSED_EXIT) from None
        raise
    if not _flush_stdout() and code == 0:
        code = STDOUT_CLOSED_EXIT
    interrupted = code in (128 + signal.SIGINT, 128 + signal.SIGTERM)
    if interrupted and getattr(main, "exits_at_once_after_signal", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    freeze_heap_for_exit()
    sys.exit(code)


def freeze_heap_for_exit() -> None:
    """Move every object the cyclic garbage collector tracks to its permanent generation
    (:func:`gc.freeze`) just before a CLI process exits, so that the interpreter's teardown does
    not traverse them: ``Py_FinalizeEx`` runs full collections (``finalize_modules``, then the
    last one of ``finalize_interp_clear``; CPython's Python/pylifecycle.c) over every tracked
    object, and a process that imported torch + transformers holds ~424,000 of them (3,422
    modules: torch, sympy, scipy, pandas, transformers). On this project's 2-core VM one such
    collection took 0.53-0.65 s and the teardown of a ``live.record`` run 4.4-12 s (load 7-10;
    ``perf``: ~75 % of it in ``gc_collect_main``); frozen, 1.1-1.2 s. atexit hooks still run and
    modules are still cleared (objects freed by reference counting as usual); only garbage
    *cycles* among the frozen objects are left to the operating system, whose finalizers Python
    does not promise to run at exit anyway. Not for library code: a frozen object is never
    collected by the cycle collector while the process lives."""
    import gc

    gc.freeze()


TOOLS = (
    "live.record",
    "calibration.fit",
    "calibration.h2d",
    "sim.sweep",
    "analysis.report",
    "analysis.validate",
    "traces.inspect",
    "traces.validate",
    "traces.rewrite",
    "traces.synthetic",
    "live.train_default",
    "live.train_eagle3",
    "live.build_width",
)
"""Every ``python -m`` tool of the toolkit (``tests/test_specfit_cli.py`` keeps it complete)."""


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specfit.cli``: this module holds the tools' shared contract and is not a tool
    itself; exit 2 with one line naming the tools (``--help`` also lists them)."""
    listed = ", ".join(f"python -m {tool}" for tool in TOOLS)
    parser = ArgumentParser(
        prog="python -m specfit.cli",
        description=f"The CLI contract's shared helpers, not a tool. The tools: {listed}.",
    )
    parser.parse_args(argv)
    exit_bad_input(None, f"specfit.cli is the tools' shared helpers, not a tool; run one of: {listed}", parser.prog)


if __name__ == "__main__":
    run_main(main)
