"""A small OpenAI-compatible dLLM server for testing `dlm validate` and `dlm loadtest`.

It implements the HTTP contract (design.md section 4) without a model: text is a
deterministic function of the prompt and `usage.denoising_steps` follows the dLLM rules
(steps, one step per block under a tiny threshold). Each `Behaviour` field turns on one
deliberate misbehaviour, so every check can be shown to fail when it should.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MODEL = "fake-dllm"
WORDS = ("tide", "salt", "wave", "foam", "gull", "reef", "kelp", "drift", "swell", "shore")


@dataclass
class Behaviour:
    api_keys: tuple[str, ...] = ()
    status: int | None = None  # every generation request answers this status (a broken server)
    sse: str = "ok"  # ok | ndjson | no_done | no_blank_lines
    random_text: bool = False  # temperature 0 is not deterministic
    stream_text_differs: bool = False  # the stream says something else than the JSON answer
    metrics: bool = True
    max_model_len: int = 2048  # advertised in /v1/models
    accepted_context: int | None = None  # what it really accepts (None: max_model_len)
    ignores_dllm: bool = False  # steps / threshold / block_length have no effect
    refuses_dllm: str | None = None  # steps / threshold / block_length get a 400 with this error code
    lax_validation: bool = False  # invalid parameters crash into a 500
    queue_limit: int | None = None  # in-flight requests beyond this are rejected
    overload_status: int = 429
    retry_after: bool = True
    capacity: int | None = None  # concurrent decodes; more wait (a saturating server)
    step_delay: float = 0.0  # seconds per denoising step
    ready_after: float = 0.0
    answers: dict[str, str] = field(default_factory=dict)  # prompt substring -> canned text
    tool_call: dict[str, Any] | None = None  # chat requests with tools get this call
    leaks_mask: bool = False  # answers end in an undecoded MASK token
    batch_dependent: bool = False  # JSON answers decoded beside other requests come out reversed
    capabilities: tuple[str, ...] = ()  # advertised in /v1/models
    decode_modes: tuple[str, ...] = ("diffusion", "ar")  # decode_mode values answered; others: 400 unsupported
    response_cache: bool = False  # a body answered before is answered again with 0 steps, unless no-cache is asked


def error(
    status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status, headers=headers
    )


class Invalid(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def dllm_steps(body: dict[str, Any], max_tokens: int, b: Behaviour) -> int:
    """Validate the dLLM fields and return the denoising steps they imply."""
    block = body.get("block_length")
    steps = body.get("steps")
    threshold = body.get("threshold")
    if block is not None and (not isinstance(block, int) or block < 1):
        raise Invalid("block_length must be a positive integer")
    blocks = -(-max_tokens // block) if block else 1  # any max_tokens: the last block decoded whole
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise Invalid("steps must be a positive integer")
    if threshold is not None and not (isinstance(threshold, (int, float)) and 0 < threshold <= 1):
        raise Invalid("threshold must be in (0, 1]")
    if body.get("remasking", "low_confidence") not in ("low_confidence", "random"):
        raise Invalid("unknown remasking")
    if body.get("cache", "none") not in ("none", "prefix", "dual", "block"):
        raise Invalid("unknown cache")
    if body.get("response_format") not in (None, {"type": "text"}):  # as a server without structured output
        raise Invalid("response_format is not supported", param="response_format", code="unsupported")
    if body.get("decode_mode", "diffusion") not in b.decode_modes:
        raise Invalid(f"decode_mode {body['decode_mode']!r} is not supported", param="decode_mode", code="unsupported")
    if b.refuses_dllm is not None:
        for name in ("steps", "block_length", "threshold"):
            if body.get(name) is not None:
                raise Invalid(f"{name} is not supported by this model", param=name, code=b.refuses_dllm)
    if b.ignores_dllm:
        return max_tokens
    if threshold is not None:
        return blocks
    # split over the blocks, one step per block at least, one token per step at most
    return max(blocks, min(steps or max_tokens, max_tokens) // blocks * blocks)


def make_app(b: Behaviour) -> FastAPI:
    app = FastAPI()
    started = time.monotonic()
    registry = CollectorRegistry()
    success = Counter("dlm_request_success", "ok requests", ["finish_reason"], registry=registry)
    prompt_tokens = Counter("dlm_prompt_tokens", "prompt tokens", registry=registry)
    generation_tokens = Counter("dlm_generation_tokens", "generated tokens", registry=registry)
    running = Gauge("dlm_num_requests_running", "running", registry=registry)
    Gauge("dlm_num_requests_waiting", "waiting", registry=registry)
    e2e = Histogram("dlm_e2e_request_latency_seconds", "e2e", registry=registry)
    Histogram("dlm_time_to_first_token_seconds", "ttft", registry=registry)
    Histogram("dlm_request_queue_time_seconds", "queue", registry=registry)
    steps_hist = Histogram("dlm_request_denoising_steps", "steps", registry=registry)
    Histogram("dlm_tokens_per_step", "tokens per step", registry=registry)
    Histogram("dlm_step_duration_seconds", "step duration", registry=registry)
    Histogram("dlm_batch_size", "batch size", registry=registry)
    Counter("dlm_request_rejections", "rejections", ["reason"], registry=registry)
    Counter("dlm_request_timeouts", "timeouts", registry=registry)
    Counter("dlm_http_requests_client_disconnected", "disconnects", registry=registry)
    state = {"inflight": 0}
    answered: set[str] = set()  # bodies answered (non-streamed), for `response_cache`
    slots = asyncio.Semaphore(b.capacity) if b.capacity else None

    def authorised(request: Request) -> bool:
        if not b.api_keys:
            return True
        return request.headers.get("authorization", "") in {f"Bearer {k}" for k in b.api_keys}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if time.monotonic() - started < b.ready_after:
            return error(503, "loading", "unavailable")
        return JSONResponse({"status": "ready"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not authorised(request):
            return error(401, "invalid API key", "authentication_error")
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": MODEL,
                        "object": "model",
                        "owned_by": "tests",
                        "max_model_len": b.max_model_len,
                        "capabilities": list(b.capabilities),
                    }
                ],
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        if not b.metrics:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(generate_latest(registry).decode())

    async def generate(request: Request, chat: bool) -> Response:
        if not authorised(request):
            return error(401, "invalid API key", "authentication_error")
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError:
            return error(400, "malformed JSON")
        if b.status is not None:
            return error(b.status, "the server is broken", "internal_error")
        if body.get("model") != MODEL:
            return error(404, f"model {body.get('model')!r} not found", "not_found_error")
        try:
            if chat:
                messages = body["messages"]
                prompt = " ".join(m["content"] for m in messages)
                n_prompt = len(prompt.split()) + 2 * len(messages)
            else:
                prompt = body["prompt"]
                n_prompt = len(prompt.split())
            max_tokens = body.get("max_tokens", 16)
            temperature = body.get("temperature", 1.0)
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise Invalid("max_tokens must be a positive integer")
            if not isinstance(temperature, (int, float)) or temperature < 0:
                raise Invalid("temperature must be >= 0")
            steps = dllm_steps(body, max_tokens, b)
        except (Invalid, KeyError, TypeError) as exc:
            if b.lax_validation:
                return PlainTextResponse("Internal Server Error", status_code=500)
            if isinstance(exc, Invalid) and exc.code is not None:
                return JSONResponse(
                    {
                        "error": {
                            "message": str(exc),
                            "type": "invalid_request_error",
                            "param": exc.param,
                            "code": exc.code,
                        }
                    },
                    status_code=400,
                )
            return error(400, str(exc) or "bad request")
        if n_prompt + max_tokens > (b.accepted_context or b.max_model_len):
            return error(400, "prompt is longer than the context")
        if b.queue_limit is not None and state["inflight"] >= b.queue_limit:
            return error(
                b.overload_status, "queue full", "rate_limit_error", {"Retry-After": "1"} if b.retry_after else None
            )
        text = answer(prompt, max_tokens, b)
        if b.leaks_mask:
            text += "<|mask|>"
        n_out = len(text.split())
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "denoising_steps": steps,
        }

        async def decode(pace: float) -> AsyncIterator[None]:
            """Hold a slot (and the in-flight count) while 'denoising', then count the request."""
            state["inflight"] += 1
            running.inc()
            start = time.monotonic()
            try:
                if slots:
                    await slots.acquire()
                try:
                    for _ in range(steps):
                        await asyncio.sleep(pace)
                        yield None
                finally:
                    if slots:
                        slots.release()
                success.labels("length").inc()
                prompt_tokens.inc(n_prompt)
                generation_tokens.inc(n_out)
                steps_hist.observe(steps)
                e2e.observe(time.monotonic() - start)
            finally:
                state["inflight"] -= 1
                running.dec()

        if body.get("stream"):
            streamed = text[::-1] if b.stream_text_differs else text
            events = stream_events(chat, streamed, usage, body, decode(b.step_delay))
            return StreamingResponse(frame(events, b.sse), media_type="text/event-stream")
        seen = json.dumps(body, sort_keys=True)
        if b.response_cache and "no-cache" not in request.headers.get("cache-control", "") and seen in answered:
            return JSONResponse(completion(chat, text, {**usage, "denoising_steps": 0}, None))
        answered.add(seen)
        peak = 0  # the most requests in flight while this one decoded
        async for _ in decode(b.step_delay):
            peak = max(peak, state["inflight"])
        if b.batch_dependent and peak > 1:
            text = text[::-1]
        tool = b.tool_call if chat and body.get("tools") else None
        return JSONResponse(completion(chat, text, usage, tool))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


def answer(prompt: str, max_tokens: int, b: Behaviour) -> str:
    for key, text in b.answers.items():
        if key in prompt:
            return text
    seed = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16)
    rng = random.Random() if b.random_text else random.Random(seed)
    return "".join(" " + rng.choice(WORDS) for _ in range(max_tokens))


def completion(chat: bool, text: str, usage: dict[str, int], tool: dict[str, Any] | None) -> dict:
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": tool["name"], "arguments": json.dumps(tool["arguments"])},
                    }
                ],
            }
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if tool else "length"}
        return {
            "id": "chatcmpl-0",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [choice],
            "usage": usage,
        }
    return {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": usage,
    }


async def stream_events(
    chat: bool, text: str, usage: dict[str, int], body: dict[str, Any], steps: AsyncIterator[None]
) -> AsyncIterator[dict[str, Any]]:
    """Deltas spread over the denoising steps, a finish chunk, then usage if asked for."""
    pieces = re.findall(r"\s*\S+|\s+$", text)
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str, finish: str | None) -> dict[str, Any]:
        choice = (
            {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": piece, "finish_reason": finish}
        )
        return {"id": "x", "object": kind, "created": 0, "model": MODEL, "choices": [choice]}

    done = 0
    step = 0
    total = usage["denoising_steps"]
    async for _ in steps:
        step += 1
        upto = len(pieces) * step // total
        for piece in pieces[done:upto]:
            yield chunk(piece, None)
        done = max(done, upto)
    for piece in pieces[done:]:
        yield chunk(piece, None)
    yield chunk("", "length")
    if (body.get("stream_options") or {}).get("include_usage"):
        yield {"id": "x", "object": kind, "created": 0, "model": MODEL, "choices": [], "usage": usage}


async def frame(events: AsyncIterator[dict[str, Any]], sse: str) -> AsyncIterator[str]:
    async for event in events:
        data = json.dumps(event)
        yield {"ndjson": f"{data}\n", "no_blank_lines": f"data: {data}\n"}.get(sse, f"data: {data}\n\n")
    if sse != "no_done":
        yield "data: [DONE]\n\n"


@contextmanager
def serve(behaviour: Behaviour | None = None) -> Iterator[str]:
    """Run the fake server on 127.0.0.1 (a free port) in a thread; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            make_app(behaviour or Behaviour()), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def raw_server(answer: Callable[[str, str], Iterator[bytes]]) -> Iterator[str]:
    """A hostile server in a thread: `answer(method, path)` yields the raw bytes sent back
    (status line, headers and body, however broken), with the connection closed after it.
    Yields the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def reply(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                for piece in answer(self.command, self.path):
                    self.wfile.write(piece)
                    self.wfile.flush()
            except OSError:  # the client gave up
                pass
            self.close_connection = True

        do_GET = do_POST = reply

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def http_answer(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    """A complete HTTP/1.0 answer of `body`."""
    return f"HTTP/1.0 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def sse_answer(*events: bytes) -> Iterator[bytes]:
    """An SSE answer whose body is `events` (raw, framing included)."""
    yield b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
    yield from events
