"""Deployments: which store version each one serves, and the history of how it got there.

One JSON file per deployment (`<store>/deployments/NAME.json`) holds `current`, the
append-only `history`, and, while a hot swap is under way, `pending`: the swap journal. It is
replaced atomically, so a release or rollback killed at any instant leaves the old state or
the new one, never neither.

Locking: every change to the store (publishing a version, recording a verification, `rm`,
release, rollback, a server registering) runs in `transaction`: under the one store-wide
lock, taken before anything it protects is read. `rm` therefore sees the releases as they are
when it deletes, never as they were before a concurrent release.

The swap journal: before asking a running server to switch, a release writes `pending`
(an intent id, the target, the server's pid). The server acts only on a request whose intent
matches the journal, and notes in its own record (dlm/cli/store/admin.py) what it is loading
and then what it serves. The release clears `pending` as it records the outcome. If the
release dies first, the next transaction (any store command, or a server starting) settles
it from the server's record: the release counts as done if and only if the server switched.

Rollback semantics: successful events form a stack. A release pushes its version; a rollback
to a version on the stack pops back to it. So after releasing v1, v2, v3, two rollbacks
return to v2 and then v1 (not back and forth between v2 and v3).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dlm.cli import interrupts
from dlm.cli.store import admin, leases
from dlm.cli.store.atomic import write_json_atomic
from dlm.cli.store.records import (
    Action,
    CorruptRecord,
    Current,
    DeploymentState,
    Event,
    HotSwap,
    Manifest,
    Pending,
    Ref,
    read_record,
)
from dlm.cli.store.resolve import check_config
from dlm.cli.store.store import MANIFEST, NAME_RE, CorruptVersion, Store, check_name, now
from dlm.engine.errors import DlmError, UsageError

DEFAULT_DEPLOYMENT = "default"
SETTLE_POLL_S = 0.1


def state_path(store: Store, deployment: str) -> Path:
    return store.deployments_dir / f"{check_name(deployment, 'deployment name')}.json"


CORRUPT_STATE_FIX = " (restore it, or delete it to start the deployment afresh)"


def load_state(store: Store, deployment: str) -> DeploymentState:
    """The deployment's record (an empty one if it has none); CorruptRecord (exit 1) when
    its file cannot be read: a release or rollback of that deployment refuses to overwrite
    it, and every other command passes over it (`readable_states`)."""
    path = state_path(store, deployment)
    try:
        state = read_record(path, DeploymentState)
    except FileNotFoundError:
        return DeploymentState(deployment=deployment, current=None, history=[])
    except CorruptRecord as exc:
        raise CorruptRecord(path, f"{exc.reason}{CORRUPT_STATE_FIX}") from None
    if state.deployment != deployment:
        raise CorruptRecord(path, f"it is the record of deployment {state.deployment!r}")
    return state


def readable_states(store: Store) -> tuple[list[DeploymentState], dict[str, str]]:
    """Every deployment's record, and {deployment: why} for those that cannot be read."""
    states, corrupt = [], {}
    for deployment in deployments(store):
        try:
            states.append(load_state(store, deployment))
        except CorruptRecord as exc:
            corrupt[deployment] = exc.reason
    return states, corrupt


def _save(store: Store, deployment: str, state: DeploymentState) -> None:
    write_json_atomic(state_path(store, deployment), state.to_json())


def deployments(store: Store) -> list[str]:
    if not store.deployments_dir.is_dir():
        return []
    return sorted(p.stem for p in store.deployments_dir.glob("*.json") if NAME_RE.match(p.stem))


@contextmanager
def transaction(store: Store, blocking: bool = True) -> Iterator[None]:
    """Hold the store-wide lock, with interrupted hot swaps settled and the temporaries of
    killed writers cleared (no other writer can be running). `blocking=False` raises
    `atomic.Busy` at once when another command holds the lock."""
    with store.lock(blocking):
        interrupts.check()  # a Ctrl-C that a library swallowed: the store takes no change after it
        if store.deployments_dir.is_dir():
            for torn in store.deployments_dir.glob(".*.tmp"):
                torn.unlink(missing_ok=True)
        for name in store.model_directories():  # a fetch's leftovers too, with no version yet
            store.clear_leftovers(name)
        leases.clear_stale(store)  # the leases of processes that died
        for state in readable_states(store)[0]:
            if state.pending is not None:
                _settle(store, state.deployment)
        yield


def _settle(store: Store, deployment: str) -> None:
    """Resolve the journal entry of a release that died during its hot swap: wait while the
    server is still switching (up to the swap timeout), then record what the server did."""
    deadline = time.monotonic() + admin.SWAP_TIMEOUT_S
    while True:
        with admin.record_lock(store, deployment):
            state = load_state(store, deployment)
            pending = state.pending
            if pending is None:
                return
            record = admin.read_record(store, deployment)
            server = record if record is not None and record.pid == pending.server_pid else None
            switching = server is not None and admin.alive(server.pid) and server.swap_intent == pending.id
            if not switching or time.monotonic() > deadline:
                applied = server is not None and server.serving == pending.ref
                settled = now()
                error = None
                if not applied:
                    still = server.serving if server is not None and server.serving else "its previous version"
                    error = f"the {pending.action} ended before its server switched; it kept {still}"
                state.history.append(
                    Event(
                        action=pending.action,
                        model=pending.model,
                        version=pending.version,
                        from_=pending.from_,
                        at=pending.at,
                        status="ok" if applied else "failed",
                        hot_swap=HotSwap(server_pid=pending.server_pid, admin_url=pending.admin_url),
                        error=error,
                        settled_at=settled,
                    )
                )
                if applied:
                    state.current = Current(
                        model=pending.model, version=pending.version, since=settled, action=pending.action
                    )
                state.pending = None
                _save(store, deployment, state)
                return
        time.sleep(SETTLE_POLL_S)


def release_stack(history: list[Event]) -> list[tuple[str, str]]:
    """(model, version) of the successful releases still in force, oldest first."""
    stack: list[tuple[str, str]] = []
    for event in history:
        if event.status != "ok":
            continue
        ref = (event.model, event.version)
        if event.action == "rollback" and ref in stack:
            while stack[-1] != ref:
                stack.pop()
        else:
            stack.append(ref)
    return stack


def protected_versions(store: Store) -> dict[tuple[str, str], str]:
    """Versions `rm` must keep, with the reason: each deployment's current and previous
    release, both ends of a swap in progress, whatever a live server serves or loads, and
    every version a live process leased as it loaded it (dlm/cli/store/leases.py: a plain
    `dlm serve NAME@VERSION`, `dlm generate`, `dlm batch`). A deployment whose record is
    corrupt names nothing here (what it holds cannot be known): `rm` refuses to run beside
    it (`_releases_knowable`)."""
    kept: dict[tuple[str, str], str] = {}
    for state in readable_states(store)[0]:
        name = state.deployment
        stack = release_stack(state.history)
        for ref, role in zip(reversed(stack), ("current", "previous")):
            kept.setdefault(ref, f"the {role} release of deployment {name}")
        if state.pending is not None:
            kept.setdefault((state.pending.model, state.pending.version), f"being swapped in by deployment {name}")
    for record in admin.server_records(store):
        for served in (record.serving, record.swapping):
            if served:
                model, _, version = served.partition("@")
                kept.setdefault((model, version), f"served by the server of deployment {record.deployment}")
    for path, lease in leases.live_leases(store):
        kept.setdefault((lease.model, lease.version), leases.holder(path, lease))
    return kept


def current_checkpoint(store: Store, deployment: str = DEFAULT_DEPLOYMENT) -> tuple[Manifest, Path]:
    """What `dlm serve --deployment NAME` should load."""
    store.require()
    current = load_state(store, deployment).current
    if current is None:
        raise UsageError(f"deployment {deployment!r} has no release; run `dlm release MODEL@VERSION`")
    manifest = store.manifest(current.model, current.version)
    # Damaged since it was released: its last verification failed, or a file has gone or
    # changed size since (a truncated shard failed in the loader once the server had started).
    if (failure := manifest.failure() or store.size_damage(manifest)) is not None:
        raise DlmError(
            f"the current release of deployment {deployment!r}, {failure}; or `dlm rollback -d {deployment}`"
        )
    directory = store.files_dir(manifest.name, manifest.version)
    check_config(manifest, directory)  # as every store name is resolved: the file read first
    return manifest, directory


# -- the server's side ---------------------------------------------------------------------
def register(store: Store, deployment: str, admin_url: str, admin_key: str) -> tuple[Manifest, Path]:
    """A server of `deployment` starts: in one transaction, settle what an earlier server
    left pending, read the current release and register as serving it. Returns what to load;
    a release from now on hot-swaps this server (once it has loaded)."""
    with transaction(store):
        manifest, path = current_checkpoint(store, deployment)
        admin.register_server(store, deployment, admin_url, admin_key, serving=f"{manifest.name}@{manifest.version}")
    return manifest, path


def claim_swap(store: Store, deployment: str, intent: str | None, target: str, serving: str | None) -> None:
    """The server accepts a swap only for the release pending in the journal, and notes
    that it is switching before it loads anything."""
    with admin.record_lock(store, deployment):
        pending = load_state(store, deployment).pending
        if intent is None or pending is None or pending.id != intent or pending.ref != target:
            raise UsageError(
                f"no release of {target} is pending for deployment {deployment}: swaps go through `dlm release`"
            )
        admin.note_serving(store, deployment, serving=serving, swapping=target, intent=intent)


def swap_ended(store: Store, deployment: str, serving: str | None) -> None:
    """The server finished (or gave up) a swap: record what it serves now."""
    with admin.record_lock(store, deployment):
        admin.note_serving(store, deployment, serving=serving, swapping=None, intent=None)


# -- releases and rollbacks ----------------------------------------------------------------
@dataclass
class Outcome:
    deployment: str
    action: str
    event: Event | None  # None: nothing changed
    current: Current | None
    # a rollback's earlier releases passed over, newest first: each one's reason (removed, failed, damaged)
    skipped: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.event is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "deployment": self.deployment,
            "action": self.action,
            "changed": self.changed,
            "current": self.current.to_json() if self.current else None,
            "event": self.event.to_json() if self.event else {},
            "skipped": self.skipped,
        }


def _usable(store: Store, manifest: Manifest) -> None:
    """A release needs a verified version whose files are all still there at their size."""
    ref = manifest.ref
    if (failure := manifest.failure()) is not None:
        raise DlmError(failure)
    if not manifest.verified:
        raise DlmError(f"{ref} is {manifest.state}; run `dlm verify {ref}` first")
    if (damage := store.size_damage(manifest)) is not None:
        raise DlmError(damage)
    check_config(
        manifest, store.files_dir(manifest.name, manifest.version)
    )  # the file every load reads first, by its sha256 (it is small)


def _switch(store: Store, deployment: str, action: Action, manifest: Manifest, state: DeploymentState) -> Outcome:
    """Hot-swap a running server (if any, through the journal), then record the event and,
    on success, the new current version, in one atomic write (inside a transaction)."""
    previous = state.current
    if previous is not None and previous.ref == manifest.ref:
        return Outcome(deployment, action, None, previous)
    event = Event(
        action=action,
        model=manifest.name,
        version=manifest.version,
        from_=previous and Ref(model=previous.model, version=previous.version),
        at=now(),
        status="ok",
        hot_swap=None,
    )
    server = admin.running_server(store, deployment)
    failure: admin.SwapFailed | None = None
    if server is not None:
        intent = secrets.token_hex(8)
        state.pending = Pending(
            id=intent,
            action=action,
            model=event.model,
            version=event.version,
            from_=event.from_,
            at=event.at,
            server_pid=server.pid,
            admin_url=server.admin_url,
        )
        _save(store, deployment, state)  # the intent is on disk before the server hears of it
        try:
            admin.hot_swap(
                server,
                model=manifest.name,
                version=manifest.version,
                path=store.files_dir(manifest.name, manifest.version),
                content_sha256=manifest.content_sha256,
                intent=intent,
            )
            event.hot_swap = HotSwap(server_pid=server.pid, admin_url=server.admin_url)
        except admin.SwapFailed as exc:
            failure = exc
            event.status, event.error = "failed", str(exc)
        state.pending = None
    state.history.append(event)
    if failure is None:
        state.current = Current(model=manifest.name, version=manifest.version, since=event.at, action=action)
    _save(store, deployment, state)
    if failure is not None:
        prior = previous.ref if previous else "nothing"
        raise DlmError(f"{action} of {manifest.ref} failed, still serving {prior}: {failure}")
    return Outcome(deployment, action, event, state.current)


def release(store: Store, spec: str, deployment: str = DEFAULT_DEPLOYMENT) -> Outcome:
    """Make MODEL@VERSION (or MODEL: its newest verified version) the deployment's current one."""
    check_name(deployment, "deployment name")
    with transaction(store):
        manifest = store.find(spec)
        _usable(store, manifest)
        return _switch(store, deployment, "release", manifest, load_state(store, deployment))


def rollback(store: Store, deployment: str = DEFAULT_DEPLOYMENT, to: str | None = None) -> Outcome:
    """Return to the previous good release, or to `to` (VERSION of the current model, or
    MODEL@VERSION)."""
    check_name(deployment, "deployment name")
    with transaction(store):
        state = load_state(store, deployment)
        current = state.current
        if current is None:
            raise UsageError(f"deployment {deployment!r} has no release to roll back from")
        if to is not None:
            manifest = store.find(to if "@" in to else f"{current.model}@{to}")
            _usable(store, manifest)
            return _switch(store, deployment, "rollback", manifest, state)
        reasons = []
        for model, version in reversed(release_stack(state.history)[:-1]):
            try:
                manifest = store.manifest(model, version)
                _usable(store, manifest)
            except DlmError as exc:
                reasons.append(str(exc))
                continue
            return replace(_switch(store, deployment, "rollback", manifest, state), skipped=reasons)
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        raise DlmError(f"deployment {deployment!r} has no earlier good release to roll back to{detail}")


def _releases_knowable(store: Store) -> None:
    """Refuse to remove a version while a deployment's record is corrupt: which versions it
    releases cannot be known, and once the record is restored its current release must still
    be there (rm removed it, as protected by nothing, before)."""
    corrupt = readable_states(store)[1]
    if corrupt:
        deployment, why = next(iter(corrupt.items()))
        why = why.removesuffix(CORRUPT_STATE_FIX)  # the fix is said once, below
        raise DlmError(
            f"deployment {deployment}'s record {state_path(store, deployment)} is corrupt ({why}): the versions "
            "it releases cannot be known, so rm removes none until it is restored (or deleted, to start "
            "that deployment afresh)"
        )


def remove_versions(store: Store, name: str, version: str | None, keep: int | None) -> tuple[list[str], dict[str, str]]:
    """Delete one version (`version`, a corrupt one included), or all but the newest `keep`
    readable ones, failed or damaged ones counted last (a corrupt version is removed only by
    naming it); never a version that `protected_versions` names. Returns (removed, {kept
    because protected: what protects it})."""
    if (version is None) == (keep is None):
        raise UsageError("give MODEL@VERSION, or MODEL with --keep N")
    if keep is not None and keep < 0:
        raise UsageError("--keep must be >= 0")
    with transaction(store):
        protected = protected_versions(store)
        targets: list[Manifest | CorruptVersion]
        if version is not None:
            pending = [f for f in store.incomplete_fetches(name) if f.version == version]
            if pending and not (store.version_dir(name, version) / MANIFEST).exists():
                store.discard_incomplete(pending[0])  # a download never published: no release holds it
                return [pending[0].ref], {}
            _releases_knowable(store)
            found = store.lookup(f"{name}@{version}")
            role = protected.get((found.name, found.version))
            if role:
                raise DlmError(f"refusing to remove {found.ref}: it is {role}")
            targets = [found]
        else:
            _releases_knowable(store)
            manifests, corrupt = store.versions(name)
            if not manifests and not corrupt:
                raise UsageError(f"no model named {name!r} in the store at {store.root}")
            # Unusable versions go first, a failed one or one damaged since (a file missing or of
            # another size: `needs_repair`): a version that cannot be served is never kept in place
            # of one that can (`--keep 1` over a good v1 and a failed or damaged v2 removed the good one).
            unusable = [m for m in manifests if store.needs_repair(m)]
            ranked = unusable + [m for m in manifests if m not in unusable]
            targets = list(ranked[: max(0, len(ranked) - (keep or 0))])
        removed, kept = [], {}
        for target in targets:
            role = protected.get((target.name, target.version))
            if role:
                kept[target.ref] = role
                continue
            store.remove(target.name, target.version)
            removed.append(target.ref)
    return removed, kept
