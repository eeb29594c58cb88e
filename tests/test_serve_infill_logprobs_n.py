"""The server's `suffix`, `logprobs` / `top_logprobs`, `echo` and `n`, through the in-process
app (no socket): each answer equals the engine's for the same request, in the OpenAI
shapes (read back with the openai SDK's types), streamed or not; `/v1/models` lists what the
family honours, and a block-causal family refuses `suffix` with a 400 naming it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from dlm.engine.llm import LLM
from tests.serving import in_process_server, sse_events

SETTINGS = dict(dtype="float32", device="cpu", max_tokens=64)
PROMPT = [5, 17, 42, 99, 7, 3]
SAMPLING = {"temperature": 1.0, "seed": 21}


@pytest.fixture(scope="module")
def llada() -> Iterator[httpx.Client]:
    with in_process_server(model="tiny:llada", max_queue=4, **SETTINGS) as client:
        yield client


@pytest.fixture(scope="module")
def engine(llada: httpx.Client) -> LLM:
    """The same checkpoint through the Python API."""
    return LLM("tiny:llada", dtype="float32", device="cpu")


def sdk(client: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://dlm/v1", api_key="none", max_retries=0, http_client=client)


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_the_family_capabilities(llada: httpx.Client) -> None:
    card = llada.get("/v1/models").json()["data"][0]
    assert card["capabilities"] == ["suffix", "logprobs", "n", "response_format", "include_canvas"]


def test_a_model_is_retrieved_by_its_name(llada: httpx.Client) -> None:
    """`client.models.retrieve(NAME)` (GET /v1/models/NAME) answers the card `/v1/models`
    lists; it was a 404 `Not Found` for the name served, so SDK code checking its model failed."""
    card = llada.get("/v1/models").json()["data"][0]
    client = sdk(llada)
    retrieved = client.models.retrieve(card["id"])
    assert retrieved.id == card["id"] and retrieved.model_dump()["capabilities"] == card["capabilities"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("not-served/model")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"  # type: ignore[index]
    assert llada.get("/v1/models/").json()["data"] == [card]  # the list, as before the route


def test_suffix_answers_the_engine_middle(llada: httpx.Client, engine: LLM) -> None:
    suffix = " and that is all."
    body = complete(llada, suffix=suffix, return_token_ids=True)
    expected = engine.generate(PROMPT, suffix=suffix, gen_length=16)[0]
    assert body["choices"][0]["token_ids"] == expected.completion_ids
    assert body["choices"][0]["text"] == expected.text
    ids = complete(llada, suffix=engine.encode(suffix), return_token_ids=True)
    assert ids["choices"][0]["token_ids"] == expected.completion_ids
    plain = complete(llada, return_token_ids=True)
    assert plain["choices"][0]["token_ids"] != expected.completion_ids


def test_suffix_over_the_context_is_refused_naming_the_context(llada: httpx.Client) -> None:
    response = llada.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "suffix": [1] * 2048})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_completion_logprobs_are_the_engine_values(llada: httpx.Client, engine: LLM) -> None:
    body = complete(llada, logprobs=2, return_token_ids=True)
    expected = engine.generate(PROMPT, gen_length=16, logprobs=2)[0].logprobs
    assert expected is not None
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx([t.logprob for t in expected], abs=1e-6)
    assert len(logprobs["tokens"]) == len(body["choices"][0]["token_ids"])
    for chosen, token, top in zip(logprobs["token_logprobs"], logprobs["tokens"], logprobs["top_logprobs"]):
        assert math.exp(chosen) <= 1
        assert top[token] == pytest.approx(chosen)  # the committed token is always listed
        assert len(top) <= 3
    parsed = sdk(llada).completions.create(model="tiny:llada", prompt=PROMPT, max_tokens=16, logprobs=2)
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.token_logprobs == logprobs["token_logprobs"]


def test_chat_logprobs_stream_as_they_answer(llada: httpx.Client) -> None:
    request = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = sdk(llada).chat.completions.create(model="tiny:llada", **request)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert content
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and len(values) == 3
        # The token's own bytes: its text's UTF-8, but one raw byte for a piece of a character
        # (shown as U+FFFD, whose UTF-8 the bytes once were).
        assert bytes(entry.bytes) == entry.token.encode() if entry.token != "\ufffd" else len(entry.bytes) == 1
    streamed = llada.post("/v1/chat/completions", json={**request, "stream": True})
    pieces = [
        e["choices"][0]["logprobs"]["content"] for e in sse_events(streamed.text) if e["choices"][0].get("logprobs")
    ]
    joined = [entry for piece in pieces for entry in piece]
    assert [e["logprob"] for e in joined] == [e.logprob for e in content]
    assert "".join(e["token"] for e in joined) == "".join(e.token for e in content)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"n": 65}, "n"),
        (
            {"n": 13},
            "n",
        ),  # more choices than the batch (8) and the queue (4) hold: never a 429 that retrying cannot cure
    ],
)
def test_completion_refusals_name_the_field(llada: httpx.Client, body: dict, param: str) -> None:
    response = llada.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"), [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]
)
def test_chat_refusals_name_the_field(llada: httpx.Client, body: dict, param: str) -> None:
    response = llada.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **body}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_echo_prepends_the_prompt(llada: httpx.Client) -> None:
    body = llada.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, "echo": True}).json()
    plain = llada.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8}).json()
    assert body["choices"][0]["text"] == "Hello there" + plain["choices"][0]["text"]


def test_n_choices_equal_separate_requests_with_their_seeds(llada: httpx.Client) -> None:
    body = complete(llada, n=3, return_token_ids=True, logprobs=1, **SAMPLING)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice in choices:
        alone = complete(llada, return_token_ids=True, logprobs=1, **{**SAMPLING, "seed": 21 + choice["index"]})
        assert choice["token_ids"] == alone["choices"][0]["token_ids"]
        assert choice["logprobs"] == alone["choices"][0]["logprobs"]
    assert len({tuple(c["token_ids"]) for c in choices}) == 3
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


def test_n_streams_every_choice_by_index(llada: httpx.Client) -> None:
    whole = complete(llada, n=2, **SAMPLING)
    streamed = llada.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "n": 2, "stream": True, **SAMPLING}
    )
    texts = {0: "", 1: ""}
    reasons = {}
    for event in sse_events(streamed.text):
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert reasons == {c["index"]: c["finish_reason"] for c in whole["choices"]}


def test_block_causal_family_refuses_suffix_and_lists_without_it() -> None:
    with in_process_server(model="tiny:sdar", **SETTINGS) as sdar:
        card = sdar.get("/v1/models").json()["data"][0]
        assert card["capabilities"] == ["logprobs", "n", "decode_mode", "include_canvas"]
        response = sdar.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "suffix": "tail"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("suffix", "unsupported")
        body = sdar.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "logprobs": 1}).json()
        assert len(body["choices"][0]["logprobs"]["token_logprobs"]) > 0


def test_validate_checks_every_advertised_capability(llada: httpx.Client) -> None:
    from dlm.cli.checks.capabilities import CAPABILITY_CHECKS
    from dlm.cli.checks.contract import completion, models
    from dlm.cli.checks.runner import PASSED, SKIPPED, Check, Context, ValidateOptions, run_checks
    from dlm.cli.client.api import ApiClient

    api = ApiClient("http://dlm")
    api.http = llada  # the in-process server
    checks = [Check("models", models), Check("completion", completion, ("models",)), *CAPABILITY_CHECKS]
    results = run_checks(Context(api, ValidateOptions(max_tokens=16)), checks)
    listed = llada.get("/v1/models").json()["data"][0]["capabilities"]
    # what LLaDA lacks (decode_mode ar: block-causal families, tests/test_serve_decode_mode.py) is skipped
    expected = {
        c.name: SKIPPED
        if c.name.startswith("capability_") and c.name.removeprefix("capability_") not in listed
        else PASSED
        for c in checks
    }
    assert {r.name: r.status for r in results} == expected, [r.detail for r in results]


def test_logprobs_decode_each_token_once(llada: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer's logprobs name the same tokens over and over (up to 21 entries a token, each
    a text and, on chat, bytes): each token id's own text and bytes are worked out once, not
    per entry on the event loop, where n 15 x 1024 tokens x 20 alternatives held /health for
    4 s. A second answer over the same tokens decodes none of them again."""
    from transformers import PreTrainedTokenizerBase

    calls: list[int] = []
    decode = PreTrainedTokenizerBase.decode
    to_tokens = PreTrainedTokenizerBase.convert_ids_to_tokens

    def counted_decode(self: Any, ids: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and isinstance(ids, list) and len(ids) == 1:  # one token's own text
            calls.append(ids[0])
        return decode(self, ids, *args, **kwargs)

    def counted_tokens(self: Any, ids: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(ids)  # one token's bytes
        return to_tokens(self, ids, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "decode", counted_decode)
    monkeypatch.setattr(PreTrainedTokenizerBase, "convert_ids_to_tokens", counted_tokens)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "ignore_eos": True}
    body |= {"logprobs": True, "top_logprobs": 20, "n": 2, **SAMPLING}
    first = llada.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    entries = sum(1 + len(e["top_logprobs"]) for c in first.json()["choices"] for e in c["logprobs"]["content"])
    assert entries == 2 * 16 * 21
    assert 0 < len(calls) <= 2 * len(set(calls)) < entries  # a text and bytes per token id, not per entry
    calls.clear()
    again = llada.post("/v1/chat/completions", json=body)
    assert again.json()["choices"][0]["logprobs"] == first.json()["choices"][0]["logprobs"]
    assert calls == []


def test_an_answer_is_built_off_the_event_loop(llada: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole answer's body (its choices' logprobs, then the JSON) is built on a worker
    thread: with n choices of 1024 tokens and 20 alternatives it is hundreds of thousands of
    entries, a second of CPU during which the event loop answered nothing, /health included."""
    import asyncio

    from dlm.cli.server import generation

    on_loop: list[bool] = []
    build = generation.chat_logprobs

    def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread
            on_loop.append(False)
        return build(*args, **kwargs)

    monkeypatch.setattr(generation, "chat_logprobs", watched)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "logprobs": True, "n": 2}
    response = llada.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert on_loop == [False, False]  # one per choice, neither on the loop
