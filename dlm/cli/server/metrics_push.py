"""Pushing the server's metrics to a Prometheus Pushgateway: the monitoring address a service
reports to (the deployment guides' 监控上报地址), for networks where nothing can scrape
`/metrics`, which is served all the same.

Every `metrics_push_interval` seconds the server's registry replaces its group on the gateway,
job `dlm`, instance `HOST:PORT` of this server (prometheus-client's `push_to_gateway`, run on a
worker thread: never on the event loop); a last push when the server stops, so the final
counters reach it. A push that fails is logged once as a warning naming the gateway and the
error, and again once pushes succeed: the server never stops for its monitoring. Credentials
in the URL (`http://user:password@gateway:9091`, a gateway behind basic auth) are sent as its
Authorization header, never as part of the host, and never logged.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, push_to_gateway
from prometheus_client.exposition import basic_auth_handler, default_handler

log = logging.getLogger("dlm.server")

JOB = "dlm"


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

    def _handler(self, url: str, method: str, timeout: float | None, headers: list[Any], data: bytes) -> Any:
        if self.username is None:
            return default_handler(url, method, timeout, headers, data)
        return basic_auth_handler(url, method, timeout, headers, data, self.username, self.password)

    @classmethod
    def for_server(cls, url: str, interval: float, registry: CollectorRegistry, port: int) -> MetricsPusher:
        """Its instance is this machine's name and the server's port: one group per server."""
        return cls(url, interval, registry, f"{socket.gethostname()}:{port}")

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
