"""LLaDA2.x (model_type `llada2_moe`, `LLaDA2MoeModelLM`): block-diffusion MoE transformer.

Parameters mirror the checkpoint (`model.word_embeddings`, `model.layers.N.attention.
query_key_value` / `dense` / `query_layernorm` / `key_layernorm`, `mlp.gate.weight`,
`mlp.gate.expert_bias`, `mlp.shared_experts.*`, `model.norm`, `lm_head`), except the
packed `gate_up_proj` (gate_proj, up_proj) of every MLP and the stacked routed experts
(`mlp.experts.gate_up_proj` / `down_proj`, read from the checkpoint's `mlp.experts.E.*`).

- The fused `query_key_value` output is all Q heads, then all K heads, then all V heads.
- Per-head RMSNorm of q and k (`use_qk_norm`) runs before RoPE; RoPE is partial
  (`partial_rotary_factor`): inv_freq over the rotary dim, rotate-half within it.
- Layers below `first_k_dense_replace` are dense; the rest are MoE with the sigmoid,
  group-limited router and a shared expert (see engine/layers/moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.decoding.block_diffusion import BlockRules
from engine.layers.block_decoder import DecoderLayer, block_attention, decoder_stack
from engine.layers.linear import ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SigmoidGroupGate, SparseMoE, expert_sources
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary
from engine.runtime.block_batch import BlockBatch


class LLaDA2Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        raw, hd = config.raw, config.head_dim
        self.query_key_value = QKVParallelLinear(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            hd,
            bool(raw.get("use_qkv_bias", False)),
            fused=True,
        )
        self.num_heads, self.num_kv_heads = self.query_key_value.num_heads, self.query_key_value.num_kv_heads
        self.sizes = self.query_key_value.local_parts
        self.dense = RowParallelLinear(config.num_heads * hd, config.hidden_size, bias=bool(raw.get("use_bias", False)))
        qk_norm = bool(raw.get("use_qk_norm", True))
        self.query_layernorm = RMSNorm(hd, config.rms_norm_eps) if qk_norm else None
        self.key_layernorm = RMSNorm(hd, config.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        h: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: BlockBatch,
        layer: int,
        selected: bool,
    ) -> torch.Tensor:
        q, k, v = self.query_key_value(h).split(self.sizes, dim=-1)
        out = block_attention(
            q,
            k,
            v,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            q_norm=self.query_layernorm,
            k_norm=self.key_layernorm,
            rotary=rotary,
            cos_sin=cos_sin,
            batch=batch,
            layer=layer,
            selected=selected,
        )
        return self.dense(out)


class LLaDA2Layer(DecoderLayer):
    attention_name = "attention"

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        raw, d = config.raw, config.hidden_size
        self.attention = LLaDA2Attention(config)
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        experts = raw.get("num_experts")
        if experts and index >= int(raw.get("first_k_dense_replace", 0)):
            if raw.get("score_function", "sigmoid") != "sigmoid":
                raise ValueError(f"LLaDA2 score_function {raw.get('score_function')!r} (only sigmoid)")
            ffn = int(raw["moe_intermediate_size"])
            gate = SigmoidGroupGate(
                d,
                int(experts),
                int(raw["num_experts_per_tok"]),
                int(raw.get("n_group") or 1),
                int(raw.get("topk_group") or 1),
                float(raw.get("routed_scaling_factor", 1.0)),
                bool(raw.get("norm_topk_prob", True)),
                bool(raw.get("moe_router_enable_expert_bias", False)),
            )
            self.mlp: nn.Module = SparseMoE(gate, d, ffn, int(experts), ffn * int(raw.get("num_shared_experts") or 0))
        else:
            self.mlp = GatedMLP(d, config.intermediate_size)


class LLaDA2Inner(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.logits_size, config.hidden_size)
        self.layers = nn.ModuleList(LLaDA2Layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Model(nn.Module):
    packed_modules = {"gate_up_proj": ("gate_proj", "up_proj")}
    tensor_sources = expert_sources
    block_rules = BlockRules(aligned_grid=True, causal_context=False, logit_shift=0, threshold_rule="dinfer")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LLaDA2Inner(config)
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.logits_size)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)

    @property
    def default_block_length(self) -> int:
        return 32  # LLaDA2.0/2.1's trained block size (not in config.json)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.word_embeddings.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, batch: BlockBatch) -> torch.Tensor:
        """Final-normed hidden states [B, S, d] at `batch.select`."""
        m = self.model
        return decoder_stack(m.word_embeddings(batch.input_ids), m.layers, m.norm, self.rotary, batch)
