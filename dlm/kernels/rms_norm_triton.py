"""Triton twin of `dlm/kernels/rms_norm.py`: residual add + RMSNorm in one pass over each row.

Each program normalises a few rows: each row is read once (plus the residual), the sum
written once, the normed row written once; the unfused path reads and writes it three to four times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlm.kernels.triton_support import round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    R,
    D,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    ok = (rows < R) & (cols < D)
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        summed = round_to(x + r, dtype)  # the sum in the model dtype, as torch adds
        tl.store(sum_ptr + rows * stride_s + cols, summed, mask=ok)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
    h = x * rstd[:, None]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    if ZERO_CENTRED:
        out = round_to(h * (1.0 + w), out_dtype)
    else:
        # Plain weights scale the already-rounded normed row, in the output dtype.
        out = round_to(w * round_to(h, dtype).to(tl.float32), out_dtype)
    tl.store(out_ptr + rows * stride_o + cols, out, mask=ok)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm_torch`."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    res = None
    if residual is not None:
        res = residual.reshape(-1, d)
        res = res if res.stride(-1) == 1 else res.contiguous()
    out_dtype = x.dtype if zero_centred else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(rows) if res is not None else rows
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(16, 4096 // block_d))  # several short rows per program
    if rows.shape[0]:
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], block_r),)](
            rows,
            res if res is not None else rows,
            weight,
            out,
            summed,
            rows.shape[0],
            d,
            rows.stride(0),
            (res if res is not None else rows).stride(0),
            out.stride(0),
            summed.stride(0),
            float(eps),
            HAS_RESIDUAL=res is not None,
            ZERO_CENTRED=zero_centred,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
        )
    return out.view(x.shape), (summed.view(x.shape) if res is not None else x)
