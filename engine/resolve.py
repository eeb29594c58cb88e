"""Turn what a user names as MODEL into a checkpoint directory."""
from __future__ import annotations

from pathlib import Path

from engine.errors import UsageError


def resolve_model(spec: str | Path | None) -> Path:
    """None -> the embedded default model; otherwise an existing checkpoint directory."""
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
    raise UsageError(f"no model at {spec!r}: not a directory")
