"""Bring a checkpoint into the store, from the hub or from a local / mounted mirror path.

Hub: the revision is resolved to a commit first, so a version always names immutable
content; files download through huggingface_hub into a staging directory named after that
commit (an interrupted fetch resumes there), then each file is checked against the hub's
hash for it (sha256 for LFS files, git's blob id for the rest) before the version is
published. Local: files are copied (or hard-linked) and hashed in the same pass; symbolic
links are followed only inside the source tree (or, with `follow_symlinks`, anywhere), and a
broken one (dangling, a loop) or anything that is not a regular file is stored as a finding
that fails the version instead of being copied. The scan notes which file (device, inode)
each path is; the copy opens it again without following any link and reads only the file
the scan saw, so a file swapped for a link (or for another file) between the two is refused,
never stored.
Either way the version id is derived from the content, so a second fetch of the same thing
does no transfer: for a commit already in the store, no network call either when the
revision is given as a full commit hash.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.cli.hub import HUB_ID
from dlm.cli.store.atomic import write_json_atomic
from dlm.cli.store.hashing import (
    ByteProgress,
    NoProgress,
    copy_hashing,
    git_blob_sha1,
    parallel_map,
    sha256_file,
    sha256_stream,
)
from dlm.cli.store.records import CorruptRecord, FileEntry, HubSource, LocalSource, Manifest, text
from dlm.cli.store.releases import transaction
from dlm.cli.store.store import (
    FILES,
    SOURCE,
    Store,
    check_name,
    content_hash,
    iter_files,
    local_path,
    now,
)
from dlm.cli.store.verify import VerifyReport, check_structure
from dlm.engine.errors import DlmError, UsageError

COMMIT = re.compile(r"[0-9a-f]{40}\Z")


@dataclass
class FetchResult:
    manifest: Manifest
    path: Path
    already_present: bool
    bytes_transferred: int
    report: VerifyReport | None  # structural checks of a newly published version

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "name": m.name,
            "version": m.version,
            "ref": f"{m.name}@{m.version}",
            "path": str(self.path),
            "source": m.source.to_json(),
            "files": len(m.files),
            "total_size": m.total_size,
            "content_sha256": m.content_sha256,
            "already_present": self.already_present,
            "bytes_transferred": self.bytes_transferred,
            "state": m.state,
            "verification": m.verification.to_json() if m.verification else None,
        }


# A local source is what it is: nothing pins it (its version is its content hash).
LOCAL_REVISION = "--revision applies to hub sources, not to a local directory"


def _store_name(given: str | None, derived: str, origin: str) -> str:
    """The name to store under: --name, else `derived` from the source (`origin` says how),
    which, when it is no valid name, is refused saying so and pointing to --name (it was
    refused as an "invalid model name" the user never typed)."""
    if given is not None:
        return check_name(given)
    try:
        return check_name(derived)
    except UsageError as exc:
        raise UsageError(f"{exc} ({origin}; give the store name with --name NAME)") from None


def _select(paths: Sequence[str], include: Sequence[str], exclude: Sequence[str]) -> list[str]:
    """The hub's own --include/--exclude semantics, for hub and local sources alike."""
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(paths, allow_patterns=list(include) or None, ignore_patterns=list(exclude) or None))


def _filter_tag(include: Sequence[str], exclude: Sequence[str]) -> str:
    if not include and not exclude:
        return ""
    blob = json.dumps([sorted(include), sorted(exclude)]).encode()
    return "-" + hashlib.sha256(blob).hexdigest()[:6]


def _publish(
    store: Store, staging: Path, manifest: Manifest, transferred: int, unusable: dict[str, str] | None = None
) -> FetchResult:
    """Structural checks on the staged files (plus the source entries that could not be
    copied, as failures), then the atomic rename into the store."""
    report = VerifyReport(path=str(staging / FILES), model=manifest.name, version=manifest.version)
    report.files = len(manifest.files)
    for rel, problem in sorted((unusable or {}).items()):
        report.fail(rel, "source", problem)
    check_structure(staging / FILES, report)
    manifest.verification = report.record(hashed=True)
    with transaction(store):
        published = store.commit(staging, manifest)
        if not published:
            manifest = store.manifest(manifest.name, manifest.version)
    path = store.files_dir(manifest.name, manifest.version)
    report.path = str(path)
    return FetchResult(manifest, path, not published, transferred, report if published else None)


@contextmanager
def _staging(store: Store, name: str, key: str | None = None) -> Iterator[None]:
    """Hold model `name`'s staging lock for a transfer (staged under `key`, see
    `Store.staging`); if the fetch fails (an error, Ctrl-C), the directories it made and left
    empty go again (`Store.discard_empty`): the store is as it was, with no model listed
    without a version. A version it published stays."""
    created = store.new_directories(name, key)
    with store.staging_lock(name):
        try:
            yield
        except BaseException:
            store.discard_empty(name, created)
            raise


# -- local directories and mounted mirrors --------------------------------------------------
def _unchanged_copy(store: Store, name: str, source: LocalSource, stats: dict[str, dict[str, int]]) -> Manifest | None:
    """A version copied from this very path whose files all still have the size and mtime
    they had then: re-fetching it would read everything to learn nothing."""
    for manifest in reversed(store.manifests(name)):
        if manifest.source != source or store.needs_repair(manifest):  # a failed or damaged one is fetched again
            continue
        if {f.path: f.source_stat for f in manifest.files} == stats:
            return manifest
    return None


@dataclass(frozen=True)
class SourceFile:
    """A regular file of a local source as the scan saw it: its path (links resolved) and
    which file that was (device, inode, size, mtime), so the copy can tell that it opened
    that very file and that it did not change while being read."""

    path: Path
    device: int
    inode: int
    size: int
    mtime_ns: int

    @property
    def source_stat(self) -> dict[str, int]:
        """What the manifest keeps (`source_stat`) to skip an unchanged source next time."""
        return {"size": self.size, "mtime_ns": self.mtime_ns}


# Entries a local source may hold (files, directories, links; each way to one through links
# counts): a checkpoint has a few thousand at most. Links to directories reachable along
# many paths multiply them (a chain of n directories, each linking twice to the next, has
# 2^n paths), and `dlm fetch /` walks /sys's web of links: without a bound the scan ran until
# the kernel killed it for memory, before --include/--exclude are applied.
MAX_SOURCE_ENTRIES = 200_000


def _source_files(src: Path, follow_symlinks: bool) -> tuple[dict[str, SourceFile], dict[str, str]]:
    """Walk a local source: (relative path -> file to read, relative path -> why it cannot
    be copied). Dot-directories (.git, .cache) are skipped, as in `iter_files`. A symbolic
    link is read through when its target lies inside `src`; one leaving it is refused unless
    `follow_symlinks`; links to an enclosing directory (loops) and dangling links are unusable."""
    files: dict[str, SourceFile] = {}
    unusable: dict[str, str] = {}
    pending: list[tuple[Path, str, frozenset[Path]]] = [(src, "", frozenset({src}))]
    entries = 0
    while pending:
        directory, prefix, ancestors = pending.pop()
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            rel, path = prefix + entry.name, Path(entry.path)
            entries += 1
            if entries > MAX_SOURCE_ENTRIES:
                raise DlmError(
                    f"{src} holds more than {MAX_SOURCE_ENTRIES:,} entries (reached at {text(rel)}; links to "
                    "directories along many paths count each path): it is no checkpoint directory; "
                    "fetch the checkpoint's own directory"
                )
            if text(entry.name) != entry.name:  # a manifest names its files in UTF-8 (records.text)
                if not (entry.name.startswith(".") and entry.is_dir()):  # a dot-directory is skipped anyway
                    unusable[text(rel)] = "a name that is not UTF-8, which a manifest cannot record (rename it)"
                continue
            real = path
            if entry.is_symlink():
                try:
                    real = path.resolve(strict=True)
                except (OSError, RuntimeError):
                    unusable[rel] = "a broken symbolic link (dangling, or a loop)"
                    continue
                if not real.is_relative_to(src) and not follow_symlinks:
                    raise DlmError(
                        f"{path} is a symbolic link to {real}, outside {src}: refused "
                        "(`dlm fetch --follow-symlinks` copies what such links point to)"
                    )
            try:
                st = os.lstat(real)  # `real` has no link left in it, unless one was swapped in just now
            except FileNotFoundError:
                raise DlmError(f"{path} vanished while the source was being read; fetch again") from None
            if stat.S_ISLNK(st.st_mode):
                raise DlmError(f"{path} changed while the source was being read; fetch again")
            if stat.S_ISDIR(st.st_mode):
                if entry.name.startswith("."):
                    continue
                if real in ancestors:
                    unusable[rel] = f"a symbolic link to its own enclosing directory {real} (a loop)"
                    continue
                pending.append((real, rel + "/", ancestors | {real}))
            elif stat.S_ISREG(st.st_mode):
                files[rel] = SourceFile(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            else:
                unusable[rel] = "not a regular file (a socket, FIFO or device)"
    return files, unusable


def _refuse_store_inside(src: Path, store: Store) -> None:
    """A source that holds the store (DLM_HOME under a project folder fetched whole) would be
    copied with the store in it, every version of every model, and its staging folder as it
    fills: refused (bad usage) unless a dot-directory, which the scan skips, holds the store."""
    root = store.root.expanduser().resolve()
    if root.is_relative_to(src) and not any(part.startswith(".") for part in root.relative_to(src).parts):
        raise UsageError(
            f"{src} holds the model store ({root}): fetching it would copy the store into itself; "
            "fetch the checkpoint's own directory"
        )


NO_FOLLOW_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW  # O_PATH: search, not read


def _open_scanned(file: SourceFile) -> io.FileIO:
    """Open the file the scan saw, following no symbolic link on the way (each directory of
    its resolved path is opened below the previous one with O_NOFOLLOW), and check that it is
    that same regular file. A link, a FIFO or another file put in its place since the scan
    is refused (DlmError), so nothing but the source's own bytes can be copied."""
    replaced = (
        f"{file.path} was replaced or removed after the source was scanned (a link or another file in its place?)"
    )
    parent = os.open("/", NO_FOLLOW_DIR)
    try:
        for part in file.path.parts[1:-1]:
            inner = os.open(part, NO_FOLLOW_DIR, dir_fd=parent)
            os.close(parent)
            parent = inner
        fd = os.open(file.path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.ENXIO):
            raise DlmError(f"{replaced}: refused; fetch again") from None
        raise
    finally:
        os.close(parent)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (file.device, file.inode):
        os.close(fd)
        raise DlmError(f"{replaced}: refused; fetch again")
    return io.FileIO(fd, "rb")


def _transfer(file: SourceFile, dst: Path, link: bool, advance: Any) -> str:
    """Copy (or hard-link) one scanned file into the staging area; the sha256 of exactly the
    bytes stored. Refuses a file that changed while it was read."""
    with _open_scanned(file) as source:
        digest = _link_hashing(file, source, dst, advance) if link else None
        if digest is None:
            digest = copy_hashing(source, dst, advance)
        st = os.fstat(source.fileno())
    if {"size": st.st_size, "mtime_ns": st.st_mtime_ns} != file.source_stat:
        raise DlmError(f"{file.path} changed while it was being copied; fetch again")
    return digest


def _link_hashing(file: SourceFile, source: io.RawIOBase, dst: Path, advance: Any) -> str | None:
    """Hard-link the scanned file at `dst` and hash it through `source` (the same inode);
    None when it cannot be linked (another file system), for the caller to copy it. The link
    is made to the path itself, never to what a link there points to, and kept only if it is
    the very file `source` holds open."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(file.path, dst, follow_symlinks=False)
    except OSError:
        return None
    linked = os.lstat(dst)
    if (linked.st_dev, linked.st_ino) != (file.device, file.inode):
        dst.unlink()
        raise DlmError(f"{file.path} was replaced after the source was scanned: refused; fetch again")
    return sha256_stream(source, advance)


def fetch_local(
    directory: Path,
    store: Store,
    name: str | None,
    include: Sequence[str],
    exclude: Sequence[str],
    link: bool,
    progress: ByteProgress,
    workers: int | None,
    follow_symlinks: bool = False,
) -> FetchResult:
    src = directory.expanduser().resolve()
    name = _store_name(name, src.name, "the directory's name")
    _refuse_store_inside(src, store)
    found, unusable = _source_files(src, follow_symlinks)
    selected = set(_select(sorted({*found, *unusable}), include, exclude))
    if not selected:
        raise UsageError(
            f"no files to fetch from {src}" + (" (after --include/--exclude)" if include or exclude else "")
        )
    unusable = {rel: why for rel, why in unusable.items() if rel in selected}
    sources = {rel: file for rel, file in found.items() if rel in selected}
    rels = sorted(sources)
    stats = {rel: sources[rel].source_stat for rel in rels}
    source = LocalSource(
        path=str(src), include=list(include), exclude=list(exclude), link=link, follow_symlinks=follow_symlinks
    )
    with _staging(store, name):
        existing = None if unusable else _unchanged_copy(store, name, source, stats)
        if existing is not None:
            return FetchResult(existing, store.files_dir(name, existing.version), True, 0, None)
        store.clear_stale_staging(name)
        staging = store.staging(name)
        try:
            total = sum(recorded["size"] for recorded in stats.values())
            digests = parallel_map(
                lambda rel, advance: _transfer(sources[rel], staging / FILES / rel, link, advance),
                rels,
                progress,
                "linking" if link else "copying",
                workers,
                total,
            )
            failed = {rel: d for rel, d in digests.items() if isinstance(d, OSError)}
            if failed:
                rel, exc = next(iter(failed.items()))
                raise DlmError(f"could not copy {sources[rel].path}: {exc}")
            files = [
                FileEntry(path=rel, size=stats[rel]["size"], sha256=str(digests[rel]), source_stat=stats[rel])
                for rel in rels
            ]
            digest = content_hash(files)
            manifest = Manifest(
                name=name, version=digest[:12], source=source, files=files, fetched_at=now(), content_sha256=digest
            )
            return _publish(store, staging, manifest, sum(f.size for f in files), unusable)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


# -- the hub (or a mirror speaking its API: HF_ENDPOINT) ----------------------------------
def _hub_error(repo_id: str, exc: Exception) -> DlmError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, RevisionNotFoundError):
        return UsageError(f"{repo_id}: revision not found on the hub ({exc.__class__.__name__})")
    if isinstance(exc, GatedRepoError):
        return DlmError(f"{repo_id} is gated: accept its terms on the hub and set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        return UsageError(f"{repo_id}: no such repository on the hub (or it is private: set HF_TOKEN)")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
    return DlmError(f"fetching {repo_id} from the hub failed: {first}")


def _existing(store: Store, name: str, version: str) -> Manifest | None:
    """The stored version, unless absent, corrupt, failed or damaged (those are fetched again)."""
    try:
        manifest = store.manifest(name, version)
    except (UsageError, CorruptRecord):
        return None
    return None if store.needs_repair(manifest) else manifest


def fetch_hub(
    repo_id: str,
    store: Store,
    name: str | None,
    revision: str | None,
    include: Sequence[str],
    exclude: Sequence[str],
    progress: ByteProgress,
    workers: int | None,
) -> FetchResult:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    name = _store_name(name, repo_id.split("/")[-1], "the repository's name")
    revision = revision or "main"
    tag = _filter_tag(include, exclude)
    if COMMIT.match(revision):  # immutable: no need to ask the hub what it resolves to
        found = _existing(store, name, revision[:12] + tag)
        if found is not None:
            return FetchResult(found, store.files_dir(name, found.version), True, 0, None)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint)
    try:
        commit = api.repo_info(repo_id, revision=revision).sha
        if commit is None:
            raise DlmError(f"the hub did not resolve {repo_id}@{revision} to a commit")
        version = commit[:12] + tag
        found = _existing(store, name, version)
        if found is not None:
            return FetchResult(found, store.files_dir(name, version), True, 0, None)
        tree = {
            f.path: f for f in api.list_repo_tree(repo_id, revision=commit, recursive=True) if isinstance(f, RepoFile)
        }
    except DlmError:
        raise
    except Exception as exc:  # the hub client raises many kinds: name the repo and the cause
        raise _hub_error(repo_id, exc) from exc
    wanted = _select(sorted(tree), include, exclude)
    if not wanted:
        raise UsageError(f"{repo_id}@{commit[:12]} has no files matching --include/--exclude")
    source = HubSource(
        repo_id=repo_id,
        revision=revision,
        commit=commit,
        endpoint=endpoint,
        include=list(include),
        exclude=list(exclude),
    )
    with _staging(store, name, key=f"hub-{version}"):
        staging = store.staging(name, key=f"hub-{version}")
        write_json_atomic(staging / SOURCE, source.to_json())  # what `dlm models` offers to resume
        target = staging / FILES
        before = sum(p.stat().st_size for p in iter_files(target)) if target.exists() else 0
        try:
            snapshot_download(
                repo_id,
                revision=commit,
                local_dir=target,
                allow_patterns=list(include) or None,
                ignore_patterns=list(exclude) or None,
                endpoint=endpoint,
                max_workers=workers or 8,
            )
        except Exception as exc:
            raise _hub_error(repo_id, exc) from exc
        shutil.rmtree(target / ".cache", ignore_errors=True)  # huggingface_hub's resume metadata

        def check(path: Path, advance: Any) -> str:
            digest = sha256_file(path, advance)
            with open(path, "rb") as handle:  # durable before the version is published
                os.fsync(handle.fileno())
            return digest

        missing = [rel for rel in wanted if not (target / rel).is_file()]
        if missing:
            raise DlmError(f"the hub download of {repo_id} lacks {', '.join(missing)}; fetch again to resume")
        digests = parallel_map(check, [target / rel for rel in wanted], progress, "hashing", workers)
        files, bad = [], []
        for rel in wanted:
            info, digest = tree[rel], digests[target / rel]
            if isinstance(digest, OSError):
                raise DlmError(f"could not read {target / rel}: {digest}")
            expected = {"sha256": info.lfs.sha256} if info.lfs is not None else {"git_sha1": info.blob_id}
            actual = digest if info.lfs is not None else git_blob_sha1(target / rel)
            files.append(FileEntry(path=rel, size=(target / rel).stat().st_size, sha256=digest, expected=expected))
            if actual != next(iter(expected.values())):
                bad.append(rel)
                (target / rel).unlink()  # so that the next run downloads it again
        if bad:
            raise DlmError(
                f"{', '.join(bad)} from {repo_id}@{commit[:12]} did not match the hub's hash; "
                "removed, fetch again to retry"
            )
        manifest = Manifest(
            name=name,
            version=version,
            source=source,
            files=files,
            fetched_at=now(),
            content_sha256=content_hash(files),
        )
        after = sum(f.size for f in files)
        return _publish(store, staging, manifest, max(0, after - before))


def fetch(
    source: str,
    store: Store,
    *,
    name: str | None = None,
    revision: str | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    link: bool = False,
    follow_symlinks: bool = False,
    progress: ByteProgress | None = None,
    workers: int | None = None,
) -> FetchResult:
    """Fetch SOURCE (a directory, or a hub repo id) into the store."""
    progress = progress or NoProgress()
    path = local_path(source)
    if path is not None:
        if not path.is_dir():
            raise UsageError(f"{source} is a file; SOURCE must be a directory or a hub repo id")
        if revision is not None:
            raise UsageError(LOCAL_REVISION)
        return fetch_local(path, store, name, include, exclude, link, progress, workers, follow_symlinks)
    if link or follow_symlinks:
        raise UsageError(f"{'--link' if link else '--follow-symlinks'} applies to local sources only")
    if not HUB_ID.match(source):
        raise UsageError(f"no directory at {source!r}, and it is not a hub repo id (org/name)")
    if revision is not None and not revision.strip():  # `--revision ""` (an unset variable) was main
        raise UsageError("--revision is empty: give a branch, tag or commit, or leave it out for main")
    return fetch_hub(source, store, name, revision, include, exclude, progress, workers)
