"""An httpx transport whose every network wait ends at the deadline of the answer being read.

httpx's timeouts bound each connect, read and write alone, so a server that trickles its
answer a byte at a time, head or body, is never timed out. `DeadlineTransport` is built from
httpcore's public parts (a connection pool, or an HTTP proxy's pool, over a network backend);
its streams cut each wait at the deadline that `deadline()` sets for the calls made inside
its block, and raise httpcore's timeout once the deadline has passed. Outside such a block,
every wait is httpx's alone. The deadline is a context variable: each thread has its own.
"""

from __future__ import annotations

import ssl
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

_DEADLINE: ContextVar[float | None] = ContextVar("dlm_client_deadline", default=None)


@contextmanager
def deadline(seconds: float) -> Iterator[float]:
    """Every network wait in the block ends `seconds` from now (on `time.perf_counter`'s clock,
    which the block is given)."""
    at = time.perf_counter() + seconds
    token = _DEADLINE.set(at)
    try:
        yield at
    finally:
        _DEADLINE.reset(token)


def _wait(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float | None:
    """`timeout` cut to what is left before the deadline; `expired` once none is left."""
    at = _DEADLINE.get()
    if at is None:
        return timeout
    left = at - time.perf_counter()
    if left <= 0:
        raise expired("the deadline of the answer has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A network stream whose reads, writes and TLS handshakes end at the deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self.inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, _wait(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, _wait(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        wait = _wait(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self.inner.start_tls(ssl_context, server_hostname, wait))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's own synchronous backend, its connections and streams held to the deadline."""

    def __init__(self) -> None:
        self.inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        wait = _wait(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self.inner.connect_tcp(host, port, wait, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
    ) -> httpcore.NetworkStream:
        wait = _wait(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self.inner.connect_unix_socket(path, wait, socket_options))

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


@contextmanager
def _as_httpx_errors() -> Iterator[None]:
    """httpcore's errors as httpx's of the same name (httpx's public classes mirror them), so
    callers catch httpx's as they do with httpx's own transport."""
    try:
        yield
    except Exception as exc:
        for kind in type(exc).__mro__:
            twin = getattr(httpx, kind.__name__, None) if getattr(httpcore, kind.__name__, None) is kind else None
            if isinstance(twin, type) and issubclass(twin, httpx.TransportError):
                raise twin(str(exc)) from exc
        raise


class _Body(httpx.SyncByteStream):
    """An httpcore answer's body as an httpx response stream."""

    def __init__(self, answer: httpcore.Response) -> None:
        self.answer = answer

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx_errors():
            yield from self.answer.iter_stream()

    def close(self) -> None:
        with _as_httpx_errors():
            self.answer.close()


def env_proxy(url: httpx.URL) -> httpx.URL | None:
    """The proxy the environment names for `url` (`HTTP(S)_PROXY`, `ALL_PROXY`, less
    `NO_PROXY`), as httpx's own transport would take it; None for a direct connection."""
    proxies = urllib.request.getproxies()
    chosen = proxies.get(url.scheme) or proxies.get("all")
    if not chosen or urllib.request.proxy_bypass(url.host):
        return None
    proxy = httpx.URL(chosen if "://" in chosen else f"http://{chosen}")
    if proxy.scheme not in ("http", "https"):
        from dlm.engine.errors import UsageError

        raise UsageError(f"proxy {chosen!r} (from the environment): only http:// and https:// proxies are supported")
    return proxy


class DeadlineTransport(httpx.BaseTransport):
    """httpx's default transport (TLS check `verify`, `limits`, the environment's proxy for
    `url`) over `_DeadlineBackend`: its waits end at the deadline of `deadline()`."""

    def __init__(self, url: httpx.URL, verify: ssl.SSLContext | bool, limits: httpx.Limits) -> None:
        shared: dict[str, Any] = {
            "ssl_context": httpx.create_ssl_context(verify=verify),
            "max_connections": limits.max_connections,
            "max_keepalive_connections": limits.max_keepalive_connections,
            "keepalive_expiry": limits.keepalive_expiry,
            "network_backend": _DeadlineBackend(),
        }
        proxy = env_proxy(url)
        self.pool: httpcore.ConnectionPool
        if proxy is None:
            self.pool = httpcore.ConnectionPool(**shared)
        else:
            auth = (proxy.username, proxy.password) if proxy.username else None
            bare = proxy.copy_with(username=None, password=None)
            self.pool = httpcore.HTTPProxy(proxy_url=str(bare), proxy_auth=auth, **shared)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)  # a sync client's request
        target = httpcore.URL(
            scheme=request.url.raw_scheme,
            host=request.url.raw_host,
            port=request.url.port,
            target=request.url.raw_path,
        )
        sent = httpcore.Request(
            request.method, target, headers=request.headers.raw, content=request.stream, extensions=request.extensions
        )
        with _as_httpx_errors():
            answer = self.pool.handle_request(sent)
        return httpx.Response(answer.status, headers=answer.headers, stream=_Body(answer), extensions=answer.extensions)

    def close(self) -> None:
        self.pool.close()
