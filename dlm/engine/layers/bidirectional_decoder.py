"""The decoder layer shared by the bidirectional families (LLaDA, Dream).

Both are pre-norm LLaMA/Qwen2-style layers: RMSNorm, packed q/k/v projection, RoPE and
attention over every fed row (`self_attention`: bidirectional, GQA, cache-aware), output
projection, RMSNorm, SwiGLU MLP. They differ only in biases (`ModelConfig.qkv_bias`,
`o_bias`, `mlp_bias`) and in names (LLaDA's flat `attn_norm`, `attn_out`,
`ff_norm`, `ff_out`; Dream's Qwen2 `self_attn.*`, `mlp.*`); each family passes its
`LayerNames`, and the parameters are created at those (possibly nested) paths so the
checkpoints' tensor names load unchanged. The logit shift belongs to the family
(`ModelConfig.logits_shift`), not the layer. In the last layer only the `select` rows
ask questions, so only they leave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.config import ModelConfig
from dlm.engine.layers.attention import self_attention
from dlm.engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from dlm.engine.layers.norm import RMSNorm
from dlm.engine.layers.rotary import Rotary
from dlm.engine.runtime.batch import ForwardBatch, gather_rows


@dataclass(frozen=True)
class LayerNames:
    """Where a family's checkpoint puts each part of a layer (dotted paths under the layer)."""

    attn_norm: str
    qkv: str  # packed: the model's `packed_modules` names its checkpoint sources
    attn_out: str
    mlp_norm: str
    gate_up: str  # packed gate and up projections
    down: str


class BidirectionalDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, names: LayerNames) -> None:
        super().__init__()
        d, hd, eps, ffn = config.hidden_size, config.head_dim, config.rms_norm_eps, config.intermediate_size
        self.names = names
        qkv = QKVParallelLinear(d, config.num_heads, config.num_kv_heads, hd, config.qkv_bias)
        gate_up = ColumnParallelLinear(d, [ffn] * 2, bias=config.mlp_bias)
        parts = {
            names.attn_norm: RMSNorm(d, eps),
            names.qkv: qkv,
            names.attn_out: RowParallelLinear(config.num_heads * hd, d, bias=config.o_bias),
            names.mlp_norm: RMSNorm(d, eps),
            names.gate_up: gate_up,
            names.down: RowParallelLinear(ffn, d, bias=config.mlp_bias),
        }
        for path, module in parts.items():
            self._place(path, module)
        self.heads = (qkv.num_heads, qkv.num_kv_heads)  # this rank's
        self.ffn = gate_up.local_parts[0]  # this rank's intermediate features

    def _place(self, path: str, module: nn.Module) -> None:
        """Register `module` at dotted `path`, creating plain containers on the way."""
        parent: nn.Module = self
        *owners, leaf = path.split(".")
        for owner in owners:
            if not hasattr(parent, owner):
                parent.add_module(owner, nn.Module())
            parent = parent.get_submodule(owner)
        parent.add_module(leaf, module)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        layer: int,
        last: bool,
    ) -> torch.Tensor:
        """Layer number `layer` (`dlm.engine.layers.block_decoder.decoder_stack` runs the stack);
        in the `last` one, queries (and the output) are only the `batch.select` rows."""
        n, part = self.names, self.get_submodule
        select = batch.select if last else None
        h = part(n.attn_norm)(x)
        out = self_attention(h, cast(nn.Linear, part(n.qkv)), self.heads, rotary, cos_sin, batch, layer, select)
        if select is not None:
            x = gather_rows(x, select)
        x = x + part(n.attn_out)(out)
        gate, up = part(n.gate_up)(part(n.mlp_norm)(x)).split([self.ffn, self.ffn], dim=-1)
        return x + part(n.down)(F.silu(gate) * up)
