"""A stop string ends its request before the next forward, whatever the event loop is doing.

The server found a `stop` string on the event loop, in the snapshots the engine thread posts,
and only then asked the engine to drop the request: meanwhile the engine kept denoising it,
so `usage.denoising_steps` of the same request depended on how busy the event loop was (a
batch of concurrent lines, a stream whose client reads slowly, another request's JSON being
rendered): 16 forwards one time, 17 the next, for the same sdar request. The engine thread now
checks the committed prefix for the request's stop strings after every step that extends it
(`RequestStream.ends`), so the request spends exactly the forwards up to the step whose
committed text first holds a stop string, as docs/architecture.md promised ("leaves the batch
before the next forward"), on every family, streamed or not.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from dlm.cli.server import generation
from dlm.engine.llm import LLM
from dlm.engine.tokenizer import decode
from tests.serving import in_process_server, sse_events
from tests.tiny_families import tiny_names

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The quick brown fox"
LENGTH = 48


def late_stop(llm: LLM) -> tuple[str, int]:
    """A stop string the greedy answer holds past its first steps, and the forwards spent by
    the step whose committed prefix first spells it: what the request must spend."""
    seen: list[tuple[int, str]] = []

    def on_step(seqs: Any) -> None:
        seq = seqs[0]
        seen.append((seq.nfe, decode(llm.tokenizer, seq.committed_prefix, seq.stop_ids)))

    llm.generate(PROMPT, gen_length=LENGTH, on_step=on_step)
    final = seen[-1][1]
    # A stop string first spelled by a late step: the request has forwards left after it.
    for nfe, text in seen:
        if nfe > 1 and len(text) > 8 and nfe < seen[-1][0]:
            stop = text[-4:]
            if stop.strip() and stop in final:
                first = next(n for n, t in seen if stop in t)
                if first < seen[-1][0]:
                    return stop, first
    pytest.skip("the greedy answer commits its text in one step")


@pytest.mark.parametrize("name", tiny_names())
def test_a_stop_string_spends_the_same_forwards_however_busy_the_event_loop(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with LLM(f"tiny:{name}", dtype="float32", device="cpu") as llm:
        stop, forwards = late_stop(llm)
    text = generation.Responder.text

    def slow(self: Any, choice: Any, out: Any) -> Any:
        time.sleep(0.05)  # the event loop busy elsewhere while the engine thread runs on
        return text(self, choice, out)

    monkeypatch.setattr(generation.Responder, "text", slow)
    body = {"prompt": PROMPT, "max_tokens": LENGTH, "stop": [stop], "return_token_ids": True}
    with in_process_server(model=f"tiny:{name}", dtype="float32", device="cpu", warmup=False) as client:
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        streamed = client.post(
            "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert streamed.status_code == 200, streamed.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert answer.json()["usage"]["denoising_steps"] == forwards
    events = sse_events(streamed.text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
    assert events[-1]["usage"] == answer.json()["usage"]
