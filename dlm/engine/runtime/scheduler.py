"""Scheduler: continuous batching whose unit is one denoising step.

Every `Engine.step()` is one forward over the engine's running set, the one list of running
sequences: the scheduler adds to it (`Engine.add`) and reads it, never keeps its own. Between two steps the
scheduler removes what must leave (timed out, cancelled) and admits waiting requests while
the running set stays within its bounds (sequences, and tokens fed to one forward), so
requests at different steps, blocks and lengths share each forward and a newcomer joins at
the next step. The waiting queue is bounded too: beyond it a request is refused at once
(`QueueFull`), because an unbounded queue only turns overload into timeouts. It counts the
requests waiting for a slot, those the next admission leaves waiting (the same rule decides
both): requests that arrive while a step runs and that the batch's free room takes at the
next step are not refused for the queue.

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
from dlm.engine.params import ResolvedParams
from dlm.engine.runtime.interface import Engine
from dlm.engine.runtime.request import RequestState


class QueueFull(DlmError):
    """The waiting queue is at its bound; the caller should retry later."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 8  # sequences in one forward
    max_num_batched_tokens: int = 16384  # canvas tokens in one forward (CFG and draft rows count too)
    max_queue: int = 64  # requests waiting for a slot (not those free room takes at the next step)
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
    """Tokens this sequence feeds to each forward, at most (`ResolvedParams.forward_tokens`:
    from its parameters and prompt length, as a check before the sequence exists counts them)."""
    return seq.params.forward_tokens(seq.prompt_length)


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
        """Raise QueueFull unless `count` more requests of `tenant` fit, before they exist (a
        server's check before it reads the body): their forward tokens are not known yet, so
        counted as none; `add` checks again with them."""
        self._check_room([(tenant, 0)] * count)

    def add(self, *requests: ScheduledRequest) -> None:
        """Queue requests (one request's samples: all of them or none); refuse at once when
        the waiting queue, or their tenant's share of it, cannot take them all; a usage error
        when no wait lets them in (`_check_possible`)."""
        arrivals = [(r.tenant, forward_tokens(r.seq)) for r in requests]
        self._check_possible(arrivals)
        self._check_room(arrivals)
        self.waiting.extend(requests)

    def check_possible(self, tenant: str, params: ResolvedParams, prompt_length: int) -> None:
        """Raise UsageError unless the `n` samples of a request of `tenant` with `params` on a
        prompt of `prompt_length` tokens could ever be queued together (`_check_possible`),
        before they exist (a server's check with the request's other parameters, `/tokenize`'s
        too): their forward tokens derive from the parameters (`ResolvedParams.forward_tokens`),
        so this refuses exactly what `add` refuses once they are built."""
        self._check_possible([(tenant, params.forward_tokens(prompt_length))] * params.n)

    def _check_possible(self, arrivals: list[tuple[str, int]]) -> None:
        """Raise UsageError unless `arrivals` (one request's samples: (tenant, forward tokens))
        fit an idle scheduler: each within `max_num_batched_tokens` (field `gen_length`: the
        answer's length is what the request can lower), and all of them within what the
        admission of an empty batch takes (`_admissions`, the one rule) plus what the queue and
        the tenant's share of it hold (field `n`). Beyond that no wait lets them in, so refusing
        them `QueueFull` (retry later) would be a lie."""
        cost = max((tokens for _, tokens in arrivals), default=0)
        if cost > self.limits.max_num_batched_tokens:
            raise UsageError(
                f"the request needs {cost} tokens per forward, more than "
                f"max_num_batched_tokens ({self.limits.max_num_batched_tokens})",
                field="gen_length",
            )
        left = [arrivals[i][0] for i in self._waiting_after(arrivals, idle=True)]
        limits = self.limits
        room = (
            limits.max_queue
            if limits.max_queue_per_tenant is None
            else min(limits.max_queue, limits.max_queue_per_tenant)
        )
        if len(left) > room:
            taken = len(arrivals) - len(left)
            raise UsageError(
                f"n ({len(arrivals)}) exceeds the {taken + room} samples one request may have on this server "
                f"({taken} decoded together, {room} waiting)",
                field="n",
            )

    def _check_room(self, arrivals: list[tuple[str, int]]) -> None:
        """Raise QueueFull unless `arrivals` ((tenant, forward tokens), in order) fit. The queue
        holds the requests waiting for a slot: those the next admission leaves waiting
        (`_admissions`), arrivals included. A request that free room in the batch takes at the
        next step waits for the step, not for a slot, so it is not counted: a burst arriving
        while a step runs is not refused for the room the batch still has (`max_queue` 0: no
        request waits, those the batch takes still run)."""
        entries = [(r.tenant, forward_tokens(r.seq)) for r in self.waiting] + arrivals
        left = [entries[i][0] for i in self._waiting_after(entries)]
        limits = self.limits
        if len(left) > limits.max_queue:
            raise QueueFull(f"the request queue is full ({limits.max_queue} waiting)")
        share = limits.max_queue_per_tenant
        if share is not None and any(left.count(tenant) > share for tenant, _ in arrivals):
            raise QueueFull(f"this API key already has {share} requests waiting (its share of the queue)")

    def _waiting_after(self, entries: list[tuple[str, int]], idle: bool = False) -> list[int]:
        """The indices of `entries` the next admission (`_admissions`) leaves waiting."""
        taken = set(self._admissions(entries, idle))
        return [i for i in range(len(entries)) if i not in taken]

    def _admissions(self, entries: list[tuple[str, int]], idle: bool = False) -> list[int]:
        """Which of `entries` ((tenant, forward tokens) of waiting requests, in arrival order)
        the next admission takes, in its order: round-robin over tenants (the tenant admitted
        least recently first, each tenant's own in arrival order) while the running set stays
        within `max_num_seqs` and `max_num_batched_tokens`. The one rule of admission: `admit`
        applies it, `_check_room` counts what it leaves waiting, and `_check_possible` (`idle`:
        as if nothing ran) what it could never take."""
        queues: dict[str, deque[int]] = {}  # each tenant's entries, tenants by first arrival
        for i, (tenant, _) in enumerate(entries):
            queues.setdefault(tenant, deque()).append(i)
        last_turn = {} if idle else dict(self._last_turn)
        turns = self._turns
        slots = self.limits.max_num_seqs - (0 if idle else len(self.running))
        tokens = 0 if idle else self.batch_tokens
        taken: list[int] = []
        while queues and len(taken) < slots:
            tenant = min(queues, key=lambda t: last_turn.get(t, -1))  # ties: never served, first to arrive
            i = queues[tenant][0]
            if tokens + entries[i][1] > self.limits.max_num_batched_tokens:
                break
            queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
            turns += 1
            last_turn[tenant] = turns
            tokens += entries[i][1]
            taken.append(i)
        return taken

    def admit(self, now: float) -> list[ScheduledRequest]:
        """Move the waiting requests `_admissions` picks into the running set, in its order;
        they take part in the next forward."""
        waiting = list(self.waiting)
        admitted = [waiting[i] for i in self._admissions([(r.tenant, forward_tokens(r.seq)) for r in waiting])]
        for request in admitted:
            self.waiting.remove(request)
            self._turns += 1
            self._last_turn[request.tenant] = self._turns
            request.admitted = now
            self._admitted[request.seq.seq_id] = request
            self.engine.add(request.seq)
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
