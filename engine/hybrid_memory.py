"""Memory terms of the Gated-DeltaNet hybrid, from config.json alone (no torch), for
`dlm estimate` and capacity planning.

Per sequence the hybrid holds two kinds of state: keys/values of its few full-attention
layers, growing with the context like any KV cache, and for every DeltaNet layer a
fixed-size state whatever the context length: the conv ring (K-1 pre-conv rows of
2*key_dim + value_dim channels, model dtype) and the recurrent matrix per value head
(dk x dv, always fp32).
"""
from __future__ import annotations

from engine.config import ModelConfig

FP32_BYTES = 4


def _layer_count(config: ModelConfig, kind: str) -> int:
    return sum(1 for t in config.raw["layer_types"][: config.num_layers] if t == kind)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of keys + values one token adds, over the full-attention layers only."""
    return _layer_count(config, "full_attention") * 2 * config.num_kv_heads * config.head_dim * dtype_bytes


def linear_state_bytes_per_sequence(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of DeltaNet state one sequence holds, independent of its length."""
    raw = config.raw
    key_dim = int(raw["linear_num_key_heads"]) * int(raw["linear_key_head_dim"])
    value_dim = int(raw["linear_num_value_heads"]) * int(raw["linear_value_head_dim"])
    conv = (2 * key_dim + value_dim) * (int(raw.get("linear_conv_kernel_dim", 4)) - 1) * dtype_bytes
    recurrent = int(raw["linear_num_value_heads"]) * int(raw["linear_key_head_dim"]) * int(raw["linear_value_head_dim"]) * FP32_BYTES
    return _layer_count(config, "linear_attention") * (conv + recurrent)


def sequence_state_bytes(config: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """Everything one sequence of `tokens` tokens holds in its HybridCache."""
    return tokens * kv_bytes_per_token(config, dtype_bytes) + linear_state_bytes_per_sequence(config, dtype_bytes)
