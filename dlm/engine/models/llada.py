"""LLaDA (model_type `llada`): a LLaMA-style transformer with fully bidirectional attention.

Parameters mirror the checkpoint (`model.transformer.blocks.N.attn_out.weight`, ...), except
the packed `qkv_proj` (q/k/v_proj) and `gate_up_proj` (ff_proj/up_proj), loaded by
concatenation so each is one matmul. In the checkpoint `ff_proj` is the SwiGLU gate,
`up_proj` the up projection, `ff_out` (in a block) the down projection and (at the top)
the LM head. The block itself is the bidirectional decoder layer Dream shares
(dlm/engine/layers/bidirectional_decoder.py), under LLaDA's names.
"""

from __future__ import annotations

import torch
from torch import nn

from dlm.engine.config import ModelConfig
from dlm.engine.layers.bidirectional_decoder import BidirectionalDecoderLayer, LayerNames
from dlm.engine.layers.block_decoder import decoder_stack
from dlm.engine.layers.linear import ParallelLMHead, VocabParallelEmbedding
from dlm.engine.layers.norm import RMSNorm
from dlm.engine.layers.rotary import Rotary
from dlm.engine.runtime.batch import ForwardBatch

NAMES = LayerNames("attn_norm", "qkv_proj", "attn_out", "ff_norm", "gate_up_proj", "ff_out")


class LLaDATransformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.logits_size, config.hidden_size)
        self.blocks = nn.ModuleList(BidirectionalDecoderLayer(config, NAMES) for _ in range(config.num_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.ff_out = ParallelLMHead(config.hidden_size, config.logits_size)


class _Root(nn.Module):
    """Holds `transformer` so parameter names carry the checkpoint's `model.` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.transformer = LLaDATransformer(config)


class Model(nn.Module):
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("ff_proj", "up_proj")}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Root(config)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        t = self.model.transformer
        return t.wte.weight if self.config.tie_word_embeddings else t.ff_out.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [B, S, d] at `batch.select`."""
        t = self.model.transformer
        return decoder_stack(t.wte(batch.input_ids), t.blocks, t.ln_f, self.rotary, batch)
