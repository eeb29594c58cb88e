"""Rotary position embedding applied in place to q and k (rotate-half layout), torch twin.

x [B, H, T, D] with cos/sin [B, T, R] (R = rotary dims, the first R of each head; the
rest pass through untouched: partial rotary). Rotation in fp32, written back in x's dtype,
exactly as `dlm/engine/layers/rotary.py` computes it. In place because q and k are fresh
projections nobody else reads: rotating them where they lie saves a copy of each.
"""

from __future__ import annotations

import torch


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    r = cos.shape[-1]
    rot = x[..., :r].float()
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    x[..., :r] = (rot * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def rotary_torch(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q (and k, which shares q's positions) in place."""
    _rotate_(q, cos, sin)
    if k is not None:
        _rotate_(k, cos, sin)
