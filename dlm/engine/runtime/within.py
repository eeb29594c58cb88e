"""Awaiting something for at most a while, without `asyncio.wait_for`.

On Python 3.10 and 3.11 `asyncio.wait_for` swallows a cancellation of its caller that comes in
the step its inner awaitable finishes (the CPython issue fixed in 3.12): a request cancelled as
its body's last chunk arrived went on to decode for nobody, and a stream's reader cancelled as
an output arrived went on reading. `asyncio.wait` never swallows one, so this is built on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float | None) -> asyncio.Future[T] | None:
    """`awaitable`'s finished future if it ends within `timeout` seconds (its `result()` gives
    its value or raises its error), else None, with it cancelled. A cancellation of the caller
    cancels it too and propagates; an error it ended with meanwhile is then retrieved here, so
    asyncio does not report it as never retrieved."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        task.cancel()
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: the caller reads it through the future, or has gone
    return task if done else None
