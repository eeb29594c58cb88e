"""LLaDA (model_type `llada`): a LLaMA-style transformer with fully bidirectional attention.

Parameters mirror the checkpoint (`model.transformer.blocks.N.attn_out.weight`, ...), except
the packed `qkv_proj` (q/k/v_proj) and `gate_up_proj` (ff_proj/up_proj), loaded by
concatenation so each is one matmul. In the checkpoint `ff_proj` is the SwiGLU gate,
`up_proj` the up projection, `ff_out` (in a block) the down projection and (at the top)
the LM head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch, gather_rows
from engine.config import ModelConfig
from engine.layers.attention import self_attention
from engine.layers.linear import (
    ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary


class LLaDABlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        bias = bool(config.raw.get("include_bias", False))
        qkv_bias = bias or bool(config.raw.get("include_qkv_bias", False))
        self.layer = layer
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(d, config.num_heads, config.num_kv_heads, hd, qkv_bias)
        self.heads = (self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads)  # this rank's heads
        self.attn_out = RowParallelLinear(config.num_heads * hd, d, bias=bias)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.gate_up_proj = ColumnParallelLinear(d, [config.intermediate_size] * 2, bias=bias)
        self.ffn = self.gate_up_proj.local_parts[0]
        self.ff_out = RowParallelLinear(config.intermediate_size, d, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        select: torch.Tensor | None,
    ) -> torch.Tensor:
        """One block; with `select`, queries (and the output) are only the selected rows."""
        h = self.attn_norm(x)
        out = self_attention(h, self.qkv_proj, self.heads, rotary, cos_sin, batch, self.layer, select)
        if select is not None:
            x = gather_rows(x, select)
        x = x + self.attn_out(out)
        gate, up = self.gate_up_proj(self.ff_norm(x)).split([self.ffn, self.ffn], dim=-1)
        return x + self.ff_out(F.silu(gate) * up)


class LLaDATransformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.logits_size, config.hidden_size)
        self.blocks = nn.ModuleList(LLaDABlock(config, i) for i in range(config.num_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.ff_out = ParallelLMHead(config.hidden_size, config.logits_size)


class _Root(nn.Module):
    """Holds `transformer` so parameter names carry the checkpoint's `model.` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.transformer = LLaDATransformer(config)


class Model(nn.Module):
    logits_shift = 0  # row i predicts token i
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("ff_proj", "up_proj")}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Root(config)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        t = self.model.transformer
        return t.wte.weight if self.config.tie_word_embeddings else t.ff_out.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [B, S, d] at `batch.select`."""
        t = self.model.transformer
        x = t.wte(batch.input_ids)
        cos_sin = self.rotary.cos_sin(batch.positions)
        last = len(t.blocks) - 1
        for i, block in enumerate(t.blocks):
            x = block(x, self.rotary, cos_sin, batch, batch.select if i == last else None)
        return t.ln_f(x)
