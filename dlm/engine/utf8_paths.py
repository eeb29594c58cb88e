"""Paths for the Rust-backed libraries dlm reads checkpoints with (tokenizers, safetensors).

They take a path as UTF-8 text. Python holds a path whose bytes are not UTF-8 (a directory
named in Latin-1, say, as `DLM_HOME` or a checkpoint's folder) with surrogate escapes, which
those libraries refuse: loading the tokenizer raised UnicodeEncodeError and reading weights
SafetensorError ("is not valid UTF-8"), so a sound checkpoint failed `dlm fetch`'s checks and
could not be loaded. `utf8_path` hands them a UTF-8 path to the same file instead.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def utf8_path(path: Path | str) -> Iterator[str]:
    """`path` as text a Rust-backed library can open: itself when it is UTF-8, else a symbolic
    link to it (its absolute path) in a new temporary directory, removed on leaving the block,
    named as `path` with each byte that is not UTF-8 as U+FFFD (a checkpoint folder's name is
    a remote-code module's name to transformers). What a library opened inside the block
    stays open (an open file outlives its link)."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
        utf8 = True
    except UnicodeEncodeError:
        utf8 = False
    if utf8:
        yield text
        return
    with tempfile.TemporaryDirectory(prefix="dlm-utf8-path-") as alias_dir:
        name = os.path.basename(text).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        alias = os.path.join(alias_dir, name or "path")
        os.symlink(os.path.abspath(text), alias)
        yield alias
