"""Tiny transformers-native models for the `--backend transformers` tests: one small shape
shared by every architecture, weights drawn sharper than transformers' 0.02 init so that
confidences spread and ties vanish (a greedy comparison is then decided by the model, not
by rounding)."""

from __future__ import annotations

from typing import Any

import torch

# Two layers of width 32: enough for attention and an MLP, fast on one CPU thread.
TINY_SHAPE: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def sharpened(model: Any) -> Any:
    """`model` in eval mode with every matrix redrawn at a 1/sqrt(fan-in) scale."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return model.eval()


def tiny_bert(vocab_size: int, max_position_embeddings: int, **config: Any) -> Any:
    """A BertForMaskedLM (bidirectional, head with bias): the forward path's model."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    bert = BertConfig(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, **TINY_SHAPE, **config)
    return sharpened(BertForMaskedLM(bert))


def tiny_llama(vocab_size: int, max_position_embeddings: int, **config: Any) -> Any:
    """A LlamaForCausalLM with one KV head: the generate path's model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        num_key_value_heads=1,
        **TINY_SHAPE,
        **config,
    )
    return sharpened(LlamaForCausalLM(llama))
