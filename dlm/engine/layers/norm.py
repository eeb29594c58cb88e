"""RMSNorm as the reference models compute it: statistics in fp32 (`dlm.kernels.rms_norm`).

Called with a residual, the norm also performs the residual add before it and returns the
new residual stream: one fused pass instead of an add and a norm.
"""

from __future__ import annotations

import torch

from dlm.kernels import dispatch


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, *, zero_centred: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred  # weight stored as w - 1: scale by (1 + w)
        self.weight = torch.nn.Parameter(torch.empty(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual)."""
        normed, summed = dispatch.rms_norm(x, self.weight, self.eps, residual=residual, zero_centred=self.zero_centred)
        return normed if residual is None else (normed, summed)
