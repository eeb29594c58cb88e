"""From a running request to an OpenAI response: one JSON body, or server-sent events.

Streaming sends the committed left-to-right prefix: a dLLM commits tokens anywhere in its
block, but text before the first MASK can no longer change, so each step that extends it
becomes one delta, and every OpenAI client can read the stream. A client that opts in
(`stream_options.include_canvas`) also gets one canvas event per denoising step, beside
the same deltas. When the client leaves
(connection closed), the request is cancelled and leaves the batch before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dlm_cli.server.errors import CLIENT_CLOSED, APIError
from dlm_cli.server.service import Job, Service
from dlm_cli.server.tools import parse_tool_calls, streamable
from engine.runtime.async_engine import RequestOutput, RequestStream
from engine.runtime.request import canvas_json

# How the engine's non-success finish reasons reach the client.
_FAILURES = {
    "timeout": (408, "timeout", "request_timeout", "the request exceeded the time limit of {timeout:g}s"),
    "shutdown": (503, "unavailable", "shutdown", "the server shut down before the request finished"),
    "error": (500, "server_error", "engine_error", "the engine failed on this request"),
}


def find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _failure(service: Service, out: RequestOutput) -> APIError | None:
    if out.finish_reason not in _FAILURES:
        return None
    status, kind, code, message = _FAILURES[out.finish_reason]
    message = message.format(timeout=service.config.request_timeout)
    if out.error is not None:  # e.g. which tensor-parallel rank died
        message = f"{message}: {out.error}"
    return APIError(status, message, type=kind, code=code)


class Responder:
    """Builds the bodies of one request for its endpoint (completions or chat)."""

    def __init__(self, service: Service, job: Job, stream: RequestStream) -> None:
        self.service, self.job, self.stream = service, job, stream
        assert job.served is not None, "submitted requests know their model"
        self.served = job.served  # the version it runs on, even after a hot swap
        self.chat = job.endpoint == "chat.completions"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + job.id
        self.patience = service.config.request_timeout + 30

    # ---- text --------------------------------------------------------------------------

    def text(self, out: RequestOutput) -> tuple[str, bool]:
        """Decoded prefix cut at the first stop string, and whether a stop string was hit."""
        text = self.served.decode(out.prefix_ids)
        cut = find_stop(text, self.job.stops)
        if cut is None:
            return text, False
        if not out.finished:  # the answer is complete: free the slot now
            self.served.engine.abort(self.stream, "stop")
        return text[:cut], True

    def close(self, out: RequestOutput, text: str, stopped: bool, calls: list[Any]) -> str:
        """Account for a finished request; returns the OpenAI finish reason."""
        reason = "tool_calls" if calls else ("stop" if stopped else out.finish_reason or "length")
        job = self.job
        job.completion_ids = self.served.completion_ids(out.prefix_ids)
        job.output_text = text
        self.service.finish(job, self.stream, reason, 200)
        return reason

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.job.prompt_ids), len(self.job.completion_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "denoising_steps": self.stream.seq.nfe,
        }

    def _head(self) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.job.created, "model": self.service.model_name}

    # ---- one JSON body -----------------------------------------------------------------

    async def respond(self, request: Request) -> Response:
        waiter = asyncio.create_task(self._final())
        watcher = asyncio.create_task(_disconnected(request))
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            self.served.engine.abort(self.stream, "abort")
            self.service.finish(self.job, self.stream, "abort", CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        watcher.cancel()
        out, text, stopped = waiter.result()
        error = _failure(self.service, out)
        if error is not None:
            self.service.finish(self.job, self.stream, out.finish_reason or "error", error.status)
            return error.response()
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        calls: list[Any] = []
        if self.chat:
            content = text
            if self.job.tools:
                content, calls = parse_tool_calls(text)
                content = content.strip() if calls else content
            message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            choice["message"] = message
        else:
            choice["text"] = text
        choice["finish_reason"] = self.close(out, text, stopped, calls)
        if self.job.return_token_ids:
            choice["token_ids"] = self.job.completion_ids
        body = {**self._head(), "choices": [choice], "usage": self.usage()}
        return JSONResponse(body, headers={"X-Request-Id": self.job.id})

    async def _final(self) -> tuple[RequestOutput, str, bool]:
        async for out in self.stream.outputs(self.patience):
            text, stopped = self.text(out)
            if out.finished:
                return out, text, stopped
        raise AssertionError("unreachable: outputs() ends with a finished output")

    # ---- server-sent events ------------------------------------------------------------

    def streaming(self) -> StreamingResponse:
        return StreamingResponse(
            self._events(),
            media_type="text/event-stream",
            headers={"X-Request-Id": self.job.id, "Cache-Control": "no-cache"},
        )

    def _chunk(self, delta: str | dict[str, Any], finish_reason: str | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = delta if isinstance(delta, dict) else {"content": delta}
        else:
            choice["text"] = delta
        body = {**self._head(), "choices": [choice]}
        if self.chat:
            body["object"] = "chat.completion.chunk"
        return _sse(body)

    def _canvas(self, out: RequestOutput) -> str:
        """A canvas event (opt-in: stream_options.include_canvas): every answer position
        after this step, committed, provisional (the step's proposal, not yet committed) or
        masked, each with its token's text. Documented in docs/serve.md."""
        assert out.canvas is not None
        text = None if self.served.tokenizer is None else (lambda token: self.served.decode([token]))
        kind = "chat.completion.canvas" if self.chat else "text_completion.canvas"
        return _sse({**self._head(), "object": kind, "canvas": canvas_json(out.nfe, out.canvas, text)})

    async def _events(self) -> AsyncIterator[str]:
        sent = ""
        completed = False
        first_token = False
        try:
            if self.chat:
                yield self._chunk({"role": "assistant", "content": ""})
            async for out in self.stream.outputs(self.patience):
                text, stopped = self.text(out)
                if out.canvas is not None and out.error is None:
                    yield self._canvas(out)
                if not out.finished:
                    visible = text.rstrip("\ufffd")  # a partial UTF-8 character waits for its bytes
                    if self.job.tools:
                        visible = streamable(visible)
                    if len(visible) > len(sent) and visible.startswith(sent):
                        if not first_token:
                            first_token = True
                            self.service.metrics.ttft.observe(time.monotonic() - self.job.arrival)
                        yield self._chunk(visible[len(sent) :])
                        sent = visible
                    continue
                error = _failure(self.service, out)
                if error is not None:
                    completed = True
                    self.service.finish(self.job, self.stream, out.finish_reason or "error", error.status)
                    yield _sse(error.body())
                    yield "data: [DONE]\n\n"
                    return
                content, calls = parse_tool_calls(text) if self.job.tools else (text, [])
                rest = content[len(sent) :] if content.startswith(sent) else ""
                if calls:
                    rest = rest.rstrip()
                if (rest or calls) and not first_token:
                    self.service.metrics.ttft.observe(time.monotonic() - self.job.arrival)
                if rest:
                    yield self._chunk(rest)
                if calls:
                    yield self._chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
                completed = True
                reason = self.close(out, text, stopped, calls)
                yield self._chunk({} if self.chat else "", finish_reason=reason)
                if self.job.include_usage:
                    yield _sse(
                        {
                            **self._head(),
                            "object": "chat.completion.chunk" if self.chat else "text_completion",
                            "choices": [],
                            "usage": self.usage(),
                        }
                    )
                yield "data: [DONE]\n\n"
        finally:
            if not completed:  # the client went away (the response task was cancelled)
                self.served.engine.abort(self.stream, "abort")
                self.service.finish(self.job, self.stream, "abort", CLIENT_CLOSED)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
