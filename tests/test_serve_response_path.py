"""From a submitted request to its answer, over a real socket (uvicorn in a thread, the app
on the embedded default model): logprobs with a response format are numbers (never NaN);
a failure while answering is a logged, counted 500 on a connection that stays usable; a
stream adds up to the non-streamed answer at every stop string, and token_ids, usage and
logprobs cover the text answered; chat logprobs carry a token's raw bytes; `/tokenize`
refuses what generation refuses; `stop` / `stop_token_ids` with a response format are refused."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from dlm.cli.server import generation, prepare
from dlm.cli.server.app import create_app
from dlm.cli.server.config import ServeConfig
from dlm.cli.server.connections import protocol
from dlm.cli.server.generation import Responder, undecided
from dlm.cli.server.logprobs import chat_logprobs, token_bytes
from dlm.engine.decoding.logprobs import LogprobRecord, TokenLogprob
from tests.serving import wait_until

SORT = [{"role": "user", "content": "Sort: 4 3 9 8 5"}]  # the default model answers "3 4 5 8 9"
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


def _no_constant(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def strict(text: str) -> Any:
    """JSON as RFC 8259 has it: NaN and Infinity are not JSON (Python's json reads them)."""
    return json.loads(text, parse_constant=_no_constant)


def events(text: str) -> list[dict[str, Any]]:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-500:]
    return [strict(line) for line in lines[:-1]]


class Served:
    """The app under uvicorn on 127.0.0.1 (an ephemeral port), its request log lines kept."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.app = create_app(ServeConfig(device="cpu", dtype="float32", warmup=False))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            self.app, http=protocol(30), log_level="warning", log_config=None, lifespan="on", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def logs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines)]

    def metric(self, client: httpx.Client, sample: str) -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return 0.0


@contextmanager
def running(s: Served) -> Iterator[Served]:
    """`s` serving, once it listens (uvicorn listens on its socket only after the lifespan has
    started: a request before that was refused, and under load the fixture erred every test of
    the module) and its model is ready; stopped after the block."""
    s.thread.start()
    try:
        assert wait_until(lambda: s.server.started or not s.thread.is_alive(), timeout=300), "uvicorn never started"
        assert s.server.started, "uvicorn ended before it listened"
        ready = wait_until(lambda: httpx.get(s.url + "/ready").status_code == 200, timeout=300)
        assert ready, httpx.get(s.url + "/health").text
        yield s
    finally:
        s.server.should_exit = True
        s.thread.join(timeout=60)
        s.sock.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    handler = logging.Handler()
    handler.emit = s.emit  # type: ignore[method-assign]
    requests_log = logging.getLogger("dlm.requests")
    level = requests_log.level
    requests_log.addHandler(handler)
    requests_log.setLevel(logging.INFO)
    try:
        with running(s):
            yield s
    finally:
        requests_log.removeHandler(handler)
        requests_log.setLevel(level)


def test_no_request_goes_out_before_uvicorn_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture's first request went out as soon as the thread started; uvicorn listens
    only after its startup (the lifespan), so on a loaded machine it was refused
    (httpx.ConnectError) and every test of the module erred. A slow startup is waited for."""
    real = uvicorn.Server.startup

    async def slow_startup(self: uvicorn.Server, sockets: Any = None) -> None:
        await asyncio.sleep(1.0)  # as a loaded machine would take
        await real(self, sockets=sockets)

    monkeypatch.setattr(uvicorn.Server, "startup", slow_startup)
    with running(Served()) as s:
        assert httpx.get(s.url + "/ready").status_code == 200


@pytest.fixture
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=120) as c:  # one keep-alive connection
        yield c


def ask(client: httpx.Client, chat: bool, body: dict[str, Any], stream: bool = False) -> httpx.Response:
    """A chat body (messages) to either endpoint: to completions as its prompt's token ids."""
    body = dict(body)
    if not chat:
        messages = body.pop("messages")
        body["prompt"] = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
        if body.pop("logprobs", None):
            body["logprobs"] = body.pop("top_logprobs", 0)
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return client.post(path, json=body)


def answer(chat: bool, response: httpx.Response) -> tuple[str, list[Any], dict[str, Any], list[int] | None]:
    """Text, logprob entries, usage and token_ids of a non-streamed answer."""
    assert response.status_code == 200, response.text
    body = strict(response.text)
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    lp = choice["logprobs"]
    entries = (lp["content"] if chat else list(zip(lp["tokens"], lp["token_logprobs"]))) if lp else []
    return text, entries, body["usage"], choice.get("token_ids")


def streamed(chat: bool, response: httpx.Response) -> tuple[str, list[Any], dict[str, Any]]:
    assert response.status_code == 200, response.text
    text, entries, usage = "", [], {}
    for event in events(response.text):
        if "usage" in event and event["usage"]:
            usage = event["usage"]
        for choice in event.get("choices", []):
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            lp = choice.get("logprobs")
            if lp:
                entries += lp["content"] if chat else list(zip(lp["tokens"], lp["token_logprobs"]))
    return text, entries, usage


# ---- 1: logprobs of a response format's skeleton ---------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_response_format_logprobs_are_numbers(client: httpx.Client, chat: bool, stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "logprobs": True, "top_logprobs": 1}
    response = ask(client, chat, {**body, "response_format": FORMAT}, stream)
    text, entries, _ = streamed(chat, response) if stream else answer(chat, response)[:3]
    assert isinstance(json.loads(text)["x"], int)
    values = [e["logprob"] for e in entries] if chat else [v for _, v in entries]
    assert values and all(isinstance(v, float) and math.isfinite(v) for v in values)
    assert values[0] == 0.0  # "{" is the skeleton's: certain under the constraint


def test_a_record_never_reports_nan() -> None:
    record = LogprobRecord(3, top=2)  # no step decided position 0: committed before decoding
    record.note(torch.tensor([1, 2]), torch.eye(4)[:2], torch.randn(5, 4), torch.tensor([3, 4]), mask_id=0)
    first, *rest = record.tokens([7, 3, 4])
    assert first == TokenLogprob(7, 0.0, ((7, 0.0),))
    assert all(math.isfinite(t.logprob) and t.logprob < 0 for t in rest)


def test_events_refuse_values_json_cannot_carry() -> None:
    with pytest.raises(ValueError):
        generation._sse({"logprob": math.nan})


# ---- 2: a failure while answering ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_a_failure_while_answering_is_a_logged_counted_500_on_a_usable_connection(
    served: Served, client: httpx.Client, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    def boom(*_: Any) -> str:
        raise RuntimeError("injected")

    failures = served.metric(client, 'dlm_request_failures_total{reason="error"}')
    before = len(served.logs())
    with monkeypatch.context() as patch:
        patch.setattr(Responder, "close", boom)
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream": stream})
    if stream:
        assert response.status_code == 200  # the stream had begun: its error is an event
        error = events(response.text)[-1]["error"]
    else:
        assert response.status_code == 500
        error = response.json()["error"]
    assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
    again = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8})  # the same connection
    assert again.status_code == 200
    end = time.monotonic() + 10  # a line is written once the client has the whole answer
    while len(served.logs()) < before + 2 and time.monotonic() < end:
        time.sleep(0.01)
    lines = served.logs()[before:]
    assert [(line["status"], line["outcome"], line["finish_reason"]) for line in lines] == [
        (500, "failed", "error"),
        (200, "answered", lines[1]["finish_reason"]),
    ]
    assert served.metric(client, 'dlm_request_failures_total{reason="error"}') == failures + 1


def test_every_answer_of_a_generation_route_carries_its_request_id(
    served: Served, client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X-Request-Id names the request's log line: it came with a 200 only, so the client of a
    refusal (400), a failure before submission (500) or while answering (500) could not
    point the operator at its line. And a failure before submission was raised to the
    framework, which closed the connection after its 500: the client's next request on it
    (the one after, here) was reset."""

    def boom(*_: Any) -> Any:
        raise RuntimeError("injected")

    body = {"prompt": "hi", "max_tokens": 8}
    answers = [
        client.post("/v1/completions", json=body),
        client.post("/v1/completions", json={**body, "stream": True}),
        client.post("/v1/chat/completions", json={"messages": SORT, "max_tokens": 8, "treshold": 0.9}),
    ]
    with monkeypatch.context() as patch:
        patch.setattr(prepare, "_options", boom)  # before submission
        answers.append(client.post("/v1/completions", json=body))
    with monkeypatch.context() as patch:
        patch.setattr(Responder, "close", boom)  # after it
        answers.append(client.post("/v1/completions", json=body))
    assert [a.status_code for a in answers] == [200, 200, 400, 500, 500]
    # a server's client learns no internals (`dlm batch`, the operator, gets the cause: test_batch_lines.py)
    assert [a.json()["error"]["message"] for a in answers[3:]] == ["internal server error"] * 2
    ids = [a.headers.get("x-request-id") for a in answers]
    assert None not in ids and len(set(ids)) == len(ids), ids
    assert wait_until(lambda: {line["id"] for line in served.logs()} >= set(ids)), ids
    lines = {line["id"]: line for line in served.logs()}
    assert [lines[i]["status"] for i in ids] == [200, 200, 400, 500, 500]


# ---- 3, 4: stop strings: streams, token_ids, usage, logprobs ---------------------------


def test_undecided_is_the_longest_suffix_that_may_begin_a_stop() -> None:
    assert undecided("3 4 5 ", [" 8"]) == 1
    assert undecided("3 4 5", [" 8", "5 8"]) == 1
    assert undecided("ab", ["abc", "b"]) == 2
    assert undecided("3 4", ["x"]) == 0 and undecided("", [" 8"]) == 0


STOPS = [[" 8"], ["5 8"], [" "], ["4 5 8"], [" 8 9"], ["9"], [" 9", " 5"], ["nowhere"]]


@pytest.mark.parametrize("stop", STOPS, ids=lambda s: repr(s))
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streams_add_up_to_the_answer_at_every_stop_string(client: httpx.Client, chat: bool, stop: list[str]) -> None:
    body = {"messages": SORT, "max_tokens": 32, "temperature": 0, "stop": stop, "logprobs": True, "top_logprobs": 1}
    text, entries, usage, ids = answer(chat, ask(client, chat, {**body, "return_token_ids": True}))
    assert not any(s in text for s in stop)
    s_text, s_entries, s_usage = streamed(chat, ask(client, chat, body, stream=True))
    assert s_text == text
    assert s_entries == entries
    assert s_usage["completion_tokens"] == usage["completion_tokens"]
    # token_ids, completion_tokens and logprobs cover the text answered (the fewest tokens that spell it)
    assert ids is not None and len(ids) == usage["completion_tokens"] == len(entries)
    spelt = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    shorter = client.post("/detokenize", json={"tokens": ids[:-1]}).json()["prompt"]
    if stop != ["nowhere"]:
        assert spelt.startswith(text) and len(shorter) < len(text)


def test_the_reported_stop_case(client: httpx.Client) -> None:
    body = {"messages": SORT, "max_tokens": 32, "temperature": 0, "stop": [" 8"], "return_token_ids": True}
    text, _, usage, ids = answer(True, ask(client, True, body))
    assert text == "3 4 5" and usage["completion_tokens"] == len(ids or []) == 5
    assert streamed(True, ask(client, True, body, stream=True))[0] == "3 4 5"


# ---- 5: raw bytes of byte-level tokens -------------------------------------------------


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(served: Served) -> None:
    tokenizer = served.app.state.service.served.tokenizer
    vocab = tokenizer.get_vocab()
    first = vocab["ð"]  # byte 0xF0 (a 4-byte character's first), decoded alone as U+FFFD
    text = lambda t: str(tokenizer.decode([t]))  # noqa: E731
    assert text(first) == "\ufffd" and token_bytes(tokenizer, first, text(first)) == b"\xf0"
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    space = vocab["Ġ"]
    entry = chat_logprobs(
        [TokenLogprob(first, -1.0, ((first, -1.0), (special, -2.0), (space, -3.0)))],
        text,
        lambda t: token_bytes(tokenizer, t, text(t)),
    )["content"][0]
    assert entry["token"] == "\ufffd" and entry["bytes"] == [0xF0]
    assert [e["bytes"] for e in entry["top_logprobs"]] == [[0xF0], list(b"<|endoftext|>"), [0x20]]


def test_served_chat_logprobs_carry_raw_bytes(
    served: Served, client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    byte = served.app.state.service.served.tokenizer.get_vocab()["ð"]
    tokens = LogprobRecord.tokens

    def with_byte(self: LogprobRecord, ids: list[int]) -> list[TokenLogprob]:
        return [TokenLogprob(t.token, t.logprob, ((byte, -50.0), *t.top)) for t in tokens(self, ids)]

    monkeypatch.setattr(LogprobRecord, "tokens", with_byte)
    body = {"messages": SORT, "max_tokens": 8, "logprobs": True, "top_logprobs": 1}
    for stream in (False, True):
        response = ask(client, True, body, stream)
        entries = streamed(True, response)[1] if stream else answer(True, response)[1]
        alternatives = [a for e in entries for a in e["top_logprobs"] if a["token"] == "\ufffd"]
        assert alternatives and all(a["bytes"] == [0xF0] for a in alternatives)


# ---- 6: /tokenize refuses what generation refuses --------------------------------------

LONG_CONST = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": "word " * 40}}}
REFUSED = [
    {"prompt": [-1]},
    {"prompt": ""},
    {"prompt": "x", "max_tokens": 5000},
    {"prompt": "x", "n": 0},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
    {"messages": [{"role": "user", "content": "x"}], "stop": ["}"], "response_format": FORMAT},
    # compiles (one run of fixed text), but its tokens do not fit: refused where it is laid out
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 16, "response_format": LONG_CONST},
]


@pytest.mark.parametrize("body", REFUSED, ids=lambda b: json.dumps(b)[:48])
def test_tokenize_refuses_what_generation_refuses(client: httpx.Client, body: dict[str, Any]) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    generated = client.post(path, json=body)
    tokenized = client.post("/tokenize", json=body)
    assert generated.status_code == 400, generated.text
    assert (tokenized.status_code, tokenized.json()) == (400, generated.json())


def test_tokenize_builds_no_sequence(served: Served, client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """`/tokenize` runs the checks building would (parameters, ids, a response format's
    layout) and builds nothing: it used to make the request's `n` sequences, a skeleton laid
    on each, only to drop them (on a tensor-parallel server, mirrored to every rank too)."""
    engine = served.app.state.service.served.engine.engine
    built: list[int] = []
    real = engine.make_sequences

    def counted(prompt_ids: list[int], params: Any) -> Any:
        built.append(params.n)
        return real(prompt_ids, params)

    monkeypatch.setattr(engine, "make_sequences", counted)
    body = {"messages": SORT, "max_tokens": 32, "n": 3, "response_format": FORMAT}
    tokens = client.post("/tokenize", json=body)
    assert tokens.status_code == 200, tokens.text
    assert built == []
    answered = client.post("/v1/chat/completions", json=body)  # generation builds them, by the same path
    assert answered.status_code == 200, answered.text
    assert built == [3]


def test_tokenize_still_answers_the_prompt_ids(client: httpx.Client) -> None:
    body = {"messages": SORT, "max_tokens": 4}
    tokens = client.post("/tokenize", json=body).json()
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert tokens["count"] == len(tokens["tokens"]) == usage["prompt_tokens"]


# ---- 7: what would cut a response format's JSON ----------------------------------------


@pytest.mark.parametrize(("field", "value"), [("stop", ["}"]), ("stop", "8"), ("stop_token_ids", [29])])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_stops_with_a_response_format_are_refused(client: httpx.Client, chat: bool, field: str, value: Any) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 64, "response_format": FORMAT, field: value}
    refused = ask(client, chat, body)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported")
    ignore_eos = ask(client, chat, {**body, field: None, "ignore_eos": True}).json()["error"]
    assert error["code"] == ignore_eos["code"]  # refused as ignore_eos is


@pytest.mark.parametrize("text", ["a\U0001f600b", "caf\u00e9 \u00fc", "x \u4e2d\u6587 y", "\U0001f600\U0001f600"])
def test_text_offsets_index_the_answer_across_split_characters(served: Served, text: str) -> None:
    """Completions' `text_offset` summed each token's own text: a character split over byte
    tokens (each alone U+FFFD, together one character) made every later offset overshoot, and
    a stream, restarting each chunk from a decoded prefix, disagreed with the body."""
    from types import SimpleNamespace

    loaded = served.app.state.service.served
    ids = list(loaded.tokenizer.encode(text, add_special_tokens=False))
    assert loaded.decode(ids, ()) == text and any("\ufffd" in loaded.token_text(t) for t in ids)
    responder = SimpleNamespace(served=loaded)
    offsets = Responder._offsets(responder, ids, 0, len(ids), ())  # type: ignore[arg-type]
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    for token, at in zip(ids, offsets):
        piece = loaded.token_text(token)
        if "\ufffd" not in piece:
            assert text[at : at + len(piece)] == piece, (piece, at)
    for start in range(len(ids)):  # a stream's chunk starting at any token agrees with the body
        assert Responder._offsets(responder, ids, start, len(ids), ()) == offsets[start:]  # type: ignore[arg-type]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stream_returns_the_token_ids_on_each_choices_finishing_chunk(client: httpx.Client, chat: bool) -> None:
    """`return_token_ids` with `stream` was accepted and dropped: no chunk carried ids."""
    body = {"messages": SORT, "max_tokens": 16, "return_token_ids": True, "n": 2, "stop": [" 8"]}
    whole = strict(ask(client, chat, body).text)["choices"]
    finishing = [
        c for e in events(ask(client, chat, body, stream=True).text) for c in e.get("choices", []) if c["finish_reason"]
    ]
    assert sorted((c["index"], c["token_ids"]) for c in finishing) == sorted(
        (c["index"], c["token_ids"]) for c in whole
    )
    assert all(c["token_ids"] for c in whole)
