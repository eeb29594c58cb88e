"""`within` (dlm/engine/runtime/within.py): a bounded wait that never swallows its caller's
cancellation, as `asyncio.wait_for` did on Python 3.10/3.11."""

from __future__ import annotations

import asyncio

import pytest

from dlm.engine.runtime.within import within


def test_within_gives_the_finished_future_or_none_at_the_timeout() -> None:
    async def run() -> None:
        async def value() -> int:
            return 7

        async def fails() -> None:
            raise ValueError("bad")

        done = await within(value(), 1)
        assert done is not None and done.result() == 7
        failed = await within(fails(), 1)
        assert failed is not None and isinstance(failed.exception(), ValueError)
        forever = asyncio.Event()
        assert await within(forever.wait(), 0.01) is None

    asyncio.run(run())


def test_a_cancellation_as_the_awaited_ends_reaches_the_caller() -> None:
    """The caller is cancelled in the very step its awaitable finishes (with an error here):
    the cancellation propagates, and the awaitable's error is retrieved (no 'never retrieved')."""

    async def run() -> None:
        gate = asyncio.Event()

        async def inner() -> None:
            await gate.wait()
            raise ValueError("ended as the caller left")

        caller = asyncio.ensure_future(within(inner(), 5))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.sleep(0)  # inner runs to its error now; the caller is woken next
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller

    asyncio.run(run())
