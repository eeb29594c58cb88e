"""Reading a JSONL file of requests: one JSON object per non-empty line, errors naming the line.

`dlm loadtest --prompts` and `dlm batch` read such files; both refuse a bad file whole,
before any request runs, with a usage error that says `FILE:LINE: what is wrong`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.errors import UsageError


def read_objects(path: Path, what: str = "requests") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-empty line; a file without any is an error."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}") from None
    found = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise UsageError(f"{path}:{number}: not JSON") from None
        if not isinstance(item, dict):
            raise UsageError(f"{path}:{number}: a line must be a JSON object")
        found = True
        yield number, item
    if not found:
        raise UsageError(f"{path} holds no {what}")
