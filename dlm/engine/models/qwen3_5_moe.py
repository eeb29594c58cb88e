"""The Qwen3.5/3.6-MoE hybrid (model_type `qwen3_5_moe`, `qwen3_5_moe_text`), the base of
Clover-35B-A3B (`clover_moe`).

Layers alternate Gated DeltaNet linear attention (`linear_attention`) and gated full
attention (`full_attention`) as listed in `layer_types`; every layer then runs a sparse MoE
with a gated shared expert. Norms are zero-centred except the DeltaNet output norm.

Parameters mirror the checkpoint (`model.layers.N.linear_attn.out_proj.weight`, ...),
except the packed projections (`qkv_proj` = q/k/v_proj, `in_proj` = in_proj_qkv/z/b/a,
`gate_up_proj` = gate/up_proj of the shared expert) and the stacked experts, which
`tensor_sources` reads from one tensor per expert or from already stacked tensors
(`dlm.engine.layers.moe.expert_sources`), and from under `model.language_model.` in multimodal
checkpoints (their vision tower and MTP head are not loaded).

Unlike the bidirectional families this model never sees a whole canvas: it runs token
spans against a `HybridCache` (`forward_tokens`), causal for prefill, decode and Clover's
commit pass, bidirectional inside the span for Clover's preview pass. It returns the new
per-layer states and leaves the cache alone; the caller commits them or drops them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import cast

import torch
from torch import nn

from dlm.engine.config import LINEAR_ATTENTION, ModelConfig
from dlm.engine.layers.gated_attention import GatedAttention
from dlm.engine.layers.gated_deltanet import GatedDeltaNet
from dlm.engine.layers.linear import ParallelLMHead, VocabParallelEmbedding
from dlm.engine.layers.moe import expert_sources
from dlm.engine.layers.norm import RMSNorm
from dlm.engine.layers.pre_norm import PreNormLayer
from dlm.engine.layers.rotary import Rotary
from dlm.engine.loader import checkpoint_sources
from dlm.engine.runtime.hybrid_cache import HybridCache, LayerState

MULTIMODAL_PREFIX = "model.language_model."


class HybridLayer(PreNormLayer):
    """Pre-norm residual layer (zero-centred norms) whose mixer is the Gated DeltaNet or
    the gated attention, as `layer_types` says."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index, zero_centred=True)
        d, eps, la = config.hidden_size, config.rms_norm_eps, config.linear
        self.layer_type = config.layer_type(index)
        if self.layer_type == LINEAR_ATTENTION and la is not None:
            self.linear_attn = GatedDeltaNet(
                d, la.key_heads, la.value_heads, la.key_dim, la.value_dim, la.conv_kernel, eps
            )
        else:
            self.self_attn = GatedAttention(
                d, config.num_heads, config.num_kv_heads, config.head_dim, eps, config.qkv_bias
            )

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        past: LayerState | None,
        causal: bool,
        chunked: bool | None,
    ) -> tuple[torch.Tensor, LayerState]:
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR_ATTENTION:
            # The DeltaNet is causal by construction; a bidirectional span still runs it causally.
            mixed, state = self.linear_attn(h, past, chunked)  # type: ignore[arg-type]
        else:
            mixed, state = self.self_attn(h, rotary, *cos_sin, past, causal)  # type: ignore[arg-type]
        return self.mlp_residual(x + mixed), state


class HybridBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=True)


class Model(nn.Module):
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = HybridBody(config)
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)

    @property
    def layer_types(self) -> list[str]:
        return [cast(HybridLayer, layer).layer_type for layer in self.model.layers]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def tensor_sources(self, name: str, available: Collection[str]) -> list[str] | None:
        """Checkpoint names for parameter `name` where they differ from the default rule:
        the routed experts' tensors (`expert_sources`) and the multimodal prefix."""
        if not name.startswith("model."):
            return None  # lm_head.weight sits at the top level in both layouts
        nested = MULTIMODAL_PREFIX + "embed_tokens.weight" in available
        prefix = MULTIMODAL_PREFIX if nested else "model."
        experts = expert_sources(self, name, available, prefix + name[len("model.") :])
        if experts is not None:
            return experts
        if not nested:
            return None
        return [prefix + src[len("model.") :] for src in checkpoint_sources(name, self.packed_modules)]

    def new_cache(self) -> HybridCache:
        return HybridCache(layers=[None] * len(self.model.layers))

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: HybridCache | None,
        causal: bool = True,
        chunked: bool | None = None,
    ) -> tuple[torch.Tensor, list[LayerState]]:
        """Run ids [B, T] at absolute `positions` [B, T] after the cached prefix.

        Returns the final-normed hidden states [B, T, d] and every layer's state after these
        tokens (attention: prefix + new keys/values; DeltaNet: conv and recurrent state).
        `causal=False` makes full-attention layers bidirectional within the span.
        """
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        states: list[LayerState] = []
        for i, layer in enumerate(self.model.layers):
            past = None if cache is None else cache.layers[i]
            x, state = layer(x, self.rotary, cos_sin, past, causal, chunked)
            states.append(state)
        return self.model.norm(x), states

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head_weight.T
