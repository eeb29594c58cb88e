"""`dlm fetch ORG/NAME` through huggingface_hub's real client, against tests/fake_hub.py
(a local HTTP server speaking the hub's file API) reached via HF_ENDPOINT."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dlm.cli.store.fetch import fetch
from dlm.cli.store.store import Store
from dlm.cli.store.verify import verify_model
from dlm.engine.errors import DlmError, UsageError
from tests.fake_hub import FakeHub
from tests.weights_helpers import ROOT, cli, make_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _files(make_checkpoint(tmp_path_factory.mktemp("hubsrc") / "tiny"))


@pytest.fixture
def hub(repo_files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    server = FakeHub("org/tiny", repo_files, commit=COMMIT)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))  # never the user's cache
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield server
    server.close()


def _downloads(hub: FakeHub) -> list[str]:
    return [path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path]


def test_fetch_resolves_commit_and_records_hub_hashes(hub: FakeHub, tmp_path: Path) -> None:
    code, stdout, stderr = cli("fetch", "org/tiny", "--store", str(tmp_path / "store"), "--json")
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["version"] == COMMIT[:12] and out["state"] == "verified"
    assert out["source"]["commit"] == COMMIT and out["source"]["revision"] == "main"
    manifest = Store(tmp_path / "store").manifest("tiny", out["version"])
    for entry in manifest.files:
        data = hub.files[entry.path]
        assert entry.sha256 == hashlib.sha256(data).hexdigest()
        if entry.path.endswith(".safetensors"):
            assert entry.expected == {"sha256": entry.sha256}  # the hub's LFS oid
        else:
            assert entry.expected == {"git_sha1": hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()}
    assert sorted(p.name for p in Path(out["path"]).iterdir()) == sorted(hub.files)  # no .cache left behind
    assert any(path.endswith(f"/resolve/{COMMIT}/config.json") for path in _downloads(hub))  # pinned to the commit


def test_second_fetch_costs_nothing(hub: FakeHub, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    fetch("org/tiny", store)
    hub.requests.clear()
    again = fetch("org/tiny", store)  # a branch: one call to learn its commit, no download
    assert again.already_present and again.bytes_transferred == 0
    assert _downloads(hub) == [] and len(hub.requests) <= 2
    hub.requests.clear()
    pinned = fetch("org/tiny", store, revision=COMMIT)  # a commit: not even that
    assert pinned.already_present and hub.requests == []


def test_token_include_exclude(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret_for_test")
    result = fetch("org/tiny", Store(tmp_path / "store"), exclude=["tokenizer*"])
    assert result.manifest.version.startswith(COMMIT[:12] + "-")  # filtered: a distinct version
    assert not any("tokenizer" in path for path in _downloads(hub))
    auth = [{k.lower(): v for k, v in h.items()}.get("authorization") for _, path, h in hub.requests]
    assert auth and all(a == "Bearer hf_secret_for_test" for a in auth)


def test_corrupt_download_is_refused_then_retried(hub: FakeHub, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    shard = "model-00001-of-00002.safetensors"
    bad = bytearray(hub.files[shard])
    bad[-5] ^= 0xFF
    hub.served[shard] = bytes(bad)
    with pytest.raises(DlmError, match=f"{shard} .*did not match the hub's hash"):
        fetch("org/tiny", store)
    assert store.manifests("tiny") == []
    hub.served[shard] = hub.files[shard]
    hub.requests.clear()
    result = fetch("org/tiny", store)
    assert result.manifest.verified
    assert [p for p in _downloads(hub) if p.endswith(".safetensors")] == [f"/org/tiny/resolve/{COMMIT}/{shard}"]


def test_unknown_revision_and_repo_are_usage_errors(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="revision not found"):
        fetch("org/tiny", Store(tmp_path / "store"), revision="v9")
    code, _, stderr = cli("fetch", "org/other", "--store", str(tmp_path / "store"))
    assert code == 2 and "no such repository" in stderr


@pytest.mark.parametrize("revision", ["", "  "])
def test_an_empty_revision_is_bad_usage_not_main(hub: FakeHub, tmp_path: Path, revision: str) -> None:
    """`--revision "$REV"` with REV unset fetched main, pinning another version than asked."""
    with pytest.raises(UsageError, match="--revision is empty"):
        fetch("org/tiny", Store(tmp_path / "store"), revision=revision)
    assert hub.requests == []  # refused before asking the hub


@pytest.mark.slow
def test_sigkill_mid_download_then_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub (2.x) downloads each file to a process-unique temporary name, so a
    rerun resumes file by file: what was complete is kept, the interrupted file restarts."""
    src = make_checkpoint(tmp_path / "src", shards=1)
    save_file({"a": torch.zeros(1 << 18)}, str(src / "a.safetensors"))
    save_file({"b": torch.ones(1 << 18)}, str(src / "b.safetensors"))
    hub = FakeHub("org/big", _files(src), commit=COMMIT)
    hub.stall = ("b.safetensors", 1 << 19)
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(tmp_path / "hf_cache"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    store = Store(tmp_path / "store")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlm", "fetch", "org/big", "--store", str(store.root), "--workers", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        staged = store.model_dir("big") / ".staging" / f"hub-{COMMIT[:12]}" / "files"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            stalled = any(p.endswith("/b.safetensors") for m, p, _ in hub.requests if m == "GET")
            if stalled and (staged / "a.safetensors").is_file():
                break
            time.sleep(0.01)
        assert (staged / "a.safetensors").is_file() and not (staged / "b.safetensors").exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        hub.release_stall.set()
        assert store.manifests("big") == []  # never usable
        code, stdout, stderr = cli("models", "--store", str(store.root), "--json")
        listing = json.loads(stdout)
        assert code == 0 and listing["models"] == [], stderr  # no model without a version
        [incomplete] = listing["incomplete"]
        assert incomplete["ref"] == f"big@{COMMIT[:12]}" and incomplete["files"] == 1 and not incomplete["running"]
        assert incomplete["resume"] == f"dlm fetch org/big --revision {COMMIT} --name big"
        hub.stall = None
        hub.requests.clear()
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
        result = fetch("org/big", store)
        fetched = sorted(p.rsplit("/", 1)[1] for p in _downloads(hub))
        assert "b.safetensors" in fetched and "a.safetensors" not in fetched  # resumed, not restarted
        assert result.manifest.verified and verify_model(f"big@{result.manifest.version}", store).ok
        assert not staged.exists()
    finally:
        proc.kill()
        hub.close()


@pytest.mark.parametrize("before", ["no store", "a version of the name"])
def test_a_download_that_fails_before_any_file_arrives_leaves_the_store_as_it_was(
    before: str, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It left `models/NAME/` (a lock, an empty staging folder) behind, listed as a model with
    no version. What a download fetched stays for the next run to resume
    (test_corrupt_download_is_refused_then_retried); an empty one goes with what it made."""
    import huggingface_hub

    store = Store(tmp_path / "store")
    if before != "no store":
        fetch(str(make_checkpoint(tmp_path / "local", shards=1, tokenizer=False)), store, name="tiny")
    was = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if "store" in p.parts)

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(DlmError, match="network is unreachable"):
        fetch("org/tiny", store)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if "store" in p.parts) == was


def _interrupted_download(hub: FakeHub, monkeypatch: pytest.MonkeyPatch, how: str) -> type[BaseException]:
    """Make the next fetch stop once config.json and the second shard arrived: the network
    fails, the user hits Ctrl-C, or the first shard does not match the hub's hash (removed,
    the rest kept)."""
    import huggingface_hub

    if how == "hash mismatch":
        shard = "model-00001-of-00002.safetensors"
        hub.served[shard] = hub.files[shard][:-5] + bytes(b ^ 0xFF for b in hub.files[shard][-5:])
        return DlmError
    real = huggingface_hub.snapshot_download
    raised = {"network error": OSError("connection reset by peer"), "Ctrl-C": KeyboardInterrupt()}[how]

    def some_files_then(*args: object, **kwargs: object) -> None:
        real(*args, **{**kwargs, "allow_patterns": ["config.json", "model-00002-of-00002.safetensors"]})
        raise raised

    monkeypatch.setattr(huggingface_hub, "snapshot_download", some_files_then)
    return type(raised) if how == "Ctrl-C" else DlmError


# `dlm ARGS`, SIGKILLed as it runs the structural checks of what it downloaded (seconds: the
# tokenizer loads, the family's model is built on the meta device).
KILLED_CHECKING = """
import os, signal, sys
from dlm.cli.store import fetch
fetch.check_structure = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
sys.argv = ["dlm", *sys.argv[1:]]
from dlm.cli.entry import main
main()
"""


@pytest.mark.slow
def test_a_download_killed_during_its_checks_is_listed_with_its_resume(hub: FakeHub, tmp_path: Path) -> None:
    """A hub fetch deleted its download's record of the source (`source.json`) before the
    structural checks, so a fetch killed (or interrupted) during them left a download listed
    as staged by an older dlm, with no command to resume it. The record now goes only as the
    version is published."""
    root = str(tmp_path / "store")
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_CHECKING, "fetch", "org/tiny", "--store", root],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, stdout, stderr = cli("models", "--store", root, "--json")
    listing = json.loads(stdout)
    assert code == 0 and listing["models"] == [], stderr
    [incomplete] = listing["incomplete"]
    assert incomplete["resume"] == f"dlm fetch org/tiny --revision {COMMIT} --name tiny"
    assert incomplete["source"]["commit"] == COMMIT
    code, stdout, stderr = cli("fetch", "org/tiny", "--revision", COMMIT, "--name", "tiny", "--store", root, "--json")
    assert code == 0 and json.loads(stdout)["state"] == "verified", stderr
    version = Store(tmp_path / "store").version_dir("tiny", COMMIT[:12])
    assert sorted(p.name for p in version.iterdir()) == ["files", "manifest.json"]  # no source.json left


@pytest.mark.parametrize("before", ["no store", "a version of the name"])
def test_rm_of_an_incomplete_download_deletes_it_unless_its_fetch_runs(
    before: str, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlm models` names an interrupted download's NAME@VERSION; `dlm rm` of that ref said
    "no model named" and the operator had to delete the directory by hand. It deletes it now
    (refused while a fetch of the model holds its staging lock), and nothing published."""
    store = Store(tmp_path / "store")
    published = []
    if before != "no store":
        published = [fetch(str(make_checkpoint(tmp_path / "local", shards=1, tokenizer=False)), store, name="tiny")]
    with pytest.raises(_interrupted_download(hub, monkeypatch, "network error")):
        fetch("org/tiny", store)
    [incomplete] = store.incomplete_fetches("tiny")
    root = str(store.root)
    with store.staging_lock("tiny"):  # as a running fetch holds it
        code, _, stderr = cli("rm", incomplete.ref, "--store", root)
    assert code == 1 and f"refusing to remove {incomplete.ref}: a fetch of tiny is running" in stderr
    assert incomplete.path.is_dir()
    code, stdout, stderr = cli("rm", incomplete.ref, "--store", root, "--json")
    assert code == 0, stderr
    assert json.loads(stdout) == {"removed": [incomplete.ref], "kept_released": [], "kept": {}}
    assert not incomplete.path.exists() and store.incomplete_fetches("tiny") == []
    assert [m.version for m in store.manifests("tiny")] == [r.manifest.version for r in published]
    assert store.models() == (["tiny"] if published else [])
    assert (store.model_dir("tiny").exists()) == bool(published)  # nothing of the name is left


@pytest.mark.parametrize("before", ["no store", "a version of the name"])
@pytest.mark.parametrize("how", ["network error", "Ctrl-C", "hash mismatch"])
def test_an_interrupted_download_is_listed_as_incomplete_not_as_a_model_without_a_version(
    how: str, before: str, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download interrupted after some files arrived keeps them for its rerun to resume, and
    `dlm models --json` listed NAME with `"versions": []` (the table showed nothing) until the
    rerun, a name that `dlm verify`, `dlm rm` and `dlm serve` then did not know. Now NAME is a
    model only once a version is published: the download is listed apart as `incomplete`, with
    the command that resumes it, which a bare NAME's error names too. A published version of
    the name stays listed and is what NAME resolves to."""
    store = Store(tmp_path / "store")
    published = []
    if before != "no store":
        published = [fetch(str(make_checkpoint(tmp_path / "local", shards=1, tokenizer=False)), store, name="tiny")]
    raised = _interrupted_download(hub, monkeypatch, how)
    with pytest.raises(raised):
        fetch("org/tiny", store)
    resume = f"dlm fetch org/tiny --revision {COMMIT} --name tiny"

    code, stdout, stderr = cli("models", "--store", str(store.root), "--json")
    listing = json.loads(stdout)
    assert code == 0, stderr
    assert [(m["name"], [v["version"] for v in m["versions"]]) for m in listing["models"]] == [
        ("tiny", [r.manifest.version for r in published])
    ] * len(published)
    [incomplete] = listing["incomplete"]
    assert incomplete["ref"] == f"tiny@{COMMIT[:12]}" and incomplete["resume"] == resume
    assert incomplete["files"] >= 1 and incomplete["size"] > 0 and not incomplete["running"]
    assert incomplete["source"]["repo_id"] == "org/tiny" and Path(incomplete["path"]).is_dir()
    code, stdout, _ = cli("models", "--store", str(store.root))
    assert code == 0 and f"incomplete fetch tiny@{COMMIT[:12]}" in stdout and resume in " ".join(stdout.split())

    if published:  # what was published stays what NAME means
        assert store.find("tiny").version == published[0].manifest.version
    else:
        code, _, stderr = cli("verify", "tiny", "--store", str(store.root))
        assert code == 2 and "no model named 'tiny'" in stderr and resume in stderr

    monkeypatch.undo()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    hub.served = dict(hub.files)
    hub.requests.clear()
    result = fetch("org/tiny", store, revision=COMMIT)  # the command it named
    assert result.manifest.verified and result.manifest.version == COMMIT[:12]
    fetched = [p.rsplit("/", 1)[1] for p in _downloads(hub)]
    assert "model-00001-of-00002.safetensors" in fetched
    assert "model-00002-of-00002.safetensors" not in fetched  # resumed: what arrived is kept
    assert not (result.path.parent / "source.json").exists()  # the staging record is not published
    code, stdout, _ = cli("models", "--store", str(store.root), "--json")
    listing = json.loads(stdout)
    assert listing["incomplete"] == [] and not Path(incomplete["path"]).exists()
    assert [v["version"] for v in listing["models"][0]["versions"]] == [
        *(r.manifest.version for r in published),
        COMMIT[:12],
    ]
