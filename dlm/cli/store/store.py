"""The versioned model store: `<root>/models/<name>/<version>/{manifest.json, files/}`.

A version directory is built under `<name>/.staging/` and appears under its final name by
one `rename` once every file is written, fsynced and hashed and its manifest is on disk, so
a fetch killed at any point never leaves a listed, half-written version. Versions are
immutable afterwards except for the manifest's `verification` record, which is rewritten
atomically, and a `failed` version, which a fetch of the same content that passes the checks
replaces whole. Version ids are derived from what was fetched (the hub commit, or the content
hash of a local copy), so fetching the same thing twice lands on the same version.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dlm.cli.store.atomic import Busy, fsync_dir, locked, unwritable, write_json_atomic
from dlm.cli.store.records import (
    CorruptRecord,
    FileEntry,
    HubSource,
    Manifest,
    Verification,
    fetch_command,
    read_record,
)
from dlm.engine.errors import DlmError, UsageError
from dlm.engine.home import dlm_home, expand_user

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # \Z: no trailing newline
MANIFEST = "manifest.json"
FILES = "files"
STAGING = ".staging"
SOURCE = "source.json"  # a hub download's source, in its staging directory until it is published


def store_env(environ: Mapping[str, str] | None = None) -> str | None:
    """`DLM_STORE` (from `environ`, else the process's), or None where it is unset or empty:
    an empty DLM_STORE means the default store for every command (click reads the store
    commands' variable so), never the current directory; a blank one is refused naming it."""
    value = (os.environ if environ is None else environ).get("DLM_STORE") or None
    return None if value is None else check_store_path(value, "DLM_STORE")


def default_store_root() -> Path:
    """`DLM_STORE` (`store_env`), else `$DLM_HOME/store`."""
    env = store_env()
    return expand_user(env, "DLM_STORE") if env else dlm_home() / "store"


def store_path_problem(path: str) -> str | None:
    """What is wrong with `path` as a store directory, if anything: an empty or blank one
    would read as the current directory (or a directory named by spaces: a fetch filled
    ./models with no word)."""
    if not path:
        return "must name a directory, got an empty string"
    if not path.strip():
        return f"must name a directory, got a blank value {path!r}"
    return None


def check_store_path(path: str, source: str = "--store") -> str:
    """A store directory as the user gave it, from `source` (`--store`, `DLM_STORE`): refused
    when `store_path_problem` finds one, naming where it came from."""
    problem = store_path_problem(path)
    if problem is not None:
        raise UsageError(f"{source} {problem}")
    return path


def store_root_problem(root: Path) -> str | None:
    """What makes `root` unusable as a store directory, if anything: it is a file, or lies
    under one (`FILE/store`), or is (or lies under) a symbolic link that leads nowhere, a
    dangling one or a loop (a fetch failed with "File exists" or a traceback, and a listing
    showed an empty store), so no command could create or read a store there."""
    nearest = next((p for p in (root, *root.parents) if os.path.lexists(p)), None)  # what exists of it
    if nearest is not None and nearest.is_symlink() and not nearest.exists():
        where = "is" if nearest == root else f"is under {nearest},"
        return f"{root} {where} a symbolic link that leads nowhere (dangling, or a loop)"
    if nearest is None or nearest.is_dir():
        return None
    if nearest == root:
        return f"{root} is a file, not a store directory"
    return f"{root} is under {nearest}, which is a file, not a directory"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def check_name(name: str, what: str = "model name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UsageError(
            f"invalid {what} {name!r}: use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def split_ref(spec: str) -> tuple[str, str | None]:
    """'name@version' -> (name, version); 'name' -> (name, None)."""
    name, sep, version = spec.partition("@")
    check_name(name)
    if sep:
        check_name(version, "version")
        return name, version
    return name, None


def local_path(spec: str) -> Path | None:
    """SPEC as an existing file system path, else None (also when it cannot be one: a
    component longer than the file system allows, a NUL byte, a link loop; and the empty
    string, which Path would read as the current directory; and `~USER/...` naming no home
    directory, for which Path.expanduser raises RuntimeError)."""
    if not spec:
        return None
    try:
        path = Path(spec).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError, RuntimeError):
        return None


def content_hash(files: list[FileEntry]) -> str:
    """One sha256 naming a version's content: its sorted (path, sha256) pairs."""
    digest = hashlib.sha256()
    for entry in sorted(files, key=lambda f: f.path):
        digest.update(f"{entry.path}\t{entry.sha256}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class IncompleteFetch:
    """A hub download staged under `models/NAME/.staging/hub-VERSION/` and not published: a
    fetch interrupted (Ctrl-C, SIGKILL, a network error) or refused (a file that did not match
    the hub's hash) after some files arrived, or one running now. Listed apart from the
    versions (`dlm models`), never resolved, served or released."""

    name: str
    version: str  # the version it would publish
    path: Path
    files: int  # complete files so far
    size: int  # bytes on disk, partial files included
    source: HubSource | None  # None: staged by an older dlm, which kept no record of it
    running: bool  # a fetch of NAME holds its staging lock now

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def resume(self) -> str | None:
        """The command that resumes it (the same fetch, pinned to its commit)."""
        return None if self.source is None else fetch_command(self.name, self.source)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "ref": self.ref,
            "path": str(self.path),
            "files": self.files,
            "size": self.size,
            "source": self.source.to_json() if self.source is not None else None,
            "running": self.running,
            "resume": self.resume,
        }


@dataclass(frozen=True)
class CorruptVersion:
    """A listed version whose manifest cannot be read: shown (with why) and removable, never
    resolved, served or released."""

    name: str
    version: str
    reason: str
    state: str = "corrupt"

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


def no_usable_version(name: str, manifests: list[Manifest], corrupt: list[CorruptVersion]) -> str:
    """Why model `name` has no verified version, version by version: each is unverified,
    failed its last verification (with its first findings) or has a corrupt manifest (with
    the reason); and what to do about each kind."""
    failed = [m for m in manifests if m.state == "failed"]
    unverified = [m for m in manifests if m.state == "unverified"]
    why = [
        f"{m.ref} is unverified"
        if m.state == "unverified"
        else f"{m.ref} failed verification ({m.problems() or 'see `dlm verify`'})"
        for m in manifests
    ]
    why += [f"{c.ref} is corrupt ({c.reason})" for c in corrupt]
    damaged = [*(m.ref for m in failed), *(c.ref for c in corrupt)]
    them = "it" if len(damaged) == 1 else "them"
    removal = ", ".join(f"`dlm rm {ref}`" for ref in damaged)
    findings = f"; `dlm verify {name}@VERSION` lists a failed version's findings" if failed else ""
    if not unverified:
        return (
            f"no version of {name!r} can be used: {'; '.join(why)}. Fetching {them} again repairs {them} "
            f"in place, or remove {them} ({removal}){findings}"
        )
    checks = ", ".join(f"`dlm verify {m.ref}`" for m in unverified)
    one = len(unverified) == 1
    repairs = f"; fetching the others again repairs them in place, or remove them ({removal})" if damaged else ""
    return (
        f"{name!r} has no verified version: {'; '.join(why)}. {checks} "
        f"{'checks the unverified version' if one else 'check the unverified versions'}{repairs}"
    )


class Store:
    def __init__(self, root: Path | None = None) -> None:
        self.root = expand_user(root, "the store directory") if root else default_store_root()

    # -- layout -------------------------------------------------------------------------
    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def deployments_dir(self) -> Path:
        return self.root / "deployments"

    def model_dir(self, name: str) -> Path:
        return self.models_dir / check_name(name)

    def version_dir(self, name: str, version: str) -> Path:
        return self.model_dir(name) / check_name(version, "version")

    def files_dir(self, name: str, version: str) -> Path:
        return self.version_dir(name, version) / FILES

    def require(self) -> None:
        """UsageError unless the store exists. What reads or changes the versions a store
        holds (verify, rm, release, rollback, serve --deployment) needs one and creates none:
        only a fetch makes the store's directory (`dlm models` lists a missing store as
        empty)."""
        if not self.root.is_dir():
            raise UsageError(
                f"there is no store at {self.root}: nothing was ever fetched into it "
                "(check --store / DLM_STORE; `dlm fetch` creates it)"
            )

    def lock(self, blocking: bool = True) -> Any:
        """The store-wide lock: every change to what the store lists or serves (publishing,
        verification records, removal, releases, server registration) happens under it,
        and reads what it protects only once it is held. Callers normally take it through
        `dlm.cli.store.releases.transaction`, which also settles interrupted hot swaps.
        Taking it creates no store (`require`): a fetch has made its staging copy, and so
        the store, before it publishes under the lock."""
        self.require()
        return locked(
            self.root / ".lock",
            blocking,
            waiting=f"the store lock {self.root / '.lock'}: another dlm command is changing the store "
            "(a release holds it for its whole hot swap)",
        )

    def staging_lock(self, name: str, blocking: bool = True) -> Any:
        """Serialises the (long) transfers of one model's fetches into its staging area;
        taken before, never inside, the store-wide lock (inside it only without blocking)."""
        return locked(
            self.model_dir(name) / ".lock", blocking, waiting=f"another fetch of {name} to finish its transfer"
        )

    # -- reading ------------------------------------------------------------------------
    def model_directories(self) -> list[str]:
        """Every model directory, with a version or not: what a transaction tidies
        (`clear_leftovers`). Listing is `models`."""
        if not self.models_dir.is_dir():
            return []
        return sorted(p.name for p in self.models_dir.iterdir() if p.is_dir() and NAME_RE.match(p.name))

    def models(self) -> list[str]:
        """The models the store holds: names with at least one listed version (readable or
        corrupt). A directory holding only a fetch in progress or interrupted (a hub download
        kept to be resumed, a SIGKILLed fetch's lock) is no model: `dlm models` listed it with
        no version, which nothing could resolve, verify or remove (`incomplete_fetches`
        reports such downloads)."""
        return [name for name in self.model_directories() if self._listed(name)]

    def _listed(self, name: str) -> list[str]:
        """The version directories of `name` that are listed: a valid name, not a dot name
        (staging, trash), with a manifest (a version is renamed into place with it)."""
        directory = self.model_dir(name)
        if not directory.is_dir():
            return []
        try:
            entries = list(directory.iterdir())
        except FileNotFoundError:  # removed since the listing
            return []
        return [
            e.name for e in entries if not e.name.startswith(".") and NAME_RE.match(e.name) and (e / MANIFEST).exists()
        ]

    def incomplete_fetches(self, name: str) -> list[IncompleteFetch]:
        """The hub downloads of `name` that a fetch left unpublished (killed, interrupted, a
        file that failed its hash), kept under `.staging/hub-<version>/` for the same fetch to
        resume: never a version, but disk space an operator should know of, with the command
        that resumes each (`running` while a fetch of `name` holds its staging lock)."""
        base = self.model_dir(name) / STAGING
        try:
            staged = sorted(e for e in base.iterdir() if e.is_dir() and e.name.startswith("hub-"))
        except (FileNotFoundError, NotADirectoryError):
            return []
        if not staged:  # nothing to report, and no lock to probe (a listing of a read-only store)
            return []
        try:
            with locked(self.model_dir(name) / ".lock", blocking=False, make_parents=False):
                running = False
        except Busy:
            running = True
        except FileNotFoundError:  # a fetch removed the model's directory just now
            return []
        except OSError as exc:  # a store this process may not write: no fetch of it runs here
            if not unwritable(exc):
                raise
            running = False
        found = []
        for entry in staged:
            files, size = 0, 0
            for directory, _, names in os.walk(entry / FILES):  # partial files (.cache) count as space
                for file in names:
                    try:
                        size += os.lstat(os.path.join(directory, file)).st_size
                    except FileNotFoundError:
                        continue
            if (entry / FILES).is_dir():
                files = sum(1 for _ in iter_files(entry / FILES))
            try:
                source: HubSource | None = read_record(entry / SOURCE, HubSource)
            except (FileNotFoundError, CorruptRecord):
                source = None  # staged by an older dlm, or damaged: the user knows what they fetched
            found.append(IncompleteFetch(name, entry.name[len("hub-") :], entry, files, size, source, running))
        return found

    def versions(self, name: str) -> tuple[list[Manifest], list[CorruptVersion]]:
        """Listed versions of `name`: those that read (oldest fetch first) and those whose
        manifest is corrupt. Staging and torn entries (no manifest yet) are not listed."""
        found, corrupt = [], []
        for version in self._listed(name):
            try:
                found.append(self._read_manifest(name, version))
            except CorruptRecord as exc:
                corrupt.append(CorruptVersion(name, version, exc.reason))
            except FileNotFoundError:  # removed since the listing
                continue
        found.sort(key=lambda m: (m.fetched_at, m.version))
        corrupt.sort(key=lambda c: c.version)
        return found, corrupt

    def manifests(self, name: str) -> list[Manifest]:
        """Readable versions of `name`, oldest fetch first."""
        return self.versions(name)[0]

    def _read_manifest(self, name: str, version: str) -> Manifest:
        path = self.version_dir(name, version) / MANIFEST
        manifest = read_record(path, Manifest)
        if (manifest.name, manifest.version) != (name, version):  # it would resolve to other files
            raise CorruptRecord(path, f"it names {manifest.ref} but is stored as {name}@{version}")
        return manifest

    def manifest(self, name: str, version: str) -> Manifest:
        """The manifest of `name@version`: UsageError if there is none, CorruptRecord (exit 1,
        saying how to remove it) if it cannot be read."""
        try:
            return self._read_manifest(name, version)
        except FileNotFoundError:
            raise UsageError(f"no version {version!r} of {name!r} in the store at {self.root}") from None
        except CorruptRecord as exc:
            raise CorruptRecord(exc.path, f"{exc.reason} (`dlm rm {name}@{version}` removes it)") from None

    def lookup(self, spec: str) -> Manifest | CorruptVersion:
        """Resolve 'name@version' (a unique prefix of the version is enough), corrupt versions
        included, or 'name' (its newest verified version; when there is none, an error listing
        every version's state: UsageError while one is unverified (`dlm verify` it), else
        DlmError, the store's damage)."""
        name, version = split_ref(spec)
        manifests, corrupt = self.versions(name)
        if not manifests and not corrupt:
            self.require()
            pending = "".join(
                f" (its fetch of {f.ref} is incomplete: " + (f"`{f.resume}` resumes it)" if f.resume else "rerun it)")
                for f in self.incomplete_fetches(name)[-1:]
            )
            raise UsageError(f"no model named {name!r} in the store at {self.root}{pending}")
        if version is None:
            verified = [m for m in manifests if m.verified]
            if verified:
                return verified[-1]
            if any(m.state == "unverified" for m in manifests):  # verifying it is the user's step
                raise UsageError(no_usable_version(name, manifests, corrupt))
            # Each version failed verification or is corrupt: the store's damage (exit 1), which
            # verifying again would not repair.
            raise DlmError(no_usable_version(name, manifests, corrupt))
        listed: list[Manifest | CorruptVersion] = [*manifests, *corrupt]
        exact = [v for v in listed if v.version == version]
        matches = exact or [v for v in listed if v.version.startswith(version)]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(v.version for v in listed)
        if not matches:
            raise UsageError(f"{name!r} has no version {version!r} (versions: {known})")
        raise UsageError(f"version {version!r} of {name!r} is ambiguous (versions: {known})")

    def find(self, spec: str) -> Manifest:
        """`lookup`, for a version to use: a corrupt one is an error saying how to remove it."""
        found = self.lookup(spec)
        if isinstance(found, CorruptVersion):
            path = self.version_dir(found.name, found.version) / MANIFEST
            raise CorruptRecord(path, f"{found.reason} (`dlm rm {found.ref}` removes it)")
        return found

    def size_damage(self, manifest: Manifest) -> str | None:
        """The first file of `manifest`'s version that is missing or not of the size its
        manifest records, as a finding with its fixes ("m@V: model.safetensors is missing or
        changed size since it was verified: `dlm verify m@V` records ..."); None when each is
        there at its size. Every use of a version checks it (release, rollback, resolving
        MODEL, the listing). A stat per file, no hashing
        (that is `dlm verify`): cheap enough for every listing, and what catches a truncated
        or deleted file that the last verification's record cannot know of."""
        root = self.files_dir(manifest.name, manifest.version)
        since = "fetched" if manifest.verification is None else "verified"
        for entry in manifest.files:
            path = root / entry.path
            try:
                intact = path.is_file() and path.stat().st_size == entry.size
            except OSError:  # a directory on the way that cannot be searched: no file to load either
                intact = False
            if not intact:
                ref = manifest.ref
                return (
                    f"{ref}: {entry.path} is missing or changed size since it was {since}: `dlm verify {ref}` "
                    f"records the damage, then `{fetch_command(manifest.name, manifest.source)}` repairs it "
                    f"(or `dlm rm {ref}`)"
                )
        return None

    def needs_repair(self, manifest: Manifest) -> bool:
        """Whether a fetch of the same content should copy `manifest`'s version again rather
        than stop at "already in the store": it failed its last verification, or a file of it
        is missing or of another size since (`size_damage`: listed `damaged`, refused by every
        use), which its record, still `verified`, cannot know of."""
        return manifest.state == "failed" or self.size_damage(manifest) is not None

    # -- writing ------------------------------------------------------------------------
    def staging(self, name: str, key: str | None = None) -> Path:
        """A staging directory: named by `key` when a rerun should resume it (hub downloads),
        fresh otherwise."""
        base = self.model_dir(name) / STAGING
        base.mkdir(parents=True, exist_ok=True)
        if key is not None:
            path = base / key
            path.mkdir(exist_ok=True)
            return path
        return Path(tempfile.mkdtemp(prefix="local-", dir=base))

    def clear_stale_staging(self, name: str, keep: Path | None = None) -> None:
        """Remove abandoned fresh staging directories (callers hold the model lock)."""
        base = self.model_dir(name) / STAGING
        if base.is_dir():
            for entry in base.iterdir():
                if entry.name.startswith("local-") and entry != keep:
                    shutil.rmtree(entry, ignore_errors=True)

    def new_directories(self, name: str, key: str | None = None) -> list[Path]:
        """The directories a fetch of model `name` (staging under `key`, as `staging`) is
        about to make, innermost first: what `discard_empty` may remove again."""
        base = self.model_dir(name) / STAGING
        paths = [*([base / key] if key is not None else []), base, self.model_dir(name), self.models_dir, self.root]
        return [p for p in paths if not p.exists()]

    def discard_empty(self, name: str, created: list[Path]) -> None:
        """After a failed fetch of model `name`, or when a transaction tidies it
        (`clear_leftovers`) (the caller holds its staging lock and has removed its fresh
        staging copies): remove the directories of `created`
        (`new_directories`) that hold nothing now, so that the store is as it was before, not
        listing a model with no version. Only empty directories go (and the lock files in
        them: the model's, which the caller holds, and the store's, taken to remove it;
        `atomic.locked` sends a waiter to the file made after it): a resumable hub download,
        and whatever another command put there meanwhile, stay."""
        directory = self.model_dir(name)
        for path in created:  # innermost first; one that is not empty stays, and so its parents
            try:
                if path.parent.name == STAGING:  # a download's folders, emptied
                    for inner, _, _ in os.walk(path, topdown=False):
                        if inner != str(path):
                            os.rmdir(inner)
                    if [entry.name for entry in path.iterdir()] == [SOURCE]:  # the record of nothing
                        (path / SOURCE).unlink()
                if path.is_dir() and [entry.name for entry in path.iterdir()] == [".lock"]:
                    if path == directory:  # the model's staging lock: the caller holds it
                        (path / ".lock").unlink()
                    else:  # the store's lock (a publication failed): removed by whoever holds it
                        with locked(path / ".lock", blocking=False):
                            (path / ".lock").unlink()
                path.rmdir()
            except (OSError, Busy):
                break

    def commit(self, staging: Path, manifest: Manifest) -> bool:
        """Publish a staged version: write its manifest, then rename it into place (the
        caller holds the store lock).

        Returns False (and discards the staging copy) when that version already exists,
        unless the stored one cannot be used (`needs_repair`) and the staged one passed:
        then the staged copy replaces it (a fetch repairs a failed or damaged version). The
        staged copy is complete (manifest included) before the stored one is unlisted, and the
        stored one is deleted only once the new one is in place: a fetch killed while it
        deleted a large copy lost the version (both copies, the staged one then an abandoned
        staging directory), a deployment's current release too.
        """
        target = self.version_dir(manifest.name, manifest.version)
        replacing = (target / MANIFEST).exists()
        if replacing:
            try:
                stored: Manifest | None = self._read_manifest(manifest.name, manifest.version)
            except CorruptRecord:
                stored = None  # whatever the new copy's state, it is better than an unreadable one
            if stored is not None and (not self.needs_repair(stored) or not manifest.verified):
                shutil.rmtree(staging, ignore_errors=True)
                return False
        for directory, _, _ in os.walk(staging / FILES):
            fsync_dir(Path(directory))
        write_json_atomic(staging / MANIFEST, manifest.to_json())
        # A hub download's record of its source (the manifest's now) stays until this moment: a
        # fetch killed or interrupted before (its structural checks take seconds) leaves the
        # download listed with the command that resumes it.
        (staging / SOURCE).unlink(missing_ok=True)
        trash = self._trash(target) if replacing else None
        if target.exists():  # a torn leftover from an older, non-atomic tool: not listed, replace
            shutil.rmtree(target)
        os.rename(staging, target)
        fsync_dir(target.parent)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return True

    def record_verification(self, checked: Manifest, verification: Verification) -> Manifest:
        """Rewrite the verification record of the version `checked` describes (the caller holds
        the store lock), unless that copy is gone: a version fetched again (a repair) while a
        verify of the old copy ran would otherwise be marked with the old copy's failures."""
        name, version = checked.name, checked.version
        if not (self.version_dir(name, version) / MANIFEST).exists():
            raise DlmError(f"{name}@{version} was removed while it was being verified")
        manifest = self.manifest(name, version)
        if manifest.fetched_at != checked.fetched_at:
            raise DlmError(
                f"{name}@{version} was fetched again while it was being verified: its new copy's record "
                f"stands (`dlm verify {name}@{version}` checks the new copy)"
            )
        manifest.verification = verification
        write_json_atomic(self.version_dir(name, version) / MANIFEST, manifest.to_json())
        return manifest

    def remove(self, name: str, version: str) -> None:
        """Unlist the version atomically, then delete its files (the caller holds the store lock)."""
        self._unlist(self.version_dir(name, version))

    def discard_incomplete(self, fetch: IncompleteFetch) -> None:
        """Delete an incomplete hub download (`incomplete_fetches`), as `dlm rm NAME@VERSION`
        of it asks (the caller holds the store lock): unlisted first (renamed to a dot name),
        then deleted, unless a fetch of the model is transferring now."""
        try:
            with locked(self.model_dir(fetch.name) / ".lock", blocking=False, make_parents=False):
                trash = fetch.path.parent / f".trash-{fetch.path.name}-{os.getpid()}"
                os.rename(fetch.path, trash)
                shutil.rmtree(trash, ignore_errors=True)
        except Busy:
            raise DlmError(f"refusing to remove {fetch.ref}: a fetch of {fetch.name} is running") from None
        self.clear_leftovers(fetch.name)  # a name left with nothing is no model directory either

    def clear_leftovers(self, name: str) -> None:
        """What killed writers left under model `name`: removals' trash (removals run under
        the store lock, which the caller holds), torn verification records, and abandoned fresh staging copies, unless a
        fetch of the model is transferring now (it holds the staging lock; its successor
        clears what it abandons); and then the model's directory itself when that leaves it
        with no version (a fetch of a new name killed, or its last version removed), so that
        no model is listed without a version (`discard_empty`; a hub download's staging stays,
        for its rerun to resume). A directory that a failing fetch removes meanwhile is not
        made again for its lock."""
        directory = self.model_dir(name)
        for leftover in directory.glob(".trash-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        # A verification record's temporary (`write_json_atomic`), left by a `dlm verify` killed
        # as it wrote it: written under the store lock, which the caller holds, so none is in use.
        for torn in directory.glob(f"*/.{MANIFEST}.*.tmp"):
            torn.unlink(missing_ok=True)
        try:
            with locked(directory / ".lock", blocking=False, make_parents=False):
                self.clear_stale_staging(name)
                if {entry.name for entry in directory.iterdir()} <= {".lock", STAGING}:  # no version
                    self.discard_empty(name, [p for p in (directory / STAGING, directory) if p.exists()])
        except (Busy, FileNotFoundError):
            pass

    def _unlist(self, target: Path) -> None:
        """Rename a version directory to a dot name (no longer listed), then delete it."""
        shutil.rmtree(self._trash(target), ignore_errors=True)

    def _trash(self, target: Path) -> Path:
        """Rename a version directory to a dot name, no longer listed, for the caller to delete
        (a transaction deletes what a killed caller left)."""
        for leftover in target.parent.glob(".trash-*"):  # from a removal killed midway
            shutil.rmtree(leftover, ignore_errors=True)
        trash = target.parent / f".trash-{target.name}-{os.getpid()}"
        os.rename(target, trash)
        fsync_dir(target.parent)
        return trash


def iter_files(root: Path) -> Iterator[Path]:
    """Regular files under `root`, sorted, skipping dot-directories (.git, .cache)."""
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            yield Path(directory) / name
