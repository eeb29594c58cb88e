"""One denoising decision for one sequence: which masked positions to commit, and to what."""
from __future__ import annotations

import torch

from engine.decoding.commit import above_threshold, factor_rule, top_k
from engine.params import GenerationParams
from kernels.token_stats import TokenStats


def confidence(params: GenerationParams, stats: TokenStats, generator: torch.Generator | None) -> torch.Tensor:
    """Per-position confidence used to rank commits ('random' remasking ignores the model)."""
    if params.remasking == "random":
        return torch.rand(
            stats.prob.shape, dtype=torch.float64, device=stats.prob.device, generator=generator
        )
    return stats.prob


def decide(
    params: GenerationParams,
    positions: torch.Tensor,
    stats: TokenStats,
    scheduled: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n] (masked, current block), stats for them; `scheduled` is the linear
    schedule's count for this step. Returns (positions, tokens) to commit."""
    conf = confidence(params, stats, generator).cpu()
    if params.threshold is not None:
        chosen = above_threshold(conf, params.threshold)
    elif params.factor is not None:
        chosen = factor_rule(conf, params.factor)
    else:
        chosen = top_k(conf, scheduled)
    return positions[chosen], stats.token.cpu()[chosen]
