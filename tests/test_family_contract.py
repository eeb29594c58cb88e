"""The OpenAI contract as a matrix, on every family the registry lists (tests/tiny_families.py):
`dlm validate` passes against `dlm serve tiny:NAME`, and the official openai SDK gets chat,
streams, completions at any max_tokens, fixed lengths, `n`, logprobs and `response_format`.
Where the family record says a family cannot do a feature, the SDK gets the 400 naming it
and `dlm validate` skips the check (never fails it).

One server per family, started once for both: each family is one test that runs `dlm
validate` and then the SDK against it, and reports what each found (pytest-xdist's load
scheduling would split two tests of a family over its workers, each starting the server; its
`xdist_group` marks have no effect under pytest 9).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from typer.testing import CliRunner

from dlm.cli.checks.capabilities import PROBES, SCHEMA
from dlm.cli.checks.contract import PROMPT
from dlm.cli.main import app
from dlm.engine.capabilities import supported
from dlm.engine.config import load_config
from dlm.engine.registry import Family, family_named
from dlm.engine.tiny_models import ensure_tiny_model
from tests.conftest import session_home
from tests.serving import ServerProcess, ready_server
from tests.tiny_families import MAX_TOKENS, cannot, tiny_names

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": PROMPT}]


def family_of(name: str) -> Family:
    return family_named(load_config(ensure_tiny_model(f"tiny:{name}")).family)


def expected_skips(family: Family) -> set[str]:
    """The checks `dlm validate` skips on this family, from its record: the key checks (no key
    configured), the capabilities it does not have, and the checks of fields it cannot honour."""
    skips = {"missing_key", "wrong_key"} | {f"capability_{c}" for c in PROBES if c not in supported(family)}
    fields = cannot(family)
    if "block_length" in fields:
        skips.add("block_length")
    if "threshold" in fields:
        skips |= {"threshold", "block_length"}
    if "logprobs" not in supported(family):  # no token is committed at a step: steps are not bounded by tokens
        skips.add("plausible_steps")
    return skips


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_keeps_the_openai_contract(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`dlm validate` passes (skipping exactly what the family record says the family cannot
    do), and the openai SDK gets every feature or the 400 naming it."""
    family = family_of(name)
    problems: dict[str, str] = {}
    with ready_server([f"tiny:{name}"], session_home(tmp_path_factory)) as server:
        try:
            dlm_validate_passes(server, family)
        except AssertionError as exc:
            problems["dlm validate"] = str(exc)
        try:
            openai_sdk_contract(server, family)
        except (AssertionError, openai.OpenAIError) as exc:
            problems["openai SDK"] = f"{type(exc).__name__}: {exc}"
    assert not problems, problems


def dlm_validate_passes(server: ServerProcess, family: Family) -> None:
    result = CliRunner().invoke(app, ["validate", server.url, "--json"])
    report = json.loads(result.stdout)
    failed = {c["name"]: c["detail"] for c in report["checks"] if c["status"] == "failed"}
    assert result.exit_code == 0 and not failed, failed
    skipped = {c["name"]: c["detail"] for c in report["checks"] if c["status"] == "skipped"}
    assert set(skipped) == expected_skips(family), skipped


def refusal(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value


def openai_sdk_contract(server: ServerProcess, family: Family) -> None:
    can = supported(family)
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = sdk.models.list().data[0].id
    for gen in MAX_TOKENS:  # any max_tokens: a block grid's answer is cut, `length` when cut
        done = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=gen, temperature=0)
        tokens, finish = done.usage.completion_tokens, done.choices[0].finish_reason  # type: ignore[union-attr]
        assert 1 <= tokens <= gen and finish in ("stop", "length") and (finish == "stop" or tokens == gen)
    fixed = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=7, extra_body={"ignore_eos": True, "min_tokens": 7}
    )
    assert (fixed.usage.completion_tokens, fixed.choices[0].finish_reason) == (7, "length")  # type: ignore[union-attr]

    chat = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    stream = sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]
    text = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    streamed = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text

    sampling: dict[str, Any] = {} if "temperature" in cannot(family) else {"temperature": 1.0}
    two = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, seed=5, **sampling)
    alone = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, seed=6, **sampling)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[1].text == alone.choices[0].text

    def logprobs() -> Any:
        return sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)

    if "logprobs" in can:
        got = logprobs()
        assert len(got.choices[0].logprobs.token_logprobs) == got.usage.completion_tokens  # type: ignore[union-attr]
        chat_lp = sdk.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,  # type: ignore[arg-type]
        )
        assert chat_lp.choices[0].logprobs.content  # type: ignore[union-attr]
    else:
        refused = refusal(logprobs)
        assert (refused.param, refused.code) == ("logprobs", "unsupported")
        # Chat's switch is `logprobs: true`; `top_logprobs` is named only when the client sent it.
        for top, field in ((None, "logprobs"), (2, "top_logprobs")):
            refused = refusal(
                lambda top=top: sdk.chat.completions.create(
                    model=model,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=8,
                    logprobs=True,
                    top_logprobs=top,
                )
            )
            assert (refused.param, refused.code) == (field, "unsupported"), refused.body
            assert isinstance(refused.body, dict) and refused.body["message"].startswith(f"{field} is not")

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def structured() -> Any:
        return sdk.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=64,
            temperature=0,
            response_format=fmt,  # type: ignore[arg-type]
        )

    if "response_format" in can:
        jsonschema.validate(json.loads(structured().choices[0].message.content), SCHEMA)
    else:
        refused = refusal(structured)
        assert (refused.param, refused.code) == ("response_format", "unsupported")
