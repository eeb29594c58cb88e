"""ModelConfig: one normalised, typed view of any supported checkpoint's `config.json`.

Every family spells the same idea differently (LLaDA's `d_model`/`n_layers`, Qwen's
`hidden_size`/`num_hidden_layers`, LLaDA2's `first_k_dense_replace` beside SDAR's
`decoder_sparse_step`, ...). The family's registry record (dlm/engine/registry.py) says which
spelling its config uses and declares its own facts (MASK id, biases, MoE placement, block
size, logit shift); the readers here turn the file into `ModelConfig`, computed once. The
engine's models and `dlm estimate` read only this normalised form, never the raw file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlm.engine.errors import InvalidConfig, UsageError

if TYPE_CHECKING:
    from dlm.engine.registry import BlockRules, Family

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
NO_MASK = -1  # the mask_token_id of a model without a MASK token (a family declares it)
PLAIN_ROPE = ("default", "mrope")  # rope_scaling types that rotate text positions as plain RoPE


@dataclass(frozen=True)
class MoESpec:
    """The mixture of experts of the layers listed in `layers` (the others are dense)."""

    layers: tuple[int, ...]  # indices of the decoder layers whose MLP is a mixture of experts
    num_experts: int
    top_k: int
    expert_ffn: int  # intermediate size of one routed expert
    shared_ffn: int = 0  # intermediate size of the shared expert(s) together; 0 when none
    shared_gate: bool = False  # Qwen-style sigmoid gate [1, d] on the shared expert
    router: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid_group" (LLaDA2, group-limited)
    norm_topk_prob: bool = True
    router_bias: bool = False  # LLaDA2's expert_bias [E] (selection only)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet layers of the Qwen3.5/Qwen3-Next hybrids (Clover's base)."""

    layers: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_bytes(self, act_bytes: int, tp: int = 1) -> int:
        """Bytes of DeltaNet state one sequence holds on one rank, whatever its length: per
        layer the recurrent matrix of each value head (dk x dv, always fp32) and the conv
        ring (kernel-1 pre-conv rows of conv_dim channels, activation dtype), heads split
        over TP. This is what dlm/engine/runtime/hybrid_cache.py allocates (tests/test_hybrid_memory.py)."""
        recurrent = self.value_heads // tp * self.key_dim * self.value_dim * 4  # fp32
        conv = self.conv_dim // tp * (self.conv_kernel - 1) * act_bytes
        return self.layers * (recurrent + conv)


@dataclass(frozen=True)
class CanvasSpec:
    """DiffusionGemma's encoder/decoder facts beyond a plain layer stack: the full-attention
    layers' own head shape and RoPE (proportional: only `rope_fraction` of the rotary
    frequencies turn, divided by `rope_factor`, the rest stay 0), the sliding-window layers'
    window, the logit soft-cap, the canvas the decoder refines, and the checkpoint's sampler
    defaults (generation_config.json)."""

    canvas_length: int
    sliding_window: int
    global_head_dim: int
    global_kv_heads: int
    global_rope_theta: float
    global_rope_fraction: float
    global_rope_factor: float  # the turning frequencies are divided by it
    logit_softcap: float
    expert_ffn: int
    num_experts: int
    top_k: int
    sampler_defaults: dict[str, float] = field(default_factory=dict)  # from generation_config.json


@dataclass(frozen=True)
class ModelConfig:
    family: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense SwiGLU MLP's (0 when every layer is a mixture of experts)
    vocab_size: int  # tokenizer vocabulary
    logits_size: int  # rows of the LM head (>= vocab_size when the embedding is padded)
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    mask_token_id: int  # NO_MASK where the model has none
    # Every EOS id: config.json may list several (Gemma: end of text, end of turn), and each
    # ends an answer; the first also fills the canvas after an early stop.
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    tie_word_embeddings: bool
    torch_dtype: str | None
    partial_rotary_factor: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    q_gate: bool = False  # gated attention: q_proj also emits a per-head output gate
    layer_types: tuple[str, ...] = ()  # empty: every layer full attention
    moe: MoESpec | None = None
    linear: LinearAttentionSpec | None = None
    block_length: int | None = None  # the trained block size of a block-diffusion family
    logits_shift: int = 0  # row i of the logits predicts token i + logits_shift
    block_rules: BlockRules | None = None  # block-causal families' decoding rules
    mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (never run)
    canvas: CanvasSpec | None = None  # DiffusionGemma's encoder/decoder facts

    @property
    def eos_token_id(self) -> int | None:
        """The model's EOS: the first of `eos_token_ids` (None without one)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> int:
        return self.num_layers - (self.linear.layers if self.linear is not None else 0)

    @property
    def dense_layers(self) -> int:
        return self.num_layers - (len(self.moe.layers) if self.moe is not None else 0)

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL_ATTENTION


def _shown(value: Any) -> str:
    """`value` as config.json spells it (`Infinity`, `NaN`, `2.5`, `"64"`)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def as_int(value: Any, key: str, minimum: int | None = 1, file: str = "config.json") -> int:
    """`value` of field `key` as an integer of at least `minimum` (None: any): JSON's numbers
    only, a float only when whole (`64.0`), never NaN/Infinity (Python's json accepts them)
    nor a fraction silently truncated (`2.5` heads)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfig(f"{file} field {key!r} must be an integer, got {_shown(value)}", key, file)
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise InvalidConfig(f"{file} field {key!r} must be an integer, got {_shown(value)}", key, file)
    if minimum is not None and value < minimum:
        raise InvalidConfig(f"{file} field {key!r} must be at least {minimum}, got {_shown(value)}", key, file)
    return int(value)


def as_float(value: Any, key: str, positive: bool = True, file: str = "config.json") -> float:
    """`value` of field `key` as a finite float, greater than 0 when `positive`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidConfig(f"{file} field {key!r} must be a finite number, got {_shown(value)}", key, file)
    if positive and value <= 0:
        raise InvalidConfig(f"{file} field {key!r} must be greater than 0, got {_shown(value)}", key, file)
    return float(value)


def as_bool(value: Any, key: str) -> bool:
    """`value` of field `key` as a yes/no: JSON's true and false (null, 0 and 1 as Python reads
    them). A string is refused: `bool("false")` is True, so `"tie_word_embeddings": "false"`
    tied the embeddings."""
    if value is None or isinstance(value, bool) or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise InvalidConfig(f"config.json field {key!r} must be true or false, got {_shown(value)}", key)


def flag(raw: dict[str, Any], key: str, default: bool = False) -> bool:
    """Field `key`, a yes/no (`as_bool`), or `default` when it is absent."""
    return as_bool(raw.get(key, default), key)


def _plain_rope(raw: dict[str, Any]) -> None:
    """No family runs scaled RoPE (linear, dynamic, YaRN, ...): a `rope_scaling` asking for
    one was read by no one and the model decoded with plain RoPE, silently unlike its authors'
    (Dream alone refused it). transformers' own spelling of plain RoPE passes, and Qwen-VL's
    multimodal RoPE ("mrope", which the Qwen3.5 hybrids carry): on text positions it is plain."""
    value = raw.get("rope_scaling")
    kind = (value.get("rope_type") or value.get("type") or "default") if isinstance(value, dict) else None
    if value is None or kind in PLAIN_ROPE:
        return
    raise InvalidConfig(
        f"config.json field 'rope_scaling' must be null (dlm runs plain RoPE), got {_shown(value)}", "rope_scaling"
    )


def _ints(value: Any, key: str, file: str = "config.json") -> tuple[int, ...]:
    """A field holding one id or a list of them (`eos_token_id`, `pad_token_id`), as a tuple
    (`()`: none)."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(as_int(v, key, None, file) for v in values)


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """config.json's EOS ids, then those only generation_config.json lists: a chat model may
    name its end of turn there alone (SDAR's `<|im_end|>` beside config.json's
    `<|endoftext|>`), and transformers' `generate` and vLLM stop on every one of them."""
    own = _ints(raw.get("eos_token_id"), "eos_token_id")
    more = _ints((raw.get(GENERATION_CONFIG) or {}).get("eos_token_id"), "eos_token_id", GENERATION_FILE)
    return tuple(dict.fromkeys(own + more))


def section(raw: dict[str, Any], key: str, where: str | None = None) -> dict[str, Any]:
    """Field `key`, a JSON object (`{}` when absent or null); `where` is its path in
    config.json (`text_config.rope_parameters`) when it is nested."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        where = where or key
        raise InvalidConfig(f"config.json field {where!r} must be an object, got {_shown(value)}", where)
    return value


def require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise UsageError(f"config.json has no field {key!r}, which its model family needs")
    return raw[key]


def size(raw: dict[str, Any], key: str, default: Any = None, minimum: int = 1) -> int:
    """Field `key`, a size (`as_int`), or `default` when it is absent or null (required
    when `default` is None)."""
    value = raw.get(key)
    if value is None:
        return as_int(require(raw, key) if default is None else default, key, minimum)
    return as_int(value, key, minimum)


def real(raw: dict[str, Any], key: str, default: float, positive: bool = True) -> float:
    """Field `key`, a finite float (`as_float`), or `default` when it is absent or null."""
    value = raw.get(key)
    return as_float(default if value is None else value, key, positive)


def _mask(raw: dict[str, Any], family: Family) -> int:
    """The MASK id: config.json's, else (absent or null) the family's documented one. A family
    without a MASK token (NO_MASK) never reads the field."""
    if family.mask_token_id == NO_MASK:
        return NO_MASK
    mask = raw.get("mask_token_id")
    mask = family.mask_token_id if mask is None else mask
    if mask is None:
        raise UsageError(f"config.json has no mask_token_id, which {family.name} needs: add it there")
    return as_int(mask, "mask_token_id", 0)


def _common(raw: dict[str, Any], family: Family) -> dict[str, Any]:
    """The fields every spelling shares, and the family's declared facts."""
    _plain_rope(raw)
    block_length = raw.get(family.block_length_field) if family.block_length_field else None
    return dict(
        family=family.name,
        mask_token_id=_mask(raw, family),
        eos_token_ids=_eos_ids(raw),
        pad_token_id=next(iter(_ints(raw.get("pad_token_id"), "pad_token_id")), None),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        block_length=family.block_length
        if block_length is None
        else as_int(block_length, str(family.block_length_field)),
        logits_shift=family.logits_shift,
        block_rules=None
        if family.block_rules is None
        else replace(family.block_rules, logit_shift=family.logits_shift),
        mtp_layers=size(raw, "num_nextn_predict_layers", 0, minimum=0),
    )


def _llada(raw: dict[str, Any], family: Family) -> ModelConfig:
    """LLaDA's OLMo-style names; `include_bias` puts biases on every linear,
    `include_qkv_bias` on q/k/v only."""
    d_model = size(raw, "d_model")
    n_heads = size(raw, "n_heads")
    # OLMo convention: multi_query_attention means one KV head
    n_kv = size(raw, "n_kv_heads", 1 if flag(raw, "multi_query_attention") else n_heads)
    vocab = size(raw, "vocab_size")
    bias = flag(raw, "include_bias", False)
    return ModelConfig(
        model_type=str(raw.get("model_type", family.name)),
        hidden_size=d_model,
        num_layers=size(raw, "n_layers"),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=d_model // n_heads,
        intermediate_size=size(raw, "mlp_hidden_size", size(raw, "mlp_ratio", 4) * d_model),
        vocab_size=vocab,
        logits_size=size(raw, "embedding_size", vocab),
        rope_theta=real(raw, "rope_theta", 10000.0),
        rms_norm_eps=real(raw, "rms_norm_eps", 1e-5),
        max_position_embeddings=size(raw, "max_sequence_length", 4096),
        tie_word_embeddings=flag(raw, "weight_tying", False),
        qkv_bias=bias or flag(raw, "include_qkv_bias", False),
        o_bias=bias,
        mlp_bias=bias,
        **_common(raw, family),
    )


def _qwen_moe(raw: dict[str, Any], layers: int) -> MoESpec | None:
    """Qwen3-MoE placement: every `decoder_sparse_step`-th layer not in `mlp_only_layers`;
    a softmax router; Qwen3.5's gated shared expert when `shared_expert_intermediate_size`."""
    experts = size(raw, "num_experts", 0, minimum=0)
    if not experts:
        return None
    step = size(raw, "decoder_sparse_step", 1)
    dense_only = _layer_indices(raw, "mlp_only_layers", layers)
    shared = size(raw, "shared_expert_intermediate_size", 0, minimum=0)
    return MoESpec(
        layers=tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0),
        num_experts=experts,
        top_k=size(raw, "num_experts_per_tok"),
        expert_ffn=size(raw, "moe_intermediate_size"),
        shared_ffn=shared,
        shared_gate=shared > 0,
        norm_topk_prob=flag(raw, "norm_topk_prob", True),
    )


def _layer_indices(raw: dict[str, Any], key: str, layers: int) -> set[int]:
    """Field `key`, a list of layer indices (`set()` when absent or null): a string was read
    as a set of its characters, which named no layer, silently."""
    value = raw.get(key)
    if value is None:
        return set()
    if not isinstance(value, list):
        raise InvalidConfig(f"config.json field {key!r} must be a list of layer indices, got {_shown(value)}", key)
    indices = {as_int(v, key, 0) for v in value}
    if indices and max(indices) >= layers:
        raise InvalidConfig(f"config.json field {key!r} names layer {max(indices)}, past the model's {layers}", key)
    return indices


def _bailing_moe(raw: dict[str, Any], layers: int) -> MoESpec | None:
    """LLaDA2 (Bailing-MoE): the first `first_k_dense_replace` layers dense, the rest a
    sigmoid, group-limited router over the routed experts plus `num_shared_experts`."""
    experts = size(raw, "num_experts", 0, minimum=0)
    if not experts:
        return None
    if raw.get("score_function", "sigmoid") != "sigmoid":
        raise UsageError(f"LLaDA2 score_function {raw.get('score_function')!r} is not supported (only sigmoid)")
    ffn = size(raw, "moe_intermediate_size")
    return MoESpec(
        layers=tuple(range(min(size(raw, "first_k_dense_replace", 0, minimum=0), layers), layers)),
        num_experts=experts,
        top_k=size(raw, "num_experts_per_tok"),
        expert_ffn=ffn,
        shared_ffn=ffn * size(raw, "num_shared_experts", 0, minimum=0),
        router="sigmoid_group",
        norm_topk_prob=flag(raw, "norm_topk_prob", True),
        router_bias=flag(raw, "moe_router_enable_expert_bias", False),
        n_group=size(raw, "n_group", 1),
        topk_group=size(raw, "topk_group", 1),
        routed_scaling_factor=real(raw, "routed_scaling_factor", 1.0),
    )


MOE_READERS: dict[str, Callable[[dict[str, Any], int], MoESpec | None]] = {"qwen": _qwen_moe, "bailing": _bailing_moe}


def _qwen(raw: dict[str, Any], family: Family, **overrides: Any) -> ModelConfig:
    """transformers' standard field names (Qwen/Llama/Bailing style): Dream, LLaDA2, SDAR,
    openPangu, and (flattened) the Qwen3.5 hybrids."""
    hidden = size(raw, "hidden_size")
    heads = size(raw, "num_attention_heads")
    layers = size(raw, "num_hidden_layers")
    vocab = size(raw, "vocab_size")
    fields: dict[str, Any] = dict(
        model_type=str(raw.get("model_type", family.name)),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=size(raw, "num_key_value_heads", heads),
        head_dim=size(raw, "head_dim", 0, minimum=0) or hidden // heads,
        intermediate_size=size(raw, "intermediate_size", 0, minimum=0),
        vocab_size=vocab,
        logits_size=vocab,
        rope_theta=real(raw, "rope_theta", 10000.0),
        rms_norm_eps=real(raw, "rms_norm_eps", 1e-6),
        max_position_embeddings=size(raw, "max_position_embeddings", 4096),
        tie_word_embeddings=flag(raw, "tie_word_embeddings", False),
        partial_rotary_factor=real(raw, "partial_rotary_factor", 1.0),
        qkv_bias=family.qkv_bias.read(raw),
        o_bias=family.o_bias.read(raw),
        qk_norm=family.qk_norm.read(raw),
        moe=MOE_READERS[family.moe](raw, layers) if family.moe else None,
        **_common(raw, family),
    )
    fields.update(overrides)
    if fields["moe"] is None or fields["moe"].layers != tuple(range(layers)):
        fields["intermediate_size"] = size(raw, "intermediate_size")  # some layer is dense
    return ModelConfig(**fields)


def hybrid_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3.5/3.6-MoE text fields as one flat dict.

    Multimodal checkpoints (`qwen3_5_moe`) nest them under `text_config`; text-only ones
    (`qwen3_5_moe_text`, presumably Clover) are flat. transformers 5 writes rope settings
    under `rope_parameters`, older files at the top level; both are lifted to the top.
    """
    # The outer model_type names the family (a nested text_config says `..._text`).
    flat = {**raw, **section(raw, "text_config"), "model_type": raw.get("model_type")}
    rope = section(flat, "rope_parameters")
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            flat[key] = rope[key]
    return flat


def _layer_types(
    raw: dict[str, Any], key: str, layers: int, kinds: tuple[str, ...], where: str | None = None
) -> tuple[str, ...]:
    """Field `key`: the type of each of the `layers` layers, one of `kinds` (`()` when absent
    or null). A list shorter than the layers left the last layers without a type (an
    IndexError when the model was built); entries past them are not read."""
    value, where = raw.get(key), where or key
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) < layers or any(t not in kinds for t in value[:layers]):
        raise InvalidConfig(
            f"config.json field {where!r} must be a list of {layers} layer types "
            f"({' or '.join(map(repr, kinds))}), got {_shown(value)}",
            where,
        )
    return tuple(value[:layers])


def _hybrid(raw: dict[str, Any], family: Family) -> ModelConfig:
    """Qwen3.5-MoE / Qwen3-Next hybrids: Gated DeltaNet layers interleaved with gated full
    attention (`layer_types`, else every `full_attention_interval`-th layer full)."""
    flat = hybrid_text_config(raw)
    layers = size(flat, "num_hidden_layers")
    interval = size(flat, "full_attention_interval", 4)
    types = _layer_types(flat, "layer_types", layers, (FULL_ATTENTION, LINEAR_ATTENTION)) or tuple(
        FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
    )
    linear = LinearAttentionSpec(
        layers=types.count(LINEAR_ATTENTION),
        key_heads=size(flat, "linear_num_key_heads"),
        value_heads=size(flat, "linear_num_value_heads"),
        key_dim=size(flat, "linear_key_head_dim"),
        value_dim=size(flat, "linear_value_head_dim"),
        conv_kernel=size(flat, "linear_conv_kernel_dim", 4),
    )
    return _qwen(
        flat,
        family,
        max_position_embeddings=size(flat, "max_position_embeddings", 32768),
        q_gate=flag(flat, "attn_output_gate", True),
        layer_types=types,
        linear=linear,
    )


SLIDING_ATTENTION = "sliding_attention"
GENERATION_FILE = "generation_config.json"
GENERATION_CONFIG = "dlm_generation_config"  # where load_config puts generation_config.json for the readers
# generation_config.json field -> the request field it gives DiffusionGemma's default for.
SAMPLER_FIELDS = {
    "max_denoising_steps": "refinement_steps",
    "t_min": "min_temperature",
    "t_max": "max_temperature",
    "stability_threshold": "stability_threshold",
    "confidence_threshold": "confidence_threshold",
}


def _sampler_defaults(generation: dict[str, Any]) -> dict[str, float]:
    """The checkpoint's own sampler settings (what transformers' `generate` uses when a call
    gives none), as request fields."""
    found: dict[str, float] = {}
    for key, name in SAMPLER_FIELDS.items():
        if (value := generation.get(key)) is not None:
            found[name] = _sampler_value(value, key, name)
    sampler = generation.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        found["entropy_bound"] = _sampler_value(
            sampler["entropy_bound"], "sampler_config.entropy_bound", "entropy_bound"
        )
    return found


def _sampler_value(value: Any, key: str, name: str) -> float:
    """A sampler default of generation_config.json, held to the range its request field has
    (a string of steps raised ValueError from the first request, a traceback; NaN was refused
    naming the request field, not the file)."""
    file = GENERATION_FILE
    if name == "refinement_steps":
        return as_int(value, key, 1, file=file)
    if name == "stability_threshold":
        return as_int(value, key, 0, file=file)
    return as_float(value, key, positive=name != "max_temperature", file=file)


def _diffusion_gemma(raw: dict[str, Any], family: Family) -> ModelConfig:
    """DiffusionGemma: the text fields nested under `text_config`; sliding-window layers use
    `head_dim`/`num_key_value_heads` and default RoPE, full-attention layers their own
    `global_head_dim`/`num_global_key_value_heads` (written per layer in `per_layer_config`)
    and proportional RoPE; every layer has a dense MLP beside its mixture of experts."""
    require(raw, "text_config")
    text = dict(section(raw, "text_config"))
    layers = size(text, "num_hidden_layers")
    types = _layer_types(text, "layer_types", layers, (SLIDING_ATTENTION, FULL_ATTENTION), "text_config.layer_types")
    if not types:
        raise InvalidConfig(
            f"config.json field 'text_config.layer_types' must list the type of each of the {layers} layers",
            "text_config.layer_types",
        )
    rope = section(text, "rope_parameters", "text_config.rope_parameters")
    full_rope = section(rope, FULL_ATTENTION, f"text_config.rope_parameters.{FULL_ATTENTION}")
    sliding_rope = section(rope, SLIDING_ATTENTION, f"text_config.rope_parameters.{SLIDING_ATTENTION}")
    for kind, params, expected in (
        (FULL_ATTENTION, full_rope, "proportional"),
        (SLIDING_ATTENTION, sliding_rope, "default"),
    ):
        if params.get("rope_type", expected) != expected:
            raise UsageError(
                f"DiffusionGemma {kind} rope_type {params['rope_type']!r} is not supported (only {expected!r})"
            )
    per_layer = section(text, "per_layer_config", "text_config.per_layer_config")
    global_layer: dict[str, Any] = next(
        (
            section(per_layer, str(i), f"text_config.per_layer_config.{i}")
            for i, t in enumerate(types)
            if t == FULL_ATTENTION and str(i) in per_layer
        ),
        {},
    )
    head_dim = size(text, "head_dim")
    kv_heads = size(text, "num_key_value_heads")
    full = "text_config.rope_parameters.full_attention."
    canvas = CanvasSpec(
        canvas_length=size(raw, "canvas_length", 256),
        sampler_defaults=_sampler_defaults(raw.get(GENERATION_CONFIG) or {}),
        sliding_window=size(text, "sliding_window"),
        global_head_dim=size(global_layer, "head_dim", size(text, "global_head_dim", head_dim)),
        global_kv_heads=size(global_layer, "num_key_value_heads", size(text, "num_global_key_value_heads", kv_heads)),
        global_rope_theta=as_float(full_rope.get("rope_theta", 1_000_000.0), full + "rope_theta"),
        global_rope_fraction=as_float(full_rope.get("partial_rotary_factor", 1.0), full + "partial_rotary_factor"),
        global_rope_factor=as_float(full_rope.get("factor", 1.0), full + "factor"),
        logit_softcap=real(text, "final_logit_softcapping", 30.0),
        expert_ffn=size(text, "moe_intermediate_size"),
        num_experts=size(text, "num_experts"),
        top_k=size(text, "top_k_experts"),
    )
    flat = {
        **text,
        "model_type": raw.get("model_type"),
        "rope_theta": sliding_rope.get("rope_theta", 10_000.0),
        GENERATION_CONFIG: raw.get(GENERATION_CONFIG),
    }
    return _qwen(
        flat,
        family,
        max_position_embeddings=size(text, "max_position_embeddings", 131_072),
        tie_word_embeddings=True,
        layer_types=types,
        block_length=canvas.canvas_length,
        canvas=canvas,
    )


LAYOUTS: dict[str, Callable[[dict[str, Any], Family], ModelConfig]] = {
    "llada": _llada,
    "qwen": _qwen,
    "hybrid": _hybrid,
    "diffusion_gemma": _diffusion_gemma,
}


# torch counts a storage's bytes in int64, and an element is at most 8 bytes wide: no tensor,
# so no model, holds more elements than this.
MAX_ELEMENTS = (2**63 - 1) // 8


def parameter_bound(config: ModelConfig) -> int:
    """At least the parameters of the model `config` describes (every layer counted with
    each kind of attention and MLP it may have): what `check_sizes` holds to MAX_ELEMENTS."""
    c, attention = config, (2 * config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    width = attention + 3 * c.intermediate_size
    if c.moe is not None:
        width += c.moe.num_experts * (3 * c.moe.expert_ffn + 1) + 3 * c.moe.shared_ffn
    if c.linear is not None:
        width += c.linear.conv_dim * (c.linear.conv_kernel + 2) + 2 * c.linear.value_heads * c.linear.value_dim
    if c.canvas is not None:
        width += 2 * (c.num_heads + c.canvas.global_kv_heads) * c.canvas.global_head_dim
        width += c.canvas.num_experts * (3 * c.canvas.expert_ffn + 1)
    return (c.num_layers + c.mtp_layers) * c.hidden_size * (width + 4) + 2 * c.logits_size * c.hidden_size


def _at_most(value: int, key: str, limit: int, what: str) -> None:
    if value > limit:
        raise InvalidConfig(f"config.json field {key!r} must be at most {what} ({limit}), got {value}", key)


def check_experts(config: ModelConfig) -> None:
    """A router picks `top_k` of its experts (LLaDA2's: of the experts of its best
    `topk_group` of `n_group` equal groups): more than there are made the first forward's
    topk raise "selected index k out of range", groups that do not split the experts its
    view raise "shape ... is invalid", a traceback from generate and serve."""
    moe, canvas = config.moe, config.canvas
    if moe is not None:
        _at_most(moe.top_k, "num_experts_per_tok", moe.num_experts, "num_experts")
        if moe.router == "sigmoid_group":
            if moe.num_experts % moe.n_group:
                raise InvalidConfig(
                    f"config.json field 'n_group' must divide num_experts ({moe.num_experts}) into "
                    f"equal groups, got {moe.n_group}",
                    "n_group",
                )
            _at_most(moe.topk_group, "topk_group", moe.n_group, "n_group")
            eligible = moe.topk_group * (moe.num_experts // moe.n_group)
            _at_most(moe.top_k, "num_experts_per_tok", eligible, "the experts of topk_group groups")
    if canvas is not None:
        _at_most(canvas.top_k, "top_k_experts", canvas.num_experts, "num_experts")


def check_sizes(config: ModelConfig) -> ModelConfig:
    """What no single field shows: a head width of 0 (more heads than the hidden size has
    columns), heads the key/value heads do not divide, a MASK id outside the embedding,
    and sizes whose model no storage can hold. The bound is torch's own (int64 bytes;
    building such a model, even on the meta device, raises "Storage size calculation
    overflowed", which says nothing of the file): checked here, where every command parses
    config.json, rather than classified from that RuntimeError after the fact, so `dlm
    verify` records it against config.json and `serve`, `generate` and `estimate` refuse
    it with the same words, before anything is built."""
    if config.head_dim < 1:
        raise InvalidConfig(
            f"config.json's sizes give head_dim {config.head_dim} "
            f"(hidden size {config.hidden_size} over {config.num_heads} heads): it must be at least 1",
            "head_dim",
        )
    if config.num_heads % config.num_kv_heads:
        raise InvalidConfig(
            f"config.json's sizes give {config.num_heads} attention heads over {config.num_kv_heads} "
            "key/value heads: each key/value head must serve a whole number of heads",
            "num_kv_heads",
        )
    # Gated DeltaNet: each key head is read by a whole number of value heads (the layer's
    # view of them raised ValueError from the first build: a traceback from verify and serve).
    if config.linear is not None and config.linear.value_heads % config.linear.key_heads:
        raise InvalidConfig(
            f"config.json's sizes give {config.linear.value_heads} linear-attention value heads over "
            f"{config.linear.key_heads} key heads: linear_num_value_heads must be a multiple of linear_num_key_heads",
            "linear_num_value_heads",
        )
    # Every canvas starts as MASK ids, so the MASK must be a row of the embedding: out of
    # range, the first forward raised IndexError.
    if config.mask_token_id != NO_MASK and config.mask_token_id >= config.logits_size:
        raise InvalidConfig(
            f"config.json field 'mask_token_id' must be a row of the embedding (0..{config.logits_size - 1}), "
            f"got {config.mask_token_id}",
            "mask_token_id",
        )
    check_experts(config)
    # The rotary part of a head is at most the head: past it, RoPE's halves no longer match
    # the head's columns (a traceback from the first forward).
    fractions = [("partial_rotary_factor", config.partial_rotary_factor)]
    if config.canvas is not None:
        fractions.append(
            ("text_config.rope_parameters.full_attention.partial_rotary_factor", config.canvas.global_rope_fraction)
        )
    for key, fraction in fractions:
        if fraction > 1:
            raise InvalidConfig(f"config.json field {key!r} must be at most 1, got {_shown(fraction)}", key)
    bound = parameter_bound(config)
    if bound > MAX_ELEMENTS:
        raise InvalidConfig(
            f"config.json's sizes describe a model of about {bound:.3g} parameters (hidden size "
            f"{config.hidden_size}, {config.num_layers} layers, vocabulary {config.logits_size}), "
            f"more than any tensor can hold ({MAX_ELEMENTS:.3g} elements)"
        )
    return config


# A stored value may stand for several parameters (4-bit weights packed in int32: 8 each).
PARAMETERS_PER_VALUE = 64


def check_fits_weights(config: ModelConfig, values: int) -> None:
    """Refuse a config.json describing a model far larger than the `values` its weights hold
    (an edited or foreign config: 10**6 layers over the tensors of 4). The model is built,
    even on the meta device, module by module before any tensor is held against it: such a
    config cost minutes and gigabytes before `dlm verify` or a load could say a word."""
    bound = parameter_bound(config)
    if values and bound > PARAMETERS_PER_VALUE * values:
        raise InvalidConfig(
            f"config.json describes a model of about {bound:.3g} parameters ({config.num_layers} layers, "
            f"hidden size {config.hidden_size}), more than {PARAMETERS_PER_VALUE} for each of the {values:,} "
            "values its weights hold: it is not these weights' config"
        )


# Names check_dtypes takes without importing torch (a test holds each to torch).
COMMON_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def check_dtypes(raw: dict[str, Any]) -> None:
    """`torch_dtype`/`dtype` (at the top, or in a nested text_config) must name a torch
    dtype, as transformers reads them (`getattr(torch, name)`) whenever it parses the file,
    loading the tokenizer too: "float128" raised AttributeError there, a traceback from
    generate after its tokens were computed and a tokenizer failure from dlm verify."""
    nested = raw.get("text_config")
    for prefix, fields in (("", raw), ("text_config.", nested if isinstance(nested, dict) else {})):
        for key in ("torch_dtype", "dtype"):
            value = fields.get(key)
            if value is None or (isinstance(value, str) and value in COMMON_DTYPES):
                continue
            if isinstance(value, str):
                import torch  # only for a name beyond the common ones

                if isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype):
                    continue
            raise InvalidConfig(
                f"config.json field {prefix + key!r} must name a torch dtype (float32, bfloat16, ...), "
                f"got {_shown(value)}",
                prefix + key,
            )


def _check_eos(config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """Every EOS id a token of the model, refused naming the file that lists it: an EOS the
    model cannot emit never stops an answer (every request ran to its length)."""
    text = raw.get("text_config")  # where DiffusionGemma's config.json keeps it
    own = {*_ints(raw.get("eos_token_id"), "eos_token_id")}
    own |= {*_ints(text.get("eos_token_id"), "eos_token_id")} if isinstance(text, dict) else set()
    for eos in config.eos_token_ids:
        if not 0 <= eos < config.logits_size:
            file = "config.json" if eos in own else GENERATION_FILE
            raise InvalidConfig(
                f"{file} field 'eos_token_id' must be a token of the model (0..{config.logits_size - 1}), got {eos}",
                "eos_token_id",
                file,
            )
    return config


def parse_config(raw: dict[str, Any], family: Family) -> ModelConfig:
    """`raw` read as `family` declares: its spelling, its refusals, its facts. Every number
    is checked as it is read (`size`, `real`: integers of their range, finite floats; the
    typed InvalidConfig naming the field) and the sizes together (`check_sizes`), so every
    command that reads a checkpoint refuses the same config.json with the same words."""
    try:
        if family.check is not None:
            family.check(raw)
        check_dtypes(raw)
        return _check_eos(check_sizes(LAYOUTS[family.layout](raw, family)), raw)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"config.json has an invalid field for {family.name}: {exc}") from exc


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    from dlm.engine.registry import family_for  # the registry's records name this module's readers

    return parse_config(raw, family_for(raw))


def read_config_json(path: Path) -> dict[str, Any]:
    """Read a checkpoint directory's (or a bare file's) config.json with clear errors."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise UsageError(f"no config.json at {path}")
    if not file.is_file():
        raise UsageError(f"{file} is not a file")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{file} is not valid UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise UsageError(f"{file} nests deeper than any config.json does") from None
    except OSError as exc:
        raise UsageError(f"cannot read {file}: {exc.strerror or exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{file} does not hold a JSON object")
    return raw


def load_config(path: Path) -> ModelConfig:
    """A checkpoint's model config: config.json with what its generation_config.json adds."""
    raw = read_config_json(path)
    generation = Path(path) / GENERATION_FILE
    if generation.is_file():
        generation_config = _read_generation_config(generation)
        # Some checkpoints (LLaDA2 fixtures) keep the MASK id only in generation_config.json;
        # chat models may list more EOS ids there; DiffusionGemma keeps its sampler's defaults.
        raw = {**raw, GENERATION_CONFIG: generation_config}
        if "mask_token_id" not in raw and generation_config.get("mask_token_id") is not None:
            raw["mask_token_id"] = generation_config["mask_token_id"]
    return config_from_dict(raw)


def _read_generation_config(file: Path) -> dict[str, Any]:
    """generation_config.json, a JSON object, or InvalidConfig naming it: what it holds
    changes the answers (EOS ids, sampler defaults), so one that cannot be read is refused,
    as transformers refuses it, never skipped."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"{GENERATION_FILE} is not valid UTF-8 JSON: {exc}", None, GENERATION_FILE) from None
    except RecursionError:
        raise InvalidConfig(f"{GENERATION_FILE} nests deeper than any does", None, GENERATION_FILE) from None
    except OSError as exc:
        raise InvalidConfig(f"cannot read {GENERATION_FILE}: {exc.strerror or exc}", None, GENERATION_FILE) from None
    if not isinstance(value, dict):
        raise InvalidConfig(f"{GENERATION_FILE} does not hold a JSON object", None, GENERATION_FILE)
    return value
