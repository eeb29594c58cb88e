"""`dlm estimate`: a per-GPU memory plan for serving a dLLM, from config.json alone.

Nothing is loaded and torch is never imported, so the plan answers "does it fit" on a
laptop, before any download. Parameters are counted per component from the config's own
fields as the engine itself normalises them (the family's record in dlm/engine/registry.py and
`ModelConfig`, dlm/engine/config.py: no parser of its own); for a local checkpoint or a hub
repository the count is cross-checked against the safetensors headers. Runtime memory adds what a dLLM server
holds beyond the weights: the KV cache (exact for block-causal models, approximate
prefix/dual caches for bidirectional ones), the linear-attention state of hybrid models,
the activations of one denoising forward over the canvas, MoE routing buffers, the logits
statistics of the decided positions, and a stated runtime overhead and fragmentation margin.
Every row of the plan carries the assumption it rests on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dlm.cli.estimate import canvas as canvas_terms
from dlm.cli.estimate.gpus import CATALOGUE, Gpu, find_gpu
from dlm.cli.estimate.headers import CheckpointHeaders, hub_headers, local_headers
from dlm.cli.hub import HUB_ID
from dlm.engine.compressed_tensors import read_scheme
from dlm.engine.config import NO_MASK, LinearAttentionSpec, ModelConfig, check_fits_weights, parse_config
from dlm.engine.errors import DlmError, UsageError
from dlm.engine.family_rules import fixed_block
from dlm.engine.home import expand_user
from dlm.engine.parallel.divisibility import check_tensor_parallel
from dlm.engine.params import CACHES
from dlm.engine.quantization import INT4_GROUP_SIZES, METHODS, Method, check_kv_cache_dtype, check_runs, method_named
from dlm.engine.registry import Family, family_for

GIB = 1024**3
MAX_GIB = 1 << 30  # the largest --overhead-gb or --gpu-memory planned with: an exbibyte, beyond any device


# --------------------------------------------------------------------------- architecture
@dataclass(frozen=True)
class Architecture:
    """What memory depends on: the engine's normalised config and the family's record."""

    config: ModelConfig
    family: Family

    @property
    def name(self) -> str:
        return self.family.label or self.family.name

    @property
    def attention(self) -> str:
        """`bidirectional` (approximate caches only), `block-causal` (an exact KV cache) or
        `encoder-decoder` (DiffusionGemma: the model's own prompt cache)."""
        return self.family.attention

    @property
    def full_attention_layers(self) -> int:
        return self.config.full_attention_layers

    @property
    def linear(self) -> LinearAttentionSpec | None:
        return self.config.linear

    @property
    def sub_blocks(self) -> int:
        """A block is denoised in this many sub-blocks: rows decided per forward."""
        rules = self.config.block_rules
        return rules.sub_blocks if rules is not None else 1

    @property
    def notes(self) -> tuple[str, ...]:
        mtp: tuple[str, ...] = ()
        if self.config.mtp_layers:
            mtp = (
                "multi-token-prediction layers (num_nextn_predict_layers) are not counted: "
                "dLLM decoding does not run them",
            )
        return (*mtp, *self.family.plan_notes)

    def kv_bytes_per_token(self, kv_bytes: int, tp: int = 1, scale_bytes: int = 0) -> int:
        """Keys + values one cached token adds on one rank: full-attention layers only (a
        hybrid's DeltaNet layers keep fixed state instead); KV heads split over TP, each
        rank keeping at least one; `scale_bytes` per head vector (int8's scale)."""
        c = self.config
        return 2 * c.full_attention_layers * max(1, c.num_kv_heads // tp) * (c.head_dim * kv_bytes + scale_bytes)


def architecture_from_config(raw: dict[str, Any]) -> Architecture:
    """The family's record and the engine's own normalisation (dlm/engine/config.py), so the
    plan sizes what the engine builds. The MASK id matters only for decoding: a config
    without one (SDAR's published files) is still planned, as a family without a MASK."""
    family = family_for(raw, planning=True)
    reading = family if "mask_token_id" in raw else replace(family, mask_token_id=NO_MASK)
    return Architecture(parse_config(raw, reading), family)


# --------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class Matrices:
    """Parameters of a component's weight matrices that share one input width. A quantized
    format's bytes depend on it: a scale per group of inputs, and CUDA int4 pads the inputs
    of every matrix to its tile (dlm/engine/quantization.py)."""

    params: int
    inputs: int
    inputs_split: bool = False  # row-parallel under TP: each rank holds inputs / tp of every row


@dataclass(frozen=True)
class Component:
    """One group of parameters, with how it is placed under tensor parallelism."""

    name: str
    params: int
    active: int  # parameters one token's forward uses
    tp: str  # "split" | "kv" (split by KV head, replicated below one head per rank) | "replicated"
    quantized: bool  # takes the weight format (linear layers); False: kept in 16 bits
    assumption: str
    # Quantized components: their params by input width (empty: all of them take the hidden size).
    matrices: tuple[Matrices, ...] = ()


def mlp_matrices(count: int, d: int, ffn: int) -> tuple[Matrices, ...]:
    """`count` gated MLPs of intermediate `ffn`: gate and up read the hidden size, down (row
    parallel) the intermediate."""
    return (Matrices(count * 2 * d * ffn, d), Matrices(count * d * ffn, ffn, inputs_split=True))


def parameter_components(a: Architecture) -> list[Component]:
    """Per-component counts from config fields alone (equal to the checkpoint's tensors)."""
    if a.config.canvas is not None:
        return canvas_terms.components(a)
    d, hd, n_full = a.config.hidden_size, a.config.head_dim, a.full_attention_layers
    q = a.config.num_heads * hd
    q_out = 2 * q if a.config.q_gate else q
    kv = a.config.num_kv_heads * hd
    rows: list[Component] = []

    def add(
        name: str,
        params: int,
        tp: str,
        quantized: bool,
        assumption: str,
        active: int | None = None,
        matrices: tuple[Matrices, ...] = (),
    ) -> None:
        if params:
            active = params if active is None else active
            rows.append(Component(name, params, active, tp, quantized, assumption, matrices))

    add("embeddings", a.config.logits_size * d, "split", False, "vocab-parallel; not quantized")
    add(
        "attention Q/O",
        n_full * (d * q_out + q * d + (q_out if a.config.qkv_bias else 0) + (d if a.config.o_bias else 0)),
        "split",
        True,
        f"{n_full} full-attention layers, {a.config.num_heads} heads split by TP"
        + ("; q_proj also emits the output gate" if a.config.q_gate else ""),
        matrices=(Matrices(n_full * d * q_out, d), Matrices(n_full * q * d, q, inputs_split=True)),
    )
    add(
        "attention K/V",
        n_full * 2 * (kv * d + (kv if a.config.qkv_bias else 0)),
        "kv",
        True,
        f"{a.config.num_kv_heads} KV heads; replicated where TP exceeds them",
    )
    if a.linear is not None:
        la = a.linear
        v = la.value_heads * la.value_dim
        per_layer = (
            d * la.conv_dim
            + d * v
            + 2 * d * la.value_heads  # in_proj_qkv, _z, _b, _a
            + la.conv_dim * la.conv_kernel
            + 2 * la.value_heads
            + v * d
        )  # conv1d, dt_bias, A_log, out_proj
        add(
            "linear attention (GDN)",
            la.layers * per_layer,
            "split",
            True,
            f"{la.layers} Gated DeltaNet layers, heads split by TP",
            matrices=(
                Matrices(la.layers * (d * la.conv_dim + d * v + 2 * d * la.value_heads), d),
                Matrices(la.layers * v * d, v, inputs_split=True),
            ),
        )
    add(
        "dense MLP",
        a.config.dense_layers
        * (3 * d * a.config.intermediate_size + (2 * a.config.intermediate_size + d if a.config.mlp_bias else 0)),
        "split",
        True,
        f"{a.config.dense_layers} SwiGLU layers, intermediate {a.config.intermediate_size}",
        matrices=mlp_matrices(a.config.dense_layers, d, a.config.intermediate_size),
    )
    if a.config.moe is not None:
        m = a.config.moe
        expert = 3 * d * m.expert_ffn
        add(
            "routed experts",
            len(m.layers) * m.num_experts * expert,
            "split",
            True,
            f"{len(m.layers)} MoE layers x {m.num_experts} experts; top-{m.top_k} active per token; "
            "sharded by TP (EP holds the same bytes per rank)",
            active=len(m.layers) * m.top_k * expert,
            matrices=mlp_matrices(len(m.layers) * m.num_experts, d, m.expert_ffn),
        )
        add(
            "shared experts",
            len(m.layers) * (3 * d * m.shared_ffn + (d if m.shared_gate else 0)),
            "split",
            True,
            f"intermediate {m.shared_ffn}, always active",
            matrices=mlp_matrices(len(m.layers), d, m.shared_ffn),
        )
        add(
            "router",
            len(m.layers) * (m.num_experts * d + (m.num_experts if m.router_bias else 0)),
            "replicated",
            False,
            "replicated, kept in 16 bits (routing in fp32)",
        )
    norms = (2 * a.config.num_layers + 1) * d + (2 * hd * n_full if a.config.qk_norm else 0)
    norms += a.linear.layers * a.linear.value_dim if a.linear is not None else 0
    add("norms", norms, "replicated", False, "RMSNorm weights, replicated")
    if not a.config.tie_word_embeddings:
        add("LM head", a.config.logits_size * d, "split", False, "vocab-parallel; not quantized")
    return rows


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int
    non_embedding: int
    active_non_embedding: int
    active_without_input_embedding: int


def count_parameters(components: list[Component]) -> ParameterCount:
    embedding = sum(c.params for c in components if c.name in ("embeddings", "LM head"))
    total = sum(c.params for c in components)
    active = sum(c.active for c in components)
    lookup = sum(c.params for c in components if c.name == "embeddings")
    return ParameterCount(total, active, total - embedding, active - embedding, active - lookup)


# --------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class WeightFormat:
    bits: int
    scale_bytes: float = 0.0  # per group of `group` weights
    group: int = 0
    assumption: str = ""
    torch_dtype: str = ""  # the engine's name for it (`dlm serve --dtype`)

    def bytes_per_param(self, group_size: int) -> float:
        group = self.group or group_size
        return self.bits / 8 + (self.scale_bytes / group if self.scale_bytes else 0.0)


# The activation (and unquantized weight) dtypes; quantized formats are the engine's
# methods (dlm/engine/quantization.py), `--quantization`.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat(32, assumption="fp32", torch_dtype="float32"),
    "bf16": WeightFormat(16, assumption="bf16", torch_dtype="bfloat16"),
    "fp16": WeightFormat(16, assumption="fp16", torch_dtype="float16"),
}
ALIASES = {
    "auto": "bf16",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
}
KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# Bytes beside each cached head vector: int8's float32 scale (dlm/engine/runtime/kv_cache.py).
KV_SCALE_BYTES = {"int8": 4}


def weight_format(name: str) -> str:
    """The activation dtype `--dtype` names; a quantization method (the older spelling
    `--dtype int4`) is returned as is, for `Serving.resolved` to read as `--quantization`."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in WEIGHT_FORMATS and key not in METHODS:
        raise UsageError(f"unknown --dtype {name!r}; use one of auto, {', '.join(WEIGHT_FORMATS)}")
    return key


# --------------------------------------------------------------------------- serving plan
LOGITS = ("fused", "unfused")
DEVICES = ("cuda", "cpu")  # what `dlm estimate --device` plans for
STATS_CHUNK = 16384  # vocabulary chunk of dlm/kernels/token_stats.py
DEFAULT_CONTEXT = 4096  # tokens per sequence planned without --context, if the model takes that many
DEFAULT_BLOCK_LENGTH = 32  # the engine's block for a model without its own (dlm/engine/params.py)


@dataclass(frozen=True)
class Serving:
    """What the server will run: its parallelism, batch and sequence shape."""

    dtype: str = "auto"
    kv_dtype: str = "auto"
    tp: int = 1
    batch: int = 1
    context: int | None = None  # tokens per sequence, prompt + generation (default: min(max_position, DEFAULT_CONTEXT))
    gen_length: int = 256
    block_length: int | None = None  # None: the model's, as the engine takes it (`model_block_length`)
    cache: str = "auto"
    logits: str = "fused"
    prefill_chunk: int | None = 8192  # tokens per prefill forward (chunked prefill); None: whole prompts
    overhead_gib: float | None = None  # default 1.0, +0.5 with TP > 1
    fragmentation: float = 0.10
    quantization: str | None = None  # a method of dlm/engine/quantization.py, or None
    group_size: int | None = None  # int4 inputs per scale; None: what the loader picks
    device: str = "cuda"  # the device type planned for (DEVICES): a quantized layout's padding is per device

    @property
    def method(self) -> Method | None:
        return method_named(self.quantization)

    def resolved(self, a: Architecture) -> Serving:
        """Fill defaults and reject impossible combinations with one clear message."""
        fmt = weight_format(self.dtype)
        method = method_named(self.quantization)
        if fmt in METHODS:  # `--dtype int4`: the older spelling of bf16 with --quantization int4
            if self.quantization is not None and (method is None or method.name != fmt):
                raise UsageError(
                    f"--dtype {fmt} and --quantization {self.quantization} disagree: give --quantization only"
                )
            method, fmt = METHODS[fmt], "bf16"
        if self.group_size is not None:  # groups the int4 kernels take, as the loader refuses others
            if method is None or method.scale != "group":
                raise UsageError("--group-size applies to --quantization int4 only (its inputs per scale)")
            if self.group_size not in INT4_GROUP_SIZES:
                raise UsageError(
                    f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} "
                    f"(the groups the int4 kernels take), got {self.group_size}"
                )
        kv = self.kv_dtype.lower()
        kv = ALIASES.get(kv, kv) if kv != "auto" else ("fp32" if fmt == "fp32" else "fp16" if fmt == "fp16" else "bf16")
        if kv not in KV_BYTES:
            raise UsageError(f"unknown --kv-dtype {self.kv_dtype!r}; use auto, {', '.join(KV_BYTES)}")
        if kv == "int8":  # what `--kv-cache-dtype int8` stores, where serving can store it
            check_kv_cache_dtype(kv, a.family)
        longest = a.config.max_position_embeddings
        context = self.context if self.context is not None else min(longest, DEFAULT_CONTEXT)
        cache = self.cache
        if cache not in CACHES:
            raise UsageError(f"--cache must be one of {', '.join(CACHES)}, got {cache!r}")
        if cache == "auto":
            cache = "block" if a.attention == "block-causal" else "none"
        if cache != "none" and a.attention == "encoder-decoder":
            raise UsageError(f"{a.name} keeps its prompt KV cache itself: use --cache none (or auto)")
        if cache == "block" and a.attention != "block-causal":
            raise UsageError(
                f"{a.name} attends bidirectionally: it has no exact block KV cache (use --cache none, prefix or dual)"
            )
        if cache in ("prefix", "dual") and a.attention != "bidirectional":
            raise UsageError(f"{a.name} is block-causal: its cache is the exact --cache block")
        if self.logits not in LOGITS:
            raise UsageError(f"--logits must be fused or unfused, got {self.logits!r}")
        if self.logits == "unfused" and a.attention == "encoder-decoder":  # planned as fused, without a word
            raise UsageError(
                f"{a.name} samples from the whole canvas's fp32 logits (its self-conditioning keeps them): "
                "--logits does not apply"
            )
        block = model_block_length(a.config) if self.block_length is None else self.block_length
        for name, value in (
            ("tp", self.tp),
            ("batch", self.batch),
            ("gen-length", self.gen_length),
            ("block-length", block),
        ):
            if value < 1:
                raise UsageError(f"--{name} must be at least 1, got {value}")
        if context <= self.gen_length and self.context is not None:
            raise UsageError(
                f"--context ({context}) must exceed --gen-length ({self.gen_length}): "
                "it counts the prompt and the generation"
            )
        if context <= self.gen_length and self.gen_length >= longest:  # no --context: the model's length
            raise UsageError(
                f"--gen-length ({self.gen_length}) leaves no room for a prompt in the model's maximum "
                f"length ({longest} tokens, config.json): "
                + (f"give a --gen-length below {longest}" if longest > 1 else "it holds no prompt and answer")
            )
        if context <= self.gen_length:  # no --context: dlm's default, shorter than the model's length
            raise UsageError(
                f"--gen-length ({self.gen_length}) leaves no room for a prompt in the default context "
                f"({context} tokens): give a --context above it (the model takes up to {longest}) or a "
                "shorter --gen-length"
            )
        if block > longest:  # as the engine refuses it (dlm/engine/params.py)
            raise UsageError(
                f"--block-length ({block}) exceeds the model's maximum length of {longest} tokens (config.json)"
            )
        if (fixed := fixed_block(a.config)) is not None and block != fixed:  # as the engine refuses it
            raise UsageError(f"{a.name} decodes {fixed}-token blocks only: leave --block-length out or give {fixed}")
        if not 0 <= self.fragmentation < 1:
            raise UsageError(f"--fragmentation must be in [0, 1), got {self.fragmentation}")
        if self.overhead_gib is not None:
            check_gib("--overhead-gb", self.overhead_gib, positive=False)
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise UsageError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        check_tensor_parallel(a.config, self.tp)
        device = self.device.lower().partition(":")[0]  # `dlm serve`'s spellings: cuda:1 plans as cuda
        if device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if method is not None:
            check_runs(method, device, WEIGHT_FORMATS[fmt].torch_dtype)
        quantization = None if method is None else method.name
        return replace(
            self,
            dtype=fmt,
            kv_dtype=kv,
            context=context,
            block_length=block,
            cache=cache,
            quantization=quantization,
            device=device,
        )


def model_block_length(config: ModelConfig) -> int:
    """The block the engine decodes when none is given (`family_rules.with_defaults`): the
    family's trained block length (SDAR's 4, Clover's 32), DiffusionGemma's canvas, else 32.
    The plan took 32 whatever the model: a DiffusionGemma of a 256-token canvas was planned
    with a 32-token one (its logits an eighth of what it holds)."""
    return config.block_length if config.block_length is not None else DEFAULT_BLOCK_LENGTH


def check_gib(flag: str, value: float, positive: bool) -> None:
    """Refuse a GiB amount that is not a finite number > 0 (>= 0 unless `positive`) up to
    MAX_GIB: NaN passes every comparison, and inf (or a number whose bytes overflow a float)
    cannot be rounded to bytes."""
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise UsageError(f"{flag} must be a finite number {'> 0' if positive else '>= 0'}, got {value:g}")
    if value > MAX_GIB:
        raise UsageError(f"{flag} must be at most {MAX_GIB} GiB (an exbibyte), got {value:g}")


def valid_tps(a: Architecture, limit: int = 64) -> list[int]:
    out = []
    tp = 1
    while tp <= limit:
        try:
            check_tensor_parallel(a.config, tp)
            out.append(tp)
        except UsageError:
            pass
        tp *= 2
    return out


@dataclass(frozen=True)
class Row:
    name: str
    bytes: int
    assumption: str


@dataclass
class MemoryPlan:
    rows: list[Row]
    peak_transient: int  # max(forward + routing, logits): the two never coexist
    total: int
    notes: list[str] = field(default_factory=list)
    # What one sequence holds on one rank, for capacity planning beyond this plan's shape:
    kv_bytes_per_token: int = 0  # grows with every cached token
    linear_state_bytes: int = 0  # fixed (hybrids: DeltaNet recurrent + conv state; else 0)


def _act_bytes(s: Serving) -> int:
    return 4 if s.dtype == "fp32" else 2


def _quant_text(method: Method, inputs: int, group: int | None) -> str:
    if method.scale == "row":
        return f"{method.name}: {method.description}"
    return f"{method.name}: int{method.bits} weights, a scale and zero per {group or method.group_size(inputs)} inputs"


def _weight_rows(a: Architecture, comps: list[Component], s: Serving) -> list[Row]:
    fmt = WEIGHT_FORMATS[s.dtype]
    plain_bpp = 4 if s.dtype == "fp32" else 2
    method = s.method
    d = a.config.hidden_size
    quant_text = fmt.assumption if method is None else _quant_text(method, d, s.group_size)
    kv_share = max(1, a.config.num_kv_heads // s.tp) / a.config.num_kv_heads
    rows = []
    for c in comps:
        if c.tp == "split":
            share, place = 1 / s.tp, f"1/{s.tp} per rank" if s.tp > 1 else "one rank"
        elif c.tp == "kv":
            share = kv_share
            place = f"{max(1, a.config.num_kv_heads // s.tp)} of {a.config.num_kv_heads} KV heads per rank" + (
                " (replicated)" if a.config.num_kv_heads < s.tp else ""
            )
        else:
            share, place = 1.0, "replicated on every rank"
        weight_bytes: float = c.params * plain_bpp
        if c.quantized and method is not None:
            # Each matrix at its rank's input width, in the groups the loader takes for the
            # whole row, refused where the loader refuses (no group divides the row, or a
            # rank's shard would cut one); what no matrix counts (biases, the DeltaNet
            # convolution) stays in the activation dtype.
            matrices = c.matrices or (Matrices(c.params, d),)
            quantized = sum(m.params for m in matrices)
            weight_bytes = (c.params - quantized) * plain_bpp
            for m in matrices:
                group = s.group_size or method.group_for(m.inputs, f"the {c.name}")
                local = m.inputs // s.tp if m.inputs_split and c.tp == "split" else m.inputs
                if local != m.inputs:
                    method.check_split(m.inputs, local, group, f"the {c.name}")
                weight_bytes += m.params * method.bytes_per_param(local, plain_bpp, s.device, group)
        dtype = quant_text if c.quantized else ("fp32" if s.dtype == "fp32" else "16-bit")
        rows.append(
            Row(
                f"weights: {c.name}",
                round(weight_bytes * share),
                f"{c.params:,} params, {dtype}, {place}; {c.assumption}",
            )
        )
    return rows


def _layer_peak_elements(a: Architecture, s: Serving) -> tuple[float, str]:
    """Activation elements per forward token at a layer's peak, in an eager engine that keeps
    a layer's tensors alive until it returns (the residual in, normed input, q/k/v and the
    rotated q/k) while the MLP intermediates are allocated."""
    tp, d = s.tp, a.config.hidden_size
    q = a.config.num_heads * a.config.head_dim / tp
    kv = max(1, a.config.num_kv_heads // tp) * a.config.head_dim
    q_out = 2 * q if a.config.q_gate else q
    attn_held = 2 * d + (q_out + 2 * kv) + q + kv
    attn_phase = attn_held + 2 * q + 2 * d  # attention output, merged heads, o_proj, residual
    if a.config.moe is not None:
        m = a.config.moe
        mlp = 4 * m.top_k * m.expert_ffn / tp + 4 * m.shared_ffn / tp + d
        mlp_text = f"top-{m.top_k} expert and shared-expert SwiGLU intermediates"
    else:
        mlp = 4 * a.config.intermediate_size / tp
        mlp_text = "SwiGLU gate/up, activation and product"
    if a.config.moe is not None and a.config.dense_layers:
        mlp = max(mlp, 4 * a.config.intermediate_size / tp)
    peaks = [attn_phase, attn_held + d + mlp]
    if a.linear is not None:
        la = a.linear
        conv, v = la.conv_dim / tp, la.value_heads * la.value_dim / tp
        gdn_held = 2 * d + 2 * conv + 3 * v + 2 * la.value_heads / tp  # projections, conv out, core, gated norm
        peaks.append(gdn_held + d + mlp)
    text = f"per token: residual stream, normed input, q/k/v and rotated q/k kept live, plus {mlp_text}" + (
        "; GDN layers: projections, conv output and recurrence output (approximate)" if a.linear else ""
    )
    return max(peaks), text


def plan_memory(a: Architecture, comps: list[Component], serving: Serving) -> MemoryPlan:
    s = serving.resolved(a)
    assert s.context is not None and s.block_length is not None  # resolved
    act = _act_bytes(s)
    kv_bytes = KV_BYTES[s.kv_dtype]
    tp, d = s.tp, a.config.hidden_size
    prompt = s.context - s.gen_length
    rows = _weight_rows(a, comps, s)
    notes = list(a.notes)
    if s.context > a.config.max_position_embeddings:
        notes.append(
            f"context {s.context} exceeds the model's max_position_embeddings ({a.config.max_position_embeddings})"
        )

    if a.config.canvas is not None:
        return _canvas_plan(a, s, rows, notes)

    # Cache: what each sequence keeps between forwards.
    kv_heads_rank = max(1, a.config.num_kv_heads // tp)
    per_token_kv = a.kv_bytes_per_token(kv_bytes, tp, KV_SCALE_BYTES.get(s.kv_dtype, 0))
    # The prefix cache's largest is the context less the last block, which is shorter than
    # --block-length when that does not divide --gen-length (the whole answer when it exceeds
    # it): `context - block_length` went negative (a negative KV cache) past the context.
    last_block = s.gen_length - (-(-s.gen_length // s.block_length) - 1) * s.block_length
    prefix = s.context - last_block
    cached_tokens = {"none": 0, "block": s.context, "dual": s.context, "prefix": prefix}[s.cache]
    kv_text = {
        "none": "no cache: every forward recomputes the whole sequence",
        "block": f"exact block KV cache over the whole context ({s.context} tokens)"
        + (f", full-attention layers only ({a.full_attention_layers} of {a.config.num_layers})" if a.linear else ""),
        "dual": f"approximate dual cache (Fast-dLLM): K/V of all {s.context} tokens, refreshed every block",
        "prefix": f"approximate prefix cache (Fast-dLLM): K/V of up to {prefix} prefix tokens, refreshed every block",
    }[s.cache]
    rows.append(
        Row(
            "KV cache",
            per_token_kv * cached_tokens * s.batch,
            f"{kv_text}; {s.kv_dtype}{' (+ a 4-byte scale per head vector)' if s.kv_dtype in KV_SCALE_BYTES else ''}, "
            f"{kv_heads_rank} KV heads x {a.config.head_dim} per rank, batch {s.batch}",
        )
    )
    state = a.linear.state_bytes(act, tp) if a.linear is not None else 0
    if a.linear is not None:
        la = a.linear
        rows.append(
            Row(
                "linear-attention state",
                state * s.batch,
                f"{state:,} bytes per sequence whatever its length: per GDN layer ({la.layers}), "
                f"fp32 recurrent state [{la.value_heads // tp} heads, {la.key_dim}, {la.value_dim}] "
                f"+ conv state of {la.conv_kernel - 1} rows x {la.conv_dim // tp} channels; "
                f"batch {s.batch}",
            )
        )

    # Tokens in the largest forward.
    if s.cache == "block":
        prefill = s.batch * prompt if s.prefill_chunk is None else min(s.batch * prompt, s.prefill_chunk)
        tokens = max(s.batch * s.block_length, prefill)
        fwd_text = (
            f"largest forward: {tokens} tokens (prefill of {s.batch} x {prompt}-token prompts"
            + (f" in chunks of {s.prefill_chunk}" if s.prefill_chunk else " at once")
            + f", or {s.batch} x {s.block_length}-token blocks)"
        )
    else:
        tokens = s.batch * s.context
        fwd_text = (
            f"largest forward: {tokens} tokens ({s.batch} x the whole {s.context}-token canvas"
            + (", the per-block cache refresh" if s.cache != "none" else "")
            + ")"
        )
    elements, layer_text = _layer_peak_elements(a, s)
    per_token = elements * act + 8 * a.config.rotary_dim + 16  # + fp32 cos/sin, int64 ids and positions
    forward = round(tokens * per_token)
    rows.append(
        Row(
            "forward activations",
            forward,
            f"{fwd_text}; {layer_text}; fp32 rotary tables; attention scores never materialised "
            "(flash / memory-efficient SDPA)",
        )
    )
    routing = 0
    if a.config.moe is not None:
        m = a.config.moe
        routing = round(tokens * (2 * m.num_experts * 4 + m.top_k * 12 + 2 * m.top_k * d * act))
        rows.append(
            Row(
                "MoE routing buffers",
                routing,
                f"per token: fp32 router logits and scores over {m.num_experts} experts, top-{m.top_k} "
                "ids and weights, hidden states permuted to and gathered back from the experts",
            )
        )
    # Logits statistics at the decided positions of one sequence: dlm's runners call the LM
    # head per sequence, so a batch does not multiply this buffer.
    decided = -(-s.block_length // a.sub_blocks)
    vocab_rank = -(-a.config.logits_size // tp)
    unit = f"{'sub-' if a.sub_blocks > 1 else ''}block"
    if s.logits == "fused":
        logits = decided * min(vocab_rank, STATS_CHUNK) * 4 * 4
        logits_text = (
            f"{decided} decided positions (one {unit}, one sequence at a time) x vocabulary chunks "
            f"of {STATS_CHUNK}: four fp32 buffers (logits, shifted, exponentials, products), as the "
            "torch twin holds them; a fused kernel needs less"
        )
    else:
        logits = decided * vocab_rank * (act + 4 + 4)
        logits_text = (
            f"{decided} decided positions (one {unit}, one sequence at a time) x {vocab_rank} "
            "vocabulary rows per rank: logits, their fp32 copy and the softmax"
        )
    rows.append(
        Row(
            "logits/statistics buffer",
            logits,
            f"{logits_text}; runs after the forward, so the peak counts the larger of the two",
        )
    )
    peak_transient = max(forward + routing, logits)
    return _finish(rows, notes, s, peak_transient, per_token_kv, state)


def _canvas_plan(a: Architecture, s: Serving, rows: list[Row], notes: list[str]) -> MemoryPlan:
    """DiffusionGemma: its encoder cache, self-conditioning logits and canvas step (canvas.py)."""
    act, kv_bytes = _act_bytes(s), KV_BYTES[s.kv_dtype]
    rows += canvas_terms.cache_rows(a, s, kv_bytes, act)
    peak, text = canvas_terms.transient(a, s, act)
    rows.append(Row("forward activations", peak, text))
    return _finish(rows, notes, s, peak, canvas_terms.kv_bytes_per_token(a, s, kv_bytes), 0)


def _finish(
    rows: list[Row], notes: list[str], s: Serving, peak_transient: int, per_token_kv: int, state: int
) -> MemoryPlan:
    """Overhead and fragmentation rows, and the total."""
    tp = s.tp
    overhead = s.overhead_gib if s.overhead_gib is not None else (1.0 + (0.5 if tp > 1 else 0.0))
    rows.append(
        Row(
            "runtime overhead",
            round(overhead * GIB),
            f"CUDA context, cuBLAS/attention workspaces{', NCCL buffers' if tp > 1 else ''}: "
            f"{overhead:g} GiB assumed (--overhead-gb)",
        )
    )
    cached = ("KV cache", "linear-attention state", "self-conditioning logits")
    cache_bytes = sum(r.bytes for r in rows if r.name in cached)
    frag = round(s.fragmentation * (cache_bytes + peak_transient))
    rows.append(
        Row(
            "fragmentation margin",
            frag,
            f"{s.fragmentation:.0%} of cache and peak transient memory lost to allocator fragmentation "
            "(--fragmentation)",
        )
    )
    weights = sum(r.bytes for r in rows if r.name.startswith("weights:"))
    total = weights + cache_bytes + peak_transient + round(overhead * GIB) + frag
    return MemoryPlan(rows, peak_transient, total, notes, per_token_kv, state)


# --------------------------------------------------------------------------- verdicts
def smallest_tp(a: Architecture, comps: list[Component], serving: Serving, capacity: int) -> int | None:
    for tp in valid_tps(a):
        try:
            plan = plan_memory(a, comps, replace(serving, tp=tp))
        except UsageError:  # the serving shape was checked at its own TP: this TP cuts int4 groups
            continue
        if plan.total <= capacity:
            return tp
    return None


def max_batch(a: Architecture, comps: list[Component], serving: Serving, capacity: int, limit: int = 1 << 16) -> int:
    """Largest batch whose plan fits `capacity` at the given TP and context (0: none)."""

    def fits(b: int) -> bool:
        return plan_memory(a, comps, replace(serving, batch=b)).total <= capacity

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------- inputs
@dataclass
class ModelSource:
    label: str
    kind: str  # "checkpoint" | "store" | "config" | "hub"
    raw: dict[str, Any]
    headers: CheckpointHeaders | None
    header_note: str | None = None


class HubUnreachable(DlmError):
    """A hub repo's config.json could not be read (offline, unreachable): what to give
    instead depends on the command (`dlm deploy kubernetes` says --estimate-from)."""

    def __init__(self, repo_id: str, why: str) -> None:
        super().__init__(
            f"cannot read {repo_id!r} from the Hugging Face hub ({why}); "
            "pass a local checkpoint directory or a config.json instead"
        )
        self.repo_id, self.why = repo_id, why


def load_source(spec: str, revision: str | None = None) -> ModelSource:
    """A checkpoint directory, a store model, a bare config.json, or a hub repo id
    (config + headers only)."""
    from dlm.cli.store.resolve import resolve_model
    from dlm.engine.config import read_config_json

    if not spec.strip():  # Path("") is the current directory, and the engine's "" the default model
        raise UsageError("the model to plan (MODEL_OR_CONFIG, or --estimate-from) is empty")
    path = expand_user(spec, "MODEL")
    if not path.exists() and HUB_ID.match(spec):  # store names never contain "/"
        return _hub_source(spec, revision)
    if revision is not None:  # taken and ignored before: a path or a store version is what it is
        from dlm.cli.store.fetch import LOCAL_REVISION

        raise UsageError(f"{LOCAL_REVISION}, a config.json or a store name ({spec!r} is not a hub repo id)")
    if path.is_file():
        return ModelSource(str(path), "config", read_config_json(path), None, "a bare config.json has no weights")
    directory = resolve_model(spec)  # a checkpoint directory, or a store NAME[@VERSION]
    headers = local_headers(directory)
    return ModelSource(
        str(directory),
        "checkpoint" if path.is_dir() else "store",
        read_config_json(directory),
        headers,
        None if headers else "no safetensors files next to config.json",
    )


def _hub_source(repo_id: str, revision: str | None) -> ModelSource:
    import json

    import httpx
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError

    from dlm.cli.hub import hub_status

    status = hub_status()  # at once, not after huggingface_hub's retries
    if status.problem is not None and not status.offline:
        raise HubUnreachable(repo_id, status.problem)
    try:  # in offline mode, from the local hub cache if it holds the file
        config_path = hf_hub_download(repo_id, "config.json", revision=revision)
    except RepositoryNotFoundError as exc:  # also gated repositories
        raise UsageError(f"hub repository {repo_id!r} not found or not accessible: {type(exc).__name__}") from None
    except RemoteEntryNotFoundError:
        raise UsageError(f"hub repository {repo_id!r} has no config.json") from None
    except (OSError, httpx.HTTPError) as exc:  # offline (LocalEntryNotFoundError), unreachable, HTTP errors
        raise HubUnreachable(repo_id, f"offline or unreachable: {type(exc).__name__}") from None
    try:
        raw = json.loads(Path(config_path).read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"config.json of {repo_id} is not valid JSON: {exc}") from None
    note = None
    try:
        headers = hub_headers(repo_id, revision)
        if headers is None:
            note = "the repository has no safetensors weights"
    except (OSError, httpx.HTTPError) as exc:
        headers, note = None, f"safetensors headers unavailable ({type(exc).__name__})"
    return ModelSource(f"hf://{repo_id}", "hub", raw, headers, note)


# --------------------------------------------------------------------------- report
def _checkpoint_quantization(raw: dict[str, Any], serving: Serving) -> tuple[Serving, str | None]:
    """A pre-quantized checkpoint is planned as `dlm serve` loads it (its own method) unless
    the command line names one; the note says so (its headers count packed tensors)."""
    try:
        scheme = read_scheme(raw)
    except UsageError as exc:
        return serving, f"its quantization_config cannot be served by dlm ({exc}); planned as given"
    if scheme is None:
        return serving, None
    if serving.quantization is None and weight_format(serving.dtype) not in METHODS:
        serving = replace(serving, quantization=scheme.method, group_size=serving.group_size or scheme.group_size)
    return serving, (
        f"pre-quantized checkpoint (compressed-tensors {scheme.method}, format {scheme.format}): "
        "header counts are of its packed data and scales"
    )


def estimate(
    spec: str,
    serving: Serving,
    gpu: str | None = None,
    gpu_memory_gib: float | None = None,
    revision: str | None = None,
) -> dict[str, Any]:
    """The full plan as a JSON-ready dict (what `dlm estimate --json` prints)."""
    source = load_source(spec, revision)
    return plan_report(source, serving, gpu, gpu_memory_gib)


def plan_report(
    source: ModelSource,
    serving: Serving,
    gpu: str | None = None,
    gpu_memory_gib: float | None = None,
) -> dict[str, Any]:
    arch = architecture_from_config(source.raw)
    if source.headers is not None:  # a plan of other weights than these says nothing of them
        check_fits_weights(arch.config, source.headers.parameter_count)
    comps = parameter_components(arch)
    counts = count_parameters(comps)
    serving, scheme_note = _checkpoint_quantization(source.raw, serving)
    plan = plan_memory(arch, comps, serving)
    if scheme_note:
        plan.notes.append(scheme_note)
    resolved = serving.resolved(arch)
    checkpoint = None
    if source.headers is not None:
        in_headers = source.headers.parameter_count
        checkpoint = {
            "source": source.headers.source,
            "params_in_headers": in_headers,
            "bytes_in_headers": source.headers.nbytes,
            "params_by_dtype": source.headers.count_by_dtype(),
            "matches_config": in_headers == counts.total,
            "difference": in_headers - counts.total,
        }
    targets: list[Gpu] = []
    if gpu is not None and gpu_memory_gib is not None:  # one was dropped without a word (even an unknown --gpu)
        raise UsageError(f"--gpu {gpu} and --gpu-memory {gpu_memory_gib:g} both name the GPU to judge: give one")
    if gpu_memory_gib is not None:
        check_gib("--gpu-memory", gpu_memory_gib, positive=True)
        targets = [Gpu(f"{gpu_memory_gib:g} GiB", round(gpu_memory_gib * 1024))]
    elif gpu is not None:
        targets = [find_gpu(gpu)]
    notes = list(plan.notes)
    if not targets and resolved.device == "cpu":  # a GPU catalogue says nothing of a host
        notes.append("planned for a CPU: no GPU verdicts; --gpu-memory GiB judges a host's memory")
    elif not targets:
        targets = list(CATALOGUE)
    verdicts = [_verdict(arch, comps, resolved, plan, g) for g in targets]
    return {
        "model": {
            "source": source.label,
            "kind": source.kind,
            "family": arch.name,
            "model_type": arch.config.model_type,
            "attention": arch.attention,
            "layers": arch.config.num_layers,
            "full_attention_layers": arch.full_attention_layers,
            "hidden_size": arch.config.hidden_size,
            "heads": arch.config.num_heads,
            "kv_heads": arch.config.num_kv_heads,
            "head_dim": arch.config.head_dim,
            "vocab": arch.config.logits_size,
            "max_position": arch.config.max_position_embeddings,
            "moe": {**asdict(arch.config.moe), "layers": len(arch.config.moe.layers)} if arch.config.moe else None,
            "linear_attention": asdict(arch.linear) if arch.linear else None,
        },
        "parameters": {
            **asdict(counts),
            "components": [asdict(c) for c in comps],
            "active_convention": "active counts every non-expert weight (embeddings and LM head included, "
            "as model cards do) plus the top-k routed experts",
        },
        "checkpoint": checkpoint,
        "checkpoint_note": source.header_note,
        "serving": asdict(resolved),
        "memory_per_gpu": {
            "rows": [asdict(r) for r in plan.rows],
            "peak_transient_bytes": plan.peak_transient,
            "total_bytes": plan.total,
            "per_sequence": {
                "kv_bytes_per_token": plan.kv_bytes_per_token,
                "linear_state_bytes": plan.linear_state_bytes,
            },
        },
        "verdicts": verdicts,
        "notes": notes,
    }


def _verdict(a: Architecture, comps: list[Component], s: Serving, plan: MemoryPlan, gpu: Gpu) -> dict[str, Any]:
    capacity = gpu.memory_bytes
    return {
        "gpu": gpu.name,
        "memory_bytes": capacity,
        "fits": plan.total <= capacity,
        "headroom_bytes": capacity - plan.total,
        "smallest_tp": smallest_tp(a, comps, s, capacity),
        "max_batch": max_batch(a, comps, s, capacity),
    }
