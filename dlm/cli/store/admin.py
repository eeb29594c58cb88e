"""The contract between the store and a running `dlm serve --deployment NAME`.

A server serving a deployment registers itself in `<store>/deployments/.servers/NAME.json`
(mode 0600: it holds the admin key; a dot directory, so no deployment name can collide with
it): its pid, its admin URL (always on 127.0.0.1), the admin key, and what it serves
(`serving`) or is switching to (`swapping`, with the `swap_intent` it acts on). The server is
the only writer of its record, under the record's own lock. `dlm release` / `dlm rollback`
find it there, record their intent in the deployment file (the swap journal,
dlm/cli/store/releases.py) and call

    POST {admin_url}/admin/swap
    Authorization: Bearer {admin_key}
    {"deployment": ..., "model": ..., "version": ..., "path": "<checkpoint dir>",
     "content_sha256": ..., "intent": "<the journal entry's id>"}

The server loads the new version beside the old one, warms it up, switches traffic and
drains the old one, and answers only then: 200 `{"status": "ok", "model", "version"}`
once traffic is on the new version, or an OpenAI-style error body
`{"error": {"message", ...}}` (any non-2xx) when the new version failed to load or warm
up, in which case traffic stayed on the old one. The store's current version changes only
after a 200.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dlm.cli.store import records
from dlm.cli.store.atomic import locked, write_json_atomic
from dlm.cli.store.records import CorruptRecord, ServerRecord
from dlm.cli.store.store import Store, check_name, now
from dlm.engine.errors import DlmError

SWAP_PATH = "/admin/swap"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SWAP_TIMEOUT_S = 1800.0  # loading and warming an 8B+ model can take minutes


class SwapFailed(DlmError):
    """The server did not switch: traffic stays on the version it was serving."""


SERVERS = ".servers"


def record_path(store: Store, deployment: str) -> Path:
    return store.deployments_dir / SERVERS / f"{check_name(deployment, 'deployment name')}.json"


@contextmanager
def record_lock(store: Store, deployment: str) -> Iterator[None]:
    """Serialises the server's changes to its record with the store's reading of it (held
    briefly by both: never while loading a model or waiting for a server)."""
    with locked(record_path(store, deployment).with_name(f".{deployment}.lock")):
        yield


def read_record(store: Store, deployment: str) -> ServerRecord | None:
    """The deployment's server record, whether its process lives or not; None when there is
    none or it is corrupt (only the server writes it, atomically: a corrupt one was not
    written by a server)."""
    try:
        return records.read_record(record_path(store, deployment), ServerRecord)
    except (FileNotFoundError, CorruptRecord):
        return None


def server_records(store: Store) -> list[ServerRecord]:
    """Every server record whose process is alive."""
    directory = store.deployments_dir / SERVERS
    found = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        record = read_record(store, path.stem) if not path.name.startswith(".") else None
        if record is not None and alive(record.pid):
            found.append(record)
    return found


def _check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise DlmError(f"admin URL {url} is not on 127.0.0.1; the admin key is only ever sent to loopback")


def register_server(store: Store, deployment: str, admin_url: str, admin_key: str, serving: str | None = None) -> Path:
    """Called (through `releases.register`) by `dlm serve --deployment NAME` once its admin
    endpoint listens."""
    _check_loopback(admin_url)
    path = record_path(store, deployment)
    record = ServerRecord(
        deployment=deployment,
        pid=os.getpid(),
        admin_url=admin_url.rstrip("/"),
        admin_key=admin_key,
        started_at=now(),
        serving=serving,
    )
    with record_lock(store, deployment):
        write_json_atomic(path, record.to_json(), mode=0o600)
    return path


def note_serving(
    store: Store, deployment: str, *, serving: str | None, swapping: str | None, intent: str | None
) -> None:
    """The server's own record of what it serves and what it is switching to (the caller
    holds `record_lock`); only this process's record is touched."""
    record = read_record(store, deployment)
    if record is None or record.pid != os.getpid():
        return
    record.serving, record.swapping, record.swap_intent = serving, swapping, intent
    write_json_atomic(record_path(store, deployment), record.to_json(), mode=0o600)


def unregister_server(store: Store, deployment: str) -> None:
    """Called by the server on shutdown; only removes its own record."""
    path = record_path(store, deployment)
    with record_lock(store, deployment):
        record = read_record(store, deployment)
        if record is not None and record.pid == os.getpid():
            path.unlink(missing_ok=True)


def _stat(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields from the third on (state, ppid, ...: after the command, which
    may hold spaces); None where /proc cannot say (no such process, not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot: /proc/PID/stat's field 22), which
    tells the process that wrote a record from a later one given the same pid (a container
    restarted in its pod runs its server as pid 1 again); None where /proc cannot say."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` still runs. A zombie does not: a server SIGKILLed under a
    supervisor that has not reaped it yet (or never does) still answers `kill(pid, 0)`, and
    its lease or server record kept `rm` refusing its version, served by nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat(pid)
    return fields is None or fields[:1] not in ([b"Z"], [b"X"])


def running_server(store: Store, deployment: str) -> ServerRecord | None:
    """The registered server of `deployment`, if its process is alive."""
    record = read_record(store, deployment)
    return record if record is not None and alive(record.pid) else None


def hot_swap(
    server: ServerRecord,
    *,
    model: str,
    version: str,
    path: Path,
    content_sha256: str,
    intent: str,
    timeout: float = SWAP_TIMEOUT_S,
) -> dict[str, Any]:
    """Ask the server to switch to `model@version`; returns its answer or raises SwapFailed."""
    import httpx

    _check_loopback(server.admin_url)
    body = {
        "deployment": server.deployment,
        "model": model,
        "version": version,
        "path": str(path),
        "content_sha256": content_sha256,
        "intent": intent,
    }
    try:
        response = httpx.post(
            server.admin_url + SWAP_PATH,
            json=body,
            timeout=timeout,
            headers={"Authorization": f"Bearer {server.admin_key}"},
        )
    except httpx.HTTPError as exc:
        raise SwapFailed(
            f"server of deployment {server.deployment} at {server.admin_url} did not answer: {exc}"
        ) from exc
    try:
        payload = response.json()
    except ValueError:
        payload = {}
    if response.status_code // 100 != 2:
        message = (payload.get("error") or {}).get("message") if isinstance(payload, dict) else None
        raise SwapFailed(f"server refused the swap (HTTP {response.status_code}): {message or response.text[:200]}")
    return payload if isinstance(payload, dict) else {}
