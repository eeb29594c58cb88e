"""Rate limits and error codes, in process (the app over tiny SDAR): a request whose whole
token charge (n x max_tokens) no bucket can hold is a 400 naming the limit, never a 429
forever; a request refused after its token charge gives the tokens back (it still counts as a
request); every 400 carries a
documented code and names the field the client sent; stream_options and response_format
refuse what they do not know; the booleans OpenAI types "boolean or null" take null."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.cli.server.ratelimit import OverCapacity, RateLimiter, TokenBucket
from dlm.engine.errors import UnknownKey, UsageError
from dlm.engine.params import GenerationParams
from dlm.engine.runtime.scheduler import QueueFull
from tests.serving import app_client

# docs/serve.md, "Errors": the codes a 400 may carry.
CODES_400 = {
    "invalid_json",
    "invalid_value",
    "unknown_parameter",
    "unsupported",
    "context_length_exceeded",
    "max_tokens_exceeded",
    "steps_exceeded",
}
TPM = 100
MESSAGES = [{"role": "user", "content": "hi"}]
ROUTES = {
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "chat": ("/v1/chat/completions", {"messages": MESSAGES}),
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    """--tokens-per-minute 100, --max-queue 8 (so a request may have 16 samples: 8 decoded, 8 waiting)."""
    settings = {"model": "tiny:sdar", "warmup": False, "tokens_per_minute": TPM, "max_queue": 8}
    with app_client(settings) as test_client:
        yield test_client


@pytest.fixture(autouse=True)
def fresh_buckets(request: pytest.FixtureRequest) -> None:
    """Each test starts with full buckets (answered requests are charged)."""
    if "client" in request.fixturenames:
        service = request.getfixturevalue("client").app.state.service
        service.limiter = RateLimiter(service.config.requests_per_minute, service.config.tokens_per_minute)


def post(client: TestClient, route: str, **fields: Any) -> Any:
    path, base = ROUTES[route]
    return client.post(path, json={**base, **fields})


def error_of(response: Any, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return dict(response.json()["error"])


# ---- 1: a charge over the bucket's capacity -------------------------------------------------


def test_a_bucket_refuses_an_amount_above_its_capacity() -> None:
    bucket = TokenBucket(per_minute=1000, level=1000, stamp=0.0)
    with pytest.raises(OverCapacity):
        bucket.take(1001, now=0.0)
    assert bucket.level == 1000  # nothing taken
    assert bucket.take(1000, now=0.0) == 0.0
    limiter = RateLimiter(0, 1000)
    with pytest.raises(OverCapacity):
        limiter.check("k", "tokens", 1200)
    assert limiter.check("k", "tokens", 1000) == 0
    assert RateLimiter(0.5, 0).check("k", "requests") == 0  # under one a minute: still one at a time


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("fields", "param"),
    [({"max_tokens": 60, "n": 2}, "n"), ({"max_tokens": 30, "n": 4}, "n"), ({"max_tokens": TPM + 1}, "max_tokens")],
)
def test_a_charge_over_the_token_rate_is_a_400_naming_the_limit(
    client: TestClient, route: str, fields: dict[str, Any], param: str
) -> None:
    error = error_of(post(client, route, **fields))
    assert (error["param"], error["code"]) == (param, "max_tokens_exceeded"), error
    assert f"{TPM} tokens per minute" in error["message"]
    # Just under the limit passes.
    assert post(client, route, max_tokens=TPM // fields.get("n", 1) // 8, n=fields.get("n", 1)).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("n", "max_tokens"), [(1, TPM), (4, TPM // 4)])
def test_a_charge_of_the_whole_capacity_is_taken_and_then_waits(
    client: TestClient, route: str, n: int, max_tokens: int
) -> None:
    """One rule decides what a bucket can hold (`Service._check_charge`) and `submit` charges
    exactly what it judged: n x max_tokens equal to the capacity is taken (200), one token
    more per sample is the 400; the bucket it drained then answers a 429 with a wait (a
    shortage refilling cures), never the 400."""
    over = error_of(post(client, route, max_tokens=max_tokens + 1, n=n))
    assert (over["code"], over["param"]) == ("max_tokens_exceeded", "n" if n > 1 else "max_tokens"), over
    assert post(client, route, max_tokens=max_tokens, n=n).status_code == 200
    short = post(client, route, max_tokens=TPM // 2)  # 50 tokens: half a minute to refill
    assert error_of(short, 429)["code"] == "rate_limit_exceeded"
    assert int(short.headers["retry-after"]) >= 1


# ---- 2: refused after the charge, charged nothing -----------------------------------------


@pytest.fixture(scope="module")
def tight() -> Iterator[TestClient]:
    settings = {
        "model": "tiny:sdar",
        "warmup": False,
        "tokens_per_minute": 128,
        "requests_per_minute": 3,
        "max_queue": 1,
        "max_num_seqs": 1,
    }
    with app_client(settings) as test_client:
        yield test_client


def _full(*_: Any, **__: Any) -> None:
    raise QueueFull("the request queue is full (1 waiting)")


@pytest.mark.parametrize("route", ROUTES)
def test_requests_refused_after_the_token_charge_give_their_tokens_back(
    tight: TestClient, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full queue at submission used to keep the tokens it was charged: 64 tokens gone per
    refusal, and the next request refused by a token rate nothing had spent."""
    service = tight.app.state.service
    service.limiter = RateLimiter(100, 128)
    with monkeypatch.context() as patch:  # the queue fills between admission and submission
        patch.setattr(service.served.engine, "enqueue", _full)
        for _ in range(2):
            assert error_of(post(tight, route, max_tokens=64), 429)["code"] == "queue_full"
    with monkeypatch.context() as patch:  # full at admission, before any token charge
        patch.setattr(service.engine.scheduler, "check_room", _full)
        assert error_of(post(tight, route, max_tokens=64), 429)["code"] == "queue_full"
    assert error_of(post(tight, route, max_tokens=64, top_p=0.5))["code"] == "unsupported"
    # The 128 tokens of the minute are all still there: 64 + 64, then the token rate refuses.
    assert post(tight, route, max_tokens=64).status_code == 200
    assert post(tight, route, max_tokens=64).status_code == 200
    error = error_of(post(tight, route, max_tokens=8), 429)
    assert error["code"] == "rate_limit_exceeded" and "token rate" in error["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_refused_requests_still_count_against_the_request_rate(
    tight: TestClient, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal is still a request: a flood of bad or overflowing ones meets the request rate."""
    service = tight.app.state.service
    service.limiter = RateLimiter(3, 1000)
    with monkeypatch.context() as patch:
        patch.setattr(service.engine.scheduler, "check_room", _full)
        assert error_of(post(tight, route, max_tokens=8), 429)["code"] == "queue_full"
    assert error_of(post(tight, route, max_tokens=8, top_p=0.5))["code"] == "unsupported"
    assert post(tight, route, max_tokens=8).status_code == 200
    assert "request rate" in error_of(post(tight, route, max_tokens=8), 429)["message"]


# ---- 3 and 4: every 400 has a documented code, naming what the client sent ----------------

ERROR_PATHS: list[tuple[str, dict[str, Any], str, str]] = [
    ("completions", {"prompt": ["a", "b"]}, "prompt", "unsupported"),
    ("completions", {"prompt": "hi", "n": 17, "max_tokens": 2}, "n", "invalid_value"),
    ("chat", {"n": 17, "max_tokens": 2}, "n", "invalid_value"),
    ("completions", {"max_tokens": TPM + 1}, "max_tokens", "max_tokens_exceeded"),
    ("chat", {"max_completion_tokens": TPM + 1}, "max_completion_tokens", "max_tokens_exceeded"),
    ("chat", {"max_output_tokens": TPM + 1}, "max_output_tokens", "max_tokens_exceeded"),
    ("completions", {"max_tokens": 60, "n": 2}, "n", "max_tokens_exceeded"),
    ("chat", {"max_completion_tokens": 4000}, "max_completion_tokens", "max_tokens_exceeded"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ("completions", {"max_tokens": 0}, "max_tokens", "invalid_value"),
    ("chat", {"max_completion_tokens": 4, "block_length": 4, "steps": 2000}, "steps", "steps_exceeded"),
    ("completions", {"top_p": 0.5, "max_tokens": 8}, "top_p", "unsupported"),
    ("chat", {"top_p": 0.5, "max_tokens": 8}, "top_p", "unsupported"),
    ("completions", {"top_p": 1.5, "max_tokens": 8}, "top_p", "invalid_value"),
    ("chat", {"logprobs": True, "top_logprobs": 21, "max_tokens": 8}, "top_logprobs", "invalid_value"),
    ("completions", {"logprobs": 21, "max_tokens": 8}, "logprobs", "invalid_value"),
    ("completions", {"prompt": "x" * 300_000}, "prompt", "context_length_exceeded"),
    ("completions", {"treshold": 0.9}, "treshold", "unknown_parameter"),
    ("completions", {"logit_bias": {"5": 1}}, "logit_bias", "unsupported"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ("chat", {"stream_options": {"include_usage": True}, "stream": False}, "stream_options", "invalid_value"),
    ("chat", {"stream_options": {"continuous_usage_stats": True}}, "stream_options", "invalid_value"),
]

# A refusal that names the length besides its own field names it as the client spelt it.
LENGTH_MENTIONS: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"max_completion_tokens": 4, "min_tokens": 5}, "max_completion_tokens (4)"),
    ("chat", {"max_output_tokens": 4, "min_tokens": 5}, "max_output_tokens (4)"),
    ("chat", {"max_tokens": 4, "min_tokens": 5}, "max_tokens (4)"),
    ("completions", {"max_tokens": 4, "min_tokens": 5}, "max_tokens (4)"),
]

# Every field a refusal names is spelt as the API spells it (the engine's `mode` is `decode_mode`).
SPELT: list[tuple[str, dict[str, Any], str, str]] = [
    ("chat", {"max_tokens": 4, "decode_mode": "ar", "steps": 4}, "steps", "steps does not apply to decode_mode ar"),
    (
        "completions",
        {"max_tokens": 4, "decode_mode": "ar", "threshold": 0.9},
        "threshold",
        "threshold does not apply to decode_mode ar",
    ),
]


@pytest.mark.parametrize(("route", "fields", "param", "start"), SPELT)
def test_a_refusal_spells_every_field_it_names_as_the_api_does(
    client: TestClient, route: str, fields: dict, param: str, start: str
) -> None:
    error = error_of(post(client, route, **fields))
    assert error["param"] == param and error["message"].startswith(start), error


@pytest.mark.parametrize(("route", "fields", "length"), LENGTH_MENTIONS)
def test_a_refusal_names_the_length_field_the_client_sent(
    client: TestClient, route: str, fields: dict, length: str
) -> None:
    error = error_of(post(client, route, **fields))
    assert (error["param"], error["code"]) == ("min_tokens", "invalid_value"), error
    assert error["message"] == f"min_tokens (5) must not exceed {length}", error


@pytest.mark.parametrize(("route", "fields", "param", "code"), ERROR_PATHS)
def test_every_400_has_a_documented_code(client: TestClient, route: str, fields: dict, param: str, code: str) -> None:
    error = error_of(post(client, route, **fields))
    assert error["code"] is not None and error["code"] in CODES_400, error
    assert (error["param"], error["code"]) == (param, code), error
    if param in ("top_logprobs", "logprobs", "max_completion_tokens", "max_output_tokens", "max_tokens"):
        assert error["message"].startswith(param), error  # the field the client sent, not another


def test_rejections_are_counted_by_their_code(client: TestClient) -> None:
    for route, fields, _, _ in ERROR_PATHS:
        post(client, route, **fields)
    metrics = client.get("/metrics").text
    assert 'reason="invalid_request_error"' not in metrics
    assert 'reason="unsupported"' in metrics and 'reason="max_tokens_exceeded"' in metrics


# ---- 5: stream_options and response_format refuse what they do not know -------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
WRAPPER = {"name": "x", "schema": SCHEMA}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("fields", "place", "code"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"stream_options": {"include_canvas": True}}, "stream_options", "invalid_value"),
        ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus", "unknown_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": WRAPPER, "foo": 1}}, "foo", "unknown_parameter"),
        ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "schema", "unknown_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {**WRAPPER, "x": 1}}}, "x", "unknown_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "name", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {**WRAPPER, "name": 5}}}, "name", "invalid_value"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {**WRAPPER, "strict": 1}}},
            "strict",
            "invalid_value",
        ),
        ({"response_format": {"json_schema": WRAPPER}}, "type", "invalid_value"),
    ],
)
def test_stream_options_and_response_format_refuse_what_they_do_not_know(
    client: TestClient, route: str, fields: dict, place: str, code: str
) -> None:
    """stream_options is named by its path (a typed object); response_format by its own name,
    its message naming the place (as for the schema's own refusals: docs/serve.md)."""
    error = error_of(post(client, route, max_tokens=8, **fields))
    if "response_format" in fields:
        assert error["param"] == "response_format" and place in error["message"], error
        assert error["code"] == code, error
    else:
        assert (error["param"], error["code"]) == (place, code), error


UNKNOWN_KEYS = [
    ({"type": "json_schema", "json_schema": WRAPPER, "foo": 1}, "response_format.foo"),
    ({"type": "json_object", "schema": SCHEMA}, "response_format.schema"),
    ({"type": "text", "json_schema": WRAPPER}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {**WRAPPER, "x": 1}}, "response_format.json_schema.x"),
]


@pytest.mark.parametrize(("fmt", "path"), UNKNOWN_KEYS, ids=[path for _, path in UNKNOWN_KEYS])
def test_every_entry_point_refuses_an_unknown_response_format_key_alike(
    client: TestClient, tiny_llada: Path, fmt: dict[str, Any], path: str
) -> None:
    """The server, the Python API and `dlm generate` refuse the same key with the same words:
    the engine's one rule (dlm/engine/structured.py), the server's 400 derived from its type.
    The command line and the Python API used to ignore the key (only the server refused it)."""
    http = error_of(post(client, "chat", max_tokens=8, response_format=fmt))
    assert (http["param"], http["code"]) == ("response_format", "unknown_parameter"), http
    with pytest.raises(UnknownKey) as caught:  # the Python API's object, as LLM.generate takes it
        GenerationParams(response_format=fmt).validate(4, 1024)
    assert (caught.value.path, caught.value.field, str(caught.value)) == (path, "response_format", http["message"])
    args = ["generate", str(tiny_llada), "--prompt-ids", "1,2", "--gen-length", "8", "--response-format"]
    result = CliRunner().invoke(app, [*args, json.dumps(fmt), "--dtype", "float32", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {http['message']}"


# Values that are not a response format object, as a client sends them, and their JSON type.
NON_OBJECTS = [([], "array"), ([{"type": "json_object"}], "array"), ("json_object", "string"), (3, "number")]
NON_OBJECTS += [(True, "boolean"), ('{"type": "json_object"}', "string")]  # a body's string is not JSON text


def test_every_entry_point_refuses_a_response_format_that_is_not_an_object_alike(
    client: TestClient, tiny_llada: Path, tmp_path: Path
) -> None:
    """The server (both routes), `dlm batch`, the Python API (the value itself, or its JSON
    text) and `dlm generate` (its JSON text) refuse a non-object in the engine's words
    (`format_object`), naming the field. They used to say it three ways: pydantic's "Input
    should be a valid dictionary" (server, batch), "must be an object with a type" (dlm
    generate) and "must be a JSON object or its text, got list" (the Python API)."""
    lines = []
    for i, (fmt, kind) in enumerate(NON_OBJECTS):
        said = f"response_format must be a JSON object, got {kind}"
        for route in ROUTES:
            http = error_of(post(client, route, max_tokens=8, response_format=fmt))
            assert (http["message"], http["param"], http["code"]) == (said, "response_format", "invalid_value"), http
        given = [json.dumps(fmt)] + ([] if isinstance(fmt, str) else [fmt])  # a str is JSON text to the Python API
        for value in given:
            with pytest.raises(UsageError) as caught:
                GenerationParams(response_format=value).validate(4, 1024)
            assert (str(caught.value), caught.value.field) == (said, "response_format"), value
        args = ["generate", str(tiny_llada), "--prompt-ids", "1,2", "--gen-length", "8", "--response-format"]
        result = CliRunner().invoke(app, [*args, json.dumps(fmt), "--dtype", "float32", "--device", "cpu"])
        assert (result.exit_code, result.stderr.strip()) == (2, f"error: {said}"), result.output
        body = {"prompt": "hi", "max_tokens": 8, "response_format": fmt}
        lines.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body})
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(app, ["batch", str(source), str(out), "--model", "tiny:llada"])
    assert result.exit_code == 0, result.output
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for i, (_, kind) in enumerate(NON_OBJECTS):
        error = records[f"q{i}"]["error"]
        assert (error["message"], error["param"]) == (
            f"response_format must be a JSON object, got {kind}",
            "response_format",
        )


@pytest.mark.parametrize("route", ROUTES)
def test_stream_options_with_a_stream_and_neutral_ones_without_are_taken(client: TestClient, route: str) -> None:
    streamed = post(client, route, max_tokens=8, stream=True, stream_options={"include_usage": True})
    assert streamed.status_code == 200, streamed.text
    assert '"usage"' in streamed.text
    plain = post(client, route, max_tokens=8, stream_options={"include_usage": False, "include_canvas": None})
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize("route", ROUTES)
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client: TestClient, route: str) -> None:
    """vLLM's option, which benchmark clients send beside include_usage: each chunk's usage
    counts its choice's tokens streamed so far; the last reaches the final usage chunk's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    response = post(client, route, max_tokens=8, stream=True, ignore_eos=True, stream_options=options)
    assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    chunks, final = events[:-1], events[-1]
    assert chunks and all("usage" in chunk for chunk in chunks), events
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == final["usage"]["completion_tokens"] == 8
    assert {chunk["usage"]["prompt_tokens"] for chunk in chunks} == {final["usage"]["prompt_tokens"]}
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in (c["usage"] for c in chunks))


# ---- 6: null is the default for OpenAI's "boolean or null" fields -------------------------


@pytest.mark.parametrize(
    ("route", "field"),
    [
        ("completions", "stream"),
        ("chat", "stream"),
        ("completions", "echo"),
        ("completions", "return_token_ids"),
        ("chat", "return_token_ids"),
    ],
)
def test_null_booleans_take_their_default(client: TestClient, route: str, field: str) -> None:
    response = post(client, route, max_tokens=8, **{field: None})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert "token_ids" not in choice or choice["token_ids"] is None
    if route == "completions":
        assert not choice["text"].startswith("hi")  # no echo


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})])
def test_tokenize_and_detokenize_count_against_the_request_rate(tight: TestClient, path: str, body: Any) -> None:
    """They parse and tokenise on the preparation thread as a generation request does: a key
    over its request rate flooded them (900 KB prompts, chat templates, response formats)
    without a single 429."""
    service = tight.app.state.service
    service.limiter = RateLimiter(2, 1000)
    assert tight.post(path, json=body).status_code == 200
    assert tight.post(path, json=body).status_code == 200
    refused = tight.post(path, json=body)
    assert "request rate" in error_of(refused, 429)["message"] and int(refused.headers["retry-after"]) >= 1
    assert "request rate" in error_of(post(tight, "completions", max_tokens=8), 429)["message"]  # one bucket


@pytest.mark.parametrize("path", ["/v1/completions/", "/v1/chat/completions/", "/health/", "/tokenize/"])
def test_a_trailing_slash_is_an_unknown_path_not_a_redirect(client: TestClient, path: str) -> None:
    """Starlette redirected it (307, empty body, before any key check) to a URL built from the
    Host header the client sent: `Host: evil.example` got `Location: http://evil.example/...`."""
    response = client.post(path, json={"prompt": "hi"}, headers={"Host": "evil.example"}, follow_redirects=False)
    assert response.status_code in (404, 405) and "location" not in response.headers
    assert response.json()["error"]["type"] in ("not_found_error", "invalid_request_error")


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/embeddings"])
def test_an_unknown_route_names_itself(client: TestClient, path: str) -> None:
    """OpenAI SDKs (`client.responses.create`) show only the message: "Not Found" alone did
    not say the route, not the model, was missing."""
    error = error_of(client.post(path, json={"model": "m", "input": "hi"}), 404)
    assert error["type"] == "not_found_error" and f"no route POST {path}" in error["message"]


# ---- draining: every route that reads a body answers as generation does ---------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("/tokenize", {"prompt": "hi", "max_tokens": 4}),
        ("/detokenize", {"tokens": [5]}),
    ],
)
def test_a_draining_server_refuses_every_body_route_alike(client: TestClient, path: str, body: dict) -> None:
    """A load balancer sees one state: /tokenize and /detokenize answered 200 while the
    generation routes answered 503 `draining`."""
    service = client.app.state.service  # type: ignore[attr-defined]
    assert client.post(path, json=body).status_code == 200
    service.draining = True
    try:
        error = error_of(client.post(path, json=body), 503)
    finally:
        service.draining = False
    assert (error["type"], error["code"]) == ("unavailable", "draining"), error
