"""SDAR (model_type `sdar` / `sdar_moe`), openPangu (`PanguEmbedded`) and Fast-dLLM v2
(`Fast_dLLM_Qwen`): Qwen3/Qwen2/Llama-style block-diffusion transformers.

Parameters mirror the Qwen3 checkpoint layout (`model.embed_tokens`, `model.layers.N.
self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.*`, `model.norm`, `lm_head`),
except the packed `qkv_proj` (q/k/v_proj) and `gate_up_proj` (gate_proj/up_proj).
The MoE variant (`SDARMoeForCausalLM`, from Qwen3-30B-A3B) has Qwen3-MoE layers:
`mlp.gate` (softmax router, top-k, `norm_topk_prob`) and the routed experts, stacked
(`mlp.experts.gate_up_proj` / `down_proj`, read from the checkpoint's `mlp.experts.E.*`),
on the layers that `decoder_sparse_step` / `mlp_only_layers` select.

openPangu-R-7B-Diffusion is the same network without q/k norm and with biases on q/k/v/o
(`bias`, default true), same tensor names; its registry record says so. What makes it
different is decoding (its `BlockRules`): the context is causal (the prompt is prefilled
and each finished block committed with a causal mask), logits are shifted one position
(row i predicts token i+1, so the commit forward of a block also decodes the first token
of the next one), blocks of 32 start right after the prompt and are denoised in 4
sub-blocks of 8. Its MASK is 45830 (an argument of the reference, not in config.json).
Because the context is causal and logits are shifted, the checkpoint is also a plain
causal LM: `--mode ar` (blocks of one token) is ordinary greedy AR decoding.

Fast-dLLM v2 (Qwen2.5 fine-tuned for block diffusion) is the same network with Qwen2's
attention: biases on q/k/v, none on o_proj, no q/k norm. Its `BlockRules` put blocks of
`bd_size` on the absolute grid with a block-causal context, shift logits like openPangu,
denoise in 4 sub-blocks and stop mid-block at a decided EOS (docs/block-diffusion.md).
"""

from __future__ import annotations

from dlm.engine.config import ModelConfig
from dlm.engine.layers.block_decoder import DecoderLayer
from dlm.engine.layers.moe import expert_sources
from dlm.engine.models.base import DecoderBody, DecoderLM


class Model(DecoderLM):
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    tensor_sources = expert_sources

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderBody(config, (DecoderLayer(config, i) for i in range(config.num_layers))))
