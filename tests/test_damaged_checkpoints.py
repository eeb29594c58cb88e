"""A damaged checkpoint (a malformed shard index, a shard it names missing, a weight file
replaced by a directory) is refused the same way from every entry point: `dlm generate`,
`dlm estimate` and the Python API `LLM(DIR)` fail with one `error:` line naming the damaged
file and the fix, exit 1 (a failed operation, not bad usage), never a traceback.

The index is parsed and checked in one place (`dlm.engine.loader.shard_index`) that the
loader and estimate's header reader share; before, each tripped over a bad index its own
way (AttributeError, TypeError, UnicodeDecodeError tracebacks, exit 2 for a missing shard,
"No such device" naming no file for a directory).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dlm.engine.errors import DlmError
from dlm.engine.loader import INDEX_NAME, SINGLE_NAME, shard_index
from tests.weights_helpers import ROOT, cli, make_checkpoint

FIRST_SHARD = "model-00001-of-00002.safetensors"
ERROR_LINE = re.compile(r"\W*error\b", re.IGNORECASE)


def _index(content: str | bytes) -> Callable[[Path], list[str]]:
    """Overwrite the index with `content`; the error must name the index."""

    def damage(directory: Path) -> list[str]:
        index = directory / INDEX_NAME
        if isinstance(content, bytes):
            index.write_bytes(content)
        else:
            index.write_text(content)
        return [str(index)]

    return damage


def _missing_shard(directory: Path) -> list[str]:
    (directory / FIRST_SHARD).unlink()
    return [str(directory / INDEX_NAME), FIRST_SHARD]


def _replace_by_directory(name: str) -> Callable[[Path], list[str]]:
    def damage(directory: Path) -> list[str]:
        (directory / name).unlink()
        (directory / name).mkdir()
        return [str(directory / name)]

    return damage


# Each damage: (shards of the checkpoint it damages, what it does -> what the error must name).
DAMAGES: dict[str, tuple[int, Callable[[Path], list[str]]]] = {
    "weight_map not a mapping": (2, _index('{"weight_map": 5}')),
    "index is a list": (2, _index("[1, 2]")),
    "shard name not a string": (2, _index('{"weight_map": {"a": 5}}')),
    "index not UTF-8": (2, _index(b"\xff\xfe")),
    "shard missing": (2, _missing_shard),
    "shard is a directory": (2, _replace_by_directory(FIRST_SHARD)),
    "single weight file is a directory": (1, _replace_by_directory(SINGLE_NAME)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("good")
    return {shards: make_checkpoint(root / f"shards{shards}", shards=shards) for shards in (1, 2)}


def _damaged(kind: str, checkpoints: dict[int, Path], tmp_path: Path) -> tuple[Path, list[str]]:
    shards, damage = DAMAGES[kind]
    directory = tmp_path / "damaged"
    shutil.copytree(checkpoints[shards], directory)
    return directory, damage(directory)


def _assert_names_damage(message: str, named: list[str]) -> None:
    for part in named:
        assert part in message, (part, message)
    assert "dlm verify" in message, message  # the fix


@pytest.mark.parametrize("kind", list(DAMAGES))
@pytest.mark.parametrize(
    "command",
    [["generate", "{dir}", "--prompt-ids", "1,2,3", "--gen-length", "8"], ["estimate", "{dir}"]],
    ids=["generate", "estimate"],
)
def test_cli_refuses_a_damaged_checkpoint(
    kind: str, command: list[str], checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    directory, named = _damaged(kind, checkpoints, tmp_path)
    code, stdout, stderr = cli(*[part.format(dir=directory) for part in command])  # re-raises a crash
    assert "Traceback" not in stdout + stderr, stderr[-2000:]
    assert code == 1, (code, stderr[-2000:])  # a failed operation, not bad usage
    errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(errors) == 1 and errors[0].startswith("error: "), stderr[-2000:]
    _assert_names_damage(errors[0], named)


@pytest.mark.parametrize("kind", list(DAMAGES))
def test_api_refuses_a_damaged_checkpoint(kind: str, checkpoints: dict[int, Path], tmp_path: Path) -> None:
    from dlm.engine.llm import LLM

    directory, named = _damaged(kind, checkpoints, tmp_path)
    with pytest.raises(DlmError) as caught:
        LLM(directory, dtype="float32", device="cpu")
    assert caught.value.exit_code == 1, caught.value
    _assert_names_damage(str(caught.value), named)


@pytest.mark.parametrize(
    "weight_map",
    [{}, {"a": ""}, {"a": "../elsewhere.safetensors"}, {"a": "/etc/passwd"}, {"a": ["x.safetensors"]}],
    ids=["empty", "empty name", "parent", "absolute", "list"],
)
def test_index_naming_no_shard_of_its_directory_is_damaged(weight_map: object, tmp_path: Path) -> None:
    """What the index may name: shard files inside the checkpoint, at least one."""
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(DlmError, match=re.escape(str(tmp_path / INDEX_NAME))) as caught:
        shard_index(tmp_path)
    assert caught.value.exit_code == 1


def test_index_resolves_to_the_shards(checkpoints: dict[int, Path]) -> None:
    directory = checkpoints[2]
    locations = shard_index(directory)
    assert locations is not None
    assert {path.name for path in locations.values()} == {FIRST_SHARD, "model-00002-of-00002.safetensors"}
    assert shard_index(checkpoints[1]) is None  # no index: the caller scans the files


def test_estimate_reads_the_index_without_torch(checkpoints: dict[int, Path]) -> None:
    """The index check lives in the loader, and estimate's headers stay torch-free."""
    code = (
        "import sys; from dlm.cli.estimate.headers import local_headers;"
        f"h = local_headers({str(checkpoints[2])!r}); print(len(h.tensors), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    count, torch_loaded = out.stdout.split()
    assert int(count) > 0 and torch_loaded == "False"


def test_serve_ends_a_failed_load_with_the_contracts_error_line(
    checkpoints: dict[int, Path], tmp_path: Path, server_logging: None
) -> None:
    """`dlm serve` loads after binding, so a damaged checkpoint fails in its JSON log; its
    stderr now also ends with the one `error:` line scripts look for (grep found none)."""
    directory, named = _damaged(next(iter(DAMAGES)), checkpoints, tmp_path)
    code, _, stderr = cli("serve", str(directory), "--port", "0", "--no-warmup")
    assert code == 1, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot read the weights"), stderr[-2000:]
    _assert_names_damage(last, named)
