"""The value of a command's path argument or option, refused when empty.

Typer reads a path as `Path(text)`, and `Path("")` is `.`, the current directory: `dlm
validate URL --suite ""` said "cannot read suite .: Is a directory", `dlm deploy kubernetes
--out ""` wrote into the current directory. An empty path is an unset variable
(`--config "$SETTINGS"`), so every path parameter takes `parser=path_value`.
"""

from __future__ import annotations

from pathlib import Path

import typer


def path_value(text: str) -> Path:
    if not text.strip():
        raise typer.BadParameter("is empty: give a path")
    return Path(text)
