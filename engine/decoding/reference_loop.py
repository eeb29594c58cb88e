"""The reference LLaDA / Fast-dLLM decoding loop, written as literally as possible.

Every step runs the model over the whole canvas, builds the full [batch, length, vocab]
logits and a float64 softmax over all of them, exactly as the authors' `generate()` does.
It is never used to serve: it is the oracle the engine is tested against (for settings the
shipped vectors do not cover, such as classifier-free guidance) and the baseline that
`benchmarks/decode_vs_reference.py` times the engine against.
"""
from __future__ import annotations

import torch

from engine.batch import ForwardBatch
from engine.decoding.commit import factor_rule
from engine.decoding.schedule import linear_schedule


@torch.inference_mode()
def full_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[B, L] ids -> [B, L, V] logits, every position through the LM head."""
    b, length = x.shape
    positions = torch.arange(length, device=x.device).expand(b, length)
    hidden = model(ForwardBatch(x, positions, None, positions))
    return hidden @ model.lm_head_weight.T


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
) -> tuple[torch.Tensor, int]:
    """Greedy (temperature 0, low-confidence remasking) decoding; returns (x, nfe)."""
    b, p = prompt.shape
    x = torch.full((b, p + gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :p] = prompt
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
            mask_index = x == mask_id
            mask_index[:, end:] = False
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                logits, un_logits = full_logits(model, torch.cat([x, un_x])).chunk(2)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = full_logits(model, x)
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
                    chosen = order if threshold is None else order[
                        torch.cat([torch.tensor([True]), conf[j][order[1:]] >= threshold])
                    ]
                x[j, chosen] = x0[j, chosen]
            i += 1
    return x, nfe
