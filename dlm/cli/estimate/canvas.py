"""DiffusionGemma's terms in `dlm estimate`: what its encoder/decoder holds and allocates.

Parameters: per layer type (sliding-window layers with `head_dim` and their own v_proj,
full-attention layers with `global_head_dim` and keys doubling as values), a dense GELU MLP
beside the experts in every layer, the router's scales, and the decoder's self-conditioning
MLP. Memory per sequence: the encoder's prompt KV cache (every position for full-attention
layers, the last `sliding_window - 1` for sliding ones; values kept apart from keys) and the
previous step's logits that self-condition the next step (canvas x vocabulary, activation
dtype). Transient: the larger of one prompt's encoder pass and one decoder step over the
batch's canvases with its vocabulary-wide logits (gathered, soft-capped) and one canvas's
sampler buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlm.engine.config import FULL_ATTENTION

if TYPE_CHECKING:
    from dlm.cli.estimate.plan import Architecture, Component, Row, Serving


def components(a: Architecture) -> list[Component]:
    from dlm.cli.estimate.plan import Component, Matrices, mlp_matrices

    c, sp = a.config, a.config.canvas
    assert sp is not None
    d, heads, ffn = c.hidden_size, c.num_heads, c.intermediate_size
    full = _full_layers(a)
    sliding = c.num_layers - full
    expert = 3 * d * sp.expert_ffn
    head_dims = sliding * c.head_dim + full * sp.global_head_dim
    rows = [
        Component("embeddings", c.logits_size * d, c.logits_size * d, "split", False, "vocab-parallel, tied LM head"),
        Component(
            "attention Q/O",
            2 * d * heads * head_dims,
            2 * d * heads * head_dims,
            "split",
            True,
            f"{sliding} sliding-window layers (head {c.head_dim}), {full} full (head {sp.global_head_dim})",
            (
                Matrices(d * heads * head_dims, d),
                Matrices(sliding * d * heads * c.head_dim, heads * c.head_dim, inputs_split=True),
                Matrices(full * d * heads * sp.global_head_dim, heads * sp.global_head_dim, inputs_split=True),
            ),
        ),
        Component(
            "attention K/V",
            d * (2 * sliding * c.num_kv_heads * c.head_dim + full * sp.global_kv_heads * sp.global_head_dim),
            d * (2 * sliding * c.num_kv_heads * c.head_dim + full * sp.global_kv_heads * sp.global_head_dim),
            "kv",
            True,
            "full-attention layers have no v_proj (values are the keys)",
        ),
        Component(
            "dense MLP",
            (c.num_layers + 1) * 3 * d * ffn,
            (c.num_layers + 1) * 3 * d * ffn,
            "split",
            True,
            f"{c.num_layers} GELU layers beside the experts + the self-conditioning MLP, intermediate {ffn}",
            mlp_matrices(c.num_layers + 1, d, ffn),
        ),
        Component(
            "routed experts",
            c.num_layers * sp.num_experts * expert,
            c.num_layers * sp.top_k * expert,
            "split",
            True,
            f"{c.num_layers} layers x {sp.num_experts} experts; top-{sp.top_k} active per token",
            mlp_matrices(c.num_layers * sp.num_experts, d, sp.expert_ffn),
        ),
        Component(
            "router",
            c.num_layers * (sp.num_experts * d + d + sp.num_experts),
            c.num_layers * (sp.num_experts * d + d + sp.num_experts),
            "replicated",
            False,
            "projection, input scale and per-expert scale, replicated",
        ),
    ]
    norms = c.num_layers * (7 * d + 2) + 2 * head_dims + 2 * d  # layer norms and scalars, q/k norms, final, SC
    rows.append(Component("norms", norms, norms, "replicated", False, "RMSNorm weights and layer scalars"))
    return rows


def _full_layers(a: Architecture) -> int:
    return sum(1 for i in range(a.config.num_layers) if a.config.layer_type(i) == FULL_ATTENTION)


def kv_bytes_per_token(a: Architecture, s: Serving, kv_bytes: int) -> int:
    """What one more cached position adds on one rank (full-attention layers; the sliding
    ones keep a fixed window)."""
    sp = a.config.canvas
    assert sp is not None
    return 2 * _full_layers(a) * max(1, sp.global_kv_heads // s.tp) * sp.global_head_dim * kv_bytes


def cache_rows(a: Architecture, s: Serving, kv_bytes: int, act: int) -> list[Row]:
    """What each sequence keeps between decoder steps."""
    from dlm.cli.estimate.plan import Row

    c, sp = a.config, a.config.canvas
    assert sp is not None and s.context is not None and s.block_length is not None
    full = _full_layers(a)
    kv = max(1, c.num_kv_heads // s.tp) * c.head_dim
    window = min(s.context, sp.sliding_window - 1)
    sliding = 2 * (c.num_layers - full) * window * kv * kv_bytes
    per_sequence = s.context * kv_bytes_per_token(a, s, kv_bytes) + sliding
    logits = s.block_length * c.logits_size * act
    return [
        Row(
            "KV cache",
            per_sequence * s.batch,
            f"encoder prompt cache: {full} full-attention layers x {s.context} positions, "
            f"{c.num_layers - full} sliding layers x {window}; keys and values, batch {s.batch}",
        ),
        Row(
            "self-conditioning logits",
            logits * s.batch,
            f"the previous step's tempered logits, {s.block_length}-token canvas x {c.logits_size} "
            f"vocabulary, batch {s.batch}",
        ),
    ]


def transient(a: Architecture, s: Serving, act: int) -> tuple[int, str]:
    """The larger of one prompt's encoder pass and one decoder step over the batch."""
    c, sp = a.config, a.config.canvas
    assert sp is not None and s.context is not None and s.block_length is not None
    d, tp = c.hidden_size, s.tp
    q = c.num_heads // tp * max(c.head_dim, sp.global_head_dim)
    # Live per token at a layer's peak: residual, normed input, MLP input, attention output,
    # q/k/v, and the dense MLP's gate, up and activation (the experts see a top-k share).
    per_token = (4 * d + 3 * q + 3 * c.intermediate_size / tp) * act
    encoder = (s.context - s.gen_length) * per_token
    canvas = s.batch * s.block_length
    vocab = c.logits_size
    # fp32 logits, their soft-capped tanh and the capped copy over the batch's canvases; then
    # one canvas at a time: tempered logits, probabilities and the entropy's buffers.
    decoder = canvas * per_token + canvas * vocab * 4 * 3 + s.block_length * vocab * 4 * 5
    text = (
        f"larger of one {s.context - s.gen_length}-token prompt's encoder pass and a decoder step "
        f"over {s.batch} canvases of {s.block_length}: activations (attention through fused SDPA, "
        "scores not materialised), fp32 logits soft-capped, one canvas's sampler buffers"
    )
    return round(max(encoder, decoder)), text
