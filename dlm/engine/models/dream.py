"""Dream (model_type `Dream`): Dream-7B, Dream-Coder, DiffuCoder.

A Qwen2 decoder (q/k/v biases, no o_proj bias, GQA, RMSNorm, RoPE) with attention made fully
bidirectional, trained so that row i of the logits predicts token i+1 (the family's
`logits_shift`): the samplers read position p's distribution from row p-1. Parameters
mirror the checkpoint (`model.layers.N.self_attn.o_proj.weight`, `lm_head.weight`, ...),
except the packed `qkv_proj` (q/k/v_proj) and `gate_up_proj` (gate_proj/up_proj), one matmul
each. The layer is the bidirectional decoder layer LLaDA shares
(dlm/engine/layers/bidirectional_decoder.py), under Qwen2's names.
"""

from __future__ import annotations

from dlm.engine.config import ModelConfig
from dlm.engine.layers.bidirectional_decoder import BidirectionalDecoderLayer, LayerNames
from dlm.engine.models.base import DecoderBody, DecoderLM

NAMES = LayerNames(
    "input_layernorm",
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_up_proj",
    "mlp.down_proj",
)


class Model(DecoderLM):
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig) -> None:
        layers = (BidirectionalDecoderLayer(config, NAMES) for _ in range(config.num_layers))
        super().__init__(config, DecoderBody(config, layers))
