"""LLaDA2.x (model_type `llada2_moe`, `LLaDA2MoeModelLM`): block-diffusion MoE transformer.

Parameters mirror the checkpoint (`model.word_embeddings`, `model.layers.N.attention.
query_key_value` / `dense` / `query_layernorm` / `key_layernorm`, `mlp.gate.weight`,
`mlp.gate.expert_bias`, `mlp.shared_experts.*`, `model.norm`, `lm_head`), except the
packed `gate_up_proj` (gate_proj, up_proj) of every MLP and the stacked routed experts
(`mlp.experts.gate_up_proj` / `down_proj`, read from the checkpoint's `mlp.experts.E.*`).

- The fused `query_key_value` output is all Q heads, then all K heads, then all V heads.
- Per-head RMSNorm of q and k (`use_qk_norm`) runs before RoPE; RoPE is partial
  (`partial_rotary_factor`): inv_freq over the rotary dim, rotate-half within it.
- Layers below `first_k_dense_replace` are dense; the rest are MoE with the sigmoid,
  group-limited router and a shared expert (see dlm/engine/layers/moe.py).
The layer is the block-causal decoder layer SDAR shares (dlm/engine/layers/block_decoder.py).
"""

from __future__ import annotations

from dlm.engine.config import ModelConfig
from dlm.engine.layers.block_decoder import AttentionNames, DecoderLayer
from dlm.engine.layers.moe import expert_sources
from dlm.engine.models.base import DecoderBody, DecoderLM

NAMES = AttentionNames(qkv="query_key_value", out="dense", q_norm="query_layernorm", k_norm="key_layernorm")


class Model(DecoderLM):
    packed_modules = {"gate_up_proj": ("gate_proj", "up_proj")}
    tensor_sources = expert_sources

    def __init__(self, config: ModelConfig) -> None:
        layers = (DecoderLayer(config, i, "attention", NAMES, fused=True) for i in range(config.num_layers))
        super().__init__(config, DecoderBody(config, layers, embedding="word_embeddings"))
