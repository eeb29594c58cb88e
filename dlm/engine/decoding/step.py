"""One denoising decision for one sequence: which positions to commit, and to what.

Two families of rules: LLaDA's `generate()` (linear schedule, threshold, factor, random
remasking) and Dream's `diffusion_generate` (dlm/engine/decoding/dream.py). This module picks the
statistics each needs from the LM head and applies the rule.
"""

from __future__ import annotations

import torch

from dlm.engine.decoding import dream
from dlm.engine.decoding.commit import above_threshold, factor_rule, top_k
from dlm.engine.decoding.sampling import filtered_stats
from dlm.engine.layers.linear import gather_logits
from dlm.engine.params import ResolvedParams
from dlm.engine.runtime.request import RequestState
from dlm.engine.runtime.sequence import Sequence
from dlm.kernels import dispatch
from dlm.kernels.token_stats import TokenStats, VocabShard


def token_stats(
    seq: Sequence,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shard: VocabShard | None = None,
    positions: torch.Tensor | None = None,
) -> TokenStats:
    """LM head + the softmax statistics `seq`'s rule needs, for hidden rows [N, d] (the
    canvas `positions` being decided). The MASK token is never proposed: committing it
    would leave the position masked forever (the references loop or leave MASKs in the
    output there; real checkpoints never rank it first). `shard`: `weight` is this rank's
    vocabulary range (tensor parallelism). A restricted request (a response format, banned
    stop ids) is decided from its restricted distribution (`restricted_stats`)."""
    p, mask = seq.params, seq.mask_id
    restricted = restricted_stats(seq, hidden, weight, shard, positions, exclude_token=mask)
    if restricted is not None:
        return restricted
    if seq.sampler != "dream":
        return dispatch.token_stats(
            hidden, weight, temperature=p.temperature, generator=seq.generator, exclude_token=mask, shard=shard
        )
    if p.temperature > 0 or p.top_p is not None or p.top_k is not None:
        # Top-p / top-k filtering needs the sorted distribution: the decided rows' logits
        # (gathered over the vocabulary shards under tensor parallelism).
        logits = hidden @ weight.T if shard is None else gather_logits(hidden @ weight.T, shard.size)
        return filtered_stats(
            logits, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, generator=seq.generator, exclude_token=mask
        )
    return dispatch.token_stats(
        hidden,
        weight,
        want_entropy=p.alg == "entropy",
        want_margin=p.alg == "topk_margin",
        exclude_token=mask,
        shard=shard,
    )


def restricted_stats(
    seq: RequestState,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shard: VocabShard | None,
    positions: torch.Tensor | None,
    exclude_token: int | None,
) -> TokenStats | None:
    """The statistics of the distribution the decided `positions` are restricted to, or None
    when nothing restricts them (the LM-head kernel's path): with a response format, each
    row's slot tokens (dlm/engine/decoding/constrain.py); with `ignore_eos` or `min_tokens`,
    no banned stop id (`RequestState.banned`). Banned tokens get no probability (renormalised,
    as vLLM's logits processors do). Only the decided rows' logits are materialised, never
    the whole canvas's."""
    if positions is None:
        return None
    constraint = seq.constraint
    banned = seq.banned(positions - seq.prompt_length)
    if constraint is None and banned is None:
        return None
    logits = hidden @ weight.T if shard is None else gather_logits(hidden @ weight.T, shard.size)
    logits = logits.float()
    if constraint is not None:
        allowed = constraint.allowed(seq.canvas, positions.cpu()).to(logits.device)
        logits = logits.masked_fill(~allowed[:, : logits.shape[-1]], float("-inf"))
    if banned is not None:
        ids, ban = banned
        columns = torch.tensor(ids, device=logits.device)
        logits[:, columns] = logits[:, columns].masked_fill(ban.to(logits.device), float("-inf"))
    p = seq.params
    return filtered_stats(
        logits,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        generator=seq.generator,
        exclude_token=exclude_token,
    )


def confidence(params: ResolvedParams, stats: TokenStats, generator: torch.Generator | None) -> torch.Tensor:
    """Per-position confidence used to rank commits ('random' remasking ignores the model)."""
    if params.remasking == "random":
        return torch.rand(stats.prob.shape, dtype=torch.float64, device=stats.prob.device, generator=generator)
    return stats.prob


def decide(seq: Sequence, positions: torch.Tensor, stats: TokenStats) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n] (`seq.positions_to_decide()`), stats for them. Returns (positions,
    tokens) to commit."""
    params, step = seq.params, seq.step_in_block
    if seq.sampler == "dream":
        if params.cache != "none" and step == 0:
            chosen = torch.zeros(1, dtype=torch.long)  # the refresh commits the block's first token
        else:
            chosen = dream.choose(params, step, stats, seq.generator, seq.quota)
    else:
        chosen = llada_rule(params, step, seq.schedule, confidence(params, stats, seq.generator).cpu())
    if seq.constraint is not None and chosen.numel() == 0 and positions.numel() > 0:
        # A response format's slots are written left to right, so a step commits at least
        # one value token whatever Dream's timestep rule says: the forwards stay bounded by
        # the slots' tokens (`ResolvedParams.max_forwards`).
        chosen = top_k(stats.prob.cpu(), 1)
    require_progress(seq, positions, chosen)
    return positions[chosen], stats.token.cpu()[chosen]


def llada_rule(params: ResolvedParams, step: int, schedule: list[int], conf: torch.Tensor) -> torch.Tensor:
    """Indices into `conf` that LLaDA's rules commit at step `step` of a block (the schedule,
    threshold or factor rule; the last step of the block's share commits the rest)."""
    if step >= params.steps_per_block - 1:
        return torch.arange(conf.numel())
    if params.threshold is not None:
        return above_threshold(conf, params.threshold)
    if params.factor is not None:
        return factor_rule(conf, params.factor)
    return top_k(conf, schedule[step])


def require_progress(seq: Sequence, positions: torch.Tensor, chosen: torch.Tensor) -> None:
    """Fail loudly instead of spinning: a block must finish in a bounded number of steps.

    LLaDA's rules commit at least one position per step (the schedule sums to the block's
    masks, the threshold and factor rules keep the most confident one) and the last step of
    the block's share commits the rest; Dream's timestep
    rules may commit nothing before the block's last scheduled step, but from then on commit
    every remaining position. A step that commits nothing where its rule promises a commit
    would repeat forever on the unchanged canvas."""
    if chosen.numel() > 0 or positions.numel() == 0:
        return
    if seq.sampler == "dream" and seq.step_in_block < seq.params.steps_per_block - 1:
        return
    raise RuntimeError(
        f"decoding invariant violated: step {seq.step_in_block} of block {seq.block} committed none of "
        f"its {positions.numel()} masked positions ({seq.sampler} rules); the block would never finish"
    )
