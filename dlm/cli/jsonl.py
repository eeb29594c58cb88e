"""Reading a JSONL file of requests: one JSON object per non-empty line, errors naming the line.

`dlm loadtest --prompts` and `dlm batch` read such files; both refuse a bad file whole,
before any request runs, with a usage error that says `FILE:LINE: what is wrong`. The SSE
reader (dlm/cli/client/sse.py) checks each event's data with the same `json_object`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlm.engine.errors import UsageError


def json_object(text: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; ValueError saying what it is not ("not JSON", "not a
    JSON object"), for the caller to place (a file's line, a stream's event)."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError("not JSON") from None
    if not isinstance(item, dict):
        raise ValueError("not a JSON object")
    return item


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
            item = json_object(line)
        except ValueError as exc:
            raise UsageError(f"{path}:{number}: {exc}") from None
        found = True
        yield number, item
    if not found:
        raise UsageError(f"{path} holds no {what}")
