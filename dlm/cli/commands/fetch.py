"""`dlm fetch`: bring a checkpoint from the hub or a local mirror into the store."""

from __future__ import annotations

import typer
from rich.markup import escape

from dlm.cli.output import cli_errors, emit_json, err_console
from dlm.cli.store_ui import (
    JSON_OPTION,
    STORE_OPTION,
    WORKERS_OPTION,
    ByteBar,
    check_workers,
    counted,
    human_size,
    open_store,
    render_findings,
)


def fetch(
    source: str = typer.Argument(..., help="Hub repo id (org/name) or a local directory / mounted mirror path."),
    revision: str | None = typer.Option(
        None, "--revision", help="Hub branch, tag or commit; resolved to a commit.", show_default="main"
    ),
    include: list[str] | None = typer.Option(
        None, "--include", help="Only files matching this glob (repeatable).", show_default="every file"
    ),
    exclude: list[str] | None = typer.Option(
        None, "--exclude", help="Skip files matching this glob (repeatable).", show_default="none"
    ),
    name: str | None = typer.Option(
        None, "--name", help="Name in the store.", show_default="the repo or directory name"
    ),
    link: bool = typer.Option(False, "--link", help="Hard-link local files instead of copying them (same filesystem)."),
    follow_symlinks: bool = typer.Option(
        False,
        "--follow-symlinks",
        help="Copy what symbolic links pointing outside the source directory point to (refused otherwise).",
    ),
    workers: int | None = WORKERS_OPTION,
    store: str | None = STORE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Fetch SOURCE into the versioned store; hashes every file and checks the checkpoint.

    Hub sources honour HF_TOKEN and HF_ENDPOINT (an internal mirror) and resume after an
    interruption. Fetching the same revision or content again transfers nothing.
    """
    with cli_errors():
        from dlm.cli.store.fetch import fetch as run_fetch
        from dlm.engine.errors import DlmError

        result = run_fetch(
            source,
            open_store(store),
            name=name,
            revision=revision,
            include=include or (),
            exclude=exclude or (),
            link=link,
            follow_symlinks=follow_symlinks,
            progress=ByteBar(),
            workers=check_workers(workers),
        )
        m = result.manifest
        if json_out:
            emit_json(result.to_json())
        if result.report is not None:
            render_findings(result.report)
        verb = "already in the store:" if result.already_present else "fetched"
        err_console.print(
            f"{verb} [bold]{m.name}@{m.version}[/] ({len(m.files)} files, {human_size(m.total_size)}, "
            f"{m.state}) -> {escape(str(result.path))}",
            highlight=False,
            soft_wrap=True,
        )
        if not m.verified:
            problems = len(m.verification.failures) if m.verification else 0
            raise DlmError(
                f"{m.name}@{m.version} is stored but failed verification ({counted(problems, 'problem')}); "
                "fix the source and fetch it again to replace it"
            )
