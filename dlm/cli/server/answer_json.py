"""A large answer's JSON, encoded in pieces so the event loop keeps running beside it.

A non-streamed answer with logprobs is tens of MB of JSON (n 15 x 1024 tokens x 20
alternatives: 24 MB). Encoded in one `json.dumps` call, the C encoder holds the GIL from start
to end, half a second, and every route waits, `/health` included, though the answer is
built on a worker thread. Here the answer's outer levels are walked in Python and every list
at `DEPTH` is encoded a slice of `SLICE` entries at a time: between two calls the interpreter
hands the GIL over at its switch interval (5 ms), so the event loop waits milliseconds. The
bytes are those of Starlette's `JSONResponse` (tests/test_serve_answer_json.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import Response

# The levels walked: the answer, its choices, a choice, its logprobs; lists below are sliced.
DEPTH = 4
SLICE = 64  # entries per call: a chat token's logprobs with 20 alternatives is ~1.3 KB


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _pieces(value: Any, depth: int) -> Iterator[str]:
    if isinstance(value, dict) and depth < DEPTH:
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + _dumps(key) + ":"
            yield from _pieces(item, depth + 1)
        yield "}"
    elif isinstance(value, list) and depth < DEPTH and value and isinstance(value[0], dict | list):
        yield "["  # the choices: each walked
        for i, item in enumerate(value):
            yield "," if i else ""
            yield from _pieces(item, depth + 1)
        yield "]"
    elif isinstance(value, list) and len(value) > SLICE:
        yield "["
        for start in range(0, len(value), SLICE):
            yield ("," if start else "") + _dumps(value[start : start + SLICE])[1:-1]
        yield "]"
    else:
        yield _dumps(value)


def json_response(content: Any, headers: dict[str, str] | None = None) -> Response:
    """`JSONResponse(content, headers=headers)`, encoded as above (call it off the event loop)."""
    # each piece to bytes on its own: one str of 24 MB (UCS-4 where one character needs it) took
    # 70 ms to join and encode, in calls that hold the GIL throughout
    body = b"".join(piece.encode("utf-8") for piece in _pieces(content, 0))
    return Response(body, media_type="application/json", headers=headers)
