"""Scheduler: continuous batching whose unit is one denoising step.

Every `Engine.step()` is one forward over the engine's running set, the one list of running
sequences: the scheduler adds to it (`Engine.add`) and reads it, never keeps its own. Between two steps the
scheduler removes what must leave (timed out, cancelled) and admits waiting requests while
the running set stays within its bounds (sequences, and tokens fed to one forward), so
requests at different steps, blocks and lengths share each forward and a newcomer joins at
the next step. The waiting queue is bounded too: beyond it a request is refused at once
(`QueueFull`), because an unbounded queue only turns overload into timeouts.

Requests carry a tenant (a server's API key). The queue is shared fairly: one tenant may hold
at most `max_queue_per_tenant` waiting requests, so it cannot fill the queue and turn every
other tenant's request away, and waiting requests join round-robin over tenants (the tenant
admitted least recently first, each tenant's own requests in arrival order), so one tenant's
backlog does not delay another's requests behind it.

Not thread-safe: the async wrapper (dlm/engine/runtime/async_engine.py) calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dlm.engine.errors import DlmError, UsageError
from dlm.engine.runtime.interface import Engine
from dlm.engine.runtime.request import RequestState


class QueueFull(DlmError):
    """The waiting queue is at its bound; the caller should retry later."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 8  # sequences in one forward
    max_num_batched_tokens: int = 16384  # canvas tokens in one forward (CFG and draft rows count too)
    max_queue: int = 64  # requests waiting for a slot
    max_queue_per_tenant: int | None = None  # of which one tenant's (None: max_queue)

    def validate(self) -> SchedulerLimits:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise UsageError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_queue_per_tenant is not None and self.max_queue_per_tenant < 0:
            raise UsageError(f"max_queue_per_tenant must be >= 0, got {self.max_queue_per_tenant}")
        return self


def forward_tokens(seq: RequestState) -> int:
    """Tokens this sequence feeds to each forward, at most: the whole canvas, twice with CFG,
    once more per draft candidate (`drafts`, dlm/engine/decoding/drafts.py)."""
    return len(seq.canvas) * (2 if seq.params.cfg_scale > 0 else 1 + seq.params.drafts)


@dataclass(eq=False)
class ScheduledRequest:
    request_id: str
    seq: RequestState
    arrival: float  # time.monotonic() at submission
    deadline: float | None  # monotonic time after which the request is timed out
    admitted: float | None = None  # when it joined the running set
    context: Any = field(default=None, repr=False)  # owner's per-request state
    tenant: str = ""  # whose request (a server's API key id): the queue is shared fairly between tenants


class Scheduler:
    def __init__(self, engine: Engine, limits: SchedulerLimits) -> None:
        self.engine = engine
        self.limits = limits.validate()
        self.waiting: deque[ScheduledRequest] = deque()
        self._admitted: dict[int, ScheduledRequest] = {}  # seq_id -> request, until reaped or removed
        self._turns = 0  # admissions so far
        self._last_turn: dict[str, int] = {}  # tenant -> the admission that last served it

    @property
    def running(self) -> list[ScheduledRequest]:
        """The requests of the engine's running set, in its order."""
        return [self._admitted[s.seq_id] for s in self.engine.running if s.seq_id in self._admitted]

    @property
    def batch_tokens(self) -> int:
        return sum(forward_tokens(r.seq) for r in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self._admitted)

    def check_room(self, tenant: str = "", count: int = 1) -> None:
        """Raise QueueFull unless `count` more requests of `tenant` fit: in the waiting queue,
        and in the tenant's share of it."""
        limits = self.limits
        if len(self.waiting) + count > limits.max_queue:
            raise QueueFull(f"the request queue is full ({limits.max_queue} waiting)")
        share = limits.max_queue_per_tenant
        if share is not None and sum(r.tenant == tenant for r in self.waiting) + count > share:
            raise QueueFull(f"this API key already has {share} requests waiting (its share of the queue)")

    def add(self, *requests: ScheduledRequest) -> None:
        """Queue requests (one request's samples: all of them or none); refuse at once when
        the waiting queue, or their tenant's share of it, cannot take them all."""
        for request in requests:
            cost = forward_tokens(request.seq)
            if cost > self.limits.max_num_batched_tokens:
                raise UsageError(
                    f"the request needs {cost} tokens per forward, more than "
                    f"max_num_batched_tokens ({self.limits.max_num_batched_tokens})"
                )
        for tenant in {r.tenant for r in requests}:
            self.check_room(tenant, sum(r.tenant == tenant for r in requests))
        self.waiting.extend(requests)

    def _next(self) -> ScheduledRequest:
        """The request to admit next: the oldest of the tenant served least recently."""
        heads: dict[str, ScheduledRequest] = {}
        for request in self.waiting:
            heads.setdefault(request.tenant, request)
        return min(heads.values(), key=lambda r: self._last_turn.get(r.tenant, -1))

    def admit(self, now: float) -> list[ScheduledRequest]:
        """Move waiting requests (round-robin over tenants, each tenant's first come first
        served) into the running set while the bounds hold; they take part in the next forward."""
        admitted = []
        tokens = self.batch_tokens
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            request = self._next()
            cost = forward_tokens(request.seq)
            if tokens + cost > self.limits.max_num_batched_tokens:
                break
            self.waiting.remove(request)
            self._turns += 1
            self._last_turn[request.tenant] = self._turns
            request.admitted = now
            tokens += cost
            self._admitted[request.seq.seq_id] = request
            self.engine.add(request.seq)
            admitted.append(request)
        return admitted

    def expired(self, now: float) -> list[ScheduledRequest]:
        """Requests past their deadline, waiting or running."""
        return [r for r in (*self.waiting, *self.running) if r.deadline is not None and now >= r.deadline]

    def remove(self, request: ScheduledRequest, reason: str) -> None:
        """Take a request out now (timeout, cancel, early stop): it is not in the next forward."""
        self.engine.abort(request.seq, reason)
        self.waiting = deque(r for r in self.waiting if r is not request)
        self._admitted.pop(request.seq.seq_id, None)

    def reap(self) -> list[ScheduledRequest]:
        """Forget the admitted requests whose sequences finished (the engine dropped them)."""
        done = [r for r in self._admitted.values() if r.seq.finished]
        for request in done:
            del self._admitted[request.seq.seq_id]
        return done
