"""Leases (dlm/cli/store/leases.py): a process that resolved a store version keeps it from
`dlm rm` while it runs, a plain `dlm serve NAME@VERSION` included; a dead holder's lease
counts for nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.cli.store import leases
from dlm.cli.store.admin import process_start
from dlm.cli.store.fetch import fetch
from dlm.cli.store.records import Lease, read_record
from dlm.cli.store.releases import protected_versions, remove_versions, transaction
from dlm.cli.store.resolve import resolve_model
from dlm.cli.store.store import Store, now
from dlm.engine.errors import DlmError
from tests.weights_helpers import cli, make_checkpoint, make_checkpoints


@pytest.fixture
def stocked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Store, list[str]]:
    """The default store (DLM_HOME under tmp_path) with two verified versions of model `c`."""
    monkeypatch.setenv("DLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DLM_STORE", raising=False)
    store = Store()
    sources = make_checkpoints(tmp_path / "src", count=2)
    return store, [fetch(str(s), store, name="c").manifest.version for s in sources]


def test_a_resolved_version_is_kept_by_rm_while_its_holder_runs(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, v2) = stocked
    with leases.holding("dlm generate"):
        assert resolve_model(f"c@{v1}") == store.files_dir("c", v1)
        code, _, stderr = cli("rm", f"c@{v1}", "--store", str(store.root))
        assert code == 1 and stderr.count("\n") == 1
        assert stderr.startswith(f"error: refusing to remove c@{v1}: it is loaded by pid ")
        assert "(dlm generate)" in stderr and store.files_dir("c", v1).is_dir()
        code, stdout, stderr = cli("rm", "c", "--keep", "0", "--json", "--store", str(store.root))
        answer = json.loads(stdout)
        assert code == 0 and answer["removed"] == [f"c@{v2}"] and answer["kept_released"] == [f"c@{v1}"]
        assert answer["kept"][f"c@{v1}"].startswith("loaded by pid")  # why, as stderr says
        assert f"kept c@{v1} (it is loaded by pid" in stderr
        listed = json.loads(cli("models", "--json", "--store", str(store.root))[1])["models"][0]["versions"]
        assert listed[0]["release_role"].startswith("loaded by pid ")  # the holder, in the listing too
    assert not list(leases.lease_dir(store).glob("*.json"))  # the command ended: its lease went
    assert remove_versions(store, "c", v1, None) == ([f"c@{v1}"], {})


def _dead_lease(store: Store, version: str) -> tuple[Path, Lease]:
    """The store's lease folder, made, and a lease of c@`version` by a process that has ended."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lease_dir = leases.lease_dir(store)
    lease_dir.mkdir()
    record = Lease(
        model="c", version=version, pid=dead.pid, host=leases.HOST, command="dlm serve", use="served", since=now()
    )
    return lease_dir, record


def test_a_lease_of_a_dead_process_protects_nothing_and_is_cleared(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, _) = stocked
    lease_dir, record = _dead_lease(store, v1)
    dead_pid = record.pid
    (lease_dir / f"{dead_pid}-0.json").write_text(json.dumps(record.to_json()))
    (lease_dir / "1-corrupt.json").write_text("{")  # only a dlm process writes one, atomically: counts as none
    assert protected_versions(store) == {}
    with transaction(store):
        pass
    assert not list(lease_dir.iterdir())
    # The same record with a live pid (this one) protects the version.
    alive = record.model_copy(update={"pid": os.getpid()})
    (lease_dir / "live.json").write_text(json.dumps(alive.to_json()))
    assert protected_versions(store) == {("c", v1): f"served by pid {alive.pid} (dlm serve)"}
    # ... written by this very process (its start time), but not by an earlier one that had this
    # pid (a container restarted in its pod runs its server as pid 1 again): that one is dead
    started = process_start(os.getpid())
    assert started is not None  # Linux: /proc
    (lease_dir / "live.json").write_text(json.dumps(alive.model_copy(update={"started": started}).to_json()))
    assert protected_versions(store) == {("c", v1): f"served by pid {alive.pid} (dlm serve)"}
    (lease_dir / "live.json").write_text(json.dumps(alive.model_copy(update={"started": started - 1}).to_json()))
    assert protected_versions(store) == {}
    foreign = record.model_copy(update={"host": "elsewhere"})  # its pid cannot be checked from here
    (lease_dir / "live.json").write_text(json.dumps(foreign.to_json()))
    with pytest.raises(DlmError, match=f"served by pid {dead_pid} on elsewhere") as refused:
        remove_versions(store, "c", v1, None)
    assert f"if it runs no more, delete {lease_dir / 'live.json'}" in str(refused.value)  # how to clear it


def test_a_version_removed_first_is_not_leased(stocked: tuple[Store, list[str]]) -> None:
    """rm and a starting process decide under the store lock: once rm has won, the
    resolver finds no version (and leases nothing)."""
    store, (v1, _) = stocked
    remove_versions(store, "c", v1, None)
    with leases.holding("dlm serve", "served"), pytest.raises(Exception, match="has no version"):
        resolve_model(f"c@{v1}")
    assert not leases.lease_dir(store).exists() or not list(leases.lease_dir(store).glob("*.json"))


@pytest.mark.slow
def test_rm_refuses_the_version_a_plain_server_serves(tmp_path: Path) -> None:
    from tests.serving import ready_server

    home = tmp_path / "home"
    store = Store(home / "store")
    version = fetch(str(make_checkpoint(tmp_path / "src", shards=1)), store, name="c").manifest.version
    env = {**os.environ, "DLM_HOME": str(home), "DLM_STORE": ""}
    rm = [sys.executable, "-m", "dlm", "rm", f"c@{version}"]
    with ready_server([f"c@{version}"], home) as server:
        refused = subprocess.run(rm, capture_output=True, text=True, env=env, timeout=120)
        assert refused.returncode == 1, refused.stderr
        assert f"served by pid {server.proc.pid} (dlm serve)" in refused.stderr
        assert store.files_dir("c", version).is_dir()
        assert server.http.get(server.url + "/health").status_code == 200
    removed = subprocess.run(rm, capture_output=True, text=True, env=env, timeout=120)
    assert removed.returncode == 0, removed.stderr
    assert not store.version_dir("c", version).exists()


def test_a_lease_of_a_killed_process_not_yet_reaped_protects_nothing(stocked: tuple[Store, list[str]]) -> None:
    """A server SIGKILLed under a supervisor that has not reaped it is a zombie: its pid still
    answers kill(pid, 0), but it serves nothing, and rm refused its version until the reaping."""
    store, (v1, _) = stocked
    holder = subprocess.Popen(["sleep", "60"])
    try:
        started = process_start(holder.pid)
        record = Lease(
            model="c", version=v1, pid=holder.pid, host=leases.HOST, command="dlm serve", use="served",
            since=now(), started=started,
        )  # fmt: skip
        leases.lease_dir(store).mkdir()
        (leases.lease_dir(store) / f"{holder.pid}-0.json").write_text(json.dumps(record.to_json()))
        assert protected_versions(store) == {("c", v1): f"served by pid {holder.pid} (dlm serve)"}
        holder.kill()
        while Path(f"/proc/{holder.pid}/stat").read_text().split()[2] != "Z":  # dead, not reaped
            pass
        assert protected_versions(store) == {}
        assert remove_versions(store, "c", v1, None) == ([f"c@{v1}"], {})
    finally:
        holder.kill()
        holder.wait()


def test_resolving_says_it_waits_for_the_store_lock(
    stocked: tuple[Store, list[str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A release holds the store lock for its whole hot swap (minutes): `dlm generate c@V`
    waited on it saying nothing, like a hang."""
    import threading

    from dlm.cli.store import atomic

    store, (v1, _) = stocked
    monkeypatch.setattr(atomic, "WAIT_NOTICE_S", 0.2, raising=False)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.lock():
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    threading.Timer(1.0, release.set).start()
    with leases.holding("dlm generate"):
        assert resolve_model(f"c@{v1}") == store.files_dir("c", v1)
    holder.join()
    assert capsys.readouterr().err == (
        f"note: waiting for the store lock {store.root / '.lock'}: another dlm command is changing the store "
        "(a release holds it for its whole hot swap)\n"
    )
    with store.lock():  # taken at once: no note
        pass
    assert capsys.readouterr().err == ""


def test_a_lease_held_from_another_pid_namespace_protects_its_version(stocked: tuple[Store, list[str]]) -> None:
    """A process in another pid namespace on this host (a container beside the server's in one
    pod, sharing the store) records a pid that means another process here: rm took its lease
    for a dead one and removed the version it loaded. Its lease file stays locked while it runs."""
    store, (v1, _) = stocked
    with leases.holding("dlm serve", "served"):
        resolve_model(f"c@{v1}")
        (path,) = leases.lease_dir(store).glob("*.json")
        lease = read_record(path, Lease)
        path.write_text(json.dumps(lease.model_copy(update={"pid": 1, "started": -1}).to_json()))  # same file
        with pytest.raises(DlmError, match=f"refusing to remove c@{v1}: it is served by pid 1"):
            remove_versions(store, "c", v1, None)
    assert remove_versions(store, "c", v1, None) == ([f"c@{v1}"], {})  # the holder ended


def test_a_stale_lease_this_user_may_not_remove_fails_no_command(
    stocked: tuple[Store, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's lease on a shared store, its process gone: this user cannot delete it,
    and every store transaction (rm, release, fetch) failed with PermissionError. It is left,
    protecting nothing."""
    store, (v1, _) = stocked
    lease_dir, record = _dead_lease(store, v1)
    dead_pid = record.pid
    theirs = lease_dir / f"{dead_pid}-0.json"
    theirs.write_text(json.dumps(record.to_json()))
    unlink = Path.unlink

    def refused(path: Path, missing_ok: bool = False) -> None:
        if path == theirs:
            raise PermissionError(13, "Permission denied", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refused)
    assert remove_versions(store, "c", v1, None) == ([f"c@{v1}"], {})
    assert theirs.exists()


def test_a_directory_where_a_lease_file_would_be_fails_no_command(stocked: tuple[Store, list[str]]) -> None:
    """A directory named like a lease (`.leases/x.json`, planted or left by hand) is no lease
    and protects nothing; clearing it as a stale one was IsADirectoryError in every store
    transaction (rm, release, fetch). It is left: it is not ours to delete with its contents."""
    store, (v1, _) = stocked
    planted = leases.lease_dir(store) / "7-planted.json"
    (planted / "inside").mkdir(parents=True)
    assert remove_versions(store, "c", v1, None) == ([f"c@{v1}"], {})
    assert (planted / "inside").is_dir()
    code, out, err = cli("models", "--json")
    assert code == 0, err


def test_a_server_of_a_bare_name_loads_the_version_it_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dlm serve NAME` (and `dlm batch --model NAME`) checks its settings against NAME's newest
    verified version, then loads MODEL again: a fetch in between made it load the newer one,
    unchecked. The command pins the version it resolved (ServeConfig.pinned), served as NAME."""
    from dlm.cli.server.config import load_config
    from dlm.cli.server.service import Service
    from dlm.cli.store.resolve import resolve_version

    monkeypatch.setenv("DLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DLM_STORE", raising=False)
    store = Store()
    first, second = make_checkpoints(tmp_path / "src", count=2)
    v1 = fetch(str(first), store, name="c").manifest.version
    config = load_config(None, {"model": "c"}, environ={})
    checked, ref = resolve_version(config.model)
    pinned = config.pinned(ref)
    assert (checked, pinned.model, pinned.served_model_name) == (store.files_dir("c", v1), f"c@{v1}", "c")
    v2 = fetch(str(second), store, name="c").manifest.version  # published between the check and the load
    assert resolve_model("c") == store.files_dir("c", v2)
    assert Service(pinned).initial_checkpoint() == (str(store.files_dir("c", v1)), None)
    assert Service(pinned).model_name == Service(config).model_name == "c"
    assert config.pinned(None) is config and resolve_version(str(first)) == (first, None)
