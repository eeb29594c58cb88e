"""The reference LLaDA / Fast-dLLM / Dream decoding loops, written as literally as possible.

Every step runs the model over the fed tokens (the whole canvas, or with Fast-dLLM's prefix /
dual cache the suffix / block), builds the full [batch, fed, vocab] logits and a softmax over
all of them, exactly as the authors' `generate()`, `generate_with_prefix_cache()`,
`generate_with_dual_cache()` and Dream's `diffusion_generate` (with Fast-dLLM's block sampler)
do. They are never used to serve: they are the oracles the engine is tested against (for
settings the shipped vectors do not cover) and the baselines `benchmarks/` times the engine
against. Caches go through dlm.engine.runtime.cache with one row, the same K/V the engine keeps.

`suffix`: infilling, the canvas is [prompt, MASK x gen_length, suffix] and the suffix is never
decided. `record`: filled with, per committed canvas position, the float64 log-softmax of the
logits row of the step that committed it (what the engine's logprobs must equal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlm.engine.decoding.commit import factor_rule
from dlm.engine.decoding.dream import transfer_count, transfer_probability
from dlm.engine.decoding.schedule import linear_schedule
from dlm.engine.runtime.batch import ForwardBatch
from dlm.engine.runtime.cache import BatchKV, KVCache, RowKV


@torch.inference_mode()
def full_logits(model: torch.nn.Module, x: torch.Tensor, first: int = 0, kv: RowKV | None = None) -> torch.Tensor:
    """[B, T] ids at positions first.. -> [B, T, V] logits, every row through the LM head;
    with `kv` (one row), against / into that cache."""
    b, length = x.shape
    rows = torch.arange(length, device=x.device).expand(b, length)
    batch = ForwardBatch(x, rows + first, None, rows, None if kv is None else BatchKV([kv], [length], length))
    return model(batch) @ model.lm_head_weight.T


def _cached_span(
    x: torch.Tensor, cache: str, kv: KVCache, step: int, start: int, end: int
) -> tuple[int, int, RowKV | None]:
    """Fast-dLLM's feeding: the whole canvas at a block's first step (refresh), then the
    suffix (prefix cache) or the block (dual cache)."""
    length = x.shape[1]
    if cache == "none":
        return 0, length, None
    if step == 0:
        kv.keys, kv.values = [], []
        return 0, length, RowKV(kv, refresh=True, keep=start if cache == "prefix" else length)
    return start, length if cache == "prefix" else end, RowKV(kv, refresh=False, start=start)


@torch.inference_mode()
def reference_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int,
    steps: int,
    block_length: int,
    cfg_scale: float = 0.0,
    threshold: float | None = None,
    factor: float | None = None,
    cache: str = "none",
    suffix: torch.Tensor | None = None,
    record: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, int]:
    """Greedy (temperature 0, low-confidence remasking) decoding; returns (x, nfe)."""
    b, p = prompt.shape
    assert cache == "none" or (b == 1 and cfg_scale == 0), "cached reference loops are batch-1, no CFG"
    kv = KVCache()
    tail = 0 if suffix is None else suffix.shape[1]
    x = torch.full((b, p + gen_length + tail), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :p] = prompt
    if suffix is not None:
        x[:, p + gen_length :] = suffix
    prompt_index = x != mask_id
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks
    nfe = 0
    for blk in range(num_blocks):
        start, end = p + blk * block_length, p + (blk + 1) * block_length
        schedule = [linear_schedule(int(n), per_block) for n in (x[:, start:end] == mask_id).sum(1)]
        i = 0
        while (x[:, start:end] == mask_id).any():
            nfe += 1
            first, last, row = _cached_span(x, cache, kv, i, start, end)
            mask_index = x[:, first:last] == mask_id
            mask_index[:, end - first :] = False
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                logits, un_logits = full_logits(model, torch.cat([x, un_x])).chunk(2)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = full_logits(model, x[:, first:last], first, row)
            x0 = logits.argmax(-1)
            p_all = torch.softmax(logits.to(torch.float64), dim=-1)
            x0_p = p_all.gather(-1, x0[..., None])[..., 0]
            conf = torch.where(mask_index, x0_p, torch.tensor(float("-inf"), dtype=torch.float64))
            for j in range(b):
                masked = int(mask_index[j].sum())
                if masked == 0:
                    continue
                if factor is not None:
                    picks = factor_rule(conf[j][mask_index[j]], factor)
                    chosen = mask_index[j].nonzero()[:, 0][picks]
                else:
                    k = masked if threshold is not None else schedule[j][i]
                    order = torch.topk(conf[j], k=k).indices
                    chosen = (
                        order
                        if threshold is None
                        else order[torch.cat([torch.tensor([True]), conf[j][order[1:]] >= threshold])]
                    )
                x[j, chosen + first] = x0[j, chosen]
                if record is not None:
                    for c in chosen.tolist():
                        record[c + first] = torch.log_softmax(logits[j, c].to(torch.float64), dim=-1)
            i += 1
    return x, nfe


def _sample_tokens(logits: torch.Tensor, alg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's greedy sample_tokens: fp32 softmax over the whole vocabulary per row."""
    probs = torch.softmax(logits, dim=-1)
    confidence, x0 = probs.max(dim=-1)
    if alg == "topk_margin":
        top = torch.sort(probs, dim=-1, descending=True).values
        confidence = top[:, 0] - top[:, 1]
    elif alg == "entropy":
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


@torch.inference_mode()
def reference_dream_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int,
    steps: int,
    block_length: int,
    alg: str,
    threshold: float | None = None,
    alg_temp: float | None = None,
    eps: float = 1e-3,
    cache: str = "none",
    generator: torch.Generator | None = None,
    suffix: torch.Tensor | None = None,
    record: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, int]:
    """Dream's diffusion_generate at temperature 0 (one block when block_length ==
    gen_length; `confidence_threshold` is Fast-dLLM's whole-sequence rule there), and with a
    cache Fast-dLLM's block sampler, whose refresh forward commits the block's first token.
    Batch 1. Returns (x, nfe)."""
    p = prompt.shape[1]
    tail = [] if suffix is None else [suffix]
    x = torch.cat([prompt, torch.full((1, gen_length), mask_id, dtype=torch.long), *tail], dim=1)
    per_block = steps // (gen_length // block_length)
    kv, nfe = KVCache(), 0
    for start in range(p, p + gen_length, block_length):
        end = start + block_length
        if alg == "confidence_threshold" and cache == "none":
            assert threshold is not None
            nfe += _fastdllm_threshold_block(model, x, start, end, per_block, threshold, mask_id)
            continue
        i = 0
        while (x[:, start:end] == mask_id).any():
            nfe += 1
            first, last, row = _cached_span(x, cache, kv, i, start, end)
            logits = full_logits(model, x[:, first:last], first, row)
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # row i predicts token i+1
            if cache != "none" and i == 0:
                x[:, start] = _sample_tokens(logits[0], alg)[1][start]
                if record is not None:
                    record[start] = torch.log_softmax(logits[0, start].to(torch.float64), dim=-1)
                i += 1
                continue
            mask_index = x[:, first:last] == mask_id
            mask_index[:, end - first :] = False
            confidence, x0 = _sample_tokens(
                logits[mask_index], "maskgit_plus" if alg == "confidence_threshold" else alg
            )
            full = torch.full(mask_index.shape, -torch.inf, dtype=confidence.dtype)
            full[mask_index] = confidence
            fed = x[:, first:last]
            n = int(mask_index.sum())
            if alg == "confidence_threshold":
                conf, order = torch.topk(full, n)
                keep = torch.cat([torch.tensor([True]), conf[0, 1:] >= threshold])
                chosen = order[0, keep]
            elif alg == "origin":
                picks = torch.rand(n, generator=generator) < transfer_probability(i, per_block, eps)
                chosen = mask_index[0].nonzero()[:, 0][picks]
            else:
                k = transfer_count(n, i, per_block, eps)
                if alg_temp:
                    chosen = torch.multinomial(F.softmax(full[0] / alg_temp, dim=-1), k, generator=generator)
                else:
                    chosen = torch.topk(full[0], k).indices
            proposal = torch.full_like(fed, mask_id)
            proposal[mask_index] = x0
            fed[0, chosen] = proposal[0, chosen]
            if record is not None:
                for c in chosen.tolist():
                    record[c + first] = torch.log_softmax(logits[0, c].to(torch.float64), dim=-1)
            i += 1
    return x, nfe


def _fastdllm_threshold_block(
    model: torch.nn.Module, x: torch.Tensor, start: int, end: int, steps: int, threshold: float, mask_id: int
) -> int:
    """Fast-dLLM's whole-sequence `confidence_threshold` (dream/model/generation_utils.py) over
    the block [start, end) of `x` (one block = the reference): each step takes the top
    `#mask/steps + left` positions, commits the first and those >= threshold, and carries the
    rest over (`left`); a position below the threshold at the last step zeroes the per-step
    count and adds a step. Returns the forwards spent."""
    masks = int((x[:, start:end] == mask_id).sum())
    assert masks % steps == 0, "the reference needs the block's masks divisible by its steps"
    number_transfer_tokens, left_tokens_last_step = masks // steps, 0
    i = 0
    while i < steps:
        logits = full_logits(model, x)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_index = x == mask_id
        mask_index[:, end:] = False
        confidence, x0 = _sample_tokens(logits[mask_index], "maskgit_plus")
        proposal = torch.full_like(x, mask_id)
        proposal[mask_index] = x0
        full_confidence = torch.full(x.shape, -torch.inf, dtype=confidence.dtype)
        full_confidence[mask_index] = confidence
        current_transfer_tokens = number_transfer_tokens + left_tokens_last_step
        left_tokens_last_step = 0
        selected_confidence, select_index = torch.topk(full_confidence, current_transfer_tokens)
        transfer_index = torch.zeros_like(x, dtype=torch.bool)
        transfer_index[0, select_index[0]] = True
        for k in range(1, current_transfer_tokens):
            if selected_confidence[0, k] < threshold:
                if i < steps - 1:
                    left_tokens_last_step += 1
                else:
                    number_transfer_tokens = 0
                    steps += 1
                    left_tokens_last_step += 1
                transfer_index[0, select_index[0, k]] = False
        x[transfer_index] = proposal[transfer_index]
        i += 1
    return i
