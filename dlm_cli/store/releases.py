"""Deployments: which store version each one serves, and the history of how it got there.

One JSON file per deployment (`<store>/deployments/NAME.json`) holds both `current` and the
append-only `history`, and is replaced atomically: a release or rollback killed at any
instant leaves the old state or the new one, never neither. Releases and rollbacks of one
deployment are serialised by a lock file.

Rollback semantics: successful events form a stack. A release pushes its version; a rollback
to a version on the stack pops back to it. So after releasing v1, v2, v3, two rollbacks
return to v2 and then v1 (not back and forth between v2 and v3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm_cli.store import admin
from dlm_cli.store.atomic import locked, read_json, write_json_atomic
from dlm_cli.store.store import Manifest, Store, check_name, now
from engine.errors import DlmError, UsageError

DEFAULT_DEPLOYMENT = "default"


def state_path(store: Store, deployment: str) -> Path:
    return store.deployments_dir / f"{check_name(deployment, 'deployment name')}.json"


def load_state(store: Store, deployment: str) -> dict[str, Any]:
    path = state_path(store, deployment)
    if not path.exists():
        return {"deployment": deployment, "current": None, "history": []}
    try:
        return read_json(path)
    except ValueError as exc:
        raise DlmError(f"deployment file {path} is unreadable: {exc}") from exc


def deployments(store: Store) -> list[str]:
    if not store.deployments_dir.is_dir():
        return []
    return sorted(
        p.stem
        for p in store.deployments_dir.glob("*.json")
        if not p.name.startswith(".") and not p.name.endswith(".server.json")
    )


def release_stack(history: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(model, version) of the successful releases still in force, oldest first."""
    stack: list[tuple[str, str]] = []
    for event in history:
        if event.get("status") != "ok":
            continue
        ref = (event["model"], event["version"])
        if event["action"] == "rollback" and ref in stack:
            while stack[-1] != ref:
                stack.pop()
        else:
            stack.append(ref)
    return stack


def protected_versions(store: Store) -> dict[tuple[str, str], str]:
    """Versions `rm` must keep: each deployment's current and previous release."""
    kept: dict[tuple[str, str], str] = {}
    for name in deployments(store):
        stack = release_stack(load_state(store, name)["history"])
        for ref, role in zip(reversed(stack), ("current", "previous")):
            kept.setdefault(ref, f"the {role} release of deployment {name}")
    return kept


def current_checkpoint(store: Store, deployment: str = DEFAULT_DEPLOYMENT) -> tuple[Manifest, Path]:
    """What `dlm serve --deployment NAME` should load."""
    current = load_state(store, deployment)["current"]
    if current is None:
        raise UsageError(f"deployment {deployment!r} has no release; run `dlm release MODEL@VERSION`")
    manifest = store.manifest(current["model"], current["version"])
    return manifest, store.files_dir(manifest.name, manifest.version)


@dataclass
class Outcome:
    deployment: str
    action: str
    event: dict[str, Any]
    current: dict[str, Any] | None
    changed: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "deployment": self.deployment,
            "action": self.action,
            "changed": self.changed,
            "current": self.current,
            "event": self.event,
        }


def _usable(store: Store, manifest: Manifest) -> None:
    """A release needs a verified version whose files are all still there at their size."""
    ref = f"{manifest.name}@{manifest.version}"
    if not manifest.verified:
        raise DlmError(f"{ref} is {manifest.state}; run `dlm verify {ref}` first")
    root = store.files_dir(manifest.name, manifest.version)
    for entry in manifest.files:
        path = root / entry.path
        if not path.is_file() or path.stat().st_size != entry.size:
            raise DlmError(
                f"{ref}: {entry.path} is missing or changed size since it was verified; run `dlm verify {ref}`"
            )


def _switch(store: Store, deployment: str, action: str, manifest: Manifest, state: dict[str, Any]) -> Outcome:
    """Hot-swap a running server (if any), then record the event and, on success, the new
    current version, in one atomic write."""
    previous = state["current"]
    target = {"model": manifest.name, "version": manifest.version}
    if previous and {"model": previous["model"], "version": previous["version"]} == target:
        return Outcome(deployment, action, {}, previous, changed=False)
    event: dict[str, Any] = {
        "action": action,
        **target,
        "from": previous and {"model": previous["model"], "version": previous["version"]},
        "at": now(),
        "status": "ok",
        "hot_swap": None,
    }
    server = admin.running_server(store, deployment)
    failure: admin.SwapFailed | None = None
    if server is not None:
        try:
            admin.hot_swap(
                server,
                model=manifest.name,
                version=manifest.version,
                path=store.files_dir(manifest.name, manifest.version),
                content_sha256=manifest.content_sha256,
            )
            event["hot_swap"] = {"server_pid": server.pid, "admin_url": server.admin_url}
        except admin.SwapFailed as exc:
            failure = exc
            event.update(status="failed", error=str(exc))
    state["history"].append(event)
    for torn in state_path(store, deployment).parent.glob(f".{deployment}.json.*.tmp"):
        torn.unlink(missing_ok=True)  # left by a writer killed mid-write; we hold the lock
    if failure is None:
        state["current"] = {**target, "since": event["at"], "action": action}
    write_json_atomic(state_path(store, deployment), state)
    if failure is not None:
        prior = f"{previous['model']}@{previous['version']}" if previous else "nothing"
        raise DlmError(f"{action} of {manifest.name}@{manifest.version} failed, still serving {prior}: {failure}")
    return Outcome(deployment, action, event, state["current"], changed=True)


def release(store: Store, spec: str, deployment: str = DEFAULT_DEPLOYMENT) -> Outcome:
    """Make MODEL@VERSION the deployment's current version."""
    if "@" not in spec:
        raise UsageError(f"release needs MODEL@VERSION, got {spec!r}")
    check_name(deployment, "deployment name")
    with locked(store.deployments_dir / f".{deployment}.lock"):
        manifest = store.find(spec)
        _usable(store, manifest)
        return _switch(store, deployment, "release", manifest, load_state(store, deployment))


def rollback(store: Store, deployment: str = DEFAULT_DEPLOYMENT, to: str | None = None) -> Outcome:
    """Return to the previous good release, or to `to` (VERSION of the current model, or
    MODEL@VERSION)."""
    check_name(deployment, "deployment name")
    with locked(store.deployments_dir / f".{deployment}.lock"):
        state = load_state(store, deployment)
        current = state["current"]
        if current is None:
            raise UsageError(f"deployment {deployment!r} has no release to roll back from")
        if to is not None:
            manifest = store.find(to if "@" in to else f"{current['model']}@{to}")
            _usable(store, manifest)
            return _switch(store, deployment, "rollback", manifest, state)
        reasons = []
        for model, version in reversed(release_stack(state["history"])[:-1]):
            try:
                manifest = store.manifest(model, version)
                _usable(store, manifest)
            except DlmError as exc:
                reasons.append(str(exc))
                continue
            return _switch(store, deployment, "rollback", manifest, state)
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        raise DlmError(f"deployment {deployment!r} has no earlier good release to roll back to{detail}")


def remove_versions(store: Store, name: str, version: str | None, keep: int | None) -> tuple[list[str], list[str]]:
    """Delete one version (`version`), or all but the newest `keep`; never the current or
    previous release of any deployment. Returns (removed, kept-because-released)."""
    if (version is None) == (keep is None):
        raise UsageError("give MODEL@VERSION, or MODEL with --keep N")
    protected = protected_versions(store)
    if version is not None:
        manifest = store.find(f"{name}@{version}")
        role = protected.get((manifest.name, manifest.version))
        if role:
            raise DlmError(f"refusing to remove {manifest.name}@{manifest.version}: it is {role}")
        targets = [manifest]
    else:
        if keep is not None and keep < 0:
            raise UsageError("--keep must be >= 0")
        manifests = store.manifests(name)
        if not manifests:
            raise UsageError(f"no model named {name!r} in the store at {store.root}")
        targets = manifests[: max(0, len(manifests) - (keep or 0))]
    removed, kept = [], []
    for manifest in targets:
        ref = f"{manifest.name}@{manifest.version}"
        if (manifest.name, manifest.version) in protected:
            kept.append(ref)
            continue
        store.remove(manifest.name, manifest.version)
        removed.append(ref)
    return removed, kept
