"""Self-attention shared by the bidirectional families: packed QKV, RoPE, GQA through SDPA.

`select` lets the last layer compute queries only for the rows whose hidden states are
wanted, while keys and values still cover every fed row (and any cached rows around them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch, gather_rows
from engine.layers.rotary import Rotary


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], mask bool broadcastable to [B, 1, Tq, Tk]
    (True = may attend) or None for full bidirectional attention."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, T, H*D] -> [B, H, T, D]."""
    b, t, _ = x.shape
    return x.view(b, t, num_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H*D]."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def self_attention(
    h: torch.Tensor,
    qkv_proj: nn.Linear,
    heads: tuple[int, int],
    rotary: Rotary,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    batch: ForwardBatch,
    layer: int,
    select: torch.Tensor | None,
) -> torch.Tensor:
    """Attention output (before the output projection) for the rows of normed `h` [B, T, d],
    or only for `select` [B, S]. `heads` = (query heads, KV heads); the packed projection
    holds q, k, v in that order."""
    num_heads, num_kv_heads = heads
    w, b = qkv_proj.weight, qkv_proj.bias
    head_dim = w.shape[0] // (num_heads + 2 * num_kv_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    cos, sin = cos_sin
    if select is None:
        q, k, v = qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        cos_q, sin_q = cos, sin
    else:
        # Keys and values for every fed row, queries only where hidden states are wanted.
        k, v = F.linear(h, w[q_size:], None if b is None else b[q_size:]).split([kv_size, kv_size], dim=-1)
        q = F.linear(gather_rows(h, select), w[:q_size], None if b is None else b[:q_size])
        cos_q, sin_q = gather_rows(cos, select), gather_rows(sin, select)
    k = rotary.apply(split_heads(k, num_kv_heads), cos, sin)
    v = split_heads(v, num_kv_heads)
    q = rotary.apply(split_heads(q, num_heads), cos_q, sin_q)
    k, v, mask = batch.keys_values(layer, k, v)
    return merge_heads(attention(q, k, v, mask))
