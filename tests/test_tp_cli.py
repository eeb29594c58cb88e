"""`dlm generate --tensor-parallel-size 2` as a user runs it: the same JSON ids as one
process, and a worker killed mid-generation (or hung) ends the command with exit 1 and a
message naming what failed, within a bounded time."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.tp_checkpoints import write_family

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.fixture(scope="module")
def llada(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("llada"), "llada")


def _command(model: Path, *extra: str, gen_length: int = 16) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dlm",
        "generate",
        str(model),
        "--prompt-ids",
        "5,17,42,99",
        "--gen-length",
        str(gen_length),
        "--block-length",
        "8",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--json",
        *extra,
    ]


@pytest.fixture(scope="module")
def single(llada: Path) -> dict:
    run = subprocess.run(_command(llada), capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_cli_two_ranks_print_the_single_process_ids(llada: Path, single: dict) -> None:
    run = subprocess.run(
        _command(llada, "--tensor-parallel-size", "2"), capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert run.returncode == 0, run.stderr
    parallel = json.loads(run.stdout)
    assert parallel["output_ids"] == single["output_ids"] and parallel["nfe"] == single["nfe"]
    assert (single["tensor_parallel_size"], parallel["tensor_parallel_size"]) == (1, 2)


def test_a_split_the_model_cannot_make_is_a_usage_error(llada: Path) -> None:
    """3 ranks over 4 query heads: refused in one line (exit 2) before any rank starts."""
    run = subprocess.run(
        _command(llada, "--tensor-parallel-size", "3"), capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "not divisible by the tensor-parallel size 3" in lines[-1], run.stderr
    assert "Traceback" not in run.stderr and "rank1" not in run.stderr


def test_cli_two_nodes(llada: Path, single: dict) -> None:
    """`--nnodes 2`: the same command on two "nodes" (here two local processes, one rank
    each); node 0 prints the result, node 1 serves and prints nothing."""
    from dlm.engine.parallel.distributed import _free_port

    flags = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    nodes = [
        subprocess.Popen(
            _command(llada, *flags, "--node-rank", str(rank)),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (1, 0)
    ]
    (out1, err1), (out0, err0) = (node.communicate(timeout=120) for node in nodes)
    assert [node.returncode for node in nodes] == [0, 0], err0 + err1
    assert out1 == "" and json.loads(out0)["output_ids"] == single["output_ids"]


def _worker_pid(parent: int) -> int:
    """The spawned rank among the process's children (not multiprocessing's resource tracker),
    whichever of its threads started it."""
    children = [c for task in Path(f"/proc/{parent}/task").iterdir() for c in (task / "children").read_text().split()]
    return next(int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())


def _wait_for(proc: subprocess.Popen, text: str, limit: float) -> None:
    assert proc.stderr is not None
    deadline, seen = time.monotonic() + limit, ""
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"never saw {text!r}: {seen}"
        if select.select([proc.stderr], [], [], left)[0]:
            seen += proc.stderr.readline()


@pytest.mark.parametrize(
    ("sig", "message"),
    [
        (signal.SIGKILL, r"error: tensor-parallel rank 1 \(pid {pid}\) was killed by signal 9 \(SIGKILL\)"),
        # The collective's own timeout, or the driver's deadline if it is blocked elsewhere.
        (
            signal.SIGSTOP,
            r"error: (a tensor-parallel collective timed out after 5s|the tensor-parallel group made "
            r"no progress for 5s \(a rank is hung\)): tensor-parallel rank 1 \(pid {pid}\) is stopped",
        ),
    ],
)
def test_a_dead_or_hung_worker_fails_the_command(llada: Path, sig: signal.Signals, message: str) -> None:
    env = {**os.environ, "DLM_DIST_TIMEOUT": "5"}
    proc = subprocess.Popen(
        _command(llada, "--tensor-parallel-size", "2", gen_length=480),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(proc, "ranks ready", limit=60)
        time.sleep(0.3)  # into the denoising loop (480 steps: seconds of work)
        pid = _worker_pid(proc.pid)
        os.kill(pid, sig)
        _, err = proc.communicate(timeout=60)  # a hang guard, not a speed check: the message names the timeout
        assert proc.returncode == 1
        assert re.search(message.format(pid=pid), err), err
    finally:
        proc.kill()
        proc.wait()
