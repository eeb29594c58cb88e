"""`dlm serve --tensor-parallel-size 2` as a real process (gloo, the embedded tiny model):
rank 0 serves HTTP and schedules, rank 1 runs the same forwards. Completions equal a
single-process server's, alone and batched together; /metrics works; SIGTERM stops the
ranks and exits 0. A worker that is killed (or hangs) fails the in-flight and queued
requests with an OpenAI-shaped 5xx naming what failed, /health turns 503 naming it, and the
server exits 1 a few seconds later."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import session_home
from tests.serving import ServerProcess, wait_until
from tests.test_tp_cli import _worker_pid

ARGS = ["--dtype", "float32", "--device", "cpu", "--max-num-seqs", "4", "--no-warmup"]
# One greedy request per decoding path the server mixes in one batch, and a sampled one: its
# seed makes every rank (and the single process) draw the same noise.
BODIES: list[dict[str, Any]] = [
    {"prompt": "Hello, diffusion", "max_tokens": 32, "steps": 16, "block_length": 16, "temperature": 0, "seed": 7},
    {
        "prompt": "Tensor parallel",
        "max_tokens": 16,
        "block_length": 8,
        "threshold": 0.5,
        "cache": "prefix",
        "temperature": 0,
    },
    {"prompt": [5, 17, 42, 99], "max_tokens": 16, "steps": 8, "block_length": 8, "temperature": 0.8, "seed": 3},
]


def _complete(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = server.http.post(server.url + "/v1/completions", json={**body, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _serve(home: Path, *extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess([*ARGS, *extra], home, env=env)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, list[dict[str, Any]]]]:
    """The two-rank server, and the single-process server's answers to BODIES (both start
    together; the single one is gone before the tests run)."""
    home = session_home(tmp_path_factory)
    tp = _serve(home, "--tensor-parallel-size", "2", "--public-metrics", env={"DLM_DIST_TIMEOUT": "30"})
    try:
        single = _serve(home)
        try:
            single.wait_ready()
            answers = [_complete(single, body) for body in BODIES]
        finally:
            assert single.terminate() == 0
        tp.wait_ready()
        worker = _worker_pid(tp.proc.pid)
        yield tp, answers
    finally:
        assert tp.terminate() == 0, "\n".join(tp.lines)  # drained, ranks stopped
        assert not [line for line in tp.lines if '"level": "error"' in line or "tensor-parallel rank" in line], (
            "\n".join(tp.lines)
        )
    assert wait_until(lambda: not Path(f"/proc/{worker}").exists(), timeout=5), "rank 1 outlived the server"


@pytest.mark.slow
def test_two_ranks_answer_as_one_process(servers: tuple[ServerProcess, list[dict[str, Any]]]) -> None:
    tp_server, single = servers
    assert any("tensor parallel: 2 ranks ready" in line for line in tp_server.lines)
    for body, expected in zip(BODIES, single):
        got = _complete(tp_server, body)
        assert (got["token_ids"], got["text"]) == (expected["token_ids"], expected["text"]), body
    # /tokenize checks a body as generation does, on the driver alone (`check_request`):
    # nothing built, so nothing mirrored to rank 1, whose next steps below stay in step.
    tokens = tp_server.http.post(tp_server.url + "/tokenize", json=BODIES[0])
    assert tokens.status_code == 200 and tokens.json()["count"] > 0, tokens.text
    bad = tp_server.http.post(tp_server.url + "/tokenize", json={**BODIES[2], "prompt": [10**9]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "prompt"), bad.text
    # Together: admitted into shared forwards at different steps, mirrored on rank 1.
    results: list[Any] = [None] * len(BODIES)
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, _complete(tp_server, BODIES[i])))
        for i in range(len(BODIES))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r["token_ids"] for r in results] == [e["token_ids"] for e in single]

    metrics = tp_server.metrics()
    assert metrics['dlm_request_success_total{finish_reason="length"}'] + metrics[
        'dlm_request_success_total{finish_reason="stop"}'
    ] == 2 * len(BODIES)
    assert metrics["dlm_batch_size_count"] > 0 and metrics["dlm_num_requests_running"] == 0
    assert httpx.get(tp_server.url + "/health").json()["status"] == "ok"


LONG = {"prompt": "x", "max_tokens": 512, "steps": 512, "block_length": 32}
STOPPED = r"a tensor-parallel collective timed out after 5s: tensor-parallel rank 1 \(pid {pid}\) is stopped"


def _failed(server: ServerProcess, cause: str) -> None:
    """Between the failure and the exit: /health and /ready answer 503 naming `cause`, and a
    new request is refused."""
    health: list[httpx.Response] = []

    def unhealthy() -> bool:
        try:
            health.append(httpx.get(server.url + "/health"))
        except httpx.ConnectError:  # it should answer 503 for FAILED_EXIT_DELAY_S first
            server.proc.wait(timeout=10)
            raise AssertionError("the server exited before /health said 503:\n" + "\n".join(server.lines)) from None
        return health[-1].status_code != 200

    assert wait_until(unhealthy, timeout=60, interval=0.1)  # a hang guard only: the cause proves which timeout fired
    assert health[-1].status_code == 503 and re.search(cause, health[-1].json()["error"]["message"])
    assert httpx.get(server.url + "/ready").status_code == 503
    refused = server.http.post(server.url + "/v1/completions", json=LONG)  # before it exits
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"


def _exits(server: ServerProcess, pid: int, cause: str) -> None:
    """The server exits 1 with `cause` as its error line, and rank 1 does not outlive it."""
    assert server.proc.wait(timeout=60) == 1
    assert any(re.search("error: " + cause, line) for line in server.lines), "\n".join(server.lines)
    assert wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=5), "rank 1 outlived the server"


def _engine_error(answer: httpx.Response, cause: str) -> None:
    error = answer.json()["error"]
    assert answer.status_code == 500 and error["code"] == "engine_error" and re.search(cause, error["message"]), error


def _failing_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """Two ranks, one sequence at a time, collectives that time out after 5s."""
    home = session_home(tmp_path_factory)
    return _serve(home, "--tensor-parallel-size", "2", "--max-num-seqs", "1", env={"DLM_DIST_TIMEOUT": "5"})


@pytest.mark.parametrize(
    ("sig", "cause"),
    [
        (signal.SIGKILL, r"tensor-parallel rank 1 \(pid {pid}\) was killed by signal 9 \(SIGKILL\)"),
        (signal.SIGSTOP, STOPPED),
    ],
)
@pytest.mark.slow
def test_a_failed_worker_fails_requests_and_health_then_the_server_exits_1(
    tmp_path_factory: pytest.TempPathFactory,
    sig: signal.Signals,
    cause: str,
) -> None:
    server = _failing_server(tmp_path_factory)
    try:
        server.wait_ready()
        answers: dict[str, httpx.Response] = {}

        def request(name: str) -> None:
            answers[name] = server.http.post(server.url + "/v1/completions", json=LONG, timeout=60)

        threads = [threading.Thread(target=request, args=(name,)) for name in ("running", "queued")]
        for thread in threads:
            thread.start()
        assert wait_until(
            lambda: (
                (server.metrics()["dlm_num_requests_running"], server.metrics()["dlm_num_requests_waiting"]) == (1, 1)
            ),
            timeout=20,
        )
        pid = _worker_pid(server.proc.pid)
        os.kill(pid, sig)
        cause = cause.format(pid=pid)
        _failed(server, cause)
        for thread in threads:
            thread.join(timeout=60)
        for name in ("running", "queued"):
            _engine_error(answers[name], cause)
        _exits(server, pid, cause)
    finally:
        server.proc.kill()
        server.proc.wait()


@pytest.mark.slow
def test_a_worker_stopped_while_idle_fails_the_next_request_on_the_collective_timeout(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A rank stopped between steps has not taken the next step message: the driver's send
    of it must time out like a collective (it waited forever, until the backstop ended the
    process without an answer)."""
    server = _failing_server(tmp_path_factory)
    try:
        server.wait_ready()
        pid = _worker_pid(server.proc.pid)
        os.kill(pid, signal.SIGSTOP)
        cause = STOPPED.format(pid=pid)
        _engine_error(server.http.post(server.url + "/v1/completions", json=LONG, timeout=60), cause)
        _failed(server, cause)
        _exits(server, pid, cause)
    finally:
        server.proc.kill()
        server.proc.wait()


def test_parallel_settings_come_from_flags_or_environment_and_refuse_hot_swaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dlm.cli.server.config import load_config
    from dlm.engine.errors import UsageError

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DLM_DIST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    env = {"DLM_NNODES": "2", "DLM_NODE_RANK": "1", "DLM_MASTER_ADDR": "10.0.0.1", "DLM_MASTER_PORT": "29500"}
    parallel = load_config(None, {"tensor_parallel_size": 4}, environ=env).parallel()
    assert (
        parallel.tensor_parallel_size,
        parallel.nnodes,
        parallel.node_rank,
        parallel.ranks_per_node,
        parallel.master_addr,
        parallel.master_port,
    ) == (4, 2, 1, 2, "10.0.0.1", 29500)
    with pytest.raises(UsageError, match="hot swaps .* not supported with tensor parallelism"):
        load_config(None, {"tensor_parallel_size": 2, "admin_key": "k"}, environ={}).parallel()
    with pytest.raises(UsageError, match="--nnodes 3 must divide --tensor-parallel-size 2"):
        load_config(None, {"tensor_parallel_size": 2, "nnodes": 3}, environ={}).parallel()
    assert not load_config(None, {"admin_key": "k"}, environ={}).parallel().parallel  # one process swaps
