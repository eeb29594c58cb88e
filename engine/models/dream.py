"""Dream (model_type `Dream`): Dream-7B, Dream-Coder, DiffuCoder.

A Qwen2 decoder (q/k/v biases, no o_proj bias, GQA, RMSNorm, RoPE) with attention made fully
bidirectional, trained so that row i of the logits predicts token i+1 (`logits_shift`): the
samplers read position p's distribution from row p-1. Parameters mirror the checkpoint
(`model.layers.N.self_attn.o_proj.weight`, `lm_head.weight`, ...), except the packed
`qkv_proj` (q/k/v_proj) and `gate_up_proj` (gate_proj/up_proj), one matmul each. The layer is
the bidirectional decoder layer LLaDA shares (engine/layers/bidirectional_decoder.py), under
Qwen2's names.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.bidirectional_decoder import BidirectionalDecoderLayer, LayerNames
from engine.layers.block_decoder import decoder_stack
from engine.layers.linear import ParallelLMHead, VocabParallelEmbedding
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary
from engine.runtime.batch import ForwardBatch

NAMES = LayerNames(
    attn_norm="input_layernorm",
    qkv="self_attn.qkv_proj",
    attn_out="self_attn.o_proj",
    mlp_norm="post_attention_layernorm",
    gate_up="mlp.gate_up_proj",
    down="mlp.down_proj",
)


class DreamBase(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.logits_size, config.hidden_size)
        self.layers = nn.ModuleList(
            BidirectionalDecoderLayer(config, NAMES, qkv_bias=True, bias=False) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Model(nn.Module):
    logits_shift = 1  # row i predicts token i+1
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DreamBase(config)
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.logits_size)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [B, S, d] at `batch.select` (unshifted rows)."""
        m = self.model
        return decoder_stack(m.embed_tokens(batch.input_ids), m.layers, m.norm, self.rotary, batch)
