"""Triton twin of `dlm/kernels/token_stats.py`: LM head + softmax statistics in one kernel.

Grid: (row tiles, vocabulary splits). Each program multiplies its rows' hidden states with
the LM-head rows of its split tile by tile (never writing logits to memory), keeps the
online statistics of `token_stats_partial_torch` in registers and writes one
`VocabPartial` row per split; `combine` merges the splits. Splitting the vocabulary is what
keeps an accelerator busy with only ~32 decided positions per step. Numerics follow the
torch twin: logits rounded to the input dtype, exp in fp32, sums in float64, float64
Gumbel noise from the same counter-based hash (`dlm.kernels.gumbel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlm.kernels.gumbel import draw_seed
from dlm.kernels.token_stats import TokenStats, VocabPartial, combine
from dlm.kernels.triton_support import round_to, upcast_dot

DEFAULT_SPLIT = 2048  # vocabulary columns per program


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _uniform53(seed, rows, cols):
    """Transcription of `dlm.kernels.gumbel.uniform53` in uint32 arithmetic (wraps mod 2**32)."""
    s = _fmix32(seed.to(tl.uint32))
    key = _fmix32(cols.to(tl.uint32)[None, :] ^ _fmix32(rows.to(tl.uint32) + s)[:, None])
    hi = _fmix32(key ^ 0x68BC21EB) >> 6
    lo = _fmix32(key + 0x02E5BE93) >> 5
    return (hi.to(tl.float64) * 134217728.0 + lo.to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)


# An int argument equal to 1 would otherwise be specialised into a constexpr (no `.to`).
@triton.jit(do_not_specialize=["seed", "vocab_start", "exclude"])
def _token_stats_kernel(
    h_ptr,
    w_ptr,
    max_ptr,
    sum_ptr,
    sum_logit_ptr,
    top2_ptr,
    score_ptr,
    token_ptr,
    logit_ptr,
    N,
    V,
    D,
    stride_h,
    stride_w,
    split_size,
    vocab_start,
    temperature,
    seed,
    exclude,
    WANT_ENTROPY: tl.constexpr,
    WANT_MARGIN: tl.constexpr,
    SAMPLE: tl.constexpr,
    EXCLUDE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    lane = tl.arange(0, BLOCK_V)
    v_lo = split * split_size
    v_hi = tl.minimum(v_lo + split_size, V)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float64)
    t = tl.zeros([BLOCK_N], tl.float64)
    top1 = tl.full([BLOCK_N], float("-inf"), tl.float32)
    top2 = tl.full([BLOCK_N], float("-inf"), tl.float32)
    best_score = tl.full([BLOCK_N], float("-inf"), tl.float64)
    best_token = tl.zeros([BLOCK_N], tl.int32)
    best_logit = tl.zeros([BLOCK_N], tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + lane
        col_ok = cols < v_hi
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            d_ok = dd < D
            h = tl.load(h_ptr + rows[:, None] * stride_h + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :] * stride_w + dd[:, None], mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(h, w, acc, input_precision="ieee")
        # Round to the input dtype first: the logits the reference LM head would produce.
        logits = round_to(acc, h_ptr.dtype.element_ty).to(tl.float32)
        logits = tl.where(col_ok[None, :], logits, float("-inf"))
        tile_max = tl.max(logits, axis=1)
        new_m = tl.maximum(m, tile_max)
        scale = tl.exp((m - new_m).to(tl.float64))
        e = tl.exp(logits - new_m[:, None])
        s = s * scale + tl.sum(e.to(tl.float64), axis=1)
        if WANT_ENTROPY:
            el = e * tl.where(col_ok[None, :], logits, 0.0)  # e is 0 there; avoid 0 * -inf
            t = t * scale + tl.sum(el.to(tl.float64), axis=1)
        m = new_m
        if WANT_MARGIN:
            first = tl.argmax(logits, axis=1, tie_break_left=True)
            second = tl.max(tl.where(lane[None, :] == first[:, None], float("-inf"), logits), axis=1)
            top2 = tl.maximum(tl.minimum(top1, tile_max), tl.maximum(top2, second))
            top1 = tl.maximum(top1, tile_max)
        if SAMPLE:
            u = _uniform53(seed, rows, vocab_start + cols)
            score = logits.to(tl.float64) / temperature - tl.log(-tl.log(u))
            if EXCLUDE:  # never chosen; its logit still counts in the softmax above
                score = tl.where((vocab_start + cols == exclude)[None, :], float("-inf"), score)
            tile_best = tl.max(score, axis=1)
            tile_idx = tl.argmax(score, axis=1, tie_break_left=True)
        elif EXCLUDE:
            allowed = tl.where((vocab_start + cols == exclude)[None, :], float("-inf"), logits)
            tile_best = tl.max(allowed, axis=1).to(tl.float64)
            tile_idx = tl.argmax(allowed, axis=1, tie_break_left=True)
        else:
            tile_best = tile_max.to(tl.float64)
            tile_idx = tl.argmax(logits, axis=1, tie_break_left=True)
        better = tile_best > best_score  # strict: the lowest vocab id wins ties
        picked = tl.max(tl.where(lane[None, :] == tile_idx[:, None], logits, float("-inf")), axis=1)
        best_score = tl.where(better, tile_best, best_score)
        best_token = tl.where(better, vocab_start + v0 + tile_idx, best_token)
        best_logit = tl.where(better, picked, best_logit)
    out = split * N + rows
    tl.store(max_ptr + out, m, mask=row_ok)
    tl.store(sum_ptr + out, s, mask=row_ok)
    if WANT_ENTROPY:
        tl.store(sum_logit_ptr + out, t, mask=row_ok)
    if WANT_MARGIN:
        tl.store(top2_ptr + out * 2, top1, mask=row_ok)
        tl.store(top2_ptr + out * 2 + 1, top2, mask=row_ok)
    tl.store(score_ptr + out, best_score, mask=row_ok)
    tl.store(token_ptr + out, best_token.to(tl.int64), mask=row_ok)
    tl.store(logit_ptr + out, best_logit, mask=row_ok)


def token_stats_partial_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    want_entropy: bool = False,
    want_margin: bool = False,
    exclude_token: int | None = None,
    vocab_start: int = 0,
    chunk_size: int = DEFAULT_SPLIT,
) -> VocabPartial:
    """Same contract as `token_stats_partial_torch`; P = number of vocabulary splits
    (`chunk_size` columns each, rounded up to the tile width)."""
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n, d = hidden.shape
    vocab = weight.shape[0]
    block_n = 16 if n <= 16 else 32
    block_v, block_d = 128, 64
    split = triton.cdiv(max(chunk_size, 1), block_v) * block_v
    splits = triton.cdiv(vocab, split)
    device = hidden.device
    new = lambda dtype, *shape: torch.empty((splits, n, *shape), dtype=dtype, device=device)  # noqa: E731
    part = VocabPartial(
        max_logit=new(torch.float32),
        sum_exp=new(torch.float64),
        sum_exp_logit=new(torch.float64) if want_entropy else None,
        top2=new(torch.float32, 2) if want_margin else None,
        best_score=new(torch.float64),
        best_token=new(torch.long),
        best_logit=new(torch.float32),
    )
    if n == 0:
        return part
    unused = part.sum_exp
    grid = (triton.cdiv(n, block_n), splits)
    _token_stats_kernel[grid](
        hidden,
        weight,
        part.max_logit,
        part.sum_exp,
        part.sum_exp_logit if want_entropy else unused,
        part.top2 if want_margin else unused,
        part.best_score,
        part.best_token,
        part.best_logit,
        n,
        vocab,
        d,
        hidden.stride(0),
        weight.stride(0),
        split,
        vocab_start,
        float(temperature) if temperature > 0 else 1.0,
        int(seed),
        -1 if exclude_token is None else int(exclude_token),
        WANT_ENTROPY=want_entropy,
        WANT_MARGIN=want_margin,
        SAMPLE=temperature > 0,
        EXCLUDE=exclude_token is not None,
        UPCAST=upcast_dot(hidden.dtype),
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        BLOCK_D=block_d,
    )
    return part


def token_stats_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    want_entropy: bool = False,
    want_margin: bool = False,
    exclude_token: int | None = None,
    chunk_size: int = DEFAULT_SPLIT,
) -> TokenStats:
    """Same contract as `token_stats_torch` (same seed draw, so the same sampled ids)."""
    seed = draw_seed(generator, hidden.device) if temperature > 0 else 0
    return combine(
        token_stats_partial_triton(
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
