"""Turn what the engine is given as MODEL into a checkpoint directory.

The engine knows three kinds of MODEL: none (the embedded default model), `tiny:FAMILY` (a
tiny random checkpoint of any family, dlm/engine/tiny_models.py) and a checkpoint directory.
Store names (`NAME`, `NAME@VERSION`) belong to the model store, which resolves
them to a directory before calling the engine (`dlm.cli.store.resolve`).
"""

from __future__ import annotations

from pathlib import Path

from dlm.engine.errors import UsageError
from dlm.engine.home import expand_user


def checkpoint_dir(spec: str | Path | None) -> Path | None:
    """The checkpoint directory `spec` names, or None when it names no existing path.

    None -> the embedded default model; `tiny:FAMILY` -> that tiny model (both built on
    first use). An empty MODEL is refused: it is a variable that was not set (`dlm generate
    "$MODEL"`), which must not quietly become the default model."""
    if spec is None:
        from dlm.engine.default_model import ensure_default_model

        return ensure_default_model()
    if not str(spec).strip():
        raise UsageError(
            "MODEL is empty: name a checkpoint directory, a store name or tiny:FAMILY (none: the default model)"
        )
    from dlm.engine.tiny_models import ensure_tiny_model, is_tiny

    if is_tiny(str(spec)):
        return ensure_tiny_model(str(spec))
    path = expand_user(spec, "MODEL")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UsageError(f"{path} has no config.json; is it a model checkpoint directory?")
        return path
    if path.exists():
        raise UsageError(f"{path} is a file; MODEL must be a checkpoint directory")
    return None


def resolve_model(spec: str | Path | None) -> Path:
    """None -> the embedded default model; an existing checkpoint directory; else UsageError."""
    path = checkpoint_dir(spec)
    if path is None:
        raise UsageError(f"no model directory at {spec!r} (store names are resolved by the dlm CLI)")
    return path
