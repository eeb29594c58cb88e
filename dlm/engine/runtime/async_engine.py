"""AsyncEngine: continuous batching for an asyncio server.

A background thread owns the engine (any `Engine`) and loops: apply cancellations, time out requests
past their deadline, admit waiting requests (dlm/engine/runtime/scheduler.py), run one denoising step
for the whole running set. Because deadlines and cancellations are applied between steps, a
timed-out or abandoned request stops denoising within one step and frees its slot at once.

Callers on the event loop `submit()` a request (or `enqueue()` the sequences they built with
the engine's `make_sequences` beforehand, off the loop) and read its `RequestStream`:
snapshots of the committed left-to-right prefix (what can be streamed: a dLLM commits tokens
anywhere in the block, but only the prefix before the first MASK is final text) and a final
output. A stream keeps at most `MAX_UNREAD` outputs its reader has not taken: each snapshot
holds the whole prefix (and canvas), so when the reader falls behind (a client that does not
read) the oldest snapshots are dropped, never queued without bound; the final output is
always kept.

A step that fails fails its batch; an engine that fails (`EngineFailed`: a tensor-parallel
rank died or hung) fails every request it holds, refuses new ones and ends the loop, so no
request waits on an engine that cannot answer (`failure` says why).

The engine core knows nothing of HTTP: metrics reach the server through `EngineObserver`.

One thread does all of a served model's torch work: `start_on_engine_thread` loads the model,
warms it up and then runs its loop on the same new thread. torch's CPU intra-op parallelism is
OpenMP (libgomp), whose thread teams belong to the thread that opened them: a second thread
that ran torch work (loading and warming up on a helper thread, as the server once did) keeps
a second team alive, and libgomp then counts more threads than cores and switches every team
from spinning to sleeping between parallel regions, so each region pays a futex wake-up: issue
35 measured 16.4 ms per step in `dlm generate` against 39.5 ms served (on a loaded machine the
difference can go the other way; either way the two differed). With one thread the served
model has the one team `dlm generate` has, run with the threads its CPU plan chose
(dlm/engine/cpu_plan.py, applied by `LLM` on the loading thread), and the same step time.
Other threads only build new requests' small canvases (a server's preparation thread,
dlm/cli/server/prepare.py: below torch's parallel grain, so no team) and read finished ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from dlm.engine.cpu_plan import apply_threads
from dlm.engine.decoding.logprobs import TokenLogprob
from dlm.engine.errors import DlmError, EngineFailed
from dlm.engine.params import GenerationParams, ResolvedParams
from dlm.engine.runtime.interface import Engine
from dlm.engine.runtime.prefix_cache import PrefixCacheStats
from dlm.engine.runtime.request import RequestState
from dlm.engine.runtime.scheduler import ScheduledRequest, Scheduler, SchedulerLimits, forward_tokens
from dlm.engine.runtime.thread_governor import ThreadGovernor
from dlm.engine.runtime.within import within

log = logging.getLogger("dlm.engine")

MAX_UNREAD = 8  # outputs a stream keeps for its reader; beyond, the oldest snapshot is dropped
T = TypeVar("T")
ENGINE_THREAD = "dlm-engine"


class Draining(DlmError):
    """The engine stopped admitting requests (shutdown in progress)."""


class EngineObserver(Protocol):
    def on_step(self, batch_size: int, batch_tokens: int, committed: list[int], seconds: float) -> None:
        """One forward ran over `batch_size` sequences (`batch_tokens` canvas tokens) and
        committed `committed[i]` tokens for sequence i, in `seconds`."""


@dataclass
class RequestOutput:
    request_id: str
    prefix_ids: list[int]  # committed generated ids before the first MASK (may include EOS)
    nfe: int  # forwards spent so far
    finish_reason: str | None = None  # stop, length, timeout, abort, shutdown, error
    output_ids: list[int] | None = None  # the whole generated canvas, on the final output
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # of `prefix_ids`, when the request asks for them
    canvas: list[tuple[int | None, str]] | None = None  # RequestState.canvas_view(), when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class RequestStream:
    """The consumer's side of one request: outputs arrive on the event loop, at most
    `MAX_UNREAD` of them kept unread (snapshots are cumulative: a reader that falls behind
    misses intermediate ones, never the final one)."""

    request: ScheduledRequest
    wants_updates: bool
    loop: asyncio.AbstractEventLoop
    wants_canvas: bool = False  # a snapshot of the canvas after every step
    unread: deque[RequestOutput] = field(default_factory=deque)  # event-loop side
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: int = 0  # snapshots dropped because the reader was behind
    finished_at: float | None = None
    last_prefix: int = -1  # length of the last prefix sent (loop-thread side)
    # Whether a committed prefix ends the request by a rule of its caller's (a server's stop
    # strings): asked on the engine thread after every step that extends the prefix, so the
    # request leaves the batch before the next forward, however busy its reader is.
    ends: Callable[[list[int]], bool] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seq(self) -> RequestState:
        return self.request.seq

    def post(self, output: RequestOutput) -> None:
        """Hand an output to the event loop (called from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self._arrive, output)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _arrive(self, output: RequestOutput) -> None:
        if not output.finished and len(self.unread) >= MAX_UNREAD:
            self.unread.popleft()  # a snapshot: the newer ones hold all it held
            self.dropped += 1
        self.unread.append(output)
        self.arrived.set()

    async def outputs(self, patience: float | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs until the final one. If the engine stays silent for `patience` seconds
        (its loop died), end with an error output instead of waiting forever."""
        while True:
            if not self.unread:
                self.arrived.clear()
                if await within(self.arrived.wait(), patience) is None:  # not asyncio.wait_for
                    yield RequestOutput(
                        self.request_id, [], self.seq.nfe, finish_reason="error", error="the engine did not answer"
                    )
                    return
                continue
            output = self.unread.popleft()
            yield output
            if output.finished:
                return

    async def result(self, patience: float | None = None) -> RequestOutput:
        """The final output (intermediate snapshots are skipped)."""
        async for output in self.outputs(patience):
            if output.finished:
                return output
        raise AssertionError("unreachable: outputs() ends with a finished output")


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        limits: SchedulerLimits,
        observer: EngineObserver | None = None,
        governor: ThreadGovernor | None = None,
    ) -> None:
        self.engine = engine
        self.governor = governor  # the steps' thread count, applied on the engine thread
        self.scheduler = Scheduler(engine, limits)
        self.observer = observer
        self.accepting = True
        self._cv = threading.Condition()
        self._cancels: list[tuple[ScheduledRequest, str]] = []
        self._stopping = False
        self.failure: str | None = None  # why the engine can run nothing more
        self._thread: threading.Thread | None = None
        self._service_seconds = 1.0  # running average of admitted -> finished, for Retry-After

    # ---- lifecycle ---------------------------------------------------------------------

    def warmup(self) -> None:
        """A real request before serving, so the first client does not pay for lazy
        initialisation; must run before `start()`. The engine says which request is cheap."""
        assert self._thread is None, "warm up before starting the loop"
        prompt = [self.engine.config.eos_token_id or 0]
        self.engine.generate([prompt], self.engine.warmup_params)

    def start(self) -> None:
        """Run the loop on a new thread (a model loaded elsewhere: tests, a warm engine);
        a server uses `start_on_engine_thread`, which loads on the loop's thread too."""
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():  # stuck in a step: the engine is not ours to close
                return
        self.engine.close()  # a tensor-parallel engine stops its ranks

    def fail(self, reason: str) -> None:
        """The engine can run nothing more (any thread may say so): end every request with
        `reason`, refuse new ones, end the loop."""
        with self._cv:
            if self.failure is None:
                self.failure = reason
                log.error("error: %s", reason)
            self.accepting = False
            self._cv.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def cache_bytes(self) -> int:
        with self._cv:
            return self.engine.cache_bytes()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.engine.prefix_cache_stats()  # the cache locks its own counters

    @property
    def batch_tokens(self) -> int:
        with self._cv:
            return self.scheduler.batch_tokens

    # ---- requests ----------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: GenerationParams,
        *,
        timeout: float | None,
        updates: bool = False,
        canvas: bool = False,
        tenant: str = "",
    ) -> RequestStream:
        """Validate and queue a request (UsageError on bad input, QueueFull, Draining).

        With `updates`, every step that extends the committed prefix posts a snapshot; with
        `canvas`, every step posts one carrying the canvas (`RequestOutput.canvas`).
        """
        self._check_open()
        self.check_room(tenant)  # refuse before building the canvas: overload answers fast
        seq = self.engine.make_sequence(prompt_ids, params)
        return self.enqueue([request_id], [seq], timeout=timeout, updates=updates, canvas=canvas, tenant=tenant)[0]

    def check_room(self, tenant: str = "") -> None:
        """QueueFull unless one more request of `tenant` fits the queue (`Scheduler.check_room`),
        read under the loop's lock: the loop admits and removes requests meanwhile."""
        with self._cv:
            self.scheduler.check_room(tenant)

    def check_possible(self, tenant: str, params: ResolvedParams, prompt_length: int) -> None:
        """UsageError unless a request's `n` samples could ever be queued together
        (`Scheduler.check_possible`: the limits alone, no lock needed)."""
        self.scheduler.check_possible(tenant, params, prompt_length)

    def enqueue(
        self,
        request_ids: list[str],
        seqs: list[RequestState],
        *,
        timeout: float | None,
        updates: bool = False,
        canvas: bool = False,
        tenant: str = "",
        ends: Callable[[RequestState], Callable[[list[int]], bool]] | None = None,
    ) -> list[RequestStream]:
        """Queue sequences built by the engine's `make_sequences` (a request's samples), all
        of them or none (QueueFull, Draining, EngineFailed; those refused are left unqueued).
        `ends(seq)`: the rule by which a committed prefix of `seq` ends it (`RequestStream.ends`)."""
        self._check_open()
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        streams = []
        for request_id, seq in zip(request_ids, seqs):
            request = ScheduledRequest(request_id, seq, now, now + timeout if timeout else None, tenant=tenant)
            stream = RequestStream(request, updates, loop, wants_canvas=canvas, ends=ends(seq) if ends else None)
            request.context = stream
            streams.append(stream)
        with self._cv:
            self.scheduler.add(*(stream.request for stream in streams))
            self._cv.notify_all()
        return streams

    def _check_open(self) -> None:
        if self.failure is not None:
            raise EngineFailed(self.failure)
        if not self.accepting:
            raise Draining("the server is shutting down and admits no new requests")

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        """Ask the loop to drop the request before the next forward."""
        with self._cv:
            self._cancels.append((stream.request, reason))
            self._cv.notify_all()

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it, served in parallel."""
        backlog = self.num_waiting + 1
        return max(1, math.ceil(self._service_seconds * backlog / self.scheduler.limits.max_num_seqs))

    async def drain(self, grace: float) -> int:
        """Stop admitting; let in-flight requests finish (or time out) for up to `grace`
        seconds, then end the rest with finish reason `shutdown`. Returns how many were ended."""
        self.accepting = False
        end = time.monotonic() + grace
        while self.scheduler.has_work() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        with self._cv:
            left = [*self.scheduler.waiting, *self.scheduler.running]
            self._cancels.extend((r, "shutdown") for r in left)
            self._cv.notify_all()
        for _ in range(200):  # the loop answers them before its next forward
            if not self.scheduler.has_work():
                break
            await asyncio.sleep(0.05)
        return len(left)

    # ---- the loop (engine thread) ------------------------------------------------------

    def _finish(self, request: ScheduledRequest, error: str | None = None) -> None:
        seq = request.seq
        if request.admitted is not None:
            seconds = time.monotonic() - request.admitted
            self._service_seconds = 0.8 * self._service_seconds + 0.2 * seconds
        stream: RequestStream = request.context
        stream.finished_at = time.monotonic()
        stream.post(
            RequestOutput(
                request.request_id,
                seq.committed_prefix,
                seq.nfe,
                finish_reason=seq.finish_reason or "abort",
                output_ids=seq.output_ids,
                error=error,
                logprobs=seq.token_logprobs(seq.committed_prefix),
                canvas=seq.canvas_view() if stream.wants_canvas else None,
            )
        )

    def _prepare_step(self) -> list[ScheduledRequest] | None:
        """Under the lock: apply cancellations and deadlines, admit; None means stop."""
        with self._cv:
            while not (self._stopping or self.failure or self._cancels or self.scheduler.has_work()):
                self._cv.wait(timeout=1.0)
            if self.failure is not None:
                for request in [*self.scheduler.waiting, *self.scheduler.running]:
                    self.scheduler.remove(request, "error")
                    self._finish(request, error=self.failure)
                return None
            if self._stopping:
                return None
            cancels, self._cancels = self._cancels, []
            for request, reason in cancels:
                if not request.seq.finished:  # it may have finished in the meantime
                    self.scheduler.remove(request, reason)
                    self._finish(request)
            now = time.monotonic()
            for request in self.scheduler.expired(now):
                self.scheduler.remove(request, "timeout")
                self._finish(request)
            self.scheduler.admit(now)
            return list(self.scheduler.running)

    def _run(self) -> None:
        while (batch := self._prepare_step()) is not None:
            if not batch:
                continue
            masked_before = [r.seq.masks_left for r in batch]
            tokens = sum(forward_tokens(r.seq) for r in batch)
            if self.governor is not None:
                apply_threads(self.governor.threads)
            start = time.perf_counter()
            try:
                self.engine.step()
            except EngineFailed as exc:  # its requests end with the rest, in _prepare_step
                self.fail(str(exc))
                continue
            except Exception as exc:  # a failed forward fails its batch, never the server
                log.exception("denoising step failed for %d sequences", len(batch))
                with self._cv:
                    for request in batch:
                        self.scheduler.remove(request, "error")
                        self._finish(request, error=f"{type(exc).__name__}: {exc}")
                continue
            seconds = time.perf_counter() - start
            if self.governor is not None:
                self.governor.observe(seconds, tokens)
            committed = [before - r.seq.masks_left for r, before in zip(batch, masked_before)]
            if self.observer is not None:
                self.observer.on_step(len(batch), tokens, committed, seconds)
            self._after_step(batch)

    def _after_step(self, batch: list[ScheduledRequest]) -> None:
        """Post the snapshots that grew and the final outputs. A request ends by its
        sequence's own rule (an EOS ends it at block granularity), never by a rule of the
        server's: so it spends the forwards `dlm generate` spends on it."""
        with self._cv:
            for request in batch:
                seq, stream = request.seq, request.context
                prefix = seq.committed_prefix
                if seq.finished:
                    continue
                if self._ended(stream, prefix):  # its caller's rule: out before the next forward
                    self.scheduler.remove(request, "stop")
                    self._finish(request)
                    continue
                if stream.wants_canvas:  # one per step, whether or not the prefix grew
                    stream.last_prefix = len(prefix)
                    stream.post(RequestOutput(request.request_id, prefix, seq.nfe, canvas=seq.canvas_view()))
                elif stream.wants_updates and len(prefix) > stream.last_prefix:
                    stream.last_prefix = len(prefix)
                    stream.post(RequestOutput(request.request_id, prefix, seq.nfe, logprobs=seq.token_logprobs(prefix)))
            for request in self.scheduler.reap():
                self._finish(request)

    def _ended(self, stream: RequestStream, prefix: list[int]) -> bool:
        """Whether the caller's rule (`RequestStream.ends`) ends the request at this committed
        prefix (it reads the text only when the prefix grew: `stops.ends_at_stop`). A rule that
        fails is dropped (logged), never the engine thread: the request then ends by its own rule."""
        if stream.ends is None:
            return False
        try:
            return stream.ends(prefix)
        except Exception:  # noqa: BLE001 - a caller's rule never stops the loop
            log.exception("the end rule of request %s failed; it ends by its own rule", stream.request_id)
            stream.ends = None
            return False


def start_on_engine_thread(build: Callable[[], tuple[AsyncEngine, T]]) -> T:
    """Run `build` (load a model, warm it up, make its AsyncEngine) on a new thread that then
    runs that engine's loop, and return what `build` returned beside the engine once it has
    (or raise what it raised: the thread then ends, and its OpenMP team with it). So every
    torch op of the model runs on one thread (see the module docstring)."""
    built: Future[T] = Future()

    def main() -> None:
        try:
            engine, result = build()
        except BaseException as exc:  # the caller raises it
            built.set_exception(exc)
            return
        engine._thread = threading.current_thread()
        built.set_result(result)
        engine._run()

    threading.Thread(target=main, name=ENGINE_THREAD, daemon=True).start()
    return built.result()
