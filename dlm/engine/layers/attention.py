"""Attention for the model families, through `dlm.kernels.dispatch` (`dlm.kernels.attention`), and the
self-attention block the bidirectional families (LLaDA, Dream) share: packed QKV, RoPE, GQA.

`select` lets the last layer compute queries only for the rows whose hidden states are
wanted, while keys and values still cover every fed row (and any cached rows around them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.layers.rotary import Rotary
from dlm.engine.quantized_weights import is_quantized
from dlm.engine.runtime.batch import ForwardBatch, gather_rows
from dlm.kernels import dispatch


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor | None,
    *,
    q_positions: torch.Tensor | None = None,
    block_size: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D]; kv_lens [B] real keys per row (None: all Tk).
    Bidirectional, or block-causal over absolute `q_positions` with `block_size`; or, with
    `mask`, an explicit boolean mask [B, 1, Tq, Tk] (True = may attend)."""
    if mask is not None:
        return dispatch.masked_attention(q, k, v, mask)
    if kv_lens is not None and kv_lens.dim() != 1:
        raise ValueError(f"kv_lens must be [batch] key counts, not a {tuple(kv_lens.shape)} mask")
    return dispatch.attention(q, k, v, kv_lens=kv_lens, q_positions=q_positions, block_size=block_size)


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
    if select is None or is_quantized(w):
        # A quantized or packed weight is not sliced by rows: its layout need not allow it.
        q, k, v = qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        cos_q, sin_q = cos, sin
        if select is not None:
            q, cos_q, sin_q = gather_rows(q, select), gather_rows(cos, select), gather_rows(sin, select)
    else:
        # Keys and values for every fed row, queries only where hidden states are wanted.
        k, v = F.linear(h, w[q_size:], None if b is None else b[q_size:]).split([kv_size, kv_size], dim=-1)
        q = F.linear(gather_rows(h, select), w[:q_size], None if b is None else b[:q_size])
        cos_q, sin_q = gather_rows(cos, select), gather_rows(sin, select)
    k = rotary.apply(split_heads(k, num_kv_heads), cos, sin)
    v = split_heads(v, num_kv_heads)
    q = rotary.apply(split_heads(q, num_heads), cos_q, sin_q)
    # Cached keys sit in position order from key 0 with right padding, so real keys per row
    # (`kv_lens`) describe the layout and the position-based kernel applies.
    k, v, kv_lens = batch.keys_values(layer, k, v)
    return merge_heads(attention(q, k, v, kv_lens))
