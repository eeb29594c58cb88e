"""Where dlm keeps its files: `DLM_HOME`, else the user's cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from dlm.engine.errors import UsageError


def dlm_home() -> Path:
    """`DLM_HOME`, else `$XDG_CACHE_HOME/dlm` (`~/.cache/dlm`). An empty DLM_HOME is unset; a
    blank one is refused (UsageError naming it), as a blank DLM_STORE is: it read as a
    directory named by spaces under the current directory, which every command filled."""
    env = os.environ.get("DLM_HOME")
    if env and not env.strip():
        raise UsageError(f"DLM_HOME must name a directory, got a blank value {env!r}")
    if env:
        return expand_user(env, "DLM_HOME")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "dlm"
    try:
        return Path.home() / ".cache" / "dlm"
    except RuntimeError:  # no HOME, and no password entry for this uid (a container's arbitrary uid)
        raise UsageError("no home directory to keep dlm's files in (~/.cache/dlm): set DLM_HOME") from None


def expand_user(path: str | Path, source: str) -> Path:
    """`path` with a leading `~` or `~USER` expanded, as every path the user gives is: where
    it names no home directory (no such user; no HOME and no password entry for this one, as
    in a container run under an arbitrary uid), a UsageError naming where it came from
    (`source`), not the RuntimeError `Path.expanduser` raises (a traceback from every command
    given `~nouser/x`)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise UsageError(
            f"{source} {str(path)!r}: its '~' names no home directory here (no such user, or no HOME)"
        ) from None
