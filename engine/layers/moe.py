"""Mixture-of-experts feed-forward: routers and the grouped expert dispatch.

Routing decides, per token, `top_k` experts and their weights; the dispatch then sorts the
(token, slot) pairs by expert so each expert runs ONE matmul over all its tokens (a loop
over experts, never over tokens). Rows of an expert are kept in ascending (token, slot)
order, and the weighted sum runs over slots in routing order, which is exactly the
arithmetic of the reference implementations (boolean-mask gather per expert, then
`(out * w).sum(slots)`), so outputs match them bit for bit in fp32.

Two routers cover the supported families:
- LLaDA2 (DeepSeek-V3 style): sigmoid scores; selection on scores + expert bias, limited to
  the `topk_group` groups (of `n_group`) with the largest sum of their two best biased
  scores; weights are the *unbiased* scores of the chosen experts, renormalised, times
  `routed_scaling_factor`. A shared expert is added unweighted.
- SDAR-MoE (Qwen3-MoE style): softmax over expert logits, top-k, optional renormalisation.

Across tensor-parallel ranks (activations are replicated, so every rank routes every token
identically with the replicated router) the experts are placed by `expert_placement`:
expert parallelism gives each rank whole experts (the others are `NotLocal` placeholders),
tensor-parallel experts split every expert's intermediate features. Either way each rank
produces a partial sum of the routed (and shared) experts' output, and one all-reduce per
layer combines them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state
from engine.layers.linear import split
from engine.layers.mlp import GatedMLP


def sigmoid_group_limited_route(
    logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, n_group: int,
    topk_group: int, scaling: float, renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (experts [T, k], weights [T, k] fp32)."""
    scores = torch.sigmoid(logits)
    biased = scores if expert_bias is None else scores + expert_bias.float()
    tokens, experts = biased.shape
    if n_group > 1:
        grouped = biased.view(tokens, n_group, experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False).indices, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(tokens, experts)
        biased = biased.masked_fill(~keep, float("-inf"))
    chosen = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return chosen, weights * scaling


def softmax_route(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (experts [T, k], weights [T, k] fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, chosen = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return chosen, weights


class NotLocal(nn.Module):
    """The place of an expert held by another rank (expert parallelism): no parameters."""


def expert_placement(num_experts: int, expert_ffn: int) -> tuple[str, range]:
    """How this rank holds a layer's experts: ("single", all) outside tensor parallelism,
    ("ep", its experts) or ("tp", all, each split). `auto` picks expert parallelism when
    the experts divide evenly over the ranks, tensor-parallel experts otherwise."""
    tp = parallel_state.current()
    if tp.size == 1:
        return "single", range(num_experts)
    mode = tp.moe
    if mode == "auto":
        mode = "ep" if num_experts % tp.size == 0 else "tp"
    if mode == "ep":
        return "ep", range(*split(num_experts, "the number of experts"))
    split(expert_ffn, "the expert intermediate size")
    return "tp", range(num_experts)


def grouped_experts(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: nn.ModuleList
) -> torch.Tensor:
    """x [T, d], chosen/weights [T, k] -> sum_k weights * expert_k(x), one matmul per expert
    (experts of other ranks contribute zero here)."""
    tokens, k = chosen.shape
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    out = x.new_zeros((tokens * k, x.shape[-1]))
    start = 0
    for e, n in enumerate(counts):
        if n and not isinstance(experts[e], NotLocal):
            rows = order[start : start + n]
            out[rows] = experts[e](x[rows // k])
        start += n
    return (out.view(tokens, k, x.shape[-1]) * weights[..., None]).sum(1).to(x.dtype)


class SigmoidGroupGate(nn.Module):
    """LLaDA2's router: `gate.weight` [E, d] and `gate.expert_bias` [E] as in the checkpoint."""

    def __init__(self, hidden: int, experts: int, top_k: int, n_group: int, topk_group: int,
                 scaling: float, renormalize: bool, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.expert_bias = nn.Parameter(torch.empty(experts)) if bias else None
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.scaling, self.renormalize = scaling, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # the router runs in fp32
        return sigmoid_group_limited_route(
            logits, self.expert_bias, self.top_k, self.n_group, self.topk_group,
            self.scaling, self.renormalize,
        )


class SoftmaxGate(nn.Module):
    """Qwen3-MoE's router (SDAR-MoE): `gate.weight` [E, d]."""

    def __init__(self, hidden: int, experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_route(F.linear(x, self.weight), self.top_k, self.renormalize)


class SparseMoE(nn.Module):
    """`gate`, `experts.N` and optionally `shared_experts`, named as in the checkpoints."""

    def __init__(self, gate: nn.Module, hidden: int, expert_ffn: int, num_experts: int,
                 shared_ffn: int = 0) -> None:
        super().__init__()
        self.gate = gate  # replicated: every rank routes every token the same way
        self.placement, local = expert_placement(num_experts, expert_ffn)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, expert_ffn, reduce=False, sharded=self.placement != "ep") if e in local else NotLocal()
            for e in range(num_experts)
        )
        self.shared_experts = GatedMLP(hidden, shared_ffn, reduce=False) if shared_ffn else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.gate(flat)
        out = grouped_experts(flat, chosen, weights, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return parallel_state.all_reduce(out).view(x.shape)
