"""Releases and rollbacks: verified versions only, stack semantics, rm protection, the
admin hot-swap contract, and crash safety under SIGKILL."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dlm.cli.store import admin
from dlm.cli.store.fetch import fetch
from dlm.cli.store.releases import Outcome, current_checkpoint, load_state, release, remove_versions, rollback
from dlm.cli.store.resolve import resolve_model
from dlm.cli.store.store import Store
from dlm.engine.errors import DlmError, UsageError
from tests.weights_helpers import ROOT, cli, make_checkpoints, mount_read_only


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_checkpoints(tmp_path_factory.mktemp("rel"))


@pytest.fixture
def stocked(sources: list[Path], tmp_path: Path) -> tuple[Store, list[str]]:
    """A store with three verified versions of model `m`; returns (store, their versions)."""
    store = Store(tmp_path / "store")
    return store, [fetch(str(s), store, name="m").manifest.version for s in sources]


def _current(store: Store, deployment: str = "default") -> str | None:
    current = load_state(store, deployment).current
    return current and current.version


def _version(outcome: Outcome) -> str | None:
    return outcome.current.version if outcome.current else None


def test_release_and_rollback_walk_back_the_stack(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, v2, v3) = stocked
    for v in (v1, v2, v3):
        assert release(store, f"m@{v}").changed
    assert _current(store) == v3
    assert _version(rollback(store)) == v2
    assert _version(rollback(store)) == v1  # not back to v3
    with pytest.raises(DlmError, match="no earlier good release"):
        rollback(store)
    assert _version(rollback(store, to=v3[:6])) == v3  # --to: a version of the current model
    assert not release(store, f"m@{v3}").changed  # already current: nothing recorded
    history = load_state(store, "default").history
    assert [(e.action, e.version) for e in history] == [
        ("release", v1),
        ("release", v2),
        ("release", v3),
        ("rollback", v2),
        ("rollback", v1),
        ("rollback", v3),
    ]
    manifest, path = current_checkpoint(store)
    assert manifest.version == v3 and (path / "config.json").is_file()


def test_a_rollback_past_a_damaged_release_names_it(stocked: tuple[Store, list[str]]) -> None:
    """Releases v1, v2, v3, then v2's weights truncated: the rollback lands on v1 and says it
    passed over v2 and why (it said nothing: the operator learnt only that v1 was serving)."""
    store, (v1, v2, v3) = stocked
    for v in (v1, v2, v3):
        release(store, f"m@{v}")
    shard = store.files_dir("m", v2) / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    code, stdout, stderr = cli("rollback", "--store", str(store.root), "--json")
    assert code == 0, stderr
    answer = json.loads(stdout)
    assert answer["current"]["version"] == v1
    (reason,) = answer["skipped"]
    assert f"m@{v2}" in reason and "changed size since it was verified" in reason
    assert f"skipped: m@{v2}" in stderr
    assert json.loads(cli("rollback", "--store", str(store.root), "--to", v3, "--json")[1])["skipped"] == []


def test_deployments_are_independent_and_cli_contract(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, v2, _) = stocked
    root = str(store.root)
    code, stdout, stderr = cli("release", f"m@{v1}", "--deployment", "canary", "--store", root, "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["current"]["version"] == v1
    assert cli("release", f"m@{v2}", "-d", "canary", "--store", root)[0] == 0
    assert _current(store, "default") is None
    code, stdout, _ = cli("rollback", "-d", "canary", "--store", root, "--json")
    assert code == 0 and json.loads(stdout)["event"]["action"] == "rollback"
    code, stdout, _ = cli("models", "--store", root, "--json")
    listing = json.loads(stdout)
    assert [d["deployment"] for d in listing["deployments"]] == ["canary"]
    roles = {v["version"]: v["release_role"] for v in listing["models"][0]["versions"]}
    assert roles[v1] == "the current release of deployment canary"
    code, _, stderr = cli("rollback", "--store", root)
    assert code == 2 and "no release to roll back from" in stderr
    # A bare name releases its newest verified version and says which (issue 19).
    newest = store.find("m").version
    code, stdout, stderr = cli("release", "m", "--store", root, "--json")
    assert code == 0 and json.loads(stdout)["current"]["version"] == newest
    assert f"m resolves to m@{newest}, its newest verified version" in stderr


def test_release_requires_a_verified_intact_version(stocked: tuple[Store, list[str]], sources: list[Path]) -> None:
    store, (v1, v2, _) = stocked
    broken = fetch(str(sources[0]), store, name="cfg", include=["*.json"])  # no weights: failed
    with pytest.raises(
        DlmError,
        match=(
            r"failed verification \(\.: no \*\.safetensors weights\): fetching it again repairs it in place "
            r"\(`dlm fetch \S+ --include '\*\.json' --name cfg`\)"
        ),
    ):
        release(store, f"cfg@{broken.manifest.version}")
    shard = store.files_dir("m", v2) / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    code, _, stderr = cli("release", f"m@{v2}", "--store", str(store.root))
    assert code == 1 and "changed size since it was verified" in stderr
    assert _current(store) is None


def test_models_lists_a_version_damaged_since_its_verification(
    stocked: tuple[Store, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlm models` stats each file against its manifest (the size check `release` makes): a
    truncated or deleted file shows the version as damaged, not as its last record says."""
    store, (v1, v2, v3) = stocked
    root = str(store.root)
    (store.files_dir("m", v2) / "model.safetensors").write_bytes(b"\0" * 1000)
    (store.files_dir("m", v3) / "config.json").unlink()
    code, stdout, _ = cli("models", "--json", "--store", root)
    versions = {v["version"]: v for v in json.loads(stdout)["models"][0]["versions"]}
    assert code == 0 and versions[v1]["state"] == "verified" and "reason" not in versions[v1]
    for version, file in ((v2, "model.safetensors"), (v3, "config.json")):
        assert versions[version]["state"] == "damaged"
        reason = versions[version]["reason"]
        assert reason.startswith(
            f"m@{version}: {file} is missing or changed size since it was verified: `dlm verify m@{version}`"
        )
        assert "--name m` repairs it" in reason and f"`dlm rm m@{version}`" in reason
    code, stdout, _ = cli("models", "--store", root)
    row = next(line for line in stdout.splitlines() if f"m@{v2}" in line)
    assert code == 0 and row.split("│")[2].strip() == "damaged"  # the state column
    code, _, stderr = cli("release", f"m@{v2}", "--store", root)  # the same check, the same finding
    assert code == 1 and "model.safetensors is missing or changed size since it was verified" in stderr
    # and loading it (MODEL as a store name): refused with the finding and its fixes; it failed in
    # the loader (a truncated safetensors header), naming no fix
    monkeypatch.setenv("DLM_STORE", root)
    with pytest.raises(DlmError, match=f"m@{v2}: model.safetensors is missing or changed size .* repairs it"):
        resolve_model(f"m@{v2}")


def test_models_lists_a_read_only_store(stocked: tuple[Store, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A store on a read-only mount (or another user's) is listed as it stands: `dlm models`
    failed with `error: Read-only file system: <store>/.lock` (the settling transaction's
    lock, and then the probe of whether a download is running), though such a store is
    resolved as MODEL (without a lease)."""
    store, (v1, _, _) = stocked
    release(store, f"m@{v1}")
    download = store.model_dir("m") / ".staging" / "hub-0123456789ab" / "files"
    download.mkdir(parents=True)
    (download / "config.json").write_text("{}")
    mount_read_only(monkeypatch, store.root)
    code, stdout, stderr = cli("models", "--json", "--store", str(store.root))
    assert code == 0, stderr
    listing = json.loads(stdout)
    assert [v["state"] for v in listing["models"][0]["versions"]] == ["verified"] * 3
    assert listing["deployments"][0]["current"]["version"] == v1
    assert [(f["version"], f["running"]) for f in listing["incomplete"]] == [("0123456789ab", False)]
    code, stdout, stderr = cli("models", "--store", str(store.root))
    assert code == 0 and f"m@{v1}" in stdout, stderr


def test_rm_keeps_current_and_previous(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, v2, v3) = stocked
    release(store, f"m@{v1}")
    release(store, f"m@{v2}")
    for v, role in ((v2, "current"), (v1, "previous")):
        code, _, stderr = cli("rm", f"m@{v}", "--store", str(store.root))
        assert code == 1 and f"the {role} release of deployment default" in stderr
    removed, kept = remove_versions(store, "m", None, keep=0)
    assert removed == [f"m@{v3}"] and sorted(kept) == sorted([f"m@{v1}", f"m@{v2}"])
    assert [m.version for m in store.manifests("m")] == [v1, v2]
    with pytest.raises(UsageError):
        remove_versions(store, "m", None, None)


class FakeAdmin:
    """The server side of the admin contract (dlm/cli/store/admin.py), as a test double."""

    def __init__(self, status: int = 200, message: str = "") -> None:
        self.calls: list[tuple[str, dict, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append((self.path, dict(self.headers), body))
                if status == 200:
                    payload = {"status": "ok", "model": body["model"], "version": body["version"]}
                else:
                    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_release_hot_swaps_a_registered_server(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, v2, _) = stocked
    release(store, f"m@{v1}")
    fake = FakeAdmin()
    try:
        record = admin.register_server(store, "default", fake.url, "admin-key-1")
        assert oct(record.stat().st_mode & 0o777) == "0o600"
        outcome = release(store, f"m@{v2}")
        path, headers, body = fake.calls[0]
        assert path == "/admin/swap" and headers["Authorization"] == "Bearer admin-key-1"
        assert body["model"] == "m" and body["version"] == v2
        assert body["path"] == str(store.files_dir("m", v2))
        assert body["content_sha256"] == store.manifest("m", v2).content_sha256
        assert outcome.event is not None and outcome.event.hot_swap is not None
        assert outcome.event.hot_swap.admin_url == fake.url and _current(store) == v2
        rollback(store)
        assert fake.calls[-1][2]["version"] == v1 and _current(store) == v1
    finally:
        admin.unregister_server(store, "default")
        fake.close()
    assert not admin.record_path(store, "default").exists()


def test_failed_swap_keeps_the_old_version_and_is_recorded(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, v2, v3) = stocked
    release(store, f"m@{v1}")
    release(store, f"m@{v2}")
    fake = FakeAdmin(status=503, message="warm-up failed: out of memory")
    try:
        admin.register_server(store, "default", fake.url, "k")
        code, _, stderr = cli("release", f"m@{v3}", "--store", str(store.root))
        assert code == 1 and "still serving m@" in stderr and "out of memory" in stderr
    finally:
        admin.unregister_server(store, "default")
        fake.close()
    state = load_state(store, "default")
    assert state.current is not None and state.current.version == v2
    assert state.history[-1].status == "failed" and "out of memory" in str(state.history[-1].error)
    assert _version(rollback(store)) == v1  # the failed release is not on the stack


@pytest.mark.slow
def test_dead_or_remote_servers_are_not_called(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, _, _) = stocked
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    admin_record = admin.record_path(store, "default")
    admin_record.parent.mkdir(parents=True, exist_ok=True)
    admin_record.write_text(
        json.dumps(
            {
                "deployment": "default",
                "pid": dead.pid,
                "admin_url": "http://127.0.0.1:9",
                "admin_key": "k",
                "started_at": "x",
            }
        )
    )
    assert admin.running_server(store, "default") is None
    outcome = release(store, f"m@{v1}")
    assert outcome.event is not None and outcome.event.hot_swap is None
    with pytest.raises(DlmError, match="not on 127.0.0.1"):
        admin.register_server(store, "default", "http://10.0.0.5:8001", "k")


def _assert_consistent(store: Store, allowed: set[str | None]) -> None:
    state = load_state(store, "default")  # parses: never torn
    assert _current(store) in allowed
    if state.current is not None:
        assert state.history[-1].version == state.current.version or state.history[-1].status == "failed"


@pytest.mark.slow
def test_release_killed_at_any_point_leaves_old_or_new(stocked: tuple[Store, list[str]]) -> None:
    store, (v1, v2, _) = stocked
    release(store, f"m@{v1}")
    # The CLI, killed at several points from start-up to completion.
    for delay in (0.05, 0.15, 0.25, 0.35, 0.45, 0.6, 0.8):
        target = v2 if _current(store) == v1 else v1
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlm", "release", f"m@{target}", "--store", str(store.root)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _assert_consistent(store, {v1, v2})
    # A process switching back and forth as fast as it can, killed at random instants.
    loop = (
        "import sys; from dlm.cli.store.store import Store; from dlm.cli.store.releases import release\n"
        "s = Store(sys.argv[1]); vs = sys.argv[2:]\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    for v in vs: release(s, 'm@' + v)\n"
    )
    rng = random.Random(0)
    for _ in range(8):
        proc = subprocess.Popen(
            [sys.executable, "-c", loop, str(store.root), v1, v2],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _assert_consistent(store, {v1, v2})
    assert len(load_state(store, "default").history) > 10  # the loop really released
    _, _, v3 = stocked[1]
    assert release(store, f"m@{v3}").changed  # no stale lock; torn temporaries cleared
    assert not [p.name for p in store.deployments_dir.iterdir() if p.name.endswith(".tmp")]


def test_keep_never_keeps_a_failed_version_in_place_of_a_usable_one(tmp_path: Path) -> None:
    """`dlm rm k --keep 1` over a verified v1 and a newer v2 that failed removed v1, the only
    copy that could be served."""
    from dlm.cli.store.fetch import fetch
    from dlm.cli.store.releases import remove_versions
    from dlm.cli.store.store import Store
    from tests.weights_helpers import cli, make_checkpoints

    store = Store(tmp_path / "store")
    good, bad = (fetch(str(s), store, name="k").manifest for s in make_checkpoints(tmp_path / "src", 2))
    shard = next(store.files_dir("k", bad.version).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4])
    assert cli("verify", f"k@{bad.version}", "--store", str(store.root))[0] == 1
    removed, _ = remove_versions(store, "k", None, 1)
    assert removed == [f"k@{bad.version}"]
    assert [m.version for m in store.versions("k")[0]] == [good.version]


def test_keep_never_keeps_a_damaged_version_in_place_of_a_usable_one(tmp_path: Path) -> None:
    """As a failed one: `dlm rm k --keep 1` over a verified v1 and a newer v2 damaged since its
    verification (a shard truncated: listed `damaged`, refused by release and every load, its
    record still `verified`) removed v1, the only copy that could be served, and kept v2."""
    store = Store(tmp_path / "store")
    good, damaged = (fetch(str(s), store, name="k").manifest for s in make_checkpoints(tmp_path / "src", 2))
    shard = next(store.files_dir("k", damaged.version).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4])
    code, stdout, stderr = cli("rm", "k", "--keep", "1", "--store", str(store.root), "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["removed"] == [f"k@{damaged.version}"]
    assert [m.version for m in store.versions("k")[0]] == [good.version]
