"""The model families dlm knows: one record each, the only place a family's facts are written.

A record says which checkpoints belong to the family (`model_type` / `architectures`), how
its config.json is spelled and what it leaves out (MASK id, block size), the architecture
facts that are fixed for the family rather than read from the file (biases, q/k norm, MoE
placement), its decoding rules (sampler, block rules, logit shift, caches, modes), which
engine decodes it and which module builds its network, and what `dlm estimate` reports
about it. `dlm.engine.config` reads a config.json into `ModelConfig` as the record says.

Kept free of torch imports so that config parsing (and `dlm estimate`) stays cheap; the
model module of a family is imported only when a model is built. Adding a family is one
record here plus one model module (docs/adding-a-family.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from dlm.engine.config import NO_MASK, as_bool, flag, section
from dlm.engine.errors import UsageError


@dataclass(frozen=True)
class BlockRules:
    """How a block-causal family decodes block by block (dlm/engine/decoding/block_diffusion.py)."""

    aligned_grid: bool  # blocks at multiples of B (True) or from the prompt's end (False)
    causal_context: bool  # context attends causally (openPangu) rather than block-causally
    threshold_rule: str  # "dinfer" or "dynamic": what --threshold means for the family
    sub_blocks: int = 1  # a block is denoised in this many consecutive sub-blocks
    logit_shift: int = 0  # 1: output row i predicts token i+1; filled from `Family.logits_shift`
    # LLaDA2.1's draft-and-edit rule (dlm/engine/decoding/draft_edit.py) may be asked for: a
    # request may also replace committed tokens of the current block. Opt-in per request,
    # since a LLaDA2.1 config.json reads exactly like a LLaDA2.0 one.
    token_edits: bool = False
    # Stop as soon as the first EOS has no undecided position before it (Fast-dLLM v2's
    # `generate`), rather than after the block that holds it is finished.
    stop_mid_block: bool = False


@dataclass(frozen=True)
class Flag:
    """A yes/no architecture fact: the first of `fields` that config.json holds, else `default`."""

    fields: tuple[str, ...] = ()
    default: bool = False

    def read(self, raw: dict[str, Any]) -> bool:
        field = next((f for f in self.fields if f in raw), None)
        return self.default if field is None else as_bool(raw[field], field)


ATTENTION_BIAS = Flag(("attention_bias",))  # Qwen's one switch for q/k/v/o biases
ALWAYS = Flag(default=True)
PANGU_BIAS = Flag(("bias", "attention_bias"), True)  # openPangu: biases on q/k/v/o unless told


@dataclass(frozen=True)
class Family:
    """One supported model family."""

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    module: str  # dotted path of the module defining `Model`
    description: str
    sampler: str = "llada"  # decoding rules: "llada" (generate()) or "dream" (diffusion_generate)
    caches: tuple[str, ...] = ("none",)  # `--cache` modes the family can use
    # Block-causal attention (causal across blocks, full inside one): these families decode
    # with an exact KV cache through the block runner, and also in AR mode.
    block_causal: bool = False
    engine: str = "dlm.engine.runtime.engine.LLMEngine"  # dotted path of the engine that decodes it; "" = none
    # How config.json is read (dlm.engine.config.LAYOUTS): "llada" (OLMo-style d_model/n_layers),
    # "qwen" (transformers' standard names) or "hybrid" (Qwen3.5 text config, maybe nested).
    layout: str = "qwen"
    mask_token_id: int | None = None  # the documented MASK where config.json omits it; None: required; NO_MASK: none
    check: Callable[[dict[str, Any]], None] | None = None  # refuses what the model does not implement
    # Architecture facts of the "qwen"/"hybrid" layouts (LLaDA's own names are read by its layout).
    qkv_bias: Flag = ATTENTION_BIAS
    o_bias: Flag = ATTENTION_BIAS
    qk_norm: Flag = Flag()
    moe: str | None = None  # MoE spelling (dlm.engine.config.MOE_READERS): "qwen", "bailing"; None: dense
    # Decoding facts.
    logits_shift: int = 0  # row i of the logits predicts token i + logits_shift
    block_rules: BlockRules | None = None
    block_length: int | None = None  # the trained block size, where config.json does not say
    block_length_field: str | None = None  # the config.json field that says it
    fixed_block: bool = False  # decodes blocks of its `block_length` only, without guidance (Clover)
    commit_pass: bool = False  # a block costs one forward beyond its steps: a pass that advances the cache (Clover)
    # What `dlm estimate` needs beyond the config: how attention sees the context (decides
    # which caches are exact), the name it reports, spellings it also plans (architectures
    # the engine does not load), and notes on weights it does not count.
    attention: str = "bidirectional"  # or "block-causal" (an exact KV cache), "encoder-decoder"
    label: str = ""  # the name `dlm estimate` reports (default: `name`)
    planned_model_types: tuple[str, ...] = ()
    planned_architectures: tuple[str, ...] = ()
    plan_notes: tuple[str, ...] = ()

    def engine_class(self) -> Any:
        if not self.engine:
            raise UsageError(
                f"{self.name} checkpoints are autoregressive base models: dlm loads their layers "
                "but does not decode them natively; use --backend transformers"
            )
        module, _, cls = self.engine.rpartition(".")
        return getattr(importlib.import_module(module), cls)

    @property
    def default_cache(self) -> str:
        """What `--cache auto` means: the exact block cache where the family has one (same
        tokens as recomputing, far less work); otherwise none, since Fast-dLLM's prefix and
        dual caches are approximate and so an explicit choice."""
        return "block" if "block" in self.caches else "none"

    def model_class(self) -> Any:
        return importlib.import_module(self.module).Model

    def matches(self, model_type: Any, architectures: Any, planning: bool = False) -> bool:
        """Whether a config with this `model_type` (or, failing that, `architectures`) is
        this family's; `planning` also accepts what `dlm estimate` plans, case-insensitively."""
        types, archs = self.model_types, self.architectures
        if planning:
            types = tuple(t.lower() for t in (*types, *self.planned_model_types))
            model_type = str(model_type).lower()
            archs = (*archs, *self.planned_architectures)
        return model_type in types or any(a in archs for a in architectures or ())


def _refuse_llada(raw: dict[str, Any]) -> None:
    if raw.get("block_type", "llama") != "llama":
        raise UsageError(f"LLaDA block_type {raw.get('block_type')!r} is not supported (only 'llama')")
    if flag(raw, "alibi"):
        raise UsageError("LLaDA checkpoints with alibi are not supported")


def _refuse_dream(raw: dict[str, Any]) -> None:
    if flag(raw, "use_sliding_window"):
        raise UsageError("Dream checkpoints with sliding-window attention are not supported")


def _refuse_diffusion_gemma(raw: dict[str, Any]) -> None:
    text = section(raw, "text_config")
    if text.get("use_bidirectional_attention") == "all":
        raise UsageError("DiffusionGemma checkpoints with a bidirectional encoder are not supported (only causal)")
    if flag(text, "attention_bias"):
        raise UsageError("DiffusionGemma checkpoints with attention biases are not supported")


HYBRID_NOTE = (
    "multi-token-prediction (mtp.*) and vision-tower weights, if the checkpoint has them, "
    "are not counted: text dLLM decoding does not run them"
)
# The kinds of family, and what every family of a kind shares.
bidirectional_family = partial(Family, caches=("none", "prefix", "dual"))
block_family = partial(Family, block_causal=True, caches=("none", "block"), attention="block-causal")
hybrid_family = partial(
    Family, layout="hybrid", qk_norm=ALWAYS, moe="qwen", attention="block-causal", plan_notes=(HYBRID_NOTE,)
)

FAMILIES: tuple[Family, ...] = (
    bidirectional_family(
        name="llada",
        model_types=("llada",),
        architectures=("LLaDAModelLM",),
        module="dlm.engine.models.llada",
        description="LLaDA: bidirectional LLaMA-style masked diffusion LM",
        layout="llada",
        mask_token_id=126336,  # LLaDA-8B's config.json omits it; 126336 is its documented MASK
        check=_refuse_llada,
    ),
    bidirectional_family(
        name="dream",
        model_types=("Dream",),
        architectures=("DreamModel",),
        module="dlm.engine.models.dream",
        description="Dream / Dream-Coder / DiffuCoder: bidirectional Qwen2-style, logits shifted one position",
        sampler="dream",
        mask_token_id=151666,  # Dream-v0 / DiffuCoder; the tiny and newer configs carry the field
        check=_refuse_dream,
        qkv_bias=ALWAYS,  # Qwen2: q/k/v biases, none on o_proj
        o_bias=Flag(),
        logits_shift=1,
    ),
    block_family(
        name="llada2_moe",
        model_types=("llada2_moe",),
        architectures=("LLaDA2MoeModelLM",),
        module="dlm.engine.models.llada2_moe",
        description="LLaDA2.x: block-diffusion MoE (sigmoid group-limited routing, shared expert)",
        mask_token_id=156895,
        qkv_bias=Flag(("use_qkv_bias",)),
        o_bias=Flag(("use_bias",)),
        qk_norm=Flag(("use_qk_norm",), True),
        moe="bailing",
        block_rules=BlockRules(aligned_grid=True, causal_context=False, threshold_rule="dinfer", token_edits=True),
        block_length=32,  # LLaDA2.0/2.1's trained block size (not in config.json)
        label="llada2",
    ),
    block_family(
        name="sdar",
        model_types=("sdar", "sdar_moe"),
        architectures=("SDARForCausalLM", "SDARMoeForCausalLM"),
        module="dlm.engine.models.sdar",
        description="SDAR: Qwen3-style block diffusion (dense or MoE)",
        qk_norm=ALWAYS,
        moe="qwen",
        block_rules=BlockRules(aligned_grid=True, causal_context=False, threshold_rule="dynamic"),
        block_length=4,
        block_length_field="block_size",
    ),
    block_family(
        name="pangu",
        model_types=("PanguEmbedded",),
        architectures=("PanguEmbeddedForCausalLM",),
        module="dlm.engine.models.sdar",  # the SDAR network with openPangu's options
        description="openPangu-R-7B-Diffusion: context-causal block diffusion, shifted logits",
        mask_token_id=45830,  # an argument of the reference, not in config.json
        qkv_bias=PANGU_BIAS,
        o_bias=PANGU_BIAS,
        logits_shift=1,
        block_rules=BlockRules(aligned_grid=False, causal_context=True, threshold_rule="dynamic", sub_blocks=4),
        block_length=32,
        planned_model_types=("pangu_embedded",),
    ),
    Family(
        name="diffusion_gemma",
        model_types=("diffusion_gemma",),
        architectures=("DiffusionGemmaForBlockDiffusion",),
        module="dlm.engine.models.diffusion_gemma",
        description="DiffusionGemma: causal encoder (prompt KV cache) + canvas decoder, entropy-bound sampler",
        sampler="entropy_bound",
        engine="dlm.engine.runtime.canvas.CanvasEngine",
        layout="diffusion_gemma",
        mask_token_id=NO_MASK,  # a canvas starts as uniform random tokens
        check=_refuse_diffusion_gemma,
        qk_norm=ALWAYS,
        attention="encoder-decoder",
        plan_notes=("vision-tower weights are not counted: dlm decodes text prompts only",),
    ),
    block_family(
        name="fast_dllm_v2",
        model_types=("Fast_dLLM_Qwen",),
        architectures=("Fast_dLLM_QwenForCausalLM",),
        module="dlm.engine.models.sdar",  # the SDAR network with Qwen2's options
        description="Fast-dLLM v2: block diffusion adapted from Qwen2.5, shifted logits, sub-blocks",
        mask_token_id=151665,  # `|<MASK>|`, an argument of the reference's generate, not in config.json
        qkv_bias=ALWAYS,  # Qwen2: q/k/v biases, none on o_proj
        o_bias=Flag(),
        logits_shift=1,
        block_rules=BlockRules(
            aligned_grid=True, causal_context=False, threshold_rule="dynamic", sub_blocks=4, stop_mid_block=True
        ),
        block_length=32,
        block_length_field="bd_size",
    ),
    hybrid_family(
        name="qwen3_5_moe",
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        module="dlm.engine.models.qwen3_5_moe",
        description="Qwen3.5/3.6-MoE hybrid (Gated DeltaNet + gated attention), autoregressive base",
        engine="",
        mask_token_id=NO_MASK,  # the autoregressive base model has none
        label="qwen3.5-hybrid",
        planned_model_types=("qwen3_next",),
        planned_architectures=("Qwen3NextForCausalLM",),
    ),
    hybrid_family(
        name="clover",
        model_types=("clover_moe",),
        architectures=(),
        module="dlm.engine.models.qwen3_5_moe",
        description="Clover: block diffusion on the Qwen3.5-MoE hybrid (EXPERIMENTAL, docs/clover.md)",
        engine="dlm.engine.runtime.clover.CloverEngine",
        # mask_token_id: nobody has read Clover's config.json yet, so refuse to guess (docs/clover.md).
        block_length=32,  # Clover's training block size (model card)
        block_length_field="block_size",
        fixed_block=True,
        commit_pass=True,
        plan_notes=(
            HYBRID_NOTE,
            "Clover's extra GDN parameters (right-convolution taps, about conv_dim x "
            "(kernel-1) per GDN layer, <0.01% of the model) are not named in its config "
            "and are not counted",
        ),
    ),
)


def supported_names() -> str:
    return ", ".join(f"{f.name} (model_type {'/'.join(f.model_types)})" for f in FAMILIES)


# What LLMEngine decodes a checkpoint outside the registry with (the transformers backend's
# "forward" path): LLaDA's rules over the model's own forward, which knows no dlm cache.
UNREGISTERED = Family(
    name="transformers",
    model_types=(),
    architectures=(),
    module="",
    description="a bidirectional model run through transformers",
    engine="",
)


def family_named(name: str) -> Family:
    """The registered family called `name` (`ModelConfig.family`), else `UNREGISTERED`."""
    return next((f for f in FAMILIES if f.name == name), UNREGISTERED)


def family_for(raw_config: dict[str, Any], planning: bool = False) -> Family:
    """Pick the family from `model_type`, falling back to `architectures`; `planning`
    (dlm estimate) also accepts the spellings a family only plans."""
    model_type, archs = raw_config.get("model_type"), raw_config.get("architectures")
    for family in FAMILIES:
        if family.matches(model_type, (), planning):
            return family
    for family in FAMILIES:
        if family.matches(None, archs, planning):
            return family
    if planning:
        known = ", ".join(sorted({t.lower() for f in FAMILIES for t in (*f.model_types, *f.planned_model_types)}))
        raise UsageError(
            f"dlm estimate does not know model_type {model_type!r} (architectures {archs}); known: {known}"
        )
    raise UsageError(f"unsupported model_type {model_type!r} (architectures {archs}); supported: {supported_names()}")
