"""Attention for the model families, through `kernels.dispatch` (`kernels.attention`)."""
from __future__ import annotations

import torch

from kernels import dispatch


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
