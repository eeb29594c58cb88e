"""Triton twin of `dlm/kernels/rotary.py`: q and k rotated in place in one launch.

One program per (16-token tile, head) over q's heads followed by k's; it reads its tokens'
cos/sin rows and rewrites the rotated half-pairs over the input; the pass-through dims of a
partial rotary are never touched. Any strides with a unit stride on the head dimension
(q/k are usually head-split views of a projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlm.kernels.triton_support import round_to


@triton.jit
def _rotate_rows(base, offsets, c, s, ok, HALF, BLOCK_HALF: tl.constexpr):
    """Rotate the rows at `base + offsets` (one per token) with their cos/sin rows `c`/`s`."""
    i = tl.arange(0, BLOCK_HALF)[None, :]
    m = ok[:, None] & (i < HALF)
    x_lo = base + offsets[:, None] + i
    x1 = tl.load(x_lo, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_lo + HALF, mask=m, other=0.0).to(tl.float32)
    cos1 = tl.load(c[:, None] + i, mask=m, other=0.0)
    cos2 = tl.load(c[:, None] + HALF + i, mask=m, other=0.0)
    sin1 = tl.load(s[:, None] + i, mask=m, other=0.0)
    sin2 = tl.load(s[:, None] + HALF + i, mask=m, other=0.0)
    dtype = base.dtype.element_ty
    # Same products and sum as the twin's rot * cos + cat(-x2, x1) * sin.
    tl.store(x_lo, round_to(x1 * cos1 + (-x2) * sin1, dtype), mask=m)
    tl.store(x_lo + HALF, round_to(x2 * cos2 + x1 * sin2, dtype), mask=m)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    BT,
    T,
    HQ,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_t,
    sc_b,
    sc_t,
    HALF,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    ok = tokens < BT
    b = tokens // T
    t = tokens % T
    c = cos_ptr + b * sc_b + t * sc_t
    s = sin_ptr + b * sc_b + t * sc_t
    if head < HQ:
        _rotate_rows(q_ptr + head * sq_h, b * sq_b + t * sq_t, c, s, ok, HALF, BLOCK_HALF)
    else:
        _rotate_rows(k_ptr + (head - HQ) * sk_h, b * sk_b + t * sk_t, c, s, ok, HALF, BLOCK_HALF)


def rotary_triton(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Same contract as `rotary_torch`."""
    kk = q if k is None else k
    if q.stride(-1) != 1 or kk.stride(-1) != 1:
        raise ValueError("rotary_triton needs a unit stride on the head dimension")
    b, hq, t, _ = q.shape
    hk = 0 if k is None else k.shape[1]
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    half = cos.shape[-1] // 2
    if b * t * (hq + hk) == 0:
        return
    block_t = 16
    _rotary_kernel[(triton.cdiv(b * t, block_t), hq + hk)](
        q,
        kk,
        cos,
        sin,
        b * t,
        t,
        hq,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kk.stride(0),
        kk.stride(1),
        kk.stride(2),
        cos.stride(0),
        cos.stride(1),
        half,
        BLOCK_T=block_t,
        BLOCK_HALF=triton.next_power_of_2(half),
    )
