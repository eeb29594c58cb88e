"""Turn what a user names as MODEL into a checkpoint directory, store names included."""

from __future__ import annotations

from pathlib import Path

from dlm.cli.store.store import NAME_RE, Store
from dlm.engine.errors import UsageError
from dlm.engine.resolve import checkpoint_dir


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
        return store.files_dir(manifest.name, manifest.version)
    raise UsageError(f"no model at {spec!r}: not a directory, nor a model in the store at {store.root}")
