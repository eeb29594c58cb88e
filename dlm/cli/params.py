"""The decoding options of `dlm generate`, built from their one declaration (dlm/engine/params.py).

Each option's flag, help text and default (or `shown`, what a default of None means) come
from its `GenerationParams` field; the command names its parameters after the fields, so
`decoding_params(ctx.params)` collects them without restating the mapping. Ranges and
family rules are checked by the one validation (dlm/engine/family_rules.py), like every
other entry point.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

import typer

from dlm.engine.params import DEFAULTS, PARAMS, cli_flag

if TYPE_CHECKING:
    from dlm.engine.params import GenerationParams


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
    shown = spec.shown or True  # what a default of None means, in words
    if _holds_ids(name):  # repeated, comma-separated, or both: as --prompt-ids takes ids
        return typer.Option(
            DEFAULTS[name], flag, help=spec.help + extra, callback=_id_list(flag), metavar="ID,...", show_default=shown
        )
    return typer.Option(DEFAULTS[name], flag, help=spec.help + extra, show_default=shown)


def template_kwargs(text: str | None, chat: bool) -> dict[str, Any] | None:
    """`--chat-template-kwargs`: a JSON object, read as strictly as a request body is (a key
    twice, NaN: refused), and only beside --chat (a plain prompt has no template to give it)."""
    from dlm.cli.jsonl import json_object
    from dlm.engine.errors import UsageError

    if text is None:
        return None
    if not chat:
        raise UsageError("--chat-template-kwargs needs --chat")
    try:
        return json_object(text)
    except ValueError as exc:
        raise UsageError(
            f"--chat-template-kwargs: {exc} ({text!r}); give an object such as '{{\"enable_thinking\": true}}'"
        ) from None


def parse_ids(text: str, flag: str) -> list[int]:
    """Token ids given on the command line: comma-separated integers. An empty element
    (`1,,2`) is refused, not dropped: it is a typo as likely as a missing id."""
    from dlm.engine.errors import UsageError

    parts = text.replace(" ", "").split(",")
    if parts == [""]:
        raise UsageError(f"{flag} is empty")
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _holds_ids(name: str) -> bool:
    """Whether field `name` holds token ids (its type is a tuple of ints); its option is then
    declared `list[str]`, each value parsed by `parse_ids`."""
    from dlm.engine.params import GenerationParams

    return get_type_hints(GenerationParams)[name] in (tuple[int, ...], tuple[int, ...] | None)


def _id_list(flag: str) -> Any:
    def parse(values: list[str] | None) -> list[int] | None:
        from dlm.engine.errors import UsageError

        try:  # raised while click parses: its error, which the entry point prints as one line
            return [i for v in values for i in parse_ids(v, flag)] if values else None
        except UsageError as exc:
            raise typer.BadParameter(str(exc)) from None

    return parse


def check_before_loading(
    model_dir: Path, params: GenerationParams, prompt_length: int | None, tensor_parallel_size: int = 1
) -> None:
    """Refuse from config.json alone, before any rank spawns or weight loads, what the
    checkpoint would refuse after: a split its heads do not allow, flag combinations, ranges,
    the length. It is the engine's own validation (dlm/engine/family_rules.py); the engine runs
    it again once the prompt's tokens are known, and that result decodes.

    A text prompt's length (None) is known only once tokenised, so only what every length
    refuses is refused: the shortest prompt (one token) bounds the length check, and no
    other rule depends on the prompt's length (a block grid takes any)."""
    from dlm.engine.config import load_config
    from dlm.engine.family_rules import validate
    from dlm.engine.parallel.divisibility import check_tensor_parallel

    config = load_config(model_dir)
    check_tensor_parallel(config, tensor_parallel_size)
    validate(params, 1 if prompt_length is None else prompt_length, config)


def decoding_params(given: dict[str, Any]) -> GenerationParams:
    """GenerationParams from a command's parsed parameters (the ones named after its fields)."""
    from dlm.engine.params import GenerationParams

    # click records a repeatable option given no times as (), where the field's default is None.
    # click's values are untyped; GenerationParams.validate checks them.
    fields: dict[str, Any] = {name: None if value == () else value for name, value in given.items() if name in PARAMS}
    return GenerationParams(**fields)
