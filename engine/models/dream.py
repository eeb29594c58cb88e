"""Dream (model_type `Dream`): Dream-7B, Dream-Coder, DiffuCoder.

A Qwen2 decoder (q/k/v biases, no o_proj bias, GQA, RMSNorm, RoPE) with attention made fully
bidirectional, trained so that row i of the logits predicts token i+1 (`logits_shift`): the
samplers read position p's distribution from row p-1. Parameters mirror the checkpoint
(`model.layers.N.self_attn.o_proj.weight`, `lm_head.weight`, ...), except the packed
`qkv_proj` (q/k/v_proj) and `gate_up_proj` (gate_proj/up_proj), one matmul each.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.batch import ForwardBatch, gather_rows
from engine.config import ModelConfig
from engine.layers.attention import self_attention
from engine.layers.linear import ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary


class DreamAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_heads, config.num_kv_heads, hd, bias=True)
        self.o_proj = RowParallelLinear(config.num_heads * hd, config.hidden_size, bias=False)


class DreamLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DreamAttention(config)
        self.heads = (self.self_attn.qkv_proj.num_heads, self.self_attn.qkv_proj.num_kv_heads)  # this rank's
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        select: torch.Tensor | None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        out = self_attention(h, self.self_attn.qkv_proj, self.heads, rotary, cos_sin, batch, self.layer, select)
        if select is not None:
            x = gather_rows(x, select)
        x = x + self.self_attn.o_proj(out)
        return x + self.mlp(self.post_attention_layernorm(x))


class DreamBase(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.logits_size, config.hidden_size)
        self.layers = nn.ModuleList(DreamLayer(config, i) for i in range(config.num_layers))
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
        x = m.embed_tokens(batch.input_ids)
        cos_sin = self.rotary.cos_sin(batch.positions)
        last = len(m.layers) - 1
        for i, layer in enumerate(m.layers):
            x = layer(x, self.rotary, cos_sin, batch, batch.select if i == last else None)
        return m.norm(x)
