"""The hybrid's memory formulas: equal to what a real HybridCache holds, and the
Qwen3.5-35B-A3B / Clover numbers they give."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.config import config_from_dict
from engine.engine import load_model
from engine.hybrid_memory import kv_bytes_per_token, linear_state_bytes_per_sequence, sequence_state_bytes
from tests.hybrid_checkpoints import reference_model, save_reference


def test_formula_equals_a_real_cache(tmp_path: Path) -> None:
    directory = save_reference(reference_model(seed=1), tmp_path)
    loaded = load_model(directory, torch.bfloat16, torch.device("cpu"))
    model, tokens = loaded.model, 21
    cache = model.new_cache()
    with torch.inference_mode():
        _, states = model.forward_tokens(torch.arange(tokens)[None], torch.arange(tokens)[None], cache)
    cache.commit(states, tokens)
    assert cache.state_bytes() == sequence_state_bytes(loaded.config, tokens, dtype_bytes=2)


def test_clover_35b_terms() -> None:
    """transformers' Qwen3_5MoeTextConfig defaults (= Qwen3.5-35B-A3B, the Clover base)."""
    config = config_from_dict({
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "moe_intermediate_size": 512,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 256,
        "num_experts_per_tok": 8, "shared_expert_intermediate_size": 512,
    })
    assert config.raw["layer_types"].count("full_attention") == 10
    assert kv_bytes_per_token(config, 2) == 10 * 2 * 2 * 256 * 2  # 20 KiB per token in bf16
    # 30 layers x (conv ring 8192 x 3 x 2 B + S 32 x 128 x 128 x 4 B) = about 61.4 MiB per sequence
    assert linear_state_bytes_per_sequence(config, 2) == 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
