"""`dlm fetch` from a local directory: a real copy into the store, hashed as it goes,
atomic under SIGKILL, idempotent, and resolvable as MODEL afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from safetensors.torch import save_file

from dlm.cli.store import fetch as fetch_module
from dlm.cli.store.fetch import fetch
from dlm.cli.store.resolve import resolve_model
from dlm.cli.store.store import Store
from dlm.cli.store.verify import verify_model
from dlm.engine.errors import DlmError, UsageError
from tests.weights_helpers import ROOT, cli, make_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("src") / "tiny")


def test_fetch_copies_hashes_and_publishes(source: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    code, stdout, stderr = cli("fetch", str(source), "--store", str(store), "--json")
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["name"] == "tiny" and out["state"] == "verified" and not out["already_present"]
    assert out["bytes_transferred"] == out["total_size"] > 0
    assert "copying" in stderr and "kB" in stderr  # the byte progress bar, on stderr
    manifest = Store(store).manifest("tiny", out["version"])
    for entry in manifest.files:
        data = (source / entry.path).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest()
        assert (Path(out["path"]) / entry.path).read_bytes() == data
    assert out["version"] == manifest.content_sha256[:12]
    assert manifest.verification is not None and manifest.verification.family == "llada"


def test_second_fetch_reads_nothing(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "store")
    first = fetch(str(source), store)

    def forbidden(*args: object, **kwargs: object) -> str:
        raise AssertionError("an unchanged source must not be read again")

    for reader in ("copy_hashing", "sha256_file", "sha256_stream"):
        monkeypatch.setattr(fetch_module, reader, forbidden)
    again = fetch(str(source), store)
    assert again.already_present and again.bytes_transferred == 0
    assert again.manifest.version == first.manifest.version
    assert [m.version for m in store.manifests("tiny")] == [first.manifest.version]


def test_same_content_elsewhere_is_the_same_version(source: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    first = fetch(str(source), store)
    copy = tmp_path / "elsewhere" / "tiny"
    make_checkpoint(copy)  # same recipe, same bytes
    again = fetch(str(copy), store)
    assert again.already_present and again.manifest.version == first.manifest.version


def test_changed_content_is_a_new_version(source: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    first = fetch(str(source), store, name="m")
    other = make_checkpoint(tmp_path / "other", seed=1)
    second = fetch(str(other), store, name="m")
    assert second.manifest.version != first.manifest.version
    assert [m.version for m in store.manifests("m")] == [first.manifest.version, second.manifest.version]


def test_include_exclude_and_link(source: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    result = fetch(str(source), store, exclude=["tokenizer*"], link=True)
    names = sorted(f.path for f in result.manifest.files)
    assert names == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert result.manifest.verification is not None
    assert result.manifest.verification.warnings[0].check == "tokenizer"
    shard = "model-00001-of-00002.safetensors"
    assert (result.path / shard).stat().st_ino == (source / shard).stat().st_ino  # hard link
    only = fetch(str(source), store, name="cfg", include=["*.json"])
    assert not only.manifest.verified  # no weights: stored, but never usable
    assert only.manifest.verification is not None
    assert any("no *.safetensors" in f.problem for f in only.manifest.verification.failures)


def test_bad_usage(source: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    for args, words in [
        (["/no/such/dir"], "not a hub repo id"),
        ([str(source), "--revision", "main"], "--revision applies to hub sources"),
        ([str(source), "--name", "bad name!"], "invalid model name"),
        ([str(source / "config.json")], "is a file"),
        (["org/n\u00e4me"], "not a hub repo id"),  # the hub's ids are ASCII: no request is made
    ]:
        code, _, stderr = cli("fetch", *args, "--store", store)
        assert code == 2 and words in stderr, (args, stderr)


def test_a_source_whose_name_is_no_model_name_says_to_give_one(source: Path, tmp_path: Path) -> None:
    """`dlm fetch "./my model"` (no --name) said "invalid model name 'my model'": a name the
    user never gave, with no word of where it came from or of --name. The refusal says it is
    the directory's name and that --name NAME gives another; nothing is created."""
    odd = tmp_path / "my model"
    shutil.copytree(source, odd)
    code, stdout, stderr = cli("fetch", str(odd), "--store", str(tmp_path / "store"))
    said = " ".join(stderr.split())
    assert code == 2 and stdout == "", stderr
    assert "invalid model name 'my model'" in said and "the directory's name" in said and "--name" in said, said
    assert not (tmp_path / "store").exists()
    code, _, stderr = cli("fetch", "org/-dashed", "--store", str(tmp_path / "store"))  # a hub id: no request made
    said = " ".join(stderr.split())
    assert code == 2 and "invalid model name '-dashed'" in said and "the repository's name" in said, said


def test_links_that_multiply_a_source_are_bounded(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Directories that each link twice to the next have 2^n paths: a chain of 30 (or `dlm
    fetch /`, through /sys) scanned until the kernel killed the fetch for memory. The scan
    stops at MAX_SOURCE_ENTRIES (lowered here to keep the test quick) and nothing is stored."""
    ckpt = tmp_path / "src"
    shutil.copytree(source, ckpt)
    previous = None
    for level in reversed(range(12)):  # 2^12 ways to the last level's file
        directory = ckpt / f"level{level}"
        directory.mkdir()
        (directory / "x.txt").write_text(str(level))
        if previous is not None:
            (directory / "a").symlink_to(previous)
            (directory / "b").symlink_to(previous)
        previous = directory
    monkeypatch.setattr(fetch_module, "MAX_SOURCE_ENTRIES", 1000, raising=False)
    store = Store(tmp_path / "store")
    code, _, stderr = cli("fetch", str(ckpt), "--name", "dag", "--store", str(store.root))
    assert code == 1 and "holds more than 1,000 entries" in stderr, stderr
    assert store.manifests("dag") == [] and not (store.root / "models" / "dag").exists()


@pytest.mark.parametrize("inside", ["store", "models/store"])
def test_a_source_holding_the_store_is_refused(source: Path, tmp_path: Path, inside: str) -> None:
    """`dlm fetch DIR` with the store under DIR copied the store into itself (every version
    and its own staging folder as it filled). A store under a dot-directory (skipped by the
    scan, as `.dlm` under a project) is no obstacle."""
    ckpt = tmp_path / "src"
    shutil.copytree(source, ckpt)
    store = Store(ckpt / inside)
    code, _, stderr = cli("fetch", str(ckpt), "--name", "self", "--store", str(store.root))
    assert code == 2 and "holds the model store" in stderr, stderr
    assert not (store.root / "models" / "self").exists()
    hidden = Store(ckpt / ".dlm" / "store")
    code, _, stderr = cli("fetch", str(ckpt), "--name", "ok", "--store", str(hidden.root))
    assert code == 0, stderr
    assert not any(".dlm" in f.path for f in hidden.manifests("ok")[0].files)


def test_store_names_resolve_as_model(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLM_STORE", str(tmp_path / "store"))
    result = fetch(str(source), Store())
    ref = f"tiny@{result.manifest.version}"
    assert resolve_model(ref) == result.path
    assert resolve_model(f"tiny@{result.manifest.version[:5]}") == result.path  # unique prefix
    assert resolve_model("tiny") == result.path  # newest verified
    with pytest.raises(UsageError, match="has no version"):
        resolve_model("tiny@ffff")
    with pytest.raises(UsageError, match="no model at 'nothing'"):
        resolve_model("nothing")
    code, stdout, stderr = cli("generate", ref, "--prompt", "hi", "--gen-length", "8", "--block-length", "8", "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["model"] == str(result.path)


def _big_source(directory: Path) -> Path:
    """A checkpoint plus a 64 MB shard, so a copy lasts long enough to be killed midway."""
    make_checkpoint(directory, shards=1)
    save_file({"big": torch.zeros(16 << 20)}, str(directory / "big.safetensors"))
    return directory


@pytest.mark.slow
def test_sigkill_mid_fetch_leaves_nothing_usable_and_rerun_completes(tmp_path: Path) -> None:
    src = _big_source(tmp_path / "big")
    store = Store(tmp_path / "store")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlm", "fetch", str(src), "--store", str(store.root), "--workers", "1"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    staging = store.model_dir("big") / ".staging"
    deadline = time.monotonic() + 60
    partial = None
    while time.monotonic() < deadline and proc.poll() is None:
        copies = list(staging.glob("local-*/files/big.safetensors")) if staging.exists() else []
        if copies and 0 < copies[0].stat().st_size < (src / "big.safetensors").stat().st_size:
            partial = copies[0]
            break
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial is not None, "the fetch finished before it could be killed mid-copy"
    assert store.manifests("big") == []  # the half-written version is not listed
    code, stdout, _ = cli("models", "--store", str(store.root), "--json")
    assert code == 0 and json.loads(stdout)["models"] == []  # the next command cleared what it left
    assert not store.model_dir("big").exists()
    with pytest.raises(UsageError):
        store.find("big")

    result = fetch(str(src), store)
    assert not result.already_present and result.manifest.verified
    assert not partial.exists()  # the abandoned staging copy was cleared
    assert verify_model(f"big@{result.manifest.version}", store).ok


# `dlm ARGS`, SIGKILLed as it deletes a replaced version's old copy (its `.trash-` directory).
KILLED_DELETING_TRASH = """
import os, shutil, signal, sys
rmtree = shutil.rmtree
def killed(path, *args, **kwargs):
    if os.path.basename(str(path)).startswith(".trash-"):
        os.kill(os.getpid(), signal.SIGKILL)
    return rmtree(path, *args, **kwargs)
shutil.rmtree = killed
sys.argv = ["dlm", *sys.argv[1:]]
from dlm.cli.entry import main
main()
"""


@pytest.mark.slow
def test_a_repair_killed_while_it_deletes_the_old_copy_keeps_the_version(source: Path, tmp_path: Path) -> None:
    """A fetch that repairs a damaged version (here the deployment's current release) deleted
    the old copy before it moved the new one into place: killed during that deletion (seconds,
    for a large model), it left neither, and the next command cleared both (the release named
    a version the store no longer had). The old copy now goes only once the new one is in place."""
    store = Store(tmp_path / "store")
    version = fetch(str(source), store).manifest.version
    root = str(store.root)
    assert cli("release", f"tiny@{version}", "--store", root)[0] == 0
    (store.files_dir("tiny", version) / "config.json").write_text("{}")  # damaged: another size
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_DELETING_TRASH, "fetch", str(source), "--store", root],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, stdout, stderr = cli("models", "--store", root, "--json")  # a transaction: it tidies
    listing = json.loads(stdout)
    assert code == 0, stderr
    assert [(v["version"], v["state"]) for v in listing["models"][0]["versions"]] == [(version, "verified")]
    assert listing["deployments"][0]["current"]["version"] == version
    assert list(store.model_dir("tiny").glob(".trash-*")) == []  # the old copy's remains: cleared
    assert list(store.model_dir("tiny").glob(".staging/*")) == []
    assert verify_model(f"tiny@{version}", store).ok


def test_source_changing_during_copy_is_refused(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "store")
    real = fetch_module.copy_hashing
    copy = tmp_path / "moving"
    make_checkpoint(copy)

    def touching(src: BinaryIO, dst: Path, advance: object) -> str:
        digest = real(src, dst, advance)
        if dst.name == "config.json":
            os.utime(src.fileno(), ns=(time.time_ns(), time.time_ns() + 10**9))
        return digest

    monkeypatch.setattr(fetch_module, "copy_hashing", touching)
    with pytest.raises(DlmError, match="changed while it was being copied"):
        fetch(str(copy), store)
    assert store.manifests("moving") == []


def _swap_for_link(path: Path, target: Path) -> None:
    path.unlink() if not path.is_dir() or path.is_symlink() else shutil.rmtree(path)
    os.symlink(target, path)


def _swap_for_other_file(path: Path, _: Path) -> None:
    fresh = path.with_name(".fresh")
    fresh.write_text("other bytes, another inode")
    os.replace(fresh, path)


# What a hostile writer does to the source between the scan and the copy. `outside` is a
# directory out of the source holding a secret file named like the swapped ones.
RACES = {
    "file swapped for a link out": lambda src, outside: _swap_for_link(src / "config.json", outside / "config.json"),
    "file swapped for a link in": lambda src, outside: _swap_for_link(src / "config.json", src / "tokenizer.json"),
    "directory swapped for a link out": lambda src, outside: _swap_for_link(src / "extra", outside),
    "file swapped for another file": lambda src, outside: _swap_for_other_file(src / "config.json", outside),
    "file swapped for a FIFO": lambda src, outside: (src / "config.json").unlink() or os.mkfifo(src / "config.json"),
    "linked target swapped for a link": lambda src, outside: _swap_for_link(
        outside / "linked.txt", outside / "config.json"
    ),
}


@pytest.mark.parametrize("link", [False, True], ids=["copy", "link"])
@pytest.mark.parametrize("race", list(RACES))
def test_a_source_file_swapped_after_the_scan_is_refused(
    race: str, link: bool, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy opens exactly the file the scan saw, following no link: whatever is put in
    its place between scan and copy is refused, and nothing of it reaches the store."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    (src / "extra").mkdir()
    (src / "extra" / "config.json").write_text('{"inside": true}')
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = b"root:x:0:0:secret outside the source"
    genuine = (src / "config.json").stat()  # the same size and mtime: no stat check can tell them apart
    (outside / "config.json").write_bytes(secret.ljust(genuine.st_size, b" "))
    os.utime(outside / "config.json", ns=(genuine.st_atime_ns, genuine.st_mtime_ns))
    (outside / "linked.txt").write_text("allowed by --follow-symlinks")
    os.symlink(outside / "linked.txt", src / "linked.txt")
    scan = fetch_module._source_files

    def scan_then_swap(root: Path, follow_symlinks: bool) -> object:
        found = scan(root, follow_symlinks)
        RACES[race](src, outside)
        return found

    monkeypatch.setattr(fetch_module, "_source_files", scan_then_swap)
    store = Store(tmp_path / "store")
    with pytest.raises(DlmError, match="replaced or removed after the source was scanned"):
        fetch(str(src), store, name="m", link=link, follow_symlinks=True, workers=1)
    assert store.manifests("m") == []
    stored = [p for p in store.root.rglob("*") if p.is_file() and not p.is_symlink()]
    assert all(secret not in p.read_bytes() for p in stored)


def test_a_swap_after_the_scan_is_one_error_line_from_the_cli(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    shutil.copytree(source, src)
    scan = fetch_module._source_files

    def scan_then_swap(root: Path, follow_symlinks: bool) -> object:
        found = scan(root, follow_symlinks)
        _swap_for_link(src / "tokenizer.json", Path("/etc/passwd"))
        return found

    monkeypatch.setattr(fetch_module, "_source_files", scan_then_swap)
    code, stdout, stderr = cli("fetch", str(src), "--store", str(tmp_path / "store"), "--json")
    assert code == 1 and stdout == ""
    assert "error:" in stderr and "tokenizer.json was replaced" in " ".join(stderr.split())
    assert Store(tmp_path / "store").manifests("src") == []


def _tree(root: Path) -> dict[str, bytes | None] | None:
    """Everything under a store: each path with its bytes (None for a directory); None when
    there is no store."""
    if not root.exists():
        return None
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _copy_fails(monkeypatch: pytest.MonkeyPatch, src: Path) -> None:
    real = fetch_module.copy_hashing

    def failing(source: BinaryIO, dst: Path, advance: object) -> str:
        if dst.suffix == ".safetensors":
            raise OSError(28, "No space left on device")
        return real(source, dst, advance)

    monkeypatch.setattr(fetch_module, "copy_hashing", failing)


def _shard_vanishes(monkeypatch: pytest.MonkeyPatch, src: Path) -> None:
    scan = fetch_module._source_files

    def scan_then_remove(root: Path, follow_symlinks: bool) -> object:
        found = scan(root, follow_symlinks)
        sorted(src.glob("*.safetensors"))[-1].unlink()
        return found

    monkeypatch.setattr(fetch_module, "_source_files", scan_then_remove)


def _raising(exc: BaseException) -> object:
    def raise_it(*args: object, **kwargs: object) -> None:
        raise exc

    return raise_it


# Where a local fetch can fail once its staging has begun: (how, what it raises).
FETCH_FAILURES = {
    "copy fails midway": (_copy_fails, DlmError),
    "a shard vanishes after the scan": (_shard_vanishes, DlmError),
    "verification raises": (
        lambda mp, src: mp.setattr(fetch_module, "check_structure", _raising(MemoryError())),
        MemoryError,
    ),
    "publishing fails": (lambda mp, src: mp.setattr(Store, "commit", _raising(OSError(5, "I/O error"))), OSError),
    "Ctrl-C during the copy": (
        lambda mp, src: mp.setattr(fetch_module, "copy_hashing", _raising(KeyboardInterrupt())),
        KeyboardInterrupt,
    ),
}


@pytest.mark.parametrize("before", ["no store", "another model", "a version of the name"])
@pytest.mark.parametrize("failure", list(FETCH_FAILURES))
def test_a_failed_fetch_leaves_the_store_as_it_was(
    failure: str, before: str, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch that failed once it had begun staging left `models/NAME/` (its lock and empty
    staging area) behind, and `dlm models` listed NAME with no version. Now what it made goes
    again, the store's own directories included; another model and the name's other versions
    are untouched."""
    store = Store(tmp_path / "store")
    if before != "no store":
        other = make_checkpoint(tmp_path / "other", shards=1, seed=1, tokenizer=False)
        fetch(str(other), store, name="m" if before == "a version of the name" else "other")
    src = tmp_path / "src"
    shutil.copytree(source, src)
    was = _tree(store.root)
    arrange, raised = FETCH_FAILURES[failure]
    arrange(monkeypatch, src)
    with pytest.raises(raised):
        fetch(str(src), store, name="m", workers=1)
    assert _tree(store.root) == was
    monkeypatch.undo()
    code, stdout, stderr = cli("models", "--store", str(store.root), "--json")
    listed = {m["name"]: len(m["versions"]) for m in json.loads(stdout)["models"]}
    assert (
        code == 0
        and listed == {"no store": {}, "another model": {"other": 1}, "a version of the name": {"m": 1}}[before]
    ), stderr


def test_a_failed_fetch_from_the_cli_leaves_no_model_behind(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _copy_fails(monkeypatch, source)
    code, stdout, stderr = cli("fetch", str(source), "--name", "m", "--store", str(tmp_path / "store"))
    assert code == 1 and "error: could not copy" in stderr and "No space left on device" in stderr
    assert not (tmp_path / "store").exists()


def test_a_waiter_for_a_removed_staging_lock_locks_the_new_one(tmp_path: Path) -> None:
    """A failed fetch removes the model directory it made, lock file included, while it holds
    that lock (Store.discard_empty): a fetch waiting on the removed file must not think it
    holds the lock while a third one locks the file made after it."""
    import threading

    from dlm.cli.store.atomic import Busy, locked

    path = tmp_path / "models" / "m" / ".lock"
    got = threading.Event()
    with locked(path):

        def waiter() -> None:
            with locked(path):
                got.set()
                time.sleep(0.5)

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.2)  # the waiter has opened the file and blocks on it
        path.unlink()
        path.parent.rmdir()
    assert got.wait(5)
    with pytest.raises(Busy):  # the waiter holds the file now at `path`
        with locked(path, blocking=False):
            pass
    thread.join()


def test_a_lock_directory_removed_while_it_is_made_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch starting while a failed one removes the directories it made (discard_empty)
    failed with `error: File exists: .../models/m`: Path.mkdir(exist_ok=True) found the
    directory there, then not a directory once the other process had removed it. (Seen
    with processes locking and removing models/m/.lock; here the interleaving is replayed.)"""
    from dlm.cli.store import atomic

    path = tmp_path / "models" / "m" / ".lock"
    real_mkdir = os.mkdir
    raced: list[str] = []

    def mkdir_meets_a_removal(target: object, mode: int = 0o777) -> None:
        if Path(str(target)) == path.parent and not raced:  # made by another, removed again by now
            raced.append(str(target))
            raise FileExistsError(17, "File exists", str(target))
        real_mkdir(target, mode)

    monkeypatch.setattr(atomic.os, "mkdir", mkdir_meets_a_removal)
    (tmp_path / "models").mkdir()
    with atomic.locked(path):
        assert path.is_file()
    assert raced


def test_the_next_command_removes_a_model_left_without_a_version(source: Path, tmp_path: Path) -> None:
    """A fetch of a new name SIGKILLed (its lock and staging copy), or the last version of a
    model removed, left models/NAME/ behind for good, and `dlm models --json` listed NAME with
    no version; the next store transaction removes it now (unless a fetch of it is running)."""
    store = Store(tmp_path / "store")
    fetch(str(source), store, name="kept")
    killed = store.model_dir("killed")
    (killed / ".staging" / "local-abc" / "files").mkdir(parents=True)
    (killed / ".staging" / "local-abc" / "files" / "config.json").write_text("{}")
    (killed / ".lock").touch()
    removed = fetch(str(source), store, name="removed").manifest
    assert cli("rm", removed.ref, "--store", str(store.root))[0] == 0
    running = store.model_dir("running")
    (running / ".staging").mkdir(parents=True)
    with store.staging_lock("running"):  # a fetch of it transferring: left alone (and no model yet)
        code, stdout, stderr = cli("models", "--store", str(store.root), "--json")
        assert code == 0, stderr
        assert [m["name"] for m in json.loads(stdout)["models"]] == ["kept"]
        assert (running / ".staging").is_dir()
    assert not killed.exists() and not store.model_dir("removed").exists()
    assert cli("models", "--store", str(store.root), "--json")[0] == 0
    assert store.model_directories() == ["kept"] and store.models() == ["kept"]


def test_a_transaction_does_not_make_again_a_model_directory_a_failed_fetch_removed(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store transaction (any store command) lists the models, then takes each one's staging
    lock to tidy it: when a failing fetch removed the model's directory in between, taking
    that lock made models/NAME/.lock again, and NAME stayed listed with no version."""
    from dlm.cli.store.releases import transaction

    store = Store(tmp_path / "store")
    fetch(str(source), store, name="kept")
    monkeypatch.setattr(Store, "model_directories", lambda self: ["kept", "gone"])  # listed, then removed
    with transaction(store):
        pass
    assert not store.model_dir("gone").exists()
