"""Fused mixture-of-experts MLP: sort tokens by expert, grouped SwiGLU GEMMs, weighted
combine (torch twin).

The router has already chosen `topk_ids` [T, K] and `topk_weights` [T, K]. Every
(token, slot) pair is sorted by expert so each expert runs two dense matmuls over all of its
tokens at once (a loop over experts, never over tokens). An id equal to E (the number of
experts in `w13`) marks a slot whose expert another device holds (expert parallelism): it
contributes zero here, and the caller sums the devices' partials. Expert weights are stacked:
`w13` [E, 2F, d] (gate rows then up rows, as a packed gate_up projection) and `w2` [E, d, F].
Numerics (shared with the Triton twin): projections in the weight dtype with fp32
accumulation, rounded to that dtype; SwiGLU in fp32 rounded once; the routing weight and
the sum over the K slots in fp32, rounded once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpertOrder:
    """(token, slot) pairs grouped by expert: `order` indexes the flattened [T * K] pairs."""

    order: torch.Tensor  # [T*K] long, pair ids sorted by expert (stable: token order inside)
    counts: torch.Tensor  # [E + 1] long, pairs per expert; the last: pairs held elsewhere
    starts: torch.Tensor  # [E + 1] long, offset of each expert's group in `order`


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """Group pairs by expert; ids in [0, num_experts], num_experts meaning "held elsewhere"
    (sorted last, so the local groups stay contiguous from the start)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)
    return ExpertOrder(order, counts, torch.cumsum(counts, 0) - counts)


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor | Sequence[torch.Tensor],
    w2: torch.Tensor | Sequence[torch.Tensor],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """x [T, d] -> [T, d]: sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]).

    This is CPU serving's MoE, where small batches make it bound by per-op overhead: token
    rows and weights are gathered once in expert order, each expert works on contiguous
    slices of them and writes its weighted rows in place, and one scatter restores the
    (token, slot) order. The experts may also come as one weight per expert (quantized
    experts, whose tensors are 2-D): `w13[e]` is expert e's either way."""
    t, k = topk_ids.shape
    d, f = x.shape[1], w2[0].shape[-1]
    groups = sort_by_expert(topk_ids, len(w13))
    rows = x[groups.order // k]
    weights = topk_weights.reshape(-1)[groups.order].float()[:, None]
    sorted_out = torch.zeros((t * k, d), dtype=torch.float32, device=x.device)  # experts held elsewhere: 0
    start = 0
    for e, count in enumerate(groups.counts[:-1].tolist()):
        if count == 0:
            continue
        end = start + count
        gate_up = F.linear(rows[start:end], w13[e]).float()
        act = F.silu(gate_up[:, :f]).mul_(gate_up[:, f:]).to(x.dtype)
        torch.mul(F.linear(act, w2[e]).float(), weights[start:end], out=sorted_out[start:end])
        start = end
    out = torch.empty_like(sorted_out)
    out[groups.order] = sorted_out
    return out.view(t, k, d).sum(1).to(x.dtype)
