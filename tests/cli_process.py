"""`dlm` as a separate process, for tests that check what a real command line does (exit
code, stdout, stderr, which modules it loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def dlm(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m dlm ARGS` from the checkout, with `env` over this process's environment;
    `timeout` only guards against a hang."""
    return subprocess.run(
        [sys.executable, "-m", "dlm", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
