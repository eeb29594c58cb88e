"""Rotary position embeddings (rotate-half layout), full or partial, always in fp32.

Positions are explicit per token (absolute ids), never implied by the slice being fed:
cached and gathered forwards must rotate a token exactly as the full forward would.
The rotation itself is `dlm.kernels.rotary`, applied in place through the dispatch.
"""

from __future__ import annotations

import torch

from dlm.kernels import dispatch


class Rotary:
    def __init__(self, rotary_dim: int, theta: float) -> None:
        self.rotary_dim = rotary_dim
        # Built on the CPU explicitly: models are constructed under `torch.device("meta")`.
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self.inv_freq = 1.0 / (theta**exponent)
        # One copy per device, made on first use: a copy from host memory in every forward
        # would synchronise with the host, and a CUDA graph cannot capture it.
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [..., rotary_dim] for integer `positions` of any shape."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[..., None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [B, H, T, D] in place with cos/sin [B, T, rotary_dim] (dims past
        rotary_dim pass through) and return it: x must be a fresh projection."""
        dispatch.rotary(x, None, cos, sin)
        return x
