"""Turn what a user names as MODEL into a checkpoint directory, store names included."""

from __future__ import annotations

from pathlib import Path

from dlm.cli.store.hashing import sha256_file
from dlm.cli.store.store import NAME_RE, Manifest, Store
from dlm.engine.errors import DlmError, UsageError
from dlm.engine.resolve import checkpoint_dir

CONFIG = "config.json"


def resolve_model(spec: str | Path | None) -> Path:
    """None -> the embedded default model; an existing checkpoint directory; or a store
    name, `NAME` (its newest verified version) or `NAME@VERSION`."""
    path = checkpoint_dir(spec)
    if path is not None:
        return path
    name = str(spec).partition("@")[0]
    store = Store()
    if NAME_RE.match(name) and store.model_dir(name).is_dir():
        manifest = store.find(str(spec))
        if (failure := manifest.failure()) is not None:  # NAME@VERSION of a damaged version
            raise DlmError(failure)
        directory = store.files_dir(manifest.name, manifest.version)
        check_config(manifest, directory)
        return directory
    raise UsageError(f"no model at {spec!r}: not a directory, nor a model in the store at {store.root}")


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
