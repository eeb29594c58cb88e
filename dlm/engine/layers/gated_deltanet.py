"""Gated DeltaNet: the linear-attention mixer of the Qwen3.5/3.6 hybrid (and Clover).

Per value head the layer keeps a matrix state S [dk, dv] and, per token t,
    S <- exp(g_t) * S                                   (gated decay, g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T           (delta rule: write the correction)
    o_t = S^T q_t
with q, k L2-normalised and q scaled by dk^-1/2. Two exact forms of the same recurrence:
`recurrent_delta_rule` steps token by token (decode: one token, O(1) per token), and
`chunked_delta_rule` processes chunks of 64 tokens with matmuls (prefill): inside a chunk the
delta-rule writes form a unit lower-triangular system solved once per chunk, and only the
chunk boundaries are sequential. Both run in fp32 whatever the model dtype, because the
state accumulates over the whole context.

Before the recurrence, q/k/v pass through a short causal depthwise convolution whose last
K-1 input rows are the layer's "conv state"; after it, a gated RMSNorm (norm, then times
silu(z)) and the output projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.layers.linear import RowParallelLinear, mark_rows, split

CHUNK = 64


@dataclass
class LinearAttentionState:
    """One sequence's (or batch's) Gated-DeltaNet cache for one layer.

    conv: the last K-1 pre-convolution rows [B, conv_dim, K-1] (model dtype);
    recurrent: S per value head [B, Hv, dk, dv], fp32.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [B, T, C], weight [C, K], history [B, C, K-1] or None
    (zeros: the sequence starts here). Returns (y [B, T, C], the new history)."""
    b, t, c = x.shape
    k = weight.shape[-1]
    xt = x.transpose(1, 2)
    if history is None:
        history = xt.new_zeros(b, c, k - 1)
    full = torch.cat((history.to(xt.dtype), xt), dim=-1)
    y = F.conv1d(full, weight[:, None, :].to(xt.dtype), groups=c)
    return F.silu(y).transpose(1, 2), full[:, :, full.shape[-1] - (k - 1) :]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form. q/k [B, H, T, dk] (normalised, q scaled), v [B, H, T, dv],
    g/beta [B, H, T], state [B, H, dk, dv]; all fp32. Returns (o [B, H, T, dv], state)."""
    out = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        k_t = k[:, :, t]
        correction = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[..., :, None] * correction[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(out, dim=2), state


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form, same arguments and result as `recurrent_delta_rule`.

    Within a chunk with cumulative log-decay G_t and entry state S0, the written
    corrections u_t = beta_t (v_t - S_{t-1}'^T k_t) satisfy
        u_t + sum_{s<t} beta_t e^{G_t-G_s} (k_t.k_s) u_s = beta_t v_t - beta_t e^{G_t} S0^T k_t,
    a unit lower-triangular system; then o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t-G_s}
    (q_t.k_s) u_s and S_end = e^{G_C} S0 + sum_s e^{G_C-G_s} k_s u_s^T.
    Padding tokens get g = 0 and beta = 0, so they write nothing and do not decay S.
    """
    b, h, t, dk = k.shape
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    cum = g.cumsum(-1)  # G_t
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(chunk, dtype=q.dtype, device=q.device)
    # Solve once for the parts that do not depend on S0: u = U_v - W S0.
    u_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # includes s == t
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    end_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(n):
        u = u_v[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ u
        state = state * end_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return out.reshape(b, h, n * chunk, -1)[:, :, :t], state


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate): statistics and gate in fp32, as the reference."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """The mixer. `in_proj` packs the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and
    in_proj_a (rows in that order) so the four input projections are one matmul."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
    ) -> None:
        super().__init__()
        # Tensor parallelism splits the heads (value heads with the key heads they read).
        k0, k1 = split(num_k_heads, "linear-attention key heads")
        v0, v1 = split(num_v_heads, "linear-attention value heads")
        full_key_dim, full_value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        num_k_heads, num_v_heads = k1 - k0, v1 - v0
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.split = [self.conv_dim, self.value_dim, num_v_heads, num_v_heads]
        self.in_proj = nn.Linear(hidden_size, sum(self.split), bias=False)
        self.conv1d = nn.Module()  # holds `weight` [conv_dim, 1, K] under the checkpoint's name
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowParallelLinear(full_value_dim, hidden_size)
        # This rank's rows of q, k and v inside in_proj_qkv (and the conv channels).
        qkv = [
            (k0 * head_k_dim, k1 * head_k_dim),
            (full_key_dim + k0 * head_k_dim, full_key_dim + k1 * head_k_dim),
            (2 * full_key_dim + v0 * head_v_dim, 2 * full_key_dim + v1 * head_v_dim),
        ]
        heads = [(v0, v1)]
        mark_rows(self.in_proj.weight, [qkv, [(v0 * head_v_dim, v1 * head_v_dim)], heads, heads])
        mark_rows(self.conv1d.weight, [qkv])
        mark_rows(self.dt_bias, [heads])
        mark_rows(self.A_log, [heads])

    def empty_state(self, batch: int, dtype: torch.dtype, device: torch.device) -> LinearAttentionState:
        return LinearAttentionState(
            conv=torch.zeros(batch, self.conv_dim, self.conv_kernel - 1, dtype=dtype, device=device),
            recurrent=torch.zeros(
                batch, self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32, device=device
            ),
        )

    def forward(
        self, x: torch.Tensor, state: LinearAttentionState | None, chunked: bool | None = None
    ) -> tuple[torch.Tensor, LinearAttentionState]:
        """x [B, T, d]; `state` is the cache before these tokens (None: sequence start).
        Returns the output and the state after them; the caller decides whether to keep it
        (a commit) or drop it (a preview). `chunked` forces a form (default: chunked when
        T > 1, recurrent for single-token decode)."""
        b, t, _ = x.shape
        mixed, z, b_proj, a_proj = self.in_proj(x).split(self.split, dim=-1)
        conv_weight = cast(torch.Tensor, self.conv1d.weight)
        mixed, conv_history = causal_conv(mixed, conv_weight[:, 0], None if state is None else state.conv)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        # [B, T, H, D] -> [B, Hv, T, D] in fp32; value head h reads key head h // repeat.
        q, k = (
            y.reshape(b, t, self.num_k_heads, self.head_k_dim).float().repeat_interleave(repeat, dim=2).transpose(1, 2)
            for y in (q, k)
        )
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim).float().transpose(1, 2)
        q = l2_normalize(q) * self.head_k_dim**-0.5
        k = l2_normalize(k)
        beta = b_proj.float().sigmoid().transpose(1, 2)
        g = (-self.A_log.float().exp() * F.softplus(a_proj.float() + self.dt_bias.float())).transpose(1, 2)
        s0 = (
            torch.zeros(b, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=x.device)
            if state is None
            else state.recurrent
        )
        rule = chunked_delta_rule if (t > 1 if chunked is None else chunked) else recurrent_delta_rule
        o, s1 = rule(q, k, v, g, beta, s0)
        o = o.transpose(1, 2).to(x.dtype)  # [B, T, Hv, dv]
        y = self.norm(o, z.reshape(b, t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(y.reshape(b, t, self.value_dim)), LinearAttentionState(conv_history, s1)
