"""The store's invariants under racing commands and SIGKILL (issue 16).

Each round starts `dlm release`, `dlm rollback` (or `dlm rm --keep 1`) and `dlm rm` (of a
random version: often the one being released, the current or the previous release) at once
against a deployment whose server (tests/store_race_server.py, which speaks the store's side
of the hot-swap contract) takes a random fraction of a second per swap. Odd rounds SIGKILL the
release while its server swaps (and some of the others at random); even rounds SIGKILL a
random subset of the commands at random instants. After each round, once a store transaction
has settled what the killed commands left pending, it checks (docs/weights.md, "Invariants"):

1. the deployment file parses and has no pending swap;
2. its current release, and its previous one unless a rollback just exposed an older entry
   of the stack, are in the store with all their files (none lost);
3. the server serves exactly the current release (none diverged);
4. the server never served or loaded a version whose files were gone.

CI runs DLM_STORE_RACE_RUNS rounds (default 12); `DLM_STORE_RACE_RUNS=200` is the acceptance run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dlm.cli.store import admin
from dlm.cli.store.fetch import fetch
from dlm.cli.store.releases import load_state, release, release_stack, transaction
from dlm.cli.store.store import Store
from tests.weights_helpers import ROOT, make_checkpoint

DEPLOYMENT = "prod"
VERSIONS = 4


def _dlm(store: Store, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "dlm", *args, "--store", str(store.root)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _restock(store: Store, sources: list[Path]) -> list[str]:
    """Every source version in the store (fetching those `rm` deleted)."""
    return [fetch(str(source), store, name="m").manifest.version for source in sources]


def _check(store: Store, server_url: str, events_before: int) -> list[str]:
    """The invariants after a round; a list of violations.

    The current release must be intact. So must the previous one, unless a rollback in this
    round popped the stack back to it: rm may delete a version once it is third on the stack
    (docs/weights.md), and a later rollback can make it "previous" again; rollback skips it."""
    with transaction(store):  # what any next store command does first: settle
        state = load_state(store, DEPLOYMENT)
    found = []
    if state.pending is not None:
        found.append(f"pending swap left after a transaction: {state.pending}")
    current = state.current
    stack = release_stack(state.history)
    new = state.history[events_before:]
    rolled_back = any(e.action == "rollback" and e.status == "ok" for e in new)
    for model, version in stack[-1:] if rolled_back else stack[-2:]:
        files = store.files_dir(model, version)
        manifest = store.version_dir(model, version) / "manifest.json"
        if not manifest.is_file() or not files.is_dir():
            found.append(f"lost release {model}@{version}")
            continue
        missing = [f.path for f in store.manifest(model, version).files if not (files / f.path).is_file()]
        if missing:
            found.append(f"release {model}@{version} lost files {missing}")
    served = httpx.get(server_url + "/served", timeout=10).json()["serving"]
    if current is None or served != current.ref:
        found.append(f"diverged: the server serves {served}, the deployment record says {current}")
    problems = store.root / "race-problems.log"
    if problems.exists():
        found.append(problems.read_text().strip())
        problems.unlink()
    return found


@pytest.mark.slow
def test_raced_and_killed_commands_never_lose_or_diverge_a_release(tmp_path: Path) -> None:
    runs = int(os.environ.get("DLM_STORE_RACE_RUNS", "12"))
    rng = random.Random(int(os.environ.get("DLM_STORE_RACE_SEED", "16")))
    store = Store(tmp_path / "store")
    sources = [make_checkpoint(tmp_path / f"v{i}", shards=1, seed=i, tokenizer=False) for i in range(VERSIONS)]
    versions = _restock(store, sources)
    release(store, f"m@{versions[0]}", DEPLOYMENT)
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.store_race_server", str(store.root), DEPLOYMENT, "1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    violations: list[str] = []
    killed = 0
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        record = admin.running_server(store, DEPLOYMENT)
        assert record is not None
        for run in range(runs):
            versions = _restock(store, sources)
            before = load_state(store, DEPLOYMENT)
            assert before.current is not None
            current, events_before = before.current.version, len(before.history)
            target = rng.choice([v for v in versions if v != current])
            doomed = rng.choice([target, current, *versions])
            commands = [
                ("release", f"m@{target}", "-d", DEPLOYMENT),
                ("rm", f"m@{doomed}"),
                ("rollback", "-d", DEPLOYMENT) if rng.random() < 0.5 else ("rm", "m", "--keep", "1"),
            ]
            procs = [_dlm(store, *command) for command in commands]
            if run % 2:  # the release, killed while its server swaps
                victims = [procs[0]] + [p for p in procs[1:] if rng.random() < 0.5]
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and procs[0].poll() is None:
                    swapping = admin.read_record(store, DEPLOYMENT)
                    if swapping is not None and swapping.swap_intent is not None:
                        time.sleep(rng.uniform(0.0, 0.2))
                        break
                    time.sleep(0.005)
            else:  # any of them, at a random instant (start-up takes ~0.8 s here)
                victims = [p for p in procs if rng.random() < 0.6]
                deadline = time.monotonic() + rng.uniform(0.6, 2.0)
                while time.monotonic() < deadline and any(p.poll() is None for p in victims):
                    time.sleep(0.01)
            for proc in victims:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    killed += 1
            for proc, command in zip(procs, commands):
                _, stderr = proc.communicate(timeout=120)
                text = stderr.decode(errors="replace")
                if "Traceback" in text:
                    violations.append(f"run {run}: dlm {' '.join(command)} crashed: {text[-400:]}")
            violations += [f"run {run}: {v}" for v in _check(store, record.admin_url, events_before)]
    finally:
        server.kill()
        server.wait()
    history = load_state(store, DEPLOYMENT).history
    settled = sum(1 for event in history if event.settled_at is not None)
    refused = sum(1 for event in history if event.status == "failed")
    print(
        f"{runs} raced runs: {killed} commands SIGKILLed, {settled} interrupted swaps settled, "
        f"{len(history)} events ({refused} failed), {len(violations)} violations"
    )
    assert not violations, "\n".join(violations[:20])
    assert killed > 0
