"""What a checkpoint's family and config say about requests, torch-free: the one validation.

`validate(params, prompt_length, config)` is the check every entry point runs: `dlm
generate`, `dlm serve` and `dlm batch` from config.json before any weight loads (a bad
flag fails in milliseconds, not after the load), and `LLMEngine.validate` after loading,
so the two cannot disagree. The facts it needs beyond `GenerationParams.validate` are
derived here from the family's record (dlm/engine/registry.py) and `ModelConfig`, never
declared by a runner: the block length a request gets by default, the only block length a
family decodes, and the forwards a block costs besides its denoising steps (`Forwards`).
"""

from __future__ import annotations

from dataclasses import replace

from dlm.engine.config import CanvasSpec, ModelConfig
from dlm.engine.params import SAMPLER_DEFAULTS, Forwards, GenerationParams, ResolvedParams
from dlm.engine.registry import family_named

# Context tokens the exact block cache feeds per forward when filling it (dlm/engine/runtime/
# block_sequence.py): bounds attention memory on long prompts, and costs forwards.
PREFILL_CHUNK = 2048
DEFAULT_STEPS_PER_CANVAS = 48
# The seed of a canvas family's request that gives none. Its sampler draws the canvas and its
# samples at every temperature (there is no greedy mode), so without one the same request would
# answer differently each time; OpenAI clients (and `dlm validate`) expect a request that asks
# for no sampling to be reproducible. `seed` gives other samples.
DEFAULT_CANVAS_SEED = 0


def forwards(config: ModelConfig) -> Forwards:
    """How the model spends forwards on its blocks, so that `steps` bounds them all."""
    rules = config.block_rules
    if rules is not None:
        # openPangu's (shifted logits) commit forward of a block also decides the next block's first token.
        return Forwards(
            rules.aligned_grid,
            rules.sub_blocks,
            1 if rules.logit_shift else 0,
            PREFILL_CHUNK,
            rules.causal_context,
            whole_blocks=True,
        )
    # Clover's commit pass per block (the prompt's prefill stands in for the last block's);
    # Clover's fixed blocks and DiffusionGemma's canvases are decoded whole.
    family = family_named(config.family)
    return Forwards(
        per_block=1 if family.commit_pass else 0, whole_blocks=family.fixed_block or config.canvas is not None
    )


def fixed_block(config: ModelConfig) -> int | None:
    """The only block length the model decodes (its trained one), or None: any."""
    return config.block_length if family_named(config.family).fixed_block else None


def with_defaults(params: GenerationParams, config: ModelConfig) -> GenerationParams:
    """The family's defaults: its trained block length when the request gives none; for a
    block-causal family, `mode ar` is a block of one token decoded in one step (and so one
    token per forward: `AR_FIXED`, which `check_mode` refused if the request gave them);
    for a canvas family (DiffusionGemma), its sampler's."""
    if config.canvas is not None:
        return _canvas_defaults(params, config.canvas)
    if config.block_rules is not None and params.mode == "ar":
        return replace(params, block_length=1, steps=params.gen_length, refinement_steps=None, threshold=None)
    if params.block_length is None and config.block_length is not None:
        return replace(params, block_length=config.block_length)
    return params


def _canvas_defaults(params: GenerationParams, canvas: CanvasSpec) -> GenerationParams:
    """The sampler's defaults for fields not given (the checkpoint's generation_config.json,
    else transformers'); the canvas length as `block_length`; the per-canvas steps
    (`refinement_steps`) as `steps` in all, since a canvas may take more steps than it has
    tokens (renoised tokens are drawn again). A server's `max_steps` lowers the default
    per-canvas steps to fit, as it does for other families. Unseeded, a request is seeded
    `DEFAULT_CANVAS_SEED`: the same request gives the same answer."""
    defaults = {**SAMPLER_DEFAULTS, "refinement_steps": DEFAULT_STEPS_PER_CANVAS, **canvas.sampler_defaults}
    filled: dict[str, float | None] = {n: defaults[n] for n in SAMPLER_DEFAULTS if getattr(params, n) is None}
    block = params.block_length or canvas.canvas_length
    steps = params.steps
    if steps is None:
        canvases = -(-params.gen_length // block)  # the last one decoded whole, the answer cut from it
        per_canvas = int(params.refinement_steps or defaults["refinement_steps"])
        if params.refinement_steps is None and params.max_steps is not None:
            per_canvas = max(1, min(per_canvas, params.max_steps // canvases))  # a server's limit lowers the default
        steps = per_canvas * canvases
        filled["refinement_steps"] = None
    seed = DEFAULT_CANVAS_SEED if params.seed is None else params.seed
    return replace(params, block_length=block, steps=steps, seed=seed, **filled)  # type: ignore[arg-type]


def validate(params: GenerationParams, prompt_length: int, config: ModelConfig) -> ResolvedParams:
    """`params` resolved for a prompt of `prompt_length` tokens on the checkpoint `config`
    describes, or `UsageError` naming the field at fault."""
    params.check_ranges(config.logits_size)  # the family's defaults are derived from in-range fields
    family = family_named(config.family)
    params.check_mode(family)  # a mode the family lacks, and what mode ar fixes given beside it
    return with_defaults(params, config).validate(
        prompt_length,
        config.max_position_embeddings,
        family,
        fixed_block=fixed_block(config),
        forwards=forwards(config),
        vocab=config.logits_size,
    )
