"""SIGHUP in the moment before `dlm serve` can answer it.

`dlm serve` reads its settings again on SIGHUP (docs/serve.md, "Changing settings without a
restart"), with a handler its event loop installs once it starts (dlm/cli/server/run.py): after
the commands' modules import and the settings are read, about half a second into the process.
SIGHUP's default action ends a process, so a config manager that wrote the file and signalled
as the server started killed it. From the first moment of `dlm serve` (`dlm.cli.entry`) a
SIGHUP is only recorded here, and the server reads its settings again once it can (`take`).
Other commands keep the default: a hang-up ends them, as it ends any terminal program."""

from __future__ import annotations

import signal
from types import FrameType

_asked = False


def hold() -> None:
    """Record SIGHUP instead of dying of it, until the server's own handler replaces this."""
    signal.signal(signal.SIGHUP, _record)


def _record(signum: int, frame: FrameType | None) -> None:
    global _asked
    _asked = True


def take() -> bool:
    """Whether a SIGHUP came while held (and forget it: it is answered once)."""
    global _asked
    asked, _asked = _asked, False
    return asked
