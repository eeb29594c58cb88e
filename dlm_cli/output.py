"""Shared CLI plumbing: JSON on stdout, human text on stderr, errors as one line + exit code.

Engine errors (`engine.errors.DlmError`) carry their exit code: 2 for bad usage, 1 for a
failed operation. Imports of the engine stay inside functions so `--help` remains fast.
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


def emit_json(payload: Any) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


@contextmanager
def cli_errors() -> Iterator[None]:
    """Turn engine errors into `error: ...` on stderr and the contract's exit code."""
    from engine.errors import DlmError

    try:
        yield
    except DlmError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/]")
        raise typer.Exit(130) from None
