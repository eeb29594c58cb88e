"""openPangu-R-7B-Diffusion (model_type `PanguEmbedded`): context-causal block diffusion.

The network is Llama-style: SDAR's architecture (engine/models/sdar.py) without q/k norm
and with biases on q/k/v/o (`bias`, default true), full RoPE, same tensor names. What makes
it different is decoding (`block_rules`): the context is causal (the prompt is prefilled
and each finished block committed with a causal mask), logits are shifted one position
(row i predicts token i+1, so the commit forward of a block also decodes the first token
of the next one), blocks of 32 start right after the prompt and are denoised in 4
sub-blocks of 8. Its MASK is 45830 (an argument of the reference, not in config.json).
Because the context is causal and logits are shifted, the checkpoint is also a plain
causal LM: `--mode ar` (blocks of one token) is ordinary greedy AR decoding.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.decoding.block_diffusion import BlockRules
from engine.models.sdar import LlamaStyleModel


class Model(LlamaStyleModel):
    qk_norm = False
    block_rules = BlockRules(
        aligned_grid=False, causal_context=True, logit_shift=1, threshold_rule="dynamic", sub_blocks=4
    )

    @staticmethod
    def attention_bias(config: ModelConfig) -> bool:
        return bool(config.raw.get("bias", config.raw.get("attention_bias", True)))

    @property
    def default_block_length(self) -> int:
        return 32
