"""Usage errors come before any model loads: `dlm generate` checks its flags against the
checkpoint's config.json and `dlm serve` its `--max-model-len` and decoding defaults, both
with the engine's own validation (dlm/engine/family_rules.py), and both refuse a
tensor-parallel split the heads do not allow before any rank spawns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.cli.params import check_before_loading
from dlm.engine.block_checkpoints import family_config
from dlm.engine.checkpoint_writer import clover_config, llada_config
from dlm.engine.errors import UsageError
from dlm.engine.params import GenerationParams


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load weights or start the server fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the usage error")

    monkeypatch.setattr("dlm.engine.llm.LLM.__init__", refuse)
    monkeypatch.setattr("dlm.cli.server.run.serve", refuse)


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


def test_a_gen_length_past_the_models_length_is_refused_naming_gen_length(no_loading: None) -> None:
    """`--gen-length 3000` (not a multiple of 32) on a 2048-token model was refused as
    "block_length (3000) exceeds the model's maximum length": the block it resolves to, a flag
    the user never gave (a server's 400 named param block_length for a max_tokens too)."""
    for family in ("tiny:llada", "tiny:sdar"):
        args = ["generate", family, "--prompt-ids", "1,2,3"]
        result = CliRunner().invoke(app, [*args, "--gen-length", "100001"])
        assert result.exit_code == 2, result.output
        assert "gen_length (100001) exceeds the model's maximum length" in result.output, result.output
        assert "block_length" not in result.output, result.output
        result = CliRunner().invoke(app, [*args, "--block-length", "100000"])
        assert result.exit_code == 2 and "block_length (100000) exceeds" in result.output, result.output


def test_serve_refuses_a_max_model_len_over_the_models_before_loading(no_loading: None) -> None:
    result = CliRunner().invoke(app, ["serve", "tiny:sdar", "--max-model-len", "100000"])
    assert result.exit_code == 2, result.output
    assert "max_model_len (100000) exceeds the model's maximum" in result.output


def _config_only(directory: Path, config: dict[str, Any]) -> Path:
    """A checkpoint directory holding config.json and no weights: loading it would fail with
    another error, so the refusal below can only come from the config."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def clover_dir(tmp_path: Path) -> Path:
    return _config_only(tmp_path / "clover", clover_config(64, 63, 62))


@pytest.fixture
def three_heads_dir(tmp_path: Path) -> Path:
    """A LLaDA config whose 3 heads do not split over 2 ranks."""
    return _config_only(tmp_path / "three-heads", llada_config(64, 63, 62, d_model=48, n_heads=3, n_kv_heads=3))


def test_generate_refuses_another_block_length_for_clover_before_loading(no_loading: None, clover_dir: Path) -> None:
    args = ["generate", str(clover_dir), "--prompt-ids", "1,2,3", "--gen-length", "32", "--block-length", "16"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "clover decodes 32-token blocks" in result.output


def test_serve_refuses_a_default_block_length_clover_cannot_decode_before_loading(
    no_loading: None, clover_dir: Path
) -> None:
    result = CliRunner().invoke(app, ["serve", str(clover_dir), "--block-length", "16"])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "clover decodes 32-token blocks" in result.output


def test_generate_applies_the_family_rules_before_loading(no_loading: None) -> None:
    """Clover decodes its trained 32-token blocks only: config.json says so, so another block
    length is refused before any weight loads."""
    args = ["generate", "tiny:clover", "--prompt-ids", "1,2,3", "--gen-length", "8", "--block-length", "16"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "clover decodes 32-token blocks only" in result.output


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1,2"], ["serve"]])
def test_an_uneven_tensor_parallel_split_is_refused_before_any_rank_spawns(
    no_loading: None, three_heads_dir: Path, command: list[str]
) -> None:
    result = CliRunner().invoke(app, [command[0], str(three_heads_dir), *command[1:], "-tp", "2"])
    assert result.exit_code == 2, result.output
    assert (
        "error: the model's 3 attention heads and 3 KV heads are not divisible by the tensor-parallel size 2"
        in result.output
    )


def test_a_text_prompt_is_refused_only_what_every_length_refuses(tmp_path: Path) -> None:
    """Before tokenising, the length is unknown: a generation that fits after a one-token
    prompt passes, though not after 3 prompt tokens."""
    raw = family_config("sdar", vocab_size=64, mask_token_id=63, eos_token_id=62)
    sdar = _config_only(tmp_path / "sdar", raw)
    params = GenerationParams(gen_length=raw["max_position_embeddings"] - 2)
    check_before_loading(sdar, params, None)
    with pytest.raises(UsageError, match="exceeds the model's maximum length"):
        check_before_loading(sdar, params, 3)
    with pytest.raises(UsageError, match="exceeds the model's maximum length"):
        check_before_loading(sdar, GenerationParams(gen_length=100000), None)
