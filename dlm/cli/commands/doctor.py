"""`dlm doctor`: is this machine ready to serve? A table (or JSON) of checks; exit 1 on a blocker."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from dlm.cli.output import cli_errors, emit_json
from dlm.cli.setting_options import default

STYLE = {"ok": "green", "info": "dim", "warn": "yellow", "fail": "bold red"}


def doctor(
    port: int = typer.Option(default("port"), "--port", help="Port to check is free (as `dlm serve --port` takes it)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Check Python, torch, GPUs, NCCL, the Triton kernels (self-test), disk, port, store, hub and dtype."""
    with cli_errors():
        from dlm.cli.doctor import diagnose
        from dlm.cli.server.config import setting

        report = diagnose(setting("port", port))
        if json_out:
            emit_json(report.to_dict())
        else:
            from rich.console import Console
            from rich.table import Table

            table = Table("check", "status", "value", box=None, pad_edge=False)
            for check in report.checks:
                style = STYLE[check.status]
                table.add_row(check.name, f"[{style}]{check.status}[/]", escape(check.value))
            # Piped: no terminal width to fit, so keep every value on one line for grep.
            console = Console(width=None if sys.stdout.isatty() else 400)
            console.print(table)
            if report.blockers:
                console.print(f"[bold red]blocked by:[/] {', '.join(report.blockers)}")
    if report.blockers:
        raise typer.Exit(1)
