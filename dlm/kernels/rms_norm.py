"""RMSNorm, optionally fused with the residual add that precedes it (torch twin).

Statistics in fp32 as the reference models compute them. Two weight conventions exist:
plain (`w * normed`, the scale applied in the model dtype, LLaMA/Qwen2) and zero-centred
(`(1 + w) * normed`, the scale applied in fp32 before the cast, Qwen3-Next style).
With `residual`, the input is `x + residual` (in the model dtype) and that sum is returned
too: it is the next residual stream, so a layer reads and writes it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, x + residual); without `residual` the second item is `x` itself."""
    if residual is not None:
        x = x + residual
    if zero_centred:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (1.0 + weight.float())).to(x.dtype), x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # Same formula, one fused op (the step loop is overhead-bound on small models).
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x
