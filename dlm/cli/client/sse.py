"""A strict reader of OpenAI-style server-sent events.

OpenAI streams are SSE events of one `data: <json>` line each, separated by blank lines,
ending with `data: [DONE]`. A lenient reader would hide a server that sends NDJSON, forgets
the blank lines or never says `[DONE]`; clients in the wild break on exactly those, so every
deviation from the framing is reported as an `SSEError` naming what was wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from dlm.cli.jsonl import json_object

DONE = "[DONE]"
LINE_END = re.compile(r"\r\n|\r|\n")  # the only line ends SSE knows


class SSEError(ValueError):
    """The byte stream is not well-formed OpenAI SSE."""


def sse_lines(chunks: Iterable[str]) -> Iterator[str]:
    """The stream's lines, split where SSE splits them: at CRLF, LF or CR, nowhere else.

    Not `httpx.Response.iter_lines` (Python's `splitlines`): that also splits at U+2028,
    U+2029, U+0085 and other separators that a server writing JSON with `ensure_ascii=False`
    sends raw inside generated text, and would cut an event's data line in two.
    """
    pending = ""
    for chunk in chunks:
        pending += chunk
        held = pending.endswith("\r")  # a CR at the end: its LF may open the next chunk
        *lines, pending = LINE_END.split(pending[:-1] if held else pending)
        yield from lines
        pending += "\r" if held else ""
    if pending:
        yield pending.removesuffix("\r")


def iter_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Yield each event's JSON payload; stop after `[DONE]`, which must end the stream.

    `lines` are the stream's lines without their terminators (`sse_lines` of its text).
    Comment lines (`: keep-alive`) and the `event`, `id` and `retry` fields are allowed
    by the SSE specification and ignored.
    """
    data: list[str] = []
    done = False
    for number, line in enumerate(lines, start=1):
        if line == "":
            if not data:
                continue
            payload = "\n".join(data)
            data = []
            if done:
                raise SSEError(f"event after data: [DONE] (line {number})")
            if payload == DONE:
                done = True
                continue
            try:
                event = json_object(payload)
            except ValueError as exc:
                raise SSEError(f"event data is {exc} (line {number}): {payload[:80]!r}") from None
            yield event
            continue
        if line.startswith(":"):
            continue
        field, sep, value = line.partition(":")
        if not sep or field not in ("data", "event", "id", "retry"):
            raise SSEError(f"line {number} is not an SSE field: {line[:80]!r}")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        raise SSEError("stream ended inside an event (no blank line after the last data line)")
    if not done:
        raise SSEError("stream ended without data: [DONE]")
