"""ApiClient: one OpenAI-compatible endpoint, its key, and timed streaming calls.

Streaming results carry their timings (time to first text, end to end) because both the
acceptance checks and the load generator need them, measured the same way: from just
before the request is sent to the arrival of the line that carries the data.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dlm.cli.client.sse import SSEError, iter_events, sse_lines
from dlm.cli.client.transport import DeadlineTransport, deadline


@dataclass
class StreamResult:
    """What one streamed request produced, or why it failed."""

    status: int
    text: str = ""
    chunks: int = 0  # events carrying choices
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    ttft: float | None = None  # seconds to the first non-empty text delta
    text_times: list[float] = field(default_factory=list)  # seconds to each non-empty text delta
    e2e: float = 0.0  # seconds to the end of the stream
    error: str | None = None  # framing error, or the error body's message
    content_type: str = ""
    retry_after: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class ChunkShapeError(ValueError):
    """A stream event that is JSON but not an OpenAI chunk (choices not a list of objects,
    text not a string, ...): the message says which field is wrong."""


def delta_text(event: dict[str, Any]) -> tuple[str, str | None]:
    """The text and finish reason of the first choice of a completion or chat chunk;
    `ChunkShapeError` when the chunk is not shaped like one."""
    choices = event.get("choices") or []
    if not choices:
        return "", None
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise ChunkShapeError(f"chunk's choices is not a list of objects: {json.dumps(choices)[:80]}")
    choice = choices[0]
    if "delta" in choice:
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise ChunkShapeError(f"chunk's choices[0].delta is not an object: {json.dumps(delta)[:80]}")
        text, where = delta.get("content") or "", "choices[0].delta.content"
    else:
        text, where = choice.get("text") or "", "choices[0].text"
    if not isinstance(text, str):
        raise ChunkShapeError(f"chunk's {where} is not a string: {json.dumps(text)[:80]}")
    finish = choice.get("finish_reason")
    return text, finish if finish is None else str(finish)


def error_message(response: httpx.Response) -> str:
    """The OpenAI error body's message, or the start of whatever the body was; for a redirect
    (never followed: a client of an API should be given its URL), where it points."""
    location = response.headers.get("location")
    if response.is_redirect and location:
        return f"redirects to {location} (give the URL it names)"
    try:
        body = response.json()
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def openai_error_problem(response: httpx.Response) -> str | None:
    """None when the body is OpenAI's `{"error": {"message", "type", ...}}`, else what is wrong."""
    try:
        body = response.json()
    except ValueError:
        return f"error body is not JSON: {response.text[:80]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return f"error body lacks an 'error' object: {json.dumps(body)[:120]}"
    missing = [k for k in ("message", "type") if not isinstance(error.get(k), str)]
    if missing:
        return f"error object lacks string field(s) {', '.join(missing)}"
    return None


def model_cards(body: Any, where: str) -> list[dict[str, Any]]:
    """The model cards of an OpenAI /v1/models answer `body` (its parsed JSON), each with a
    non-empty string id; a `DlmError` naming what is wrong when it is not such a list (an
    HTML page, a proxy's error, another API on that port). `dlm validate` holds the list to
    the contract on top of this; `dlm loadtest` takes any server that lists its models so."""
    from dlm.engine.errors import DlmError

    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise DlmError(f"{where} is not an OpenAI model list (no 'data' list): {json.dumps(body)[:120]}")
    cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]]
    if len(cards) != len(data):
        raise DlmError(f"{where}: every entry of 'data' needs a string id: {json.dumps(data)[:120]}")
    return cards


def checked_url(url: str) -> str:
    """The base URL of a server, refused (bad usage) unless it is http(s)://HOST[:PORT][/PREFIX]
    with a valid port, and not an OpenAI client's base URL ending in /v1 (the commands add the
    /v1/... paths themselves). Trailing slashes are dropped."""
    from dlm.engine.errors import UsageError

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"URL must start with http:// or https://, got {url!r}")
    try:
        parsed = httpx.URL(url)
        port = parsed.port  # httpx accepts ports past 65535 and wraps them
    except (httpx.InvalidURL, ValueError) as exc:
        raise UsageError(f"URL {url!r} is not a valid URL ({exc})") from None
    if not parsed.host:
        raise UsageError(f"URL {url!r} names no host, e.g. http://127.0.0.1:8000")
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"URL {url!r}: port {port} is outside 1-65535")
    if parsed.query or parsed.fragment:
        raise UsageError(f"URL {url!r}: give the server's base URL, without a query or fragment")
    base = url.rstrip("/")
    if base.endswith("/v1"):
        raise UsageError(
            f"URL {url!r} ends in /v1: give the server's base URL ({base.removesuffix('/v1') or base}); "
            "the checks and requests add /v1/... themselves"
        )
    return base


def finite_seconds(value: float | None, flag: str, *, allow_zero: bool = False) -> None:
    """Refuse (bad usage) a NaN, infinite or non-positive number of seconds for `flag`."""
    import math

    from dlm.engine.errors import UsageError

    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{flag} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, got {value}")


class RequestTooLong(httpx.ReadTimeout):
    """The answer did not end within the request's timeout although bytes kept arriving
    (a trickling head or body, an SSE stream of keep-alive comments), or a read stalled
    until the deadline."""


Verify = ssl.SSLContext | bool  # how https:// servers are checked: True (default CAs), a context, or False


def tls_verify(cacert: Path | None = None, insecure: bool = False) -> Verify:
    """The TLS check for `--cacert FILE` / `--insecure` (validated here, at the boundary):
    httpx's CA bundle by default, FILE's CA (a private one) instead, or no check."""
    from dlm.engine.errors import UsageError

    if cacert is not None and insecure:
        raise UsageError("give --cacert or --insecure, not both")
    if insecure:
        return False
    if cacert is None:
        return True  # httpx's default: the certifi CA bundle
    try:
        return ssl.create_default_context(cafile=str(cacert))
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--cacert {cacert}: not a readable PEM CA file ({exc})") from None


def tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a transport error (a certificate no CA vouches for, a
    handshake with a plain-HTTP port), if that is what it was."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class ApiClient(AbstractContextManager["ApiClient"]):
    """A base URL, an optional API key, a timeout applied to every call, and the TLS check;
    as a context manager (entering gives the client), its connections close on leaving.
    Its transport ends every network wait at the deadline of the call (`DeadlineTransport`).
    Every request says `Cache-Control: no-cache`: validate and loadtest measure the server, not
    a result cache in front of its model (`dlm serve --response-cache-size` answered a later
    run's identical requests with `denoising_steps` 0, and `usage` failed)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_connections: int = 100,
        verify: Verify = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        limits = httpx.Limits(max_connections=max_connections)
        transport = DeadlineTransport(httpx.URL(self.base_url), verify, limits)
        self.http = httpx.Client(
            base_url=self.base_url, timeout=timeout, transport=transport, headers={"Cache-Control": "no-cache"}
        )

    def close(self) -> None:
        self.http.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def headers(self, key: str | None | bool = True) -> dict[str, str]:
        """Authorization header: True = the client's key, False/None = none, str = that key."""
        chosen = self.api_key if key is True else key or None
        return {"Authorization": f"Bearer {chosen}"} if chosen else {}

    def send(self, request: httpx.Request, timeout: float) -> httpx.Response:
        """Send and read the whole answer, head and body, within `timeout` seconds in all:
        httpx's timeout bounds each read, so a server trickling a byte at a time never timed out."""
        with whole_answer_within(request, timeout):
            return read_whole(self.http.send(request, stream=True))

    def get(self, path: str, *, key: str | None | bool = True, timeout: float | None = None) -> httpx.Response:
        limit = timeout or self.timeout
        return self.send(self.http.build_request("GET", path, headers=self.headers(key), timeout=limit), limit)

    def post(
        self,
        path: str,
        body: Any = None,
        *,
        key: str | None | bool = True,
        content: bytes | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        headers = self.headers(key)
        limit = timeout or self.timeout
        if content is not None:
            headers["Content-Type"] = "application/json"
            request = self.http.build_request("POST", path, content=content, headers=headers, timeout=limit)
        else:
            request = self.http.build_request("POST", path, json=body, headers=headers, timeout=limit)
        return self.send(request, limit)

    def stream(self, path: str, body: dict[str, Any], *, keep_events: bool = False) -> StreamResult:
        """POST with `stream: true` and read the SSE stream to its end, timing it; the whole
        stream must end within the client's timeout (httpx's bounds each read only)."""
        body = {**body, "stream": True}
        start = time.perf_counter()
        request = self.http.build_request("POST", path, json=body, headers=self.headers())
        with whole_answer_within(request, self.timeout):
            response = self.http.send(request, stream=True)
            try:
                return self._read_stream(response, start, keep_events)
            finally:
                response.close()

    def _read_stream(self, response: httpx.Response, start: float, keep_events: bool) -> StreamResult:
        """`stream`'s reading of the answer `response`, timed from `start`."""
        result = StreamResult(
            status=response.status_code,
            content_type=response.headers.get("content-type", ""),
            retry_after=response.headers.get("retry-after"),
        )
        if response.status_code != 200:
            result.error = error_message(read_whole(response))
            result.e2e = time.perf_counter() - start
            return result
        if not result.content_type.startswith("text/event-stream"):
            result.error = f"content-type is {result.content_type!r}, not text/event-stream"
        pieces: list[str] = []
        try:
            for event in iter_events(sse_lines(response.iter_text())):
                if keep_events:
                    result.events.append(event)
                if event.get("usage"):
                    if not isinstance(event["usage"], dict):
                        raise ChunkShapeError(f"chunk's usage is not an object: {json.dumps(event['usage'])[:80]}")
                    result.usage = event["usage"]
                if "error" in event:
                    error = event["error"]
                    result.error = str(error.get("message", error) if isinstance(error, dict) else error)
                if not event.get("choices"):
                    continue
                result.chunks += 1
                text, finish = delta_text(event)
                if text:
                    pieces.append(text)
                    result.text_times.append(time.perf_counter() - start)
                    if result.ttft is None:
                        result.ttft = result.text_times[0]
                if finish:
                    result.finish_reason = finish
        except (SSEError, ChunkShapeError) as exc:
            result.error = result.error or str(exc)
        result.text = "".join(pieces)
        result.e2e = time.perf_counter() - start
        return result


def read_whole(response: httpx.Response) -> httpx.Response:
    """`response` read whole, as a plain response; one its transport has read already
    (in-process and mock transports answer whole) is returned as it is: reading its stream
    again raised StreamConsumed."""
    if response.is_stream_consumed:
        return response
    try:
        raw = b"".join(response.iter_raw())
    finally:
        response.close()
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        content=raw,
        request=response.request,
        extensions=response.extensions,
    )


@contextmanager
def whole_answer_within(request: httpx.Request, timeout: float) -> Iterator[None]:
    """Every network wait of the block ends `timeout` seconds from now (`deadline()`), and a
    transport error raised past then is the whole answer's `RequestTooLong`: the transport
    ends the wait under way at the deadline (a trickle, a read that stalled) with httpx's
    own timeout error."""
    with deadline(timeout) as at:
        try:
            yield
        except httpx.TransportError as exc:
            if isinstance(exc, RequestTooLong) or time.perf_counter() < at:
                raise
            raise RequestTooLong(f"the answer did not end within the {timeout:g}s timeout", request=request) from None
