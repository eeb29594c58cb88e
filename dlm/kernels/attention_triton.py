"""Triton twin of `dlm/kernels/attention.py`: flash-style attention under dLLM masks.

Grid: (query tiles, batch x query heads). Each program streams its row's key/value tiles
with an online softmax (running max, running sum, rescaled accumulator), so no [Tq, Tk]
matrix exists. The mask is computed from (kv_lens, query positions, block size) in
registers; key tiles past the row's length, or past the last block its queries may see, are
never loaded, which is where block-causal decoding saves work over a dense masked SDPA.
GQA maps query head h to key/value head h // (Hq / Hkv).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dlm.kernels.triton_support import round_to, upcast_dot


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lens_ptr,
    pos_ptr,
    Tq,
    Tk,
    D,
    HQ,
    GROUP,
    block_size,
    scale,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_t,
    sv_b,
    sv_h,
    sv_t,
    so_b,
    so_h,
    so_t,
    sp_b,
    HAS_LENS: tl.constexpr,
    BLOCKS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    kvh = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Tq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_t + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    kv_len = Tk
    if HAS_LENS:
        kv_len = tl.load(lens_ptr + b).to(tl.int32)
    kv_end = kv_len
    if BLOCKS:
        pos = tl.load(pos_ptr + b * sp_b + rows, mask=row_ok, other=0).to(tl.int32)
        limit = (pos // block_size + 1) * block_size
        kv_end = tl.minimum(kv_len, tl.max(tl.where(row_ok, limit, 0), axis=0))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    for n0 in range(0, kv_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_end
        k = tl.load(k_base + cols[None, :] * sk_t + d[:, None], mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_t + d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        qk = tl.dot(q, k, input_precision="ieee") * scale
        valid = col_ok[None, :]
        if BLOCKS:
            valid = valid & (cols[None, :] < limit[:, None])
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing in this tile
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + b * so_b + h * so_h + rows[:, None] * so_t + d[None, :],
        round_to(out, o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_lens: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Same contract as `attention_torch`. The result is a [B, Hq, Tq, D] view of a
    [B, Tq, Hq, D] buffer, so merging the heads afterwards is a free reshape."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if block_size is not None and q_positions is None:
        raise ValueError("block-causal attention needs the queries' absolute positions")
    if min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty((b, tq, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    if b * hq * tq == 0:
        return out
    block_m = 16 if tq <= 16 else 64
    pos = q_positions if q_positions is not None else q.new_zeros((1, 1), dtype=torch.long)
    grid = (triton.cdiv(tq, block_m), b * hq)
    _attention_kernel[grid](
        q,
        k,
        v,
        out,
        kv_lens if kv_lens is not None else pos,
        pos,
        tq,
        tk,
        d,
        hq,
        hq // hkv,
        block_size or 1,
        1.0 / math.sqrt(d),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        pos.stride(0),
        HAS_LENS=kv_lens is not None,
        BLOCKS=block_size is not None,
        UPCAST=upcast_dot(q.dtype),
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    return out
