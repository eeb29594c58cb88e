"""A tiny random DiffusionGemma checkpoint, written by transformers' own classes.

DiffusionGemma has no published tiny model, and its reference implementation ships with
transformers: building the checkpoint with `DiffusionGemmaForBlockDiffusion(...)
.save_pretrained` gives the exact on-disk format (tied encoder/decoder weights, stacked
experts, per-layer head shapes) that the real checkpoints use. The token embedding (tied to
the LM head) is drawn wider than transformers' default so that the random model's
predictions are peaked enough for the entropy-bound sampler to accept several tokens per
step and for its stopping rule to fire: the decoding paths then all run on the tiny model.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

# Small, but with every structural feature: a sliding and two full-attention layers (their
# own head size and KV heads, no v_proj), experts beside the dense MLP.
TINY_TEXT: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=16,
    num_global_key_value_heads=1,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=16,
    max_position_embeddings=2048,
)
TINY_VISION: dict[str, Any] = dict(
    model_type="gemma4_vision",
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
)
EMBEDDING_STD = 1.0  # wide enough for confident random predictions (see the module docstring)


def save_tiny_diffusion_gemma(
    directory: Path,
    *,
    vocab_size: int = 96,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
    bos_token_id: int = 2,
    canvas_length: int = 8,
    seed: int = 0,
    **text: Any,
) -> Path:
    """Write a random fp32 checkpoint to `directory` with `save_pretrained`; `text`
    overrides fields of the text config."""
    from dlm.engine.quantized_weights import quiet_torchao_import

    with quiet_torchao_import():  # transformers' model classes import torchao when installed
        from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    text_config = {
        **TINY_TEXT,
        "vocab_size": vocab_size,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        **text,
    }
    config = DiffusionGemmaConfig(text_config=text_config, vision_config=TINY_VISION, canvas_length=canvas_length)
    model = DiffusionGemmaForBlockDiffusion(config).float()
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.normal_(0.0, EMBEDDING_STD)
    from transformers.utils import logging as hf_logging

    # transformers draws a progress bar for each save; building a tiny model is not long work
    # the user asked for, so `dlm serve tiny:diffusion_gemma` prints none.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Path(directory)


def tiny_diffusion_gemma(vocab_size: int, eos_token_id: int, pad_token_id: int) -> tuple[dict[str, Any], Any]:
    """(config.json, tensors) of the tiny checkpoint, for `tiny:diffusion_gemma`."""
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_diffusion_gemma(
            Path(tmp), vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id, canvas_length=32
        )
        config = json.loads((Path(tmp) / "config.json").read_text())
        return config, load_file(str(Path(tmp) / "model.safetensors"))
