"""Usage errors come before any model loads: `dlm generate` checks its flags against the
checkpoint's config.json and `dlm serve` its `--max-model-len`, and both refuse at once."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dlm_cli.main import app


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load weights or start the server fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the usage error")

    monkeypatch.setattr("engine.llm.LLM.__init__", refuse)
    monkeypatch.setattr("dlm_cli.server.run.serve", refuse)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cfg-scale", "1"], "classifier-free guidance is not available for block-causal models"),
        (["--cache", "dual"], "cache 'dual' is for bidirectional models"),
        (["--gen-length", "100000"], "exceeds the model's maximum length"),
    ],
)
def test_generate_refuses_bad_flags_before_loading(no_loading: None, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["generate", "tiny:sdar", "--prompt-ids", "1,2,3", *args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and message in result.output


def test_serve_refuses_a_max_model_len_over_the_models_before_loading(no_loading: None) -> None:
    result = CliRunner().invoke(app, ["serve", "tiny:sdar", "--max-model-len", "100000"])
    assert result.exit_code == 2, result.output
    assert "max_model_len (100000) exceeds the model's maximum" in result.output
