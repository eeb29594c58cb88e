"""Streamed sha256 of weight files: alone, while copying, and over many files in parallel.

Files are read in large chunks into one reusable buffer per thread; hashlib releases the GIL
on large updates, so threads hash several shards at once at disk speed. Progress is reported
in bytes through a small protocol so the engine never depends on a UI library.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

CHUNK = 8 << 20
K = TypeVar("K")


class ByteProgress(Protocol):
    """Receives byte counts as work advances (a progress bar, or nothing)."""

    def start(self, description: str, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def stop(self) -> None: ...


class NoProgress:
    def start(self, description: str, total_bytes: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def stop(self) -> None:
        pass


def _chunks(handle: io.RawIOBase, advance: Callable[[int], None]) -> Iterable[memoryview]:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    while True:
        n = handle.readinto(buffer)
        if not n:
            return
        yield view[:n]
        advance(n)


def open_regular(path: Path) -> io.RawIOBase:
    """`path` opened for reading if it is a regular file; OSError otherwise. A FIFO put where a
    checkpoint file was would block a plain `open` until a writer came (`dlm verify`, and every
    command resolving a store name, hung on one); it is opened without blocking and refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return io.FileIO(fd, "rb", closefd=True)


def sha256_file(path: Path, advance: Callable[[int], None] = lambda n: None) -> str:
    with open_regular(path) as handle:
        return sha256_stream(handle, advance)


def sha256_stream(handle: io.RawIOBase, advance: Callable[[int], None] = lambda n: None) -> str:
    """The sha256 of what is left to read from an open file."""
    digest = hashlib.sha256()
    for chunk in _chunks(handle, advance):
        digest.update(chunk)
    return digest.hexdigest()


def git_blob_sha1(path: Path) -> str:
    """The id git (and the hub, for files not in LFS) gives a file's content."""
    digest = hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode())
    with open(path, "rb", buffering=0) as handle:
        for chunk in _chunks(handle, lambda n: None):
            digest.update(chunk)
    return digest.hexdigest()


def copy_hashing(source: io.RawIOBase, dst: Path, advance: Callable[[int], None] = lambda n: None) -> str:
    """Copy what is left to read from `source` to `dst` and return the sha256 of exactly the
    bytes copied, in one pass; fsyncs `dst`. The caller opens `source`, so the bytes hashed
    are those of the file it checked, whatever its path names by now."""
    digest = hashlib.sha256()
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "wb") as out:
        for chunk in _chunks(source, advance):
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def parallel_map(
    work: Callable[[K, Callable[[int], None]], str],
    items: list[K],
    progress: ByteProgress,
    description: str,
    workers: int | None = None,
    total_bytes: int | None = None,
) -> dict[K, str | OSError]:
    """Run `work(item, advance)` over `items` (paths, unless `total_bytes` is given) in
    threads; an OSError is returned, not raised, so one unreadable file does not hide the
    state of the others."""
    if total_bytes is None:
        total_bytes = sum(p.stat().st_size for p in items if isinstance(p, Path) and p.is_file())
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            progress.advance(n)

    def one(item: K) -> str | OSError:
        try:
            return work(item, advance)
        except OSError as exc:
            return exc

    workers = max(1, min(workers or os.cpu_count() or 1, len(items) or 1))
    progress.start(description, total_bytes)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return dict(zip(items, pool.map(one, items)))
    finally:
        progress.stop()
