"""Exceptions that carry a user-facing message and the CLI exit code it maps to.

The CLI turns these into one line on stderr and the exit code of the design contract
(1: a failed operation or check, 2: bad usage or input), never a traceback.
"""

from __future__ import annotations


class DlmError(Exception):
    """An operation failed for a reason the user can act on."""

    exit_code = 1


class UsageError(DlmError):
    """The user asked for something invalid: a bad path, flag value or model.

    `field` names the request parameter at fault (a `GenerationParams` field, or `prompt`)
    when there is one, so the server can answer `param` without reading the message.
    `mentions`: the other `GenerationParams` fields the message names, each as `name (value)`,
    so an entry point that spells a field otherwise (the server's `max_completion_tokens` for
    `gen_length`) names it as its client wrote it."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None, mentions: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.field, self.mentions = field, mentions


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
