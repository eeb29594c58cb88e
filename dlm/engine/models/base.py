"""What the layer-stack families share: a body `model` (token embedding, decoder layers,
final norm) under the checkpoint's names, an LM head unless the embedding is tied, the
rotary tables, and the forward that runs the stack (dlm/engine/layers/block_decoder.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from dlm.engine.config import ModelConfig
from dlm.engine.layers.block_decoder import decoder_stack
from dlm.engine.layers.linear import ParallelLMHead, VocabParallelEmbedding
from dlm.engine.layers.norm import RMSNorm
from dlm.engine.layers.rotary import Rotary
from dlm.engine.runtime.batch import ForwardBatch
from dlm.engine.runtime.block_batch import BlockBatch


class DecoderBody(nn.Module):
    """`<embedding>` (the checkpoint's name for the token embedding), `layers`, `norm`."""

    def __init__(self, config: ModelConfig, layers: Iterable[nn.Module], embedding: str = "embed_tokens") -> None:
        super().__init__()
        self.embedding = embedding
        self.add_module(embedding, VocabParallelEmbedding(config.logits_size, config.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self) -> VocabParallelEmbedding:
        module = self.get_submodule(self.embedding)
        assert isinstance(module, VocabParallelEmbedding)
        return module


class DecoderLM(nn.Module):
    """`model` (a `DecoderBody`), `lm_head` unless tied, rotary; subclasses pass the body."""

    def __init__(self, config: ModelConfig, body: DecoderBody) -> None:
        super().__init__()
        self.config = config
        self.model = body
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.logits_size)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed().weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, batch: ForwardBatch | BlockBatch) -> torch.Tensor:
        """Final-normed hidden states [B, S, d] at `batch.select` (unshifted rows)."""
        m = self.model
        return decoder_stack(m.embed()(batch.input_ids), m.layers, m.norm, self.rotary, batch)
