"""GenerationParams: what a request asks of the denoiser, validated against the model.

Validation lives here (not in the CLI or the server) so every entry point rejects the same
inputs with the same one-line message.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.errors import UsageError

REMASKING = ("low_confidence", "random")
CACHES = ("none", "prefix", "dual", "block")
MODES = ("diffusion", "ar")


@dataclass(frozen=True)
class GenerationParams:
    gen_length: int = 128
    steps: int | None = None  # default: gen_length (one token per step)
    block_length: int | None = None  # default: 32 when it divides gen_length, else gen_length
    remasking: str = "low_confidence"
    temperature: float = 0.0
    cfg_scale: float = 0.0
    threshold: float | None = None  # Fast-dLLM parallel decoding: commit all conf >= threshold
    factor: float | None = None  # Fast-dLLM factor rule: accept rank n while conf >= 1 - f/(n+1)
    seed: int | None = None
    cache: str = "none"
    mode: str = "diffusion"

    def resolved(self) -> "GenerationParams":
        """Fill the defaults that depend on other fields."""
        block = self.block_length
        if block is None:
            block = 32 if self.gen_length % 32 == 0 else self.gen_length
        return replace(self, block_length=block, steps=self.steps or self.gen_length)

    @property
    def num_blocks(self) -> int:
        assert self.block_length is not None
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        assert self.steps is not None
        return self.steps // self.num_blocks

    def validate(self, prompt_length: int, max_length: int, block_causal: bool = False) -> "GenerationParams":
        """Return the resolved parameters or raise UsageError naming the bad field.
        `block_causal` families (LLaDA2, SDAR, openPangu) take the exact `block` cache and
        `ar` mode, and no classifier-free guidance or factor rule."""
        p = self.resolved()
        assert p.block_length is not None and p.steps is not None
        if p.gen_length < 1:
            raise UsageError(f"gen_length must be at least 1, got {p.gen_length}")
        if p.block_length < 1:
            raise UsageError(f"block_length must be at least 1, got {p.block_length}")
        if p.gen_length % p.block_length:
            raise UsageError(
                f"gen_length ({p.gen_length}) must be a multiple of block_length ({p.block_length})"
            )
        if p.steps < 1:
            raise UsageError(f"steps must be at least 1, got {p.steps}")
        if p.steps % p.num_blocks:
            raise UsageError(
                f"steps ({p.steps}) must be divisible by the number of blocks "
                f"(gen_length/block_length = {p.num_blocks})"
            )
        if p.remasking not in REMASKING:
            raise UsageError(f"remasking must be one of {', '.join(REMASKING)}, got {p.remasking!r}")
        if p.threshold is not None and not 0.0 < p.threshold <= 1.0:
            raise UsageError(f"threshold must be in (0, 1], got {p.threshold}")
        if p.factor is not None and p.factor <= 0:
            raise UsageError(f"factor must be positive, got {p.factor}")
        if p.threshold is not None and p.factor is not None:
            raise UsageError("threshold and factor are alternative commit rules: give one")
        if p.temperature < 0:
            raise UsageError(f"temperature must be >= 0, got {p.temperature}")
        if p.cfg_scale < 0:
            raise UsageError(f"cfg_scale must be >= 0, got {p.cfg_scale}")
        if p.cache not in CACHES:
            raise UsageError(f"cache must be one of {', '.join(CACHES)}, got {p.cache!r}")
        if block_causal:
            _validate_block_causal(p)
        elif p.cache != "none":
            raise UsageError(f"cache {p.cache!r} is not available yet; use --cache none")
        if p.mode not in MODES:
            raise UsageError(f"mode must be one of {', '.join(MODES)}, got {p.mode!r}")
        if p.mode != "diffusion" and not block_causal:
            raise UsageError(f"mode {p.mode!r} is not available for this model family")
        if prompt_length < 1:
            raise UsageError("the prompt is empty")
        if prompt_length + p.gen_length > max_length:
            raise UsageError(
                f"prompt ({prompt_length} tokens) + gen_length ({p.gen_length}) exceeds "
                f"the model's maximum length of {max_length} tokens"
            )
        return p


def _validate_block_causal(p: GenerationParams) -> None:
    if p.cache not in ("none", "block"):
        raise UsageError(
            f"cache {p.cache!r} is for bidirectional models; block-causal models take "
            "--cache block (exact KV cache) or none (recompute the prefix every step)"
        )
    if p.cfg_scale > 0:
        raise UsageError("classifier-free guidance is not available for block-causal models")
    if p.factor is not None:
        raise UsageError("the factor rule is not available for block-causal models; use --threshold")
