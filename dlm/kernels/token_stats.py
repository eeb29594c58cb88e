"""LM head + softmax statistics at the positions being decided, chunked over the vocabulary.

A denoising step needs, per decided position, the chosen token and a few scalars of the
softmax (its probability, entropy, top-2 margin), not the [positions, vocab] logits. This
computes them chunk by chunk with an online log-sum-exp, so peak memory is
[positions, chunk] whatever the vocabulary size. Logits are rounded to the weight's dtype
(as the reference models' LM head produces them), exponentials are taken in fp32 (LLaDA's
reference softmax precision) and accumulated in float64; Gumbel sampling noise is float64.

A vocabulary range (a chunk, a Triton program's split, a tensor-parallel shard) reduces to a
`VocabPartial`; partials of disjoint ranges combine exactly, which is how the Triton kernel
splits the vocabulary across programs and how tensor-parallel vocabulary shards merge across
devices (`VocabShard`: each device reduces its shard to one partial, the partials are gathered).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from dlm.kernels.gumbel import draw_seed, uniform53

DEFAULT_CHUNK = 16384


@dataclass
class TokenStats:
    token: torch.Tensor  # [N] long: argmax of the logits (Gumbel-perturbed when sampling)
    prob: torch.Tensor  # [N] float64: softmax probability of `token` (unperturbed, T-free)
    entropy: torch.Tensor | None  # [N] float64, when asked for
    margin: torch.Tensor | None  # [N] float64: p(top1) - p(top2), when asked for


@dataclass
class VocabPartial:
    """Softmax statistics of P disjoint vocabulary ranges for N rows (every field [P, N, ...])."""

    max_logit: torch.Tensor  # float32
    sum_exp: torch.Tensor  # float64: sum of exp(logit - max_logit)
    sum_exp_logit: torch.Tensor | None  # float64: sum of exp(logit - max_logit) * logit
    top2: torch.Tensor | None  # float32 [P, N, 2]: the two largest logits
    best_score: torch.Tensor  # float64: logit, or logit / T + Gumbel noise when sampling
    best_token: torch.Tensor  # long: global vocab id of best_score
    best_logit: torch.Tensor  # float32: the logit of best_token

    @staticmethod
    def cat(parts: list[VocabPartial]) -> VocabPartial:
        """Stack partials of disjoint ranges (in vocabulary order) for `combine`."""
        values: dict[str, Any] = {}
        for f in fields(VocabPartial):
            items = [getattr(p, f.name) for p in parts]
            values[f.name] = None if items[0] is None else torch.cat(items)
        return VocabPartial(**values)


def merge(part: VocabPartial) -> VocabPartial:
    """Merge the P ranges of `part` into one (P = 1): the exact log-sum-exp merge.

    Merging is associative up to float64 rounding, so partials may be merged in stages
    (a device's chunks or Triton splits, then the devices' shards)."""
    f64 = torch.float64
    m = part.max_logit.max(dim=0).values
    scale = torch.exp((part.max_logit - m).to(f64))
    s = (part.sum_exp * scale).sum(0)
    # argmax returns the first maximal index: the lowest vocab id wins ties, like torch.argmax.
    which = part.best_score.argmax(dim=0, keepdim=True)
    t = None if part.sum_exp_logit is None else (part.sum_exp_logit * scale).sum(0)[None]
    top2 = None
    if part.top2 is not None:
        top2 = part.top2.permute(1, 0, 2).reshape(m.shape[0], -1).topk(2, dim=-1).values[None]
    return VocabPartial(
        m[None],
        s[None],
        t,
        top2,
        part.best_score.gather(0, which),
        part.best_token.gather(0, which),
        part.best_logit.gather(0, which),
    )


def combine(part: VocabPartial) -> TokenStats:
    """Merge the P ranges of `part` and finish the statistics."""
    f64 = torch.float64
    one = merge(part)
    m, s, best_logit = one.max_logit[0].to(f64), one.sum_exp[0], one.best_logit[0].to(f64)
    prob = torch.exp(best_logit - m) / s
    entropy = None
    if one.sum_exp_logit is not None:
        entropy = torch.log(s) + m - one.sum_exp_logit[0] / s
    margin = None
    if one.top2 is not None:
        top2 = one.top2[0].to(f64)
        margin = (torch.exp(top2[:, 0] - m) - torch.exp(top2[:, 1] - m)) / s
    return TokenStats(one.best_token[0], prob, entropy, margin)


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary range this device's LM-head weight holds when the vocabulary is split
    across devices (tensor parallelism): ids [start, start + weight rows). `gather` takes
    this device's merged partial (P = 1) and returns every device's, in vocabulary order
    (P = devices); only these few scalars per row cross devices, never logits."""

    start: int
    size: int  # the whole vocabulary
    gather: Callable[[VocabPartial], VocabPartial]


def token_stats_partial_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    want_entropy: bool = False,
    want_margin: bool = False,
    exclude_token: int | None = None,
    vocab_start: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
) -> VocabPartial:
    """Statistics of the vocabulary range `weight` covers (ids vocab_start + row), P = 1.
    `exclude_token` is a global vocab id (it may lie outside this range)."""
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
    rows = torch.arange(n, device=device)[:, None]
    for start in range(0, vocab, chunk_size):
        logits = (hidden @ weight[start : start + chunk_size].T).float()
        chunk_max, chunk_argmax = logits.max(dim=-1)
        new_m = torch.maximum(m, chunk_max)
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
            cols = torch.arange(logits.shape[1], device=device)[None, :] + (vocab_start + start)
            u = uniform53(seed, rows, cols)
            score = logits.to(f64) / temperature - torch.log(-torch.log(u))
        else:
            score = None
        excluded = None if exclude_token is None else exclude_token - vocab_start - start
        if excluded is not None and 0 <= excluded < logits.shape[1]:
            score = logits.to(f64) if score is None else score  # a fresh tensor either way
            score[:, excluded] = float("-inf")
        if score is None:
            chunk_best, chunk_idx = chunk_max.to(f64), chunk_argmax
        else:
            chunk_best, chunk_idx = score.max(dim=-1)
        better = chunk_best > best_score  # strict: the first maximal index wins, like argmax
        best_score = torch.where(better, chunk_best, best_score)
        best_token = torch.where(better, chunk_idx + (vocab_start + start), best_token)
        best_logit = torch.where(better, logits.gather(1, chunk_idx[:, None])[:, 0], best_logit)
    return VocabPartial(
        m[None],
        s[None],
        None if t is None else t[None],
        None if top2 is None else top2[None],
        best_score[None],
        best_token[None],
        best_logit[None],
    )


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
    """hidden [N, d] (final-normed), weight [V, d] (LM head).

    With temperature > 0 the token is argmax(logits / T + Gumbel noise), i.e. a sample from
    softmax(logits / T); one seed per call is drawn from `generator` and the noise of each
    (row, token) derives from it (`dlm.kernels.gumbel`).
    `exclude_token` (the MASK id) is never chosen, though it keeps its share of the softmax:
    committing MASK would leave the position undecided forever, and the probabilities stay
    the model's.
    """
    seed = draw_seed(generator, hidden.device) if temperature > 0 else 0
    return combine(
        token_stats_partial_torch(
            hidden,
            weight,
            temperature=temperature,
            seed=seed,
            want_entropy=want_entropy,
            want_margin=want_margin,
            exclude_token=exclude_token,
            chunk_size=chunk_size,
        )
    )


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
    """The straightforward path (full [N, V] logits and softmax): the test oracle and the
    benchmark baseline. Same noise as the chunked paths, materialised for every token."""
    logits = (hidden @ weight.T).to(torch.float64)
    p = torch.softmax(logits, dim=-1)
    score = logits
    if temperature > 0:
        seed = draw_seed(generator, hidden.device)
        rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
        cols = torch.arange(logits.shape[1], device=logits.device)[None, :]
        score = logits / temperature - torch.log(-torch.log(uniform53(seed, rows, cols)))
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
