"""DiffusionGemma: a causal encoder that reads the prompt into a KV cache, and a decoder that
refines a canvas of `canvas_length` tokens against that cache.

Encoder and decoder are one set of weights (the checkpoint stores them under
`model.decoder.`; only each side's `layer_scalar` is its own). The encoder runs the layers
causally (sliding-window layers see their last `sliding_window` positions) and keeps each
layer's keys and values: all of them for full-attention layers, the last
`sliding_window - 1` for sliding ones, which is what the decoder may read. The decoder feeds
the canvas (at the positions after the cache), attends bidirectionally to the cached keys
and the whole canvas, and adds a self-conditioning signal made from the previous step's
logits (softmax @ embedding, through a gated MLP).

A layer: attention (q/k RMSNorm, an unscaled v norm, q.k not divided by sqrt(d); full
layers have no v_proj: values are the keys before their norm), then a dense GELU MLP and a
mixture of GELU experts side by side on the same residual, each with its own norms, summed,
normed, added, and the layer's output scaled by its `layer_scalar`. The logits are soft-capped
(tanh(x / c) * c) in fp32. Names of parameters are the checkpoint's, so the loader maps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.config import FULL_ATTENTION, CanvasSpec, ModelConfig
from dlm.engine.layers.attention import merge_heads, split_heads
from dlm.engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
    kv_head_range,
    split,
)
from dlm.engine.layers.norm import RMSNorm
from dlm.engine.layers.rotary import Rotary
from dlm.engine.loader import Index, Shard
from dlm.engine.parallel import state as parallel_state


def unscaled_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (v, router input, self-conditioning output), in fp32."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass
class LayerKV:
    """One layer's cached keys and values [1, Hkv, T, D] and the position of the first."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + self.keys.shape[2]


@dataclass
class PromptCache:
    """A sequence's encoder cache: per layer, what the decoder reads."""

    layers: list[LayerKV | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Positions encoded so far (the next canvas starts here)."""
        first = self.layers[0] if self.layers else None
        return 0 if first is None else first.end

    @property
    def nbytes(self) -> int:
        return sum(kv.keys.nbytes + kv.values.nbytes for kv in self.layers if kv is not None)


class GatedGeluMLP(nn.Module):
    """gate/up split by intermediate features over tensor-parallel ranks, down summed over them."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, [ffn])
        self.up_proj = ColumnParallelLinear(hidden, [ffn])
        self.down_proj = RowParallelLinear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax over experts of the unweighted-normed input (times `scale` / sqrt(d)); the top-k
    weights renormalised, then scaled per expert."""

    def __init__(self, hidden: int, experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.proj.keep_precision = True  # type: ignore[assignment]  # a router: never quantized
        self.scale = nn.Parameter(torch.empty(hidden))
        self.per_expert_scale = nn.Parameter(torch.empty(experts))
        self.top_k, self.eps, self.root = top_k, eps, hidden**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(unscaled_rms(x, self.eps) * self.scale * self.root)
        weights, chosen = torch.softmax(scores, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights * self.per_expert_scale[chosen]


class Experts(nn.Module):
    """Stacked experts: `gate_up_proj` [E, 2I, d] (gate rows, then up rows), `down_proj` [E, d, I].
    Over tensor-parallel ranks each holds a slice of every expert's intermediate features
    (every rank routes every token alike); the partial outputs are summed over the ranks."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        i0, i1 = split(ffn, "the expert intermediate size")
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * (i1 - i0), hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, i1 - i0))
        self.gate_up_proj.stacked_experts = True  # type: ignore[attr-defined]  # quantized expert by expert
        self.down_proj.stacked_experts = True  # type: ignore[attr-defined]
        if parallel_state.current().size > 1:
            gate_up: list[Index] = [(slice(None), slice(i0, i1)), (slice(None), slice(ffn + i0, ffn + i1))]
            down: list[Index] = [(slice(None), slice(None), slice(i0, i1))]
            self.gate_up_proj.shard = Shard(lambda i, shape: gate_up, cat_dim=1)  # type: ignore[attr-defined]
            self.down_proj.shard = Shard(lambda i, shape: down)  # type: ignore[attr-defined]
            self.down_proj.split_inputs = ffn  # type: ignore[attr-defined]  # quantized as whole rows

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            token, slot = torch.where(chosen == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(gelu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return parallel_state.all_reduce(out)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: CanvasSpec, full: bool) -> None:
        super().__init__()
        d, heads = config.hidden_size, config.num_heads
        dim = self.head_dim = spec.global_head_dim if full else config.head_dim
        kv_heads = spec.global_kv_heads if full else config.num_kv_heads
        # This rank's query heads and the KV heads they read (replicated when fewer than ranks).
        q0, q1 = split(heads, "query heads")
        k0, k1 = kv_head_range(heads, kv_heads)
        self.heads, self.kv_heads, self.eps = q1 - q0, k1 - k0, config.rms_norm_eps
        self.q_proj = ColumnParallelLinear(d, [heads * dim], ranges=[(q0 * dim, q1 * dim)])
        self.k_proj = ColumnParallelLinear(d, [kv_heads * dim], ranges=[(k0 * dim, k1 * dim)])
        self.v_proj = None if full else ColumnParallelLinear(d, [kv_heads * dim], ranges=[(k0 * dim, k1 * dim)])
        self.o_proj = RowParallelLinear(heads * dim, d)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project(
        self, h: torch.Tensor, rotary: Rotary, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], k and v [B, Hkv, T, D] of normed `h` [B, T, d], rotated."""
        cos, sin = cos_sin
        q = split_heads(self.q_proj(h), self.heads)
        k_raw = split_heads(self.k_proj(h), self.kv_heads)
        v = k_raw if self.v_proj is None else split_heads(self.v_proj(h), self.kv_heads)
        q = rotary.apply(self.q_norm(q).contiguous(), cos, sin)
        k = rotary.apply(self.k_norm(k_raw).contiguous(), cos, sin)
        return q, k, unscaled_rms(v, self.eps)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Softmax(q.k) v with no 1/sqrt(d) (the q/k norms set the scale); `mask` [B, 1, Tq, Tk]."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
        return self.o_proj(merge_heads(out))


class Layer(nn.Module):
    def __init__(self, config: ModelConfig, spec: CanvasSpec, index: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.full = config.layer_type(index) == FULL_ATTENTION
        self.self_attn = Attention(config, spec, self.full)
        self.mlp = GatedGeluMLP(d, config.intermediate_size)
        self.router = Router(d, spec.num_experts, spec.top_k, eps)
        self.experts = Experts(spec.num_experts, d, spec.expert_ffn)
        self.layer_scalar = nn.Parameter(torch.empty(1))
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_2",
        ):
            self.add_module(name, RMSNorm(d, eps))

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        norm: RMSNorm = getattr(self, name)
        out = norm(x)
        assert isinstance(out, torch.Tensor)
        return out

    def feed_forward(self, h: torch.Tensor, scalar: torch.Tensor) -> torch.Tensor:
        """The dense MLP and the experts on the same residual `h`, summed, added, scaled."""
        dense = self._norm("post_feedforward_layernorm_1", self.mlp(self._norm("pre_feedforward_layernorm", h)))
        flat = h.reshape(-1, h.shape[-1])
        chosen, weights = self.router(flat)
        routed = self.experts(self._norm("pre_feedforward_layernorm_2", flat), chosen, weights).view(h.shape)
        mixed = dense + self._norm("post_feedforward_layernorm_2", routed)
        return (h + self._norm("post_feedforward_layernorm", mixed)) * scalar


class Decoder(nn.Module):
    """The checkpoint's `model.decoder`: the shared layers, embedding, final norm, and the
    decoder's self-conditioning block."""

    def __init__(self, config: ModelConfig, spec: CanvasSpec) -> None:
        super().__init__()
        d = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.logits_size, d)
        self.layers = nn.ModuleList(Layer(config, spec, i) for i in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(config)


class SelfConditioning(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, [config.intermediate_size])
        self.up_proj = ColumnParallelLinear(config.hidden_size, [config.intermediate_size])
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.eps = config.rms_norm_eps

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        normed = self.pre_norm(soft)
        assert isinstance(normed, torch.Tensor)
        signal = self.down_proj(gelu(self.gate_proj(normed)) * self.up_proj(normed))
        return unscaled_rms(embeds + signal, self.eps)


class EncoderLayerScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_scalar = nn.Parameter(torch.empty(1))


class EncoderLanguageModel(nn.Module):
    """`model.encoder.language_model`: all the encoder holds of its own (its other weights are the decoder's)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayerScalars() for _ in range(layers))


class Encoder(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.language_model = EncoderLanguageModel(layers)


class Body(nn.Module):
    def __init__(self, config: ModelConfig, spec: CanvasSpec) -> None:
        super().__init__()
        self.decoder = Decoder(config, spec)
        self.encoder = Encoder(config.num_layers)


def proportional_rotary(head_dim: int, theta: float, fraction: float, factor: float) -> Rotary:
    """Rotate-half RoPE over the whole head in which only the first `fraction` of the
    frequencies turn (exponents over `head_dim`, divided by `factor`); the rest are 0 (those
    dims pass unrotated)."""
    rotary = Rotary(head_dim, theta)
    turning = int(fraction * head_dim // 2)
    rotary.inv_freq[turning:] = 0.0
    rotary.inv_freq /= factor
    return rotary


class Model(nn.Module):
    """DiffusionGemma's text model: `encode` appends prompt (or committed canvas) tokens to a
    sequence's `PromptCache`; `denoise` gives the canvas logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        spec = config.canvas
        assert spec is not None  # the diffusion_gemma layout fills it
        self.config, self.spec = config, spec
        self.model = Body(config, spec)
        self.sliding = Rotary(config.head_dim, config.rope_theta)
        self.full = proportional_rotary(
            spec.global_head_dim, spec.global_rope_theta, spec.global_rope_fraction, spec.global_rope_factor
        )

    def new_cache(self) -> PromptCache:
        return PromptCache()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.decoder.embed_tokens.weight

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=self.lm_head_weight.dtype)
        return self.model.decoder.embed_tokens(ids) * scale

    def _layers(self) -> list[Layer]:
        return [cast(Layer, layer) for layer in self.model.decoder.layers]

    def _rotaries(self, positions: torch.Tensor) -> dict[bool, tuple[Rotary, tuple[torch.Tensor, torch.Tensor]]]:
        return {full: (rot, rot.cos_sin(positions)) for full, rot in ((False, self.sliding), (True, self.full))}

    @torch.inference_mode()
    def encode(self, ids: torch.Tensor, cache: PromptCache) -> None:
        """Run `ids` [T] causally after what `cache` holds and append their keys and values."""
        start = cache.length
        layers = self._layers()
        if not cache.layers:
            cache.layers = [None] * len(layers)
        positions = torch.arange(start, start + len(ids), device=ids.device)[None]
        rot = self._rotaries(positions)
        h = self._embed(ids[None])
        window = self.spec.sliding_window
        scalars = [cast(EncoderLayerScalars, s).layer_scalar for s in self.model.encoder.language_model.layers]
        for i, layer in enumerate(layers):
            rotary, cos_sin = rot[layer.full]
            q, k, v = layer.self_attn.project(layer._norm("input_layernorm", h), rotary, cos_sin)
            past = cache.layers[i]
            first = start if past is None else past.start
            if past is not None:
                k, v = torch.cat((past.keys, k), dim=2), torch.cat((past.values, v), dim=2)
            key_pos = torch.arange(first, start + len(ids), device=ids.device)
            seen = key_pos[None, :] <= positions[0, :, None]
            if not layer.full:
                seen &= positions[0, :, None] - key_pos[None, :] < window
            attn = layer.self_attn.attend(q, k, v, seen[None, None])
            h = h + layer._norm("post_attention_layernorm", attn)
            h = layer.feed_forward(h, scalars[i])
            keep = k.shape[2] if layer.full else window - 1
            cache.layers[i] = LayerKV(k[:, :, -keep:], v[:, :, -keep:], start + len(ids) - min(keep, k.shape[2]))

    @torch.inference_mode()
    def denoise(
        self, canvas: torch.Tensor, caches: list[PromptCache], self_conditioning: list[torch.Tensor | None]
    ) -> torch.Tensor:
        """Logits [B, L, V] (fp32, soft-capped) for canvases [B, L], each after its own cache;
        `self_conditioning`: per row, the previous step's logits [1, L, V] (None: its first step)."""
        decoder = self.model.decoder
        batch, length = canvas.shape
        starts = torch.tensor([c.length for c in caches], device=canvas.device)
        positions = starts[:, None] + torch.arange(length, device=canvas.device)
        rot = self._rotaries(positions)
        h = self._embed(canvas)
        soft = torch.zeros_like(h)
        rows = [r for r, logits in enumerate(self_conditioning) if logits is not None]
        if rows:
            # The expected embedding under the previous step's distribution: each rank's
            # vocabulary rows weighted by their probabilities, summed over the ranks.
            embedding = self.model.decoder.embed_tokens
            given = torch.cat([self_conditioning[r] for r in rows])  # type: ignore[misc]
            probs = given.softmax(dim=-1, dtype=torch.float32).to(embedding.weight.dtype)
            local = probs[..., embedding.vocab_start : embedding.vocab_stop] @ embedding.weight
            soft[rows] = parallel_state.all_reduce(local) * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        h = decoder.self_conditioning(h, soft)
        for i, layer in enumerate(self._layers()):
            rotary, cos_sin = rot[layer.full]
            q, k, v = layer.self_attn.project(layer._norm("input_layernorm", h), rotary, cos_sin)
            attn = _attend_after_cache(layer.self_attn, q, k, v, [c.layers[i] for c in caches])
            h = h + layer._norm("post_attention_layernorm", attn)
            h = layer.feed_forward(h, layer.layer_scalar)
        normed = decoder.norm(h)
        assert isinstance(normed, torch.Tensor)
        local = F.linear(normed, self.lm_head_weight).float()
        logits = gather_logits(local.view(-1, local.shape[-1]), self.config.logits_size).view(batch, length, -1)
        cap = self.spec.logit_softcap
        return torch.tanh(logits / cap) * cap


def _attend_after_cache(
    attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: list[LayerKV | None]
) -> torch.Tensor:
    """Each row's canvas queries over its own cached keys/values, then its canvas ones. Rows
    whose caches have one length run as one batch; otherwise each row runs over its own keys,
    never padded to a longer neighbour's: SDPA groups its sums by the number of keys, so a
    padded row would round differently (visibly in bf16) from the same request decoded alone,
    and a request's answer would depend on its batch (as dlm.kernels.attention avoids for the
    other families)."""
    lengths = {0 if p is None else p.keys.shape[2] for p in past}
    if len(lengths) == 1:
        return attention.attend(q, *_with_cached(past, k, v), None)
    rows = range(q.shape[0])
    return torch.cat(
        [attention.attend(q[r : r + 1], *_with_cached([past[r]], k[r : r + 1], v[r : r + 1]), None) for r in rows]
    )


def _with_cached(past: list[LayerKV | None], k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached keys/values (of one length in every row) before the canvas ones."""
    present = [p for p in past if p is not None and p.keys.shape[2]]
    if not present:
        return k, v
    keys = torch.cat([p.keys for p in present], dim=0)
    values = torch.cat([p.values for p in present], dim=0)
    return torch.cat((keys, k), dim=2), torch.cat((values, v), dim=2)
