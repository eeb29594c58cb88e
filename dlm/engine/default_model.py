"""The embedded default model: a tiny LLaDA-format checkpoint TRAINED on synthetic tasks.

A fresh machine runs every dlm command on it with no download, and what it answers can be
right or wrong (`What is 27 + 58?` -> `85`): a working deployment can be told from a broken
one, and decoding settings compared at measured accuracy. It was trained on this project's
CPU by scripts/train_tiny_dllm.py (its model card, README.md beside the weights, states the
data, the training time and the accuracy per task) and ships in the package, read-only.

Its files are verified like a store version before use: `sha256sums.json` lists every other
file's sha256, and its own sha256 is pinned here, so one digest covers them all.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import resources
from pathlib import Path

from dlm.engine.errors import DlmError

NAME = "dlm-tiny-tasks-llada"
SUMS = "sha256sums.json"
SUMS_SHA256 = "78436cd43b6eb97946e2f63e39e58e60a5eabf138704afc7f8382a7b7a1fda9d"


def default_model_dir() -> Path:
    return Path(str(resources.files("dlm.engine") / "assets" / NAME))


def suite_path() -> Path:
    """The default model's known-answer suite (`dlm validate --suite default-model`)."""
    return default_model_dir() / "suite.yaml"


@functools.cache
def ensure_default_model() -> Path:
    """The default model's directory, once its files match their pinned digests (checked once
    per process: a few MB)."""
    directory = default_model_dir()
    sums = directory / SUMS
    try:
        listed = json.loads(sums.read_text()) if _sha256(sums) == SUMS_SHA256 else None
        damaged = [] if listed else [SUMS]
        damaged += [name for name, digest in (listed or {}).items() if _sha256(directory / name) != digest]
    except OSError as exc:
        damaged = [f"{exc.filename}: {exc.strerror}"]
    if damaged:
        raise DlmError(
            f"the embedded default model at {directory} is damaged ({', '.join(damaged)} does not match "
            "its sha256); reinstall dlm, or give a MODEL"
        )
    return directory


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
