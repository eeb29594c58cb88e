"""What a family can do beyond a plain completion, as data derived from its record.

Each `Capability` names a request feature (the body field that asks for it), says in one
line what it is, and decides from the family record (dlm/engine/registry.py) whether the family
honours it. The same table answers both sides, so they cannot disagree: the one validation
(`GenerationParams.validate`) refuses a feature the family lacks with `Unsupported` naming
the field (HTTP 400 `unsupported`), and the server's `/v1/models` lists the features the
loaded family has (`dlm validate` checks each one it lists). A new feature is one more entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dlm.engine.errors import Name, Unsupported
from dlm.engine.registry import Family
from dlm.engine.structured import supported as decodes_skeletons


@dataclass(frozen=True)
class Capability:
    name: str  # as /v1/models lists it, and the request field that asks for it
    description: str
    supports: Callable[[Family], bool]
    why_not: str = ""  # the refusal's reason, for a family that lacks it


def _bidirectional(family: Family) -> bool:
    """Every position attends to every other (LLaDA, Dream): a suffix after the answer is seen."""
    return family.attention == "bidirectional"


def _always(family: Family) -> bool:
    return True


def _block_causal(family: Family) -> bool:
    """A block attends only to what precedes it, through an exact block cache: a block of one
    token decoded in one step is autoregressive decoding (dlm/engine/family_rules.py)."""
    return family.block_causal


def _commits_tokens(family: Family) -> bool:
    """A token, once committed, stays: its committing step's distribution is its logprob.
    DiffusionGemma's canvas is resampled and renoised whole each step, with no such step."""
    return family.sampler != "entropy_bound"


CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        "suffix",
        "infilling: the answer is decoded between the prompt and a fixed suffix",
        _bidirectional,
        "only bidirectional models (LLaDA, Dream) attend to a suffix after the answer; "
        "put the text after the gap into the prompt instead",
    ),
    Capability(
        "logprobs",
        "log-probabilities of generated tokens at the denoising step that committed them (and the top alternatives)",
        _commits_tokens,
        "its sampler resamples and renoises the whole canvas every step, so no step commits a token "
        "whose probability could be reported",
    ),
    Capability("n", "several seeded samples per prompt (seeds seed, seed+1, ...)", _always),
    Capability(
        "response_format",
        "schema-shaped JSON: the schema's skeleton laid on the canvas, typed value slots decoded",
        decodes_skeletons,
        "it needs a bidirectional model, one that attends to a skeleton laid ahead of the position being decoded",
    ),
    Capability(
        "decode_mode",
        'both decoding modes: decode_mode "ar" (one token per forward) beside "diffusion"',
        _block_causal,
        "ar decodes one token per forward over a block cache: block-causal families only",
    ),
    Capability(
        "include_canvas",
        "canvas streaming (stream_options.include_canvas): committed and provisional positions each step",
        _always,
    ),
)
BY_NAME = {c.name: c for c in CAPABILITIES}


def supported(family: Family) -> tuple[str, ...]:
    """The capabilities `family` honours, in table order."""
    return tuple(c.name for c in CAPABILITIES if c.supports(family))


def require(family: Family, name: str) -> None:
    """Refuse capability `name` when `family` lacks it (`Unsupported`, field = its name)."""
    capability = BY_NAME[name]
    if not capability.supports(family):
        raise Unsupported((Name(name), f" is not available for {family.name} models: {capability.why_not}"), field=name)
