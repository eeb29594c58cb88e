"""The `dlm` console script (and `python -m dlm`): what runs before the command line is read.

Loading the commands (typer, rich, the engine's modules) takes a noticeable moment; a Ctrl-C
then raised KeyboardInterrupt out of the imports, a traceback and death by the signal, where
the contract promises `error: interrupted` and exit 130 (docs/cli.md). So the imports happen
here, under the same rule `dlm.cli.main.main` applies once it runs, with SIGINT handled as
`dlm.cli.interrupts` says from the first moment."""

from __future__ import annotations

from dlm.cli import interrupts


def main() -> None:
    try:
        interrupts.install()
        from dlm.cli.main import main as run

        run()
    except KeyboardInterrupt:
        interrupts.interrupted()
