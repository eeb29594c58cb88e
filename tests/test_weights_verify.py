"""`dlm verify`: every kind of damage to a checkpoint exits 1 and names the file and problem."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from dlm.cli.store.fetch import fetch
from dlm.cli.store.safetensors_format import check_safetensors
from dlm.cli.store.store import Store
from dlm.cli.store.verify import verify_directory
from dlm.engine.registry import FAMILIES
from dlm.engine.tiny_models import ensure_tiny_model
from tests.weights_helpers import cli, make_checkpoint, mount_read_only

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture
def stored(source: Path, tmp_path: Path) -> tuple[Store, str, Path]:
    """A fresh store holding one fetched, verified version: (store, ref, its files dir)."""
    store = Store(tmp_path / "store")
    result = fetch(str(source), store)
    assert result.manifest.verified, result.manifest.verification
    return store, f"{result.manifest.name}@{result.manifest.version}", result.path


def test_a_read_only_store_is_verified_without_recording_the_result(
    stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlm verify NAME@VERSION` of a store on a read-only mount (or another user's) hashed
    every file and then failed with `Read-only file system: <store>/.lock`, its findings
    unsaid; it reports them, with a warning that the result is not recorded."""
    store, ref, files = stored
    name, _, version = ref.partition("@")
    before = store.manifest(name, version).verification
    mount_read_only(monkeypatch, store.root)
    code, stdout, stderr = cli("verify", ref, "--store", str(store.root), "--json")
    report = json.loads(stdout)
    assert code == 0 and report["ok"], stderr
    assert {
        "file": "manifest.json",
        "check": "manifest",
        "problem": ("result not recorded: the store cannot be written (Read-only file system)"),
    } in report["warnings"]
    assert store.manifest(name, version).verification == before
    (files / "config.json").write_text("{}")  # damage is still found, and said: exit 1
    code, stdout, stderr = cli("verify", ref, "--store", str(store.root), "--json")
    assert code == 1 and not json.loads(stdout)["ok"] and "verification failed" in stderr


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def _rewrite_header(path: Path, edit) -> None:
    """Edit the JSON header in place, keeping its byte length (padded with spaces)."""
    raw = bytearray(path.read_bytes())
    n, header = _header(path)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    raw[8 : 8 + n] = text + b" " * (n - len(text))
    path.write_bytes(bytes(raw))


def _flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01  # inside the last tensor's data: the structure stays valid
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _bad_shape(path: Path) -> None:
    def edit(header: dict) -> None:
        name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 1)
        header[name]["shape"] = [header[name]["shape"][0] + 1]

    _rewrite_header(path, edit)


def _remove_tensor(path: Path) -> None:
    tensors = load_file(str(path))
    del tensors[sorted(tensors)[0]]
    save_file(tensors, str(path), metadata={"format": "pt"})


DAMAGE = {
    "flipped byte": (_flip_byte, SHARD1, [("sha256", "differs from the manifest")]),
    "truncated file": (_truncate, SHARD2, [("size", "truncated"), ("safetensors", "truncated")]),
    "edited header": (_bad_shape, SHARD1, [("sha256", "differs"), ("safetensors", "data_offsets span")]),
    "tensor removed": (
        _remove_tensor,
        SHARD2,
        [("size", "bytes, the manifest says"), ("index", "does not hold it"), ("tensors", "lacks tensor")],
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_fails_verify_naming_file_and_problem(kind: str, stored: tuple[Store, str, Path]) -> None:
    store, ref, files = stored
    damage, victim, expected = DAMAGE[kind]
    damage(files / victim)
    code, stdout, stderr = cli("verify", ref, "--store", str(store.root), "--json")
    assert code == 1, stderr
    report = json.loads(stdout)
    assert not report["ok"]
    found = {(f["check"], f["problem"]) for f in report["failures"]}
    for check, words in expected:
        assert any(c == check and words in p for c, p in found), (check, words, found)
    named = {f["file"] for f in report["failures"]}
    assert victim in named or "model.safetensors.index.json" in named
    assert victim in stderr and "error: verification failed" in stderr
    n = len(report["failures"])
    said = f"{n} problem{'s' if n > 1 else ''} in {len(named)} file{'s' if len(named) > 1 else ''}"
    assert f"error: verification failed: {said}\n" in stderr, stderr  # was "1 problems in 1 files"
    assert store.manifest(*ref.split("@")).state == "failed"  # release now refuses it


@pytest.mark.parametrize("kind", ["truncated file", "edited header", "tensor removed"])
def test_structural_checks_alone_catch_damage(kind: str, source: Path, tmp_path: Path) -> None:
    """Without a manifest (a plain directory) hashes cannot help: the structure checks must."""
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    damage, victim, _ = DAMAGE[kind]
    damage(copy / victim)
    report = verify_directory(copy)
    assert not report.ok
    assert any(f.check in ("safetensors", "index") for f in report.failures), report.failures


def test_healthy_version_verifies_and_records(stored: tuple[Store, str, Path]) -> None:
    store, ref, _ = stored
    code, stdout, stderr = cli("verify", ref, "--store", str(store.root), "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["ok"] and report["family"] == "llada" and report["bytes_hashed"] > 0
    assert "hashing" in stderr  # the progress bar
    manifest = store.manifest(*ref.split("@"))
    assert manifest.verification is not None and manifest.verification.hashed and manifest.state == "verified"


def test_tiny_models_verify_as_every_command_names_them(tmp_path: Path) -> None:
    """MODEL is a directory, a store name or `tiny:FAMILY` for every command (docs/cli.md);
    `dlm verify tiny:llada` said 'no such directory'."""
    code, stdout, stderr = cli("verify", "tiny:sdar", "--store", str(tmp_path / "store"), "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["ok"] and report["family"] == "sdar" and report["model"] is None
    assert report["path"] == str(ensure_tiny_model("tiny:sdar"))
    code, _, stderr = cli("verify", "tiny:nope", "--store", str(tmp_path / "store"))
    assert code == 2 and "no tiny model 'tiny:nope'" in stderr


def test_missing_and_extra_files(stored: tuple[Store, str, Path]) -> None:
    store, ref, files = stored
    (files / "tokenizer_config.json").unlink()
    (files / "stray.bin").write_bytes(b"x")
    code, stdout, _ = cli("verify", ref, "--store", str(store.root), "--json")
    assert code == 1
    found = {(f["file"], f["problem"]) for f in json.loads(stdout)["failures"]}
    assert ("tokenizer_config.json", "file is missing") in found
    assert ("stray.bin", "file is not in the manifest") in found


def test_index_problems(source: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    index = copy / "model.safetensors.index.json"
    text = index.read_text()
    first = next(iter(json.loads(text)["weight_map"]))
    # a duplicate key (json would silently keep the last), and a tensor no shard holds
    text = text.replace('"weight_map": {', f'"weight_map": {{"{first}": "{SHARD1}", "ghost.weight": "{SHARD2}", ', 1)
    index.write_text(text)
    problems = [f.problem for f in verify_directory(copy).failures]
    assert any(f"names tensor {first} more than once" in p for p in problems), problems
    assert any("ghost.weight" in p and "does not hold it" in p for p in problems), problems
    (copy / SHARD2).unlink()
    problems = [f.problem for f in verify_directory(copy).failures]
    assert any(f"names shard {SHARD2}" in p and "missing" in p for p in problems), problems


def test_config_and_tokenizer_problems(source: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    (copy / "config.json").write_text(json.dumps({"model_type": "gpt9"}))
    (copy / "tokenizer.json").write_text("{not json")
    report = verify_directory(copy)
    checks = {f.check: f.problem for f in report.failures}
    assert "unsupported model_type 'gpt9'" in checks["config"] and "llada" in checks["config"]
    assert "tokenizer" in checks


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize(
    "header, data, words",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "4 bytes follow the last tensor"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "leaves a gap at byte 0"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F16", "shape": [2], "data_offsets": [6, 10]},
            },
            b"\0" * 10,
            "overlaps",
        ),
        ({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype 'Q7'"),
        ({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 6 bytes"),
        ({"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2, None),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__ must map strings to strings"),
    ],
)
def test_safetensors_rules(header: dict, data: bytes, words: str | None, tmp_path: Path) -> None:
    problems = check_safetensors(_raw_safetensors(tmp_path / "x.safetensors", header, data)).problems
    if words is None:
        assert problems == []
    else:
        assert any(words in p for p in problems), problems


def test_safetensors_header_length_and_json(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    assert "runs past the end" in check_safetensors(path).problems[0]
    path.write_bytes(struct.pack("<Q", 4) + b"{x}!")
    assert "not valid UTF-8 JSON" in check_safetensors(path).problems[0]
    path.write_bytes(b"\1\2")
    assert "shorter than the 8-byte header length" in check_safetensors(path).problems[0]


def _family_checkpoint(family: str, directory: Path) -> Path:
    """A small checkpoint of `family` in its real on-disk layout, copied to `directory`."""
    if family == "qwen3_5_moe":  # written by transformers itself
        from tests.hybrid_checkpoints import reference_model, save_reference

        return save_reference(reference_model(), directory)
    tiny = "sdar_moe" if family == "sdar" else family  # the MoE variant also has tensor_sources
    shutil.copytree(ensure_tiny_model(f"tiny:{tiny}"), directory)
    return directory


def _drop_tensor(directory: Path, name: str) -> None:
    """Rewrite the shard holding `name` without it (and the index, if any, to match), so
    that only the tensors check can notice."""
    for shard in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(shard))
        if name in tensors:
            del tensors[name]
            save_file(tensors, str(shard), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        del data["weight_map"][name]
        index.write_text(json.dumps(data))


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_a_checkpoint_lacking_a_tensor_its_family_reads_fails(family: str, tmp_path: Path) -> None:
    """Every registered family: its checkpoint verifies; without one tensor its model reads,
    it fails the `tensors` check (and nothing else), naming a tensor, as loading would."""
    from dlm.engine.config import load_config
    from dlm.engine.loader import parameter_sources, tensor_locations
    from dlm.engine.runtime.engine import build_on_meta

    directory = _family_checkpoint(family, tmp_path / family)
    report = verify_directory(directory)
    assert report.ok and report.family == family, report.failures
    held = tensor_locations(directory)
    read = sorted(
        {src for srcs in parameter_sources(build_on_meta(load_config(directory)), held).values() for src in srcs}
    )
    assert read and set(read) <= set(held)
    _drop_tensor(directory, read[len(read) // 2])
    report = verify_directory(directory)
    assert [(f.check, f.file) for f in report.failures] == [("tensors", ".")], report.failures
    assert "lacks tensor" in report.failures[0].problem and family in report.failures[0].problem


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_a_tensor_of_another_shape_than_its_config_says_fails(family: str, tmp_path: Path) -> None:
    """Every registered family: a tensor its model reads, stored with another shape than its
    config.json gives that model (its bytes intact, so the safetensors file is sound), fails
    the `tensors` check naming its file. It verified, and `dlm serve` then refused to load
    it ('has shape ..., the model expects ...'), although a verified checkpoint is one serve
    can load."""
    from dlm.engine.config import load_config
    from dlm.engine.loader import parameter_sources, tensor_locations
    from dlm.engine.runtime.engine import build_on_meta

    directory = _family_checkpoint(family, tmp_path / family)
    held = tensor_locations(directory)
    model = build_on_meta(load_config(directory))
    params = dict(model.named_parameters())
    name = next(
        srcs[0]
        for param, srcs in parameter_sources(model, held).items()
        if len(srcs) == 1 and params[param].numel() > 1 and getattr(params[param], "weight_loader", None) is None
    )
    tensors = load_file(str(held[name]))
    tensors[name] = tensors[name].reshape(-1, 1) if tensors[name].dim() == 1 else tensors[name].reshape(-1)
    save_file(tensors, str(held[name]), metadata={"format": "pt"})
    report = verify_directory(directory)
    assert [(f.check, f.file) for f in report.failures] == [("tensors", held[name].name)], report.failures
    assert name in report.failures[0].problem and "the model expects" in report.failures[0].problem


def test_a_checkpoint_without_tensors_is_not_verified(source: Path, tmp_path: Path) -> None:
    """Its safetensors file is sound but empty: fetched as `failed`, refused by verify."""
    empty = tmp_path / "empty"
    shutil.copytree(source, empty, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({}, str(empty / "model.safetensors"))
    store = tmp_path / "store"
    code, stdout, stderr = cli("fetch", str(empty), "--store", str(store), "--json")
    assert code == 1 and json.loads(stdout)["state"] == "failed", stderr
    code, stdout, stderr = cli("verify", str(empty), "--json")
    assert code == 1
    assert [(f["check"], f["problem"]) for f in json.loads(stdout)["failures"]] == [
        ("tensors", "the safetensors files hold no tensors")
    ]


def test_a_store_name_whose_versions_are_all_corrupt_is_a_failed_operation(
    stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare NAME whose only version has a corrupt manifest: the store failed, not the user
    (exit 1, naming the version and `dlm rm`), where "run `dlm verify`" (exit 2) misled:
    verify refuses a corrupt version too."""
    store, ref, files = stored
    name = ref.split("@")[0]
    (files.parent / "manifest.json").write_text('{"broken')
    monkeypatch.setenv("DLM_STORE", str(store.root))
    for args in (["estimate", name], ["estimate", ref], ["verify", name]):
        code, _, err = cli(*args)
        assert code == 1 and err.startswith("error: ") and "is corrupt" in err, (args, err)
        assert f"dlm rm {ref}" in err, (args, err)


def test_a_damaged_config_in_the_store_is_a_failed_operation(
    stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config.json every command reads first is checked against the manifest when a store
    name is resolved: damage is exit 1 pointing at `dlm verify`, not exit 2 for bad JSON."""
    store, ref, files = stored
    config = files / "config.json"
    size = config.stat().st_size
    config.write_text('{"broken'.ljust(size))  # the same size: only its sha256 tells
    monkeypatch.setenv("DLM_STORE", str(store.root))
    code, _, err = cli("estimate", ref)
    assert code == 1 and err.startswith(f"error: {ref}'s config.json does not match the sha256"), err
    assert f"dlm verify {ref}" in err
    config.write_text('{"broken')  # another size: the stat every use of a version makes says so first
    code, _, err = cli("estimate", ref)
    assert code == 1 and err.startswith(f"error: {ref}: config.json is missing or changed size"), err
    assert f"dlm verify {ref}" in err


def test_a_dangling_link_in_a_version_is_a_finding_recorded_not_a_crash(stored: tuple[Store, str, Path]) -> None:
    """A stored file replaced by a link to nowhere: the report names it (it crashed on the
    file's stat before, printing no report and leaving the version "verified")."""
    store, ref, files = stored
    (files / SHARD1).unlink()
    (files / SHARD1).symlink_to(files / "nowhere")
    code, stdout, stderr = cli("verify", ref, "--store", str(store.root), "--json")
    assert code == 1 and "Traceback" not in stderr, stderr
    report = json.loads(stdout)
    assert any(f["file"] == SHARD1 and "unreadable" in f["problem"] for f in report["failures"]), report
    assert store.manifest(*ref.split("@")).state == "failed"


@pytest.mark.parametrize("where", ["a file", "the files directory"])
def test_a_link_in_a_version_to_an_identical_copy_outside_it_fails_verify(
    where: str, stored: tuple[Store, str, Path], tmp_path: Path
) -> None:
    """A stored file (or the version's whole `files/`) replaced by a symbolic link to an
    identical copy outside the version verified as sound: the bytes hashed were the copy's,
    which can change or vanish while the version stays "verified", and `dlm rm` never removes
    it. A fetch stores copies (or hard links), never a symbolic link: verify names the link."""
    store, ref, files = stored
    outside = tmp_path / "outside"
    if where == "a file":
        outside.mkdir()
        shutil.copyfile(files / SHARD1, outside / SHARD1)
        (files / SHARD1).unlink()
        (files / SHARD1).symlink_to(outside / SHARD1)
        named = SHARD1
    else:
        shutil.copytree(files, outside)
        shutil.rmtree(files)
        files.symlink_to(outside)
        named = "."
    code, stdout, stderr = cli("verify", ref, "--store", str(store.root), "--json")
    assert code == 1 and "Traceback" not in stderr, stderr
    report = json.loads(stdout)
    assert any(
        f["file"] == named and "symbolic link" in f["problem"] and str(outside) in f["problem"]
        for f in report["failures"]
    ), report["failures"]
    assert store.manifest(*ref.split("@")).state == "failed"


def _fail(store: Store, ref: str, files: Path) -> None:
    _flip_byte(files / SHARD1)
    assert cli("verify", ref, "--store", str(store.root))[0] == 1


@pytest.mark.parametrize("named", ["NAME@VERSION", "NAME"])
@pytest.mark.parametrize("command", ["generate", "estimate"])
def test_a_version_that_failed_verification_is_never_loaded(
    named: str, command: str, stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`NAME@VERSION` of a failed version loaded and answered without a word (only a bare NAME
    skipped it); now it is the store's failure (exit 1) naming the damage and the fixes, and a
    bare NAME whose versions all failed says so instead of "run `dlm verify`"."""
    store, ref, files = stored
    _fail(store, ref, files)
    monkeypatch.setenv("DLM_STORE", str(store.root))
    spec = ref if named == "NAME@VERSION" else ref.split("@")[0]
    args = [command, spec, "--prompt", "hi", "--gen-length", "4"] if command == "generate" else [command, spec]
    code, _, err = cli(*args)
    assert code == 1 and err.startswith("error: ") and "failed verification" in err, err
    assert f"dlm rm {ref.split('@')[0]}@" in err and "Traceback" not in err


def test_a_release_damaged_after_it_was_released_is_not_served(
    stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlm.cli.store.releases import current_checkpoint
    from dlm.engine.errors import DlmError

    store, ref, files = stored
    monkeypatch.setenv("DLM_STORE", str(store.root))
    assert cli("release", ref, "--deployment", "prod")[0] == 0
    assert current_checkpoint(store, "prod")[0].ref == ref
    _fail(store, ref, files)
    with pytest.raises(DlmError, match="failed verification.*dlm rollback -d prod"):
        current_checkpoint(store, "prod")
    code, _, err = cli("release", ref, "--deployment", "other")
    assert code == 1 and "failed verification" in err and "run `dlm verify" not in err, err


def test_a_release_truncated_after_it_was_released_is_not_served(
    stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlm serve --deployment prod` of a release whose shard was truncated since started the
    server and failed in the loader (an unreadable safetensors header), naming no fix, though
    `dlm serve NAME@VERSION` refuses it up front (Store.size_damage)."""
    from dlm.cli.store.releases import current_checkpoint
    from dlm.engine.errors import DlmError

    store, ref, files = stored
    monkeypatch.setenv("DLM_STORE", str(store.root))
    assert cli("release", ref, "--deployment", "prod")[0] == 0
    os.truncate(files / SHARD1, 100)
    with pytest.raises(DlmError, match=f"{SHARD1} is missing or changed size.*dlm rollback -d prod"):
        current_checkpoint(store, "prod")
    code, _, err = cli("serve", "--deployment", "prod")
    assert code == 1 and err.startswith("error: the current release of deployment 'prod'") and err.count("\n") == 1


def _within(seconds: float, call: Any) -> Any:
    """`call()`'s result, failing (not hanging) if it takes longer: a FIFO read blocks forever."""
    import threading

    box: list[Any] = []
    worker = threading.Thread(target=lambda: box.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert box, f"still running after {seconds}s (blocked on a FIFO?)"
    return box[0]


@pytest.mark.parametrize("victim", [SHARD1, "config.json", "model.safetensors.index.json"])
def test_a_fifo_in_a_versions_place_is_reported_never_read(
    victim: str, stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO where a file was blocked `dlm verify` (and generate/estimate of the store name,
    on config.json) until a writer came; an index that was a directory or a FIFO verified."""
    store, ref, files = stored
    (files / victim).unlink()
    os.mkfifo(files / victim)
    code, stdout, stderr = _within(60, lambda: cli("verify", ref, "--store", str(store.root), "--json"))
    assert code == 1 and "Traceback" not in stderr, stderr
    assert any(f["file"] == victim for f in json.loads(stdout)["failures"]), stdout
    monkeypatch.setenv("DLM_STORE", str(store.root))
    code, _, stderr = _within(60, lambda: cli("estimate", ref))
    assert code == 1 and stderr.startswith("error: ") and "Traceback" not in stderr, stderr


def test_a_deployment_whose_config_changed_in_place_is_not_served(
    stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same-size edit of config.json that `dlm generate NAME@VERSION` refuses was loaded
    by `dlm serve --deployment` and released (release compared sizes only)."""
    from dlm.cli.store.releases import current_checkpoint
    from dlm.engine.errors import DlmError

    store, ref, files = stored
    monkeypatch.setenv("DLM_STORE", str(store.root))
    assert cli("release", ref, "--deployment", "prod")[0] == 0
    config = files / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"llada"', '"LLaDA"', 1))
    assert len(config.read_text()) == len(text) and config.read_text() != text
    with pytest.raises(DlmError, match="does not match the sha256"):
        current_checkpoint(store, "prod")
    code, _, err = cli("release", ref, "--deployment", "other")
    assert code == 1 and "does not match the sha256" in err, err


def test_a_verify_of_a_copy_fetched_again_meanwhile_records_nothing(stored: tuple[Store, str, Path]) -> None:
    """A verify that hashed the old (damaged) copy, finishing after a fetch replaced it with a
    good one, marked the good copy failed; its record is refused now, the new copy's stands."""
    from dlm.cli.store.atomic import write_json_atomic
    from dlm.cli.store.records import Finding, Verification
    from dlm.cli.store.store import MANIFEST
    from dlm.engine.errors import DlmError

    store, ref, _ = stored
    name, version = ref.split("@")
    old = store.manifest(name, version)
    new = old.model_copy(update={"fetched_at": "2099-01-01T00:00:00.000+00:00"})  # the repairing fetch's
    write_json_atomic(store.version_dir(name, version) / MANIFEST, new.to_json())
    failed = Verification(
        ok=False,
        at="2099",
        hashed=True,
        family=None,
        failures=[Finding(file="x", check="sha256", problem="p")],
        warnings=[],
    )
    with pytest.raises(DlmError, match="fetched again while it was being verified"):
        store.record_verification(old, failed)
    assert store.manifest(name, version).state == "verified"


def _no_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` fails from now on


def _config_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """config.json may not be read (EACCES): read_config_json turns that into its own error,
    whose context says why."""
    real = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)


def _raising(target: str, exc: BaseException) -> Any:
    def arrange(monkeypatch: pytest.MonkeyPatch) -> None:
        def raise_it(*args: object, **kwargs: object) -> None:
            raise exc

        monkeypatch.setattr(target, raise_it)

    return arrange


# What breaks in the environment (or the code) while a sound version is verified: (arrange, what
# the error names).
NOT_THE_CHECKPOINTS = {
    "safetensors fails to import": (_no_safetensors, "ModuleNotFoundError"),
    "config.json may not be read": (_config_forbidden, "PermissionError: [Errno 13] Permission denied"),
    "a shard may not be read": (
        _raising("dlm.cli.store.verify.check_safetensors", PermissionError(13, "Permission denied")),
        "PermissionError",
    ),
    "hashing meets an I/O error": (
        _raising("dlm.cli.store.verify.sha256_file", OSError(5, "Input/output error")),
        "OSError: [Errno 5] Input/output error",
    ),
    "memory runs out": (_raising("dlm.cli.store.verify.check_safetensors", MemoryError()), "MemoryError"),
    "the model cannot be built": (
        _raising("dlm.engine.runtime.engine.build_on_meta", RuntimeError("an error in the code")),
        "RuntimeError: an error in the code",
    ),
}


@pytest.mark.parametrize("kind", list(NOT_THE_CHECKPOINTS))
def test_a_check_that_cannot_run_records_nothing_and_fails_the_command(
    kind: str, stored: tuple[Store, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every exception of a structure check was recorded as a finding, so a library that
    failed to import, memory running out or a permission marked a sound version `failed`.
    Only the checkpoint's faults are findings (dlm.cli.store.verify.checkpoint_fault): the
    rest is one `error:` line, exit 1, and the manifest as it was."""
    store, ref, _ = stored
    before = store.find(ref).to_json()
    arrange, named = NOT_THE_CHECKPOINTS[kind]
    arrange(monkeypatch)
    code, stdout, stderr = cli("verify", ref, "--store", str(store.root))
    monkeypatch.undo()
    assert code == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    said = " ".join(stderr.split())
    assert "could not verify" in said and named in said and "nothing was recorded" in said, stderr
    assert "FAIL" not in stderr  # no finding shown
    assert store.find(ref).to_json() == before


def test_a_damaged_header_is_still_a_finding_recorded(stored: tuple[Store, str, Path]) -> None:
    """The other side of the boundary: what is wrong with the files is recorded as before."""
    store, ref, files = stored
    shard = files / SHARD1
    raw = shard.read_bytes()
    shard.write_bytes(raw[:8] + b"!" + raw[9:])  # same length, the header's JSON broken
    code, _, stderr = cli("verify", ref, "--store", str(store.root))
    assert code == 1 and "verification failed" in stderr, stderr
    manifest = store.manifest(*ref.split("@"))
    assert manifest.state == "failed" and manifest.verification is not None
    assert any(f.file == SHARD1 and "not valid UTF-8 JSON" in f.problem for f in manifest.verification.failures)


def test_a_fetch_whose_checks_cannot_run_stores_nothing(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch published a sound checkpoint as `failed` when, say, safetensors failed to import."""
    _no_safetensors(monkeypatch)
    code, _, stderr = cli("fetch", str(source), "--store", str(tmp_path / "store"))
    assert code == 1 and "could not verify" in stderr and "ModuleNotFoundError" in stderr, stderr
    assert not (tmp_path / "store").exists()
