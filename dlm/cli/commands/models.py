"""`dlm models` (what the store holds) and `dlm rm` (prune versions)."""

from __future__ import annotations

from typing import Any

import typer

from dlm.cli.output import cli_errors, emit_json, err_console, listing_console
from dlm.cli.store_ui import JSON_OPTION, STORE_OPTION, human_size, open_store


def _source(source: dict[str, Any] | None) -> str:
    if source is None:
        return ""
    if source.get("kind") == "hub":
        return f"{source['repo_id']}@{source['revision']}"
    return str(source.get("path"))


def _settled_listing(store: Any) -> dict[str, Any]:
    """The listing, with interrupted swaps settled first, unless another store command is
    running, or the store cannot be written (a read-only mount, another user's: its lock
    cannot be taken, and nothing could be settled): then as it stands (a swap in progress
    shows as the deployment's `pending`)."""
    from dlm.cli.store.atomic import Busy, unwritable
    from dlm.cli.store.releases import transaction

    if not store.root.exists():  # nothing to list, and a listing creates no store (nor its lock)
        return _listing(store)
    try:
        with transaction(store, blocking=False):
            return _listing(store)
    except Busy:
        return _listing(store)
    except OSError as exc:
        if not unwritable(exc):
            raise
        return _listing(store)


def _state(store: Any, manifest: Any) -> tuple[str, str | None]:
    """A version's state as listed, and why it cannot be used (None when it can): `failed`
    with its last verification's findings, or `damaged` when a file is missing or of another
    size than its manifest records (`Store.size_damage`), whatever its last verification said."""
    if manifest.state == "failed":
        return "failed", manifest.problems()
    damage = store.size_damage(manifest)
    return ("damaged", damage) if damage is not None else (manifest.state, None)


def _listing(store: Any) -> dict[str, Any]:
    """Every version and deployment; a corrupt record is listed as such, with the reason."""
    from dlm.cli.store.releases import protected_versions, readable_states

    roles = protected_versions(store)
    models = []
    for name in store.models():
        manifests, corrupt = store.versions(name)
        listed = [(m, *_state(store, m)) for m in manifests]
        versions = [
            {
                "version": m.version,
                "ref": m.ref,
                "state": state,
                "total_size": m.total_size,
                "files": len(m.files),
                "fetched_at": m.fetched_at,
                "verified_at": m.verification.at if m.verification else None,
                "source": m.source.to_json(),
                "release_role": roles.get((name, m.version)),
                **({"reason": reason} if reason is not None else {}),
            }
            for m, state, reason in listed
        ]
        versions += [
            {
                "version": c.version,
                "ref": c.ref,
                "state": c.state,
                "reason": c.reason,
                "total_size": None,
                "files": None,
                "fetched_at": None,
                "verified_at": None,
                "source": None,
                "release_role": roles.get((name, c.version)),
            }
            for c in corrupt
        ]
        models.append({"name": name, "versions": versions})
    states, broken = readable_states(store)
    deployments = [state.to_json() for state in states]
    deployments += [
        {"deployment": name, "state": "corrupt", "reason": reason, "current": None, "history": []}
        for name, reason in broken.items()
    ]
    return {
        "store": str(store.root),
        "models": models,
        "deployments": sorted(deployments, key=lambda d: d["deployment"]),
        # Hub downloads not (yet) published: never a version, listed apart with how to resume them.
        "incomplete": [f.to_json() for name in store.model_directories() for f in store.incomplete_fetches(name)],
    }


def models(store: str | None = STORE_OPTION, json_out: bool = JSON_OPTION) -> None:
    """List the store on stdout: names, versions, sizes, verification state, and release history."""
    with cli_errors():
        listing = _settled_listing(open_store(store))
        if json_out:
            emit_json(listing)
            return
        from rich.markup import escape
        from rich.table import Table

        out = listing_console()

        table = Table(title=f"models in {escape(str(listing['store']))}", title_justify="left")
        table.add_column("model@version", no_wrap=True)  # whole, so it can be copied and grepped
        for column in ("state", "size", "fetched", "source", "release", "problem"):
            table.add_column(column, overflow="fold")
        for model in listing["models"]:
            for v in model["versions"]:
                color = {"verified": "green", "failed": "red", "corrupt": "red", "damaged": "red"}.get(
                    v["state"], "yellow"
                )
                table.add_row(
                    v["ref"],
                    f"[{color}]{v['state']}[/]",
                    human_size(v["total_size"]) if v["total_size"] is not None else "",
                    v["fetched_at"] or "",
                    escape(_source(v["source"])),
                    v["release_role"] or "",
                    escape(v.get("reason", "")),
                )
        out.print(table)
        for fetch in listing["incomplete"]:
            what = f"{fetch['files']} files, {human_size(fetch['size'])} in {fetch['path']}"
            if fetch["running"]:
                todo = "a fetch of it is running"
            else:
                again = f"`{fetch['resume']}`" if fetch["resume"] else "its `dlm fetch` again"
                todo = f"not usable until {again} completes it, or delete that directory"
            out.print(f"incomplete fetch {fetch['ref']}: [yellow]{escape(what)}[/]; {escape(todo)}", highlight=False)
        for state in listing["deployments"]:
            if state.get("state") == "corrupt":
                out.print(f"deployment {state['deployment']}: [red]corrupt[/] ({escape(state['reason'])})")
                continue
            history = Table(title=f"deployment {state['deployment']}", title_justify="left")
            for column in ("at", "action", "model@version", "status", "detail"):
                history.add_column(column, overflow="fold", no_wrap=column == "model@version")
            for event in state["history"]:
                history.add_row(
                    event["at"],
                    event["action"],
                    f"{event['model']}@{event['version']}",
                    event["status"],
                    escape(event.get("error") or ""),
                )
            pending = state.get("pending")
            if pending:
                history.add_row(
                    pending["at"], pending["action"], f"{pending['model']}@{pending['version']}", "swapping"
                )
            out.print(history)


def rm(
    model: str = typer.Argument(..., help="NAME@VERSION to delete, or NAME with --keep N."),
    keep: int | None = typer.Option(
        None, "--keep", help="Keep only the newest N versions of NAME.", show_default="none: delete NAME@VERSION"
    ),
    store: str | None = STORE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Delete store versions; never one a release or a running process holds."""
    with cli_errors():
        from dlm.cli.store.releases import remove_versions
        from dlm.cli.store.store import split_ref

        name, version = split_ref(model)
        removed, kept = remove_versions(open_store(store), name, version, keep)
        if json_out:
            # `kept`: why each was kept (what stderr says), beside the list scripts already read
            emit_json({"removed": removed, "kept_released": list(kept), "kept": dict(kept)})
        for ref in removed:
            err_console.print(f"removed {ref}", highlight=False)
        for ref, role in kept.items():
            err_console.print(f"kept {ref} (it is {role})", highlight=False)
