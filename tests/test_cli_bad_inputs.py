"""Every store, validate and loadtest subcommand (and generate, estimate and serve over corrupted
configs) over a corpus of bad inputs (issue 16): no
traceback, one `error:` line, the documented exit code (1 failed operation, 2 bad usage), and
a corrupted checkpoint that `dlm fetch` could read is recorded as a `failed` version.

Commands run in process (tests/weights_helpers.cli re-raises any exception that is not an exit,
so a crash fails the test as a traceback would).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dlm.cli.store.fetch import fetch
from dlm.cli.store.releases import load_state, release
from dlm.cli.store.store import Store
from tests.weights_helpers import cli, make_checkpoint

ERROR_LINE = re.compile(r"\W*error\b", re.IGNORECASE)
RAW_EXCEPTION = re.compile(r"^\s*\w*(Error|Exception)\b.*:|Traceback", re.MULTILINE)
DEEP = "[" * 100_000 + "]" * 100_000  # deeper than any recursive JSON parser's limit
BAD_UTF8 = b'{"model_type": "llada", "x": "\xff\xfe"}'


def _assert_one_error(code: int, stdout: str, stderr: str, expected_code: int) -> None:
    out = stdout + stderr
    assert not RAW_EXCEPTION.search(out), out[-2000:]
    errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(errors) == 1 and errors[0].startswith("error: "), stderr[-2000:]
    assert code == expected_code, (code, stderr[-2000:])


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("good") / "ckpt", shards=2)


def _shard(directory: Path) -> Path:
    return sorted(directory.glob("*.safetensors"))[0]


def _header_bytes(path: Path, raw: bytes) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _config_dir(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    (d / "config.json" / "inner.txt").write_text("x")


def _wrong_types(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(hidden_size="big", num_hidden_layers=[1], vocab_size=None)
    (d / "config.json").write_text(json.dumps(config))


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "config invalid utf-8": lambda d: (d / "config.json").write_bytes(BAD_UTF8),
    "config deep nesting": lambda d: (d / "config.json").write_text(DEEP),
    "config is a directory": _config_dir,
    "config is a list": lambda d: (d / "config.json").write_text("[1, 2]"),
    "config wrong types": _wrong_types,
    "index invalid utf-8": lambda d: (d / "model.safetensors.index.json").write_bytes(BAD_UTF8),
    "index deep nesting": lambda d: (d / "model.safetensors.index.json").write_text(DEEP),
    "index wrong types": lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
    "header invalid utf-8": lambda d: _header_bytes(_shard(d), b'{"a": "\xff"}'),
    "header deep nesting": lambda d: _header_bytes(_shard(d), DEEP.encode()),
    "tokenizer invalid utf-8": lambda d: (d / "tokenizer.json").write_bytes(b"\xff\xfe\x00garbage"),
    "tokenizer deep nesting": lambda d: (d / "tokenizer_config.json").write_text(DEEP),
    "symlink loop": lambda d: os.symlink("loop.bin", d / "loop.bin"),
    "dangling symlink": lambda d: os.symlink(d / "no-such-file", d / "dangling.bin"),
    "directory link to itself": lambda d: os.symlink(".", d / "again"),
    "fifo": lambda d: os.mkfifo(d / "pipe"),
}
UNCOPIED = {"symlink loop", "dangling symlink", "directory link to itself", "fifo"}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupted_checkpoint_fetch_records_failed_and_verify_reports(kind: str, good: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(good, source, symlinks=True)
    CORRUPTIONS[kind](source)
    store = tmp_path / "store"
    code, stdout, stderr = cli("fetch", str(source), "--name", "bad", "--store", str(store))
    _assert_one_error(code, stdout, stderr, 1)
    assert "failed verification" in stderr
    code, stdout, _ = cli("models", "--store", str(store), "--json")
    [version] = json.loads(stdout)["models"][0]["versions"]
    assert version["state"] == "failed"
    code, stdout, stderr = cli("verify", str(source))  # the directory itself: structure only
    if code or kind not in UNCOPIED:  # an entry fetch cannot copy need not break a directory's structure
        _assert_one_error(code, stdout, stderr, 1)
    code, stdout, stderr = cli("verify", f"bad@{version['version']}", "--store", str(store))
    if kind in UNCOPIED:  # not stored: re-verifying judges what the store holds (docs/weights.md)
        assert code in (0, 1) and not RAW_EXCEPTION.search(stdout + stderr), stderr
    else:
        _assert_one_error(code, stdout, stderr, 1)


def test_fetch_refuses_links_out_of_the_source_unless_told(good: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(good, source)
    outside = tmp_path / "secret.txt"
    outside.write_text("not part of the checkpoint")
    os.symlink(outside, source / "notes.txt")
    store = tmp_path / "store"
    code, stdout, stderr = cli("fetch", str(source), "--store", str(store))
    _assert_one_error(code, stdout, stderr, 1)
    assert "outside" in stderr and "--follow-symlinks" in stderr
    assert not Store(store).models()  # nothing read, nothing stored
    code, stdout, stderr = cli("fetch", str(source), "--store", str(store), "--follow-symlinks", "--json")
    assert code == 0, stderr
    stored = Path(json.loads(stdout)["path"]) / "notes.txt"
    assert stored.read_text() == "not part of the checkpoint" and not stored.is_symlink()
    # A link that stays inside the tree is read through, without the flag.
    inside = tmp_path / "inside"
    shutil.copytree(good, inside)
    os.symlink("config.json", inside / "config-link.json")
    code, stdout, stderr = cli("fetch", str(inside), "--store", str(store), "--json")
    assert code == 0, stderr
    assert (Path(json.loads(stdout)["path"]) / "config-link.json").is_file()


def test_fetch_repairs_a_failed_version(good: Path, tmp_path: Path) -> None:
    """Issue 19: fetching again, once the source is fixed, replaces a failed version."""
    source = tmp_path / "src"
    shutil.copytree(good, source)
    os.symlink(source / "gone", source / "dangling.bin")
    store = Store(tmp_path / "store")
    first = fetch(str(source), store, name="m")
    assert first.manifest.state == "failed"
    (source / "dangling.bin").unlink()  # the same content, minus the broken link
    second = fetch(str(source), store, name="m")
    assert second.manifest.version == first.manifest.version and second.manifest.state == "verified"
    assert not second.already_present and store.manifest("m", first.manifest.version).verified


@pytest.mark.parametrize("touched", [False, True], ids=["source unchanged", "source touched"])
def test_fetch_repairs_a_version_damaged_since_it_was_verified(touched: bool, good: Path, tmp_path: Path) -> None:
    """A stored file deleted after the version was verified: `dlm models` lists it `damaged`
    and every use refuses it, but fetching its source again answered "already in the store:
    ... verified" (exit 0, `--json` state verified) and left it broken. It is copied again."""
    source = tmp_path / "src"
    shutil.copytree(good, source)
    store = tmp_path / "store"
    code, stdout, stderr = cli("fetch", str(source), "--name", "m", "--store", str(store), "--json")
    assert code == 0, stderr
    files = Path(json.loads(stdout)["path"])
    (files / "tokenizer.json").unlink()
    if touched:  # its size and mtime differ from the manifest's: read again, the same content
        os.utime(source / "config.json")
    code, stdout, stderr = cli("fetch", str(source), "--name", "m", "--store", str(store), "--json")
    assert code == 0, stderr
    out = json.loads(stdout)
    assert not out["already_present"] and out["state"] == "verified", out
    assert (files / "tokenizer.json").is_file()
    code, stdout, stderr = cli("models", "--store", str(store), "--json")
    assert [v["state"] for v in json.loads(stdout)["models"][0]["versions"]] == ["verified"]


def test_the_fetch_command_offered_to_repair_a_version_is_shell_quoted(good: Path, tmp_path: Path) -> None:
    """The `dlm fetch ...` that `dlm models` (and every refusal of a damaged version) offers
    to paste was not quoted: a source path with a space in it gave `dlm fetch /x/my model
    --name m`, which fetches no such directory."""
    import shlex

    source = tmp_path / "my model"
    shutil.copytree(good, source)
    store = tmp_path / "store"
    code, stdout, stderr = cli("fetch", str(source), "--name", "m", "--include", "*", "--store", str(store), "--json")
    assert code == 0, stderr
    (Path(json.loads(stdout)["path"]) / "tokenizer.json").unlink()
    code, stdout, stderr = cli("models", "--store", str(store), "--json")
    reason = json.loads(stdout)["models"][0]["versions"][0]["reason"]
    offered = re.search(r"then `(dlm fetch [^`]+)`", reason)
    assert offered is not None, reason
    assert shlex.split(offered.group(1)) == ["dlm", "fetch", str(source), "--include", "*", "--name", "m"]


def test_the_fetch_command_offered_to_repair_a_version_keeps_link_and_follow_symlinks(
    good: Path, tmp_path: Path
) -> None:
    """The offered `dlm fetch` left out `--link` and `--follow-symlinks` (the manifest kept
    no record of the latter): for a source whose link leaves it, the pasted command was
    refused ("outside ... refused") instead of repairing the version."""
    import shlex

    source = tmp_path / "src"
    shutil.copytree(good, source)
    (tmp_path / "notes.txt").write_text("outside the source")
    os.symlink(tmp_path / "notes.txt", source / "notes.txt")
    store = tmp_path / "store"
    flags = ("--link", "--follow-symlinks", "--name", "m", "--store", str(store), "--json")
    code, stdout, stderr = cli("fetch", str(source), *flags)
    assert code == 0, stderr
    (Path(json.loads(stdout)["path"]) / "tokenizer.json").unlink()
    code, stdout, stderr = cli("models", "--store", str(store), "--json")
    reason = json.loads(stdout)["models"][0]["versions"][0]["reason"]
    offered = re.search(r"then `(dlm fetch [^`]+)`", reason)
    assert offered is not None, reason
    words = shlex.split(offered.group(1))
    assert {"--link", "--follow-symlinks"} <= set(words), words
    code, stdout, stderr = cli(*words[1:], "--store", str(store), "--json")  # pasted as offered
    assert code == 0, stderr
    assert json.loads(stdout)["state"] == "verified"
    code, stdout, stderr = cli("models", "--store", str(store), "--json")
    assert [v["state"] for v in json.loads(stdout)["models"][0]["versions"]] == ["verified"]


NAMES = {
    "300 characters": "a" * 300,
    "trailing newline": "name\n",
    "slash": "a/b",
    "empty": "",
    "NUL": "a\x00b",
}


@pytest.mark.parametrize("label", list(NAMES))
def test_bad_names_are_usage_errors(label: str, good: Path, tmp_path: Path) -> None:
    bad = NAMES[label]
    store = str(tmp_path / "store")
    for args in (
        ("verify", bad),
        *([] if "/" in bad else [("fetch", bad)]),  # a/b is a hub repo id
        ("fetch", str(good), "--name", bad),
        ("release", f"{bad}@v1"),
        ("release", "m@v1", "--deployment", bad),
        ("rollback", "--deployment", bad),
        ("rm", f"{bad}@v1"),
    ):
        code, stdout, stderr = cli(*args, "--store", store)
        _assert_one_error(code, stdout, stderr, 2)


NO_HOME = "~no-such-user-dlm/x"  # a `~USER` with no home directory: Path.expanduser raises RuntimeError


def test_a_tilde_naming_no_home_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`~nouser/x` as MODEL, SOURCE, --store, DLM_STORE or DLM_HOME (or `~/x` where there is no
    HOME and no password entry: a container's arbitrary uid) was a RuntimeError traceback
    ("Could not determine home directory") from every store command, estimate, generate and
    serve; it is bad usage naming where the path came from, or no such path."""
    store = str(tmp_path / "store")
    for args, named in (
        (("verify", NO_HOME, "--store", store), "no such directory"),
        (("fetch", NO_HOME, "--store", store), "no directory at"),
        (("estimate", NO_HOME), "MODEL"),
        (("generate", NO_HOME, "--prompt", "hi"), "MODEL"),
        (("models", "--store", NO_HOME), "--store"),
    ):
        code, stdout, stderr = cli(*args)
        _assert_one_error(code, stdout, stderr, 2)
        assert named in stderr, (args, stderr)
    for variable in ("DLM_STORE", "DLM_HOME"):
        with monkeypatch.context() as env:
            env.setenv(variable, NO_HOME)
            env.delenv("DLM_STORE" if variable == "DLM_HOME" else "DLM_HOME", raising=False)
            code, stdout, stderr = cli("models")
            _assert_one_error(code, stdout, stderr, 2)
            assert variable in stderr, stderr


def test_settings_suites_and_key_files_that_do_not_read_are_one_error_line(tmp_path: Path) -> None:
    """A settings file, suite or key file that is not UTF-8 was a UnicodeDecodeError traceback
    (exit 1); YAML that does not parse printed PyYAML's message over several lines."""
    not_utf8 = tmp_path / "settings.yaml"
    not_utf8.write_bytes(b"max_tokens: \xff\n")
    (tmp_path / "settings.toml").write_bytes(b'served_model_name = "\xff"\n')
    (tmp_path / "keys.txt").write_bytes(b"\xff\xfe\n")
    (tmp_path / "suite.yaml").write_text("prompts: [1, 2\n")
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n"
    )
    for args in (
        ("serve", "tiny:llada", "--config", str(not_utf8)),
        ("serve", "tiny:llada", "--config", str(tmp_path / "settings.toml")),
        ("serve", "tiny:llada", "--api-key-file", str(tmp_path / "keys.txt")),
        ("batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--config", str(not_utf8)),
        ("validate", CLOSED, "--suite", str(not_utf8)),
    ):
        code, stdout, stderr = cli(*args)
        _assert_one_error(code, stdout, stderr, 2)
        assert "is not UTF-8 text (byte 0xff" in stderr
    code, stdout, stderr = cli("validate", CLOSED, "--suite", str(tmp_path / "suite.yaml"))
    _assert_one_error(code, stdout, stderr, 2)
    assert stderr.count("\n") == 1 and "is not valid YAML at line 2, column 1" in stderr


def test_text_in_brackets_is_shown_as_it_is_never_read_as_markup(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paths, file names and a server's words were printed through rich markup: a source path
    holding `[/q]` made every `dlm models` a MarkupError traceback (the store unlistable but
    with --json), as it did `dlm verify DIR`, `dlm doctor` under such a DLM_HOME, and `dlm
    validate` against a server whose message held one."""
    from io import StringIO

    from rich.console import Console

    from dlm.cli.checks.report import render_table
    from dlm.cli.checks.runner import CheckResult

    odd = tmp_path / "ckpt[/q]"
    shutil.copytree(good, odd)
    store = str(tmp_path / "store[/s]")
    code, _, stderr = cli("fetch", str(odd), "--name", "odd", "--store", store)
    assert code == 0, stderr
    code, stdout, stderr = cli("models", "--store", store)
    assert code == 0 and str(odd) in stdout and "store[/s]" in stdout, stderr
    code, _, stderr = cli("verify", str(odd))
    assert code == 0 and "ckpt[/q]" in stderr, stderr
    monkeypatch.setenv("DLM_HOME", str(tmp_path / "home[/h]"))
    code, stdout, stderr = cli("doctor")
    assert not RAW_EXCEPTION.search(stdout + stderr) and "home[/h]" in stdout
    shown = StringIO()
    render_table([CheckResult("chat", "failed", 0.1, "HTTP 400: [/bad] field")], "http://h:1", Console(file=shown))
    assert "[/bad] field" in shown.getvalue()


def test_a_name_one_character_too_long_is_told_the_limit(good: Path, tmp_path: Path) -> None:
    """A 129-character name was refused as 'use letters, digits, ...', which it already was."""
    code, stdout, stderr = cli("release", "m", "--deployment", "d" * 129, "--store", str(tmp_path / "store"))
    _assert_one_error(code, stdout, stderr, 2)
    assert "1 to 128" in stderr


def test_missing_things_say_what_is_missing(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    code, stdout, stderr = cli("verify", "/no/such/dir", "--store", store)
    _assert_one_error(code, stdout, stderr, 2)
    assert "no such directory: /no/such/dir" in stderr
    for args in (("verify", "m@v1"), ("rm", "m@v1"), ("release", "m"), ("rollback",), ("rm", "m", "--keep", "-1")):
        code, stdout, stderr = cli(*args, "--store", store)
        _assert_one_error(code, stdout, stderr, 2)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, stdout, stderr = cli("fetch", str(blocker), "--store", store)
    _assert_one_error(code, stdout, stderr, 2)
    code, stdout, stderr = cli("release", "m@v1", "--store", str(blocker / "store"))  # a store under a file
    _assert_one_error(code, stdout, stderr, 2)
    assert f"is under {blocker}, which is a file" in " ".join(stderr.split()), stderr


STORE_COMMANDS = [("models",), ("verify", "m"), ("fetch", "SOURCE"), ("release", "m"), ("rollback",), ("rm", "m")]


@pytest.mark.parametrize("args", STORE_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("where", ["empty", "a file", "under a file"])
def test_a_store_option_that_names_no_directory_is_refused(
    args: tuple[str, ...], where: str, good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--store ''` was the current directory (a fetch filled ./models without a word),
    `--store FILE` said "File exists", and `--store FILE/DIR` listed an empty store or failed
    with "Not a directory" (exit 1); all are bad usage now, named, and nothing is created."""
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a-file"
    target = {"empty": "", "a file": str(blocker), "under a file": str(blocker / "store")}[where]
    if where != "empty":
        blocker.write_text("")
    args = tuple(str(good) if a == "SOURCE" else a for a in args)
    code, stdout, stderr = cli(*args, "--store", target)
    _assert_one_error(code, stdout, stderr, 2)
    said = {
        "empty": "must name a directory",
        "a file": "is a file, not a store directory",
        "under a file": f"--store {blocker / 'store'} is under {blocker}, which is a file, not a directory",
    }[where]
    assert said in " ".join(stderr.split()), stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if where == "empty" else ["a-file"])
    assert where == "empty" or blocker.read_text() == ""


@pytest.mark.parametrize("args", STORE_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("where", ["a link loop", "under a link loop", "a dangling link"])
def test_a_store_option_that_is_a_link_leading_nowhere_is_refused(
    args: tuple[str, ...], where: str, good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--store LOOP` (a symbolic link to itself, or LOOP/store) was a traceback from `dlm
    fetch` (RuntimeError: Symlink loop), and with a dangling link `dlm fetch` said "File
    exists" (exit 1) while `dlm models` listed an empty store (a mount not there, say): all are
    bad usage, named, and nothing is created."""
    monkeypatch.chdir(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(link if where != "a dangling link" else tmp_path / "nowhere")
    target = str(link / "store") if where == "under a link loop" else str(link)
    args = tuple(str(good) if a == "SOURCE" else a for a in args)
    code, stdout, stderr = cli(*args, "--store", target)
    _assert_one_error(code, stdout, stderr, 2)
    under = f"is under {link}," if where == "under a link loop" else "is"
    said = f"--store {target} {under} a symbolic link that leads nowhere (dangling, or a loop)"
    assert said in " ".join(stderr.split()), stderr
    assert [p.name for p in tmp_path.iterdir()] == ["link"]


@pytest.mark.parametrize("args", STORE_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("source", ["--store", "DLM_STORE"])
def test_a_blank_store_is_refused_naming_where_it_came_from(
    args: tuple[str, ...], source: str, good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DLM_STORE=' '` was refused as "--store must name a directory, got an empty string":
    an option not given, a value not empty. The error names the variable or the option the
    value came from and calls it blank; nothing is created (a directory named ' ')."""
    monkeypatch.chdir(tmp_path)
    args = tuple(str(good) if a == "SOURCE" else a for a in args)
    if source == "DLM_STORE":
        monkeypatch.setenv("DLM_STORE", " ")
        code, stdout, stderr = cli(*args)
    else:
        monkeypatch.delenv("DLM_STORE", raising=False)
        code, stdout, stderr = cli(*args, "--store", " ")
    _assert_one_error(code, stdout, stderr, 2)
    assert f"error: {source} must name a directory, got a blank value ' '" in stderr, stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [("serve", "--deployment", "prod"), ("estimate", "m")], ids=" ".join)
def test_a_blank_dlm_store_is_refused_by_name_where_a_command_reads_the_variable(
    command: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commands that read DLM_STORE themselves (serve's settings, a store name's resolution)
    took ' ' as a directory named by a space; they refuse it naming the variable."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DLM_STORE", " ")
    code, stdout, stderr = cli(*command)
    _assert_one_error(code, stdout, stderr, 2)
    assert "DLM_STORE must name a directory, got a blank value ' '" in stderr, stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [*STORE_COMMANDS, ("verify", "tiny:llada")], ids=" ".join)
def test_a_blank_dlm_home_is_refused_naming_it(
    args: tuple[str, ...], good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DLM_HOME=' '` (DLM_STORE unset) was a directory named by a space under the current
    directory: a fetch filled './ /store', a tiny model was built in './ /builtin'. It is
    refused as a blank DLM_STORE is, naming the variable; nothing is created."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DLM_STORE", raising=False)
    monkeypatch.setenv("DLM_HOME", " ")
    code, stdout, stderr = cli(*(str(good) if a == "SOURCE" else a for a in args))
    _assert_one_error(code, stdout, stderr, 2)
    assert "error: DLM_HOME must name a directory, got a blank value ' '" in stderr, stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", STORE_COMMANDS, ids=" ".join)
def test_a_dlm_home_under_a_file_is_refused_naming_dlm_home_not_store(
    args: tuple[str, ...], good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DLM_HOME=FILE` (no --store, no DLM_STORE) was refused as "--store FILE/store is under
    FILE": an option the user never gave. The error says the store is DLM_HOME's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DLM_STORE", raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DLM_HOME", str(blocker))
    code, stdout, stderr = cli(*(str(good) if a == "SOURCE" else a for a in args))
    _assert_one_error(code, stdout, stderr, 2)
    said = " ".join(stderr.split())
    assert "--store" not in said, said
    assert f"$DLM_HOME/store: {blocker / 'store'} is under {blocker}, which is a file" in said, said
    assert "check DLM_HOME" in said, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and blocker.read_text() == ""


@pytest.mark.parametrize("where", ["empty", "blank", "a file", "under a file"])
def test_serve_refuses_a_deployment_store_that_is_or_lies_under_a_file(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlm serve --deployment D --store FILE` (or FILE/DIR) said "FILE/deployments/D.json is
    corrupt: Not a directory" (exit 1), and `--store ''` served the current directory as the
    store ("deployment 'D' has no release"); its --store is refused as the store commands' is."""
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = {"empty": "", "blank": "  ", "a file": str(blocker), "under a file": str(blocker / "store")}[where]
    code, stdout, stderr = cli("serve", "--deployment", "prod", "--store", target)
    _assert_one_error(code, stdout, stderr, 2)
    said = {
        "empty": "invalid setting store: must name a directory, got an empty string",
        "blank": "invalid setting store: must name a directory, got a blank value ' '",  # spaces joined
        "a file": f"--store {target} is a file, not a store directory",
        "under a file": f"--store {target} is under {blocker}, which is a file",
    }[where]
    assert said in " ".join(stderr.split()), stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and blocker.read_text() == ""


def test_an_empty_dlm_store_is_the_default_store_for_serve_as_for_the_store_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DLM_STORE=''` made `dlm serve --deployment` read the current directory as the store;
    every store command reads an empty DLM_STORE as unset ($DLM_HOME/store), and so does serve."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DLM_STORE", "")
    default = tmp_path / "home" / "store"
    for args in (("serve", "--deployment", "prod"), ("rollback", "--deployment", "prod")):
        code, stdout, stderr = cli(*args)
        _assert_one_error(code, stdout, stderr, 2)
        assert f"there is no store at {default}" in " ".join(stderr.split()), stderr
    assert list(tmp_path.iterdir()) == []


def test_listing_a_store_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "no" / "store"
    code, stdout, stderr = cli("models", "--store", str(root), "--json")
    assert code == 0 and json.loads(stdout)["models"] == [], stderr
    assert not (tmp_path / "no").exists()


# Every store command over a store that does not exist: (arguments, exit code, what stderr says).
MISSING_STORE_CASES: list[tuple[tuple[str, ...], int, str]] = [
    (("verify", "m"), 2, "there is no store at"),
    (("verify", "m@v1"), 2, "there is no store at"),
    (("rm", "m@v1"), 2, "there is no store at"),
    (("rm", "m", "--keep", "1"), 2, "there is no store at"),
    (("release", "m"), 2, "there is no store at"),
    (("release", "m@v1"), 2, "there is no store at"),
    (("release", "m@v1", "--deployment", "prod"), 2, "there is no store at"),
    (("rollback",), 2, "there is no store at"),
    (("rollback", "--to", "v1"), 2, "there is no store at"),
    (("rollback", "--to", "m@v1", "--deployment", "prod"), 2, "there is no store at"),
    (("serve", "--deployment", "prod"), 2, "there is no store at"),
    (("fetch", "EMPTY"), 2, "no files to fetch"),  # a fetch creates the store, but not to fail
    (("fetch", "MISSING"), 2, "no directory at"),
]


@pytest.mark.parametrize("how", ["--store", "DLM_STORE"])
@pytest.mark.parametrize("case", MISSING_STORE_CASES, ids=lambda c: " ".join(c[0]))
def test_a_store_that_does_not_exist_is_named_and_never_created(
    case: tuple[tuple[str, ...], int, str], how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlm rm`, `release` and `rollback` took the store lock first, which made the store's
    directory (and its parents) before they found nothing to act on; like `dlm models`, a
    command that reads or changes the versions a store holds creates no store, and says
    that there is none rather than that it lacks the model or release."""
    args, expected_code, said = case
    (tmp_path / "empty").mkdir()
    sources = {"EMPTY": str(tmp_path / "empty"), "MISSING": str(tmp_path / "no-such-source")}
    args = tuple(sources.get(a, a) for a in args)
    root = tmp_path / "no" / "store"
    if how == "DLM_STORE":
        monkeypatch.setenv("DLM_STORE", str(root))
        code, stdout, stderr = cli(*args)
    else:
        code, stdout, stderr = cli(*args, "--store", str(root))
    _assert_one_error(code, stdout, stderr, expected_code)
    assert said in stderr, stderr
    if said == "there is no store at":
        assert f"there is no store at {root}" in " ".join(stderr.split()), stderr
    assert not (tmp_path / "no").exists()


def test_the_listing_says_why_a_version_failed(good: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    version = fetch(str(good), store, name="m").manifest.version
    shard = _shard(store.files_dir("m", version))
    shard.write_bytes(shard.read_bytes()[:-4])
    assert cli("verify", f"m@{version}", "--store", str(store.root))[0] == 1
    code, stdout, _ = cli("models", "--store", str(store.root), "--json")
    (listed,) = json.loads(stdout)["models"][0]["versions"]
    assert listed["state"] == "failed" and shard.name in listed["reason"] and "bytes" in listed["reason"]


def test_deployment_names_cannot_collide_with_server_records(good: Path, tmp_path: Path) -> None:
    """Issue 16 point 5: deployments `X` and `X.server` are independent, and a running
    server's record is neither of them."""
    from dlm.cli.store import admin

    store = Store(tmp_path / "store")
    version = fetch(str(good), store, name="m").manifest.version
    release(store, f"m@{version}", "X")
    admin.register_server(store, "X", "http://127.0.0.1:9", "k", serving=f"m@{version}")
    try:
        release(store, f"m@{version}", "X.server")
        assert load_state(store, "X").history and load_state(store, "X.server").history
        code, stdout, _ = cli("models", "--store", str(store.root), "--json")
        assert [d["deployment"] for d in json.loads(stdout)["deployments"]] == ["X", "X.server"]
    finally:
        admin.unregister_server(store, "X")
    current = load_state(store, "X.server").current
    assert current is not None and current.version == version


@pytest.mark.slow
def test_models_listing_goes_to_stdout_whole_when_piped(good: Path, tmp_path: Path) -> None:
    """Issue 19: `dlm models | grep` finds whole rows; nothing is cut to `…` or folded."""
    from tests.weights_helpers import ROOT

    store = Store(tmp_path / "store" / ("deep-" * 12))  # a long store path in the title
    manifest = fetch(str(good), store, name="a-model-with-a-rather-long-name-" + "x" * 40).manifest
    run = subprocess.run(
        [sys.executable, "-m", "dlm", "models", "--store", str(store.root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "60"},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    row = [line for line in run.stdout.splitlines() if f"{manifest.name}@{manifest.version}" in line]
    assert len(row) == 1 and manifest.fetched_at in row[0] and "…" not in run.stdout


def _dlm(*args: str) -> tuple[int, str, str]:
    """`dlm ARGS` in a process of its own (loadtest imports locust, which monkey-patches the
    process for gevent: never in the test process)."""
    from tests.weights_helpers import ROOT

    run = subprocess.run([sys.executable, "-m", "dlm", *args], cwd=ROOT, capture_output=True, text=True, timeout=180)
    return run.returncode, run.stdout, run.stderr


CLOSED = "http://127.0.0.1:9"


def _tls_cases(tmp_path: Path) -> list[tuple[tuple[str, ...], int]]:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate")
    return [
        (("ftp://x",), 2),
        ((CLOSED, "--cacert", str(tmp_path / "no-ca.pem")), 2),
        ((CLOSED, "--cacert", str(not_pem)), 2),
        ((CLOSED, "--cacert", str(not_pem), "--insecure"), 2),
        ((CLOSED, "--timeout", "0"), 2),
    ]


def test_validate_bad_inputs(tmp_path: Path) -> None:
    for args, code in _tls_cases(tmp_path):
        _assert_one_error(*cli("validate", *args), code)
    for args in (
        ("--suite", str(tmp_path / "none.yaml")),
        ("--skip", "no-such-check"),
        ("--model", ""),  # was the first model of /v1/models
        ("--model", " "),
    ):
        _assert_one_error(*cli("validate", CLOSED, *args), 2)
    report = tmp_path / "reports" / "nested" / "x.xml"
    code, stdout, stderr = cli("validate", CLOSED, "--ready-timeout", "0", "--junit-xml", str(report))
    assert code == 1 and not RAW_EXCEPTION.search(stdout + stderr) and report.is_file()  # folder created
    code, stdout, stderr = cli("validate", CLOSED, "--junit-xml", str(tmp_path))  # a directory
    _assert_one_error(code, stdout, stderr, 2)


def test_a_path_no_result_can_be_written_at_is_refused_before_any_work(good: Path, tmp_path: Path) -> None:
    """Every command that writes its result to a path refuses one it cannot write as bad usage
    (2), before it works, as `validate --junit-xml` does: `deploy haproxy --out DIR` and
    `deploy kubernetes --out FILE` (and /proc paths) failed with exit 1 after rendering."""
    a_file = tmp_path / "file.txt"
    a_file.write_text("kept")
    k8s = ("deploy", "kubernetes", str(good), "--device", "cpu", "--estimate-from", str(good))
    for args in (
        ("deploy", "haproxy", "--group", "a=10.0.0.1:8000", "--out", str(tmp_path)),
        ("deploy", "haproxy", "--group", "a=10.0.0.1:8000", "--out", "/proc/dlm-test.cfg"),
        (*k8s, "--out", str(a_file)),
        (*k8s, "--out", "/proc/dlm-test"),
        ("validate", CLOSED, "--junit-xml", "/proc/dlm-test.xml"),
    ):
        code, stdout, stderr = cli(*args)
        _assert_one_error(code, stdout, stderr, 2)
        assert "--out" in stderr or "--junit-xml" in stderr
    assert a_file.read_text() == "kept"
    out = tmp_path / "new" / "haproxy.cfg"  # its folder is made, as --junit-xml's is
    code, stdout, stderr = cli("deploy", "haproxy", "--group", "a=10.0.0.1:8000", "--out", str(out), "--json")
    assert code == 0 and json.loads(stdout)["config"] == out.read_text()


def test_deploy_haproxy_takes_json_as_every_command_does() -> None:
    code, stdout, stderr = cli("deploy", "haproxy", "--group", "a:3=10.0.0.1:8000,10.0.0.2:8000", "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["out"] is None and report["bind"] == "0.0.0.0:8080" and "backend group_a" in report["config"]
    assert report["groups"] == [{"name": "a", "weight": 3, "servers": ["10.0.0.1:8000", "10.0.0.2:8000"]}]


@pytest.mark.slow
def test_loadtest_bad_inputs(tmp_path: Path) -> None:
    cases = _tls_cases(tmp_path) + [
        ((CLOSED, *args), 2)
        for args in (
            ("--users", "0"),
            ("--duration", "soon"),
            ("--prompts", str(tmp_path / "none.jsonl")),
            ("--sweep", "1,x"),
            ("--sweep", ""),  # was no sweep: one level of --users
            ("--slo", "x"),
            ("--out", str(tmp_path / "none.jsonl")),  # a file where a folder goes: refused before any load
            # empty values were defaults: no SLO, no gate (exit 0 whatever was measured), the first model
            ("--slo", ""),
            ("--fail-on", ""),
            ("--fail-on", " , "),
            ("--model", ""),
        )
    ]
    (tmp_path / "none.jsonl").write_text("")
    for args, code in cases:
        _assert_one_error(*_dlm("loadtest", *args), code)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.mark.slow  # runs openssl
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_validate_reaches_a_tls_server_with_a_private_ca(tmp_path: Path) -> None:
    """`--cacert` trusts a private CA, `--insecure` trusts anything, and without either a
    certificate problem fails readiness at once (not after the whole ready timeout)."""
    import ssl
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dlm.cli.checks.contract import readiness
    from dlm.cli.checks.runner import CheckFailed, Context, ValidateOptions
    from dlm.cli.client.api import ApiClient, tls_verify

    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=dlm test CA", cwd=tmp_path)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1",
             cwd=tmp_path)  # fmt: skip
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "srv.pem", "-days", "1", "-extfile", "san.ext", cwd=tmp_path)  # fmt: skip

    class Ready(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "srv.pem", tmp_path / "srv.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}"
    options = ValidateOptions(ready_timeout=30)
    try:
        for verify in (tls_verify(tmp_path / "ca.pem"), tls_verify(insecure=True)):
            with ApiClient(url, verify=verify) as client:
                assert readiness(Context(client, options)).startswith("ready")
        with ApiClient(url) as client:  # an hour's patience: only an immediate refusal lets this pass
            with pytest.raises(CheckFailed, match="--cacert FILE"):
                readiness(Context(client, ValidateOptions(ready_timeout=3600)))
    finally:
        server.shutdown()
        server.server_close()


# Corruptions of what the engine reads first: generate, estimate and serve refuse them with
# one line, before any weights load (the store's checks above cover fetch and verify).
ENGINE_CORRUPTIONS = [k for k in CORRUPTIONS if k.startswith("config")]


@pytest.mark.parametrize("kind", ENGINE_CORRUPTIONS)
@pytest.mark.parametrize(
    "command",
    [
        ["generate", "{dir}", "--prompt-ids", "1,2,3", "--gen-length", "8"],
        ["estimate", "{dir}"],
        ["serve", "{dir}", "--port", "0"],
    ],
    ids=["generate", "estimate", "serve"],
)
def test_engine_commands_refuse_corrupted_configs(kind: str, command: list[str], good: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(good, source, symlinks=True)
    CORRUPTIONS[kind](source)
    code, stdout, stderr = cli(*[part.format(dir=source) for part in command])
    _assert_one_error(code, stdout, stderr, 2)


BAD_BATCH_FILES = {
    "not JSON": "{nope\n",
    "not an object": "[1, 2]\n",
    "no custom_id": '{"url": "/v1/completions", "body": {"prompt": "x"}}\n',
    "duplicate custom_id": '{"custom_id": "a", "url": "/v1/completions", "body": {}}\n' * 2,
    "other url": '{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\n',
    "streaming": '{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "stream": true}}\n',
    "empty": "\n",
    "invalid utf-8": b"\xff\xfe".decode("latin-1"),
}


@pytest.mark.parametrize("label", list(BAD_BATCH_FILES))
def test_batch_refuses_a_bad_input_file_before_loading(label: str, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    content = BAD_BATCH_FILES[label]
    if label == "invalid utf-8":
        source.write_bytes(content.encode("latin-1"))
    else:
        source.write_text(content)
    code, stdout, stderr = cli("batch", str(source), str(tmp_path / "out.jsonl"))
    _assert_one_error(code, stdout, stderr, 2)
    assert not (tmp_path / "out.jsonl").exists()


def test_an_interrupted_command_ends_with_the_contracts_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C during a command's work: exit 130 and one `error: interrupted` line, as an
    interrupt while click parses says it (it printed a bare `interrupted` there)."""
    import typer

    from dlm.cli.output import cli_errors

    with pytest.raises(typer.Exit) as stopped, cli_errors():
        raise KeyboardInterrupt
    assert stopped.value.exit_code == 130
    assert capsys.readouterr().err.strip() == "error: interrupted"


@pytest.mark.parametrize(
    "args",
    [
        ("verify", "m", "--workers", "0"),
        ("fetch", "SOURCE", "--workers", "-5"),
        ("generate", "--prompt", "hi", "--master-port", "70000"),
        ("generate", "--prompt", "hi", "--master-port", "0"),
    ],
    ids=" ".join,
)
def test_counts_and_ports_out_of_range_are_refused(args: tuple[str, ...], good: Path, tmp_path: Path) -> None:
    """Taken silently before: --workers 0 or -5 (clamped), --master-port 70000 (no such port)."""
    args = tuple(str(good) if a == "SOURCE" else a for a in args)
    code, stdout, stderr = cli(*args, *(["--store", str(tmp_path / "s")] if args[0] != "generate" else []))
    _assert_one_error(code, stdout, stderr, 2)
    assert ("--workers" if "--workers" in args else "--master-port") in stderr


def test_ctrl_c_while_the_commands_load_is_the_contracts_interrupt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C in the first moments of any command (its modules importing) printed a
    KeyboardInterrupt traceback and died by the signal; the script's entry catches it."""
    import signal
    import types

    from dlm.cli import entry, interrupts

    loading = types.ModuleType("dlm.cli.main")

    def interrupted() -> None:
        raise KeyboardInterrupt

    loading.main = interrupted  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dlm.cli.main", loading)
    for state in ("_installed", "_received", "_reported"):  # entry.main takes over this process's SIGINT
        monkeypatch.setattr(interrupts, state, getattr(interrupts, state))
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:
            entry.main()
        assert signal.getsignal(signal.SIGINT) == (signal.SIG_IGN if interrupts._installed else previous)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"
    from tests.weights_helpers import ROOT

    assert 'dlm = "dlm.cli.entry:main"' in (ROOT / "pyproject.toml").read_text()  # the installed `dlm`
    assert "from dlm.cli.entry import main" in (ROOT / "dlm" / "__main__.py").read_text()


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "", "--prompt", "x", "--gen-length", "4"],
        ["generate", " ", "--prompt", "x", "--gen-length", "4"],
        ["serve", "", "--port", "0"],
        ["batch", "{input}", "{output}", "--model", ""],
    ],
    ids=["generate", "generate-blank", "serve", "batch"],
)
def test_an_empty_model_is_refused_not_served_as_the_default_model(args: list[str], tmp_path: Path) -> None:
    """An empty MODEL is a variable that was not set (`dlm generate "$MODEL"`): it ran the
    embedded default model with exit 0 (the engine read "" as no MODEL)."""
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n")
    filled = [a.format(input=source, output=tmp_path / "out.jsonl") for a in args]
    code, stdout, stderr = cli(*filled)
    _assert_one_error(code, stdout, stderr, 2)
    assert "MODEL is empty" in stderr
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_bytes()


@pytest.mark.parametrize(
    "args",
    [
        ["validate", "http://127.0.0.1:9", "--suite", ""],
        ["validate", "http://127.0.0.1:9", "--junit-xml", ""],
        ["validate", "http://127.0.0.1:9", "--cacert", ""],
        ["loadtest", "http://127.0.0.1:9", "--out", ""],
        ["deploy", "kubernetes", "tiny:llada", "--out", ""],
        ["deploy", "kubernetes", "tiny:llada", "--config", ""],
        ["deploy", "haproxy", "--out", ""],
        ["batch", "", "out.jsonl"],
        ["batch", "in.jsonl", ""],
        ["batch", "in.jsonl", "out.jsonl", "--config", ""],
        ["serve", "--config", ""],
    ],
    ids=lambda args: " ".join(a or "''" for a in args[:1] + args[-2:]),
)
def test_an_empty_path_is_refused_not_read_as_the_current_directory(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`Path("")` is `.`: `--suite ""` said "cannot read suite .: Is a directory" and
    `deploy kubernetes --out ""` wrote into the current directory (an unset "$VARIABLE").
    Run through `dlm.cli.main.main`, which reports a refused command line as `dlm` does."""
    from dlm.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    monkeypatch.setattr(sys, "argv", ["dlm", *args])
    with pytest.raises(SystemExit) as stopped:
        main()
    captured = capsys.readouterr()
    _assert_one_error(int(stopped.value.code or 0), captured.out, captured.err, 2)
    assert "is empty" in captured.err, captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written here


def test_an_empty_prompts_spec_is_refused_not_read_as_the_current_directory() -> None:
    """`loadtest --prompts ""` said "cannot read prompts .: Is a directory". (Checked on the
    reader: the command in process would import locust, whose gevent patches this process.)"""
    from dlm.cli.loadtest.workload import from_prompts
    from dlm.engine.errors import UsageError

    for spec in ("", " "):
        with pytest.raises(UsageError, match="--prompts is empty"):
            from_prompts(spec, {}, None)


@pytest.mark.parametrize("nnodes", [1, 2])
@pytest.mark.parametrize("address", ["", " "])
def test_an_empty_master_address_is_refused(nnodes: int, address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--master-addr ""` (an unset "$ADDR") was taken as an address: on two nodes node 0
    waited for the other until the store timed out (601 s), then a DistStoreError line."""
    from dlm.engine.errors import UsageError
    from dlm.engine.parallel.distributed import TORCHRUN_VARS, ParallelConfig

    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    config = ParallelConfig(tensor_parallel_size=2, nnodes=nnodes, master_addr=address, master_port=29555)
    with pytest.raises(UsageError, match="--master-addr is empty"):
        config.resolved()


@pytest.mark.parametrize(
    "fields,refused",
    [
        ({"cache": ""}, "cache must be one of"),
        ({"remasking": ""}, "remasking must be one of"),
        ({"decode_mode": "x"}, "decode_mode must be one of"),
        ({"threshold": 2.0}, "threshold must be in"),
        ({"steps": 0}, "steps must be"),
    ],
)
def test_loadtest_refuses_a_dllm_value_every_request_would_be_refused_for(fields: dict, refused: str) -> None:
    """`loadtest --cache ''` ran the whole load, every request a 400, then exit 1. (Checked
    on the reader the command calls before the load: in process the command imports locust.)"""
    from dlm.cli.loadtest.workload import check_request_fields
    from dlm.engine.errors import UsageError

    with pytest.raises(UsageError, match=refused):
        check_request_fields(fields)
    check_request_fields({"cache": "dual", "remasking": "random", "decode_mode": "ar", "threshold": 0.9, "steps": 8})


def test_a_yaml_file_naming_a_key_twice_is_refused_as_json_and_toml_are(tmp_path: Path) -> None:
    """PyYAML keeps a key's last value: a settings file's second `host:` silently replaced the
    first (0.0.0.0 served), a suite's second `expect` dropped the first, where a TOML file, a
    JSON body and a batch line with a key twice are refused. A merge key (`<<`) still overrides."""
    from dlm.cli.checks.suite import load_suite
    from dlm.cli.server.config import load_config
    from dlm.engine.errors import UsageError

    settings = tmp_path / "settings.yaml"
    settings.write_text("host: 127.0.0.1\nmax_tokens: 64\nhost: 0.0.0.0\n")
    with pytest.raises(UsageError, match="at line 3, column 1: the key 'host' appears twice"):
        load_config(settings, environ={})
    code, stdout, stderr = cli("serve", "tiny:llada", "--config", str(settings))
    _assert_one_error(code, stdout, stderr, 2)
    suite = tmp_path / "suite.yaml"
    suite.write_text("prompts:\n  - prompt: hi\n    expect: {contains: a}\n    expect: {contains: b}\n")
    with pytest.raises(UsageError, match="the key 'expect' appears twice"):
        load_suite(suite)
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &b {max_tokens: 8, host: 127.0.0.1}\nserve:\n  <<: *b\n  max_tokens: 16\n")
    from dlm.cli.text_files import load_yaml

    assert load_yaml(merged.read_text(), "x")["serve"] == {"max_tokens": 16, "host": "127.0.0.1"}
