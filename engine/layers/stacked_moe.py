"""Sparse MoE with experts stored stacked and a sigmoid-gated shared expert (Qwen3.5-MoE).

Experts are stacked as transformers holds them in memory: `experts.gate_up_proj`
[E, 2I, d] (gate rows then up rows) and `experts.down_proj` [E, d, I]. Checkpoints on disk
often keep one tensor per expert; the model's loader layout stacks them once at load.
Routing is `engine.layers.moe.softmax_route` (softmax top-k, renormalised); tokens are
grouped by expert so each routed expert runs one matmul over its tokens.

Across tensor-parallel ranks the stacked tensors hold this rank's experts (expert
parallelism) or this rank's rows of every expert (`engine.layers.moe.expert_placement`);
routed and shared experts give a partial sum, reduced once per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state
from engine.layers.linear import split
from engine.layers.mlp import GatedMLP
from engine.layers.moe import expert_placement, softmax_route
from engine.loader import Index, Shard


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.placement, self.local = expert_placement(num_experts, intermediate_size)
        i0, i1 = split(intermediate_size, "the expert intermediate size") if self.placement == "tp" else (0, intermediate_size)
        self.intermediate_size = i1 - i0
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.local), 2 * self.intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(len(self.local), hidden_size, self.intermediate_size))
        if self.placement == "single":
            return
        experts = slice(self.local.start, self.local.stop)
        full = intermediate_size

        def gate_up(i: int, shape: tuple[int, ...]) -> list[Index]:
            if len(shape) == 3:  # stacked on disk [E, 2I, d]: this rank's experts / gate and up rows
                if self.placement == "ep":
                    return [(experts,)]
                return [(slice(None), slice(i0, i1)), (slice(None), slice(full + i0, full + i1))]
            return [(slice(i0, i1),)]  # one [I, d] tensor per expert and projection

        def down(i: int, shape: tuple[int, ...]) -> list[Index]:
            if len(shape) == 3:  # [E, d, I]
                return [(experts,)] if self.placement == "ep" else [(slice(None), slice(None), slice(i0, i1))]
            return [(slice(None), slice(i0, i1))]  # [d, I] per expert

        # Per-expert sources are concatenated on dim 0 (then reshaped by the model's
        # weight_loader); the gate and up rows of a stacked tensor on dim 1.
        self.gate_up_proj.shard = Shard(gate_up, lambda shape: 1 if len(shape) == 3 else 0)  # type: ignore[attr-defined]
        self.down_proj.shard = Shard(down)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, d]; experts/weights [N, k]: each token's chosen experts and mixing weights.
        Only this rank's experts run; the others' contributions come with the reduce."""
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // experts.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0 or e not in self.local:
                start += n
                continue
            slots = order[start : start + n]
            tokens = token_of[start : start + n]
            start += n
            local = e - self.local.start
            gate, up = F.linear(x[tokens], self.gate_up_proj[local]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[local])
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
        self.shared_expert = GatedMLP(hidden_size, shared_size, reduce=False)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)  # replicated, like the router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        experts, weights = self.gate(flat)
        routed = self.experts(flat, experts, weights)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return parallel_state.all_reduce(routed + shared).reshape(shape)
