"""Leases: the record that a running process uses a store version, so that `rm` keeps it.

A deployment's server records what it serves (dlm/cli/store/admin.py), but a plain
`dlm serve NAME@VERSION`, `dlm generate`, `dlm batch` or a Python program that resolved a
store name (`dlm.cli.store.resolve.resolve_model`) reads a version's files for as long as it
runs with no deployment naming it: `dlm rm` deleted the files under a live server. So the
resolver takes a lease, `<store>/.leases/<pid>-<token>.json` (`records.Lease`: the version,
pid, host, command), under the store-wide lock and only once it has found the version there;
`rm` decides under the same lock (`releases.protected_versions`), so either the version was
removed first (the resolver then finds none) or `rm` sees the lease and refuses.

A lease counts while its process lives. The holder keeps its lease file flock-ed for as long
as it runs (the kernel drops the lock when it dies, however): a locked lease is live, also
when its pid means nothing here (a process in another pid namespace, a container of the same
pod, same host name: its pid 1 is not ours, and rm removed the version it loaded). A process
that dies leaves its lease behind, unlocked (a command ends with `os._exit`, a SIGKILL): one
whose pid is dead, or now runs a later process (its start time, where /proc gives it, is not
the lease's), is ignored, and removed by the next store transaction. A lease written on
another host (a store shared between machines) cannot be checked and counts as live until it
is deleted. A command drops its leases when it ends (`holding`); a Python program keeps its
leases until it exits.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Literal

from dlm.cli.store.admin import alive, process_start
from dlm.cli.store.atomic import write_json_atomic
from dlm.cli.store.records import CorruptRecord, Lease, Manifest, read_record
from dlm.cli.store.store import Store, now

LEASES = ".leases"
HOST = socket.gethostname()

Use = Literal["served", "loaded"]
# This process's leases, (store root, NAME@VERSION) -> its file and the descriptor holding its
# lock: one lease per version, however often the name is resolved (`dlm serve` resolves MODEL
# before it starts and as it loads).
_taken: dict[tuple[Path, str], tuple[Path, int]] = {}
_holder: tuple[str, Use] | None = None  # set by `holding`; None: a Python program


def _program() -> str:
    """What this process runs, for a lease taken outside a command (`holding`): the script,
    or `python` (for `python -c`, stdin)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name and not name.startswith("-") else "python"


def lease_dir(store: Store) -> Path:
    return store.root / LEASES


def take(store: Store, manifest: Manifest) -> None:
    """Lease `manifest`'s version for this process (the caller holds the store lock and has
    just found the version under it)."""
    key = (store.root, manifest.ref)
    if key in _taken:
        if _taken[key][0].exists():
            return
        os.close(_taken.pop(key)[1])  # deleted by hand: lease it again
    command, use = _holder or (_program(), "loaded")
    lease = Lease(
        model=manifest.name,
        version=manifest.version,
        pid=os.getpid(),
        host=HOST,
        command=command,
        use=use,
        since=now(),
        started=process_start(os.getpid()),
    )
    path = lease_dir(store) / f"{os.getpid()}-{secrets.token_hex(6)}.json"
    write_json_atomic(path, lease.to_json())
    # Locked before the store lock is released: no transaction sees it unlocked while we run.
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _taken[key] = (path, fd)


@contextmanager
def holding(command: str, use: Use = "loaded") -> Iterator[None]:
    """For the block, leases name `command` (`dlm serve`) and what it does with the version;
    the leases taken in it are dropped when it ends: the command no longer reads the files."""
    global _holder
    before, earlier = set(_taken), _holder
    _holder = (command, use)
    try:
        yield
    finally:
        _holder = earlier
        for key in set(_taken) - before:
            path, fd = _taken.pop(key)
            path.unlink(missing_ok=True)
            os.close(fd)


def _records(store: Store) -> Iterator[tuple[Path, Lease | None]]:
    """Every lease file, with its record (None: corrupt)."""
    directory = lease_dir(store)
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            yield path, read_record(path, Lease)
        except FileNotFoundError:  # dropped since the listing
            continue
        except CorruptRecord:
            yield path, None


def _locked(path: Path) -> bool:
    """Whether a process holds `path`'s lock: its holder runs (False also where that cannot be
    told: the pid checks decide)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _live(path: Path, lease: Lease) -> bool:
    """Its process may still run: its file is locked (`take`), also by a process of another pid
    namespace; another host's cannot be checked; here, its pid must be alive and (where /proc
    says) the same process, not a later one given that pid."""
    if lease.host != HOST or _locked(path):
        return True
    if not alive(lease.pid):
        return False
    return lease.started is None or process_start(lease.pid) in (None, lease.started)


def live_leases(store: Store) -> list[tuple[Path, Lease]]:
    """The leases whose process may still run, with their files (a corrupt one counts as none:
    only a process that resolved a version writes one, atomically)."""
    return [(path, lease) for path, lease in _records(store) if lease is not None and _live(path, lease)]


def holder(path: Path, lease: Lease) -> str:
    """Who holds it, as `rm` and `dlm models` name it: 'served by pid 12 (dlm serve)'. One of
    another host cannot be checked here: the file to delete once that host runs it no more
    (a pod killed outright leaves its lease) is named."""
    if lease.host == HOST:
        return f"{lease.use} by pid {lease.pid} ({lease.command})"
    return f"{lease.use} by pid {lease.pid} on {lease.host} ({lease.command}; if it runs no more, delete {path})"


def clear_stale(store: Store) -> None:
    """Remove the leases of dead processes, corrupt ones and torn temporaries (the caller
    holds the store lock, under which every lease is written). One this user may not remove
    (another user's, on a store they share) is left: it protects nothing already, and a
    refusal here would fail every store command of this user; so is a directory of a lease's
    name (no lease: dlm writes files), whose contents are not dlm's to delete."""
    directory = lease_dir(store)
    if not directory.is_dir():
        return
    stale = [
        *directory.glob(".*.tmp"),
        *(path for path, lease in _records(store) if lease is None or not _live(path, lease)),
    ]
    for path in stale:
        with suppress(PermissionError, IsADirectoryError):
            path.unlink(missing_ok=True)
