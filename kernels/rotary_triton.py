"""Triton twin of `kernels/rotary.py`: q and k rotated in place in one launch.

One program per (token, head) over q's heads followed by k's; each reads its token's
cos/sin row and rewrites the rotated half-pairs over the input; the pass-through dims of a
partial rotary are never touched. Any strides with a unit stride on the head dimension
(q/k are usually head-split views of a projection).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import round_to


@triton.jit
def _rotate_row(base, c, s, HALF, BLOCK_HALF: tl.constexpr):
    i = tl.arange(0, BLOCK_HALF)
    ok = i < HALF
    x1 = tl.load(base + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0).to(tl.float32)
    cos1 = tl.load(c + i, mask=ok, other=0.0)
    cos2 = tl.load(c + HALF + i, mask=ok, other=0.0)
    sin1 = tl.load(s + i, mask=ok, other=0.0)
    sin2 = tl.load(s + HALF + i, mask=ok, other=0.0)
    dtype = base.dtype.element_ty
    # Same products and sum as the twin's rot * cos + cat(-x2, x1) * sin.
    tl.store(base + i, round_to(x1 * cos1 + (-x2) * sin1, dtype), mask=ok)
    tl.store(base + HALF + i, round_to(x2 * cos2 + x1 * sin2, dtype), mask=ok)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, T, HQ,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sc_b, sc_t, HALF,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    b = token // T
    t = token % T
    c = cos_ptr + b * sc_b + t * sc_t
    s = sin_ptr + b * sc_b + t * sc_t
    if head < HQ:
        _rotate_row(q_ptr + b * sq_b + head * sq_h + t * sq_t, c, s, HALF, BLOCK_HALF)
    else:
        _rotate_row(k_ptr + b * sk_b + (head - HQ) * sk_h + t * sk_t, c, s, HALF, BLOCK_HALF)


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> None:
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
    _rotary_kernel[(b * t, hq + hk)](
        q, kk, cos, sin, t, hq, q.stride(0), q.stride(1), q.stride(2),
        kk.stride(0), kk.stride(1), kk.stride(2), cos.stride(0), cos.stride(1), half,
        BLOCK_HALF=triton.next_power_of_2(half),
    )
