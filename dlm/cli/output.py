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
