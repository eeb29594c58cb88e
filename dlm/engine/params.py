"""GenerationParams: what a request asks of the denoiser, declared and validated in one place.

Every decoding parameter is one field below, with its default and a `Param` record: its
help text, its range or choices, and its names on the command line (`dlm generate`) and in
the HTTP body (`dlm serve`). The CLI options and the HTTP schema are built from these
records (dlm/cli/params.py, dlm/cli/server/protocol.py), so a parameter is written once.

`validate()` is the one check: it fills the defaults that depend on other fields and on the
model family, applies the ranges and the family's rules, and returns a `ResolvedParams`,
which the engine, its scheduler and the tensor-parallel ranks accept as it is. Every
refusal is a `UsageError` naming its field (`error.field`).

Length semantics: any `gen_length` (max_tokens) is accepted with any block length. LLaDA and
Dream decode a shorter last block; families that decode on a block grid (block-causal ones,
Clover, DiffusionGemma: `Forwards.whole_blocks`) decode the last block whole, as SGLang and
dInfer do, and the answer is cut at `gen_length` (finish_reason `length` unless a stop id
falls inside it).

Step semantics: `steps` is an upper bound on the denoising steps of every commit rule but
one. It is split evenly over the blocks decoded (rounded down); a block gets at least the
steps it needs (`least_steps`: one per sub-block, two for Dream with a cache), so a smaller
`steps` is raised to that rather than refused. The schedule rule spends exactly a block's
share, while the threshold and factor rules may finish a block sooner, and the last step of
a block's share commits whatever is left in it. Without `steps`, the schedule spends one
forward per answer token in all (a block's extra forwards included), and a threshold or
factor rule is not capped (one step per position at most). The exception is Dream's
`alg confidence_threshold` named without a cache, which follows Fast-dLLM's whole-sequence
rule: a block's share of `steps` is its schedule, and steps are added after it until every
position clears the threshold (dlm/engine/decoding/dream.py), so its bound is one forward per
position. A plain `threshold` on Dream is the threshold rule every family has.
`refinement_steps` gives the same budget per block instead of in all. Some families spend
forwards besides the denoising steps (`Forwards`, derived from the family's record and
config by dlm/engine/family_rules.py, which calls `validate()` for every entry point);
`ResolvedParams.max_forwards` bounds them all, which is what a server's `--max-steps` caps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dlm.engine.capabilities import BY_NAME as CAPABILITIES
from dlm.engine.capabilities import require
from dlm.engine.errors import Name, Unsupported, UsageError
from dlm.engine.registry import FAMILIES, Family
from dlm.engine.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS, stop_strings
from dlm.engine.structured import FIELD, Skeleton, asks_structure, compile_response_format

P = TypeVar("P", bound="GenerationParams")

REMASKING = ("low_confidence", "random")
CACHES = ("auto", "none", "prefix", "dual", "block")
MODES = ("diffusion", "ar")
# Which families take a mode beyond diffusion: the capability /v1/models lists (`decode_mode`).
MODES_CAPABILITY = CAPABILITIES["decode_mode"]
# What `mode ar` fixes (block-causal families, dlm/engine/family_rules.py): a block of one token,
# decoded in one step, committed whatever its confidence. Given beside it, each is refused
# (it was silently replaced: `--steps 3` still spent one forward per token).
AR_FIXED = ("block_length", "steps", "refinement_steps", "threshold")
# Dream's diffusion_generate algorithms, plus Fast-dLLM's threshold rule.
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy", "confidence_threshold")
DREAM_ONLY = ("alg", "alg_temp", "top_p", "top_k")
RANKING_ALGS = ("maskgit_plus", "topk_margin", "entropy")  # commit the top-n by a confidence
DREAM_DEFAULT_ALG = "entropy"  # deterministic at temperature 0; DiffuCoder's recommendation
DEFAULT_THRESHOLD = 0.9  # Fast-dLLM's default for `confidence_threshold`
SEED_LIMIT = 2**63  # torch.Generator's seeds are below this
# LLaDA2.1's draft-and-edit presets (model card): (threshold, edit_threshold). Speed mode drafts
# boldly and lets edits repair; quality mode drafts conservatively.
EDIT_PRESETS = {"speed": (0.5, 0.0), "quality": (0.7, 0.5)}
DEFAULT_EDIT_PRESET = "speed"  # SGLang's JointThreshold defaults are speed mode's
DEFAULT_MAX_POST_EDIT_STEPS = 16  # SGLang's JointThreshold default
MAX_TOP_LOGPROBS = 20  # alternatives per token, as the OpenAI API bounds top_logprobs
# The least and the largest positive temperature a sampler divides by (`temperature`,
# `alg_temp` and the entropy-bound sampler's): one outside resolves to the nearer, after
# validation. Each is its limit already: at 1e-30 the greedy one (logits 1e-28 apart are a
# probability ratio of e^100), at 1e30 the uniform one (every logit divided to ~0). Past them
# float32 logits left their range: a float32 0 (1e-40) or inf (1e39) divisor, an overflow, or
# -inf / inf for an excluded token, and the softmax's NaN failed the step, and the forward's
# other requests, with it.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-30, 1e30
TEMPERATURES = ("temperature", "alg_temp", "min_temperature", "max_temperature")
MAX_N = 64  # samples per prompt
# The most denoising steps a request may ask for (`steps` in all, `refinement_steps` per
# block): far past any schedule (a million forwards), and each block's schedule is a list
# that long. Unbounded, steps 2**31 was a MemoryError (a 17 GB schedule) and DiffusionGemma's
# int32 step fraction an overflow: tracebacks from generate, an engine failure served.
MAX_STEPS = 2**20
# The largest classifier-free guidance scale: far past any useful guidance (LLaDA's evaluations
# use at most 3), and the guided hidden state (s + 1) h_cond - s h_uncond stays within the
# model's dtype. A scale of 1e38 overflowed float32 (float16 at a few thousand): the step's
# probabilities were NaN, a garbage answer and, with logprobs, a 500.
MAX_CFG_SCALE = 100.0
# transformers' defaults for DiffusionGemma's generate (DiffusionGemmaGenerationConfig), where
# the checkpoint's generation_config.json says nothing (dlm/engine/family_rules.py fills them).
SAMPLER_DEFAULTS = dict(
    entropy_bound=0.1, min_temperature=0.4, max_temperature=0.8, stability_threshold=1, confidence_threshold=0.005
)


def _sampler_default(name: str) -> str:
    return f"{SAMPLER_DEFAULTS[name]}, or the checkpoint's generation_config.json"


@dataclass(frozen=True)
class Param:
    """How one GenerationParams field is offered and checked.

    `cli` and `http` are its names outside ("" = derived from the field name, None = not
    offered there); the bounds are inclusive unless `*_open`; `choices` lists the accepted
    strings; `shown` says in words what a default of None means (what `--help` and the HTTP
    schema show as the default)."""

    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    cli: str | None = ""
    http: str | None = ""
    shown: str | None = None

    def check(self, name: str, value: Any) -> None:
        """Refuse a value outside the range or choices, or a non-finite float (None means
        "not given")."""
        if value is None:
            return
        if self.choices is not None:
            if value not in self.choices:
                raise UsageError((Name(name), f" must be one of {', '.join(self.choices)}, got {value!r}"), field=name)
            return
        # NaN fails every comparison and so would pass any range; no parameter gives inf a
        # meaning, so a non-finite float (nan, inf, -inf) is refused for all of them.
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError((Name(name), f" must be a finite number, got {value}"), field=name)
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if too_low or too_high:
            raise UsageError((Name(name), f" must be {self.range()}, got {value}"), field=name)

    def range(self) -> str:
        """The accepted range in words: `at least 1`, `positive`, `in (0, 1]`."""
        low, high = _num(self.low), _num(self.high)
        if self.high is None:
            if self.low_open:
                return "positive" if self.low == 0 else f"greater than {low}"
            return f"at least {low}" if self.low != 0 else ">= 0"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _num(value: float | None) -> str:
    return str(int(value)) if value is not None and float(value).is_integer() else str(value)


def _param(default: Any, help: str, **spec: Any) -> Any:
    return field(default=default, metadata={"param": Param(help, **spec)})


@dataclass(frozen=True)
class Forwards:
    """How a model spends forwards on its blocks beyond one per denoising step: what turns
    `steps` into a bound on the forwards a request spends. Derived from the family's
    record and config (dlm/engine/family_rules.py)."""

    aligned_grid: bool = False  # blocks at multiples of block_length (LLaDA2, SDAR): one more may straddle the prompt
    sub_blocks: int = 1  # a block is denoised in this many sub-blocks, at least a forward each (openPangu)
    per_block: int = 0  # forwards per block besides its steps (openPangu's commit forward, Clover's commit pass)
    # With the exact block cache, context beyond this many tokens is first fed in chunks (0: never);
    # chunks of `prefill_chunk` tokens when the context attends causally, else of whole blocks.
    prefill_chunk: int = 0
    causal_context: bool = False
    # The model decodes whole blocks (a block grid: block-causal families, Clover's fixed
    # block, DiffusionGemma's canvases): an answer that ends inside a block is cut from it.
    # Otherwise (LLaDA, Dream) the answer's last block is shorter.
    whole_blocks: bool = False

    def blocks(self, prompt_length: int, gen_length: int, block: int) -> int:
        """Blocks decoded for this prompt: every block holding a position of the answer."""
        if not self.aligned_grid:
            return -(-gen_length // block)
        return -(-(prompt_length + gen_length) // block) - prompt_length // block

    def grid_end(self, prompt_length: int, gen_length: int, block: int) -> int:
        """On an aligned grid, the end of the block holding the answer's last position: where
        the canvas of a prompt and answer of these lengths ends."""
        return -(-(prompt_length + gen_length) // block) * block

    def share(self, budget: int, prefill: int, decoded: int) -> int:
        """Denoising steps per block that keep a request within `budget` forwards in all,
        besides the forwards the model spends anyway (cache prefill, one per block beyond its
        steps); at least one."""
        return max(1, (budget - prefill) // decoded - self.per_block)

    def units(self, block: int) -> int:
        """Sub-blocks a block of `block` tokens is denoised in (a forward each at least): blocks
        shorter than `sub_blocks` tokens have one a token (dlm/engine/runtime/block_sequence.py)."""
        return block // max(1, block // self.sub_blocks)

    def prefill(self, prompt_length: int, block: int) -> int:
        """Forwards that only fill the block cache before the first block is decoded
        (dlm/engine/runtime/block_sequence.py, `plan`)."""
        start = prompt_length // block * block if self.aligned_grid else prompt_length
        if not self.prefill_chunk or start <= self.prefill_chunk:
            return 0
        step = self.prefill_chunk if self.causal_context else max(block, self.prefill_chunk // block * block)
        return -(-(start - self.prefill_chunk) // step)


@dataclass(frozen=True)
class GenerationParams:
    gen_length: int = _param(
        128,
        "Tokens to generate, at most (any number: a block grid's last block is decoded whole and the answer cut here).",
        low=1,
        http="max_tokens",
    )
    steps: int | None = _param(
        None,
        "Upper bound on denoising steps in all, split evenly over the blocks decoded, at least one per block "
        "(per sub-block): every rule (schedule, threshold, factor) finishes a block within its share, the "
        "share's last step committing what is left. Dream's alg confidence_threshold without a cache is "
        "Fast-dLLM's: its schedule, plus steps until every token clears the threshold.",
        low=1,
        high=MAX_STEPS,
        shown="one forward per answer token; a threshold or factor rule uncapped",
    )
    refinement_steps: int | None = _param(
        None,
        "Denoising steps per block (at most the block length) instead of --steps in all.",
        low=1,
        high=MAX_STEPS,
        shown="none: --steps",
    )
    block_length: int | None = _param(
        None,
        "Semi-autoregressive block size; need not divide gen_length.",
        low=1,
        shown="the family's, else 32 if it divides gen_length, else gen_length: one block",
    )
    remasking: str = _param("low_confidence", "Which positions a step commits.", choices=REMASKING)
    temperature: float = _param(0.0, "Sampling temperature (0: greedy).", low=0)
    cfg_scale: float = _param(
        0.0, "Classifier-free guidance scale (0: off; LLaDA family, no cache).", low=0, high=MAX_CFG_SCALE
    )
    threshold: float | None = _param(
        None,
        "Fast-dLLM parallel decoding: commit every masked token with confidence >= T, at least one per step.",
        low=0,
        high=1,
        low_open=True,
        shown=f"none: the step schedule; {DEFAULT_THRESHOLD} with Dream's --alg confidence_threshold",
    )
    factor: float | None = _param(
        None, "Fast-dLLM factor rule instead of a threshold (LLaDA family).", low=0, low_open=True, shown="none"
    )
    seed: int | None = _param(
        None,
        "Random seed for sampling and random remasking.",
        low=0,
        high=SEED_LIMIT,
        high_open=True,
        shown="none: unseeded (DiffusionGemma: 0, reproducible)",
    )
    cache: str = _param(
        "auto",
        "auto (the family's exact cache, if any)|none|prefix|dual (Fast-dLLM approximate K/V cache, refreshed "
        "per block; LLaDA, Dream)|block (exact KV cache of block-causal models).",
        choices=CACHES,
    )
    mode: str = _param(
        "diffusion",
        "diffusion|ar (ar: one token per forward, block-causal models; steps, refinement_steps, block_length and "
        "threshold do not apply).",
        choices=MODES,
        http="decode_mode",
    )
    # Draft-and-edit (LLaDA2.1; dlm/engine/decoding/draft_edit.py):
    edit_threshold: float | None = _param(
        None,
        "Draft-and-edit (LLaDA2.x): also replace a committed token of the current block when the model's top "
        "token differs with probability > E (0: any change); turns editing on.",
        low=0,
        high=1,
        shown="none: no editing",
    )
    edit_mode: str | None = _param(
        None,
        "Draft-and-edit preset (LLaDA2.x), turns editing on: speed (threshold 0.5, edit threshold 0) or quality "
        "(threshold 0.7, edit threshold 0.5); an explicit --threshold or --edit-threshold overrides it.",
        choices=tuple(EDIT_PRESETS),
        shown="none: no editing",
    )
    max_post_edit_steps: int | None = _param(
        None,
        "Draft-and-edit: steps that may still edit a block once its masks are filled.",
        low=0,
        shown=str(DEFAULT_MAX_POST_EDIT_STEPS),
    )
    stop_token_ids: tuple[int, ...] | None = _param(
        None,
        "Token ids that end the answer besides EOS, as EOS does: the answer ends at the first one committed "
        "(finish_reason stop) and decoding stops after the block holding it (a list; on the command line, "
        "comma-separated or the flag repeated).",
        cli="--stop-token-ids",
        shown="none",
    )
    stop: tuple[str, ...] | None = _param(
        None,
        "Stop strings: the answer is cut where the first one starts (finish_reason stop) and decoding ends at "
        f"the step whose committed text first holds one; at most {MAX_STOP_STRINGS} strings of at most "
        f"{MAX_STOP_CHARS} characters (on the command line, the flag repeated).",
        shown="none",
        http=None,  # OpenAI's `stop`, a string or a list: the request layer maps it (dlm/cli/server/protocol.py)
    )
    early_stop: bool = _param(
        True,
        "Stop once a finished block holds EOS (the rest is filled with EOS).",
        cli="--early-stop/--no-early-stop",
        # Off, it only spends forwards on what follows EOS, which no answer returns: not a
        # request's to ask of a server (docs/serve.md).
        http=None,
    )
    # Fixed output lengths (vLLM's names and meaning; benchmark clients send them):
    ignore_eos: bool = _param(
        False,
        "Do not end the answer at EOS: EOS is never committed (it is masked out of every decision), so the "
        "answer runs to gen_length unless one of stop_token_ids ends it.",
    )
    min_tokens: int = _param(
        0,
        "The answer has at least this many tokens: EOS and stop_token_ids are never committed at its first "
        "N positions, and a stop string does not end it before them (at most gen_length).",
        low=0,
    )
    n: int = _param(
        1,
        "Samples per prompt, decoded together; sample i uses seed + i (with a seed), so each equals a request "
        "with that seed. Greedy decoding gives n equal samples.",
        low=1,
        high=MAX_N,
        cli="--n",
    )
    logprobs: int | None = _param(
        None,
        "Report each generated token's log-probability at the denoising step that committed it (not an "
        "autoregressive next-token probability), with this many most likely alternatives (0: none).",
        low=0,
        high=MAX_TOP_LOGPROBS,
        shown="none: no log-probabilities",
        http=None,  # the OpenAI endpoints spell it differently (completions vs chat): the request layer maps it
    )
    # Infilling: token ids the answer is decoded in front of (the canvas is prompt, answer, suffix).
    # Text reaches it through the request layer (`suffix` on /v1/completions, `dlm generate --suffix`).
    suffix: tuple[int, ...] = _param((), "Token ids after the answer (infilling).", cli=None, http=None)
    drafts: int = _param(
        0,
        "Lossless multi-token steps: candidate canvases of the following step verified in each forward "
        "(0: off; LLaDA family, greedy low-confidence rules, no guidance). The ids are those of the plain "
        "rule; forwards drop while each costs up to 1+N canvases of compute.",
        low=0,
        high=64,
    )
    # Dream family (diffusion_generate):
    alg: str | None = _param(
        None,
        "Dream family: origin|maskgit_plus|topk_margin|entropy|confidence_threshold.",
        choices=DREAM_ALGS,
        shown=f"confidence_threshold with a threshold, else {DREAM_DEFAULT_ALG}",
    )
    alg_temp: float | None = _param(
        None,
        "Dream family: sample committed positions from softmax(confidence/alg_temp).",
        low=0,
        low_open=True,
        shown="none: the most confident",
    )
    top_p: float | None = _param(
        None,
        "Dream family: nucleus filtering of the token distribution (1: none, taken by every family).",
        low=0,
        high=1,
        low_open=True,
        shown="none",
    )
    top_k: int | None = _param(None, "Dream family: keep the k most likely tokens.", low=1, shown="none")
    eps: float = _param(
        1e-3,
        "Dream family: last timestep of linspace(1, eps, steps + 1).",
        low=0,
        high=1,
        low_open=True,
        high_open=True,
        cli=None,
        http=None,
    )
    # DiffusionGemma (entropy-bound sampler; the canvas length is `block_length`, the
    # denoising steps per canvas `refinement_steps`):
    entropy_bound: float | None = _param(
        None,
        "DiffusionGemma: a step accepts the lowest-entropy tokens while their summed entropy, "
        "less the largest, stays within this bound.",
        low=0,
        low_open=True,
        shown=_sampler_default("entropy_bound"),
    )
    min_temperature: float | None = _param(
        None,
        "DiffusionGemma: temperature at the last denoising step of a canvas.",
        low=0,
        low_open=True,
        shown=_sampler_default("min_temperature"),
    )
    max_temperature: float | None = _param(
        None,
        "DiffusionGemma: temperature at the first denoising step, falling linearly.",
        low=0,
        shown=_sampler_default("max_temperature"),
    )
    stability_threshold: int | None = _param(
        None,
        "DiffusionGemma: a canvas may stop once its argmax has not changed for this many steps.",
        low=0,
        shown=_sampler_default("stability_threshold"),
    )
    confidence_threshold: float | None = _param(
        None,
        "DiffusionGemma: ... and the mean entropy of its tokens is below this.",
        low=0,
        low_open=True,
        shown=_sampler_default("confidence_threshold"),
    )
    response_format: str | None = _param(
        None,
        "Answer as JSON: an OpenAI response_format object as JSON text, "
        '\'{"type": "json_object"}\' or \'{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}\'. '
        "The schema's skeleton is laid on the canvas and only its values are decoded (bidirectional families; "
        "docs/structured-output.md).",
        shown="none: plain text",
    )
    # Set by a server (its --max-steps), never by a request: when `steps` is not given, the
    # default step count is lowered to fit; an explicit `steps` above it is the server's to refuse.
    max_steps: int | None = _param(
        None, "Largest step count a default may take (a server's limit).", low=1, cli=None, http=None
    )
    # Set by a server (the caller's API key), never by a request: prompts are looked up in and
    # published to this partition of the prefix cache only, so no tenant hits another's pages.
    prefix_cache_partition: str | None = _param(
        None,
        "The prefix-cache partition the request reads and fills (a server's: the API key's); None: the shared one.",
        cli=None,
        http=None,
    )

    def check_ranges(self, vocab: int | None = None) -> None:
        """Refuse a field outside its declared range or choices (and stop ids outside the
        vocabulary): what must hold before any default is derived from the fields."""
        for name, spec in PARAMS.items():
            value = getattr(self, name)
            _check_type(name, value)
            spec.check(name, value)
        _validate_stop_token_ids(self.stop_token_ids, vocab)
        _validate_suffix(self.suffix)
        stop_strings(self.stop)

    def require_mode(self, family: Family) -> None:
        """Refuse a decoding mode `family` cannot decode (the `decode_mode` capability)."""
        if self.mode != "diffusion" and not MODES_CAPABILITY.supports(family):
            raise Unsupported(
                (Name("mode"), f" {self.mode!r} is not available for {family.name} models: {MODES_CAPABILITY.why_not}"),
                field="mode",
            )

    def check_mode(self, family: Family) -> None:
        """Refuse a mode `family` cannot decode, then what the request's mode fixes itself
        (`AR_FIXED` with mode ar) when the request gives it: asked of the request as given,
        before the family's defaults fill those fields (dlm/engine/family_rules.py, which every
        entry point validates through). The mode first: `steps` beside ar on LLaDA was refused
        as not applying to ar, which LLaDA cannot decode at all."""
        self.require_mode(family)
        given = [name for name in AR_FIXED if getattr(self, name) is not None]
        if self.mode == "ar" and given:
            raise Unsupported(
                (
                    Name(given[0]),
                    " does not apply to ",
                    Name("mode"),
                    " ar, which decodes one token per forward (a block of one token, one step each, "
                    "whatever its confidence)",
                ),
                field=given[0],
            )

    @property
    def edits(self) -> bool:
        """The request asks for draft-and-edit decoding (dlm/engine/decoding/draft_edit.py)."""
        return self.edit_threshold is not None or self.edit_mode is not None

    def validate(
        self,
        prompt_length: int,
        max_length: int,
        family: Family | None = None,
        *,
        fixed_block: int | None = None,
        forwards: Forwards | None = None,
        vocab: int | None = None,
    ) -> ResolvedParams:
        """Return the resolved parameters or raise UsageError naming the bad field.

        `family` (default: LLaDA) decides which decoding fields apply, which caches exist
        and the defaults that depend on it. Block-causal families (LLaDA2, SDAR, openPangu)
        take the exact `block` cache and `ar` mode, and no classifier-free guidance or factor
        rule. `fixed_block`: the model decodes blocks of exactly this size and nothing else
        (Clover), so no other block length and no guidance. `forwards`: how the model spends
        forwards on blocks (default: one per denoising step). `vocab`: the model emits token ids
        below it (stop ids outside are refused)."""
        family = family or FAMILIES[0]
        self.check_ranges(vocab)
        if self.steps is not None and self.refinement_steps is not None:
            raise UsageError("give steps (in all) or refinement_steps (per block), not both", field="refinement_steps")
        if self.threshold is not None and self.factor is not None:
            raise UsageError("threshold and factor are alternative commit rules: give one", field="factor")
        if asks_structure(self.response_format):
            _validate_structured(self, family)  # before compiling: these refusals hold whatever the schema
        p = self._resolved(family, prompt_length, forwards or Forwards())
        _validate_edits(self, p, family)  # first: the presets fill a threshold other rules would judge
        if p.cache not in family.caches and p.cache != "none":
            choices = ", ".join(family.caches)
            raise UsageError(
                (
                    Name("cache"),
                    f" {p.cache!r} is for bidirectional models; block-causal models take 'block' (exact KV "
                    "cache) or 'none' (recompute the prefix every step)",
                )
                if family.block_causal
                else f"cache {p.cache!r} is not available for {family.name} models; use one of {choices}",
                field="cache",
            )
        if p.remasking == "random" and (p.threshold is not None or p.factor is not None):
            raise UsageError(
                "threshold and factor rank positions by model confidence; "
                "they cannot be combined with random remasking",
                field="remasking",
            )
        if family.block_causal:
            _validate_block_causal(p)
        if fixed_block is not None:
            _validate_fixed_block(p, family, fixed_block)
        if p.cfg_scale > 0 and p.cache != "none":
            raise UsageError(
                ("classifier-free guidance is not available with a cache; use ", Name("cache"), " 'none'"),
                field="cfg_scale",
            )
        _validate_sampler(p, family)
        if p.drafts:
            _validate_drafts(p, family, fixed_block)
        if p.skeleton is not None and family.sampler == "dream" and p.cache != "none":
            raise Unsupported(
                "response_format with Dream's cached decoding is not supported (its first step of each block "
                "commits the block's first position, which may be a fixed skeleton token); use cache none",
                field="cache",
            )
        p.require_mode(family)
        if p.suffix:
            require(family, "suffix")
        if p.logprobs is not None:
            require(family, "logprobs")
        if p.min_tokens > p.gen_length:
            raise UsageError(
                (Name("min_tokens"), f" ({p.min_tokens}) must not exceed ", Name("gen_length"), f" ({p.gen_length})"),
                field="min_tokens",
            )
        if p.seed is not None and p.seed + p.n > SEED_LIMIT:
            raise UsageError(f"seed + n - 1 must be below {SEED_LIMIT} (sample i uses seed + i)", field="seed")
        if prompt_length < 1:
            raise UsageError("the prompt is empty", field="prompt")
        if prompt_length + p.gen_length + len(p.suffix) > max_length:
            suffix = f" + suffix ({len(p.suffix)})" if p.suffix else ""
            raise UsageError(
                (
                    Name("prompt"),
                    f" ({prompt_length} tokens) + ",
                    Name("gen_length"),
                    f" ({p.gen_length}){suffix} exceeds the model's maximum length of {max_length} tokens",
                ),
                field="prompt",
            )
        # After the length: a block_length the request does not give is gen_length's (one block),
        # and judged first it named block_length for a max_tokens too long.
        if (p.block_length or 0) > max_length:  # a block-causal canvas runs to a block boundary past the context
            raise UsageError(
                f"block_length ({p.block_length}) exceeds the model's maximum length of {max_length} tokens",
                field="block_length",
            )
        # After the checks, which judge the values sent: temperatures into what samplers divide by.
        bounded: dict[str, Any] = {
            n: min(max(t, MIN_TEMPERATURE), MAX_TEMPERATURE) for n in TEMPERATURES if (t := getattr(p, n))
        }
        return dataclasses.replace(p, **bounded) if bounded else p

    def samples(self: P) -> list[P]:
        """The `n` samples this request asks for, each a request of its own (n = 1): sample i
        has seed `seed + i`, so it equals a separate request with that seed (unseeded: each
        draws its own noise)."""
        if self.n == 1:
            return [self]
        seeds = [None if self.seed is None else self.seed + i for i in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=seed) for seed in seeds]

    def _resolved(self, family: Family, prompt_length: int, forwards: Forwards) -> ResolvedParams:
        """Fill the defaults that depend on other fields and on the family: the block layout
        (any gen_length: the last block is shorter, or decoded whole and cut on a block grid)
        and the steps each block decoded gets (never fewer than it needs: `least_steps`)."""
        gen = self.gen_length
        block = self.block_length
        if block is None:
            block = 32 if gen % 32 == 0 else gen
        blocks = -(-gen // block)  # blocks of the answer, the last one possibly partial
        decoded = forwards.blocks(prompt_length, gen, block)
        cache = family.default_cache if self.cache == "auto" else self.cache
        prefill = forwards.prefill(prompt_length, block) if cache == "block" else 0
        alg, threshold = self.alg, self.threshold
        if family.sampler == "dream":
            alg = alg or ("confidence_threshold" if threshold is not None else DREAM_DEFAULT_ALG)
            if alg == "confidence_threshold" and threshold is None:
                threshold = DEFAULT_THRESHOLD
        if self.steps is not None:
            per_block = self.steps // decoded  # split evenly over the blocks decoded
        elif self.refinement_steps is not None:
            per_block = min(self.refinement_steps, block)  # a block takes at most one step per token
        else:
            # A rule that paces itself (threshold, factor, draft-and-edit) is not capped: up to
            # one step per position. The schedule spends one forward per answer token in all.
            paced = threshold is not None or self.factor is not None or self.edits
            per_block = block if paced else forwards.share(gen, prefill, decoded)
        if self.steps is None and self.max_steps is not None:  # a server's limit lowers the default to fit
            per_block = min(per_block, forwards.share(self.max_steps, prefill, decoded))
        per_block = max(per_block, least_steps(family, forwards, block, cache))
        steps = per_block * decoded
        # Fast-dLLM's whole-sequence Dream rule, asked for by its name (alg confidence_threshold)
        # without a cache; a plain threshold is the same rule as on every other family.
        quota = family.sampler == "dream" and self.alg == "confidence_threshold" and cache == "none"
        values = {name: getattr(self, name) for name in PARAMS}
        values.update(suffix=tuple(int(t) for t in self.suffix))  # a list from the Python API is welcome
        if self.top_p == 1:  # filters nothing (OpenAI's default, which clients send): asks for nothing
            values["top_p"] = None
        if isinstance(self.response_format, dict):  # so is the response_format object: kept as its text
            values["response_format"] = json.dumps(self.response_format)
        if self.stop_token_ids is not None:  # a list from a client: one immutable, ordered form
            values["stop_token_ids"] = tuple(self.stop_token_ids)
        values["stop"] = stop_strings(self.stop)  # one string or a list: a tuple, the empty ones dropped
        per_block += forwards.per_block
        if quota:
            # Fast-dLLM's whole-sequence rule adds steps until every position clears the
            # threshold, committing at least one per forward: a block's length bounds it.
            per_block = max(per_block, block)
        # The schema compiled once, here at the boundary: what the engine lays on the canvas.
        # Compiling stops as soon as the skeleton cannot fit `gen_length` (dlm/engine/structured.py).
        skeleton = compile_response_format(self.response_format, gen)
        if skeleton is not None:
            # Value slots are written left to right, at least one token per step: a block
            # may take one forward per position when its share of the steps is smaller.
            per_block = max(per_block, block)
        if self.edits:
            # Draft-and-edit: the preset fills what is not given; a block takes at most
            # block + max_post_edit_steps + 1 steps (dlm/engine/decoding/draft_edit.py).
            preset_threshold, preset_edit = EDIT_PRESETS[self.edit_mode or DEFAULT_EDIT_PRESET]
            threshold = preset_threshold if threshold is None else threshold
            post = DEFAULT_MAX_POST_EDIT_STEPS if self.max_post_edit_steps is None else self.max_post_edit_steps
            values.update(
                edit_threshold=preset_edit if self.edit_threshold is None else self.edit_threshold,
                max_post_edit_steps=post,
            )
            per_block = block + post + 1 + forwards.per_block
        values.update(block_length=block, steps=steps, refinement_steps=None, cache=cache, alg=alg, threshold=threshold)
        canvas_length = blocks * block if forwards.whole_blocks else gen
        return ResolvedParams(
            **values,
            decoded_blocks=decoded,
            max_forwards=per_block * decoded + prefill,
            canvas_length=canvas_length,
            grid_length=forwards.grid_end(prompt_length, gen, block) - prompt_length
            if forwards.aligned_grid
            else canvas_length,
            threshold_quota=quota,
            skeleton=skeleton,
        )


@dataclass(frozen=True)
class ResolvedParams(GenerationParams):
    """Parameters `GenerationParams.validate()` accepted for one model and prompt length:
    defaults filled (`steps` and `block_length` set, `cache` never `auto`), every rule
    checked. Engines take them without checking again."""

    # Blocks the model decodes: gen_length / block_length, or one more when an absolute block
    # grid straddles the prompt's end. `steps` is split evenly over them.
    decoded_blocks: int = 1
    # The most forwards the request can spend (its `usage.denoising_steps`): `steps`, plus
    # what the model's block layout costs beyond them (`Forwards`).
    max_forwards: int = 0
    # The response format compiled (None: plain text), laid out by the engine.
    skeleton: Skeleton | None = field(default=None, compare=False, repr=False)
    # Answer positions the model decodes: gen_length, or on a block grid (`Forwards.whole_blocks`)
    # gen_length rounded up to whole blocks, the answer being cut at gen_length.
    canvas_length: int = 0
    # Canvas positions after the prompt, before any suffix: `canvas_length`, or on an aligned
    # block grid (`Forwards.aligned_grid`) to the end of the block holding the answer's last
    # position (the grid's first block holds the prompt's end). What a sequence's canvas holds
    # (dlm/engine/runtime/block_sequence.py) and so what `forward_tokens` counts.
    grid_length: int = 0
    # Dream's `confidence_threshold` as Fast-dLLM's whole-sequence generation_utils.py runs it
    # (asked for by name, no cache): each step commits only within the block's linear
    # schedule, and steps are added after it (dlm/engine/decoding/dream.py).
    threshold_quota: bool = False

    @property
    def num_blocks(self) -> int:
        """Blocks of the canvas after the prompt (the last one shorter when block_length does
        not divide it)."""
        assert self.block_length is not None
        return -(-self.canvas_length // self.block_length)

    def forward_tokens(self, prompt_length: int) -> int:
        """Tokens a sequence of these parameters on a prompt of `prompt_length` tokens feeds to
        each forward, at most: its whole canvas (prompt, grid, suffix), twice with CFG, once
        more per draft candidate (`drafts`, dlm/engine/decoding/drafts.py). Derived from the
        parameters alone, so a check made before any sequence exists (a server's `/tokenize`,
        its `n` check) counts what the scheduler's token bound counts once they do."""
        canvas = prompt_length + self.grid_length + len(self.suffix)
        return canvas * (2 if self.cfg_scale > 0 else 1 + self.drafts)

    @property
    def steps_per_block(self) -> int:
        """Each block's share of `steps`: no rule spends more forwards on a block."""
        assert self.steps is not None
        return self.steps // self.decoded_blocks


PARAMS: dict[str, Param] = {f.name: f.metadata["param"] for f in dataclasses.fields(GenerationParams)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(GenerationParams)}


def _alternatives(hint: Any) -> tuple[Any, ...]:
    """The types a field's annotation allows: each member of a union, else the one type."""
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


# Each scalar field's Python types, from its annotation: what `_check_type` holds a value to.
# The command line and the HTTP schema (strict) deliver these types; the Python API takes any
# object, and a value of another type ("4" for gen_length, 1.5 for seed, None for remasking)
# failed deep in the engine with a torch or comparison traceback, or passed silently (a
# truthy string for ignore_eos, a float for min_tokens).
SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    name: _alternatives(hint)
    for name, hint in typing.get_type_hints(GenerationParams).items()
    if name in PARAMS
    and name != "response_format"  # text or an object: `format_object`'s rule
    and all(t in (int, float, str, bool, type(None)) for t in _alternatives(hint))
}
TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "None"}


def _check_type(name: str, value: Any) -> None:
    """Refuse a scalar field's value of another type than the field's: a bool is not an
    integer or a number (though Python's bool is an int), an integer is a number. The fields
    holding lists (stop_token_ids, stop, suffix) and response_format (text or an object) have
    rules of their own."""
    kinds = SCALAR_TYPES.get(name)
    if kinds is None:
        return
    if isinstance(value, bool):
        ok = bool in kinds
    elif isinstance(value, int):
        ok = int in kinds or float in kinds
    else:
        ok = any(isinstance(value, kind) for kind in kinds if kind not in (int, bool))
    if not ok:
        words = " or ".join(TYPE_WORDS[kind] for kind in kinds)
        raise UsageError((Name(name), f" must be {words}, got {value!r}"), field=name)


def cli_flag(name: str) -> str | None:
    """The `dlm generate` option of field `name` (None: not offered there)."""
    cli = PARAMS[name].cli
    return cli if cli != "" else "--" + name.replace("_", "-")


def http_name(name: str) -> str | None:
    """The HTTP body field of GenerationParams field `name` (None: not offered there)."""
    http = PARAMS[name].http
    return http if http != "" else name


def reproducible(p: ResolvedParams, family: Family) -> bool:
    """Whether the answer is a function of the prompt and `p` alone: every random draw comes
    from the request's own seeded generator, or none is made (greedy tokens, and positions
    ranked by the model: not LLaDA's random remasking, Dream's `origin` order or a positive
    `alg_temp`; the entropy-bound sampler draws its canvas). What a server may answer again
    from its response cache (dlm/cli/server/response_cache.py)."""
    if p.seed is not None:
        return True
    if p.temperature > 0 or family.sampler == "entropy_bound":
        return False
    if family.sampler == "dream":
        return p.alg != "origin" and not p.alg_temp
    return p.remasking != "random"


def least_steps(family: Family, forwards: Forwards, block: int, cache: str) -> int:
    """The fewest denoising steps a block can be decoded in: one per sub-block (each is a
    forward of its own), two for Dream with a cache (its first step, the cache's refresh,
    commits only the block's first token). Fewer steps asked are raised to it."""
    least = forwards.units(block)
    if family.sampler == "dream" and cache != "none":
        least = max(least, 2)
    return least


ENTROPY_BOUND_FIELDS = (
    "entropy_bound",
    "min_temperature",
    "max_temperature",
    "stability_threshold",
    "confidence_threshold",
)
# What the entropy-bound sampler (DiffusionGemma) does not take: its own fields replace them.
NOT_ENTROPY_BOUND = ("remasking", "temperature", "cfg_scale", "threshold", "factor", "early_stop")


def _validate_sampler(p: ResolvedParams, family: Family) -> None:
    """Fields that belong to one decoding family only, and Dream's own constraints."""
    if family.sampler == "entropy_bound":
        _validate_entropy_bound(p, family)
        return
    given = [name for name in ENTROPY_BOUND_FIELDS if getattr(p, name) is not None]
    if given:
        raise Unsupported((Name(given[0]), f" applies to DiffusionGemma models, not {family.name}"), field=given[0])
    if family.sampler != "dream":
        given = [name for name in DREAM_ONLY if getattr(p, name) is not None]
        if given:
            raise Unsupported((Name(given[0]), f" applies to Dream-family models, not {family.name}"), field=given[0])
        return
    if p.remasking != "low_confidence":
        raise Unsupported(
            (Name("remasking"), " applies to LLaDA-family models; for Dream choose ", Name("alg"), " (e.g. 'origin')"),
            field="remasking",
        )
    if p.factor is not None:
        raise Unsupported(
            ("the factor rule applies to LLaDA-family models; for Dream use ", Name("threshold")), field="factor"
        )
    if p.cfg_scale > 0:
        raise Unsupported("classifier-free guidance applies to LLaDA-family models, not Dream", field="cfg_scale")
    if p.threshold is not None and p.alg != "confidence_threshold":
        raise UsageError(f"threshold goes with alg confidence_threshold, not {p.alg!r}", field="threshold")
    if p.alg_temp is not None and p.alg not in RANKING_ALGS:
        raise UsageError(
            f"alg_temp samples among ranked positions; it needs alg {', '.join(RANKING_ALGS)}", field="alg_temp"
        )


def _validate_edits(asked: GenerationParams, p: ResolvedParams, family: Family) -> None:
    """Draft-and-edit decoding: only for families trained to edit, greedy, in diffusion mode,
    with its own step bound instead of `steps`."""
    given = [
        name for name in ("edit_mode", "edit_threshold", "max_post_edit_steps") if getattr(asked, name) is not None
    ]
    if not given:
        return
    if not asked.edits:
        raise UsageError(
            "max_post_edit_steps goes with edit_threshold or edit_mode (draft-and-edit decoding)",
            field="max_post_edit_steps",
        )
    if family.block_rules is None or not family.block_rules.token_edits:
        editing = ", ".join(f.name for f in FAMILIES if f.block_rules is not None and f.block_rules.token_edits)
        raise Unsupported(
            (Name(given[0]), f" (draft-and-edit decoding) applies to {editing} models, not {family.name}"),
            field=given[0],
        )
    if p.mode != "diffusion":
        raise UsageError(
            (Name(given[0]), " (draft-and-edit decoding) needs ", Name("mode"), f" diffusion, not {p.mode!r}"),
            field="mode",
        )
    if p.temperature > 0:
        raise UsageError("draft-and-edit decoding is greedy: temperature must be 0", field="temperature")
    for name in ("steps", "refinement_steps"):
        if getattr(asked, name) is not None:
            raise UsageError(
                f"draft-and-edit decoding runs a block until no token changes (at most block_length + "
                f"max_post_edit_steps + 1 steps): {name} does not apply",
                field=name,
            )


def _validate_stop_token_ids(ids: Any, vocab: int | None) -> None:
    """A list of token ids the model can emit (any number, none counts as none)."""
    if ids is None:
        return
    _require_token_ids(ids, "stop_token_ids", "a list of token ids")
    for token in ids:
        if token < 0 or (vocab is not None and token >= vocab):
            bound = f"0..{vocab - 1}" if vocab is not None else ">= 0"
            raise UsageError(
                f"stop_token_ids: {token} is outside the vocabulary ({bound})",
                field="stop_token_ids",
            )


def _validate_suffix(ids: Any) -> None:
    """Infilling's suffix as token ids (text is encoded before it gets here: the Python API's
    `suffix="..."`, a completion's `suffix`): `int(t)` truncated 1.5 to 1 and read b"ab" as
    two ids, and None failed as "not iterable"."""
    _require_token_ids(ids, "suffix", "text or a list of token ids")


def _require_token_ids(ids: Any, field: str, kinds: str) -> None:
    """Refuse `field` unless it is a list (or tuple) of integers: a bool is no token id, nor is
    text, bytes or a float."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise UsageError(f"{field} must be {kinds}, got {ids!r}", field=field)
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)), None)
    if bad is not None:
        raise UsageError(f"{field} token ids must be integers, got {bad!r}", field=field)


def _validate_entropy_bound(p: ResolvedParams, family: Family) -> None:
    """DiffusionGemma: its own sampler fields, none of the masked-diffusion ones."""
    given = [n for n in (*NOT_ENTROPY_BOUND, *DREAM_ONLY) if getattr(p, n) != DEFAULTS[n]]
    if given:  # well-formed fields this sampler cannot honour: refused as unsupported, named
        raise Unsupported(
            (
                Name(given[0]),
                f" does not apply to {family.name} models (entropy-bound sampler: "
                f"use {', '.join(ENTROPY_BOUND_FIELDS)})",
            ),
            field=given[0],
        )
    low, high = p.min_temperature, p.max_temperature
    if low is not None and high is not None and high <= low:
        raise UsageError(f"max_temperature ({high}) must exceed min_temperature ({low})", field="max_temperature")


def _validate_drafts(p: ResolvedParams, family: Family, fixed_block: int | None) -> None:
    """Drafted steps are verified against LLaDA's deterministic rules only (dlm/engine/decoding/drafts.py)."""
    if family.sampler != "llada" or family.block_causal or fixed_block is not None:
        raise Unsupported(f"drafts (lossless multi-token steps) are not available for {family.name}", field="drafts")
    if p.temperature > 0 or p.remasking != "low_confidence" or p.cfg_scale > 0:
        raise UsageError(
            "drafts (lossless multi-token steps) need the deterministic rules: temperature 0, "
            "low_confidence remasking, no classifier-free guidance",
            field="drafts",
        )


def _validate_structured(p: GenerationParams, family: Family) -> None:
    """A response format asking for JSON goes with a family that decodes a canvas whose later
    positions are already committed (bidirectional attention, no fixed block; Dream's cached
    first-token rule is refused once the cache is resolved), and with nothing else that
    decides where the answer ends."""
    if p.suffix:
        raise Unsupported(
            "response_format and suffix cannot be combined: the skeleton fills the answer", field="suffix"
        )
    # stop_token_ids would cut the JSON wherever such a token falls (70 of 84 seeded answers
    # did not parse); stop strings alike.
    asked = {name: getattr(p, name) for name in ("ignore_eos", "min_tokens", "stop_token_ids")}
    given = [name for name, value in {**asked, "stop": stop_strings(p.stop)}.items() if value]
    if given:
        raise ends_the_answer(given[0])
    require(family, FIELD)


def ends_the_answer(field: str) -> Unsupported:
    """The refusal of `field` beside a response format: only the schema's skeleton may
    decide where a structured answer ends."""
    return Unsupported(
        (Name(field), " cannot be combined with response_format: the schema's skeleton decides where the answer ends"),
        field=field,
    )  # bidirectional families only (dlm/engine/capabilities.py)


def _validate_block_causal(p: ResolvedParams) -> None:
    if p.cfg_scale > 0:
        raise Unsupported("classifier-free guidance is not available for block-causal models", field="cfg_scale")
    if p.factor is not None:
        raise Unsupported(
            ("the factor rule is not available for block-causal models; use ", Name("threshold")), field="factor"
        )


def _validate_fixed_block(p: ResolvedParams, family: Family, block: int) -> None:
    if p.block_length != block:
        raise Unsupported(
            (
                f"{family.name} decodes {block}-token blocks only (any ",
                Name("gen_length"),
                ": the last block is decoded whole and the answer cut): leave ",
                Name("block_length"),
                f" out or give {block}",
            ),
            field="block_length",
        )
    if p.cfg_scale > 0:
        raise Unsupported(f"classifier-free guidance is not available for {family.name}", field="cfg_scale")
