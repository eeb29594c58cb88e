"""SwiGLU feed-forward with the gate and up projections packed into one matmul.

Checkpoints store `gate_proj` and `up_proj` separately; models list
`"gate_up_proj": ("gate_proj", "up_proj")` in `packed_modules` so the loader concatenates
them, and the dense MLP, every routed expert and the shared expert are this one module.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.intermediate_size] * 2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
