"""Command-line options built from settings declared as pydantic fields: `ServeConfig`
(dlm/cli/server/config.py) and `KubernetesSettings` (dlm/cli/deploy/kubernetes.py).

A setting is declared once, as a field: its name is the config-file key, `DLM_<NAME>` and the
flag (`--name`, or what its `Cli` record says), its description the help text, its default the
default `--help` shows (or `Cli.shown`: what a default of None means). `dlm serve` gets one
option per ServeConfig field (`with_settings`), so adding a serve setting is adding a field;
`dlm generate`, `dlm deploy` and `dlm batch` take the ones they share with it from here too.
A command that also reads a settings file passes on only the options its command line gave
(`given`), so the file and DLM_* variables fill the rest; the model validates every value
once, whatever its source.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from dlm.cli.server.config import Cli, ServeConfig, setting_error
from dlm.engine.errors import UsageError

NOT_OPTIONS = ("model",)  # ServeConfig's: the MODEL argument of the commands that load a model


def cli_record(field: FieldInfo) -> Cli:
    return next((m for m in field.metadata if isinstance(m, Cli)), Cli())


def option_type(annotation: Any) -> Any:
    """The type click parses a setting as: its own without None, secrets, choices and paths as
    text (the model checks and converts them: click made `--store ''` the path '.'), a list of
    secrets as repeated text."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return option_type(args[0])
    if typing.get_origin(annotation) is list:
        return list[option_type(args[0])]  # type: ignore[misc]
    if typing.get_origin(annotation) is typing.Literal or annotation in (SecretStr, Path):
        return str
    return annotation


def default(name: str, model: type[BaseModel] = ServeConfig) -> Any:
    """A setting's default value (None where a factory makes it)."""
    field = model.model_fields[name]
    return None if field.default is PydanticUndefined else field.default


def names(name: str, model: type[BaseModel] = ServeConfig) -> tuple[str, ...]:
    """A setting's option names: `--name` (`--name/--no-name` for a bool) unless `Cli` gives them."""
    field = model.model_fields[name]
    flag = "--" + name.replace("_", "-")
    flags = field.annotation in (bool, bool | None)
    return cli_record(field).names or ((f"{flag}/--no-{flag[2:]}",) if flags else (flag,))


def option_error(exc: ValidationError, model: type[BaseModel], arguments: Iterable[str] = ()) -> UsageError:
    """The first error of `model` validated from one command line alone (`dlm deploy
    kubernetes`'s cluster settings) as the one `error:` line, naming what the user typed: the
    option and its value (`--name 'A': must be ...`), or an argument by its name (`SOURCE`).
    `setting_error`'s "invalid setting name" fits a setting a file or DLM_* may also give."""
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else ""
    if name not in model.model_fields:
        return setting_error(exc)
    what = name.upper() if name in arguments else names(name, model)[0].split("/")[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    return UsageError(f"{what} {first['input']!r}: {message}")


def setting_option(name: str, model: type[BaseModel] = ServeConfig, *, from_file: bool = False) -> Any:
    """The typer option of setting `name`, defaulting to the model's default. With `from_file`
    (a command that also reads a settings file), it defaults to None, "not given": the file's
    value, else the model's default, which `--help` then names."""
    field = model.model_fields[name]
    words = cli_record(field).shown
    # a path is passed on as text (`option_type`), still labelled as a path in --help
    metavar = "<path>" if Path in (field.annotation, *typing.get_args(field.annotation)) else None
    if from_file:
        shown = f"the settings file's, else {words or default(name, model)}"
        return typer.Option(None, *names(name, model), help=field.description, show_default=shown, metavar=metavar)
    return typer.Option(
        default(name, model), *names(name, model), help=field.description, show_default=words or True, metavar=metavar
    )


def settings(model: type[BaseModel] = ServeConfig, skip: Iterable[str] = NOT_OPTIONS) -> list[str]:
    """The settings a command offers as options, in declaration order."""
    return [name for name in model.model_fields if name not in skip]


def with_settings(
    model: type[BaseModel] = ServeConfig, skip: Iterable[str] = NOT_OPTIONS
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command (which takes `**settings`) one keyword parameter per setting of `model`
    but `skip`, each with its option: typer reads a command's parameters from its signature."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        generated = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=setting_option(name, model),
                annotation=option_type(model.model_fields[name].annotation) | None,
            )
            for name in settings(model, skip)
        ]
        command.__signature__ = signature.replace(parameters=[*own, *generated])  # type: ignore[attr-defined]
        return command

    return decorate


def given(ctx: typer.Context, names: Iterable[str]) -> dict[str, Any]:
    """The values of the parameters `names` that the command line gave (not defaults), so a
    settings file or DLM_* variable decides the rest."""
    out = {}
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name != "DEFAULT":
            out[name] = ctx.params[name]
    return out
