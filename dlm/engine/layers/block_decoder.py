"""The decoder layer shared by the block-causal families (LLaDA2, SDAR, openPangu).

Families differ only in how q/k/v are projected (LLaDA2's fused `query_key_value`, SDAR's
and openPangu's separate `q/k/v_proj`), in their MLP (dense or MoE) and in names; from the
projected rows on, they all do the same: split heads, optional per-head q/k RMSNorm *before* RoPE, (partial) RoPE at
absolute positions, attention through the batch (cache + fed keys, group visibility).
In the last layer only the `select` rows ask questions, so queries are gathered there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dlm.engine.config import ModelConfig
from dlm.engine.layers.attention import merge_heads, split_heads
from dlm.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from dlm.engine.layers.norm import RMSNorm
from dlm.engine.layers.pre_norm import PreNormLayer
from dlm.engine.layers.rotary import Rotary
from dlm.engine.runtime.batch import ForwardBatch, gather_rows
from dlm.engine.runtime.block_batch import BlockBatch


def gather_heads(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], index [B, S] -> [B, H, S, D]."""
    b, h, _, d = x.shape
    return torch.gather(x, 2, index[:, None, :, None].expand(b, h, index.shape[1], d))


@dataclass(frozen=True)
class AttentionNames:
    """Where a family's checkpoint puts each part of the attention (under the attention module)."""

    qkv: str  # packed q/k/v (the model's `packed_modules` names its sources) or a fused tensor
    out: str
    q_norm: str
    k_norm: str


QWEN_ATTENTION = AttentionNames(qkv="qkv_proj", out="o_proj", q_norm="q_norm", k_norm="k_norm")


class BlockAttention(nn.Module):
    """q/k/v projection (biases as `config.qkv_bias` / `o_bias` say), optional per-head q/k
    RMSNorm (`config.qk_norm`), RoPE at absolute positions, attention through the batch,
    output projection. `fused`: the checkpoint stores q/k/v as one tensor (LLaDA2)."""

    def __init__(self, config: ModelConfig, names: AttentionNames, fused: bool = False) -> None:
        super().__init__()
        hd, eps = config.head_dim, config.rms_norm_eps
        qkv = QKVParallelLinear(
            config.hidden_size, config.num_heads, config.num_kv_heads, hd, config.qkv_bias, fused=fused
        )
        self.names = names
        self.num_heads, self.num_kv_heads, self.sizes = qkv.num_heads, qkv.num_kv_heads, qkv.local_parts
        self.add_module(names.qkv, qkv)
        self.add_module(names.out, RowParallelLinear(config.num_heads * hd, config.hidden_size, bias=config.o_bias))
        self.add_module(names.q_norm, RMSNorm(hd, eps) if config.qk_norm else None)
        self.add_module(names.k_norm, RMSNorm(hd, eps) if config.qk_norm else None)

    def forward(
        self,
        h: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: BlockBatch,
        layer: int,
        selected: bool,
    ) -> torch.Tensor:
        """h [B, T, d] for every fed row -> [B, Tq, d], where Tq is T, or the number of
        `batch.select` rows when `selected`."""
        n, part = self.names, self.get_submodule
        q, k, v = part(n.qkv)(h).split(self.sizes, dim=-1)
        q, k, v = split_heads(q, self.num_heads), split_heads(k, self.num_kv_heads), split_heads(v, self.num_kv_heads)
        q_norm, k_norm = getattr(self, n.q_norm), getattr(self, n.k_norm)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = cos_sin
        k = rotary.apply(k, cos, sin)
        if selected:
            q = gather_heads(q, batch.select)
            index = batch.select[..., None].expand(-1, -1, cos.shape[-1])
            cos, sin = torch.gather(cos, 1, index), torch.gather(sin, 1, index)
        q = rotary.apply(q, cos, sin)
        return part(n.out)(merge_heads(batch.attend(layer, q, k, v, selected)))


class DecoderLayer(PreNormLayer):
    """Pre-norm residual layer whose mixer is the attention, under the checkpoint's name
    (`attention_name`)."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        attention_name: str = "self_attn",
        names: AttentionNames = QWEN_ATTENTION,
        fused: bool = False,
    ) -> None:
        super().__init__(config, index)
        self.attention_name = attention_name
        self.add_module(attention_name, BlockAttention(config, names, fused))

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: BlockBatch,
        layer: int,
        last: bool,
    ) -> torch.Tensor:
        attn = getattr(self, self.attention_name)
        out = attn(self.input_layernorm(x), rotary, cos_sin, batch, layer, last)
        if last:  # only the selected rows leave the last layer
            x = gather_rows(x, batch.select)
        return self.mlp_residual(x + out)


def decoder_stack(
    x: torch.Tensor, layers: nn.ModuleList, norm: RMSNorm, rotary: Rotary, batch: ForwardBatch | BlockBatch
) -> torch.Tensor:
    """Embedded inputs -> final-normed hidden states [B, S, d] at `batch.select`. Every
    family's layer loop (the bidirectional families' layers take the same arguments)."""
    cos_sin = rotary.cos_sin(batch.positions)
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        x = layer(x, rotary, cos_sin, batch, i, i == last)
    return norm(x)
