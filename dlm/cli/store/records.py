"""The store's records on disk, as typed models, and the one bounded reader of them.

Every JSON file the store keeps (a version's manifest, a deployment's state, a running
server's record) is read by `read_record` and nowhere else: at most `MAX_RECORD_BYTES`, a
regular file, parsed by pydantic's JSON parser (which refuses nesting deeper than 200
levels instead of recursing until Python's stack runs out) straight into its model, with
strict types and unknown fields refused. A file that does not fit raises `CorruptRecord`,
naming the file and the first reason; callers report it against that record alone, so a
corrupt or hostile record never stops the rest of the store from being read, listed,
released or removed.
"""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dlm.engine.errors import DlmError

MAX_RECORD_BYTES = 64 << 20  # a manifest of 100,000 files, or a deployment history of 100,000 events, fits
Action = Literal["release", "rollback"]


class CorruptRecord(DlmError):
    """A store record that cannot be read as what it should be (exit 1)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} is corrupt: {reason}")
        self.path, self.reason = path, reason


def text(value: str) -> str:
    """`value` as a record can hold it. A name from the file system that is not UTF-8 (a
    file, a source directory, a link's target, a script) is held by Python with lone
    surrogates, which the JSON written keeps as `\\udcff` escapes and pydantic's reader
    refuses: a `dlm verify` that found such a file, or a fetch from such a directory, wrote a
    manifest that read back as corrupt (the version, released or not, unusable). Its bytes
    are escaped instead (`\\xff`)."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        try:
            return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate no file system name gives: escaped as such
            return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _texts(value: Any) -> Any:
    """`value` (a record's fields as given) with every string in it as `text` makes it."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {_texts(k): _texts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_texts(v) for v in value]
    return value


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _readable_text(cls, data: Any) -> Any:
        """Every string a record holds can be written and read back (`text`)."""
        return _texts(data)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


R = TypeVar("R", bound=Record)


def read_record(path: Path, model: type[R]) -> R:
    """The record at `path` as `model`; CorruptRecord if it is not one (FileNotFoundError
    passes through: a missing record is for the caller to interpret)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO planted there cannot block us
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptRecord(path, exc.strerror or str(exc)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptRecord(path, "not a regular file (a directory?)")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        raise CorruptRecord(path, f"larger than {MAX_RECORD_BYTES} bytes")
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")  # pydantic's wrapping of our validators' words
        raise CorruptRecord(path, f"{where}: {message}" if where else message) from None


# -- a version's manifest ----------------------------------------------------------------------
class FileEntry(Record):
    path: str  # relative, '/'-separated
    size: int = Field(ge=0)
    sha256: str
    expected: dict[str, str] = Field(default_factory=dict)  # hashes the source promised
    source_stat: dict[str, int] | None = None  # local sources: size and mtime_ns when copied

    @field_validator("path")
    @classmethod
    def _inside_the_version(cls, value: str) -> str:
        """A path the version's files directory holds: relative, '/'-separated, with no empty,
        `.` or `..` part and no NUL. A hand-edited `../../x`, `/etc/passwd` or `""` was taken,
        and the version then listed as damaged or failed verification (a file outside it
        hashed or missing) instead of reading as the corrupt manifest it is."""
        if "\0" in value or any(part in ("", ".", "..") for part in value.split("/")):
            raise ValueError(f"file path {value!r} is not a relative path inside the version")
        return value


class HubSource(Record):
    kind: Literal["hub"] = "hub"
    repo_id: str
    revision: str
    commit: str
    endpoint: str | None
    include: list[str]
    exclude: list[str]


class LocalSource(Record):
    kind: Literal["local"] = "local"
    path: str
    include: list[str]
    exclude: list[str]
    link: bool
    follow_symlinks: bool = False  # absent from the manifests of dlm before it was recorded


Source = Annotated[HubSource | LocalSource, Field(discriminator="kind")]


class Finding(Record):
    file: str
    check: str  # source | manifest | size | sha256 | safetensors | index | config | tensors | tokenizer
    problem: str


class Verification(Record):
    """What a manifest keeps of its last verification."""

    ok: bool
    at: str
    hashed: bool
    family: str | None
    failures: list[Finding]
    warnings: list[Finding]


class Manifest(Record):
    name: str
    version: str
    source: Source
    files: list[FileEntry]
    fetched_at: str
    content_sha256: str
    verification: Verification | None = None
    format: Literal[1] = 1

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def verified(self) -> bool:
        return self.verification is not None and self.verification.ok

    @property
    def state(self) -> str:
        if self.verification is None:
            return "unverified"
        return "verified" if self.verification.ok else "failed"

    def failure(self) -> str | None:
        """Why this version must not be loaded, when its last verification failed: its first
        findings and the fixes (the files are damaged: verifying again changes nothing).
        None for a verified or unverified version."""
        if self.verification is None or self.verification.ok:
            return None
        return (
            f"{self.ref} failed verification ({self.problems() or 'see `dlm verify`'}): fetching it again "
            f"repairs it in place (`{fetch_command(self.name, self.source)}`), or remove it (`dlm rm {self.ref}`); "
            f"`dlm verify {self.ref}` lists every finding"
        )

    def problems(self, shown: int = 2) -> str:
        """The last verification's first findings, in one line ("" when it found none)."""
        found = self.verification.failures if self.verification is not None else []
        more = f"; {len(found) - shown} more" if len(found) > shown else ""
        return "; ".join(f"{f.file}: {f.problem}" for f in found[:shown]) + more


def fetch_command(name: str, source: HubSource | LocalSource) -> str:
    """The `dlm fetch` that brings this very content under `name` again (a hub source pinned
    to its commit): what repairs a failed version or resumes an interrupted download. Each
    word shell-quoted, as it is given to be pasted: a path with a space in it, or a glob with a
    quote, made another command (`dlm fetch /data/my model ...` fetched no such directory).
    A local source's `--link` and `--follow-symlinks` are given again: without the latter, a
    source whose links leave it was refused."""
    words = [source.repo_id, "--revision", source.commit] if isinstance(source, HubSource) else [source.path]
    for flag, globs in (("--include", source.include), ("--exclude", source.exclude)):
        words += [w for glob in globs for w in (flag, glob)]
    if isinstance(source, LocalSource):
        words += [
            flag for flag, given in (("--link", source.link), ("--follow-symlinks", source.follow_symlinks)) if given
        ]
    return shlex.join(["dlm", "fetch", *words, "--name", name])


# -- a deployment's state ----------------------------------------------------------------------
class Ref(Record):
    model: str
    version: str

    @property
    def ref(self) -> str:
        return f"{self.model}@{self.version}"


# `from` (the version a release or rollback replaced) is a Python keyword: `from_` in code.
FROM: Any = Field(validation_alias=AliasChoices("from", "from_"), serialization_alias="from")


class Current(Ref):
    since: str
    action: Action


class HotSwap(Record):
    server_pid: int
    admin_url: str


class Event(Ref):
    action: Action
    from_: Ref | None = FROM
    at: str
    status: Literal["ok", "failed"]
    hot_swap: HotSwap | None
    error: str | None = None
    settled_at: str | None = None  # an event recorded after its command died

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        return {k: v for k, v in out.items() if v is not None or k not in ("error", "settled_at")}


class Pending(Ref):
    """The swap journal's entry (dlm/cli/store/releases.py)."""

    id: str
    action: Action
    from_: Ref | None = FROM
    at: str
    server_pid: int
    admin_url: str


class DeploymentState(Record):
    deployment: str
    current: Current | None
    history: list[Event]
    pending: Pending | None = None  # only while a hot swap is under way

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["history"] = [event.to_json() for event in self.history]
        if self.pending is None:
            del out["pending"]
        return out


# -- a running server's record -----------------------------------------------------------------
class ServerRecord(Record):
    deployment: str
    pid: int
    admin_url: str
    admin_key: str
    started_at: str
    serving: str | None = None  # NAME@VERSION
    swapping: str | None = None  # NAME@VERSION being loaded by a hot swap
    swap_intent: str | None = None  # the journal entry that swap carries out


# -- a running process's lease on a version it loaded ------------------------------------------
class Lease(Ref):
    """dlm/cli/store/leases.py: a process that resolved `model@version` to load it."""

    pid: int
    host: str  # where `pid` runs: only a lease of this host can be checked for a live process
    command: str  # `dlm serve`, `dlm generate`, ...; or the program that called resolve_model
    use: Literal["served", "loaded"]
    since: str
    started: int | None = None  # `pid`'s start (admin.process_start): a later process of that pid holds nothing
