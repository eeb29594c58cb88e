"""Shared by the weights tests: tiny checkpoints in the real on-disk format, and the CLI."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "dlm" / "engine" / "assets" / "tiny_tokenizer"


def make_checkpoint(
    directory: Path, shards: int = 2, seed: int = 0, tokenizer: bool = True, **overrides: object
) -> Path:
    """A tiny LLaDA checkpoint (sharded with an index when shards > 1), with the shipped
    tokenizer files so the tokenizer check has something real to load."""
    from dlm.engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint

    config = llada_config(vocab_size=300, mask_token_id=299, eos_token_id=298, **overrides)
    save_checkpoint(directory, config, random_llada_tensors(config, seed=seed), shards=shards)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(TOKENIZER / name, directory / name)
    return directory


def make_checkpoints(directory: Path, count: int = 3) -> list[Path]:
    """`count` small, distinct single-shard checkpoints without tokenizer (versions of one model)."""
    return [make_checkpoint(directory / f"v{i}", shards=1, seed=i, tokenizer=False) for i in range(count)]


def cli(*args: str) -> tuple[int, str, str]:
    """Run `dlm ARGS` in-process: (exit code, stdout, stderr)."""
    from dlm.cli.main import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def mount_read_only(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Make `root` read-only for this process, as a read-only mount is: every open for writing
    under it fails with EROFS (chmod would not do: root, which runs the tests in containers,
    writes whatever the modes say)."""
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT
    real_open = os.open

    def read_only(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).startswith(str(root)) and flags & writes:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only)
