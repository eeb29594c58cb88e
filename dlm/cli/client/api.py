"""ApiClient: one OpenAI-compatible endpoint, its key, and timed streaming calls.

Streaming results carry their timings (time to first text, end to end) because both the
acceptance checks and the load generator need them, measured the same way: from just
before the request is sent to the arrival of the line that carries the data.
"""

from __future__ import annotations

import json
import ssl
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dlm.cli.client.sse import SSEError, iter_events, sse_lines


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


def delta_text(event: dict[str, Any]) -> tuple[str, str | None]:
    """The text and finish reason of the first choice of a completion or chat chunk."""
    choices = event.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    if "delta" in choice:
        text = (choice.get("delta") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    return text, choice.get("finish_reason")


def error_message(response: httpx.Response) -> str:
    """The OpenAI error body's message, or the start of whatever the body was."""
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
    as a context manager (entering gives the client), its connections close on leaving."""

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
        self.http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections),
            verify=verify,
        )

    def close(self) -> None:
        self.http.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def headers(self, key: str | None | bool = True) -> dict[str, str]:
        """Authorization header: True = the client's key, False/None = none, str = that key."""
        chosen = self.api_key if key is True else key or None
        return {"Authorization": f"Bearer {chosen}"} if chosen else {}

    def get(self, path: str, *, key: str | None | bool = True, timeout: float | None = None) -> httpx.Response:
        return self.http.get(path, headers=self.headers(key), timeout=timeout or self.timeout)

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
        if content is not None:
            headers["Content-Type"] = "application/json"
            return self.http.post(path, content=content, headers=headers, timeout=timeout or self.timeout)
        return self.http.post(path, json=body, headers=headers, timeout=timeout or self.timeout)

    def stream(self, path: str, body: dict[str, Any], *, keep_events: bool = False) -> StreamResult:
        """POST with `stream: true` and read the SSE stream to its end, timing it."""
        body = {**body, "stream": True}
        start = time.perf_counter()
        with self.http.stream("POST", path, json=body, headers=self.headers()) as response:
            result = StreamResult(
                status=response.status_code,
                content_type=response.headers.get("content-type", ""),
                retry_after=response.headers.get("retry-after"),
            )
            if response.status_code != 200:
                response.read()
                result.error = error_message(response)
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
                        result.usage = event["usage"]
                    if "error" in event:
                        result.error = str((event.get("error") or {}).get("message", event["error"]))
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
            except SSEError as exc:
                result.error = result.error or str(exc)
            result.text = "".join(pieces)
            result.e2e = time.perf_counter() - start
            return result
