"""The decoder layer shared by the block-causal families (LLaDA2, SDAR, openPangu).

Families differ only in how q/k/v are projected (LLaDA2's fused `query_key_value`, SDAR's
and openPangu's separate `q/k/v_proj`), in their MLP (dense or MoE) and in names; from the
projected rows on, they all do the same: split heads, optional per-head q/k RMSNorm *before* RoPE, (partial) RoPE at
absolute positions, attention through the batch (cache + fed keys, group visibility).
In the last layer only the `select` rows ask questions, so queries are gathered there.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import merge_heads, split_heads
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary
from engine.runtime.batch import ForwardBatch, gather_rows
from engine.runtime.block_batch import BlockBatch


def gather_heads(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], index [B, S] -> [B, H, S, D]."""
    b, h, _, d = x.shape
    return torch.gather(x, 2, index[:, None, :, None].expand(b, h, index.shape[1], d))


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    rotary: Rotary,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    batch: BlockBatch,
    layer: int,
    selected: bool,
) -> torch.Tensor:
    """q/k/v [B, T, H*D] for every fed row -> attention output [B, Tq, Hq*D], where Tq is
    T, or the number of `batch.select` rows when `selected`."""
    q, k, v = split_heads(q, num_heads), split_heads(k, num_kv_heads), split_heads(v, num_kv_heads)
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    cos, sin = cos_sin
    k = rotary.apply(k, cos, sin)
    if selected:
        q = gather_heads(q, batch.select)
        index = batch.select[..., None].expand(-1, -1, cos.shape[-1])
        cos, sin = torch.gather(cos, 1, index), torch.gather(sin, 1, index)
    q = rotary.apply(q, cos, sin)
    return merge_heads(batch.attend(layer, q, k, v, selected))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer. Subclasses create `input_layernorm`,
    `post_attention_layernorm`, `mlp` and the attention module under the checkpoint's name
    (`attention_name`), whose forward(h, rotary, cos_sin, batch, layer, selected) projects
    and calls `block_attention`."""

    attention_name = "self_attn"
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: BlockBatch,
        layer: int,
        last: bool,
    ) -> torch.Tensor:
        attn = getattr(self, self.attention_name)
        out = attn(self.input_layernorm(x), rotary, cos_sin, batch, layer, last)
        if last:  # only the selected rows leave the last layer
            x = gather_rows(x, batch.select)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x))


def decoder_stack(
    x: torch.Tensor, layers: nn.ModuleList, norm: RMSNorm, rotary: Rotary, batch: ForwardBatch | BlockBatch
) -> torch.Tensor:
    """Embedded inputs -> final-normed hidden states [B, S, d] at `batch.select`. Every
    family's layer loop (the bidirectional families' layers take the same arguments)."""
    cos_sin = rotary.cos_sin(batch.positions)
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        x = layer(x, rotary, cos_sin, batch, i, i == last)
    return norm(x)
