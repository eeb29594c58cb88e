"""Commit rules: given the confidences of a block's masked positions, which ones to unmask.

All rules take `conf` [n] (one entry per masked position of the current block) and return
indices into it. They reproduce the reference implementations' choices, ties included
(`torch.topk` order).
"""

from __future__ import annotations

import torch


def top_k(conf: torch.Tensor, k: int) -> torch.Tensor:
    """LLaDA's rule: the k most confident positions."""
    return torch.topk(conf, k=min(k, conf.numel())).indices


def above_threshold(conf: torch.Tensor, threshold: float, limit: int | None = None) -> torch.Tensor:
    """Fast-dLLM's parallel rule: the most confident position, plus every other position
    whose confidence is at least `threshold`; with `limit`, only among the `limit` most
    confident (Fast-dLLM's whole-sequence Dream rule: a step's quota)."""
    k = conf.numel() if limit is None else min(limit, conf.numel())
    order = torch.topk(conf, k=k).indices
    keep = conf[order] >= threshold
    keep[:1] = True
    return order[keep]


def factor_rule(conf: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM's factor rule: walk the confidences in descending order and accept rank n
    (1-based) while conf_n >= 1 - factor / (n + 1); the first is always accepted.

    Reproduces the reference's bookkeeping exactly, including its quirk that a walk which
    stops at the last rank still accepts every position.
    """
    n = conf.numel()
    sorted_conf = torch.sort(conf, descending=True).values.tolist()
    count = n - 1
    for i in range(n):
        threshold = -1.0 if i == 0 else 1.0 - factor / (i + 2)
        if sorted_conf[i] < threshold:
            count = i
            break
    if count in (0, n - 1):
        count += 1
    return torch.topk(conf, k=count).indices
