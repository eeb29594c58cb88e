"""Prometheus metrics, `dlm_` prefix, named after vLLM's where one exists.

dLLM cost is steps x forward, so besides tokens and latencies the server exports denoising
steps per request, tokens committed per step, step duration and batch size. Each app has its
own registry (several apps may live in one test process). Counters get prometheus-client's
`_total` suffix on export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.runtime.prefix_cache import PrefixCacheStats

LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
STEP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
POWERS = tuple(float(2**i) for i in range(13))  # 1 .. 4096


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("dlm_num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("dlm_num_requests_waiting", "Requests waiting for a slot.", registry=r)
        self.batch_token_usage = Gauge(
            "dlm_batch_token_usage_perc",
            "Canvas tokens in the running batch over max_num_batched_tokens (1 = full).",
            registry=r,
        )
        self.cache_bytes = Gauge(
            "dlm_kv_cache_bytes",
            "K/V cache (and recurrent state) bytes the running requests hold on this process "
            "(rank 0's shard under tensor parallelism).",
            registry=r,
        )
        self.model_info = Gauge(
            "dlm_model_info",
            "The model served now (value 1): its served name, store version and deployment ('' when none).",
            ["model", "version", "deployment"],
            registry=r,
        )
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self.e2e = Histogram("dlm_e2e_request_latency_seconds", "Arrival to last byte.", buckets=LATENCY, registry=r)
        self.ttft = Histogram(
            "dlm_time_to_first_token_seconds",
            "Arrival to first streamed text.",
            buckets=LATENCY,
            registry=r,
        )
        self.queue_time = Histogram(
            "dlm_request_queue_time_seconds",
            "Arrival to joining the running batch.",
            buckets=LATENCY,
            registry=r,
        )
        self.steps = Histogram(
            "dlm_request_denoising_steps",
            "Model forwards spent per request.",
            buckets=POWERS,
            registry=r,
        )
        self.tokens_per_step = Histogram(
            "dlm_tokens_per_step",
            "Tokens committed per sequence per denoising step.",
            buckets=(0.0,) + POWERS[:9],
            registry=r,
        )
        self.step_duration = Histogram(
            "dlm_step_duration_seconds",
            "Duration of one batched denoising forward.",
            buckets=STEP,
            registry=r,
        )
        self.batch_size = Histogram(
            "dlm_batch_size",
            "Sequences sharing one denoising forward.",
            buckets=POWERS[:10],
            registry=r,
        )
        self.prompt_tokens = Counter("dlm_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(
            "dlm_generation_tokens",
            "Generated tokens returned (up to and including EOS).",
            registry=r,
        )
        self.success = Counter(
            "dlm_request_success",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.rejections = Counter(
            "dlm_request_rejections",
            "Refused requests by reason.",
            ["reason"],
            registry=r,
        )
        self.timeouts = Counter("dlm_request_timeouts", "Requests ended by their deadline.", registry=r)
        self.disconnects = Counter(
            "dlm_http_requests_client_disconnected",
            "Requests cancelled because the client left.",
            registry=r,
        )
        self.failures = Counter(
            "dlm_request_failures",
            "Requests ended by an engine error or shutdown.",
            ["reason"],
            registry=r,
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

    def watch_gpu(self, allocated: Callable[[], float]) -> None:
        """Export the serving GPU's allocated bytes (only where there is one: no series on CPU)."""
        gauge = Gauge(
            "dlm_gpu_memory_allocated_bytes", "Bytes torch has allocated on the serving GPU.", registry=self.registry
        )
        gauge.set_function(allocated)

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


class PrefixCacheCollector(Collector):
    """The cross-request prefix cache (engine/runtime/prefix_cache.py), from the engine's own
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
