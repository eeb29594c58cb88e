"""Crash-safe file updates: write to a temporary name, fsync, rename, fsync the directory.

A reader (or a process restarted after SIGKILL) therefore sees either the old content or the
new, never a torn file. Temporary names start with a dot so listings skip them.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (the directory entry itself is data)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` by `data` (see above). An OSError that names no file (a write or an fsync
    on a full disk: `[Errno 28] No space left on device`, and nothing to say where) is raised
    naming `path`, the record that could not be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, payload: Any, mode: int = 0o644) -> None:
    write_bytes_atomic(path, (json.dumps(payload, indent=2, sort_keys=False) + "\n").encode(), mode)


def unwritable(exc: OSError) -> bool:
    """Whether `exc` says this process may not write where it tried: a store on a read-only
    mount, or another user's. Such a store can still be read (resolved, listed) without the
    store lock, which taking would create or open for writing."""
    return exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


class Busy(Exception):
    """A non-blocking `locked` found the lock held."""


WAIT_NOTICE_S = 1.0  # a lock held longer than a store transaction takes: say what is awaited


@contextmanager
def locked(path: Path, blocking: bool = True, make_parents: bool = True, waiting: str | None = None) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if needed) for the block; with
    `blocking=False`, raise Busy at once when another process holds it. A blocking wait that
    lasts more than a moment prints `note: waiting for <waiting>` on stderr once: a release
    holds the store lock for its whole hot swap (minutes), a fetch its model's for the whole
    transfer, and a command that waits on one said nothing. With
    `make_parents=False`, a directory of `path` that does not exist (or no longer does) is
    FileNotFoundError, not made: for a lock taken only to tidy what is in that directory.

    The kernel drops the lock when the holder dies, so a SIGKILLed fetch or release never
    leaves a stale lock behind. Its holder may remove the lock file (a failed fetch removes
    the model directory it made, `Store.discard_empty`): a waiter that then gets the lock of
    the removed file locks the file now at `path` instead, so no two hold `path` at once.
    """
    path = Path(path)
    for attempt in itertools.count():
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # no directory yet, or it was removed just now: make it (again)
            if not make_parents:
                raise
            _make_parents(path, attempt)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                os.close(fd)
                raise Busy(str(path)) from None
            try:
                _wait(fd, waiting or f"the lock {path}")
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            break
        os.close(fd)  # removed by its holder while we waited
    try:
        yield
    finally:
        os.close(fd)


def _wait(fd: int, waiting: str) -> None:
    """Take the lock on `fd` that another process holds, saying so once it takes a while."""
    deadline = time.monotonic() + WAIT_NOTICE_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            continue
    print(f"note: waiting for {waiting}", file=sys.stderr, flush=True)
    fcntl.flock(fd, fcntl.LOCK_EX)


def _make_parents(path: Path, attempt: int) -> None:
    """Make the directories above `path` for `locked`. Another process may be removing them
    at the same time (a failed fetch removes what it made, `Store.discard_empty`), which
    makes `Path.mkdir` raise FileExistsError (the directory went between its mkdir and its
    check) or FileNotFoundError (a parent went): `locked` then tries again. Only a failure
    that persists (a dangling link on the way, say) is raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, FileNotFoundError):
        if attempt >= 100:
            raise


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)
