"""Counter-based uniform noise for Gumbel-max sampling, identical in torch and in Triton.

A uniform for (seed, row, vocab id) is a pure function of those three integers, so the
chunked torch path, the Triton kernel (any tiling, any vocab split) and a tensor-parallel
vocab shard all draw the same noise for the same token: seeded sampling gives the same ids
whichever backend runs. The mixer is MurmurHash3's 32-bit finaliser; 53 bits from two
words give a float64 uniform strictly inside (0, 1). `kernels/token_stats_triton.py`
holds the Triton transcription of `uniform53`.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
WORD_SALT_1, WORD_SALT_2 = 0x68BC21EB, 0x02E5BE93


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for int64 h in [0, 2**32), without overflowing int64."""
    low = h * (c & 0xFFFF)
    high = ((h * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, FMIX_C2)
    return h ^ (h >> 16)


def uniform53(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1) for int64 `rows` x `cols` (broadcast), keyed by `seed`."""
    key = fmix32(cols ^ fmix32((rows + fmix32(torch.tensor(seed & MASK32, device=rows.device))) & MASK32))
    hi = fmix32(key ^ WORD_SALT_1) >> 6  # 26 bits
    lo = fmix32((key + WORD_SALT_2) & MASK32) >> 5  # 27 bits
    return ((hi * 2**27 + lo).to(torch.float64) + 0.5) * 2.0**-53


def draw_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """One 31-bit seed per call, from `generator` (or torch's default one)."""
    gen_device = generator.device if generator is not None else device
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=gen_device).item())
