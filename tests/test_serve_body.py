"""The request-body parser's explicit limits: every malformed body is a 400 naming its code
(and its field where there is one), never an exception the server would answer with 500."""

from __future__ import annotations

import asyncio
import json

import pytest

from dlm.cli.jsonl import NotJSON, json_object
from dlm.cli.server.body import MAX_DEPTH, MAX_NUMBER_CHARS, parse_json
from dlm.cli.server.errors import APIError


def nested(depth: int) -> bytes:
    return b'{"prompt": "x", "deep": ' + b"[" * depth + b"]" * depth + b"}"


def tool_nested(depth: int) -> bytes:
    """A chat body whose tool's parameters schema nests `depth` objects (written as text:
    json.dumps itself recurses)."""
    node = '{"type": "string"}'
    for _ in range(depth):
        node = '{"type": "object", "properties": {"a": ' + node + "}}"
    tool = '{"type": "function", "function": {"name": "f", "parameters": ' + node + "}}"
    return ('{"messages": [{"role": "user", "content": "hi"}], "tools": [' + tool + "]}").encode()


@pytest.mark.parametrize(
    "raw, code, param",
    [
        (nested(100_000), "invalid_json", None),  # past the recursion limit of json itself
        (nested(MAX_DEPTH), "invalid_json", None),
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json", None),  # int() refuses 4,300+
        (b'{"prompt": [' + b"7" * (MAX_NUMBER_CHARS + 1) + b"]}", "invalid_json", None),
        (b'{"prompt": "x", "temperature": 0.' + b"5" * 200 + b"}", "invalid_json", None),
        (b'{"prompt": "x", "temperature": 1e999}', "invalid_json", None),
        (b'{"prompt": "x", "temperature": NaN}', "invalid_json", None),
        (b'{"prompt": "x", "temperature": -Infinity}', "invalid_json", None),
        (b'{"prompt": "a\\ud800b"}', "invalid_value", "prompt"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "invalid_value", "messages.0.content"),
        (b'{"prompt": "x", "\\ud83d": 1}', "invalid_value", None),
        (tool_nested(500), "invalid_json", None),
        (b'{"prompt": "\xff"}', "invalid_json", None),
        ('{"prompt": "x"}'.encode("utf-16"), "invalid_json", None),  # JSON is UTF-8: no other encoding
        ('{"prompt": "x"}'.encode("utf-16-le"), "invalid_json", None),
        ('{"prompt": "x"}'.encode("utf-32"), "invalid_json", None),
        (b'{"prompt": "x", ', "invalid_json", None),
        (b'{"prompt": "x", "max_tokens": 4, "max_tokens": 8}', "invalid_json", None),  # never the last one wins
        (b'{"messages": [{"role": "user", "content": "a", "content": "b"}]}', "invalid_json", None),
        (b'{"prompt": "x", "deep": [[{"k": 1, "k": 1}]]}', "invalid_json", None),  # at any depth
        (b"[1, 2]", "invalid_json", None),
        (b"", "invalid_json", None),
    ],
    ids=lambda v: None if isinstance(v, (bytes, type(None))) else str(v),
)
def test_malformed_bodies_are_400s(raw: bytes, code: str, param: str | None) -> None:
    with pytest.raises(APIError) as caught:
        parse_json(raw)
    assert caught.value.status == 400 and caught.value.code == code
    assert caught.value.param == param


def test_a_key_twice_is_refused_by_name() -> None:
    with pytest.raises(APIError) as caught:
        parse_json(b'{"prompt": "x", "max_tokens": 4, "max_tokens": 8}')
    assert "'max_tokens'" in caught.value.message
    assert parse_json(b'{"a": {"k": 1}, "b": {"k": 2}}') == {"a": {"k": 1}, "b": {"k": 2}}  # once per object


def test_bodies_within_the_limits_parse() -> None:
    body = {
        "prompt": "emoji \U0001f600 and a surrogate pair escaped",
        "seed": 2**63 - 1,
        "temperature": 0.7,
        "deep": json.loads(nested(MAX_DEPTH - 2)[len(b'{"prompt": "x", "deep": ') : -1]),
    }
    raw = json.dumps(body).encode()  # ensure_ascii: the emoji travels as a \\ud83d\\ude00 pair
    assert parse_json(raw) == body
    assert parse_json(b"\xef\xbb\xbf" + raw) == body  # a UTF-8 byte order mark is ignored (RFC 8259 allows it)


def test_jsonl_refuses_a_key_twice_as_the_server_does() -> None:
    """`dlm batch` reads its lines with the server's strictness (dlm/cli/jsonl.py): a line a
    server would refuse is refused before anything runs."""
    with pytest.raises(NotJSON, match="'max_tokens' appears twice"):
        json_object('{"body": {"max_tokens": 4, "max_tokens": 8}}')


def test_a_cancellation_that_comes_as_the_body_arrives_is_not_swallowed() -> None:
    """The request's task cancelled (its client left, the server stops) in the step the last
    chunk of its body arrives: `asyncio.wait_for` (Python 3.10, 3.11) returned the body and
    the handler went on to decode for nobody; the cancellation must reach the caller."""
    from starlette.requests import Request

    from dlm.cli.server.body import read_body

    async def scenario() -> None:
        reader: asyncio.Task[bytes] | None = None

        async def receive() -> dict[str, object]:
            assert reader is not None
            reader.cancel()  # in the same step as the body completes
            return {"type": "http.request", "body": b"{}", "more_body": False}

        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        reader = asyncio.ensure_future(read_body(request, 1024, 10.0))
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(scenario())
