"""Answers kept for identical requests (the deployment guides' 缓存高频请求: a result cache for
frequent, fixed requests): a request that the same API key sends again, to the same model
version, with the same prompt tokens, resolved parameters and answer options, is answered
from memory, without a forward.

Only what is certain to come out the same is kept: non-streamed answers (a stream's timing is
part of what its client asked for) of requests whose decoding is reproducible
(`dlm.engine.params.reproducible`: seeded, or without random draws), every choice of which
ended normally (stop, length or tool calls). Each API key has its own entries, so no tenant
learns from a fast answer what another asked. Least recently used entries go first beyond
`response_cache_size` answers; a hot swap's new version shares none (the model is part of the
key). The answer is kept as its choices and usage, read-only: a hit gets its own id and time.
A request whose `Cache-Control` says `no-cache` or `no-store` is neither answered from it nor
kept (`bypassed`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

FINISHED = ("stop", "length", "tool_calls")  # finish reasons of an answer worth keeping
BYPASS = {"no-cache", "no-store"}  # Cache-Control request directives that ask for a fresh answer


def bypassed(cache_control: str | None) -> bool:
    """Whether a request's `Cache-Control` header asks for a fresh answer (`no-cache` or
    `no-store`, HTTP's directives): such a request is decoded, and its answer not kept. A
    client that measures the server (`dlm validate`'s usage and step checks, sent again on a
    later run) got a kept answer's `denoising_steps` 0 otherwise."""
    directives = (cache_control or "").lower().split(",")
    return any(d.split("=", 1)[0].strip() in BYPASS for d in directives)


@dataclass(frozen=True)
class CachedAnswer:
    choices: list[dict[str, Any]]
    usage: dict[str, int]
    completion_ids: list[int]
    output_text: str | None
    finish_reason: str


class ResponseCache:
    """An LRU map of request keys to answers, safe across threads (answers are built on a
    worker thread, looked up on the event loop). `size` 0: nothing is kept."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[Hashable, CachedAnswer] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> CachedAnswer | None:
        with self._lock:
            answer = self._entries.get(key)
            if answer is not None:
                self._entries.move_to_end(key)
            return answer

    def put(self, key: Hashable, answer: CachedAnswer) -> None:
        if self.size == 0 or any(c.get("finish_reason") not in FINISHED for c in answer.choices):
            return
        with self._lock:
            self._entries[key] = answer
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
