"""ModelConfig: one normalised view of any supported checkpoint's `config.json`.

Every family spells the same idea differently (LLaDA's `d_model`/`n_layers`, Qwen's
`hidden_size`/`num_hidden_layers`, ...). The engine, the estimator and the server read only
this normalised form, so a new family is one parser here plus one model module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import UsageError
from engine.registry import Family, family_for


@dataclass(frozen=True)
class ModelConfig:
    family: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # tokenizer vocabulary
    logits_size: int  # rows of the LM head (>= vocab_size when the embedding is padded)
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    mask_token_id: int
    eos_token_id: int | None
    pad_token_id: int | None
    tie_word_embeddings: bool
    torch_dtype: str | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * float(self.raw.get("partial_rotary_factor", 1.0)))


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise UsageError(f"config.json has no field {key!r}, which its model family needs")
    return raw[key]


def _llada(raw: dict[str, Any]) -> ModelConfig:
    d_model = int(_require(raw, "d_model"))
    n_heads = int(_require(raw, "n_heads"))
    n_kv = raw.get("n_kv_heads")
    if n_kv is None:  # OLMo convention: multi_query_attention means one KV head
        n_kv = 1 if raw.get("multi_query_attention") else n_heads
    vocab = int(_require(raw, "vocab_size"))
    mlp = raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4)) * d_model
    if raw.get("block_type", "llama") != "llama":
        raise UsageError(f"LLaDA block_type {raw.get('block_type')!r} is not supported (only 'llama')")
    if raw.get("alibi"):
        raise UsageError("LLaDA checkpoints with alibi are not supported")
    return ModelConfig(
        family="llada",
        model_type=str(raw.get("model_type", "llada")),
        hidden_size=d_model,
        num_layers=int(_require(raw, "n_layers")),
        num_heads=n_heads,
        num_kv_heads=int(n_kv),
        head_dim=d_model // n_heads,
        intermediate_size=int(mlp),
        vocab_size=vocab,
        logits_size=int(raw.get("embedding_size") or vocab),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(raw.get("max_sequence_length", 4096)),
        # LLaDA-8B's config.json omits mask_token_id; 126336 is its documented MASK.
        mask_token_id=int(raw.get("mask_token_id", 126336)),
        eos_token_id=_first_int(raw.get("eos_token_id")),
        pad_token_id=_first_int(raw.get("pad_token_id")),
        tie_word_embeddings=bool(raw.get("weight_tying", False)),
        torch_dtype=raw.get("torch_dtype"),
        raw=raw,
    )


def _hf_standard(family: str, default_mask: int | None) -> Callable[[dict[str, Any]], ModelConfig]:
    """Parser for configs with transformers' standard field names (Qwen/Llama/Bailing style),
    which LLaDA2, SDAR and openPangu all use. `default_mask` is the documented MASK id of
    a family whose config.json omits it (LLaDA2: 156895, openPangu: 45830)."""

    def parse(raw: dict[str, Any]) -> ModelConfig:
        hidden = int(_require(raw, "hidden_size"))
        heads = int(_require(raw, "num_attention_heads"))
        vocab = int(_require(raw, "vocab_size"))
        mask = raw.get("mask_token_id", default_mask)
        if mask is None:
            raise UsageError(f"config.json has no mask_token_id, which {family} needs")
        return ModelConfig(
            family=family,
            model_type=str(raw.get("model_type", family)),
            hidden_size=hidden,
            num_layers=int(_require(raw, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(_require(raw, "intermediate_size")),
            vocab_size=vocab,
            logits_size=vocab,
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            mask_token_id=int(mask),
            eos_token_id=_first_int(raw.get("eos_token_id")),
            pad_token_id=_first_int(raw.get("pad_token_id")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=raw.get("torch_dtype"),
            raw=raw,
        )

    return parse


def hybrid_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3.5/3.6-MoE text fields as one flat dict.

    Multimodal checkpoints (`qwen3_5_moe`) nest them under `text_config`; text-only ones
    (`qwen3_5_moe_text`, presumably Clover) are flat. transformers 5 writes rope settings
    under `rope_parameters`, older files at the top level; both are lifted to the top.
    """
    # The outer model_type names the family (a nested text_config says `..._text`).
    flat = {**raw, **raw.get("text_config", {}), "model_type": raw.get("model_type")}
    rope = flat.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            flat[key] = rope[key]
    if "layer_types" not in flat and "num_hidden_layers" in flat:
        interval = int(flat.get("full_attention_interval", 4))
        flat["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(int(flat["num_hidden_layers"]))
        ]
    return flat


def _hybrid(family: str, raw: dict[str, Any]) -> ModelConfig:
    flat = hybrid_text_config(raw)
    hidden = int(_require(flat, "hidden_size"))
    heads = int(_require(flat, "num_attention_heads"))
    vocab = int(_require(flat, "vocab_size"))
    if family == "clover" and "mask_token_id" not in flat:
        # Nobody has read Clover's config.json yet: refuse to guess its MASK (docs/clover.md).
        raise UsageError("clover_moe config.json has no mask_token_id; add it (see docs/clover.md)")
    return ModelConfig(
        family=family,
        model_type=str(raw.get("model_type")),
        hidden_size=hidden,
        num_layers=int(_require(flat, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(flat.get("num_key_value_heads", heads)),
        head_dim=int(flat.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(flat, "moe_intermediate_size")),
        vocab_size=vocab,
        logits_size=vocab,
        rope_theta=float(flat.get("rope_theta", 10000.0)),
        rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(flat.get("max_position_embeddings", 32768)),
        # -1: the autoregressive base model has no MASK token.
        mask_token_id=int(flat.get("mask_token_id", -1)),
        eos_token_id=_first_int(flat.get("eos_token_id")),
        pad_token_id=_first_int(flat.get("pad_token_id")),
        tie_word_embeddings=bool(flat.get("tie_word_embeddings", False)),
        torch_dtype=flat.get("torch_dtype") or flat.get("dtype"),
        raw=flat,
    )


def _dream(raw: dict[str, Any]) -> ModelConfig:
    """Dream / DiffuCoder: Qwen2 field names; refuse what the model does not implement."""
    if raw.get("rope_scaling"):
        raise UsageError(f"Dream rope_scaling {raw['rope_scaling']!r} is not supported (only plain RoPE)")
    if raw.get("use_sliding_window"):
        raise UsageError("Dream checkpoints with sliding-window attention are not supported")
    # Dream-v0 / DiffuCoder MASK is 151666; the tiny and newer configs carry the field.
    return _hf_standard("dream", 151666)(raw)


PARSERS: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "llada": _llada,
    "dream": _dream,
    "llada2_moe": _hf_standard("llada2_moe", 156895),
    "sdar": _hf_standard("sdar", None),
    "pangu": _hf_standard("pangu", 45830),
    "qwen3_5_moe": lambda raw: _hybrid("qwen3_5_moe", raw),
    "clover": lambda raw: _hybrid("clover", raw),
}


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    family: Family = family_for(raw)
    try:
        return PARSERS[family.name](raw)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"config.json has an invalid field for {family.name}: {exc}") from exc


def read_config_json(path: Path) -> dict[str, Any]:
    """Read a checkpoint directory's (or a bare file's) config.json with clear errors."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise UsageError(f"no config.json at {path}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise UsageError(f"{file} does not hold a JSON object")
    return raw


def load_config(path: Path) -> ModelConfig:
    raw = read_config_json(path)
    generation = Path(path) / "generation_config.json"
    if "mask_token_id" not in raw and generation.is_file():
        # Some checkpoints (LLaDA2 fixtures) keep the MASK id only in generation_config.json.
        try:
            mask = json.loads(generation.read_text()).get("mask_token_id")
        except json.JSONDecodeError:
            mask = None
        if mask is not None:
            raw = {**raw, "mask_token_id": mask}
    return config_from_dict(raw)
