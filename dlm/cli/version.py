"""dlm's version: the installed distribution's (pyproject.toml is its one source)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version


def dlm_version() -> str:
    try:
        return package_version("dlm")
    except PackageNotFoundError:  # a checkout on sys.path without an install
        return "unknown (not installed)"
