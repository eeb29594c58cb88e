"""Attention under dLLM masks over a batch of variable-length sequences (torch twin).

Row b holds `kv_lens[b]` real keys at positions 0..kv_lens[b]-1 (right padding beyond).
Bidirectional (`block_size` None): every query sees every real key (LLaDA, Dream).
Block-causal: the sequence is cut into blocks of `block_size` absolute positions and a query
at position p sees the keys of its own block and all earlier ones, i.e. keys j with
j < (p // block_size + 1) * block_size (SDAR, LLaDA2). With a KV cache the keys are the
cached prefix followed by the current block and the queries are that block: they see the
prefix and the whole block. block_size 1 is plain causal attention.
The twin calls SDPA one row at a time over that row's real keys (with the block-causal
mask when there is one); without padding and without blocks it passes the whole batch and
no mask, SDPA's fastest path.

Why per row: masked padding is exact in real arithmetic, but SDPA groups its sums by the
number of keys, so a row padded to a longer neighbour rounds differently (in bf16 visibly)
from the same request decoded alone, and a request's tokens would depend on its batch.
Over its own keys, a row is computed exactly as it would be solo.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dllm_mask(
    kv_lens: torch.Tensor | None,
    q_positions: torch.Tensor | None,
    block_size: int | None,
    num_keys: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean SDPA mask [B, 1, Tq or 1, Tk] (True = may attend), or None for no mask."""
    keys = torch.arange(num_keys, device=device)
    mask = None
    if kv_lens is not None:
        mask = (keys[None, :] < kv_lens[:, None])[:, None, None, :]
    if block_size is not None:
        if q_positions is None:
            raise ValueError("block-causal attention needs the queries' absolute positions")
        limit = (q_positions // block_size + 1) * block_size
        causal = (keys[None, None, :] < limit[:, :, None])[:, None]
        mask = causal if mask is None else mask & causal
    return mask


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_lens: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (Hq a multiple of Hkv), kv_lens [B] int or None
    (all Tk keys real), q_positions [B, Tq] absolute positions (block-causal only).
    Returns [B, Hq, Tq, D] in q's dtype; scale 1/sqrt(D)."""
    if kv_lens is not None:
        return torch.cat(
            [
                attention_torch(
                    q[b : b + 1],
                    k[b : b + 1, :, :n],
                    v[b : b + 1, :, :n],
                    q_positions=None if q_positions is None else q_positions[b : b + 1],
                    block_size=block_size,
                )
                for b, n in enumerate(kv_lens.tolist())
            ]
        )
    mask = dllm_mask(None, q_positions, block_size, k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def masked_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention under an explicit boolean mask [B, 1, Tq, Tk] (True = may attend).

    For layouts the position-based kernel does not describe yet (a per-row cache prefix of
    different lengths, in-block and commit masks of the block runner, the hybrid's causal
    prefill): SDPA with the mask, grouped-query heads handled by SDPA itself, one row at a
    time over only the keys some query of the row may see, in order (batch invariance, as
    above: a row padded around its keys is computed as it would be alone).
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
    if mask.dim() == 2:  # [Tq, Tk], the same for every row
        mask = mask[None, None]
    mask = mask.expand(q.shape[0], -1, -1, -1)
    seen = mask.any(dim=2).any(dim=1)  # [B, Tk]: keys some query of the row may attend
    rows = []
    for b in range(q.shape[0]):
        keys = seen[b].nonzero()[:, 0]
        if len(keys) == 0:  # nothing visible: SDPA's answer for a fully masked row
            keys = torch.zeros(1, dtype=torch.long, device=q.device)
        first, last = int(keys[0]), int(keys[-1]) + 1
        if last - first == len(keys):  # one run of keys: views, no copy
            kb, vb, mb = k[b : b + 1, :, first:last], v[b : b + 1, :, first:last], mask[b : b + 1, ..., first:last]
        else:  # a gap (padding between a short row's cache and its fed keys)
            kb, vb, mb = k[b : b + 1, :, keys], v[b : b + 1, :, keys], mask[b : b + 1, ..., keys]
        rows.append(
            F.scaled_dot_product_attention(q[b : b + 1], kb, vb, attn_mask=mb, enable_gqa=q.shape[1] != k.shape[1])
        )
    return torch.cat(rows)
