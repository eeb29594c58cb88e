"""`--response-cache-size`: identical requests answered again from memory (the deployment
guides' result cache for frequent, fixed requests), only where the answer is certain to be
the same (dlm/cli/server/response_cache.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dlm.cli.client.metrics import parse_samples
from dlm.engine.params import GenerationParams, reproducible
from dlm.engine.registry import FAMILIES
from tests.serving import app_client
from tests.tiny_families import tiny_names

KEYS = ("sk-cache-a", "sk-cache-b")
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "steps": 8}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = {
        "model": "tiny:llada",
        "warmup": False,
        "response_cache_size": 2,
        "api_keys": list(KEYS),
        "public_metrics": True,
    }
    with app_client(settings) as test_client:
        yield test_client


def ask(client: TestClient, body: dict[str, Any], key: str = KEYS[0], route: str = "/v1/completions") -> Any:
    response = client.post(route, json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def counters(client: TestClient) -> tuple[float, float]:
    samples = parse_samples(client.get("/metrics").text)
    return samples.get("dlm_response_cache_lookups_total", 0.0), samples.get("dlm_response_cache_hits_total", 0.0)


def test_an_identical_request_is_answered_again_without_a_forward(client: TestClient) -> None:
    body = {**GREEDY, "prompt": "identical", "logprobs": 2}
    first, again = ask(client, body), ask(client, body)
    assert again["choices"] == first["choices"] and again["id"] != first["id"]
    assert first["usage"]["denoising_steps"] > 0 and again["usage"]["denoising_steps"] == 0
    assert again["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"temperature": 0.8}, "sampled without a seed: each answer its own"),
        ({"stream": True}, "streamed"),
        ({"key": KEYS[1]}, "another API key (its own entries)"),
    ],
)
def test_what_is_not_answered_from_the_cache(client: TestClient, change: dict[str, Any], why: str) -> None:
    body = {**GREEDY, "prompt": f"not cached: {why}"}
    ask(client, body)  # kept (greedy, key A, not streamed)
    key = change.pop("key", KEYS[0])
    request = {**body, **change}
    if request.get("stream"):
        with client.stream("POST", "/v1/completions", json=request, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200 and "data: [DONE]" in r.read().decode()
        return
    assert ask(client, request, key)["usage"]["denoising_steps"] > 0, why


def test_a_seeded_sample_is_kept_and_the_counters_say_so(client: TestClient) -> None:
    lookups, hits = counters(client)
    body = {**GREEDY, "prompt": "seeded", "temperature": 0.8, "seed": 7, "n": 2}
    first, again = ask(client, body), ask(client, body)
    assert again["choices"] == first["choices"] and again["usage"]["denoising_steps"] == 0
    assert counters(client) == (lookups + 2, hits + 1)


def test_the_least_recently_used_answer_goes_first(client: TestClient) -> None:
    """Size 2: a, b, a (hit), c (evicts b), then b is computed again and a is still kept."""
    a, b, c = ({**GREEDY, "prompt": f"lru {x}"} for x in "abc")
    for body in (a, b, a, c):
        ask(client, body)
    assert ask(client, b)["usage"]["denoising_steps"] > 0
    assert ask(client, c)["usage"]["denoising_steps"] == 0


def test_chat_answers_are_kept_apart_from_completions(client: TestClient) -> None:
    chat = {"messages": [{"role": "user", "content": "chat kept"}], "max_tokens": 8, "steps": 8}
    first = ask(client, chat, route="/v1/chat/completions")
    again = ask(client, chat, route="/v1/chat/completions")
    assert again["object"] == "chat.completion" and again["choices"] == first["choices"]
    assert again["usage"]["denoising_steps"] == 0


@pytest.mark.parametrize("directive", ["no-cache", "No-Store", "max-age=0, no-cache"])
def test_a_request_asking_for_a_fresh_answer_is_decoded_and_not_kept(client: TestClient, directive: str) -> None:
    """`Cache-Control: no-cache` / `no-store` (HTTP's request directives): a client that
    measures the server, as `dlm validate` does on every run, got a kept answer's
    `denoising_steps` 0 from its second run on, and its usage check failed."""
    body = {**GREEDY, "prompt": f"fresh: {directive}"}
    headers = {"Authorization": f"Bearer {KEYS[0]}", "Cache-Control": directive}
    lookups, hits = counters(client)
    for _ in range(2):
        response = client.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200 and response.json()["usage"]["denoising_steps"] > 0
    assert counters(client) == (lookups, hits)  # not looked up
    assert ask(client, body)["usage"]["denoising_steps"] > 0  # and nothing was kept for it


def test_without_the_setting_nothing_is_kept() -> None:
    with app_client({"model": "tiny:llada", "warmup": False}) as plain:
        for _ in range(2):
            answer = plain.post("/v1/completions", json=GREEDY).json()
            assert answer["usage"]["denoising_steps"] > 0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_only_reproducible_decoding_is_cacheable(family: Any) -> None:
    """Seeded: always; unseeded: never with temperature > 0, nor with a rule that draws
    positions at random (LLaDA's random remasking, Dream's origin order or alg_temp) or the
    entropy-bound sampler's random canvas."""
    greedy = dataclasses.replace(GenerationParams(gen_length=8), temperature=0.0)
    seeded = dataclasses.replace(greedy, temperature=0.8, seed=1)
    assert reproducible(seeded, family)  # type: ignore[arg-type]
    assert not reproducible(dataclasses.replace(greedy, temperature=0.8), family)  # type: ignore[arg-type]
    expected = {"llada": True, "dream": True, "entropy_bound": False}[family.sampler]
    assert reproducible(greedy, family) is expected  # type: ignore[arg-type]
    if family.sampler == "llada":
        assert not reproducible(dataclasses.replace(greedy, remasking="random"), family)  # type: ignore[arg-type]
    if family.sampler == "dream":
        assert not reproducible(dataclasses.replace(greedy, alg="origin"), family)  # type: ignore[arg-type]
        assert not reproducible(dataclasses.replace(greedy, alg="entropy", alg_temp=0.5), family)  # type: ignore[arg-type]


def test_a_hit_is_encoded_off_the_event_loop(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept answer with logprobs is tens of MB of JSON for large n and lengths: encoded on
    the event loop, it stalled every route (`/health` too) as the miss's answer, rendered on a
    worker thread, does not (dlm/cli/server/answer_json.py)."""
    import asyncio

    from dlm.cli.server import generation

    on_loop: list[bool] = []

    def encode(content: Any, headers: dict[str, str] | None = None) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return json_response(content, headers)

    json_response = generation.json_response
    body = {**GREEDY, "prompt": "encoded off the loop", "logprobs": 2}
    ask(client, body)
    monkeypatch.setattr(generation, "json_response", encode)
    assert ask(client, body)["usage"]["denoising_steps"] == 0
    assert on_loop == [False]


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_answers_a_repeat_from_the_cache_and_a_no_cache_request_afresh(name: str) -> None:
    """Every family the registry decodes (`tiny_names`), fp32: a seeded request (reproducible
    under every sampler) asked again is answered from the cache without a forward, with the
    same choices; `Cache-Control: no-cache` decodes it again, to the same choices."""
    settings = {"model": f"tiny:{name}", "warmup": False, "response_cache_size": 2, "dtype": "float32"}
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "seed": 3, "return_token_ids": True}
    with app_client(settings) as served:
        first, again, fresh = (
            served.post("/v1/completions", json=body, headers=headers)
            for headers in ({}, {}, {"Cache-Control": "no-cache"})
        )
    assert all(r.status_code == 200 for r in (first, again, fresh)), (first.text, again.text, fresh.text)
    steps = [r.json()["usage"]["denoising_steps"] for r in (first, again, fresh)]
    assert steps[0] > 0 and steps[1] == 0 and steps[2] == steps[0]
    assert again.json()["choices"] == first.json()["choices"] == fresh.json()["choices"]
