"""Dream's diffusion_generate step rules, per block, and Fast-dLLM's block sampler on top.

Step i of a block (of `steps` per block) moves from timestep t = ts[i] to s = ts[i+1] on
ts = linspace(1, eps, steps + 1). It commits n = int(#mask * (1 - s/t)) positions (all of them
at the last step), picked by the algorithm:
- `origin`: each masked position independently, with probability 1 - s/t;
- `maskgit_plus` / `topk_margin` / `entropy`: the top-n by top-1 probability, top-1 minus
  top-2 probability, or negative entropy; with `alg_temp`, n positions drawn without
  replacement from softmax(confidence / alg_temp);
- `confidence_threshold` (Fast-dLLM): the most confident position plus every other one at or
  above the threshold. Asked for by name (`alg`) without a cache, as Fast-dLLM's
  whole-sequence `generation_utils.py` (`ResolvedParams.threshold_quota`): only among the
  step's quota of most confident positions, the quota being the block's linear schedule for
  this step plus what earlier steps left uncommitted (`Sequence.quota`); from the last
  scheduled step on the quota is every masked position, and steps are added until none is
  left, so such a block may take more than its share of `steps` (at most one forward per
  position). Otherwise (a cache, or a plain `threshold`: the rule every family has) as
  Fast-dLLM's block sampler, without a quota; there `steps` stays an upper bound, so the
  block's last step commits the rest.
With a cache, step 0 is Fast-dLLM's refresh forward, which commits only the block's first
token (`Sequence.positions_to_decide`). The count is computed in float32 tensors exactly as
the reference does, since int() truncation turns rounding into a different count.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from dlm.engine.decoding.commit import above_threshold, top_k
from dlm.engine.params import ResolvedParams
from dlm.kernels.token_stats import TokenStats


@lru_cache(maxsize=64)
def timesteps(steps: int, eps: float) -> torch.Tensor:
    return torch.linspace(1, eps, steps + 1)


def transfer_probability(i: int, steps: int, eps: float) -> torch.Tensor:
    """1 - s/t for step i (float32), 1 at the last step."""
    if i >= steps - 1:
        return torch.tensor(1.0)
    ts = timesteps(steps, eps)
    return 1 - ts[i + 1] / ts[i]


def transfer_count(num_masked: int, i: int, steps: int, eps: float) -> int:
    """int(#mask * (1 - s/t)), every remaining position at the last step."""
    if i >= steps - 1:
        return num_masked
    return int(torch.tensor(num_masked) / 1 * transfer_probability(i, steps, eps))


def confidence(alg: str, stats: TokenStats) -> torch.Tensor:
    """Per-position score the ranking algorithms sort by (higher = commit first)."""
    if alg == "topk_margin":
        assert stats.margin is not None
        return stats.margin
    if alg == "entropy":
        assert stats.entropy is not None
        return -stats.entropy
    return stats.prob


def choose(
    params: ResolvedParams,
    step: int,
    stats: TokenStats,
    generator: torch.Generator | None,
    quota: Callable[[], int],
) -> torch.Tensor:
    """Indices into the decided positions to commit at block step `step` (>= 1 with a cache);
    `quota()`: what the schedule grants this step, carried-over slots included (the
    `confidence_threshold` rule without a cache; counted only for that rule)."""
    alg, n, device = params.alg, stats.prob.numel(), stats.prob.device
    assert alg is not None
    steps = params.steps_per_block
    if alg == "confidence_threshold":
        assert params.threshold is not None
        if params.threshold_quota:
            return above_threshold(stats.prob.cpu(), params.threshold, limit=quota())
        if step >= steps - 1:  # the block's share of the steps is spent: commit the rest
            return torch.arange(n)
        return above_threshold(stats.prob.cpu(), params.threshold)
    if alg == "origin":
        draw = torch.rand(n, device=device, generator=generator).cpu()
        return (draw < transfer_probability(step, steps, params.eps)).nonzero()[:, 0]
    k = transfer_count(n, step, steps, params.eps)
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    conf = confidence(alg, stats)
    if params.alg_temp:
        weights = torch.softmax(conf / params.alg_temp, dim=0)
        return torch.multinomial(weights, k, generator=generator).cpu()
    return top_k(conf.cpu(), k)
