"""Shared CLI plumbing: JSON on stdout, human text on stderr, errors as one line + exit code.

Engine errors (`dlm.engine.errors.DlmError`) carry their exit code: 2 for bad usage, 1 for a
failed operation; an OSError (disk full, permission denied, a path too long) is a failed
operation too. Imports of the engine stay inside functions so `--help` remains fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

err_console = Console(stderr=True)


def listing_console() -> Console:
    """Where a listing goes: stdout. When stdout is not a terminal (a pipe, a file) it is
    made wide enough that no table cell is cut or folded, so `dlm models | grep` sees whole
    values on one line."""
    console = Console()
    return console if console.is_terminal else Console(width=100_000)


def progress(*columns: Any, transient: bool = True) -> Any:
    """A progress display on stderr, only where stderr is a terminal: elsewhere (a pipe, a log
    file, a test) rich draws nothing while it runs and ends it with an empty line, which then
    stood before the command's `error:` line."""
    from rich.progress import Progress

    return Progress(*columns, console=err_console, transient=transient, disable=not err_console.is_interactive)


def emit_json(payload: Any) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


def reader_gone(exc: BaseException) -> bool:
    """Whether `exc` is stdout's reader having closed the pipe (`dlm models --json | head -1`).
    That is no failure to report: the command ends quietly with exit 1, as rich's own
    listings do there (and Python's documented way). stdout is pointed at /dev/null, so the
    flush at exit does not raise the same error again. A broken pipe elsewhere (a socket a
    server closed) is not this: the pipe on stdout must report the error itself."""
    import os
    import select

    if not isinstance(exc, BrokenPipeError):
        return False
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, ValueError, OSError):  # no real stdout (a test's capture), or closed
        return False
    if gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return gone


@contextmanager
def cli_errors() -> Iterator[None]:
    """Turn engine errors into `error: ...` on stderr and the contract's exit code."""
    from dlm.engine.errors import DlmError

    try:
        yield
    except DlmError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:  # the file system or the network refused: a failed operation, not a bug
        if reader_gone(exc):
            raise typer.Exit(1) from None
        err_console.print(f"[bold red]error:[/] {escape(_one_line(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        from dlm.cli import interrupts

        interrupts.report()
        raise typer.Exit(interrupts.EXIT_CODE) from None


def _one_line(exc: OSError) -> str:
    """`strerror: filename` when the OS said which file, else the message's first line."""
    if exc.strerror and exc.filename is not None:
        return f"{exc.strerror}: {exc.filename}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def writable_file(flag: str, path: Path) -> None:
    """Refuse (bad usage, exit 2) a FLAG path no file can be written at, before any work: a
    directory, a folder that cannot be created, a place no file can take (/proc/x). Its folder
    is created; the file is left as it was."""
    from dlm.engine.errors import UsageError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create its folder ({exc.strerror or exc})") from None
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    existed = path.exists()
    try:  # opened now, as it will be: a path no file can take is refused before the work
        path.open("a").close()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None
    if not existed:
        path.unlink(missing_ok=True)


def writable_dir(flag: str, path: Path) -> None:
    """Refuse (bad usage, exit 2) a FLAG folder that is a file or cannot be created or written
    in, before any work; it is created (with its parents) when missing."""
    import tempfile

    from dlm.engine.errors import UsageError

    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()  # a folder no file can be made in (/proc, read-only)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in it ({exc.strerror or exc})") from None
