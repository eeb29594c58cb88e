"""A request that gives no length (`max_tokens`, `max_completion_tokens`) gets the server's
default (`--default-max-tokens`), lowered to the room the context leaves after its prompt, as
OpenAI's and vLLM's default answers up to the context's end: a prompt 40 tokens short of the
context was a 400 `context_length_exceeded` blaming a `max_tokens (128)` the client never sent.
A prompt that leaves no room is still that 400, naming the prompt, not a length. Every family
(block-grid families decode whole blocks and cut the answer at its length)."""

from __future__ import annotations

import pytest

from dlm.engine.registry import FAMILIES
from tests.serving import app_client
from tests.tiny_families import tiny_names

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 256  # --max-model-len


@pytest.mark.parametrize("name", [n for n in tiny_names() if n in {f.name for f in FAMILIES}])
def test_no_length_answers_within_the_room_the_prompt_leaves(name: str) -> None:
    settings = {"model": f"tiny:{name}", "warmup": False, "max_model_len": CONTEXT, "default_max_tokens": 64}
    with app_client(settings) as client:
        short = client.post("/v1/completions", json={"prompt": [5] * (CONTEXT - 24), "return_token_ids": True})
        assert short.status_code == 200, short.text
        assert len(short.json()["choices"][0]["token_ids"]) <= 24
        roomy = client.post("/v1/completions", json={"prompt": [5] * 8, "ignore_eos": True})
        assert roomy.status_code == 200 and roomy.json()["usage"]["completion_tokens"] == 64  # the default, whole
        full = client.post("/v1/completions", json={"prompt": [5] * CONTEXT})
        error = full.json()["error"]
        assert full.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        assert "max_tokens" not in error["message"]  # the client sent none
        assert (
            error["message"]
            == f"the prompt ({CONTEXT} tokens) leaves no room for an answer in the maximum context of {CONTEXT} tokens"
        )
        asked = client.post("/v1/completions", json={"prompt": [5] * (CONTEXT - 24), "max_tokens": 25})
        assert asked.status_code == 400 and "plus max_tokens (25)" in asked.json()["error"]["message"]
