"""Gated full attention (Qwen3.5/3.6 hybrid): per-head q/k RMSNorm, partial rotary,
grouped-query SDPA and a sigmoid output gate computed from the query projection.

`q_proj` emits, per head, the query followed by its gate ([H, 2*D] rows interleaved by
head), exactly as stored in the checkpoint; `qkv_proj` packs q_proj, k_proj and v_proj.
Keys and values after norm and rotary are what a cache keeps.
"""

from __future__ import annotations

import torch
from torch import nn

from dlm.engine.layers.attention import attention, merge_heads, split_heads
from dlm.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from dlm.engine.layers.norm import RMSNorm
from dlm.engine.layers.rotary import Rotary

KeyValue = tuple[torch.Tensor, torch.Tensor]  # [B, Hkv, T, D] each


def prefix_causal_mask(queries: int, past: int, device: torch.device) -> torch.Tensor:
    """[queries, past + queries] bool: query i sees the whole past and new keys 0..i."""
    new = torch.ones(queries, queries, dtype=torch.bool, device=device).tril()
    return torch.cat((torch.ones(queries, past, dtype=torch.bool, device=device), new), dim=1)


class GatedAttention(nn.Module):
    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, bias: bool
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden_size, num_heads, num_kv_heads, head_dim, bias, q_rows=2 * head_dim)
        # This rank's heads (all of them outside tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, self.split = head_dim, self.qkv_proj.local_parts
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, zero_centred=True)
        self.k_norm = RMSNorm(head_dim, eps, zero_centred=True)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: KeyValue | None,
        causal: bool,
    ) -> tuple[torch.Tensor, KeyValue]:
        """x [B, T, d] at positions given by cos/sin [B, T, r]; `past` is the cached prefix.
        causal=True: token i sees the prefix and tokens <= i (prefill, commit);
        causal=False: every token sees the prefix and all T tokens (a bidirectional block).
        Returns (output, keys/values of prefix + these tokens)."""
        b, t, _ = x.shape
        qg, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        qg = qg.view(b, t, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :].reshape(b, t, -1)
        q = rotary.apply(self.q_norm(q).transpose(1, 2), cos, sin)
        k = rotary.apply(self.k_norm(k.view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2), cos, sin)
        v = split_heads(v, self.num_kv_heads)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        mask = None
        if causal and t > 1:
            mask = prefix_causal_mask(t, k.shape[2] - t, x.device)
        out = merge_heads(attention(q, k, v, None, mask=mask)) * torch.sigmoid(gate)
        return self.o_proj(out), (k, v)
