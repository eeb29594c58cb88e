"""Reading a server's Prometheus `/metrics`: which names it exports, and counter totals.

The names a dlm server must export live here, in one place, because `dlm validate`
checks them and `dlm loadtest` reconciles its own counts against two of the counters.
They follow vLLM's names with a `dlm_` prefix (serving-conventions.md section 1c).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# Counters (prometheus_client exports them with a `_total` suffix).
REQUEST_SUCCESS = "dlm_request_success_total"  # by finish_reason
PROMPT_TOKENS = "dlm_prompt_tokens_total"
GENERATION_TOKENS = "dlm_generation_tokens_total"

EXPECTED_METRICS = (
    "dlm_num_requests_running",
    "dlm_num_requests_waiting",
    "dlm_e2e_request_latency_seconds",
    "dlm_time_to_first_token_seconds",
    "dlm_request_queue_time_seconds",
    "dlm_request_denoising_steps",
    "dlm_tokens_per_step",
    "dlm_step_duration_seconds",
    "dlm_batch_size",
    REQUEST_SUCCESS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    "dlm_request_rejections_total",  # by reason
    "dlm_request_timeouts_total",
    "dlm_http_requests_client_disconnected_total",
)


class MetricsFormatError(ValueError):
    """The body is not the Prometheus text exposition format."""


def parse_samples(text: str) -> dict[str, float]:
    """Sum every sample of the exposition by sample name (labels added together).

    Family names are included too, so `dlm_x_seconds` (a histogram family) and
    `dlm_x_total` (a counter sample) can both be looked up.
    """
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            totals.setdefault(family.name, 0.0)
            if family.type == "counter":  # a labelled counter with no children yet has no samples
                totals.setdefault(f"{family.name}_total", 0.0)
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsFormatError(f"not Prometheus text format: {exc}") from None
    return totals


def missing_metrics(text: str, expected: tuple[str, ...] = EXPECTED_METRICS) -> list[str]:
    """The expected names that the exposition does not contain."""
    present = parse_samples(text)
    return [name for name in expected if name not in present]
