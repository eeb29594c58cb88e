"""Per-request records and what they add up to for one load level.

Definitions follow vLLM's benchmark (serving-conventions.md section 4): TTFT is the time
to the first streamed text, TPOT = (e2e - TTFT) / (output tokens - 1), and goodput counts
the successful requests that meet every SLO bound. Throughput is measured over the level's
steady window (after ramp-up), over the requests started in it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dlm.cli.loadtest.thresholds import Condition

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    level: int  # index of the load level the request started in
    start: float  # monotonic seconds
    e2e: float
    status: int  # HTTP status; 0 when no answer came (timeout, refused connection)
    error: str | None = None
    ttft: float | None = None
    output_tokens: int | None = None  # usage.completion_tokens of the stream's usage chunk
    prompt_tokens: int | None = None
    denoising_steps: int | None = None
    itls: list[float] = field(default_factory=list)  # gaps between streamed text deltas, seconds
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot": self.tpot}


def percentiles(values: list[float], prefix: str) -> dict[str, float | None]:
    keys = [f"p{p}_{prefix}" for p in PERCENTILES] + [f"mean_{prefix}"]
    if not values:
        return dict.fromkeys(keys)
    measured = np.asarray(values, dtype=float)
    points = [*np.percentile(measured, PERCENTILES), np.mean(measured)]
    return {key: float(v) for key, v in zip(keys, points)}


def meets(record: RequestRecord, slo: list[Condition]) -> bool:
    measured = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    return record.ok and all((value := measured[c.metric]) is not None and c.holds(value) for c in slo)


def summarize(records: list[RequestRecord], seconds: float, slo: list[Condition]) -> dict[str, Any]:
    """Metrics of the requests started in a window of `seconds` (the --fail-on vocabulary)."""
    ok = [r for r in records if r.ok]
    errors = Counter("ok" if r.ok else (str(r.status) if r.status else "no_answer") for r in records)
    errors.pop("ok", None)
    tokens = [r.output_tokens for r in ok if r.output_tokens is not None]
    steps = [r.denoising_steps for r in ok if r.denoising_steps is not None]
    both = [(r.output_tokens, r.denoising_steps) for r in ok if r.output_tokens is not None and r.denoising_steps]
    good = [r for r in ok if meets(r, slo)]
    span = max(seconds, 1e-9)
    summary: dict[str, Any] = {
        "seconds": seconds,
        "requests": len(records),
        "ok": len(ok),
        "errors_by_status": dict(sorted(errors.items())),
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "rps": len(ok) / span,
        "output_tokens": sum(tokens),
        "output_tokens_per_s": sum(tokens) / span,
        "requests_without_usage": len(ok) - len(tokens),
        "empty_answers": sum(1 for r in ok if not r.text),  # EOS at once: no first token to time
        "mean_denoising_steps": float(np.mean(steps)) if steps else None,
        "p50_denoising_steps": float(np.median(steps)) if steps else None,
        "tokens_per_step": (sum(t for t, _ in both) / sum(s for _, s in both)) if both else None,
        "goodput_rps": len(good) / span,
        "goodput_fraction": len(good) / len(ok) if ok else 0.0,
    }
    summary |= percentiles([r.e2e for r in ok], "e2e")
    summary |= percentiles([r.ttft for r in ok if r.ttft is not None], "ttft")
    summary |= percentiles([t for r in ok if (t := r.tpot) is not None], "tpot")
    return summary


# Summary keys that --fail-on may test (plus the server-agreement ones of `run`).
GATE_METRICS = (
    "rps",
    "output_tokens_per_s",
    "error_rate",
    "goodput_rps",
    "goodput_fraction",
    "mean_denoising_steps",
    "tokens_per_step",
    *(f"{k}_{m}" for m in ("e2e", "ttft", "tpot") for k in ("p50", "p90", "p95", "p99", "mean")),
    "requests_mismatch",
    "tokens_mismatch",
)
