"""Continuous batching in process: the scheduler's bounds and the async engine's loop
(joins at the next step, leaves at once, deadlines within one step, batched == alone)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from dlm.engine.errors import UsageError
from dlm.engine.params import GenerationParams, ResolvedParams
from dlm.engine.runtime.async_engine import AsyncEngine
from dlm.engine.runtime.engine import LLMEngine, load_model
from dlm.engine.runtime.scheduler import QueueFull, ScheduledRequest, Scheduler, SchedulerLimits
from tests.serving import app_client, wait_until
from tests.tiny_families import MAX_TOKENS, tiny_names


@pytest.fixture(scope="module")
def engine(tiny_llada: Path) -> Iterator[LLMEngine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/serving.py: spinning OpenMP threads on a shared machine
    try:
        yield LLMEngine(load_model(tiny_llada, torch.float32, torch.device("cpu")))
    finally:
        torch.set_num_threads(threads)


def request(engine: LLMEngine, n: int, gen: int = 16, deadline: float | None = None) -> ScheduledRequest:
    seq = engine.make_sequence([5, 6, 7][: 1 + n % 3], GenerationParams(gen_length=gen, block_length=8))
    return ScheduledRequest(f"r{n}", seq, time.monotonic(), deadline)


def test_admission_respects_sequence_and_token_bounds(engine: LLMEngine) -> None:
    engine.running.clear()
    scheduler = Scheduler(engine, SchedulerLimits(max_num_seqs=2, max_num_batched_tokens=40, max_queue=3))
    reqs = [request(engine, i) for i in range(5)]
    for r in reqs:  # the first two join at the next admission; the queue holds the other three
        scheduler.add(r)
    with pytest.raises(QueueFull):
        scheduler.add(request(engine, 9))
    admitted = scheduler.admit(time.monotonic())
    # Each canvas is prompt (1..3) + 16 tokens: two fit in 40 tokens and two sequences.
    assert [r.request_id for r in admitted] == ["r0", "r1"]
    assert [s.seq_id for s in engine.running] == [r.seq.seq_id for r in admitted]
    assert scheduler.batch_tokens <= 40 and len(scheduler.waiting) == 3
    engine.step()
    scheduler.remove(admitted[0], "abort")  # leaves before the next forward
    assert admitted[0].seq.finish_reason == "abort"
    assert all(s is not admitted[0].seq for s in engine.running)
    assert [r.request_id for r in scheduler.admit(time.monotonic())] == ["r2"]  # joins at the next step
    nfe = admitted[0].seq.nfe
    engine.step()
    assert admitted[0].seq.nfe == nfe and reqs[2].seq.nfe == 1
    engine.running.clear()


def test_a_request_larger_than_the_token_budget_is_refused(engine: LLMEngine) -> None:
    """Refused naming `gen_length` (a server's `max_tokens`), before the sequence exists
    (`check_possible`, from the parameters) as when it is queued."""
    scheduler = Scheduler(engine, SchedulerLimits(max_num_seqs=2, max_num_batched_tokens=10, max_queue=3))
    with pytest.raises(UsageError, match="max_num_batched_tokens") as queued:
        scheduler.add(request(engine, 0))
    seq = request(engine, 0).seq
    with pytest.raises(UsageError) as checked:
        scheduler.check_possible("", seq.params, seq.prompt_length)
    assert str(checked.value) == str(queued.value) and checked.value.field == queued.value.field == "gen_length"


def test_committed_prefix_stops_at_the_first_mask(engine: LLMEngine) -> None:
    seq = engine.make_sequence([5], GenerationParams(gen_length=4, block_length=4))
    seq.canvas[1:] = torch.tensor([10, 11, seq.mask_id, 12])
    assert seq.committed_prefix == [10, 11]


class StepLog:
    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int]] = []  # (start, end, batch size)

    def on_step(self, batch_size: int, batch_tokens: int, committed: list[int], seconds: float) -> None:
        end = time.monotonic()
        self.steps.append((end - seconds, end, batch_size))


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


@asynccontextmanager
async def started(engine: LLMEngine, limits: SchedulerLimits, log: StepLog | None = None) -> AsyncIterator[AsyncEngine]:
    """The server loop running over `engine`, stopped however the test inside ends."""
    aengine = AsyncEngine(engine, limits, observer=log)
    aengine.start()
    try:
        yield aengine
    finally:
        aengine.stop()


# A request long enough to be still decoding when the test acts on it.
LONG = GenerationParams(gen_length=256, block_length=256, steps=256)


def assert_batched_match_solo(solo: list[list[int]], outs: list, eos: int | None) -> None:
    """Each batched output's committed prefix (up to its EOS) is what the request gave alone."""
    for expected, out in zip(solo, outs):
        assert out.finish_reason in ("stop", "length")
        n = out.prefix_ids.index(eos) + 1 if eos in out.prefix_ids else len(out.prefix_ids)
        assert n > 0 and out.prefix_ids[:n] == expected[:n]


def test_requests_share_forwards_and_match_solo_outputs(engine: LLMEngine) -> None:
    engine.running.clear()
    params = [GenerationParams(gen_length=g, block_length=8, steps=s) for g, s in ((16, 16), (24, 12), (8, 8))]
    prompts = [[5, 6, 7], [9, 10], [11]]
    solo = [engine.generate([p], prm)[0].output_ids for p, prm in zip(prompts, params)]

    async def main() -> list[list[int]]:
        log = StepLog()
        async with started(engine, SchedulerLimits(max_num_seqs=4), log) as aengine:
            streams = [aengine.submit(f"r{i}", p, prm, timeout=None) for i, (p, prm) in enumerate(zip(prompts, params))]
            outs = [await s.result() for s in streams]
        assert max(size for _, _, size in log.steps) == 3  # all three in one forward
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        return [s.seq.output_ids for s in streams]

    batched = run(main())
    eos = engine.config.eos_token_id
    for a, b in zip(solo, batched):
        n = b.index(eos) + 1 if eos in b else len(b)  # an early EOS stop leaves the tail masked
        assert a[:n] == b[:n]


def test_deadline_stops_denoising_within_one_step(engine: LLMEngine) -> None:
    engine.running.clear()

    async def main() -> None:
        log = StepLog()
        async with started(engine, SchedulerLimits(), log) as aengine:
            stream = aengine.submit("slow", [5, 6], LONG, timeout=0.3)
            deadline = stream.request.deadline
            out = await stream.result()
            assert out.finish_reason == "timeout"
            assert 0 < out.nfe < 256
            assert aengine.num_running == 0 and engine.running == []
            # No forward started after the deadline included the timed-out request.
            assert not [s for s in log.steps if s[0] > deadline + 0.01]
            # The slot is free: a new request runs to the end.
            quick = aengine.submit("quick", [5], GenerationParams(gen_length=8, block_length=8), timeout=None)
            assert (await quick.result()).finish_reason in ("stop", "length")

    run(main())


def test_abort_leaves_before_the_next_forward(engine: LLMEngine) -> None:
    engine.running.clear()

    async def main() -> None:
        async with started(engine, SchedulerLimits()) as aengine:
            stream = aengine.submit("gone", [5, 6], LONG, timeout=None, updates=True)
            async for out in stream.outputs():
                if out.nfe >= 2:
                    break
            aengine.abort(stream)
            final = await stream.result()
            assert final.finish_reason == "abort" and final.nfe < 256
            assert aengine.num_running == 0

    run(main())


def test_queue_full_is_immediate_and_drain_ends_work(engine: LLMEngine) -> None:
    engine.running.clear()

    async def main() -> None:
        async with started(engine, SchedulerLimits(max_num_seqs=1, max_queue=1)) as aengine:
            first = aengine.submit("a", [5], LONG, timeout=None)
            for _ in range(200):  # the loop admits it before its first forward
                if aengine.num_running:
                    break
                await asyncio.sleep(0.01)
            second = aengine.submit("b", [5], LONG, timeout=None)
            with pytest.raises(QueueFull):  # raised by the call itself, while the others still run
                aengine.submit("c", [5], LONG, timeout=None)
            assert aengine.num_running == 1 and aengine.num_waiting == 1
            assert aengine.retry_after() >= 1
            ended = await aengine.drain(grace=0.2)
            assert ended == 2
            assert (await first.result()).finish_reason == "shutdown"
            assert (await second.result()).finish_reason == "shutdown"
            with pytest.raises(Exception, match="shutting down"):
                aengine.submit("d", [5], LONG, timeout=None)

    run(main())


@pytest.mark.parametrize("cache", ["block", "none"])
def test_block_causal_family_serves_through_the_same_loop(tmp_path: Path, cache: str) -> None:
    from dlm.engine.block_checkpoints import write_tiny
    from dlm.engine.llm import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(write_tiny(tmp_path / "sdar", "sdar"), dtype="float32", device="cpu")
        block_engine = llm.engine
        prompts = [[5, 6, 7, 8, 9], [11, 12]]
        params = GenerationParams(gen_length=16, cache=cache)
        solo = [block_engine.generate([p], params)[0].output_ids for p in prompts]

        async def main() -> list:
            aengine = AsyncEngine(block_engine, SchedulerLimits(max_num_seqs=2))
            aengine.warmup()
            aengine.start()
            try:
                streams = [aengine.submit(f"b{i}", p, params, timeout=None) for i, p in enumerate(prompts)]
                return [await s.result() for s in streams]
            finally:
                aengine.stop()

        outs = run(main())
    finally:
        torch.set_num_threads(threads)
    assert_batched_match_solo(solo, outs, block_engine.config.eos_token_id)


def test_dream_with_caches_serves_through_the_same_loop(tiny_dream: Path) -> None:
    """Dream requests with different caches (none, prefix, dual) and algorithms share the
    server loop's forwards and give what each gives alone (batch invariance)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dream = LLMEngine(load_model(tiny_dream, torch.float32, torch.device("cpu")))
        params = [
            GenerationParams(gen_length=16, block_length=8, steps=8, cache="prefix"),
            GenerationParams(gen_length=16, block_length=8, cache="dual", alg="confidence_threshold"),
            GenerationParams(gen_length=8, steps=4, alg="topk_margin"),
        ]
        prompts = [[5, 6, 7], [9, 10], [11]]
        solo = [dream.generate([p], prm)[0].output_ids for p, prm in zip(prompts, params)]

        async def main() -> list:
            log = StepLog()
            async with started(dream, SchedulerLimits(max_num_seqs=4), log) as aengine:
                streams = [
                    aengine.submit(f"d{i}", p, prm, timeout=None) for i, (p, prm) in enumerate(zip(prompts, params))
                ]
                outs = [await s.result() for s in streams]
            assert max(size for _, _, size in log.steps) == 3  # all three in one forward
            return outs

        outs = run(main())
    finally:
        torch.set_num_threads(threads)
    assert_batched_match_solo(solo, outs, dream.config.eos_token_id)


def tenant_request(engine: LLMEngine, tenant: str, n: int) -> ScheduledRequest:
    seq = engine.make_sequence([5], GenerationParams(gen_length=8, block_length=8))
    return ScheduledRequest(f"{tenant}{n}", seq, time.monotonic(), None, tenant=tenant)


def samples(engine: LLMEngine, n: int) -> tuple[ResolvedParams, int]:
    """The resolved parameters of `n` samples like `tenant_request`'s, and its prompt length."""
    return engine.validate(GenerationParams(gen_length=8, block_length=8, n=n), 1), 1


def test_one_tenant_cannot_fill_the_queue_and_tenants_take_turns(engine: LLMEngine) -> None:
    """A tenant holds at most its share of the waiting queue (the others still get in), and
    waiting requests join round-robin over tenants, each tenant's in arrival order."""
    engine.running.clear()
    scheduler = Scheduler(engine, SchedulerLimits(max_num_seqs=1, max_queue=8, max_queue_per_tenant=3))
    running = tenant_request(engine, "z", 0)  # the one slot taken: every request below waits for it
    scheduler.add(running)
    assert scheduler.admit(time.monotonic()) == [running]
    for i in range(3):
        scheduler.add(tenant_request(engine, "a", i))
    with pytest.raises(QueueFull, match="share"):
        scheduler.add(tenant_request(engine, "a", 3))
    scheduler.add(tenant_request(engine, "b", 0))  # another tenant still gets in
    scheduler.add(tenant_request(engine, "c", 0))
    with pytest.raises(QueueFull, match="share"):  # a request's samples: all of them or none
        scheduler.add(tenant_request(engine, "c", 1), tenant_request(engine, "c", 2), tenant_request(engine, "c", 3))
    assert len(scheduler.waiting) == 5
    scheduler.remove(running, "abort")
    order = []
    while scheduler.waiting:
        (admitted,) = scheduler.admit(time.monotonic())
        order.append(admitted.request_id)
        scheduler.remove(admitted, "abort")
    assert order == ["a0", "b0", "c0", "a1", "a2"]
    engine.running.clear()


def test_the_queue_counts_what_the_next_admission_leaves_waiting(engine: LLMEngine) -> None:
    """A request that free room in the batch takes at the next step is not waiting for a slot:
    the queue bound counts only those the next admission (its own rule: slots, tokens,
    round-robin) leaves waiting, with each tenant's share counted the same way."""
    engine.running.clear()
    none_wait = Scheduler(engine, SchedulerLimits(max_num_seqs=2, max_queue=0))
    none_wait.check_room()  # room in the batch: it runs, though no request may wait
    none_wait.add(tenant_request(engine, "a", 0), tenant_request(engine, "a", 1))  # n = 2: both taken
    with pytest.raises(QueueFull, match="queue is full"):  # the batch is spoken for: this one would wait
        none_wait.add(tenant_request(engine, "a", 2))
    assert [r.request_id for r in none_wait.admit(time.monotonic())] == ["a0", "a1"]
    with pytest.raises(QueueFull, match="queue is full"):  # running now: no slot, no waiting
        none_wait.check_room()
    engine.running.clear()
    # Canvases of 9 tokens (1 + 8); 20 forward tokens hold two, whatever the sequence slots.
    tokens = Scheduler(engine, SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=20, max_queue=1))
    tokens.add(tenant_request(engine, "a", 0), tenant_request(engine, "a", 1), tenant_request(engine, "a", 2))
    with pytest.raises(QueueFull, match="queue is full"):
        tokens.add(tenant_request(engine, "b", 0))
    shares = Scheduler(engine, SchedulerLimits(max_num_seqs=2, max_queue=8, max_queue_per_tenant=1))
    shares.add(*(tenant_request(engine, "a", i) for i in range(3)))  # two taken, one waits
    with pytest.raises(QueueFull, match="share"):
        shares.add(tenant_request(engine, "a", 3))
    shares.add(tenant_request(engine, "b", 0))  # another key's share is its own
    assert [r.request_id for r in shares.admit(time.monotonic())] == ["a0", "b0"]  # round-robin
    engine.running.clear()


def test_samples_no_wait_lets_in_are_a_usage_error_not_queue_full(engine: LLMEngine) -> None:
    """A request's samples are queued together or not at all. Those an idle batch takes plus
    those the queue (and the tenant's share) holds can pass once the batch empties, so beyond
    that is a usage error (a 400 on `n`), never `QueueFull`, which tells a client to retry;
    up to it, the request passes when the batch is idle (`--max-queue 0` with 2 slots takes
    n = 2). Forward tokens count as admission counts them."""
    engine.running.clear()
    none_wait = Scheduler(engine, SchedulerLimits(max_num_seqs=2, max_queue=0))
    none_wait.check_possible("a", *samples(engine, 2))
    with pytest.raises(UsageError, match=r"n \(3\) exceeds the 2 samples") as refused:
        none_wait.check_possible("a", *samples(engine, 3))
    assert refused.value.field == "n"
    none_wait.add(tenant_request(engine, "a", 0), tenant_request(engine, "a", 1))
    with pytest.raises(UsageError):
        none_wait.add(*(tenant_request(engine, "b", i) for i in range(3)))
    # Canvases of 9 tokens: 20 forward tokens take two at once, so with a queue of 1 three
    # pass and four never do, whatever the sequence slots.
    tokens = Scheduler(engine, SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=20, max_queue=1))
    tokens.check_possible("a", *samples(engine, 3))
    with pytest.raises(UsageError, match=r"\(2 decoded together, 1 waiting\)") as checked:
        tokens.check_possible("a", *samples(engine, 4))  # before the canvases exist: counted from the parameters
    with pytest.raises(UsageError, match=r"\(2 decoded together, 1 waiting\)") as queued:
        tokens.add(*(tenant_request(engine, "a", i) for i in range(4)))
    assert str(checked.value) == str(queued.value)
    tokens.add(*(tenant_request(engine, "a", i) for i in range(3)))
    shares = Scheduler(engine, SchedulerLimits(max_num_seqs=2, max_queue=8, max_queue_per_tenant=1))
    shares.check_possible("a", *samples(engine, 3))
    with pytest.raises(UsageError):
        shares.check_possible("a", *samples(engine, 4))
    engine.running.clear()


def test_a_stream_its_reader_does_not_read_keeps_a_bounded_number_of_outputs(engine: LLMEngine) -> None:
    """A canvas stream posts an output at every step; unread, the stream keeps MAX_UNREAD of
    them (the newest) and the final one, so memory does not grow with the steps."""
    from dlm.engine.runtime.async_engine import MAX_UNREAD

    engine.running.clear()

    async def main() -> None:
        async with started(engine, SchedulerLimits()) as aengine:
            stream = aengine.submit("unread", [5, 6], LONG, timeout=None, updates=True, canvas=True)
            while stream.finished_at is None:  # the engine runs all 256 steps; nobody reads
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # the last outputs reach the loop
            assert stream.seq.nfe == 256 and len(stream.unread) == MAX_UNREAD + 1
            assert stream.dropped == 255 - MAX_UNREAD  # a snapshot after each step but the last, then the final
            outputs = [out async for out in stream.outputs()]
            assert outputs[-1].finished and outputs[-1].canvas is not None
            steps = [out.nfe for out in outputs]
            assert steps == sorted(steps) and steps[-1] == 256  # the newest, in order

    run(main())


def test_a_reader_cancelled_as_an_output_arrives_stops_reading(engine: LLMEngine) -> None:
    """The stream's wait for its next output was `asyncio.wait_for`, which on Python 3.10 and
    3.11 swallows a cancellation that comes as the output arrives: the reader cancelled (a
    response's choice reader, its client gone) read on, then waited forever on the queue
    nobody drained, and the garbage collector destroyed it ('Task was destroyed but it is
    pending!' on the server's stderr)."""
    from dlm.engine.runtime.async_engine import RequestOutput, RequestStream

    async def main() -> None:
        stream = RequestStream(request(engine, 1), True, asyncio.get_running_loop())
        read: list[RequestOutput] = []

        async def reader() -> None:
            async for out in stream.outputs(patience=60):
                read.append(out)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)  # it waits for an output
        stream.post(RequestOutput("reader", [5], 1))  # arrives on the loop's next turn ...
        await asyncio.sleep(0)
        task.cancel()  # ... as the reader is cancelled
        await asyncio.wait({task}, timeout=5)
        assert task.cancelled() and read == []

    run(main())


def test_a_burst_that_free_slots_take_is_not_counted_against_the_queue() -> None:
    """Requests that arrive together while a step runs wait for its end, not for a slot: the
    free slots take them at the next step. They used to count against `--max-queue` meanwhile,
    so a burst was refused `queue_full` though the batch had room for it (and `--max-queue 0`
    refused every request). Now only what the next admission leaves waiting counts: with 4
    sequence slots, 1 running and a queue of 1, a burst of 5 has 3 taken by the free slots,
    1 queued and 1 refused."""
    settings = {"model": "tiny:llada", "warmup": False, "max_num_seqs": 4, "max_queue": 1, "max_tokens": 64}
    body = {"prompt": [5, 6, 7], "max_tokens": 8}
    with app_client(settings) as client:
        aengine = client.app.state.service.engine
        engine, real = aengine.engine, aengine.engine.step
        inside, gate = threading.Event(), threading.Event()

        def held_step() -> list:
            inside.set()
            assert gate.wait(120), "the test never opened the gate"
            return real()

        engine.step = held_step  # the loop's first step holds until the burst has arrived
        statuses: list[int] = []
        codes: list[str | None] = []
        first, burst = threading.Thread(target=lambda: None), []

        def send() -> None:
            response = client.post("/v1/completions", json=body)
            statuses.append(response.status_code)
            if response.status_code != 200:
                codes.append(response.json()["error"]["code"])

        try:
            first = threading.Thread(target=send)
            first.start()
            assert inside.wait(60) and aengine.num_running == 1
            burst = [threading.Thread(target=send) for _ in range(5)]
            for thread in burst:
                thread.start()
            assert wait_until(lambda: aengine.num_waiting + len(statuses) == 5, timeout=60)
            assert (aengine.num_waiting, codes) == (4, ["queue_full"]), (aengine.num_waiting, codes, statuses)
        finally:
            gate.set()
            for thread in [first, *burst]:
                if thread.is_alive():
                    thread.join(120)
            del engine.step
        assert sorted(statuses) == [200] * 5 + [429], statuses


def test_n_that_an_idle_batch_takes_is_served_with_no_queue() -> None:
    """`--max-queue 0` with 2 sequence slots serves a request of n = 2 (the batch takes both
    choices, none waits); n = 3 can never be queued together, a 400 on `n`. The server used to
    refuse every n over the queue's share (0 here) though the batch would take them."""
    settings = {"model": "tiny:llada", "warmup": False, "max_num_seqs": 2, "max_queue": 0, "max_tokens": 64}
    body = {"prompt": [5, 6, 7], "max_tokens": 8}
    with app_client(settings) as client:
        for path in ("/v1/completions", "/tokenize"):
            answered = client.post(path, json={**body, "n": 2})
            assert answered.status_code == 200, answered.text
            refused = client.post(path, json={**body, "n": 3})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["param"], error["code"]) == ("n", "invalid_value"), error
            assert "(2 decoded together, 0 waiting)" in error["message"], error
        assert len(client.post("/v1/completions", json={**body, "n": 2}).json()["choices"]) == 2


@pytest.mark.parametrize("name", tiny_names())
def test_forward_tokens_derive_from_the_parameters_on_every_family(name: str) -> None:
    """What the token bound counts for a sequence (`forward_tokens`) is derived from its
    resolved parameters and prompt length (so a check before it exists counts the same), and
    is the canvas the family's sequence holds: a block grid's whole blocks, DiffusionGemma's
    canvases once all are drawn."""
    from dlm.engine.llm import LLM
    from dlm.engine.runtime.scheduler import forward_tokens

    with LLM(f"tiny:{name}", dtype="float32", device="cpu") as llm:
        problems = []
        for gen in MAX_TOKENS:
            for prompt in ([5, 6], list(range(5, 40))):
                params = GenerationParams(gen_length=gen, ignore_eos=True)  # no early stop: the whole canvas
                (seq,) = llm.engine.generate([prompt], params)
                expected = llm.engine.validate(params, len(prompt)).forward_tokens(len(prompt))
                if not forward_tokens(seq) == expected == len(seq.canvas):
                    problems.append(
                        f"{gen=} prompt {len(prompt)}: {forward_tokens(seq)}, {expected}, {len(seq.canvas)}"
                    )
    assert not problems, problems


@pytest.mark.parametrize("name", tiny_names())
def test_tokenize_refuses_what_generation_refuses_for_forward_tokens(name: str) -> None:
    """`/tokenize` answers as generation does where the refusal depends on the canvases'
    tokens per forward (--max-num-batched-tokens 64): CFG doubling a 42-token canvas past the
    bound (a 400 naming the field, `max_tokens` where the family takes CFG), and n = 3 of
    canvases of at least 22 tokens, which fit the sequence slots but never the token bound
    together. /tokenize used to answer 200 to both (its check counted no tokens)."""
    settings = {
        "model": f"tiny:{name}",
        "warmup": False,
        "max_num_batched_tokens": 64,
        "max_queue": 0,
        "max_tokens": 64,
    }
    bodies = (
        {"prompt": [5, 6], "max_tokens": 40, "cfg_scale": 1.0},
        {"prompt": [5, 6], "max_tokens": 20, "n": 3},
        {"prompt": [5, 6], "max_tokens": 1},  # what generation takes, /tokenize takes
    )
    with app_client(settings) as client:
        answers = [[client.post(path, json=body) for path in ("/v1/completions", "/tokenize")] for body in bodies]
        takes_cfg = "cfg_scale" not in answers[0][0].text
    for body, (generation, tokenize) in zip(bodies, answers):
        refused = generation.status_code == 400
        assert refused == (body is not bodies[-1]), (body, generation.text)
        assert tokenize.status_code == generation.status_code, (body, generation.text, tokenize.text)
        if refused:
            error = generation.json()["error"]
            assert tokenize.json()["error"] == error, (body, error)
            assert error["param"] in body, (body, error)  # every 400 names the field to change
    if takes_cfg:  # the bound, not guidance itself, refused it
        assert answers[0][0].json()["error"]["param"] == "max_tokens", answers[0][0].text
