"""`mode ar` (`decode_mode` over HTTP) decodes one token per forward: a block of one token, one
step each, committed whatever its confidence. It silently replaced an explicit `steps`,
`refinement_steps`, `block_length` or `threshold` (`dlm generate tiny:sdar --mode ar --steps 3
--block-length 4` spent one forward per token), on every entry point. Given beside it, each is
now refused by the one validation (`GenerationParams.check_mode`), naming the field: a usage
error (exit 2) on the command line and in Python, a 400 `unsupported` over HTTP; a server's own
defaults for them do not count as the request's."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.config import load_config
from dlm.engine.errors import Unsupported
from dlm.engine.family_rules import validate
from dlm.engine.llm import LLM
from dlm.engine.params import AR_FIXED, GenerationParams, http_name
from dlm.engine.registry import family_named
from dlm.engine.tiny_models import ensure_tiny_model
from tests.serving import in_process_server
from tests.tiny_families import tiny_names

VALUES = {"block_length": 4, "steps": 3, "refinement_steps": 2, "threshold": 0.9}
MODEL = "tiny:sdar"  # block-causal: mode ar is its own


@pytest.mark.parametrize("field", AR_FIXED)
@pytest.mark.parametrize("name", tiny_names())
def test_every_family_refuses_what_mode_ar_fixes(name: str, field: str) -> None:
    config = load_config(ensure_tiny_model(f"tiny:{name}"))
    with pytest.raises(Unsupported) as caught:
        validate(GenerationParams(gen_length=8, mode="ar", **{field: VALUES[field]}), 3, config)
    if not family_named(config.family).block_causal:  # the mode itself first: the family cannot decode it
        assert caught.value.field == "mode" and "mode 'ar' is not available" in str(caught.value)
        return
    assert caught.value.field == field and "mode ar" in str(caught.value)
    if family_named(config.family).block_causal:  # without it, ar is a block of one token, one step each
        ar = validate(GenerationParams(gen_length=8, mode="ar"), 3, config)
        assert (ar.block_length, ar.steps, ar.threshold) == (1, 8, None)


@pytest.mark.parametrize("field", AR_FIXED)
def test_python_and_cli_refuse_what_mode_ar_fixes(field: str) -> None:
    with LLM(MODEL, dtype="float32", device="cpu") as llm, pytest.raises(Unsupported) as caught:
        llm.generate("hi", gen_length=8, mode="ar", **{field: VALUES[field]})
    assert caught.value.field == field
    flag = "--" + field.replace("_", "-")
    args = ["generate", MODEL, "--prompt", "hi", "--gen-length", "8", "--mode", "ar", flag, str(VALUES[field])]
    result = CliRunner().invoke(app, [*args, "--dtype", "float32", "--device", "cpu"])
    assert result.exit_code == 2 and f"{field} does not apply to mode ar" in result.output


def test_http_refuses_what_mode_ar_fixes_but_not_the_servers_defaults() -> None:
    body = {"prompt": "hi", "max_tokens": 8, "decode_mode": "ar", "return_token_ids": True}
    settings = dict(model=MODEL, dtype="float32", device="cpu", warmup=False, block_length=4, refinement_steps=2)
    with in_process_server(**settings) as client:
        for field in AR_FIXED:
            name = http_name(field)
            assert name is not None
            answer = client.post("/v1/completions", json={**body, name: VALUES[field]})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert (error["code"], error["param"]) == ("unsupported", name)
        answer = client.post("/v1/completions", json=body)  # the server's block_length and refinement_steps
    assert answer.status_code == 200, answer.text
    with LLM(MODEL, dtype="float32", device="cpu") as llm:
        python = llm.generate("hi", gen_length=8, mode="ar")[0]
    assert answer.json()["choices"][0]["token_ids"] == python.completion_ids
    assert answer.json()["usage"]["denoising_steps"] == python.nfe
