"""The pre-norm residual layer the block-causal and hybrid decoders share.

A layer is x + mixer(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)); the
mixer (attention, or the hybrid's Gated DeltaNet) and its arguments differ per decoder, the
two norms and the MLP (dense or MoE, as `config.moe` places it) do not. The attribute names
are the checkpoints' (`model.layers.N.input_layernorm.weight`, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from dlm.engine.config import ModelConfig
from dlm.engine.layers.moe import feed_forward
from dlm.engine.layers.norm import RMSNorm


class PreNormLayer(nn.Module):
    """The norms and MLP of layer `index`; a subclass adds its mixer and `forward`.
    `zero_centred` norms scale by (1 + w) (Qwen3-Next style)."""

    def __init__(self, config: ModelConfig, index: int, *, zero_centred: bool = False) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, zero_centred=zero_centred)
        self.post_attention_layernorm = RMSNorm(d, eps, zero_centred=zero_centred)
        self.mlp = feed_forward(config, index)

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's second half: x + mlp(post_attention_layernorm(x))."""
        return x + self.mlp(self.post_attention_layernorm(x))
