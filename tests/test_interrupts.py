"""Ctrl-C (SIGINT) to a running `dlm` command: `error: interrupted` once and exit 130 (docs/cli.md),
wherever it lands; never death by the signal (-2), a traceback, or a store changed after it.

Each case runs `python -m dlm` as a process of its own with the signal sent at a set point
(tests/interrupt_points.py): timers sent from outside hit these points only by chance.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.cli.store.fetch import fetch
from dlm.cli.store.store import Store
from tests.weights_helpers import ROOT, make_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("interrupts") / "ckpt", shards=2, tokenizer=False)


@pytest.fixture
def stored(source: Path, tmp_path: Path) -> tuple[Store, str]:
    store = Store(tmp_path / "store")
    return store, fetch(str(source), store, name="m").manifest.ref


def _dlm_interrupted(point: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.interrupt_points", point, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_interrupted(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 130, (run.returncode, run.stderr[-3000:])
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted"], run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["importing", "working", "twice"])
@pytest.mark.parametrize("command", ["verify", "fetch"])
def test_a_ctrl_c_ends_a_store_command_with_130(
    command: str, point: str, stored: tuple[Store, str], source: Path, tmp_path: Path
) -> None:
    """`importing`: a KeyboardInterrupt that left code exec() had made from a string (the
    commands' imports run hundreds) was caught and reported, and Python then ended the
    process by the signal anyway (-2: it notes such an interrupt as unhandled and never
    forgets it when `python -m` runs the program)."""
    store, ref = stored
    before = store.find(ref).to_json()
    if command == "verify":
        args: tuple[str, ...] = ("verify", ref)
    else:
        args = ("fetch", str(source), "--name", "other")
    _assert_interrupted(_dlm_interrupted(point, *args, "--store", str(store.root)))
    assert store.versions("other") == ([], [])  # nothing fetched (a staging copy may stay: a rerun resumes it)
    assert store.find(ref).to_json() == before  # nothing recorded


@pytest.mark.slow
@pytest.mark.parametrize("point", ["swallowed", "finalizer"])
def test_a_swallowed_ctrl_c_still_ends_the_command_before_it_changes_the_store(
    point: str, stored: tuple[Store, str]
) -> None:
    """A library that catches the KeyboardInterrupt and goes on (torch, when the interrupt
    lands in its import of numpy; numpy then fails to import for the rest of the process), or a
    finalizer (Python prints its exceptions as "Exception ignored" and drops them), let
    `dlm verify` finish and record what it found: a sound version marked failed. The store
    takes no change once Ctrl-C has been pressed."""
    store, ref = stored
    before = store.find(ref).to_json()
    _assert_interrupted(_dlm_interrupted(point, "verify", ref, "--store", str(store.root)))
    assert store.find(ref).to_json() == before


@pytest.mark.slow
def test_a_ctrl_c_after_the_command_finished_changes_nothing(stored: tuple[Store, str]) -> None:
    """Once the command's outcome is decided (its output written, its exit code chosen), a
    Ctrl-C during the interpreter's shutdown printed a KeyboardInterrupt traceback, or ended the
    process by the signal; it is ignored now."""
    store, ref = stored
    run = _dlm_interrupted("after", "models", "--store", str(store.root), "--json")
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr, run.stderr[-3000:]
    assert json.loads(run.stdout)["models"][0]["name"] == "m"
