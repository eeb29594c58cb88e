"""`ignore_eos` and `min_tokens` (vLLM's names and meaning) on every family: benchmark clients
(aiperf, vLLM's bench, GuideLLM) fix the answer's length with them.

A diffusion model commits EOS anywhere in its block, and a tiny random one commits some
tokens over and over: here the model's favourite token is made its EOS, so EOS would end the
answer early. With `ignore_eos` that token is never committed (it is masked out of every
decision) and the answer runs to gen_length; with `min_tokens` no stop id (EOS or
`stop_token_ids`) is committed before that many tokens. The engine's rule holds whatever the
entry point: the Python API on every family, the HTTP fields and stop strings in-process.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dlm.engine.llm import LLM
from tests.serving import in_process_server
from tests.tiny_families import tiny_names

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Write one sentence about the sea."
GEN = 24


@pytest.mark.parametrize("name", tiny_names())
def test_ignore_eos_and_min_tokens_fix_the_length_on_every_family(name: str) -> None:
    with LLM(f"tiny:{name}", dtype="float32", device="cpu") as llm:
        engine = llm.engine
        plain = llm.generate(PROMPT, gen_length=GEN)[0]
        favourite = Counter(plain.output_ids).most_common(1)[0][0]
        first = plain.output_ids[0]
        saved = engine.config
        engine.config = dataclasses.replace(saved, eos_token_ids=(favourite,))  # the model's EOS, for this test
        try:
            ends = llm.generate(PROMPT, gen_length=GEN)[0]
            fixed = llm.generate(PROMPT, gen_length=GEN, ignore_eos=True)[0]
            least = llm.generate(PROMPT, gen_length=GEN, min_tokens=GEN - 4)[0]
        finally:
            engine.config = saved
        assert ends.finish_reason == "stop" and len(ends.completion_ids) < GEN  # EOS would end it early
        assert fixed.finish_reason == "length" and len(fixed.completion_ids) == GEN
        assert favourite not in fixed.output_ids  # never committed, so never content
        assert len(least.completion_ids) >= GEN - 4 and favourite not in least.output_ids[: GEN - 4]
        # stop_token_ids end the answer as EOS does, also with ignore_eos (as in vLLM), and
        # min_tokens holds them off too.
        stopped = llm.generate(PROMPT, gen_length=GEN, stop_token_ids=[first], ignore_eos=True)[0]
        assert (stopped.finish_reason, stopped.completion_ids) == ("stop", [first])
        held = llm.generate(PROMPT, gen_length=GEN, stop_token_ids=[first], min_tokens=10)[0]
        assert len(held.completion_ids) >= 10 and first not in held.output_ids[:10]


@pytest.mark.parametrize("name", tiny_names())
def test_every_eos_a_config_lists_ends_the_answer_on_every_family(name: str) -> None:
    """config.json may list several EOS ids (Gemma: end of text, end of turn): each ends an
    answer, not only the first (the others were dropped where the file was read), and
    `ignore_eos` holds off all of them. Here the favourite token is the second EOS."""
    with LLM(f"tiny:{name}", dtype="float32", device="cpu") as llm:
        engine = llm.engine
        plain = llm.generate(PROMPT, gen_length=GEN)[0]
        favourite = Counter(plain.output_ids).most_common(1)[0][0]
        unused = next(t for t in range(engine.config.logits_size - 1, -1, -1) if t not in plain.output_ids)
        saved = engine.config
        engine.config = dataclasses.replace(saved, eos_token_ids=(unused, favourite))
        try:
            ends = llm.generate(PROMPT, gen_length=GEN)[0]
            fixed = llm.generate(PROMPT, gen_length=GEN, ignore_eos=True)[0]
        finally:
            engine.config = saved
        assert ends.finish_reason == "stop" and len(ends.completion_ids) < GEN
        assert ends.completion_ids[-1] == favourite
        assert fixed.finish_reason == "length" and not {unused, favourite} & set(fixed.output_ids)


@pytest.fixture(scope="module")
def server() -> Iterator[httpx.Client]:
    with in_process_server(model="tiny:llada", dtype="float32", device="cpu", max_tokens=64) as client:
        yield client


def complete(client: httpx.Client, status: int = 200, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, **body})
    assert response.status_code == status, response.text
    return dict(response.json())


def test_the_http_fields_reach_the_engine(server: httpx.Client) -> None:
    first = complete(server, return_token_ids=True)["choices"][0]["token_ids"][0]
    stopped = complete(server, stop_token_ids=[first])
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    held = complete(server, stop_token_ids=[first], min_tokens=6, return_token_ids=True)
    assert held["usage"]["completion_tokens"] >= 6 and first not in held["choices"][0]["token_ids"][:6]
    fixed = complete(server, ignore_eos=True, min_tokens=16)
    assert fixed["usage"]["completion_tokens"] == 16 and fixed["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_answer_only_after_min_tokens(server: httpx.Client) -> None:
    answer = complete(server, return_token_ids=True)["choices"][0]
    stop = answer["text"][:2]
    assert stop, "the tiny model's answer has text"
    assert complete(server, stop=[stop])["choices"][0]["text"] == ""  # found at once
    later = complete(server, stop=[stop], min_tokens=8, return_token_ids=True)["choices"][0]
    assert len(later["token_ids"]) >= 8 and later["text"].startswith(answer["text"][:2])


def test_refusals_name_the_field(server: httpx.Client) -> None:
    too_many = complete(server, 400, min_tokens=17)["error"]
    assert too_many["param"] == "min_tokens" and "must not exceed" in too_many["message"]
    assert complete(server, 400, ignore_eos="yes")["error"]["param"] == "ignore_eos"
    structured = {"type": "json_object"}
    refused = complete(server, 400, ignore_eos=True, response_format=structured)["error"]
    assert (refused["param"], refused["code"]) == ("ignore_eos", "unsupported")
