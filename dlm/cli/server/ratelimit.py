"""Per-key rate limits: token buckets for requests and for generated tokens per minute.

A bucket holds up to one minute's allowance and refills continuously, so short bursts pass
and sustained excess is refused with the exact wait (Retry-After). Generated tokens are
charged at admission at the requested `max_tokens` (times `n`): a dLLM denoises the whole
canvas of `max_tokens` positions whatever the answer's length, so that is the cost it incurs.
A charge larger than the bucket can ever hold is refused outright (`OverCapacity`), never
promised a wait; a charge for a request refused afterwards is given back (`refund`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass


class OverCapacity(ValueError):
    """A charge above a bucket's capacity: no wait would ever let it pass."""

    def __init__(self, amount: float, capacity: float) -> None:
        super().__init__(f"a charge of {amount:g} exceeds the bucket's capacity of {capacity:g}")
        self.amount, self.capacity = amount, capacity


@dataclass
class TokenBucket:
    per_minute: float
    level: float
    stamp: float
    capacity: float | None = None  # what the bucket holds at most (None: one minute's allowance)

    @property
    def limit(self) -> float:
        return self.per_minute if self.capacity is None else self.capacity

    def take(self, amount: float, now: float) -> float:
        """Take `amount` and return 0, or take nothing and return the seconds to wait.
        Raises `OverCapacity` for an amount the bucket can never hold."""
        if amount > self.limit:
            raise OverCapacity(amount, self.limit)
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / (self.per_minute / 60.0)

    def give_back(self, amount: float, now: float) -> None:
        """Return a charge taken for a request that was refused after all."""
        self._refill(now)
        self.level = min(self.limit, self.level + amount)

    def _refill(self, now: float) -> None:
        self.level = min(self.limit, self.level + (now - self.stamp) * self.per_minute / 60.0)
        self.stamp = now


class RateLimiter:
    def __init__(self, requests_per_minute: float, tokens_per_minute: float) -> None:
        self.limits = {"requests": requests_per_minute, "tokens": tokens_per_minute}
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._lock = threading.Lock()

    def capacity(self, kind: str) -> float | None:
        """The most one charge of `kind` may be (None: unlimited). A request is one whole
        request, so a request rate under one a minute still lets one through at a time."""
        limit = self.limits[kind]
        if limit <= 0:
            return None
        return max(limit, 1.0) if kind == "requests" else limit

    def check(self, key: str, kind: str, amount: float = 1.0) -> int:
        """0 when allowed (and charged), else whole seconds to wait before retrying.
        Raises `OverCapacity` for an amount over the bucket's capacity (no wait helps)."""
        capacity = self.capacity(kind)
        if capacity is None:
            return 0
        now = time.monotonic()
        with self._lock:
            bucket = self._bucket(key, kind, capacity, now)
            wait = bucket.take(amount, now)
        return 0 if wait == 0 else max(1, math.ceil(wait))

    def refund(self, key: str, kind: str, amount: float = 1.0) -> None:
        """Give back a charge `check` took (a request refused after it was charged)."""
        capacity = self.capacity(kind)
        if capacity is None:
            return
        now = time.monotonic()
        with self._lock:
            self._bucket(key, kind, capacity, now).give_back(amount, now)

    def _bucket(self, key: str, kind: str, capacity: float, now: float) -> TokenBucket:
        return self._buckets.setdefault((key, kind), TokenBucket(self.limits[kind], capacity, now, capacity))
