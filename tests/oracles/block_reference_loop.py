"""Literal block-diffusion and AR loops for block-causal models: the test oracles.

No cache and no planning: every forward recomputes the whole prefix under the family's
mask, builds full [length, vocab] logits and a float64 softmax, and follows the published
loops step by step (SDAR `block_diffusion_generate`, dInfer's block decoder without cache,
openPangu's Fast-dLLM-v2-style loop with a causal context, shifted logits and sub-blocks;
Fast-dLLM v2's own, on the absolute grid with a block-causal context, stopping mid-block).
The engine's cached, batched, LM-head-at-decided-rows path must give the same ids.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from dlm.engine.decoding.block_diffusion import BlockRules, choose
from dlm.engine.decoding.schedule import linear_schedule
from dlm.engine.params import GenerationParams
from dlm.engine.runtime.block_batch import BlockBatch


@torch.inference_mode()
def masked_logits(model: torch.nn.Module, x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """x [L] ids, groups [L] -> logits [L, V] with query i seeing key j iff groups[j] <= groups[i]."""
    positions = torch.arange(len(x))[None]
    hidden = model(BlockBatch(x[None], positions, groups[None], positions))
    return (hidden @ model.lm_head_weight.T)[0]


def _groups(length: int, block_start: int, block_length: int, causal_context: bool) -> torch.Tensor:
    pos = torch.arange(length)
    context = pos if causal_context else pos // block_length * block_length
    return torch.where(pos < block_start, context, torch.full_like(pos, block_start))


def _stopped(x: torch.Tensor, start: int, end: int, rules: BlockRules, pending: torch.Tensor, stops: set[int]) -> int:
    """Fast-dLLM v2's stop (`stop_mid_block`): the end of the output (after the first stop id
    in x[start:end]) once no undecided position precedes it; else 0."""
    if not rules.stop_mid_block or not stops:
        return 0
    hits = torch.isin(x[start:end], torch.tensor(sorted(stops))).nonzero()
    if len(hits) == 0:
        return 0
    eos = start + int(hits[0, 0])
    return 0 if bool(pending[start:eos].any()) else eos + 1


@torch.inference_mode()
def reference_block_generate(
    model: torch.nn.Module,
    prompt: list[int],
    params: GenerationParams,
    *,
    mask_id: int,
    eos_id: int | None,
    stop_ids: Collection[int] = (),
) -> tuple[list[int], int]:
    """Greedy block diffusion; `params` resolved. Decoding stops after a block that leaves a
    stop id (`eos_id` or one of `stop_ids`) in the generation, as SDAR's
    `stopping_criteria_idx`. Returns (generated ids, forwards)."""
    stops = set(stop_ids) | ({eos_id} if eos_id is not None else set())
    rules: BlockRules = model.config.block_rules
    b, gen, p = params.block_length, params.gen_length, len(prompt)
    assert b is not None and params.steps is not None
    if rules.aligned_grid:
        first, end = p // b * b, -(-(p + gen) // b) * b
    else:
        first, end = p, p + params.canvas_length  # whole blocks: the last one past the answer
    x = torch.full((end,), mask_id, dtype=torch.long)
    x[:p] = torch.tensor(prompt)
    # Positions still to decide: a committed MASK argmax (dInfer and SDAR commit it) settles
    # its position like any token, as the engine counts it.
    pending = x == mask_id
    unit = max(1, b // rules.sub_blocks)
    steps_per_unit = max(1, params.steps_per_block // max(1, b // unit))
    nfe = 0
    for s in range(first, end, b):
        e = s + b
        if rules.logit_shift and x[s] == mask_id:  # the block's first token: from the context
            logits = masked_logits(model, x[:s], _groups(s, s, b, rules.causal_context))
            nfe += 1
            x[s] = logits[s - 1].argmax()
            pending[s] = False
            if _stopped(x, max(p, s), e, rules, pending, stops):
                return x[p : s + 1].tolist(), nfe
        for lo in range(s, e, unit):
            hi = min(lo + unit, e)
            schedule = linear_schedule(unit, steps_per_unit)
            j = 0
            while bool(pending[lo:hi].any()):
                logits = masked_logits(model, x[:e], _groups(e, s, b, rules.causal_context))
                nfe += 1
                masked = pending[lo:hi].nonzero()[:, 0] + lo
                rows = logits[masked - rules.logit_shift].to(torch.float64)
                probs = torch.softmax(rows, dim=-1)
                tokens = rows.argmax(-1)
                conf = probs.gather(1, tokens[:, None])[:, 0]
                k = schedule[j] if j < len(schedule) else 1
                chosen = choose(params, rules, conf, tokens, k, mask_id)
                x[masked[chosen]] = tokens[chosen]
                pending[masked[chosen]] = False
                j += 1
                stop = _stopped(x, max(p, s), e, rules, pending, stops)
                if stop:
                    return x[p:stop].tolist(), nfe
        if any(stop in x[p:e] for stop in stops):
            return x[p:e].tolist(), nfe
    return x[p:end].tolist(), nfe


@torch.inference_mode()
def reference_ar_generate(
    model: torch.nn.Module,
    prompt: list[int],
    gen_length: int,
    *,
    mask_id: int,
    eos_id: int | None,
) -> list[int]:
    """Greedy left-to-right decoding with a causal mask and no cache. Shifted-logit models
    read the next token from the last row; the others from a MASK appended at its position."""
    shift = model.config.logits_shift
    x = list(prompt)
    for _ in range(gen_length):
        ids = torch.tensor(x if shift else x + [mask_id])
        logits = masked_logits(model, ids, torch.arange(len(ids)))
        x.append(int(logits[-1].argmax()))
        if x[-1] == eos_id:
            break
    return x[len(prompt) :]
