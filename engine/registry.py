"""Maps a checkpoint's `model_type` / `architectures` to the family that implements it.

Kept free of torch imports so that config parsing (and `dlm estimate`) stays cheap; the
model module of a family is imported only when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from engine.errors import UsageError


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
    engine: str = "engine.runtime.engine.LLMEngine"  # dotted path of the engine that decodes it; "" = none

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


FAMILIES: tuple[Family, ...] = (
    Family(
        name="llada",
        model_types=("llada",),
        architectures=("LLaDAModelLM",),
        module="engine.models.llada",
        description="LLaDA: bidirectional LLaMA-style masked diffusion LM",
        caches=("none", "prefix", "dual"),
    ),
    Family(
        name="dream",
        model_types=("Dream",),
        architectures=("DreamModel",),
        module="engine.models.dream",
        description="Dream / Dream-Coder / DiffuCoder: bidirectional Qwen2-style, logits shifted one position",
        sampler="dream",
        caches=("none", "prefix", "dual"),
    ),
    Family(
        name="llada2_moe",
        model_types=("llada2_moe",),
        architectures=("LLaDA2MoeModelLM",),
        module="engine.models.llada2_moe",
        description="LLaDA2.x: block-diffusion MoE (sigmoid group-limited routing, shared expert)",
        block_causal=True,
        caches=("none", "block"),
    ),
    Family(
        name="sdar",
        model_types=("sdar", "sdar_moe"),
        architectures=("SDARForCausalLM", "SDARMoeForCausalLM"),
        module="engine.models.sdar",
        description="SDAR: Qwen3-style block diffusion (dense or MoE)",
        block_causal=True,
        caches=("none", "block"),
    ),
    Family(
        name="pangu",
        model_types=("PanguEmbedded",),
        architectures=("PanguEmbeddedForCausalLM",),
        module="engine.models.pangu",
        description="openPangu-R-7B-Diffusion: context-causal block diffusion, shifted logits",
        block_causal=True,
        caches=("none", "block"),
    ),
    Family(
        name="qwen3_5_moe",
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        module="engine.models.qwen3_5_moe",
        description="Qwen3.5/3.6-MoE hybrid (Gated DeltaNet + gated attention), autoregressive base",
        engine="",
    ),
    Family(
        name="clover",
        model_types=("clover_moe",),
        architectures=(),
        module="engine.models.qwen3_5_moe",
        description="Clover: block diffusion on the Qwen3.5-MoE hybrid (EXPERIMENTAL, docs/clover.md)",
        engine="engine.runtime.clover.CloverEngine",
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


def family_for(raw_config: dict[str, Any]) -> Family:
    """Pick the family from `model_type`, falling back to `architectures`."""
    model_type = raw_config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    for arch in raw_config.get("architectures") or ():
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    raise UsageError(
        f"unsupported model_type {model_type!r} "
        f"(architectures {raw_config.get('architectures')}); supported: {supported_names()}"
    )
