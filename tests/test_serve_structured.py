"""The server's structured output and canvas streaming, in process (the app over a tiny
random LLaDA, driven through Starlette's test client, which the OpenAI SDK also takes as
its HTTP client): schema-shaped answers, refusals naming the keyword, canvas events for
clients that opt in, and no change for those that do not."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving import app_client

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
    with app_client({"model": "tiny:llada", "api_keys": [KEY], "warmup": False}) as test_client:
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


@pytest.mark.parametrize("length", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_a_skeleton_beyond_the_length_names_the_length_field_sent(client: TestClient, length: str) -> None:
    """Its param and its message both name the field the client sent (the message said
    `max_tokens` whatever the client wrote)."""
    big = {"type": "array", "items": {"type": "string", "minLength": 20}, "minItems": 6}
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": big}}
    body = {"messages": CHAT["messages"], length: 64, "response_format": fmt}
    refused = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == length and f"than {length} (64)" in error["message"], error


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
    as in a run: canvas streaming compares its deltas with that answer), each capability LLaDA
    lacks (the registry's record: decode_mode) skipped as not advertised."""
    from dlm.cli.checks.capabilities import CAPABILITY_CHECKS
    from dlm.cli.checks.contract import CONTRACT_CHECKS
    from dlm.cli.checks.runner import PASSED, SKIPPED, Context, ValidateOptions, run_checks
    from dlm.cli.client.api import ApiClient
    from dlm.engine.capabilities import supported
    from dlm.engine.registry import family_named

    api = ApiClient(str(client.base_url), api_key=KEY)
    api.http = client
    chat = [c for c in CONTRACT_CHECKS if c.name in ("chat", "chat_stream")]
    ctx = Context(api, ValidateOptions(max_tokens=32), model="tiny:llada")
    results = run_checks(ctx, chat + CAPABILITY_CHECKS)
    advertised = {f"capability_{name}" for name in supported(family_named("llada"))} | {
        "chat",
        "chat_stream",
        "capabilities",
    }
    expected = {r.name: PASSED if r.name in advertised else SKIPPED for r in results}
    assert {r.name: r.status for r in results} == expected, [r.detail for r in results]


@dataclass
class Work:
    """What the server did for the structured requests sent: subschemas compiled, layouts
    made (and on which threads), request log lines written."""

    visits: int = 0
    layouts: int = 0
    threads: set[str] = field(default_factory=set)
    logged: int = 0

    def reset(self) -> None:
        self.visits = self.layouts = self.logged = 0
        self.threads.clear()


@pytest.fixture(scope="module")
def work(client: TestClient) -> Iterator[Work]:
    from dlm.cli.server.service import Service
    from dlm.engine import structured
    from dlm.engine.runtime import engine

    counted = Work()
    visit, lay, record = structured._Compiler.value, engine.layout, Service.record

    def value(self: Any, *args: Any) -> None:
        counted.visits += 1
        counted.threads.add(threading.current_thread().name)
        visit(self, *args)

    def layout(*args: Any) -> Any:
        counted.layouts += 1
        counted.threads.add(threading.current_thread().name)
        return lay(*args)

    def logged(self: Any, job: Any) -> None:
        counted.logged += 1
        record(self, job)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(structured._Compiler, "value", value)
        patch.setattr(engine, "layout", layout)
        patch.setattr(Service, "record", logged)
        yield counted


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "drawn", "schema": schema}}


def test_schemas_are_compiled_and_laid_out_off_the_event_loop_once_per_request(client: TestClient, work: Work) -> None:
    """n samples of a 2,000-value enum: one layout, on the preparation thread (the event loop
    only queues the request), and one log line."""
    work.reset()
    enum = {"type": "array", "items": {"enum": [f"value-{i}" for i in range(2000)]}, "minItems": 2, "maxItems": 2}
    body = {**CHAT, "max_tokens": 32, "steps": 8, "n": 8, "response_format": _schema_format(enum)}
    answer = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 8
    assert work.layouts == 1 and work.visits == 3 and work.logged == 1  # the array, its two items
    assert work.threads == {"dlm-prepare_0"}, work.threads


def test_an_exponential_schema_is_refused_after_bounded_work(client: TestClient, work: Work) -> None:
    from dlm.engine.structured import MAX_SKELETON

    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(6):
        schema = {"type": "array", "items": schema, "minItems": 64, "maxItems": 64}  # 64**6 integers
    for max_tokens, param in ((64, "max_tokens"), (None, "max_tokens")):
        work.reset()
        body = {**CHAT, "max_tokens": max_tokens, "response_format": _schema_format(schema)}
        refused = client.post("/v1/chat/completions", json=body, headers=AUTH)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        assert work.visits <= MAX_SKELETON and work.layouts == 0 and work.logged == 1


ODD = st.none() | st.booleans() | st.integers(-3, 70) | st.text(max_size=4) | st.just([]) | st.just({})
NAME = st.sampled_from(["a", "b", "c", "d"])
TYPE = st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array", "tuple"])


@st.composite
def _node(draw: st.DrawFn, children: st.SearchStrategy[Any]) -> dict[str, Any]:
    """A subschema whose keywords are mostly well-typed and sometimes anything at all."""
    keywords = {
        "type": TYPE | st.lists(TYPE, max_size=2) | ODD,
        "properties": st.dictionaries(NAME, children, max_size=3) | ODD,
        "required": st.lists(NAME | ODD, max_size=3) | ODD,
        "items": children | ODD,
        "minItems": st.integers(0, 64) | ODD,
        "maxItems": st.integers(0, 64) | ODD,
        "minLength": st.integers(0, 300) | ODD,
        "maxLength": st.integers(0, 30) | ODD,
        "minimum": st.integers(-(10**10), 10**10) | ODD,
        "maximum": st.integers(-(10**10), 10**10) | ODD,
        "enum": st.lists(ODD, max_size=4) | st.integers(0, 3000).map(lambda k: list(range(k))) | ODD,
        "const": ODD,
        "$ref": st.sampled_from(["#/$defs/a", "#/$defs/b", "#/definitions/a", "#/x", "http://x"]) | ODD,
        "pattern": st.just("a+"),
        "additionalProperties": st.booleans() | ODD,
    }
    chosen = draw(st.lists(st.sampled_from(sorted(keywords)), max_size=4, unique=True))
    return {key: draw(keywords[key]) for key in chosen}


@st.composite
def _repeated(draw: st.DrawFn, children: st.SearchStrategy[Any]) -> dict[str, Any]:
    """Repetition: arrays of exactly N items of a child, the way exponential skeletons grow."""
    count = draw(st.integers(1, 64))
    return {"type": "array", "items": draw(children), "minItems": count, "maxItems": count}


SUBSCHEMAS = st.recursive(
    st.booleans() | st.just({"type": "integer"}) | st.just({"enum": ["x", "y"]}) | _node(st.nothing()),
    lambda c: _node(c) | _repeated(c),
    max_leaves=12,
)


@st.composite
def _response_format(draw: st.DrawFn) -> Any:
    root = draw(SUBSCHEMAS)
    if isinstance(root, dict) and draw(st.booleans()):
        # A new object: `st.just` hands out one shared dict, which mutating could make cyclic.
        root = {**root, "$defs": draw(st.dictionaries(NAME, SUBSCHEMAS, max_size=2) | ODD)}
    return draw(
        st.sampled_from(
            [
                _schema_format(root),
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": root},
                {"type": "json_schema"},
                {"type": root},
            ]
        )
    )


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(_response_format(), st.sampled_from([16, 48, None]), st.sampled_from([1, 3]))
def test_drawn_response_formats_never_get_a_5xx_and_their_work_is_bounded(
    client: TestClient, work: Work, response_format: Any, max_tokens: int | None, n: int
) -> None:
    """Any response_format (valid, malformed, exponential) is answered 200 or 400, never a
    5xx, with one log line, at most MAX_SKELETON subschemas compiled and one layout, on the
    preparation thread."""
    from dlm.engine.structured import MAX_SKELETON

    work.reset()
    body = {**CHAT, "max_tokens": max_tokens, "steps": 8, "n": n, "response_format": response_format}
    answer = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert answer.status_code in (200, 400), answer.text
    if answer.status_code == 400:
        assert answer.json()["error"]["param"] in ("response_format", "max_tokens"), answer.text
    assert work.visits <= MAX_SKELETON and work.layouts <= 1 and work.logged == 1
    assert work.threads <= {"dlm-prepare_0"}
