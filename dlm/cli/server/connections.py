"""The listening socket and the HTTP connections: bound before the model loads, idle and
slow clients closed, request heads bounded, and responses able to see their connection.

The socket is bound first, so a busy port is one `error:` line at once instead of a failure
after the weights have loaded. Connections use uvicorn's h11 protocol with one addition: a
deadline on each request's head. uvicorn's keep-alive timer starts only after a response
and stops at the first byte received, so a client that connects and sends nothing, or sends
its headers a byte at a time, would otherwise hold its connection forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dlm.engine.errors import DlmError

# The largest request head (request line and headers) accepted: h11's bound on a head still
# arriving, which h11 does not apply to one that arrives whole (`head_bytes` then does).
MAX_HEAD_BYTES = 16 * 1024
CONNECTION = "dlm.connection"  # the ASGI scope extension holding the request's `Connection`


class Connection:
    """What a response may know and do of its connection: the bytes written that the client
    has not received (a client that does not read leaves them here, and its connection open),
    and a close that does not wait for them."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.lost = False
        self._unsent_at_loss = 0

    @property
    def unsent(self) -> int:
        """Bytes written and not yet acknowledged by the client: those the transport still
        holds, and those in the kernel's send queue (which holds megabytes: without them a
        client that reads nothing would seem to have received a small answer). Once the
        connection is lost: what was unacknowledged then."""
        if self.lost:
            return self._unsent_at_loss
        return self._transport.get_write_buffer_size() + _unacknowledged(self._transport.get_extra_info("socket"))

    def on_lost(self) -> None:
        """The connection ended (its socket still open): remember what the client never got."""
        self._unsent_at_loss = self.unsent
        self.lost = True

    def close_now(self) -> None:
        """Close at once, dropping what is unsent (a graceful close would wait for a peer that
        does not read, forever)."""
        self._transport.abort()


def _unacknowledged(sock: Any) -> int:
    """The socket's send queue not yet acknowledged by the peer (Linux's SIOCOUTQ; 0 where
    the system cannot tell)."""
    with contextlib.suppress(ImportError, AttributeError, OSError, ValueError):
        import fcntl
        import termios

        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    return 0


def head_bytes(scope: Any) -> int:
    """The size of a request's head as it arrived: request line and header lines."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of host:port, as asyncio's `create_server` binds them
    (TCP, so that accepted connections get TCP_NODELAY), or a DlmError (exit 1)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise DlmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.set_inheritable(True)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise DlmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets


class HeadDeadlineProtocol(H11Protocol):
    """h11 with `head_timeout`: a client has that many seconds from connecting to send a
    complete request head; after a response, that many more than the keep-alive timeout
    (which uvicorn cancels at the first byte of the next request)."""

    head_timeout = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.connection = Connection(transport)
        self._arm(self.head_timeout)

    def handle_events(self) -> None:
        super().handle_events()
        if self.scope is not None:  # before the request's task first runs: it is only scheduled
            self.scope.setdefault("extensions", {})[CONNECTION] = self.connection  # type: ignore[index]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # waiting for the next request
            self._arm(self.timeout_keep_alive + self.head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.connection.on_lost()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(seconds, self._expire)

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
