"""Deployment guide 003's settings file (service / model / decode / observability sections)
read as it is written: each key a setting of `dlm serve`, or what dlm always does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dlm.cli.server.config import GUIDE_FIXED, GUIDE_KEYS, ServeConfig, load_config
from dlm.engine.errors import UsageError

GUIDE = """\
service:
  listen_port: 8000
  max_concurrency: 16
model:
  path: tiny:sdar
  dtype: bfloat16
  max_context_length: 2048
decode:
  default_mode: autoregressive        # 可选 autoregressive / diffusion
  enable_causal_mask_fusion: true
observability:
  log_level: info
  metrics_enabled: true
  health_path: /health
"""


def config_of(tmp_path: Path, text: str, suffix: str = ".yaml") -> ServeConfig:
    path = tmp_path / f"serve{suffix}"
    path.write_text(text)
    return load_config(path, {}, environ={})


def test_the_guides_file_sets_what_it_says(tmp_path: Path) -> None:
    config = config_of(tmp_path, GUIDE)
    got = (config.port, config.max_num_seqs, config.model, config.dtype, config.max_model_len, config.decode_mode)
    assert got == (8000, 16, "tiny:sdar", "bfloat16", 2048, "ar")
    assert config.log_level == "info"


def test_every_guide_key_names_a_setting() -> None:
    assert set(GUIDE_KEYS.values()) <= set(ServeConfig.model_fields)
    assert not set(GUIDE_KEYS) & set(GUIDE_FIXED)


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        (
            "enable_causal_mask_fusion: true",
            "enable_causal_mask_fusion: false",
            "decode.enable_causal_mask_fusion can only be true",
        ),
        ("health_path: /health", "health_path: /healthz", 'observability.health_path can only be "/health"'),
        ("metrics_enabled: true", "metrics_enabled: false", "observability.metrics_enabled can only be true"),
        ("listen_port: 8000", "listen_port: 8000\n  workers: 4", "unknown setting service.workers"),
        ("default_mode: autoregressive", "default_mode: [ar]", "decode_mode"),  # was a TypeError: unhashable
    ],
)
def test_what_dlm_cannot_do_or_does_not_know_is_refused(tmp_path: Path, old: str, new: str, words: str) -> None:
    with pytest.raises(UsageError, match=re.escape(words)):
        config_of(tmp_path, GUIDE.replace(old, new))


def test_a_flat_file_is_read_as_before(tmp_path: Path) -> None:
    assert config_of(tmp_path, "model: tiny:llada\nport: 9000\n").model == "tiny:llada"
    assert config_of(tmp_path, "[serve]\nport = 9001\n", ".toml").port == 9001


@pytest.mark.parametrize(
    "text",
    [
        "service:\n  max_concurrency: 2\nmax_num_seqs: 5\n",  # the flat key after the section's
        "max_num_seqs: 5\nservice:\n  max_concurrency: 2\n",
        "service:\n  listen_port: 9000\nport: 9001\n",
        "decode:\n  default_mode: autoregressive\ndecode_mode: diffusion\n",
    ],
)
def test_a_setting_given_by_a_section_and_a_flat_key_is_refused_in_either_order(tmp_path: Path, text: str) -> None:
    """Two spellings of one setting in one file are an error: a flat key written after the
    section's key used to replace it without a word (`max_num_seqs` 5, the section's 2 lost)."""
    with pytest.raises(UsageError, match="name the same setting"):
        config_of(tmp_path, text)


def test_a_sections_keys_take_dashes_as_every_key_of_the_file_does(tmp_path: Path) -> None:
    """docs/serve.md: a file's keys are spelt with `-` or `_`; a section's were refused as
    unknown settings with `-` (`service.listen-port`)."""
    config = config_of(tmp_path, "service:\n  listen-port: 9000\n  max-concurrency: 3\ndecode:\n  default-mode: ar\n")
    assert (config.port, config.max_num_seqs, config.decode_mode) == (9000, 3, "ar")
    with pytest.raises(UsageError, match="name the same setting"):
        config_of(tmp_path, "service:\n  listen-port: 9000\n  listen_port: 9001\n")
    with pytest.raises(UsageError, match=re.escape("observability.metrics-enabled can only be true")):
        config_of(tmp_path, "observability:\n  metrics-enabled: false\n")


def test_a_fixed_keys_refusal_spells_the_value_as_the_file_does(tmp_path: Path) -> None:
    """`enable_causal_mask_fusion = false` in TOML (or `false` in YAML) was told it "can only be
    True", Python's spelling, which neither file format reads as a boolean."""
    with pytest.raises(UsageError, match=re.escape("decode.enable_causal_mask_fusion can only be true in dlm")):
        config_of(tmp_path, "[decode]\nenable_causal_mask_fusion = false\n", ".toml")
