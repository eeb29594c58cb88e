"""Entry point of the `dlm` command: registers one module per subcommand."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import typer
import typer.main
from rich.markup import escape

from dlm.cli import interrupts
from dlm.cli.commands import (
    batch,
    deploy,
    doctor,
    estimate,
    fetch,
    generate,
    loadtest,
    models,
    release,
    serve,
    validate,
    verify,
)
from dlm.cli.output import reader_gone
from dlm.cli.version import dlm_version

app = typer.Typer(
    name="dlm",
    help="Diffusion language models: fetch, verify, estimate, generate, serve, validate, load-test.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dlm {dlm_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print dlm's version and exit."
    ),
) -> None:
    """dlm: serve diffusion language models in production. Every command takes --json."""


# name -> function: one line per subcommand, in the order `dlm --help` lists them
COMMANDS: dict[str, Callable[..., Any]] = {
    "generate": generate.generate,
    "fetch": fetch.fetch,
    "verify": verify.verify,
    "models": models.models,
    "rm": models.rm,
    "release": release.release,
    "rollback": release.rollback,
    "estimate": estimate.estimate,
    "serve": serve.serve,
    "validate": validate.validate,
    "loadtest": loadtest.loadtest,
    "doctor": doctor.doctor,
    "batch": batch.batch,
}
for command_name, function in COMMANDS.items():
    app.command(command_name)(function)
app.add_typer(deploy.app, name="deploy")


def _tidy_help(command: Any) -> None:
    """Help is plain text: what it says in brackets (`[NAME-api-keys]`, a glob) is shown, not
    read as rich markup and dropped. An on/off flag takes no value: its help line shows no
    `<bool>` type label (Typer's rich help labels every option with its type; a metavar of ""
    leaves the column empty)."""
    if command.help:
        command.help = escape(command.help)
    for param in command.params:
        if getattr(param, "help", None):
            param.help = escape(param.help)
        if getattr(param, "is_flag", False):
            param.metavar = ""
    help_option = command.get_help_option  # click makes --help afresh for each context

    def unlabelled_help(ctx: Any) -> Any:
        option = help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = unlabelled_help
    for sub in getattr(command, "commands", {}).values():
        _tidy_help(sub)


def command() -> Any:
    """The `dlm` command as click runs it: the Typer app, its help tidied."""
    cli = typer.main.get_command(app)
    _tidy_help(cli)
    return cli


# Columns of help written to a pipe or a file: the widest option names (`--gpu-memory-utilization`,
# `--no-trust-remote-code`) and doc paths fit whole from 140 on.
PIPED_HELP_WIDTH = 160


def piped_help_width() -> None:
    """Help piped to grep or a file is drawn at rich's default 80 columns when no terminal
    gives a width, and rich then cuts long option names (`--tensor-parallel-…`), so
    `dlm serve --help | grep -- --keep-alive-timeout` found nothing. Give it room unless
    the user set a width (TERMINAL_WIDTH, COLUMNS) or a terminal has one."""
    import os

    import typer.rich_utils

    if typer.rich_utils.MAX_WIDTH is None and "COLUMNS" not in os.environ and not sys.stdout.isatty():
        typer.rich_utils.MAX_WIDTH = PIPED_HELP_WIDTH


def main() -> None:
    """The `dlm` entry point: the Typer app as one click command, its help tidied, and a
    command line click refuses (an unknown flag, a missing argument) reported like every
    other usage error: one `error:` line, exit 2, not a boxed panel."""
    piped_help_width()
    try:
        result = command().main(standalone_mode=False)
    except Exception as exc:
        # Typer vendors click, so its UsageError class is not importable by a stable name:
        # recognise it by what every click usage error has.
        if getattr(exc, "exit_code", None) == 2 and hasattr(exc, "format_message"):
            message = exc.format_message()  # empty for a bare `dlm`: its help was shown
            if message:
                sys.stderr.write(f"error: {message}\n")
            sys.exit(2)
        if type(exc).__name__ == "Abort":  # Ctrl-C (click turns KeyboardInterrupt into Abort)
            interrupts.interrupted()
        if reader_gone(exc):  # outside a command's cli_errors: `dlm --version | (exec 0<&-)`
            interrupts.end(1)
        raise
    interrupts.end(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
