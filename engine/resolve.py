"""Turn what a user names as MODEL into a checkpoint directory."""
from __future__ import annotations

from pathlib import Path

from engine.errors import UsageError


def resolve_model(spec: str | Path | None) -> Path:
    """None -> the embedded default model; an existing checkpoint directory; or a store
    name, `NAME` (its newest verified version) or `NAME@VERSION`."""
    if spec is None or str(spec) == "":
        from engine.default_model import ensure_default_model

        return ensure_default_model()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UsageError(f"{path} has no config.json; is it a model checkpoint directory?")
        return path
    if path.exists():
        raise UsageError(f"{path} is a file; MODEL must be a checkpoint directory")
    from engine.weights.store import NAME_RE, Store

    name = str(spec).partition("@")[0]
    store = Store()
    if NAME_RE.match(name) and store.model_dir(name).is_dir():
        manifest = store.find(str(spec))
        return store.files_dir(manifest.name, manifest.version)
    raise UsageError(f"no model at {spec!r}: not a directory, nor a model in the store at {store.root}")
