"""`dlm release` and `dlm rollback`: switch a deployment's current version."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from dlm.cli.output import cli_errors, emit_json, err_console
from dlm.cli.store_ui import JSON_OPTION, STORE_OPTION, open_store

DEPLOYMENT_OPTION: Any = typer.Option("default", "--deployment", "-d", help="Deployment name.")


def _report(outcome: Any, json_out: bool, asked: str | None = None) -> None:
    if json_out:
        emit_json(outcome.to_json())
    ref = outcome.current.ref if outcome.current else "nothing"
    if asked is not None and "@" not in asked:  # a bare name: say which version it meant
        err_console.print(f"{asked} resolves to {ref}, its newest verified version", highlight=False)
    for reason in outcome.skipped:  # a rollback past damaged or removed releases says which
        err_console.print(f"[yellow]skipped:[/] {escape(reason)}", highlight=False)
    if not outcome.changed:
        err_console.print(f"deployment {outcome.deployment} already serves {ref}", highlight=False)
        return
    how = " (server hot-swapped)" if outcome.event is not None and outcome.event.hot_swap else ""
    err_console.print(
        f"{outcome.action}: deployment {outcome.deployment} now serves [bold]{ref}[/]{how}", highlight=False
    )


def release(
    model: str = typer.Argument(
        ..., help="MODEL@VERSION from the store (must be verified); a bare MODEL means its newest verified version."
    ),
    deployment: str = DEPLOYMENT_OPTION,
    store: str | None = STORE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Make a verified version the deployment's current one (hot-swapping its running server)."""
    with cli_errors():
        from dlm.cli.store.releases import release as run_release

        _report(run_release(open_store(store), model, deployment), json_out, model)


def rollback(
    to: str | None = typer.Option(
        None,
        "--to",
        help="VERSION (of the current model) or MODEL@VERSION.",
        show_default="the previous good release",
    ),
    deployment: str = DEPLOYMENT_OPTION,
    store: str | None = STORE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Return the deployment to its previous good release (or to --to)."""
    with cli_errors():
        from dlm.cli.store.releases import rollback as run_rollback

        _report(run_rollback(open_store(store), deployment, to), json_out)
