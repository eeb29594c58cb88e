"""The `dlm` console script (and `python -m dlm`): what runs before the command line is read.

Loading the commands (typer, rich, the engine's modules) takes a noticeable moment; a Ctrl-C
then raised KeyboardInterrupt out of the imports, a traceback and death by the signal, where
the contract promises `error: interrupted` and exit 130 (docs/cli.md). So the imports happen
here, under the same rule `dlm.cli.main.main` applies once it runs, with SIGINT handled as
`dlm.cli.interrupts` says from the first moment, and for `dlm serve` SIGHUP as
`dlm.cli.hangup` says."""

from __future__ import annotations

import sys

from dlm.cli import hangup, interrupts


def main() -> None:
    try:
        interrupts.install()
        if sys.argv[1:2] == ["serve"]:  # a reload asked before the server can read its settings
            hangup.hold()
        from dlm.cli.main import main as run

        run()
    except KeyboardInterrupt:
        interrupts.interrupted()
