"""LLaDA as transformers remote code, for the peer servers that load checkpoints with
`AutoModel.from_pretrained(..., trust_remote_code=True)` (benchmarks/vs_peers.py).

The LLaDA authors' `modeling_llada.py` lives only on the Hugging Face hub, which the benchmark
machine cannot reach, and dlm's checkpoints ship no code (dlm never needs it). This file
computes what the authors' model computes, in the same order and precision: RMSNorm
statistics in fp32, rotary embeddings (rotate-half) in fp32, grouped K/V heads repeated,
bidirectional scaled-dot-product attention, a SwiGLU MLP (`ff_proj` the gate, `up_proj`,
`ff_out` the down projection), the LM head over every position. Like the authors' model it
accepts an `attention_mask` and does not apply it (their attention is called without a mask),
and takes no position ids. It runs in the peer's own environment (transformers 4.x) and
imports nothing of dlm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # loaded as remote code: a sibling module of the checkpoint's package
    from .configuration_llada import LLaDAConfig
except ImportError:  # imported directly
    from configuration_llada import LLaDAConfig  # type: ignore[no-redef]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Block(nn.Module):
    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        d, hd = config.d_model, config.d_model // config.n_heads
        kv = (config.n_kv_heads or config.n_heads) * hd
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads or config.n_heads, hd
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = (q.float() * cos + rotate_half(q.float()) * sin).type_as(q)
        k = (k.float() * cos + rotate_half(k.float()) * sin).type_as(k)
        if self.n_kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False)
        x = x + self.attn_out(att.transpose(1, 2).reshape(b, t, -1))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModel(nn.Module):
    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        vocab = config.embedding_size or config.vocab_size
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, config.d_model),
                "blocks": nn.ModuleList(Block(config) for _ in range(config.n_layers)),
                "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
            }
        )
        if not config.weight_tying:
            self.transformer["ff_out"] = nn.Linear(config.d_model, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        hd = self.config.d_model // self.config.n_heads
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.arange(input_ids.shape[1], dtype=torch.float32)[:, None] * inv_freq.to(input_ids.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        x = t["wte"](input_ids)
        for block in t["blocks"]:
            x = block(x, cos, sin)
        x = t["ln_f"](x)
        head = t["wte"].weight if self.config.weight_tying else t["ff_out"].weight
        return F.linear(x, head)


class LLaDAModelLM(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Every weight comes from the checkpoint."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: object
    ) -> CausalLMOutputWithPast:
        return CausalLMOutputWithPast(logits=self.model(input_ids))
