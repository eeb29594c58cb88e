"""`dlm serve` under pressure, as a real process: one running slot and one queue place, a
one-second request timeout; tool calls parsed into OpenAI `tool_calls`; client disconnects.

The checkpoint writes a known token (a whole `<tool_call>...</tool_call>` block) at every
position, so tool-call parsing is checked end to end on real model output.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import session_home
from tests.serving import ServerProcess, fixed_output_checkpoint, ready_server, wait_until

pytestmark = pytest.mark.slow  # every test here starts processes

LONG = {"prompt": "long", "max_tokens": 2000, "block_length": 2000, "steps": 2000}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = fixed_output_checkpoint(tmp_path_factory.mktemp("tool_model") / "tool-model")
    with ready_server(
        [
            str(model),
            "--max-num-seqs",
            "1",
            "--max-queue",
            "1",
            "--request-timeout",
            "1",
            "--max-tokens",
            "2000",
            "--max-steps",
            "2000",
            "--public-metrics",
            "--dtype",
            "float32",
        ],
        session_home(tmp_path_factory),
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tool_calls_are_parsed_into_openai_tool_calls(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="tool-model", messages=MESSAGES, max_tokens=1)
    out = client.chat.completions.create(model="tool-model", messages=MESSAGES, tools=TOOLS, max_tokens=1)
    # The tool definitions reached the model through the chat template.
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Without tools (or with tool_choice none) the same text is plain content.
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith("<tool_call>")
    unparsed = client.chat.completions.create(
        model="tool-model", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert unparsed.choices[0].message.tool_calls is None


def test_streamed_tool_calls(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model="tool-model", messages=MESSAGES, tools=TOOLS, max_tokens=2, stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]  # two blocks, two calls
    assert [c.index for c in calls] == [0, 1]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_tool_calls_false_takes_one_call(client: openai.OpenAI, stream: bool) -> None:
    """`parallel_tool_calls: false` (accepted and ignored before: both blocks became calls):
    the first block is the call, the second stays in the content as the model wrote it."""
    request = dict(model="tool-model", messages=MESSAGES, tools=TOOLS, max_tokens=2, parallel_tool_calls=False)
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        content = "".join(d.content or "" for d in deltas)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**request).choices[0]  # type: ignore[call-overload]
        calls, content, finish = choice.message.tool_calls, choice.message.content, choice.finish_reason
    assert [(c.function.name, c.index if stream else 0) for c in calls] == [("get_weather", 0)]
    assert content.startswith("<tool_call>") and content.count("<tool_call>") == 1
    assert finish == "tool_calls"


def test_queue_full_is_429_at_once_and_timeouts_free_the_slot(server: ServerProcess) -> None:
    results: dict[str, httpx.Response] = {}

    def send(name: str) -> None:
        results[name] = httpx.post(server.url + "/v1/completions", json=LONG, timeout=60)

    before = server.metrics()
    first = threading.Thread(target=send, args=("first",))
    first.start()
    assert wait_until(lambda: server.metrics()["dlm_num_requests_running"] == 1)
    second = threading.Thread(target=send, args=("second",))
    second.start()
    assert wait_until(lambda: server.metrics()["dlm_num_requests_waiting"] == 1)

    with httpx.Client(base_url=server.url, timeout=60) as http:  # connected before the clock starts
        assert http.get("/health").status_code == 200
        refused = http.post("/v1/completions", json=LONG)
    assert refused.status_code == 429, refused.text
    # Refused at once, not after waiting for room: the requests ahead are still where they were.
    m = server.metrics()
    assert m["dlm_num_requests_running"] == 1 and m["dlm_num_requests_waiting"] == 1, m
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert httpx.get(server.url + "/health").status_code == 200  # still serving meanwhile

    first.join(30)
    second.join(30)
    for name in ("first", "second"):
        response = results[name]
        assert response.status_code == 408, response.text
        error = response.json()["error"]
        assert error["type"] == "timeout" and error["code"] == "request_timeout"
    after = server.metrics()
    assert after["dlm_request_timeouts_total"] - before["dlm_request_timeouts_total"] == 2
    assert after['dlm_request_rejections_total{reason="queue_full"}'] >= 1
    assert after["dlm_num_requests_running"] == 0 and after["dlm_num_requests_waiting"] == 0
    timed_out = [line for line in server.request_logs() if line["finish_reason"] == "timeout"]
    assert timed_out and all(line["denoising_steps"] < 2000 for line in timed_out)
    # The freed slot serves the next request.
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}).status_code == 200


def assert_cancelled(server: ServerProcess, before: dict[str, float], disconnects: int) -> None:
    """Within 5 s the server has counted `disconnects` client disconnects since `before` and
    runs no request."""
    counter = "dlm_http_requests_client_disconnected_total"
    assert wait_until(lambda: server.metrics()[counter] == before[counter] + disconnects, timeout=5)
    assert wait_until(lambda: server.metrics()["dlm_num_requests_running"] == 0, timeout=5)


def test_client_disconnect_cancels_the_request(server: ServerProcess) -> None:
    before = server.metrics()
    # Streaming: read the first event, then hang up.
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    # Counted, and it leaves the batch before the next forward (the one in flight finishes first).
    assert_cancelled(server, before, disconnects=1)
    # Not streaming: the client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.3))
    assert_cancelled(server, before, disconnects=2)
    after = server.metrics()
    assert after["dlm_request_timeouts_total"] == before["dlm_request_timeouts_total"]  # cancelled, not timed out
    aborted = [line for line in server.request_logs() if line["finish_reason"] == "abort"]
    assert len(aborted) == 2 and all(line["status"] == 499 for line in aborted)


def test_stop_string_cuts_the_text_and_ends_denoising_early(server: ServerProcess) -> None:
    body = {"prompt": "x", "max_tokens": 64, "block_length": 64, "steps": 64, "stop": ["Paris", "zzz"]}
    for stream in (False, True):
        response = httpx.post(server.url + "/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert response.status_code == 200, response.text
        if stream:
            events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events)
            reason = events[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]
        assert text == '<tool_call>{"name": "get_weather", "arguments": {"city": "'
        assert reason == "stop"
    steps = [line["denoising_steps"] for line in server.request_logs()[-2:]]
    assert all(s < 64 for s in steps), steps  # the answer was complete: the slot was freed


def test_a_request_that_ran_out_of_time_is_not_resent_by_the_openai_sdk(server: ServerProcess) -> None:
    """The SDKs retry a 408 twice by default; a request that spent its `request_timeout` would
    only spend it again (three times the limit before its client learns): its answer says
    `X-Should-Retry: false`, which the SDK obeys."""
    retrying = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=2, timeout=60)
    before = server.metrics()["dlm_request_timeouts_total"]
    long = {key: value for key, value in LONG.items() if key not in ("prompt", "max_tokens")}
    with pytest.raises(openai.APIStatusError) as caught:
        retrying.completions.create(model="tool-model", prompt="long", max_tokens=2000, extra_body=long)
    assert (caught.value.status_code, caught.value.code) == (408, "request_timeout")
    assert caught.value.response.headers["X-Should-Retry"] == "false"
    assert server.metrics()["dlm_request_timeouts_total"] - before == 1


def test_a_streamed_request_that_times_out_ends_with_an_error_event(server: ServerProcess) -> None:
    response = httpx.post(server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30)
    assert response.status_code == 200  # the stream had begun when the deadline passed
    events = [line for line in response.text.splitlines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["type"] == "timeout" and error["code"] == "request_timeout"


def test_a_stream_whose_client_never_reads_is_closed_at_its_deadline(server: ServerProcess) -> None:
    """A canvas stream whose client reads nothing (a tiny receive buffer, never drained)
    stops at the request timeout like any other: the engine ends it, its connection is
    closed without waiting for the unread bytes, and its log line says `undelivered` (408),
    not a 200 (or a delivered error) for an answer nobody received. The server answers meanwhile."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({**LONG, "stream": True, "stream_options": {"include_canvas": True}})
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )

    def undelivered() -> list[dict]:
        return [line for line in server.request_logs() if line.get("outcome") == "undelivered"]

    before = len(undelivered())
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
        sock.connect((host, int(port)))
        sock.sendall((head + body).encode())
        assert wait_until(lambda: len(undelivered()) > before, timeout=60), server.request_logs()[-3:]
        assert httpx.get(server.url + "/health").status_code == 200
        received = b""
        sock.settimeout(30)
        with contextlib.suppress(ConnectionResetError):  # closed without a graceful flush
            while chunk := sock.recv(1 << 16):
                received += chunk
    (line,) = undelivered()[before:]
    assert f"x-request-id: {line['id']}".encode() in received.split(b"\r\n\r\n")[0]
    assert (line["status"], line["stream"]) == (408, True), line
    assert server.metrics()["dlm_request_undelivered_total"] >= 1
