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
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dlm"
