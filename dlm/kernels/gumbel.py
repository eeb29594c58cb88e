"""Counter-based uniform noise for Gumbel-max sampling, identical in torch and in Triton.

A uniform for (seed, row, vocab id) is a pure function of those three integers, so the
chunked torch path, the Triton kernel (any tiling, any vocab split) and a tensor-parallel
vocab shard all draw the same noise for the same token: seeded sampling gives the same ids
whichever backend runs. The mixer is MurmurHash3's 32-bit finaliser; 53 bits from two
words give a float64 uniform strictly inside (0, 1). `dlm/kernels/token_stats_triton.py`
holds the Triton transcription of `uniform53`.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
WORD_SALT_1, WORD_SALT_2 = 0x68BC21EB, 0x02E5BE93


def _mul32_(h: torch.Tensor, c: int) -> torch.Tensor:
    """h = (h * c) mod 2**32 in place, for int64 h in [0, 2**32), without overflowing int64."""
    high = h * (c >> 16)
    high &= 0xFFFF
    high <<= 16
    h *= c & 0xFFFF
    h += high
    h &= MASK32
    return h


def fmix32_(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser, in place (the noise for a whole chunk is large)."""
    h ^= h >> 16
    _mul32_(h, FMIX_C1)
    h ^= h >> 13
    _mul32_(h, FMIX_C2)
    h ^= h >> 16
    return h


def uniform53(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1) for int64 `rows` x `cols` (broadcast), keyed by `seed`."""
    s = fmix32_(torch.tensor(seed & MASK32, device=rows.device))
    key = fmix32_(cols ^ fmix32_((rows + s) & MASK32))
    lo = fmix32_((key + WORD_SALT_2) & MASK32)
    lo >>= 5  # 27 bits
    key ^= WORD_SALT_1
    hi = fmix32_(key)
    hi >>= 6  # 26 bits
    hi *= 2**27
    hi += lo
    u = hi.to(torch.float64)
    u += 0.5
    u *= 2.0**-53
    return u


def draw_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """One 31-bit seed per call, from `generator` (or torch's default one)."""
    gen_device = generator.device if generator is not None else device
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=gen_device).item())
