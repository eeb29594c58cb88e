"""GenerationParams: what a request asks of the denoiser, validated against the model.

Validation lives here (not in the CLI or the server) so every entry point rejects the same
inputs with the same one-line message.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.errors import UsageError
from engine.registry import FAMILIES, Family

REMASKING = ("low_confidence", "random")
CACHES = ("auto", "none", "prefix", "dual", "block")
MODES = ("diffusion", "ar")
# Dream's diffusion_generate algorithms, plus Fast-dLLM's threshold rule.
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy", "confidence_threshold")
RANKING_ALGS = ("maskgit_plus", "topk_margin", "entropy")  # commit the top-n by a confidence
DREAM_DEFAULT_ALG = "entropy"  # deterministic at temperature 0; DiffuCoder's recommendation
DEFAULT_THRESHOLD = 0.9  # Fast-dLLM's default for `confidence_threshold`


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
    cache: str = "auto"  # auto (the family's exact cache, if any) | none | prefix | dual | block
    mode: str = "diffusion"
    early_stop: bool = True  # once a finished block holds EOS, fill the rest with EOS and stop
    # Dream family (diffusion_generate):
    alg: str | None = None  # default: confidence_threshold with a threshold, else entropy
    alg_temp: float | None = None  # sample committed positions from softmax(confidence / alg_temp)
    top_p: float | None = None
    top_k: int | None = None
    eps: float = 1e-3  # last timestep of linspace(1, eps, steps + 1)

    def resolved(self, family: Family | None = None) -> GenerationParams:
        """Fill the defaults that depend on other fields (and, for `alg`, on the family)."""
        block = self.block_length
        if block is None:
            block = 32 if self.gen_length % 32 == 0 else self.gen_length
        cache = self.cache
        if cache == "auto":
            cache = family.default_cache if family is not None else "none"
        p = replace(self, block_length=block, steps=self.steps or self.gen_length, cache=cache)
        if family is not None and family.sampler == "dream":
            alg = p.alg or ("confidence_threshold" if p.threshold is not None else DREAM_DEFAULT_ALG)
            threshold = p.threshold
            if alg == "confidence_threshold" and threshold is None:
                threshold = DEFAULT_THRESHOLD
            p = replace(p, alg=alg, threshold=threshold)
        return p

    @property
    def num_blocks(self) -> int:
        assert self.block_length is not None
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        assert self.steps is not None
        return self.steps // self.num_blocks

    def validate(self, prompt_length: int, max_length: int, family: Family | None = None) -> GenerationParams:
        """Return the resolved parameters or raise UsageError naming the bad field.

        `family` (default: LLaDA) decides which decoding fields apply and which caches exist.
        Block-causal families (LLaDA2, SDAR, openPangu) take the exact `block` cache and `ar`
        mode, and no classifier-free guidance or factor rule."""
        family = family or FAMILIES[0]
        block_causal = family.block_causal
        p = self.resolved(family)
        assert p.block_length is not None and p.steps is not None
        if p.gen_length < 1:
            raise UsageError(f"gen_length must be at least 1, got {p.gen_length}")
        if p.block_length < 1:
            raise UsageError(f"block_length must be at least 1, got {p.block_length}")
        if p.gen_length % p.block_length:
            raise UsageError(f"gen_length ({p.gen_length}) must be a multiple of block_length ({p.block_length})")
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
        elif p.cache not in family.caches:
            raise UsageError(
                f"cache {p.cache!r} is not available for {family.name} models; use one of {', '.join(family.caches)}"
            )
        if p.remasking == "random" and (p.threshold is not None or p.factor is not None):
            raise UsageError(
                "threshold and factor rank positions by model confidence; they cannot be combined with random remasking"
            )
        if p.cfg_scale > 0 and p.cache != "none":
            raise UsageError("classifier-free guidance is not available with a cache; use --cache none")
        _validate_sampler(p, family)
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


def _validate_sampler(p: GenerationParams, family: Family) -> None:
    """Fields that belong to one decoding family only, and Dream's own constraints."""
    dream_only = {"alg": p.alg, "alg_temp": p.alg_temp, "top_p": p.top_p, "top_k": p.top_k}
    if family.sampler != "dream":
        given = [name for name, value in dream_only.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} applies to Dream-family models, not {family.name}")
        return
    if p.remasking != "low_confidence":
        raise UsageError("remasking applies to LLaDA-family models; for Dream choose --alg (e.g. origin)")
    if p.factor is not None:
        raise UsageError("the factor rule applies to LLaDA-family models; for Dream use --threshold")
    if p.cfg_scale > 0:
        raise UsageError("classifier-free guidance applies to LLaDA-family models, not Dream")
    if p.alg not in DREAM_ALGS:
        raise UsageError(f"alg must be one of {', '.join(DREAM_ALGS)}, got {p.alg!r}")
    if p.threshold is not None and p.alg != "confidence_threshold":
        raise UsageError(f"threshold goes with alg confidence_threshold, not {p.alg!r}")
    if p.alg_temp is not None:
        if p.alg_temp <= 0:
            raise UsageError(f"alg_temp must be positive, got {p.alg_temp}")
        if p.alg not in RANKING_ALGS:
            raise UsageError(f"alg_temp samples among ranked positions; it needs alg {', '.join(RANKING_ALGS)}")
    if p.top_p is not None and not 0.0 < p.top_p <= 1.0:
        raise UsageError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k is not None and p.top_k < 1:
        raise UsageError(f"top_k must be at least 1, got {p.top_k}")
    if not 0.0 < p.eps < 1.0:
        raise UsageError(f"eps must be in (0, 1), got {p.eps}")
    if p.cache != "none" and p.alg != "confidence_threshold" and p.steps_per_block < 2:
        raise UsageError(
            "with a cache, Dream's first step of each block only commits the block's first token: "
            f"steps per block must be at least 2, got {p.steps_per_block}"
        )


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
