"""SwiGLU feed-forward with the gate and up projections packed into one matmul.

Checkpoints store `gate_proj` and `up_proj` separately; models list
`"gate_up_proj": ("gate_proj", "up_proj")` in `packed_modules` so the loader concatenates
them, and the dense MLP, every routed expert and the shared expert are this one module.
Under tensor parallelism the intermediate features are split (gate/up column-parallel,
down row-parallel); `reduce=False` leaves the output a per-rank partial sum (the MoE layer
sums experts and shared expert first, then reduces once), and `sharded=False` keeps a
whole expert on one rank (expert parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        reduce: bool = True,
        sharded: bool = True,
    ) -> None:
        super().__init__()
        if sharded:
            self.gate_up_proj: nn.Linear = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
            self.down_proj: nn.Linear = RowParallelLinear(intermediate_size, hidden_size, bias, reduce=reduce)
            self.intermediate_size = self.down_proj.in_features
        else:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
            self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
            self.intermediate_size = intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.intermediate_size] * 2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
