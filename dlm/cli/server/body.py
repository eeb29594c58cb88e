"""Request bodies: read with a byte cap and a deadline, parse as JSON with explicit limits.

Python's `json` accepts what the rest of the server cannot handle: nesting deep enough to
exhaust the recursion limit (in the parser, in pydantic or in a chat template), integers
past `int()`'s 4,300-digit limit, `NaN`, and lone UTF-16 surrogates (`"\\ud800"`), which no
tokenizer or log line can encode; and an object with a key twice, keeping the last value
(dlm/cli/jsonl.py's `unique_keys` says why that is refused). Each is refused here with a 400
naming what and where, so every malformed body is a counted client error and never a 500.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from dlm.cli.jsonl import NotJSON, finite_float, no_constant, unique_keys
from dlm.cli.server.errors import CLIENT_CLOSED, APIError, bad_request
from dlm.engine.runtime.within import within

MAX_DEPTH = 64  # nested objects/arrays; a JSON schema of a tool stays far below
MAX_NUMBER_CHARS = 100  # characters of one number literal; a 64-bit seed has 20


class _Refused(ValueError):
    """Raised from inside `json.loads` hooks; carries the 400 to answer."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """At most `limit` bytes (else 413), within `timeout` seconds (else 408); a client that
    leaves mid-body is a 499 (logged, nothing sent). A compressed body (`Content-Encoding:
    gzip`, ...) is a 415 naming the coding, before any byte is read: it was parsed as it
    came and refused as text that is not UTF-8, which said nothing of the cause."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):
        raise APIError(
            415,
            f"Content-Encoding {coding!r} is not supported: send the body uncompressed",
            code="unsupported_content_encoding",
            headers={"Accept-Encoding": "identity"},
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    raw = bytearray()

    async def receive() -> None:
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > limit:
                raise _too_large(limit)

    reading = await within(receive(), timeout)  # not asyncio.wait_for (dlm/engine/runtime/within.py)
    if reading is None:
        raise APIError(408, f"the request body did not arrive within {timeout:g}s", code="body_timeout")
    try:
        reading.result()
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED, "the client closed the connection mid-body", code="client_closed") from None
    return bytes(raw)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, within the limits above; a 400 `invalid_json` (malformed, a
    key twice in one object, or over a limit) or `invalid_value` (a lone surrogate, naming the
    field) otherwise."""
    try:
        # UTF-8 only (RFC 8259), a leading byte order mark ignored as it allows: given bytes,
        # `json.loads` guessed UTF-16 and UTF-32 as well, and took bodies in them.
        text = raw.decode("utf-8").removeprefix("\ufeff")
        data: Any = json.loads(
            text, parse_int=_int, parse_float=_float, parse_constant=_constant, object_pairs_hook=_object
        )
    except _Refused as exc:
        raise exc.error from None
    except RecursionError:
        raise _too_deep() from None
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not UTF-8 text: {exc}", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    _check_tree(data)
    return data


def _check_tree(data: dict[str, Any]) -> None:
    """Depth and strings of the parsed body, without recursion (the input is untrusted)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                stack.append((item, depth + 1, f"{path}.{key}" if path else key))
        else:
            stack.extend((item, depth + 1, f"{path}.{i}") for i, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{path or 'body'}: a lone UTF-16 surrogate is not text", param=path or None, code="invalid_value"
        ) from None


def _number(text: str) -> None:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(bad_request(f"a number in the body exceeds {MAX_NUMBER_CHARS} characters", code="invalid_json"))


def _int(text: str) -> int:
    _number(text)
    return int(text)


def _float(text: str) -> float:
    _number(text)
    try:
        return finite_float(text)
    except NotJSON as exc:
        raise _Refused(bad_request(str(exc), code="invalid_json")) from None


def _constant(name: str) -> Any:
    try:
        return no_constant(name)
    except NotJSON as exc:
        raise _Refused(bad_request(str(exc), code="invalid_json")) from None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    try:
        return unique_keys(pairs)
    except NotJSON as exc:
        raise _Refused(bad_request(str(exc), code="invalid_json")) from None


def _too_deep() -> APIError:
    return bad_request(f"the body is nested deeper than {MAX_DEPTH} levels", code="invalid_json")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
