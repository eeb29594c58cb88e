"""A corrupt or hostile store record affects only itself: a manifest, a deployment file or a
server record that is nested too deeply, not JSON, of the wrong types, too large, a
directory, or another version's, is listed as corrupt (with the reason) where it is one, and
every store command keeps working for the rest; `dlm rm` removes a corrupt version and a
fetch of the same content repairs it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from dlm.cli.store import records
from dlm.cli.store.fetch import fetch
from dlm.cli.store.releases import release
from dlm.cli.store.store import Store
from tests.weights_helpers import cli, make_checkpoints

DEEP = "[" * 100_000 + "]" * 100_000  # far deeper than Python's recursion limit
SMALL_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_checkpoints(tmp_path_factory.mktemp("sources"))


@pytest.fixture
def stocked(sources: list[Path], tmp_path: Path) -> tuple[Store, list[str]]:
    """m@v1, m@v2 (released in that order to `default`) and m@v3."""
    store = Store(tmp_path / "store")
    versions = [fetch(str(s), store, name="m").manifest.version for s in sources]
    for version in versions[:2]:
        release(store, f"m@{version}")
    return store, versions


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _replace_by_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _too_large(path: Path) -> None:
    path.write_text(path.read_text() + " " * (SMALL_LIMIT + 1))


def _file_path(bad: str) -> Callable[[Path, Path], None]:
    """A damage that names `bad` as the manifest's first file (a hand edit)."""

    def harm(manifest: Path, other: Path) -> None:
        _edit_json(manifest, lambda d: d["files"][0].update(path=bad))

    return harm


MANIFEST_DAMAGE: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "nested too deeply": (
        lambda m, other: (
            _edit_json(m, lambda d: d.update(source="@")) or m.write_text(m.read_text().replace('"@"', DEEP))
        ),
        "recursion limit",
    ),
    "not JSON": (lambda m, other: m.write_text('{"name": "m", "vers'), "Invalid JSON"),
    "wrong types": (lambda m, other: _edit_json(m, lambda d: d["files"][0].update(size="big")), "files.0.size"),
    "unknown field": (lambda m, other: _edit_json(m, lambda d: d.update(trusted=True)), "trusted"),
    "verification forged as a string": (
        lambda m, other: _edit_json(m, lambda d: d["verification"].update(ok="yes")),
        "verification.ok",
    ),
    **{
        f"a file path {what}": (
            _file_path(bad),
            f"files.0.path: file path {bad!r} is not a relative path inside the version",
        )
        for what, bad in [
            ("out of the version", "../../x"),
            ("from the root", "/etc/passwd"),
            ("through ..", "a/../../b"),
            ("empty", ""),
        ]
    },
    "another version's manifest": (lambda m, other: shutil.copyfile(other, m), "but is stored as"),
    "a directory": (lambda m, other: _replace_by_directory(m), "directory"),
    "too large": (lambda m, other: _too_large(m), "larger than"),
}


@pytest.mark.parametrize("damage", list(MANIFEST_DAMAGE))
def test_a_corrupt_manifest_is_listed_and_removable_and_the_store_works_on(
    damage: str, stocked: tuple[Store, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "MAX_RECORD_BYTES", SMALL_LIMIT)
    store, (v1, v2, v3) = stocked
    harm, reason = MANIFEST_DAMAGE[damage]
    harm(store.version_dir("m", v3) / "manifest.json", store.version_dir("m", v1) / "manifest.json")
    root = str(store.root)

    code, stdout, stderr = cli("models", "--store", root, "--json")
    assert code == 0, stderr
    listed = {v["version"]: v for v in json.loads(stdout)["models"][0]["versions"]}
    assert (listed[v1]["state"], listed[v2]["state"], listed[v3]["state"]) == ("verified", "verified", "corrupt")
    assert reason in listed[v3]["reason"]
    code, stdout, _ = cli("models", "--store", root)
    assert code == 0 and "corrupt" in stdout

    for args in (["verify", f"m@{v3}"], ["release", f"m@{v3}"]):
        code, stdout, stderr = cli(*args, "--store", root)
        assert code == 1 and "corrupt" in stderr and f"dlm rm m@{v3}" in " ".join(stderr.split()), (args, stderr)
    assert cli("verify", f"m@{v2}", "--store", root)[0] == 0
    assert cli("rollback", "--store", root)[0] == 0  # to v1
    assert cli("release", "m", "--store", root)[0] == 0  # the newest verified: v2, never the corrupt v3
    code, stdout, stderr = cli("rm", "m", "--keep", "0", "--store", root, "--json")
    assert code == 0, stderr
    kept = {
        f"m@{v1}": "the previous release of deployment default",
        f"m@{v2}": "the current release of deployment default",
    }
    assert json.loads(stdout) == {"removed": [], "kept_released": [f"m@{v1}", f"m@{v2}"], "kept": kept}

    code, stdout, stderr = cli("rm", f"m@{v3}", "--store", root, "--json")
    assert code == 0 and json.loads(stdout)["removed"] == [f"m@{v3}"], stderr
    assert not store.version_dir("m", v3).exists()
    assert [m.version for m in store.manifests("m")] == [v1, v2]


def test_a_fetch_repairs_a_corrupt_version(stocked: tuple[Store, list[str]], sources: list[Path]) -> None:
    store, (_, _, v3) = stocked
    (store.version_dir("m", v3) / "manifest.json").write_text(DEEP)
    result = fetch(str(sources[2]), store, name="m")
    assert result.manifest.version == v3 and not result.already_present and result.manifest.verified
    assert store.manifest("m", v3).verified


def test_a_corrupt_released_version_stays_protected(stocked: tuple[Store, list[str]]) -> None:
    store, (_, v2, _) = stocked
    (store.version_dir("m", v2) / "manifest.json").write_text(DEEP)
    code, _, stderr = cli("rm", f"m@{v2}", "--store", str(store.root))
    assert code == 1 and "the current release of deployment default" in stderr
    assert store.version_dir("m", v2).is_dir()


def _fail_verification(store: Store, version: str) -> None:
    shard = store.files_dir("m", version) / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    assert cli("verify", f"m@{version}", "--store", str(store.root))[0] == 1


@pytest.mark.parametrize("states", [("failed", "corrupt"), ("failed", "failed"), ("corrupt", "corrupt")], ids="+".join)
@pytest.mark.parametrize("command", [("release", "m"), ("verify", "m"), ("estimate", "m")], ids=" ".join)
def test_a_name_with_no_usable_version_says_what_is_wrong_with_each(
    states: tuple[str, str],
    command: tuple[str, ...],
    sources: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bare NAME whose versions each failed verification or are corrupt is the store's
    failure (exit 1), named version by version: it said "every version of 'm' failed
    verification (v1)" when v2 was corrupt (not named at all), and of two corrupt versions
    named only the newest."""
    store = Store(tmp_path / "store")
    versions = [fetch(str(s), store, name="m").manifest.version for s in sources[:2]]
    for version, state in zip(versions, states):
        if state == "failed":
            _fail_verification(store, version)
        else:
            (store.version_dir("m", version) / "manifest.json").write_text('{"name": "m", "vers')
    monkeypatch.setenv("DLM_STORE", str(store.root))
    code, stdout, stderr = cli(*command)
    err = " ".join(stderr.split())
    assert code == 1 and err.startswith("error: ") and stderr.count("error:") == 1, stderr
    assert "every version" not in err, err
    for version, state in zip(versions, states):
        said = (
            f"m@{version} failed verification (model.safetensors: "
            if state == "failed"
            else f"m@{version} is corrupt ("
        )
        assert said in err and f"dlm rm m@{version}" in err, (version, err)
    assert ("failed" in states) == ("dlm verify m@" in err), err
    assert len(store.manifests("m")) == states.count("failed")  # nothing was changed


@pytest.mark.parametrize(
    "states",
    [("unverified", "corrupt", "failed"), ("corrupt", "unverified", "corrupt"), ("unverified", "unverified", "failed")],
    ids="+".join,
)
@pytest.mark.parametrize("command", [("release", "m"), ("verify", "m"), ("estimate", "m")], ids=" ".join)
def test_a_name_with_an_unverified_version_but_none_verified_says_what_each_is(
    states: tuple[str, ...],
    command: tuple[str, ...],
    sources: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bare NAME with an unverified version said only "'m' has no verified version; run
    `dlm verify m@VERSION`", naming neither which version to verify nor the corrupt and
    failed ones beside it. It lists every version's state now, as the message for a name
    whose versions are all damaged does (dlm.cli.store.store.no_usable_version); bad usage
    (exit 2), since verifying is the user's step."""
    store = Store(tmp_path / "store")
    versions = [fetch(str(s), store, name="m").manifest.version for s in sources[:3]]
    for version, state in zip(versions, states):
        manifest = store.version_dir("m", version) / "manifest.json"
        if state == "failed":
            _fail_verification(store, version)
        elif state == "corrupt":
            manifest.write_text('{"name": "m", "vers')
        else:
            manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "verification": None}))
    before = {v: (store.version_dir("m", v) / "manifest.json").read_bytes() for v in versions}
    monkeypatch.setenv("DLM_STORE", str(store.root))
    code, stdout, stderr = cli(*command)
    err = " ".join(stderr.split())
    assert code == 2 and err.startswith("error: ") and stderr.count("error:") == 1, stderr
    assert "'m' has no verified version: " in err, err
    for version, state in zip(versions, states):
        said = {
            "unverified": f"m@{version} is unverified",
            "failed": f"m@{version} failed verification (model.safetensors: ",
            "corrupt": f"m@{version} is corrupt (",
        }[state]
        fix = f"dlm verify m@{version}" if state == "unverified" else f"dlm rm m@{version}"
        assert said in err and fix in err, (version, err)
    assert before == {v: (store.version_dir("m", v) / "manifest.json").read_bytes() for v in versions}


@pytest.mark.parametrize(
    "content",
    [
        DEEP,
        "{",
        '{"deployment": "other", "current": null, "history": "none"}',
        '{"deployment": "default", "current": null, "history": []}',
    ],
    ids=["nested too deeply", "not JSON", "wrong types", "another deployment's"],
)
def test_a_corrupt_deployment_file_affects_only_its_deployment(content: str, stocked: tuple[Store, list[str]]) -> None:
    store, (v1, v2, v3) = stocked
    (store.deployments_dir / "other.json").write_text(content)
    root = str(store.root)
    code, stdout, stderr = cli("models", "--store", root, "--json")
    assert code == 0, stderr
    deployments = {d["deployment"]: d for d in json.loads(stdout)["deployments"]}
    assert deployments["other"]["state"] == "corrupt" and deployments["other"]["reason"]
    assert deployments["default"]["current"]["version"] == v2
    code, stdout, _ = cli("models", "--store", root)
    assert code == 0 and "deployment other: corrupt" in stdout
    assert cli("release", f"m@{v3}", "--store", root)[0] == 0
    # what the corrupt record releases cannot be known: rm removes nothing until it is restored
    for rm in (["rm", f"m@{v1}"], ["rm", "m", "--keep", "0"]):
        code, _, stderr = cli(*rm, "--store", root)
        assert code == 1 and "other.json is corrupt" in " ".join(stderr.split()), (rm, stderr)
        assert " ".join(stderr.split()).count("delete") == 1, stderr  # the fix, said once
        assert store.version_dir("m", v1).is_dir()
    for args in (["release", f"m@{v3}", "-d", "other"], ["rollback", "-d", "other"]):
        code, _, stderr = cli(*args, "--store", root)
        assert code == 1 and "other.json is corrupt" in " ".join(stderr.split()), (args, stderr)
    assert (store.deployments_dir / "other.json").read_text() == content  # never overwritten


def test_a_corrupt_server_record_is_passed_over(stocked: tuple[Store, list[str]]) -> None:
    store, (_, _, v3) = stocked
    servers = store.deployments_dir / ".servers"
    servers.mkdir()
    (servers / "default.json").write_text(DEEP)
    root = str(store.root)
    assert cli("models", "--store", root, "--json")[0] == 0
    assert cli("release", f"m@{v3}", "--store", root)[0] == 0
    assert cli("rm", "m", "--keep", "2", "--store", root)[0] == 0


@pytest.mark.parametrize("command", [("models",), ("rollback",), ("rm", "m", "--keep", "2")], ids=" ".join)
def test_the_next_transaction_removes_what_killed_writers_left(
    command: tuple[str, ...], stocked: tuple[Store, list[str]]
) -> None:
    """docs/weights.md, invariant 4: a killed fetch's staging copy and a killed removal's trash
    were cleared only by the next fetch or removal of that same model; any store command's
    transaction clears them now, except a staging copy a running fetch still holds."""
    store, _ = stocked
    base = store.model_dir("m")
    staging, trash = base / ".staging" / "local-killed", base / ".trash-v0-123"
    for leftover in (staging, trash):
        (leftover / "files").mkdir(parents=True)
        (leftover / "files" / "model.safetensors").write_bytes(b"x" * 1024)
    code, _, stderr = cli(*command, "--store", str(store.root))
    assert code == 0, stderr
    assert not staging.exists() and not trash.exists()


def test_a_staging_copy_of_a_running_fetch_is_left_alone(stocked: tuple[Store, list[str]]) -> None:
    store, _ = stocked
    staging = store.model_dir("m") / ".staging" / "local-running"
    staging.mkdir(parents=True)
    with store.staging_lock("m"):  # a fetch of m transferring
        assert cli("models", "--store", str(store.root))[0] == 0
    assert staging.exists()


@pytest.mark.parametrize(
    "args",
    [("verify", "m@V1"), ("release", "m@V3"), ("rollback",)],
    ids=["verify (manifest)", "release (deployment record)", "rollback (deployment record)"],
)
def test_a_full_disk_writing_a_record_names_the_record(
    args: tuple[str, ...], stocked: tuple[Store, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record written on a full disk (the manifest's verification, a deployment's file) said
    only `error: [Errno 28] No space left on device`: no word of which file or which disk. The
    error names the record it could not write; the record is as it was, no temporary left."""
    import os

    from dlm.cli.store import atomic

    store, versions = stocked
    before = {p: p.read_bytes() for p in store.root.rglob("*.json")}
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, handle: object) -> None:
            self.handle = handle

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()  # type: ignore[attr-defined]

        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    def fdopen(fd: int, mode: str = "r", *args: object, **kwargs: object) -> object:
        handle = real_fdopen(fd, mode, *args, **kwargs)  # type: ignore[call-overload]
        return Full(handle) if mode == "wb" else handle  # what write_bytes_atomic opens

    monkeypatch.setattr(atomic.os, "fdopen", fdopen)
    args = tuple(a.replace("V1", versions[0]).replace("V3", versions[2]) for a in args)
    code, stdout, stderr = cli(*args, "--store", str(store.root))
    assert code == 1 and "Traceback" not in stderr, stderr
    line = " ".join(stderr.split())
    assert "error: No space left on device: " in line, line
    record = "manifest.json" if args[0] == "verify" else "deployments/default.json"
    assert f"{store.root}/" in line and record in line, line
    assert {p: p.read_bytes() for p in store.root.rglob("*.json")} == before
    assert not list(store.root.rglob(".*.tmp"))


NOT_UTF8 = os.fsdecode(b"\xff\xfe")  # a file system name that does not decode: held with lone surrogates


def test_a_version_holding_a_name_that_is_not_utf8_is_failed_never_corrupt(
    stocked: tuple[Store, list[str]],
) -> None:
    """A stray file whose name is not UTF-8 in a released version's files: `dlm verify` wrote
    its finding into the manifest as a lone surrogate escape that the reader refuses, and the
    current release was listed `corrupt` from then on (unusable, `dlm rm` offered). The
    finding is recorded with the name's bytes escaped; the version is `failed`, its record read."""
    store, versions = stocked
    files = store.files_dir("m", versions[1])
    (files / f"{NOT_UTF8}.txt").write_bytes(b"x")
    code, _, stderr = cli("verify", f"m@{versions[1]}", "--store", str(store.root))
    assert code == 1, stderr
    manifest = store.manifest("m", versions[1])  # CorruptRecord before
    assert manifest.state == "failed"
    assert [f.file for f in manifest.verification.failures] == ["\\xff\\xfe.txt"]


def test_a_fetch_from_a_directory_whose_path_is_not_utf8_is_readable(sources: list[Path], tmp_path: Path) -> None:
    """A source directory whose path is not UTF-8: the fetch said "fetched ... verified" (exit 0)
    and the version was listed `corrupt` at once (its manifest's source path unreadable)."""
    source = tmp_path / NOT_UTF8
    shutil.copytree(sources[0], source)
    store = tmp_path / "store"
    code, stdout, stderr = cli("fetch", str(source), "--name", "m", "--store", str(store), "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["source"]["path"].endswith("/\\xff\\xfe")
    code, stdout, stderr = cli("models", "--store", str(store), "--json")
    assert [v["state"] for v in json.loads(stdout)["models"][0]["versions"]] == ["verified"], stdout


def test_a_source_file_whose_name_is_not_utf8_is_a_finding_not_a_traceback(sources: list[Path], tmp_path: Path) -> None:
    """`dlm fetch` of a directory holding a file whose name is not UTF-8 ended in a
    UnicodeEncodeError traceback (hashing its name into the version id). It is an entry that
    cannot be copied: a finding that fails the version (and `--exclude` leaves it out)."""
    source = tmp_path / "src"
    shutil.copytree(sources[0], source)
    (source / f"{NOT_UTF8}.txt").write_bytes(b"x")
    store = tmp_path / "store"
    code, stdout, stderr = cli("fetch", str(source), "--name", "m", "--store", str(store), "--json")
    assert code == 1 and "failed verification" in stderr, stderr
    failures = json.loads(stdout)["verification"]["failures"]
    assert [(f["file"], f["check"]) for f in failures] == [("\\xff\\xfe.txt", "source")]
    code, stdout, stderr = cli("fetch", str(source), "--name", "m", "--store", str(store), "--exclude", "*.txt")
    assert code == 0, stderr


def test_a_verification_record_torn_by_a_kill_is_cleared(stocked: tuple[Store, list[str]]) -> None:
    """`dlm verify` SIGKILLed as it wrote the version's record left `.manifest.json.*.tmp`
    in the version's directory for good (each kill one more; `dlm rm` alone removed them). The
    next store transaction clears it, as it clears a removal's trash."""
    store, versions = stocked
    torn = store.version_dir("m", versions[0]) / ".manifest.json.k1ll3d.tmp"
    torn.write_text('{"name": "m", "ver')
    code, stdout, stderr = cli("models", "--store", str(store.root), "--json")
    assert code == 0, stderr
    assert not torn.exists()
    assert store.manifest("m", versions[0]).verified
