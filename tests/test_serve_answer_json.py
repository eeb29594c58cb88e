"""A large answer's JSON encoded in pieces (dlm/cli/server/answer_json.py): the bytes Starlette's
`JSONResponse` writes, produced by calls that each encode a small part of it, so the GIL
changes hands between them (a 24 MB logprobs answer held `/health` 0.5-1.1 s in one call)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.responses import JSONResponse

from dlm.cli.server import answer_json


def _token(i: int) -> dict[str, Any]:
    alternatives = [{"token": f"t{i}.{j}", "logprob": -j / 3, "bytes": [116, 49]} for j in range(20)]
    return {"token": "é中😀" if i % 7 == 0 else f"w{i}", "logprob": -1.5, "bytes": [1, 2], "top_logprobs": alternatives}


def _chat_answer(n: int, tokens: int) -> dict[str, Any]:
    choices = [
        {
            "index": k,
            "logprobs": {"content": [_token(i) for i in range(tokens)], "refusal": None},
            "message": {"role": "assistant", "content": "é" * tokens},
            "finish_reason": "length",
            "token_ids": list(range(tokens)),
        }
        for k in range(n)
    ]
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": choices, "usage": {"total_tokens": 3}}


def _completion_answer(tokens: int) -> dict[str, Any]:
    logprobs = {
        "tokens": [f"w{i}" for i in range(tokens)],
        "token_logprobs": [-0.5] * tokens,
        "top_logprobs": [{f"w{i}": -0.5, "x": -2.0} for i in range(tokens)],
        "text_offset": list(range(tokens)),
    }
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": "x", "logprobs": logprobs}], "usage": {}}


S = answer_json.SLICE
BODIES = {
    "chat, 3 x 300 tokens": _chat_answer(3, 300),
    "chat, slice-sized lists": _chat_answer(2, S),
    "chat, one past a slice": _chat_answer(1, S + 1),
    "completion, 200 tokens": _completion_answer(200),
    "empty lists and scalars": {"a": [], "b": {}, "c": [[]], "d": None, "e": 1.5, "f": "\u2028", "g": [{}]},
    "a bare list": [1, 2, 3],
}


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_the_bytes_are_json_responses(body: Any) -> None:
    response = answer_json.json_response(body, headers={"X-Request-Id": "r"})
    assert response.body == JSONResponse(body).body
    assert response.media_type == "application/json" and response.headers["x-request-id"] == "r"


def test_no_call_encodes_more_than_a_slice_of_a_long_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The longest single encoding of an answer of 4 x 1000 tokens is a small part of it: every
    token list is cut into slices, every choice encoded on its own."""
    sizes: list[int] = []
    dumps = answer_json._dumps

    def recording(value: Any) -> str:
        text = dumps(value)
        sizes.append(len(text))
        return text

    monkeypatch.setattr(answer_json, "_dumps", recording)
    body = answer_json.json_response(_chat_answer(4, 1000)).body
    one_token = max(len(answer_json._dumps(_token(i))) + 1 for i in range(1000))  # with its comma
    assert max(sizes) <= S * one_token
    assert max(sizes) < len(body) / 50


def test_nan_is_refused_as_json_response_does() -> None:
    with pytest.raises(ValueError):
        answer_json.json_response({"choices": [{"logprob": float("nan")}]})
