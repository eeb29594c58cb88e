"""The decoding options of `dlm generate`, built from their one declaration (engine/params.py).

Each option's flag, help text and default come from its `GenerationParams` field; the
command names its parameters after the fields, so `decoding_params(ctx.params)` collects
them without restating the mapping. Ranges and family rules are checked by
`GenerationParams.validate()`, once, like every other entry point.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from engine.params import DEFAULTS, PARAMS, cli_flag

if TYPE_CHECKING:
    from engine.params import GenerationParams


def option(name: str) -> Any:
    """The typer option of GenerationParams field `name`."""
    flag = cli_flag(name)
    if flag is None:
        raise ValueError(f"{name} is not offered on the command line")
    spec = PARAMS[name]
    if spec.choices:
        extra = "" if "|" in spec.help else f" One of: {', '.join(spec.choices)}."
    else:
        extra = f" Must be {spec.range()}." if spec.low is not None or spec.high is not None else ""
    return typer.Option(DEFAULTS[name], flag, help=spec.help + extra)


def check_before_loading(model_dir: Path, params: GenerationParams, prompt_length: int) -> None:
    """Refuse what the checkpoint's family refuses from config.json alone, before seconds of
    loading: flag combinations, ranges, the length. The engine's validation after loading
    is the one whose result decodes (it also knows the prompt's tokens and the runner's
    forwards); this one only fails early, with the same messages."""
    from engine.config import load_config
    from engine.registry import family_named

    config = load_config(model_dir)
    params.validate(
        prompt_length, config.max_position_embeddings, family_named(config.family), vocab=config.logits_size
    )


def decoding_params(given: dict[str, Any]) -> GenerationParams:
    """GenerationParams from a command's parsed parameters (the ones named after its fields)."""
    from engine.params import GenerationParams

    # click records a repeatable option given no times as (), where the field's default is None.
    return GenerationParams(**{name: None if value == () else value for name, value in given.items() if name in PARAMS})
