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
)


def supported_names() -> str:
    return ", ".join(f"{f.name} (model_type {'/'.join(f.model_types)})" for f in FAMILIES)


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
