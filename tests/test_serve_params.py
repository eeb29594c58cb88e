"""A server's `--max-steps` caps every request, whatever its commit rule or family; `steps`
beside `threshold` is honoured; unknown fields are refused naming them, while the fields
OpenAI SDKs send are accepted."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import session_home
from tests.serving import ServerProcess, ready_server

pytestmark = pytest.mark.slow

PROMPT = list(range(5, 29))  # 24 tokens: on the block grid of 4 and 8
RULES = [{"threshold": 0.99}, {"factor": 0.01}, {}]


@pytest.fixture(scope="module", params=["llada", "sdar"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = session_home(tmp_path_factory)
    args = ["--max-steps", "8", "--max-tokens", "64"]
    if request.param == "sdar":  # block-causal; LLaDA is the embedded default model
        from dlm.engine.block_checkpoints import write_tiny

        args.insert(0, str(write_tiny(tmp_path_factory.mktemp("sdar"), "sdar")))
    with ready_server(args, home) as proc:
        proc.family = request.param  # type: ignore[attr-defined]
        yield proc


def complete(server: ServerProcess, **fields: object) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize("rule", RULES, ids=["threshold", "factor", "schedule"])
def test_max_steps_caps_every_rule(server: ServerProcess, rule: dict) -> None:
    if "factor" in rule and server.family == "sdar":  # type: ignore[attr-defined]
        refused = complete(server, **rule)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "factor"
        return
    for extra in ({}, {"refinement_steps": 16}, {"block_length": 8}):
        response = complete(server, **rule, **extra)
        assert response.status_code == 200, response.text
        assert 1 <= response.json()["usage"]["denoising_steps"] <= 8, (rule, extra, response.json())
    over = complete(server, steps=16, **rule)
    assert over.status_code == 400 and over.json()["error"]["code"] == "steps_exceeded"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"refinement_steps": 2}, "refinement_steps"), ({"steps": 16}, "steps"), ({}, "max_tokens")],
)
def test_a_request_over_the_step_limit_names_what_set_its_steps(
    server: ServerProcess, fields: dict, param: str
) -> None:
    """64 tokens in blocks of 4 need 16 forwards at least, over the server's 8: the refusal names
    the field the request set its step count with, or its length when it set none."""
    response = complete(server, max_tokens=64, block_length=4, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("steps_exceeded", param), error


def test_steps_beside_threshold_are_an_upper_bound(server: ServerProcess) -> None:
    response = complete(server, steps=4, block_length=8, threshold=0.99)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["denoising_steps"] <= 4


@pytest.mark.parametrize("field", ["treshold", "stpes", "max_token"])
def test_misspelt_fields_are_400_naming_them(server: ServerProcess, field: str) -> None:
    response = complete(server, **{field: 0.9})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "unknown_parameter") and field in error["message"]


def test_fields_sdks_send_are_accepted(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=32,
        temperature=0,
        user="someone",
        logit_bias=None,
        stream_options=None,
        extra_body={"metadata": {"trace": "1"}, "store": False, "service_tier": "auto", "threshold": 0.99},
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.model_extra["denoising_steps"] <= 8
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=out.model, prompt=PROMPT, max_tokens=32, logit_bias={"5": 10})
    assert refused.value.body["param"] == "logit_bias"  # type: ignore[index]


def test_a_refusal_names_body_fields_never_cli_flags(server: ServerProcess) -> None:
    """The field a refusal points to instead is named as the body spells it (the SDK's
    `extra_body`), not as `dlm generate`'s flag."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    sdar = server.family == "sdar"  # type: ignore[attr-defined]
    fields, param, named = (
        ({"factor": 0.5}, "factor", "use threshold")
        if sdar
        else ({"cfg_scale": 1.0, "cache": "prefix"}, "cfg_scale", "use cache 'none'")
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=32, extra_body=fields
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert named in error["message"] and "--" not in error["message"], error
