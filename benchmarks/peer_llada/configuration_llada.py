"""LLaDA's config.json fields as a transformers config (see modeling_llada.py beside it)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"

    def __init__(
        self,
        d_model: int = 4096,
        n_layers: int = 32,
        n_heads: int = 32,
        n_kv_heads: int | None = None,
        mlp_hidden_size: int = 12288,
        vocab_size: int = 126464,
        embedding_size: int | None = None,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        weight_tying: bool = False,
        **kwargs: Any,
    ) -> None:
        self.d_model, self.n_layers, self.n_heads, self.n_kv_heads = d_model, n_layers, n_heads, n_kv_heads
        self.mlp_hidden_size, self.embedding_size = mlp_hidden_size, embedding_size
        self.rope_theta, self.rms_norm_eps, self.weight_tying = rope_theta, rms_norm_eps, weight_tying
        super().__init__(vocab_size=vocab_size, **kwargs)
