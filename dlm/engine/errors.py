"""Exceptions that carry a user-facing message and the CLI exit code it maps to.

The CLI turns these into one line on stderr and the exit code of the design contract
(1: a failed operation or check, 2: bad usage or input), never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class DlmError(Exception):
    """An operation failed for a reason the user can act on."""

    exit_code = 1


@dataclass(frozen=True)
class Name:
    """A request field named inside a refusal's message (`GenerationParams.gen_length`):
    kept apart from the words around it so that each entry point spells it as its users
    write it (the server's `max_completion_tokens`, chat's `top_logprobs`) without
    reading the message back."""

    field: str


class UsageError(DlmError):
    """The user asked for something invalid: a bad path, flag value or model.

    `field` names the request parameter at fault (a `GenerationParams` field, or `prompt`)
    when there is one, so the server can answer `param` without reading the message.
    `message` is text, or parts of text and `Name`s: `str(exc)` spells each name as the
    engine does, `spelt` as the caller's entry point does."""

    exit_code = 2

    def __init__(self, message: str | tuple[str | Name, ...], field: str | None = None) -> None:
        self.parts = (message,) if isinstance(message, str) else message
        super().__init__(self.spelt(lambda name: name))
        self.field = field

    def spelt(self, name_of: Callable[[str], str]) -> str:
        """The message with each field it names written `name_of(field)`."""
        return "".join(name_of(part.field) if isinstance(part, Name) else part for part in self.parts)


class Unsupported(UsageError):
    """A well-formed request field this model or decoding path cannot honour: refused
    rather than silently ignored, so a client (or `dlm validate`) learns it has no effect."""


class UnknownKey(UsageError):
    """A key a request's object does not have (`response_format.json_schema.nmae`): refused,
    as OpenAI refuses it, never ignored. `path` names the key where it sits, so a server
    answers `unknown_parameter` from the type alone, whichever entry point met it."""

    def __init__(self, path: str, field: str) -> None:
        super().__init__(f"unrecognized request field {path!r}", field=field)
        self.path = path


class EngineFailed(DlmError):
    """The engine itself broke, not one request: nothing more can run on it (a
    tensor-parallel rank died or hung). A server fails every request it holds and exits."""


class InvalidConfig(UsageError):
    """A checkpoint's config.json (or generation_config.json, `file`) holds a value no model
    has: a size that is not a positive integer, a float that is not finite or out of its
    range, sizes whose model no storage can hold. `key` names the field at fault when one is
    (None when the sizes together are); `file` is the checkpoint's file that holds it, which
    `dlm verify` records the problem against."""

    def __init__(self, message: str, key: str | None = None, file: str = "config.json") -> None:
        super().__init__(message)
        self.key, self.file = key, file
