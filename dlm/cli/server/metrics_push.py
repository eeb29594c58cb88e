"""Pushing the server's metrics to a Prometheus Pushgateway: the monitoring address a service
reports to (the deployment guides' 监控上报地址), for networks where nothing can scrape
`/metrics`, which is served all the same.

Every `metrics_push_interval` seconds the server's registry replaces its group on the gateway,
job `dlm`, instance `HOST:PORT` of this server (prometheus-client's `push_to_gateway`, run on a
worker thread: never on the event loop); a last push when the server stops, so the final
counters reach it. A push that fails is logged once as a warning naming the gateway and the
error, and again once pushes succeed: the server never stops for its monitoring.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, push_to_gateway

log = logging.getLogger("dlm.server")

JOB = "dlm"


@dataclass
class MetricsPusher:
    url: str
    interval: float
    registry: CollectorRegistry
    instance: str
    failing: bool = False

    @classmethod
    def for_server(cls, url: str, interval: float, registry: CollectorRegistry, port: int) -> MetricsPusher:
        """Its instance is this machine's name and the server's port: one group per server."""
        return cls(url, interval, registry, f"{socket.gethostname()}:{port}")

    def push(self) -> None:
        """One push (blocking); a failure is logged, never raised."""
        try:
            push_to_gateway(
                self.url,
                job=JOB,
                registry=self.registry,
                grouping_key={"instance": self.instance},
                timeout=min(self.interval, 10.0),
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the gateway or the network: logged, not fatal
            if not self.failing:
                log.warning("metrics push to %s failed: %s (retried every %gs)", self.url, exc, self.interval)
            self.failing = True
            return
        if self.failing:
            log.info("metrics push to %s works again", self.url)
        self.failing = False

    async def run(self) -> None:
        """Push every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.to_thread(self.push)
