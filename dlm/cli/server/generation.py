"""From a running request to an OpenAI response: one JSON body, or server-sent events.

A request with `n` choices runs as n engine streams (seeds seed, seed+1, ...), answered as
one body whose choices are indexed 0..n-1, or one event stream whose chunks carry their
choice's index. Streaming sends the committed left-to-right prefix: a dLLM commits tokens anywhere in its
block, but text before the first MASK can no longer change, so each step that extends it
becomes one delta, and every OpenAI client can read the stream. A client that opts in
(`stream_options.include_canvas`) also gets one canvas event per denoising step, beside
the same deltas. When the client leaves
(connection closed), the request is cancelled and leaves the batch before the next step.
With `stop` strings, a delta holds back the end of the prefix that could still begin one (as
vLLM does), so the deltas add up to the text a non-streamed answer has, stop strings cut.

A failure nobody anticipated while answering (after the request was submitted) is an answer
too: a 500 in the OpenAI error shape (streaming: an error event before `[DONE]`), logged
`failed` with finish reason `error` and counted in `dlm_request_failures_total`, and the
connection stays open for the client's next request.

Every answer is handed over under the request's deadline (`_Delivery`): its log line says
`answered` only once the client has acknowledged every byte of it (dlm/cli/server/connections.py).
A client that does not read (its socket's buffers full, the server's writes paused) holds at
most a few snapshots of its request (dlm/engine/runtime/async_engine.py) and one output in
the SSE pump; `DELIVERY_GRACE_S` after the deadline, once the engine has ended the request,
its connection is closed without waiting and the request is logged `undelivered` (408),
whatever the engine's finish reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from dlm.cli.server import errors
from dlm.cli.server.answer_json import json_response
from dlm.cli.server.connections import CONNECTION, Connection
from dlm.cli.server.errors import CLIENT_CLOSED, REQUEST_ID, APIError
from dlm.cli.server.logprobs import chat_logprobs, completion_logprobs
from dlm.cli.server.response_cache import CachedAnswer
from dlm.cli.server.service import Job, Outcome, Service
from dlm.cli.server.tools import parse_tool_calls, streamable
from dlm.engine.runtime.async_engine import RequestOutput, RequestStream
from dlm.engine.runtime.request import canvas_json
from dlm.engine.stops import covering

log = logging.getLogger("dlm.server")

DELIVERY_GRACE_S = 2.0  # after the deadline, for an answer's last bytes to reach a client that reads
# How often a written answer's unacknowledged bytes are looked at: soon after the last write
# (an ACK takes a round trip, or a delayed-ACK timer), then less and less often (slow readers).
FLUSH_POLLS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
UNDELIVERED = 408  # the status logged for an answer its client did not read by the deadline

# The openai SDKs resend a 408 (twice, by default) unless its answer says not to: a request
# that spent its `request_timeout` would spend it again, and its client would wait three
# times the limit to learn it failed.
NO_RETRY = {"X-Should-Retry": "false"}

# How the engine's non-success finish reasons reach the client.
_FAILURES = {
    "timeout": (408, "timeout", "request_timeout", "the request exceeded the time limit of {timeout:g}s"),
    "shutdown": (503, "unavailable", "shutdown", "the server shut down before the request finished"),
    "error": (500, "server_error", "engine_error", "the engine failed on this request"),
}


def undecided(text: str, stops: list[str]) -> int:
    """How many of `text`'s last characters could still begin a stop string (the longest
    suffix that is a proper prefix of one): a stream holds them back until the next
    characters decide."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _failure(service: Service, out: RequestOutput) -> APIError | None:
    if out.finish_reason not in _FAILURES:
        return None
    status, kind, code, message = _FAILURES[out.finish_reason]
    message = message.format(timeout=service.config.request_timeout)
    if out.error is not None:  # e.g. which tensor-parallel rank died
        message = f"{message}: {out.error}"
    return APIError(status, message, type=kind, code=code, headers=NO_RETRY if code == "request_timeout" else None)


@dataclass(eq=False)
class Choice:
    """One of a request's `n` choices: its engine stream and what has been sent of it."""

    index: int
    stream: RequestStream
    sent: str = ""  # text streamed so far
    sent_tokens: int = 0  # tokens whose log-probabilities were streamed
    counted: int = 0  # completion tokens behind the text streamed so far (continuous_usage_stats)
    completion_ids: list[int] = field(default_factory=list)
    last: RequestOutput | None = None  # the latest output read: what it had generated by then


class Responder:
    """Builds the bodies of one request for its endpoint (completions or chat), one choice
    per stream (`n`), and writes its log line once what became of the answer is known."""

    def __init__(self, service: Service, job: Job, streams: list[RequestStream], request: Request) -> None:
        self.service, self.job = service, job
        self.choices = [Choice(i, stream) for i, stream in enumerate(streams)]
        assert job.served is not None, "submitted requests know their model"
        self.served = job.served  # the version it runs on, even after a hot swap
        self.request = request
        self.chat = job.endpoint == "chat.completions"
        self.id = answer_id(job)
        self.patience = service.config.request_timeout + 30
        deadlines = [s.request.deadline for s in streams if s.request.deadline is not None]
        self.cutoff = max(deadlines) + DELIVERY_GRACE_S if deadlines else math.inf
        self.connection: Connection | None = request.scope.get("extensions", {}).get(CONNECTION)
        # What the log line says once the answer (or the error answered) is delivered.
        self.pending: tuple[str, int, Outcome] | None = None
        self.cut = False  # the client did not read the answer by the deadline: its connection was closed
        self.logged = False
        self.accounted = False  # `account` ran: the answer's own completion ids are the job's
        # A stream's events (`streaming`): closed once its response has ended, which does not
        # close them when it is cancelled in the middle of a write (the client gone).
        self.events: AsyncGenerator[str, None] | None = None

    @property
    def streams(self) -> list[RequestStream]:
        return [c.stream for c in self.choices]

    def abort(self) -> None:
        for choice in self.choices:
            self.served.engine.abort(choice.stream, "abort")

    def log(self, finish_reason: str, status: int, outcome: Outcome) -> None:
        """Metrics and the log line, once (the first account of the request wins). A request
        ended before its answer was complete (shutdown, timeout, an error, its client gone)
        counts the completion tokens its choices had generated by then (through a stop id),
        of which a stream had sent some: it logged 0 even after deltas reached its client."""
        if not self.logged:
            self.logged = True
            if not self.accounted:
                self.job.completion_ids = [t for c in self.choices if c.last is not None for t in self._ids(c, c.last)]
            self.service.finish(self.job, self.streams, finish_reason, status, outcome)

    # ---- text --------------------------------------------------------------------------

    def text(self, choice: Choice, out: RequestOutput) -> tuple[str, bool]:
        """Decoded prefix cut at the first stop string, and whether a stop string was hit
        (`LoadedModel.stop_cut`). The engine thread ends the request at the step whose prefix
        first holds one (`Service.submit`), so its forwards never depend on when this runs."""
        text, cut = self.served.stop_cut(out.prefix_ids, choice.stream.seq)
        if cut is None:
            return text, False
        if not out.finished:  # ended by the engine already; a snapshot that saw it first changes nothing
            self.served.engine.abort(choice.stream, "stop")
        return text[:cut], True

    def close(self, choice: Choice, out: RequestOutput, text: str, stopped: bool, calls: list[Any]) -> str:
        """A finished choice's completion ids (`kept`: where a stop string cut the text, those
        of the text answered); returns its OpenAI finish reason."""
        ids = self._ids(choice, out)
        choice.completion_ids = ids[: self._kept(choice, ids, text, stopped)]
        return "tool_calls" if calls else ("stop" if stopped else out.finish_reason or "length")

    def _ids(self, choice: Choice, out: RequestOutput) -> list[int]:
        """`out`'s completion ids: through the first stop id (EOS, stop_token_ids)."""
        return self.served.completion_ids(out.prefix_ids, choice.stream.seq.stop_ids)

    def _kept(self, choice: Choice, ids: list[int], text: str, stopped: bool) -> int:
        """How many of a finished choice's completion `ids` its answer keeps: all of them, or
        where a stop string cut the text, the fewest that spell `text` (`_covering`)."""
        return self._covering(choice, ids, len(text)) if stopped else len(ids)

    def _covering(self, choice: Choice, ids: list[int], chars: int, start: int = 0) -> int:
        """The fewest of `ids` (at least `start`) that spell `chars` characters (`covering`)."""
        return covering(self.served.text_of(choice.stream.seq), ids, chars, start)

    def account(self, texts: list[str], reasons: list[str]) -> None:
        """The answer is complete (every choice finished): what its log line will say once
        it is delivered (`deliver`)."""
        job = self.job
        self.accounted = True
        job.completion_ids = [t for c in self.choices for t in c.completion_ids]
        job.output_text = texts[0] if len(texts) == 1 else json.dumps(texts, ensure_ascii=False)
        self.pending = (reasons[0], 200, "answered")

    # ---- delivery ----------------------------------------------------------------------

    async def deliver(self, response: Response, scope: Scope, receive: Receive, send: Send) -> None:
        """Send `response` and log what became of the answer (`pending`): as it says once the
        client has received every byte; `client_closed` (499) if it left first; `undelivered`
        (408) if it had not received it by the deadline (+ grace), when its connection is
        closed at once."""
        connection = self.connection
        written = asyncio.Event()  # the last byte was written while the client was connected

        async def watched(message: Message) -> None:
            await send(message)
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            if last and (connection is None or not connection.lost):
                self.job.written = time.monotonic()  # its latency ends here, not at the client's ACK
                written.set()

        sending = asyncio.ensure_future(response(scope, receive, watched))
        try:
            outcome = await self._watch(sending, written)
        finally:
            if not sending.done():
                sending.cancel()
        error = sending.exception() if sending.done() and not sending.cancelled() else None
        try:
            if error is not None:  # a failure of the response itself: the app's handler answers it
                self.abort()
                self.log("error", errors.INTERNAL.status, "failed")
                raise error
        finally:
            if sending.done() and self.events is not None:  # its `finally` ends the request (and logs it) now
                await self.events.aclose()
        if outcome != "undelivered" and self.pending is not None:  # (else: logged already)
            reason, status, received = self.pending
            if outcome == "answered":
                self.log(reason, status, received)
            else:
                self.log(reason, CLIENT_CLOSED, outcome)

    async def _watch(self, sending: asyncio.Future[None], written: asyncio.Event) -> Outcome:
        connection = self.connection
        until_cutoff = self.cutoff - time.monotonic()
        await asyncio.wait({sending}, timeout=max(0.0, until_cutoff) if until_cutoff < math.inf else None)
        polls = 0
        while True:
            if sending.done():
                if connection is None:  # an in-process client (tests): nothing is buffered
                    return "answered"
                if not written.is_set():
                    return "client_closed"
                if not connection.unsent:
                    return "answered"
                if connection.lost:
                    return "client_closed"
            if time.monotonic() >= self.cutoff and connection is not None and self._engine_done():
                self.cut = True  # logged first: the events still queued are never sent
                reason = self.pending[0] if self.pending else self.streams[0].seq.finish_reason or "abort"
                self.log(reason, UNDELIVERED, "undelivered")
                connection.close_now()  # the stream's task sees the disconnect and ends
                await asyncio.wait({sending}, timeout=DELIVERY_GRACE_S)
                return "undelivered"
            await asyncio.wait({sending}, timeout=FLUSH_POLLS_S[min(polls, len(FLUSH_POLLS_S) - 1)])
            polls += 1

    def _engine_done(self) -> bool:
        """Every choice has ended in the engine (past the deadline it ends them by timeout)."""
        return all(stream.finished_at is not None for stream in self.streams)

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.job.prompt_ids), len(self.job.completion_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "denoising_steps": sum(stream.seq.nfe for stream in self.streams),
        }

    def _head(self) -> dict[str, Any]:
        return body_head(self.service, self.job)

    def logprobs(
        self, choice: Choice, out: RequestOutput, text: str, stopped: bool, final: bool = True
    ) -> dict[str, Any] | None:
        """The log-probabilities of the tokens of `out` not yet sent for `choice`: those its
        answer keeps (`close`) when `final`, else those that spell the streamed `text`."""
        if out.logprobs is None:
            return None
        stops = choice.stream.seq.stop_ids
        ids = self._ids(choice, out)
        if final:
            end = self._kept(choice, ids, text, stopped)
        else:
            end = self._covering(choice, ids, len(text), choice.sent_tokens)
        tokens = out.logprobs[choice.sent_tokens : end]
        start = choice.sent_tokens
        choice.sent_tokens = max(choice.sent_tokens, end)
        if self.chat:
            return chat_logprobs(tokens, self.served.token_text, self.served.token_bytes)
        return completion_logprobs(tokens, self.served.token_text, self._offsets(ids, start, end, stops))

    def _offsets(self, ids: list[int], start: int, end: int, stops: Any) -> list[int]:
        """`text_offset` of tokens start..end-1: where each begins in the answer's text. Summing
        the tokens' own texts overshot after a character split over byte-level tokens (each
        alone reads U+FFFD; together one character), and a stream, restarting each chunk from
        a decoded prefix, then disagreed with the body. A token that is part of a character
        begins where that character does; only there is the prefix decoded again."""

        def decoded(k: int) -> int:
            return len(self.served.decode(ids[:k], stops).rstrip("\ufffd"))

        offsets, at, after_part = [], decoded(start), False
        for k in range(start, end):
            offsets.append(at)
            piece = self.served.token_text(ids[k])
            part = "\ufffd" in piece
            at = decoded(k + 1) if part or after_part else at + len(piece)
            after_part = part
        return offsets

    def fail(self, exc: Exception) -> Response:
        """A failure nobody anticipated while answering (the caller logs its traceback): the
        request leaves the batch, and its 500 is delivered and logged `failed`."""
        self.abort()
        self.pending = ("error", errors.INTERNAL.status, "failed")
        return _Delivery(self, self.service.internal_error(exc).response(self.job.id))

    # ---- one JSON body -----------------------------------------------------------------

    async def respond(self) -> Response:
        waiter = asyncio.create_task(self._finals())
        watcher = asyncio.create_task(_disconnected(self.request))
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            self.abort()
            self.log("abort", CLIENT_CLOSED, "client_closed")
            return Response(status_code=CLIENT_CLOSED)
        watcher.cancel()
        finals = waiter.result()
        for out, _, _ in finals:
            error = _failure(self.service, out)
            if error is not None:
                self.pending = (out.finish_reason or "error", error.status, "failed")
                return _Delivery(self, error.response(self.job.id))
        # Off the event loop: an answer of n choices with logprobs is hundreds of thousands
        # of entries and tens of MB of JSON, a second of CPU that would stall every route.
        return _Delivery(self, await asyncio.to_thread(self._answer, finals))

    def _answer(self, finals: list[tuple[RequestOutput, str, bool]]) -> Response:
        """The body of a finished request's choices, rendered (on a worker thread)."""
        bodies, texts, reasons = [], [], []
        for choice, (out, text, stopped) in zip(self.choices, finals):
            body: dict[str, Any] = {"index": choice.index, "logprobs": self.logprobs(choice, out, text, stopped)}
            calls: list[Any] = []
            if self.chat:
                content = text
                if self.job.tools:
                    content, calls = parse_tool_calls(text, self.job.most_tool_calls)
                message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
                if calls:
                    message["tool_calls"] = calls
                body["message"] = message
            else:
                body["text"] = (self.job.echo or "") + text
            body["finish_reason"] = self.close(choice, out, text, stopped, calls)
            if self.job.return_token_ids:
                body["token_ids"] = choice.completion_ids
            bodies.append(body)
            texts.append(text)
            reasons.append(body["finish_reason"])
        self.account(texts, reasons)
        usage = self.usage()
        if self.job.cache_key is not None:  # answered again without a forward: no steps
            kept = {**usage, "denoising_steps": 0}
            answer = CachedAnswer(bodies, kept, self.job.completion_ids, self.job.output_text, reasons[0])
            self.service.response_cache.put(self.job.cache_key, answer)
        body = {**self._head(), "choices": bodies, "usage": usage}
        return json_response(body, headers={REQUEST_ID: self.job.id})

    async def _finals(self) -> list[tuple[RequestOutput, str, bool]]:
        return list(await asyncio.gather(*(self._final(c) for c in self.choices)))

    async def _final(self, choice: Choice) -> tuple[RequestOutput, str, bool]:
        async for out in choice.stream.outputs(self.patience):
            choice.last = out
            text, stopped = self.text(choice, out)
            if out.finished:
                return out, text, stopped
        raise AssertionError("unreachable: outputs() ends with a finished output")

    # ---- server-sent events ------------------------------------------------------------

    def streaming(self) -> Response:
        self.events = self._events()
        events = StreamingResponse(
            self.events,
            media_type="text/event-stream",
            headers={REQUEST_ID: self.job.id, "Cache-Control": "no-cache"},
        )
        return _Delivery(self, events)

    def _chunk(
        self,
        choice: Choice,
        delta: str | dict[str, Any],
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        token_ids: list[int] | None = None,
    ) -> str:
        body: dict[str, Any] = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            body["token_ids"] = token_ids
        if self.chat:
            body["delta"] = delta if isinstance(delta, dict) else {"content": delta}
        else:
            body["text"] = delta
        payload = {**self._head(), "choices": [body]}
        if self.chat:
            payload["object"] = "chat.completion.chunk"
        if self.job.continuous_usage:
            payload["usage"] = self._usage_so_far(choice)
        return _sse(payload)

    def _usage_so_far(self, choice: Choice) -> dict[str, int]:
        """A chunk's usage under `continuous_usage_stats`: its choice's tokens behind the text
        streamed so far (`Choice.counted`) and the forwards spent so far, per choice as vLLM
        counts them; the final usage chunk (`include_usage`) sums every choice."""
        prompt = len(self.job.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": choice.counted,
            "total_tokens": prompt + choice.counted,
            "denoising_steps": 0 if choice.last is None else choice.last.nfe,
        }

    async def _outputs(self) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
        """Every choice's outputs as they come, until each has finished. One waits here at
        most: while the client does not read, the streams keep (and drop) the rest."""
        queue: asyncio.Queue[tuple[Choice, RequestOutput]] = asyncio.Queue(maxsize=1)

        async def pump(choice: Choice) -> None:
            async for out in choice.stream.outputs(self.patience):
                await queue.put((choice, out))

        pumps = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            left = len(self.choices)
            while left:
                choice, out = await queue.get()
                choice.last = out
                left -= out.finished
                yield choice, out
        finally:
            for task in pumps:
                task.cancel()

    def _canvas(self, choice: Choice, out: RequestOutput) -> str:
        """A canvas event (opt-in: stream_options.include_canvas) of one choice: every answer
        position after this step, committed, provisional (the step's proposal, not yet
        committed) or masked, each with its token's text. Documented in docs/serve.md."""
        assert out.canvas is not None
        text = None if self.served.tokenizer is None else self.served.token_text
        kind = "chat.completion.canvas" if self.chat else "text_completion.canvas"
        canvas = {"index": choice.index, **canvas_json(out.nfe, out.canvas, text)}
        return _sse({**self._head(), "object": kind, "canvas": canvas})

    async def _events(self) -> AsyncGenerator[str, None]:
        completed = False
        first_token = False
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        outputs = self._outputs()
        try:
            for choice in self.choices:
                if self.chat:
                    yield self._chunk(choice, {"role": "assistant", "content": ""})
                elif self.job.echo:
                    yield self._chunk(choice, self.job.echo)
            async for choice, out in outputs:
                text, stopped = self.text(choice, out)
                if out.canvas is not None and out.error is None:
                    yield self._canvas(choice, out)
                if not out.finished:
                    visible = text.rstrip("\ufffd")  # a partial UTF-8 character waits for its bytes
                    if not stopped:  # what may yet begin a stop string waits for what follows
                        visible = visible[: len(visible) - undecided(visible, self.job.stops)]
                    if self.job.tools:
                        visible = streamable(visible)
                    sent = choice.sent
                    if len(visible) > len(sent) and visible.startswith(sent):
                        if not first_token:
                            first_token = True
                            self.service.metrics.ttft.observe(time.monotonic() - self.job.arrival)
                        logprobs = self.logprobs(choice, out, visible, stopped, final=False)
                        if self.job.continuous_usage:
                            choice.counted = self._covering(choice, self._ids(choice, out), len(visible))
                        yield self._chunk(choice, visible[len(sent) :], logprobs=logprobs)
                        choice.sent = visible
                    continue
                error = _failure(self.service, out)
                if error is not None:
                    completed = True
                    self.abort()
                    self.pending = (out.finish_reason or "error", error.status, "failed")
                    yield _sse(error.body())
                    yield "data: [DONE]\n\n"
                    return
                sent = choice.sent
                content, calls = parse_tool_calls(text, self.job.most_tool_calls) if self.job.tools else (text, [])
                rest = content[len(sent) :] if content.startswith(sent) else ""
                if (rest or calls) and not first_token:
                    first_token = True
                    self.service.metrics.ttft.observe(time.monotonic() - self.job.arrival)
                logprobs = self.logprobs(choice, out, text, stopped)
                reasons[choice.index] = self.close(choice, out, text, stopped, calls)
                choice.counted = len(choice.completion_ids)
                if rest or (logprobs is not None and (logprobs.get("content") or logprobs.get("tokens"))):
                    yield self._chunk(choice, rest, logprobs=logprobs)
                if calls:
                    yield self._chunk(choice, {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
                texts[choice.index] = text
                # return_token_ids: all of the choice's ids on its finishing chunk (they were dropped)
                ids = choice.completion_ids if self.job.return_token_ids else None
                yield self._chunk(choice, {} if self.chat else "", finish_reason=reasons[choice.index], token_ids=ids)
            completed = True
            order = sorted(texts)
            self.account([texts[i] for i in order], [reasons[i] for i in order])
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
        except Exception as exc:  # nobody anticipated it: an error event (logged, counted), not a broken stream
            log.exception("unhandled error")
            completed = True
            self.abort()
            self.pending = ("error", errors.INTERNAL.status, "failed")
            yield _sse(self.service.internal_error(exc).body())
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()  # its choices' readers stop now (`async for` leaves it open)
            if not completed:  # the client went away, or was cut off (the response task was cancelled)
                self.abort()
                if not self.cut:
                    self.log("abort", CLIENT_CLOSED, "client_closed")


class _Delivery(Response):
    """A response sent under its request's deadline, logged once its fate is known
    (`Responder.deliver`)."""

    def __init__(self, responder: Responder, response: Response) -> None:
        super().__init__(status_code=response.status_code)
        self.responder, self.response = responder, response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.responder.deliver(self.response, scope, receive, send)


def answer_id(job: Job) -> str:
    return ("chatcmpl-" if job.endpoint == "chat.completions" else "cmpl-") + job.id


def body_head(service: Service, job: Job) -> dict[str, Any]:
    """The fields an answer's body opens with: its id, kind, time and model."""
    kind = "chat.completion" if job.endpoint == "chat.completions" else "text_completion"
    return {"id": answer_id(job), "object": kind, "created": job.created, "model": service.model_name}


def cached_response(service: Service, job: Job, answer: CachedAnswer) -> Response:
    """The answer the response cache kept, under this request's own id and time (call it off
    the event loop: `json_response`)."""
    service.finish_cached(job, answer)
    body = {**body_head(service, job), "choices": answer.choices, "usage": answer.usage}
    return json_response(body, headers={REQUEST_ID: job.id})


def _sse(payload: dict[str, Any]) -> str:
    """One event; a value JSON cannot carry (NaN, infinity) is an error, never invalid JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
