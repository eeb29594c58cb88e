"""Triton twin of `dlm/kernels/moe.py`: grouped GEMMs over expert-sorted tokens.

The (token, slot) pairs, sorted by expert, are laid out in tiles of BLOCK_M rows that each
belong to one expert (each expert's group padded to a whole tile; pad rows are masked).
Kernel 1 gathers a tile's token rows, multiplies them with that expert's gate and up rows
and writes SwiGLU(gate, up); kernel 2 multiplies that with the expert's down projection
and scales by the routing weight; the K slots of a token are summed in fp32 afterwards
(deterministic, no atomics). Tile -> expert is found by a search over the padded offsets,
so nothing waits on the device for the group sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlm.kernels.moe import sort_by_expert
from dlm.kernels.triton_support import round_to, upcast_dot


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    experts_ptr,
    act_ptr,
    NP,
    K,
    D,
    F,
    E,
    sx,
    sw_e,
    sw_f,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = f < F
    e = tl.load(experts_ptr + tile)
    pair = tl.load(ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pair < NP
    token = tl.where(ok, pair // K, 0)
    e_safe = tl.minimum(e, E - 1)
    d_end = tl.where(e < E, D, 0)  # held elsewhere (e == E) or past the end: zeros
    acc_g = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
    w_base = w_ptr + e_safe * sw_e
    for d0 in range(0, d_end, BLOCK_K):
        dd = d0 + tl.arange(0, BLOCK_K)
        d_ok = dd < D
        a = tl.load(x_ptr + token[:, None] * sx + dd[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        wmask = f_ok[None, :] & d_ok[:, None]
        wg = tl.load(w_base + f[None, :] * sw_f + dd[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (F + f)[None, :] * sw_f + dd[:, None], mask=wmask, other=0.0)
        if UPCAST:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
        acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
    dtype = act_ptr.dtype.element_ty
    g = round_to(acc_g, dtype).to(tl.float32)
    u = round_to(acc_u, dtype).to(tl.float32)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + pair[:, None] * F + f[None, :], round_to(act, dtype), mask=ok[:, None] & f_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w_ptr,
    ids_ptr,
    experts_ptr,
    weights_ptr,
    out_ptr,
    NP,
    D,
    F,
    E,
    sw_e,
    sw_d,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    e = tl.load(experts_ptr + tile)
    pair = tl.load(ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pair < NP
    pair_safe = tl.where(ok, pair, 0)
    w_base = w_ptr + tl.minimum(e, E - 1) * sw_e
    f_end = tl.where(e < E, F, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for f0 in range(0, f_end, BLOCK_K):
        ff = f0 + tl.arange(0, BLOCK_K)
        f_ok = ff < F
        a = tl.load(act_ptr + pair_safe[:, None] * F + ff[None, :], mask=ok[:, None] & f_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :] * sw_d + ff[:, None], mask=n_ok[None, :] & f_ok[:, None], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    y = round_to(acc, act_ptr.dtype.element_ty).to(tl.float32)
    y = y * tl.load(weights_ptr + pair_safe, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * D + n[None, :], y, mask=ok[:, None] & n_ok[None, :])


def expert_tiles(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, exact: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids laid out in expert tiles, padded with NP; the expert of each tile, E = none).

    Pairs of experts held elsewhere (id E) get tiles of their own with expert E: the
    kernels do no arithmetic there and write zeros. On a GPU (`exact=False`) the tile
    count is an upper bound (every group's padding at its worst), so its size is known
    without reading the group sizes back from the device; the extra tiles hold only pad
    rows. Where reading back is free (CPU tensors, Triton's interpreter, which pays per
    program) the count is exact."""
    groups = sort_by_expert(topk_ids, num_experts)
    pairs = groups.order.numel()
    padded = (groups.counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    tiles = int(padded_end[-1]) // block_m if exact else triton.cdiv(pairs, block_m) + num_experts + 1
    ids = torch.full((tiles * block_m,), pairs, dtype=torch.long, device=topk_ids.device)
    expert_of = topk_ids.reshape(-1)[groups.order]
    rank = torch.arange(pairs, device=topk_ids.device) - groups.starts[expert_of]
    ids[padded_end[expert_of] - padded[expert_of] + rank] = groups.order
    tile_start = torch.arange(tiles, device=topk_ids.device) * block_m
    experts = torch.searchsorted(padded_end, tile_start, right=True)
    return ids, experts


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `fused_moe_torch`."""
    t, k = topk_ids.shape
    e, two_f, d = w13.shape
    f = two_f // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    block_m = 16 if t * k <= 1024 else 64
    ids, experts = expert_tiles(topk_ids, e, block_m, exact=x.device.type != "cuda")
    act = torch.empty((t * k, f), dtype=x.dtype, device=x.device)
    out = torch.empty((t * k, d), dtype=torch.float32, device=x.device)
    if t * k == 0:
        return torch.zeros_like(x)
    tiles = experts.numel()
    upcast = upcast_dot(x.dtype)
    _gate_up_kernel[(tiles, triton.cdiv(f, 64))](
        x,
        w13,
        ids,
        experts,
        act,
        t * k,
        k,
        d,
        f,
        e,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        UPCAST=upcast,
        BLOCK_M=block_m,
        BLOCK_F=64,
        BLOCK_K=64,
    )
    _down_kernel[(tiles, triton.cdiv(d, 64))](
        act,
        w2,
        ids,
        experts,
        topk_weights.reshape(-1).contiguous(),
        out,
        t * k,
        d,
        f,
        e,
        w2.stride(0),
        w2.stride(1),
        UPCAST=upcast,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=64,
    )
    return out.view(t, k, d).sum(1).to(x.dtype)
