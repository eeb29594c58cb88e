"""Fused mixture-of-experts MLP: sort tokens by expert, grouped SwiGLU GEMMs, weighted
combine (torch twin).

The router has already chosen `topk_ids` [T, K] and `topk_weights` [T, K]. Every
(token, slot) pair is sorted by expert so each expert runs two dense matmuls over all of its
tokens at once (a loop over experts, never over tokens). Expert weights are stacked:
`w13` [E, 2F, d] (gate rows then up rows, as a packed gate_up projection) and `w2` [E, d, F].
Numerics (shared with the Triton twin): projections in the weight dtype with fp32
accumulation, rounded to that dtype; SwiGLU in fp32 rounded once; the routing weight and
the sum over the K slots in fp32, rounded once at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpertOrder:
    """(token, slot) pairs grouped by expert: `order` indexes the flattened [T * K] pairs."""

    order: torch.Tensor  # [T*K] long, pair ids sorted by expert (stable: token order inside)
    counts: torch.Tensor  # [E] long, pairs per expert
    starts: torch.Tensor  # [E] long, offset of each expert's group in `order`


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return ExpertOrder(order, counts, torch.cumsum(counts, 0) - counts)


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """x [T, d] -> [T, d]: sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])."""
    t, k = topk_ids.shape
    f = w2.shape[2]
    groups = sort_by_expert(topk_ids, w13.shape[0])
    out = torch.zeros((t * k, x.shape[1]), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float()
    for e, (start, count) in enumerate(zip(groups.starts.tolist(), groups.counts.tolist())):
        if count == 0:
            continue
        pairs = groups.order[start : start + count]
        gate_up = x[pairs // k] @ w13[e].T
        act = (F.silu(gate_up[:, :f].float()) * gate_up[:, f:].float()).to(x.dtype)
        out[pairs] = (act @ w2[e].T).float() * weights[pairs, None]
    return out.view(t, k, -1).sum(1).to(x.dtype)
