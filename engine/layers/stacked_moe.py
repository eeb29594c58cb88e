"""Sparse MoE with experts stored stacked and a sigmoid-gated shared expert (Qwen3.5-MoE).

Experts are stacked as transformers holds them in memory: `experts.gate_up_proj`
[E, 2I, d] (gate rows then up rows) and `experts.down_proj` [E, d, I]. Checkpoints on disk
often keep one tensor per expert; the model's loader layout stacks them once at load.
Routing is `engine.layers.moe.softmax_route` (softmax top-k, renormalised); tokens are
grouped by expert so each routed expert runs one matmul over its tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.mlp import GatedMLP
from engine.layers.moe import softmax_route


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, d]; experts/weights [N, k]: each token's chosen experts and mixing weights."""
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // experts.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            tokens = token_of[start : start + n]
            start += n
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, tokens, y * weights.reshape(-1)[slots, None].to(y.dtype))
        return out


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts, weights = softmax_route(F.linear(x, self.weight), self.top_k, renormalize=True)
        return experts, weights.to(x.dtype)


class StackedSparseMoE(nn.Module):
    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, shared_size: int
    ) -> None:
        super().__init__()
        self.gate = Router(num_experts, hidden_size, top_k)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = GatedMLP(hidden_size, shared_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        experts, weights = self.gate(flat)
        routed = self.experts(flat, experts, weights)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(shape)
