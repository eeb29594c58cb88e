"""`dlm serve` against hostile input, as a real process: a corpus of malformed bodies and a
property-based fuzzer never get a 5xx or a traceback; idle, slow and vanishing clients are
closed and logged; a second SIGTERM exits at once with code 1; a busy port fails before the
model loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import session_home
from tests.serving import ROOT, ServerProcess, ready_server, wait_until

KEY = "sk-harden-1234"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
READ_TIMEOUT = 2  # seconds, for the connection tests; the default is 30

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ready_server(
        ["--api-key", KEY, "--max-tokens", "16", "--max-steps", "16", "--max-model-len", "512", "--public-metrics"],
        session_home(tmp_path_factory),
        env={"DLM_READ_TIMEOUT": str(READ_TIMEOUT)},
    ) as proc:
        yield proc


def post(server: ServerProcess, path: str, raw: bytes) -> httpx.Response:
    return server.http.post(server.url + path, content=raw, headers=AUTH)


def no_tracebacks(server: ServerProcess) -> None:
    logged = "\n".join(server.lines)
    assert "Traceback" not in logged and '"level": "error"' not in logged, logged[-4000:]


def nested_tool(depth: int) -> bytes:
    """A chat body whose tool's parameters nest `depth` JSON-schema objects."""
    node = '{"type": "string"}'
    for _ in range(depth):
        node = '{"type": "object", "properties": {"a": ' + node + "}}"
    tool = '{"type": "function", "function": {"name": "f", "parameters": ' + node + "}}"
    return ('{"messages": [{"role": "user", "content": "hi"}], "tools": [' + tool + "]}").encode()


def chat(content: Any, **extra: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}).encode()


# (path, body, code): each answered 400 with that code.
CORPUS = [
    # the four classes that used to answer 500
    (COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),
    (CHAT, b'{"messages": ' + b'[{"a": ' * 3000 + b"1" + b"}]" * 3000 + b"}", "invalid_json"),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),
    (COMPLETIONS, b'{"prompt": [' + b"1" * 4301 + b"]}", "invalid_json"),
    (COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 2}', "invalid_value"),
    (COMPLETIONS, b'{"prompt": ["\\udfff"], "max_tokens": 2}', "invalid_value"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}', "invalid_value"),
    (CHAT, chat([{"type": "text", "text": "\udc00"}]), "invalid_value"),
    (CHAT, chat("hi", stop=["\ud800"]), "invalid_value"),
    (CHAT, nested_tool(500), "invalid_json"),
    # the rest of the parser's limits
    (COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', "invalid_json"),
    (COMPLETIONS, b'{"prompt": "x", "temperature": 1e999}', "invalid_json"),
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', "invalid_json"),
    (COMPLETIONS, b'{"prompt": "x"', "invalid_json"),
    (COMPLETIONS, b'"just a string"', "invalid_json"),
    # sizes refused before tokenising
    (COMPLETIONS, json.dumps({"prompt": "ab " * 300_000}).encode(), "context_length_exceeded"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}] * 12_000}).encode(), "context_length_exceeded"),
    # a response_format whose schema is not a JSON Schema (a TypeError, a 500, unlogged, before)
    (
        CHAT,
        chat(
            "hi",
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
                },
            },
        ),
        "invalid_value",
    ),
    # token ids no model has
    (COMPLETIONS, b'{"prompt": [99999999999999999999], "max_tokens": 2}', "invalid_value"),
    (COMPLETIONS, b'{"prompt": [-1], "max_tokens": 2}', "invalid_value"),
]


def test_malformed_corpus_gets_400s_no_tracebacks_and_the_server_still_answers(server: ServerProcess) -> None:
    before = len(server.request_logs())
    for path, raw, code in CORPUS:
        response = post(server, path, raw)
        assert response.status_code == 400, (raw[:80], response.text)
        assert response.json()["error"]["code"] == code, (raw[:80], response.text)
    # one request line per refusal, every refusal counted (the log is read from the server's
    # stdout by a thread, so the last line may still be on its way)
    wait_until(lambda: len(server.request_logs()) - before >= len(CORPUS))
    refused = server.request_logs()[before:]
    assert [line["status"] for line in refused] == [400] * len(CORPUS)
    metrics = server.metrics()
    for code in {c for _, _, c in CORPUS}:
        expected = sum(c == code for _, _, c in CORPUS)
        assert metrics[f'dlm_request_rejections_total{{reason="{code}"}}'] >= expected
    no_tracebacks(server)
    normal = post(server, CHAT, chat("hello \U0001f600"))  # a surrogate pair is a character, not an error
    assert normal.status_code == 200, normal.text
    assert normal.json()["choices"][0]["finish_reason"] in ("stop", "length")


LONE = st.sampled_from(["\ud800", "\udbff", "\udc00", "x\udfffy"])
TEXT = st.text(max_size=12) | LONE
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
)
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=12
)
FIELDS = {
    name: JSON | st.integers(min_value=0, max_value=40)
    for name in (
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "steps",
        "refinement_steps",
        "block_length",
        "threshold",
        "stop",
        "stream",
        "cache",
        "decode_mode",
        "tool_choice",
        "response_format",
    )
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"]), "content": TEXT | JSON},
    optional={"tool_calls": JSON, "name": JSON},
)
TOOL = st.fixed_dictionaries({"type": st.just("function") | JSON, "function": JSON})
BODIES = st.one_of(
    st.tuples(
        st.just(COMPLETIONS),
        st.fixed_dictionaries({"prompt": TEXT | st.lists(st.integers(-3, 3000), max_size=6) | JSON}, optional=FIELDS),
    ),
    st.tuples(
        st.just(CHAT),
        st.fixed_dictionaries(
            {"messages": st.lists(MESSAGE, max_size=3) | JSON}, optional={**FIELDS, "tools": st.lists(TOOL, max_size=2)}
        ),
    ),
    st.tuples(st.sampled_from([COMPLETIONS, CHAT]), st.binary(max_size=64)),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(case=BODIES)
def test_fuzzed_bodies_never_get_a_5xx(server: ServerProcess, case: tuple[str, Any]) -> None:
    path, body = case
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # lone surrogates go out as \\udXXX
    response = post(server, path, raw)
    assert response.status_code < 500, (raw[:200], response.text)


def test_no_traceback_after_fuzzing(server: ServerProcess) -> None:
    no_tracebacks(server)


def receive_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by a timeout)."""
    sock.settimeout(30)  # well past read_timeout and the default keep_alive_timeout (5 s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def head_of(length: int) -> str:
    """A completion request's head announcing a body of `length` bytes."""
    return f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {length}\r\n\r\n"


def test_idle_and_slow_clients_are_closed(server: ServerProcess) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    silent = socket.create_connection((host, int(port)))
    slow_head = socket.create_connection((host, int(port)))
    slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    slow_body = socket.create_connection((host, int(port)))
    slow_body.sendall(f"{head_of(100)}{{".encode())
    kept_alive = socket.create_connection((host, int(port)))
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    with silent, slow_head, slow_body, kept_alive:
        assert receive_until_closed(silent) == b""
        assert receive_until_closed(slow_head) == b""
        assert b" 408 " in receive_until_closed(slow_body).split(b"\r\n")[0]
        answer = receive_until_closed(kept_alive)  # answered, then closed when idle
        assert answer.startswith(b"HTTP/1.1 200 ") and b'{"status":"ok"' in answer
    assert server.metrics()['dlm_request_rejections_total{reason="body_timeout"}'] >= 1
    no_tracebacks(server)


def test_request_heads_over_16_kib_are_refused_however_they_arrive(server: ServerProcess) -> None:
    """The documented 16 KiB cap on a request head holds for a head sent whole (h11 checks
    only one still arriving): 431, counted and logged; a 15 KiB head is served."""
    host, port = server.url.removeprefix("http://").split(":")
    body = b'{"prompt": "x", "max_tokens": 2}'

    def ask(padding: int, split: bool = False) -> bytes:
        pad = f"Host: x\r\nConnection: close\r\nX-Pad: {'a' * padding}\r\n"
        head = head_of(len(body)).replace("Host: x\r\n", pad)
        with socket.create_connection((host, int(port))) as sock:
            raw = head.encode() + body
            if split:  # the head in pieces: h11's own bound
                for i in range(0, len(raw), 4096):
                    sock.sendall(raw[i : i + 4096])
            else:
                sock.sendall(raw)
            return receive_until_closed(sock).split(b"\r\n")[0]

    before = len(server.request_logs())
    assert b" 431 " in ask(100_000)
    try:  # h11 refuses a head growing past 16 KiB with a 400 and closes, maybe while we still send
        split = ask(100_000, split=True)
    except (ConnectionResetError, BrokenPipeError):
        split = b"reset"
    assert split == b"reset" or split.split(b" ")[1] in (b"400", b"431"), split
    assert b" 200 " in ask(15_000)
    assert wait_until(lambda: any(line["status"] == 431 for line in server.request_logs()[before:]))
    assert server.metrics()['dlm_request_rejections_total{reason="request_header_fields_too_large"}'] >= 1
    no_tracebacks(server)


def test_a_target_in_absolute_form_is_routed_by_its_path_and_several_hosts_are_refused(
    server: ServerProcess,
) -> None:
    """RFC 9112, 3.2: a server must accept `POST http://host/v1/completions HTTP/1.1` (was a
    404 naming the URL as a route) and refuse a request with several Host headers (h11 does)."""
    host, port = server.url.removeprefix("http://").split(":")
    body = b'{"prompt": "x", "max_tokens": 2}'
    before = len(server.request_logs())

    def ask(target: str, hosts: tuple[str, ...] = ("x",)) -> bytes:
        head = head_of(len(body)).replace(f"POST {COMPLETIONS} ", f"POST {target} ")
        head = head.replace("Host: x\r\n", "".join(f"Host: {h}\r\n" for h in hosts) + "Connection: close\r\n")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + body)
            return receive_until_closed(sock)

    for target in (f"http://{host}:{port}{COMPLETIONS}", f"HTTPS://example.com{COMPLETIONS}"):
        answer = ask(target)
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"object":"text_completion"' in answer, answer[-300:]
    assert b"no route POST / (" in ask("http://example.com")  # no path: "/"
    refused = ask(COMPLETIONS, hosts=("x", "y"))
    assert refused.startswith(b"HTTP/1.1 400 "), refused[-300:]
    assert ask(COMPLETIONS, hosts=("x",)).startswith(b"HTTP/1.1 200 ")
    # Its three answers' lines, each written once delivered (the next test counts lines from here).
    assert wait_until(lambda: [line["status"] for line in server.request_logs()[before:]] == [200, 200, 200])
    no_tracebacks(server)


def test_a_client_leaving_mid_body_is_one_499_line(server: ServerProcess) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    before = len(server.request_logs())
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f'{head_of(1000)}{{"prompt": "'.encode())
    assert wait_until(lambda: len(server.request_logs()) > before)
    assert [line["status"] for line in server.request_logs()[before:]] == [499]
    no_tracebacks(server)


def test_a_busy_port_is_one_error_line_before_loading(tmp_path_factory: pytest.TempPathFactory) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "dlm", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "DLM_HOME": str(session_home(tmp_path_factory))},
        )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"], result.stderr
    assert "Traceback" not in result.stderr and "listening on" not in result.stderr and "loading" not in result.stderr


def test_a_second_sigterm_under_load_exits_1_at_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    proc = ServerProcess(["--max-tokens", "256", "--max-steps", "256"], session_home(tmp_path_factory))
    try:
        proc.wait_ready()
        body = {"prompt": "x", "max_tokens": 256, "block_length": 256, "steps": 256}
        outcomes: list[str] = []

        def request() -> None:
            try:
                outcomes.append(str(proc.http.post(proc.url + COMPLETIONS, json=body, timeout=60).status_code))
            except httpx.HTTPError as exc:  # the connection is cut when the process ends
                outcomes.append(type(exc).__name__)

        clients = [threading.Thread(target=request) for _ in range(4)]
        for client in clients:
            client.start()
        assert wait_until(lambda: proc.metrics()["dlm_num_requests_running"] >= 1, timeout=60)
        proc.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: any("draining" in line for line in proc.lines))
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(30) == 1  # never a signal status (a C++ abort was -6)
        for client in clients:
            client.join(60)
        assert len(outcomes) == 4
        logged = "\n".join(proc.lines)
        assert "second signal" in logged and "terminate called" not in logged and "Traceback" not in logged
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


def test_max_connections_counts_the_connections_served(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--max-connections N` serves N open connections and answers 503 on one more. uvicorn's
    `limit_concurrency` counts the connection asking, so N passed as it is served N - 1:
    `--max-connections 1` started a server that answered every request 503, `/health` too."""
    proc = ServerProcess(["tiny:llada", "--no-warmup", "--max-connections", "1"], session_home(tmp_path_factory))
    try:
        assert wait_until(lambda: any("ready: serving" in line for line in proc.lines), 120), proc.lines
        assert proc.http.get(proc.url + "/health").status_code == 200  # its one connection, kept alive
        host, port = proc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as other:
            other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert other.recv(64).startswith(b"HTTP/1.1 503 ")
        assert proc.http.get(proc.url + "/ready").status_code == 200
    finally:
        proc.http.close()
        assert proc.terminate() == 0, "\n".join(proc.lines)
