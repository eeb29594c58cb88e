"""Request preparation off the event loop: sizes refused before any tokenising, a bounded
backlog, and a prompt encoded again when a hot swap replaced the model meanwhile."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from dlm.cli.server import prepare
from dlm.cli.server.errors import APIError
from dlm.cli.server.prepare import CHARS_PER_TOKEN, TOKENS_PER_MESSAGE, Preparer
from dlm.cli.server.protocol import ChatRequest, CompletionRequest
from dlm.engine.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS


class CountingTokenizer:
    """Stands for a tokenizer: counts the calls that would cost CPU."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        self.calls += 1
        return {"input_ids": [1] * len(text)}

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> list[int]:
        self.calls += 1
        return [1] * len(messages)


@dataclass(eq=False)
class Served:
    max_model_len: int = 64
    tokenizer: CountingTokenizer = field(default_factory=CountingTokenizer)


@dataclass
class Bounds:
    """The settings a Preparer reads its bounds from: a backlog of `max_queue + max_num_seqs`
    bodies, `queue_share() + max_num_seqs` of one key."""

    max_queue: int = 3
    max_num_seqs: int = 1
    share: int | None = None

    def queue_share(self) -> int:
        return self.max_queue if self.share is None else self.share


def bounds(backlog: int, share: int | None = None) -> Bounds:
    """Settings giving a Preparer `backlog` bodies in all and `share` of one key (with a batch of one)."""
    return Bounds(backlog - 1, 1, None if share is None else share - 1)


@dataclass
class FakeService:
    served: Any
    models: list[str | None] = field(default_factory=list)
    config: Bounds = field(default_factory=Bounds)

    def check_model(self, name: str | None) -> None:
        self.models.append(name)

    def queue_share(self) -> int:
        return self.config.queue_share()


def run(service: FakeService, body: dict[str, Any], model: type = CompletionRequest, backlog: int = 4) -> Any:
    service.config = bounds(backlog)

    async def go() -> Any:
        preparer = Preparer()
        try:
            return await preparer.prepare(service, json.dumps(body).encode(), model)  # type: ignore[arg-type]
        finally:
            preparer.close()

    return asyncio.run(go())


def test_a_prompt_too_long_to_fit_is_refused_before_tokenising() -> None:
    served = Served()
    with pytest.raises(APIError) as caught:
        run(FakeService(served), {"prompt": "x" * (64 * CHARS_PER_TOKEN + 1)})
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "context_length_exceeded", "prompt")
    assert served.tokenizer.calls == 0
    assert run(FakeService(served), {"prompt": "x" * 10}).prompt_ids == [1] * 10


def test_a_chat_with_too_many_messages_is_refused_before_rendering() -> None:
    served = Served()
    messages = [{"role": "user", "content": "hi"}] * (64 // TOKENS_PER_MESSAGE + 1)
    with pytest.raises(APIError) as caught:
        run(FakeService(served), {"messages": messages}, ChatRequest)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "messages")
    assert served.tokenizer.calls == 0
    prepared = run(FakeService(served), {"messages": messages[:3], "max_completion_tokens": 5}, ChatRequest)
    assert (prepared.prompt_ids, prepared.max_tokens) == ([1] * 3, 5)


def test_a_full_backlog_is_429_at_once() -> None:
    async def go() -> None:
        preparer = Preparer()
        preparer.pending = 1  # one body already being prepared
        try:
            with pytest.raises(APIError) as caught:
                service = FakeService(Served(), config=bounds(1))
                await preparer.prepare(service, b'{"prompt": "x"}', CompletionRequest)  # type: ignore[arg-type]
            assert (caught.value.status, caught.value.code) == (429, "queue_full")
            assert caught.value.headers["Retry-After"] == "1"
        finally:
            preparer.close()

    asyncio.run(go())


def test_a_detokenize_body_counts_in_the_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    """`/detokenize` bodies ran on the same pool outside the backlog's count: any number of
    them waited there, ahead of the generation bodies the bound was for. One being decoded
    now fills a backlog of one, so the next body is a 429 at once, and once it is done the
    backlog is free again."""
    started, release = threading.Event(), threading.Event()

    def decoding(*_: Any) -> str:
        started.set()
        release.wait(30)
        return "text"

    monkeypatch.setattr(prepare, "_detokenize", decoding)

    async def go() -> None:
        preparer = Preparer()
        service = FakeService(Served(), config=bounds(1))
        try:
            first = asyncio.ensure_future(preparer.detokenize(service, b'{"tokens": [1]}'))  # type: ignore[arg-type]
            assert await asyncio.to_thread(started.wait, 30)
            with pytest.raises(APIError) as caught:
                await preparer.prepare(service, b'{"prompt": "x"}', CompletionRequest)  # type: ignore[arg-type]
            assert (caught.value.status, caught.value.code) == (429, "queue_full")
            release.set()
            assert await first == "text"
            assert (await preparer.prepare(service, b'{"prompt": "x"}', CompletionRequest)).prompt_ids == [1]  # type: ignore[arg-type]
        finally:
            release.set()
            preparer.close()

    asyncio.run(go())


def test_a_hot_swap_during_preparation_encodes_again_with_the_new_model(monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = Served(), Served()
    service = FakeService(old)
    encode = prepare._completion

    def swapping(served: Served, body: CompletionRequest) -> Any:
        service.served = new  # the swap lands while this body is being encoded
        return encode(served, body)  # type: ignore[arg-type]

    monkeypatch.setattr(prepare, "_completion", swapping)
    run(service, {"prompt": "hello", "model": "m"})
    assert (old.tokenizer.calls, new.tokenizer.calls) == (1, 1)
    assert service.models == ["m", "m"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forcing_a_tool_is_unsupported_as_documented(choice: Any) -> None:
    """docs/serve.md lists forcing a tool among the fields refused with code `unsupported`
    (a value dlm understands but cannot honour), not `invalid_value`."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": choice}
    with pytest.raises(APIError) as caught:
        run(FakeService(Served()), body, ChatRequest)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "unsupported", "tool_choice")


@pytest.mark.parametrize(
    "stop, message",
    [
        ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], f"at most {MAX_STOP_STRINGS} stop strings"),
        ("x" * (MAX_STOP_CHARS + 1), f"at most {MAX_STOP_CHARS} characters"),
        (["a", "x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"),
    ],
)
def test_stop_strings_are_bounded_before_tokenising(stop: Any, message: str) -> None:
    """Each output of a request is searched for every stop string on the event loop: 50,000
    of them (a 1 MB body) held /health for up to a second per request, n choices times."""
    served = Served()
    with pytest.raises(APIError) as caught:
        run(FakeService(served), {"prompt": "hi", "stop": stop})
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "invalid_value", "stop")
    assert message in caught.value.message and served.tokenizer.calls == 0
    most = [f"s{i}".ljust(MAX_STOP_CHARS, "x") for i in range(MAX_STOP_STRINGS)]
    assert run(FakeService(served), {"prompt": "hi", "stop": most}).body.stop_strings() == most
