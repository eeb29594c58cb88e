"""Load-test results in the shape `vllm bench serve --save-result` writes, plus a diffusion section.

Operators compare servers with vLLM's benchmark JSON; writing the same keys lets their
dashboards and scripts read dlm's results unchanged. One object per load level (vLLM runs
one concurrency per invocation). Keys that only make sense for vLLM's own client (a
tokenizer id, a request-rate schedule) carry the values that describe what dlm did: a
closed loop of `max_concurrency` users, i.e. request rate "inf" with a concurrency cap.

Definitions follow vLLM's: TTFT to the first streamed text, TPOT = (e2e - TTFT) /
(output tokens - 1), ITL = the gaps between streamed text deltas, E2EL the whole request.
A diffusion server commits several tokens per delta, so its ITLs are per delta, not per
token (as vLLM's are for speculative decoding). The `diffusion` section says what a dLLM
spends: denoising steps (model forwards) per request and committed tokens per step.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dlm.cli.loadtest.stats import RequestRecord, meets
from dlm.cli.loadtest.thresholds import Condition

# The latency metrics vLLM reports, each as mean/median/std/p99 in milliseconds.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# Every key `vllm bench serve --save-result` writes that applies to a text-generation run.
VLLM_KEYS = (
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for metric in LATENCY_METRICS for stat in ("mean", "median", "std", "p99")),
)


def _latency(values: list[float], metric: str) -> dict[str, float]:
    """mean/median/std/p99 in ms of seconds `values` (0.0 for none, as vLLM writes)."""
    ms = np.asarray(values, dtype=float) * 1000 if values else np.zeros(1)
    return {
        f"mean_{metric}_ms": float(ms.mean()),
        f"median_{metric}_ms": float(np.median(ms)),
        f"std_{metric}_ms": float(ms.std()),
        f"p99_{metric}_ms": float(np.percentile(ms, 99)),
    }


def _peak_output_rate(records: list[RequestRecord]) -> tuple[float, int]:
    """Highest output tokens per one-second bucket, and most requests in flight at once.

    Tokens of a request are spread evenly over its streaming span (dlm's records keep the
    text delta gaps, not per-token times)."""
    ok = [r for r in records if r.ok and r.output_tokens]
    if not ok:
        return 0.0, 0
    origin = min(r.start for r in records)
    buckets: dict[int, float] = {}
    for r in ok:
        first = r.start + (r.ttft or 0.0) - origin
        last = r.start + r.e2e - origin
        span = max(last - first, 1e-9)
        for second in range(int(first), int(last) + 1):
            overlap = min(last, second + 1) - max(first, second)
            buckets[second] = buckets.get(second, 0.0) + (r.output_tokens or 0) * max(overlap, 0.0) / span
    events = sorted([(r.start, 1) for r in records] + [(r.start + r.e2e, -1) for r in records])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return max(buckets.values(), default=0.0), peak


def level_result(
    records: list[RequestRecord], duration: float, users: int, model: str | None, endpoint: str, slo: list[Condition]
) -> dict[str, Any]:
    """One load level as `vllm bench serve` would have written it, plus `diffusion`."""
    ok = [r for r in records if r.ok]
    input_lens = [r.prompt_tokens or 0 for r in ok]
    output_lens = [r.output_tokens or 0 for r in ok]
    span = max(duration, 1e-9)
    peak_rate, peak_running = _peak_output_rate(records)
    steps = [r.denoising_steps for r in ok if r.denoising_steps]
    committed = sum(r.output_tokens or 0 for r in ok if r.denoising_steps)
    result: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if endpoint.endswith("chat/completions") else "openai",
        "backend": "dlm",
        "label": None,
        "model_id": model,
        "tokenizer_id": model,
        "num_prompts": len(records),
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": users,
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": sum(input_lens),
        "total_output_tokens": sum(output_lens),
        "request_throughput": len(ok) / span,
        "request_goodput": sum(1 for r in ok if meets(r, slo)) / span,
        "output_throughput": sum(output_lens) / span,
        "total_token_throughput": (sum(input_lens) + sum(output_lens)) / span,
        "input_lens": input_lens,
        "output_lens": output_lens,
        "ttfts": [r.ttft or 0.0 for r in ok],
        "itls": [r.itls for r in ok],
        "generated_texts": [r.text for r in ok],
        "errors": [r.error or f"HTTP {r.status}" for r in records if not r.ok],
        "max_output_tokens_per_s": peak_rate,
        "max_concurrent_requests": peak_running,
    }
    result |= _latency([r.ttft for r in ok if r.ttft is not None], "ttft")
    result |= _latency([t for r in ok if (t := r.tpot) is not None], "tpot")
    result |= _latency([gap for r in ok for gap in r.itls], "itl")
    result |= _latency([r.e2e for r in ok], "e2el")
    result["diffusion"] = {
        "committed_throughput": sum(output_lens) / span,
        "mean_denoising_steps_per_request": float(np.mean(steps)) if steps else None,
        # A request's denoising step is one model forward it took part in, so this is also the
        # tokens per forward a request sees (a batched forward serves several requests at once).
        "committed_tokens_per_step": committed / sum(steps) if steps else None,
    }
    return result
