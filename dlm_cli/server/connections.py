"""The listening socket and the HTTP connections: bound before the model loads, idle and
slow clients closed.

The socket is bound first, so a busy port is one `error:` line at once instead of a failure
after the weights have loaded. Connections use uvicorn's h11 protocol with one addition: a
deadline on each request's head. uvicorn's keep-alive timer starts only after a response
and stops at the first byte received, so a client that connects and sends nothing, or sends
its headers a byte at a time, would otherwise hold its connection forever.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.errors import DlmError


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (as uvicorn would bind it), or a DlmError (exit 1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DlmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class HeadDeadlineProtocol(H11Protocol):
    """h11 with `head_timeout`: from the connection's start, and from the end of each
    response, a client has that many seconds to send a complete request head."""

    head_timeout = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # waiting for the next request
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.head_timeout, self._expire)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _expire(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE:
            self.timeout_keep_alive_handler()  # uvicorn's own close of an idle connection


def protocol(head_timeout: float) -> type[HeadDeadlineProtocol]:
    """The protocol class uvicorn instantiates per connection, with this deadline."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout": head_timeout})
