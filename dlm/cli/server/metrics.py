"""Prometheus metrics, `dlm_` prefix, named after vLLM's where one exists.

dLLM cost is steps x forward, so besides tokens and latencies the server exports denoising
steps per request, tokens committed per step, step duration and batch size. Each app has its
own registry (several apps may live in one test process). Counters get prometheus-client's
`_total` suffix on export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from math import nan
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dlm.engine.runtime.prefix_cache import PrefixCacheStats

LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
STEP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
POWERS = tuple(float(2**i) for i in range(13))  # 1 .. 4096


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.running = gauge("dlm_num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("dlm_num_requests_waiting", "Requests waiting for a slot.")
        self.batch_token_usage = gauge(
            "dlm_batch_token_usage_perc", "Canvas tokens in the running batch over max_num_batched_tokens (1 = full)."
        )
        self.cache_bytes = gauge(
            "dlm_kv_cache_bytes",
            "K/V cache (and recurrent state) bytes the running requests hold on this process "
            "(rank 0's shard under tensor parallelism).",
        )
        self.model_info = gauge(
            "dlm_model_info",
            "The model served now (value 1): its served name, store version and deployment ('' when none).",
            *("model", "version", "deployment"),
        )
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self.e2e = histogram("dlm_e2e_request_latency_seconds", "Arrival to last byte.", LATENCY)
        self.ttft = histogram("dlm_time_to_first_token_seconds", "Arrival to first streamed text.", LATENCY)
        self.queue_time = histogram("dlm_request_queue_time_seconds", "Arrival to joining the running batch.", LATENCY)
        self.steps = histogram("dlm_request_denoising_steps", "Model forwards spent per request.", POWERS)
        self.tokens_per_step = histogram(
            "dlm_tokens_per_step", "Tokens committed per sequence per denoising step.", (0.0,) + POWERS[:9]
        )
        self.step_duration = histogram("dlm_step_duration_seconds", "Duration of one batched denoising forward.", STEP)
        self.batch_size = histogram("dlm_batch_size", "Sequences sharing one denoising forward.", POWERS[:10])
        self.prompt_tokens = counter("dlm_prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter(
            "dlm_generation_tokens",
            "Generated tokens (up to and including EOS), a request ended early counting its own.",
        )
        self.success = counter("dlm_request_success", "Finished requests by finish reason.", "finish_reason")
        self.rejections = counter("dlm_request_rejections", "Refused requests by reason.", "reason")
        self.timeouts = counter("dlm_request_timeouts", "Requests ended by their deadline.")
        self.disconnects = counter(
            "dlm_http_requests_client_disconnected", "Requests cancelled because the client left."
        )
        self.failures = counter("dlm_request_failures", "Requests ended by an engine error or shutdown.", "reason")
        self.response_cache_lookups = counter(
            "dlm_response_cache_lookups", "Requests looked up in the response cache (cacheable ones)."
        )
        self.response_cache_hits = counter("dlm_response_cache_hits", "Requests answered from the response cache.")
        self.undelivered = counter(
            "dlm_request_undelivered", "Answers a client did not read by the request's deadline (connection closed)."
        )
        # Export the common series from the start, so rates and alerts work before the first event.
        for reason in ("stop", "length", "tool_calls"):
            self.success.labels(reason)
        for reason in ("queue_full", "rate_limit_exceeded", "invalid_api_key", "draining", "not_ready"):
            self.rejections.labels(reason)
        for reason in ("error", "shutdown"):
            self.failures.labels(reason)

    def bind(
        self,
        running: Callable[[], int],
        waiting: Callable[[], int],
        token_usage: Callable[[], float],
        cache_bytes: Callable[[], int],
    ) -> None:
        """Read the gauges from the engine at scrape time."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.batch_token_usage.set_function(token_usage)
        self.cache_bytes.set_function(cache_bytes)

    def watch_prefix_cache(self, stats: Callable[[], PrefixCacheStats]) -> None:
        """Export the engine's prefix-cache counters, read at scrape time."""
        self.registry.register(PrefixCacheCollector(stats))

    def watch_gpu(self, device: Any) -> None:
        """Export the serving GPU's (`device`, a CUDA torch.device) memory, read at scrape time:
        the bytes torch has allocated now and the peak since the server started (the guides size
        headroom by the peak, which the current value misses between scrapes), and its
        utilization where NVML can say it (torch.cuda.utilization needs pynvml, which dlm does
        not require: without it the series is absent, not a made-up 0). Only where there is a
        GPU: no series on CPU. Tensor-parallel ranks beyond the serving one are other processes,
        whose GPUs this process cannot read."""
        import torch

        cuda = torch.cuda
        for name, what, read in (
            ("dlm_gpu_memory_allocated_bytes", "Bytes torch has allocated on the serving GPU.", cuda.memory_allocated),
            (
                "dlm_gpu_memory_max_allocated_bytes",
                "Peak bytes torch has allocated on the serving GPU since the server started.",
                cuda.max_memory_allocated,
            ),
        ):
            Gauge(name, what, registry=self.registry).set_function(partial(read, device))
        if gpu_utilization(device) is not None:
            gauge = Gauge(
                "dlm_gpu_utilization_ratio",
                "Share of the last sample period the serving GPU was busy (NVML, 0-1).",
                registry=self.registry,
            )
            gauge.set_function(lambda: nan if (busy := gpu_utilization(device)) is None else busy)

    def serving(self, model: str, version: str | None, deployment: str | None) -> None:
        """The one `dlm_model_info` series: the model served now (after a load or a hot swap)."""
        self.model_info.clear()
        self.model_info.labels(model, version or "", deployment or "").set(1)

    def on_step(self, batch_size: int, batch_tokens: int, committed: list[int], seconds: float) -> None:
        self.batch_size.observe(batch_size)
        self.step_duration.observe(seconds)
        for n in committed:
            self.tokens_per_step.observe(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gpu_utilization(device: Any) -> float | None:
    """`device`'s utilization (0-1) as NVML reports it through torch, or None where it cannot:
    no pynvml installed (torch raises ModuleNotFoundError), or NVML failing (no driver
    library, a device it does not know)."""
    import torch

    try:
        return float(torch.cuda.utilization(device)) / 100
    except Exception:  # noqa: BLE001 - pynvml's NVMLError and torch's own: "cannot say", not a failed scrape
        return None


class PrefixCacheCollector(Collector):
    """The cross-request prefix cache (dlm/engine/runtime/prefix_cache.py), from the engine's own
    counters: prompt tokens looked up and found (as vLLM's prefix_cache_queries/hits), the
    hit rate since start, evictions, and the bytes held against the budget. The counters
    restart with a new model version (a hot swap), as they would with a new process."""

    def __init__(self, stats: Callable[[], PrefixCacheStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield CounterMetricFamily("dlm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.queries)
        yield CounterMetricFamily(
            "dlm_prefix_cache_hits", "Prompt tokens whose K/V came from the prefix cache.", s.hits
        )
        yield CounterMetricFamily("dlm_prefix_cache_evictions", "Prefix-cache pages evicted (LRU).", s.evictions)
        yield GaugeMetricFamily(
            "dlm_prefix_cache_hit_rate", "Prefix-cache hits over queries, in tokens, since start.", s.hit_rate
        )
        yield GaugeMetricFamily("dlm_prefix_cache_bytes", "K/V bytes the prefix cache holds.", s.bytes)
        yield GaugeMetricFamily("dlm_prefix_cache_budget_bytes", "The prefix cache's byte budget (0: off).", s.budget)
