"""Dream's token sampler: temperature, top-p and top-k change the distribution itself.

Dream's `sample_tokens` filters the tempered logits and renormalises, and its confidences
(probability, margin, entropy) are those of the filtered distribution, so they cannot come
from the plain LM-head statistics. This path materialises [positions, vocab] logits, but only
for the positions being decided; greedy unfiltered decoding never comes here.
"""

from __future__ import annotations

import torch

from dlm.kernels.token_stats import TokenStats


def filter_logits(logits: torch.Tensor, top_p: float | None, top_k: int | None) -> torch.Tensor:
    """Nucleus then top-k filtering as Dream applies them (removed entries get the dtype's min)."""
    low = torch.finfo(logits.dtype).min
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cumulative > top_p
        remove[..., 1:] = remove[..., :-1].clone()  # keep the token that crosses top_p
        remove[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), low)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, low)
    return logits


def filtered_stats(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    generator: torch.Generator | None,
    exclude_token: int | None = None,
) -> TokenStats:
    """logits [N, V] -> the sampled (or most likely) token and the filtered distribution's
    probability of it, entropy and top-2 margin, in float64. `exclude_token` is never chosen."""
    logits = logits.float()
    if exclude_token is not None:  # before filtering, so the kept set never empties
        logits = logits.clone()
        logits[:, exclude_token] = float("-inf")
    if temperature > 0:
        logits = logits / temperature
    probs = torch.softmax(filter_logits(logits, top_p, top_k).to(torch.float64), dim=-1)
    if temperature > 0:
        token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        prob = probs.gather(1, token[:, None])[:, 0]
    else:
        prob, token = probs.max(dim=-1)
    entropy = -(probs * torch.log(probs.clamp_min(1e-300))).sum(-1)
    top = probs.topk(min(2, probs.shape[-1]), dim=-1).values
    margin = top[:, 0] - (top[:, 1] if top.shape[1] > 1 else 0)
    return TokenStats(token, prob, entropy, margin)
