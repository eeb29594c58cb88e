"""Pushing the server's metrics to a Prometheus Pushgateway: the monitoring address a service
reports to (the deployment guides' 监控上报地址), for networks where nothing can scrape
`/metrics`, which is served all the same.

Every `metrics_push_interval` seconds the server's registry replaces its group on the gateway,
job `dlm`, instance `HOSTNAME:PORT` of this server (`dlm batch`: `HOSTNAME:OUTPUT`; prometheus-client's
`push_to_gateway`, run on a worker thread: never on the event loop); a last push when the server stops, so the final
counters reach it. A push that fails is logged once as a warning naming the gateway and the
error, and again once pushes succeed: the server never stops for its monitoring. Credentials
in the URL (`http://user:password@gateway:9091`, a gateway behind basic auth) are sent as its
Authorization header, never as part of the host, and never logged.

A push has one deadline for the whole of it, `min(interval, 10)` seconds: a socket timeout
bounds each read only, and a gateway that trickled its answer (a byte within each timeout) held
a push, and the last one, which shutdown waits for, as long as it liked. The push goes through
the client's transport (dlm/cli/client/transport.py), whose every wait ends at the deadline.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
from prometheus_client import CollectorRegistry, push_to_gateway

from dlm.cli.client.transport import DeadlineTransport, deadline

log = logging.getLogger("dlm.server")

JOB = "dlm"


def server_instance(port: int) -> str:
    """A server's `instance`: this machine's name and the port bound, one group per server."""
    return f"{socket.gethostname()}:{port}"


def batch_instance(output: Path) -> str:
    """A `dlm batch` run's `instance`: this machine's name and its OUTPUT, which one run holds
    at a time and a resumed run keeps. It took the server's form with the default port 8000,
    so its pushes replaced the group of a `dlm serve` on port 8000 of the same machine."""
    return f"{socket.gethostname()}:{output.resolve()}"


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """`url` without its `user:password@`, and the user and password (None without them)."""
    parts = urlsplit(url)
    gateway = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    if parts.username is None:
        return gateway, None, None
    return gateway, unquote(parts.username), unquote(parts.password or "")


def masked(url: str) -> str:
    """`url` as printed: its password, if any, as `***`."""
    gateway, username, password = split_credentials(url)
    if password is None:
        return url
    parts = urlsplit(gateway)
    return urlunsplit(parts._replace(netloc=f"{username}:***@{parts.netloc}"))


@dataclass
class MetricsPusher:
    url: str
    interval: float
    registry: CollectorRegistry
    instance: str
    failing: bool = False
    gateway: str = field(init=False)  # `url` without its credentials: where pushes go, as logged
    username: str | None = field(init=False)
    password: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.gateway, self.username, self.password = split_credentials(self.url)

    def _handler(
        self, url: str, method: str, timeout: float | None, headers: list[tuple[str, str]], data: bytes
    ) -> Callable[[], None]:
        """prometheus-client's handler contract: the request to make, made by the callable
        returned, within `timeout` seconds in all (its own handlers: each socket operation)."""
        assert timeout is not None  # `push` always gives one
        fields = dict(headers)
        if self.username is not None:
            token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            fields["Authorization"] = f"Basic {token}"

        def handle() -> None:
            transport = DeadlineTransport(httpx.URL(url), True, httpx.Limits(max_connections=1))
            with httpx.Client(transport=transport, timeout=timeout) as client, deadline(timeout) as at:
                try:
                    client.request(method, url, content=data, headers=fields).raise_for_status()
                except httpx.TransportError as exc:
                    if time.perf_counter() >= at:
                        raise TimeoutError(f"the gateway did not answer within {timeout:g}s") from exc
                    raise

        return handle

    def push(self) -> None:
        """One push (blocking); a failure is logged, never raised."""
        try:
            push_to_gateway(
                self.gateway,
                job=JOB,
                registry=self.registry,
                grouping_key={"instance": self.instance},
                timeout=min(self.interval, 10.0),
                handler=self._handler,
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the gateway or the network: logged, not fatal
            if not self.failing:
                log.warning("metrics push to %s failed: %s (retried every %gs)", self.gateway, exc, self.interval)
            self.failing = True
            return
        if self.failing:
            log.info("metrics push to %s works again", self.gateway)
        self.failing = False

    async def run(self) -> None:
        """Push every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.to_thread(self.push)
