"""LM head + softmax statistics at the positions being decided, chunked over the vocabulary.

A denoising step needs, per decided position, the chosen token and a few scalars of the
softmax (its probability, entropy, top-2 margin), not the [positions, vocab] logits. This
computes them chunk by chunk with an online log-sum-exp, so peak memory is
[positions, chunk] whatever the vocabulary size. Exponentials are taken in fp32 (LLaDA's
reference softmax precision) and accumulated in float64; Gumbel sampling noise is float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CHUNK = 16384


@dataclass
class TokenStats:
    token: torch.Tensor  # [N] long: argmax of the logits (Gumbel-perturbed when sampling)
    prob: torch.Tensor  # [N] float64: softmax probability of `token` (unperturbed, T-free)
    entropy: torch.Tensor | None  # [N] float64, when asked for
    margin: torch.Tensor | None  # [N] float64: p(top1) - p(top2), when asked for


def token_stats_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    want_entropy: bool = False,
    want_margin: bool = False,
    exclude_token: int | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> TokenStats:
    """hidden [N, d] (final-normed), weight [V, d] (LM head, or a vocab shard of it).

    With temperature > 0 the token is argmax(logits / T + Gumbel noise), i.e. a sample from
    softmax(logits / T); the noise is drawn chunk by chunk from `generator`.
    `exclude_token` (the MASK id) is never chosen, though it keeps its share of the softmax:
    committing MASK would leave the position undecided forever, and the probabilities stay
    the model's.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    f64 = torch.float64
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
    s = torch.zeros(n, dtype=f64, device=device)
    t = torch.zeros(n, dtype=f64, device=device) if want_entropy else None
    top2 = torch.full((n, 2), float("-inf"), dtype=torch.float32, device=device) if want_margin else None
    best_score = torch.full((n,), float("-inf"), dtype=f64, device=device)
    best_token = torch.zeros(n, dtype=torch.long, device=device)
    best_logit = torch.zeros(n, dtype=torch.float32, device=device)
    for start in range(0, vocab, chunk_size):
        logits = (hidden @ weight[start : start + chunk_size].T).float()
        new_m = torch.maximum(m, logits.max(dim=-1).values)
        scale = torch.exp((m - new_m).to(f64))
        # exp in fp32 (the precision of LLaDA's own softmax), sums accumulated in float64.
        e = torch.exp(logits - new_m[:, None])
        s = s * scale + e.sum(-1, dtype=f64)
        if t is not None:
            t = t * scale + (e * logits).sum(-1, dtype=f64)
        m = new_m
        if top2 is not None:
            k = min(2, logits.shape[1])
            top2 = torch.cat((top2, logits.topk(k, dim=-1).values), dim=-1).topk(2, dim=-1).values
        if temperature > 0:
            # Gumbel-max in float64: low-precision Gumbel noise measurably hurts MDM quality.
            u = torch.rand(logits.shape, dtype=f64, device=device, generator=generator)
            score = logits.to(f64) / temperature - torch.log(-torch.log(u))
        else:
            score = logits
        if exclude_token is not None and start <= exclude_token < start + logits.shape[1]:
            score = score.clone()
            score[:, exclude_token - start] = float("-inf")
        chunk_best, chunk_idx = score.max(dim=-1)
        chunk_best = chunk_best.to(f64)
        better = chunk_best > best_score  # strict: the first maximal index wins, like argmax
        best_score = torch.where(better, chunk_best, best_score)
        best_token = torch.where(better, chunk_idx + start, best_token)
        best_logit = torch.where(better, logits.gather(1, chunk_idx[:, None])[:, 0], best_logit)
    m, best_logit = m.to(f64), best_logit.to(f64)
    prob = torch.exp(best_logit - m) / s
    entropy = (torch.log(s) + m - t / s) if t is not None else None
    margin = None
    if top2 is not None:
        top2 = top2.to(f64)
        margin = (torch.exp(top2[:, 0] - m) - torch.exp(top2[:, 1] - m)) / s
    return TokenStats(best_token, prob, entropy, margin)


def token_stats_unfused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    want_entropy: bool = False,
    want_margin: bool = False,
    exclude_token: int | None = None,
) -> TokenStats:
    """The straightforward path (full [N, V] logits and softmax), kept as the test oracle."""
    logits = (hidden @ weight.T).to(torch.float64)
    p = torch.softmax(logits, dim=-1)
    score = logits
    if temperature > 0:
        u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        score = logits / temperature - torch.log(-torch.log(u))
    if exclude_token is not None:
        score = score.clone()
        score[:, exclude_token] = float("-inf")
    token = score.argmax(-1)
    prob = p.gather(1, token[:, None])[:, 0]
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1) if want_entropy else None
    margin = None
    if want_margin:
        top = p.topk(2, dim=-1).values
        margin = top[:, 0] - top[:, 1]
    return TokenStats(token, prob, entropy, margin)
