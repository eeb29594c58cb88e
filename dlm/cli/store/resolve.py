"""Turn what a user names as MODEL into a checkpoint directory, store names included."""

from __future__ import annotations

from pathlib import Path

from dlm.cli.store import leases
from dlm.cli.store.atomic import unwritable
from dlm.cli.store.hashing import sha256_file
from dlm.cli.store.store import NAME_RE, Manifest, Store
from dlm.engine.errors import DlmError, UsageError
from dlm.engine.resolve import checkpoint_dir

CONFIG = "config.json"


def resolve_model(spec: str | Path | None) -> Path:
    """None -> the embedded default model; an existing checkpoint directory; or a store
    name, `NAME` (its newest verified version) or `NAME@VERSION`, leased to this process
    (dlm/cli/store/leases.py) so that `dlm rm` keeps it while the process runs."""
    return resolve_version(spec)[0]


def resolve_version(spec: str | Path | None) -> tuple[Path, str | None]:
    """`resolve_model`'s directory, and the `NAME@VERSION` a store name resolved to (None for
    a directory or the default model): a command that reads MODEL again later (a server checks
    the checkpoint, then loads it) pins that version, since a bare NAME read later may be a
    version fetched in between."""
    path = checkpoint_dir(spec)
    if path is not None:
        return path, None
    name = str(spec).partition("@")[0]
    store = Store()
    if NAME_RE.match(name) and store.model_dir(name).is_dir():
        try:
            # Found and leased under the store lock, under which `rm` decides: either the
            # version is gone before it is found here, or `rm` sees the lease and keeps it.
            with store.lock():
                manifest = _loadable(store, str(spec))
                leases.take(store, manifest)
        except OSError as exc:
            if not unwritable(exc):
                raise
            manifest = _loadable(store, str(spec))  # a store this process may not write: no lease
        directory = store.files_dir(manifest.name, manifest.version)
        check_config(manifest, directory)
        return directory, manifest.ref
    raise UsageError(f"no model at {spec!r}: not a directory, nor a model in the store at {store.root}")


def _loadable(store: Store, spec: str) -> Manifest:
    """The version `spec` names, unless its last verification failed or a file has gone or
    changed size since (a truncated shard failed in the loader, naming no fix)."""
    manifest = store.find(spec)
    if (failure := manifest.failure() or store.size_damage(manifest)) is not None:
        raise DlmError(failure)
    return manifest


def check_config(manifest: Manifest, directory: Path) -> None:
    """A store version's config.json, which every command reads first, as it was fetched: a
    damaged copy is the store's failure (exit 1), not a bad checkpoint the user named. (The
    other files: `dlm verify`, and the loader's own checks.)"""
    entry = next((f for f in manifest.files if f.path == CONFIG), None)
    if entry is None:
        return
    ref = f"{manifest.name}@{manifest.version}"
    try:
        intact = sha256_file(directory / CONFIG) == entry.sha256
    except OSError as exc:
        raise DlmError(f"cannot read {ref}'s {CONFIG}: {exc.strerror}") from None
    if not intact:
        raise DlmError(
            f"{ref}'s {CONFIG} does not match the sha256 recorded when it was fetched: the store's copy is "
            f"damaged; `dlm verify {ref}` lists every damaged file"
        )
