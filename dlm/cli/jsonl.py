"""Reading JSONL: one JSON object per non-empty line, errors naming the line.

`dlm loadtest --prompts` and `dlm batch` read such files; both refuse a bad file whole,
before any request runs, with a usage error that says `FILE:LINE: what is wrong`. `dlm
batch` reads its own output back with `lines` to resume. The SSE reader
(dlm/cli/client/sse.py) checks each event's data with the same `json_object`.

Lines end at "\\n" and nowhere else. `str.splitlines` also breaks at U+2028, U+2029, U+0085
and other separators that JSON allows raw inside a string, so it would cut a valid line
in two (and a resumed `dlm batch` would misread its own output).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlm.engine.errors import UsageError

JSON_WHITESPACE = " \t\r\n"  # what JSON allows around a value; a "\r\n" file reads as well


def lines(text: str) -> list[str]:
    """`text`'s lines, split at "\\n" only, without their terminators; text after the last
    "\\n" is a last line of its own."""
    parts = text.split("\n")
    return parts[:-1] if parts[-1] == "" else parts


class NotJSON(ValueError):
    """Raised from inside `json.loads` hooks: a literal JSON does not have."""


def no_constant(name: str) -> Any:
    """`json.loads`'s `parse_constant`: NaN, Infinity and -Infinity are not JSON."""
    raise NotJSON(f"{name} is not JSON")


def finite_float(text: str) -> float:
    """`json.loads`'s `parse_float`: a number too large for a float (1e999) is not inf."""
    value = float(text)
    if not math.isfinite(value):
        raise NotJSON(f"{text} is out of range for a JSON number")
    return value


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`'s `object_pairs_hook`: an object that names a key twice is not taken.
    Python's `json` keeps the last value, another parser (a proxy's, a gateway's) may keep
    the first, so the two would read different requests from the same text."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise NotJSON(f"the key {key!r} appears twice in one JSON object")
        data[key] = value
    return data


def json_object(text: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; ValueError saying what it is not ("not JSON", "not a
    JSON object", too deep), for the caller to place (a file's line, a stream's event).

    Strict JSON, as `dlm serve` reads a body (dlm/cli/server/body.py, through the same hooks):
    Python's `json` also reads `NaN`, `Infinity` and `-Infinity`, and a number like 1e999 as
    inf, none of which JSON has or any request can carry on (`dlm batch` would send its body
    on and fail on it), and an object with a key twice (the last value kept), so each is
    refused as not JSON."""
    try:
        item = json.loads(text, parse_constant=no_constant, parse_float=finite_float, object_pairs_hook=unique_keys)
    except json.JSONDecodeError:  # a NotJSON from a hook goes on as it is
        raise ValueError("not JSON") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise ValueError("JSON nested too deeply to read") from None
    if not isinstance(item, dict):
        raise ValueError("not a JSON object")
    return item


class LineError(ValueError):
    """A JSONL line that is not a JSON object: its number and what it is instead."""

    def __init__(self, number: int, problem: str) -> None:
        super().__init__(f"line {number}: {problem}")
        self.number, self.problem = number, problem


def objects(text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of JSONL `text`; LineError at the
    first line that is not a JSON object."""
    for number, line in enumerate(lines(text), start=1):
        if not line.strip(JSON_WHITESPACE):
            continue
        try:
            yield number, json_object(line)
        except ValueError as exc:
            raise LineError(number, str(exc)) from None


def read_objects(path: Path, what: str = "requests") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-empty line; a file without any is an error. A
    UTF-8 byte order mark opening the file (Windows editors write one) is skipped: it was
    line 1's "not JSON"."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}") from None
    found = False
    try:
        for number, item in objects(text):
            found = True
            yield number, item
    except LineError as exc:
        raise UsageError(f"{path}:{exc.number}: {exc.problem}") from None
    if not found:
        raise UsageError(f"{path} holds no {what}")
