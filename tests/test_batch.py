"""`dlm batch`: OpenAI Batch API files answered as the server answers, resumable after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serving import ROOT, ServerProcess

pytestmark = pytest.mark.slow  # starts `dlm batch` and `dlm serve` processes


def requests(n: int) -> list[dict]:
    lines = []
    for i in range(n):
        if i % 3 == 2:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"question {i}"}]}
        else:
            url, body = "/v1/completions", {"prompt": f"line {i} of the batch"}
        body |= {"max_tokens": 8, "temperature": 0, "return_token_ids": True}
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    lines.append(
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "treshold": 0.9}}
    )
    return lines


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def batch(*args: str, home: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dlm", "batch", *args, "--max-concurrency", "8"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"OMP_NUM_THREADS": "1", **os.environ, "DLM_HOME": str(home)},
    )


def results(path: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == len(set(ids)), "a request was answered twice"
    return {line["custom_id"]: line for line in lines}


def test_batch_answers_as_the_server_does(tmp_path: Path) -> None:
    home = tmp_path / "home"
    source = requests(12)
    out = tmp_path / "out.jsonl"
    proc = batch(str(write(tmp_path / "in.jsonl", source)), str(out), "--json", home=home)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout) | {"output": None} == {
        "total": 13,
        "skipped": 0,
        "completed": 12,
        "failed": 1,
        "output": None,
    }
    got = results(out)
    bad = got["bad"]
    assert bad["response"]["status_code"] == 400 and bad["error"]["param"] == "treshold"
    server = ServerProcess([], home)
    try:
        server.wait_ready()
        for line in source[:-1]:
            direct = server.http.post(server.url + line["url"], json=line["body"]).json()
            answer = got[line["custom_id"]]["response"]["body"]
            assert answer["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"], line["custom_id"]
            assert answer["usage"] == direct["usage"], line["custom_id"]
    finally:
        server.terminate()


def started(tmp_path: Path, lines: int) -> tuple[Path, Path, Path, subprocess.Popen]:
    """A 200-request batch running in its own process, once its OUTPUT holds `lines` lines
    (home, INPUT, OUTPUT, the process)."""
    home = tmp_path / "home"
    source = write(tmp_path / "in.jsonl", requests(200))
    out = tmp_path / "out.jsonl"
    first = batch(str(source), str(out), home=home)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and (not out.exists() or out.read_bytes().count(b"\n") < lines):
        assert first.poll() is None, first.communicate()[1]
        time.sleep(0.01)
    return home, source, out, first


def test_a_killed_batch_resumes_without_gaps_or_duplicates(tmp_path: Path) -> None:
    home, source, out, first = started(tmp_path, 40)
    first.send_signal(signal.SIGKILL)
    first.wait()
    partial = results_tolerating_a_cut_line(out)
    assert 40 <= len(partial) < 201
    second = batch(str(source), str(out), "--json", home=home)
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["skipped"] == len(partial) and summary["skipped"] + summary["completed"] + summary["failed"] == 201
    final = results(out)
    assert set(final) == {f"req-{i}" for i in range(200)} | {"bad"}
    assert all(final[f"req-{i}"]["response"]["status_code"] == 200 for i in range(200))


def results_tolerating_a_cut_line(path: Path) -> set[str]:
    """custom_ids of the whole lines (the kill may have cut the last one)."""
    whole = path.read_bytes().decode().split("\n")[:-1]
    return {json.loads(line)["custom_id"] for line in whole}


def test_a_second_run_on_the_same_output_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    home, source, out, first = started(tmp_path, 1)
    first.send_signal(signal.SIGSTOP)  # frozen mid-run, holding OUTPUT
    try:
        assert first.poll() is None, "the first run ended before it could be held"
        second = batch(str(source), str(out), "--json", home=home)
        stdout, stderr = second.communicate(timeout=600)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 1 and stdout == "", stderr
    assert f"another dlm batch (pid {first.pid}) is writing" in " ".join(stderr.split())
    assert first.wait(timeout=600) == 0, first.communicate()[1]
    assert set(results(out)) == {f"req-{i}" for i in range(200)} | {"bad"}


@pytest.mark.parametrize("command", ["batch", "generate"])
def test_damaged_weights_are_one_error_line(command: str, tmp_path: Path) -> None:
    """A checkpoint whose weights safetensors cannot read: exit 1 and stderr is one `error:`
    line, as a script reads it: no traceback, no log line repeating it, and no empty line
    before it (rich ends a progress display on a non-terminal with one)."""
    model = tmp_path / "damaged"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "dlm/engine/assets/dlm-tiny-tasks-llada/config.json").read_text())
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    if command == "batch":
        args = [str(write(tmp_path / "in.jsonl", requests(1))), str(tmp_path / "out.jsonl"), "--model", str(model)]
    else:
        args = [str(model), "--prompt-ids", "1,2,3"]
    proc = subprocess.run(
        [sys.executable, "-m", "dlm", command, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DLM_HOME": str(tmp_path / "home")},
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: cannot read the weights in"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
