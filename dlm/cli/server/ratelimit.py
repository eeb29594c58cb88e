"""Per-key rate limits: token buckets for requests and for generated tokens per minute.

A bucket holds up to one minute's allowance and refills continuously, so short bursts pass
and sustained excess is refused with the exact wait (Retry-After). Generated tokens are
charged at admission at the requested `max_tokens`: a dLLM denoises the whole canvas of
`max_tokens` positions whatever the answer's length, so that is the cost it incurs.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass


@dataclass
class TokenBucket:
    per_minute: float
    level: float
    stamp: float

    def take(self, amount: float, now: float) -> float:
        """Take `amount` and return 0, or take nothing and return the seconds to wait."""
        rate = self.per_minute / 60.0
        self.level = min(self.per_minute, self.level + (now - self.stamp) * rate)
        self.stamp = now
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / rate


class RateLimiter:
    def __init__(self, requests_per_minute: float, tokens_per_minute: float) -> None:
        self.limits = {"requests": requests_per_minute, "tokens": tokens_per_minute}
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._lock = threading.Lock()

    def check(self, key: str, kind: str, amount: float = 1.0) -> int:
        """0 when allowed (and charged), else whole seconds to wait before retrying."""
        limit = self.limits[kind]
        if limit <= 0:
            return 0
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.setdefault((key, kind), TokenBucket(limit, limit, now))
            wait = bucket.take(amount, now)
        return 0 if wait == 0 else max(1, math.ceil(wait))
