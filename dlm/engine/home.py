"""Where dlm keeps its files: `DLM_HOME`, else the user's cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def dlm_home() -> Path:
    env = os.environ.get("DLM_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dlm"
