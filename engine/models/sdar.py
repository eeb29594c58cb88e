"""SDAR (model_type `sdar` / `sdar_moe`): Qwen3-style block-diffusion transformers.

Parameters mirror the Qwen3 checkpoint layout (`model.embed_tokens`, `model.layers.N.
self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.*`, `model.norm`, `lm_head`),
except the packed `qkv_proj` (q/k/v_proj) and `gate_up_proj` (gate_proj/up_proj).
The MoE variant (`SDARMoeForCausalLM`, from Qwen3-30B-A3B) has Qwen3-MoE layers:
`mlp.gate` (softmax router, top-k, `norm_topk_prob`) and the routed experts, stacked
(`mlp.experts.gate_up_proj` / `down_proj`, read from the checkpoint's `mlp.experts.E.*`),
on the layers that `decoder_sparse_step` / `mlp_only_layers` select.

`LlamaStyleModel` is the whole architecture with its options (q/k norm, projection biases);
openPangu (engine/models/pangu.py) is the same network without q/k norm and with biases.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.decoding.block_diffusion import BlockRules
from engine.layers.block_decoder import DecoderLayer, block_attention, decoder_stack
from engine.layers.linear import ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SoftmaxGate, SparseMoE, expert_sources
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary
from engine.runtime.block_batch import BlockBatch


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool, bias: bool) -> None:
        super().__init__()
        hd = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_heads, config.num_kv_heads, hd, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.sizes = self.qkv_proj.local_parts
        self.o_proj = RowParallelLinear(config.num_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        h: torch.Tensor,
        rotary: Rotary,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: BlockBatch,
        layer: int,
        selected: bool,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split(self.sizes, dim=-1)
        out = block_attention(
            q,
            k,
            v,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            rotary=rotary,
            cos_sin=cos_sin,
            batch=batch,
            layer=layer,
            selected=selected,
        )
        return self.o_proj(out)


def _is_moe_layer(raw: dict, index: int) -> bool:
    experts = int(raw.get("num_experts") or 0)
    step = int(raw.get("decoder_sparse_step") or 1)
    return experts > 0 and index not in (raw.get("mlp_only_layers") or []) and (index + 1) % step == 0


class QwenLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, index: int, qk_norm: bool, bias: bool) -> None:
        super().__init__()
        raw, d = config.raw, config.hidden_size
        self.self_attn = SelfAttention(config, qk_norm, bias)
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        if _is_moe_layer(raw, index):
            experts = int(raw["num_experts"])
            gate = SoftmaxGate(d, experts, int(raw["num_experts_per_tok"]), bool(raw.get("norm_topk_prob", True)))
            self.mlp: nn.Module = SparseMoE(gate, d, int(raw["moe_intermediate_size"]), experts)
        else:
            self.mlp = GatedMLP(d, config.intermediate_size)


class QwenInner(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool, bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.logits_size, config.hidden_size)
        self.layers = nn.ModuleList(QwenLayer(config, i, qk_norm, bias) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaStyleModel(nn.Module):
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    tensor_sources = expert_sources
    qk_norm = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = QwenInner(config, self.qk_norm, self.attention_bias(config))
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.logits_size)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)

    @staticmethod
    def attention_bias(config: ModelConfig) -> bool:
        return bool(config.raw.get("attention_bias", False))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, batch: BlockBatch) -> torch.Tensor:
        """Final-normed hidden states [B, S, d] at `batch.select`."""
        m = self.model
        return decoder_stack(m.embed_tokens(batch.input_ids), m.layers, m.norm, self.rotary, batch)


class Model(LlamaStyleModel):
    block_rules = BlockRules(aligned_grid=True, causal_context=False, logit_shift=0, threshold_rule="dynamic")

    @property
    def default_block_length(self) -> int:
        return int(self.config.raw.get("block_size") or 4)
