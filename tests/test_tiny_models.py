"""`tiny:FAMILY`: every family decodes and serves offline from a checkpoint dlm builds itself."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.resolve import resolve_model
from dlm.engine.tiny_models import BUILDERS, ensure_tiny_model, tiny_model_dir


@pytest.mark.filterwarnings("error::FutureWarning")  # no deprecation noise from the tokenizer load
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_each_tiny_model_is_its_family_and_decodes_text(family: str) -> None:
    directory = resolve_model(f"tiny:{family}")
    assert directory == tiny_model_dir(family) and (directory / "tokenizer.json").exists()
    with LLM(f"tiny:{family}", dtype="float32", device="cpu") as llm:
        assert llm.engine.family.name == ("sdar" if family == "sdar_moe" else family)
        out = llm.generate("Hello, diffusion", gen_length=32, block_length=32)[0]
    assert out.nfe >= 1 and len(out.output_ids) >= 1 and isinstance(out.text, str)
    assert ensure_tiny_model(f"tiny:{family}") == directory  # built once, then reused


def test_unknown_tiny_family_is_a_usage_error_naming_the_choices() -> None:
    with pytest.raises(UsageError, match="tiny:sdar"):
        resolve_model("tiny:gpt2")


def test_generate_cli_takes_a_tiny_model() -> None:
    result = CliRunner().invoke(
        app, ["generate", "tiny:sdar", "--prompt", "hi", "--gen-length", "8", "--dtype", "float32", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["nfe"] >= 1
