"""`dlm doctor`: is this machine ready to serve? A table (or JSON) of checks; exit 1 on a blocker."""

from __future__ import annotations

import sys

import typer

from dlm.cli.output import cli_errors, emit_json

STYLE = {"ok": "green", "info": "dim", "warn": "yellow", "fail": "bold red"}


def doctor(
    port: int | None = typer.Option(None, "--port", help="Port to check is free [serve's default, 8000]."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Check Python, torch, GPUs, NCCL, the Triton kernels (self-test), disk, port, store, hub and dtype."""
    with cli_errors():
        from dlm.cli.doctor import diagnose

        report = diagnose(port)
        if json_out:
            emit_json(report.to_dict())
        else:
            from rich.console import Console
            from rich.table import Table

            table = Table("check", "status", "value", box=None, pad_edge=False)
            for check in report.checks:
                style = STYLE[check.status]
                table.add_row(check.name, f"[{style}]{check.status}[/]", check.value)
            # Piped: no terminal width to fit, so keep every value on one line for grep.
            console = Console(width=None if sys.stdout.isatty() else 400)
            console.print(table)
            if report.blockers:
                console.print(f"[bold red]blocked by:[/] {', '.join(report.blockers)}")
    if report.blockers:
        raise typer.Exit(1)
