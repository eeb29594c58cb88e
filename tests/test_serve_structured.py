"""The server's structured output and canvas streaming, in process (the app over a tiny
random LLaDA, driven through Starlette's test client, which the OpenAI SDK also takes as
its HTTP client): schema-shaped answers, refusals naming the keyword, canvas events for
clients that opt in, and no change for those that do not."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

KEY = "sk-structured-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
CHAT = {"messages": [{"role": "user", "content": "Describe someone."}], "max_tokens": 64, "steps": 32}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from dlm.cli.server.app import create_app
    from dlm.cli.server.config import load_config

    app = create_app(load_config(None, {"model": "tiny:llada", "api_keys": [KEY], "warmup": False}, environ={}))
    with TestClient(app) as test_client:
        end = time.monotonic() + 300
        while test_client.get("/ready").status_code != 200:
            assert time.monotonic() < end, test_client.get("/health").json()
            time.sleep(0.1)
        yield test_client


def _events(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_and_completions_answer_in_the_schema(client: TestClient) -> None:
    chat = client.post("/v1/chat/completions", json={**CHAT, "response_format": FORMAT}, headers=AUTH)
    assert chat.status_code == 200, chat.text
    jsonschema.validate(json.loads(chat.json()["choices"][0]["message"]["content"]), SCHEMA)
    body = {"prompt": "JSON:", "max_tokens": 128, "response_format": {"type": "json_object"}, "temperature": 0.7}
    completion = client.post("/v1/completions", json=body, headers=AUTH)
    assert completion.status_code == 200, completion.text
    assert isinstance(json.loads(completion.json()["choices"][0]["text"]), dict)
    plain = client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}}, headers=AUTH)
    assert plain.status_code == 200


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "a+"}}},
            "pattern",
        ),
        ({"type": "yaml"}, "type must be"),
    ],
)
def test_unenforceable_schemas_are_a_400_naming_the_keyword(
    client: TestClient, response_format: dict[str, Any], needle: str
) -> None:
    refused = client.post("/v1/chat/completions", json={**CHAT, "response_format": response_format}, headers=AUTH)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "response_format" and needle in error["message"]


def test_a_skeleton_beyond_max_tokens_names_max_tokens(client: TestClient) -> None:
    big = {"type": "array", "items": {"type": "string", "minLength": 20}, "minItems": 6}
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": big}}
    refused = client.post("/v1/chat/completions", json={**CHAT, "response_format": fmt}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_canvas_events_show_provisional_tokens_becoming_committed(client: TestClient) -> None:
    answer = client.post("/v1/chat/completions", json=CHAT, headers=AUTH).json()["choices"][0]["message"]["content"]
    events = _events(client, {**CHAT, "stream_options": {"include_canvas": True}})
    canvases = [e for e in events if e["object"] == "chat.completion.canvas"]
    chunks = [e for e in events if e["object"] == "chat.completion.chunk"]
    steps = [c["canvas"]["step"] for c in canvases]
    assert steps == sorted(set(steps)) and len(steps) >= 2  # at most one per denoising step
    seen_provisional: set[int] = set()
    became_committed = False
    for canvas in canvases:
        for i, token in enumerate(canvas["canvas"]["tokens"]):
            assert token["state"] in ("committed", "provisional", "masked")
            assert (token["id"] is None) == (token["state"] == "masked")
            if token["state"] == "provisional":
                seen_provisional.add(i)
            elif token["state"] == "committed" and i in seen_provisional:
                became_committed = True
    assert seen_provisional and became_committed
    assert all(t["state"] == "committed" for t in canvases[-1]["canvas"]["tokens"])
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == answer  # the committed-prefix deltas are unchanged beside the canvas


def test_clients_that_do_not_opt_in_see_no_change(client: TestClient) -> None:
    sdk = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=KEY, http_client=client, max_retries=0)
    messages: Any = CHAT["messages"]
    whole = sdk.chat.completions.create(model="tiny:llada", messages=messages, max_tokens=64, extra_body={"steps": 32})
    stream = sdk.chat.completions.create(
        model="tiny:llada", messages=messages, max_tokens=64, extra_body={"steps": 32}, stream=True
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    raw = _events(client, CHAT)
    assert {e["object"] for e in raw} == {"chat.completion.chunk"}


def test_canvas_streaming_needs_stream(client: TestClient) -> None:
    body = {**CHAT, "stream_options": {"include_canvas": True}}
    refused = client.post("/v1/chat/completions", json=body, headers=AUTH)
    error = refused.json()["error"]
    assert refused.status_code == 400 and (error["param"], error["code"]) == ("stream_options", "invalid_value")


def test_dlm_validate_checks_both_capabilities(client: TestClient) -> None:
    """`dlm validate`'s capability checks pass against dlm's own app (the chat check first,
    as in a run: canvas streaming compares its deltas with that answer)."""
    from dlm.cli.checks.capabilities import CAPABILITY_CHECKS
    from dlm.cli.checks.contract import CONTRACT_CHECKS
    from dlm.cli.checks.runner import PASSED, Context, ValidateOptions, run_checks
    from dlm.cli.client.api import ApiClient

    api = ApiClient(str(client.base_url), api_key=KEY)
    api.http = client
    chat = [c for c in CONTRACT_CHECKS if c.name in ("chat", "chat_stream")]
    ctx = Context(api, ValidateOptions(max_tokens=32), model="tiny:llada")
    results = run_checks(ctx, chat + CAPABILITY_CHECKS)
    assert {r.name: r.status for r in results} == {r.name: PASSED for r in results}, [r.detail for r in results]
