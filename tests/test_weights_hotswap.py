"""Hot swap under traffic: a real `dlm serve --deployment prod` process on 127.0.0.1 switches
versions while clients keep sending requests, through `dlm release` and `dlm rollback`.

The versions are tiny checkpoints whose every generated token is a known word (" alpha",
" beta", ...) with a different id in each (different weights and tokenizers), so each
answer says which version produced it, and an answer decoded with another version's
tokenizer would not read as one word.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from dlm.cli.store import admin
from dlm.cli.store.fetch import fetch
from dlm.cli.store.releases import load_state, release
from dlm.cli.store.store import Store
from tests.conftest import session_home
from tests.serving import ROOT, ServerProcess, fixed_output_checkpoint, wait_until
from tests.weights_helpers import cli

SHORT = {"model": "m", "prompt": "hi", "max_tokens": 16, "steps": 16, "block_length": 16}
# One token per step over 256 positions: a couple of seconds on the tiny model.
LONG = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 256,
    "steps": 256,
    "block_length": 256,
    "stream": True,
}


@dataclass
class Deployment:
    store: Store
    versions: dict[str, str]  # word -> version id
    server: ServerProcess

    def ask(self, body: dict = SHORT) -> httpx.Response:
        return self.server.http.post(self.server.url + "/v1/completions", json=body, timeout=60)

    def word(self) -> str:
        """Which version answers a new request now."""
        response = self.ask()
        assert response.status_code == 200, response.text
        return _word(response.json()["choices"][0]["text"])

    def card(self) -> dict:
        return self.server.http.get(self.server.url + "/v1/models").json()["data"][0]


def _word(text: str) -> str:
    words = set(text.split())
    assert len(words) == 1, f"an answer mixes versions or is empty: {text!r}"
    return words.pop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    base = tmp_path_factory.mktemp("hotswap")
    store = Store(base / "store")
    versions = {}
    for offset, word in enumerate(("alpha", "beta", "gamma")):
        source = fixed_output_checkpoint(base / word, f" {word}", id_offset=offset)
        versions[word] = fetch(str(source), store, name="m").manifest.version
    release(store, f"m@{versions['alpha']}", "prod")
    server = ServerProcess(
        ["--deployment", "prod", "--store", str(store.root), "--dtype", "float32"], session_home(tmp_path_factory)
    )
    try:
        server.wait_ready()
        yield Deployment(store, versions, server)
    finally:
        server.terminate()


def _dlm(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dlm", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


class Traffic:
    """Clients sending short requests in a bounded loop until stopped; every answer is kept
    with the times it was sent and answered."""

    def __init__(self, deployment: Deployment, clients: int = 2, limit: int = 2000) -> None:
        self.deployment, self.limit = deployment, limit
        self.results: list[tuple[float, float, int, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set() and len(self.results) < self.limit:
            sent = time.monotonic()
            response = self.deployment.ask()
            text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text
            self.results.append((sent, time.monotonic(), response.status_code, text))

    def stop(self) -> list[tuple[float, float, int, str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        return self.results


@pytest.mark.slow
def test_release_and_rollback_under_traffic(deployment: Deployment) -> None:
    v = deployment.versions
    assert deployment.word() == "alpha"
    card = deployment.card()
    assert card["id"] == "m" and card["version"] == v["alpha"] and card["root"] == f"m@{v['alpha']}"

    traffic = Traffic(deployment)
    assert wait_until(lambda: len(traffic.results) >= 5, timeout=30)
    # A long streamed request is in flight when the release switches versions: it must
    # finish on the old version, and the release must not return before it has.
    long: dict[str, object] = {}
    submitted = threading.Event()

    def long_request() -> None:
        text, server = "", deployment.server
        with server.http.stream("POST", server.url + "/v1/chat/completions", json=LONG, timeout=60) as response:
            for line in response.iter_lines():
                submitted.set()  # the first event is sent once the request is in the engine
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: ") :])
                    assert "error" not in event, event
                    text += event["choices"][0]["delta"].get("content") or ""
        long.update(status=response.status_code, text=text, at=time.monotonic())

    worker = threading.Thread(target=long_request)
    worker.start()
    assert submitted.wait(30)
    code, stdout, stderr = cli(
        "release", f"m@{v['beta']}", "-d", "prod", "--store", str(deployment.store.root), "--json"
    )
    released_at = time.monotonic()
    assert code == 0, stderr
    outcome = json.loads(stdout)
    assert outcome["current"]["version"] == v["beta"] and outcome["event"]["hot_swap"]["admin_url"]
    worker.join(timeout=60)
    assert long["status"] == 200 and _word(str(long["text"])) == "alpha"
    assert long["at"] <= released_at  # drained before the swap was answered
    assert deployment.word() == "beta"
    assert deployment.card()["version"] == v["beta"]
    assert wait_until(lambda: sum(1 for r in traffic.results if r[0] > released_at) >= 5, timeout=30)
    drains = [line for line in deployment.server.lines if "hot swap: new requests go to" in line]
    assert len(drains) == 1 and "(0 running" not in drains[0]  # the long request was running then

    rollback_started = time.monotonic()
    rolled = _dlm("rollback", "-d", "prod", "--store", str(deployment.store.root), "--json")
    rolled_at = time.monotonic()
    assert rolled.returncode == 0, rolled.stderr
    assert json.loads(rolled.stdout)["current"]["version"] == v["alpha"]
    assert deployment.word() == "alpha"
    assert deployment.card()["version"] == v["alpha"]
    assert wait_until(lambda: sum(1 for r in traffic.results if r[0] > rolled_at) >= 5, timeout=30)
    results = traffic.stop()

    failures = [r for r in results if r[2] != 200]
    assert not failures, failures[:3]
    words = [(sent, done, _word(text)) for sent, done, _, text in results]
    assert {w for _, _, w in words} == {"alpha", "beta"}
    # Requests sent after a switch was answered ran on the new version.
    assert all(w == "beta" for sent, _, w in words if released_at < sent < rollback_started)
    assert all(w == "alpha" for sent, _, w in words if sent > rolled_at)
    assert sum(1 for sent, _, _ in words if sent > released_at) >= 10
    logs = "\n".join(deployment.server.lines)
    assert logs.count("the old version's weights are released") == 2
    history = load_state(deployment.store, "prod").history
    assert [(e.action, e.status, e.version) for e in history[-2:]] == [
        ("release", "ok", v["beta"]),
        ("rollback", "ok", v["alpha"]),
    ]


@pytest.mark.slow
def test_a_version_that_fails_to_load_leaves_the_old_one_serving(deployment: Deployment) -> None:
    v, store = deployment.versions, deployment.store
    current = load_state(store, "prod").current
    assert current is not None
    before = current.version
    # Corrupt the shard after verification, keeping its size (so `release` accepts it):
    # the safetensors header length now points past the end of the file.
    shard = next(store.files_dir("m", v["gamma"]).glob("*.safetensors"))
    with shard.open("r+b") as handle:
        handle.write((1 << 40).to_bytes(8, "little"))
    traffic = Traffic(deployment)
    failed = _dlm("release", f"m@{v['gamma']}", "-d", "prod", "--store", str(store.root))
    results = traffic.stop()
    assert failed.returncode == 1
    assert f"still serving m@{before}" in failed.stderr
    assert "loading or warming up" in failed.stderr
    state = load_state(store, "prod")
    event = state.history[-1]
    assert event.status == "failed" and event.version == v["gamma"] and event.error
    assert state.current is not None and state.current.version == before
    assert deployment.card()["version"] == before
    assert deployment.word() == {value: key for key, value in v.items()}[before]
    assert results and all(r[2] == 200 for r in results)


@pytest.mark.slow
def test_admin_endpoint_is_loopback_only_and_needs_its_key(deployment: Deployment) -> None:
    store, server = deployment.store, deployment.server
    record = admin.running_server(store, "prod")
    assert record is not None and record.pid == server.proc.pid
    assert stat.S_IMODE(admin.record_path(store, "prod").stat().st_mode) == 0o600
    url = urlparse(record.admin_url)
    assert url.hostname == "127.0.0.1" and url.port != urlparse(server.url).port
    body = {"deployment": "prod", "model": "m", "version": "x", "path": "/nonexistent"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = server.http.post(record.admin_url + admin.SWAP_PATH, json=body, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert server.http.post(server.url + admin.SWAP_PATH, json=body).status_code == 404  # not on the API port
    key = {"Authorization": f"Bearer {record.admin_key}"}
    other = server.http.post(record.admin_url + admin.SWAP_PATH, json={**body, "deployment": "canary"}, headers=key)
    assert other.status_code == 400 and other.json()["error"]["code"] == "wrong_deployment"
    # A swap no release journalled in the store is refused before anything loads.
    unjournalled = server.http.post(record.admin_url + admin.SWAP_PATH, json=body, headers=key)
    assert unjournalled.status_code == 409
    assert set(unjournalled.json()["error"]) == {"message", "type", "param", "code"}
    assert unjournalled.json()["error"]["code"] == "no_pending_release"
    assert "swaps go through `dlm release`" in unjournalled.json()["error"]["message"]
    assert deployment.word() in ("alpha", "beta")
    assert not any(record.admin_key in line for line in server.lines)  # never logged
    second = _dlm("serve", "--deployment", "prod", "--store", str(store.root), "--port", "0")
    assert second.returncode == 1 and f"already served by process {server.proc.pid}" in second.stderr


@pytest.mark.slow
def test_sigterm_unregisters_the_server(deployment: Deployment) -> None:
    assert deployment.server.terminate() == 0
    assert not admin.record_path(deployment.store, "prod").exists()


def test_one_swap_at_a_time(tmp_path: Path) -> None:
    """In process: while a swap loads its version, a second one is refused with 409, and the
    first completes."""
    from dlm.cli.server.config import load_config
    from dlm.cli.server.errors import APIError
    from dlm.cli.server.hotswap import HotSwapper, SwapRequest
    from dlm.cli.server.service import Service

    model = fixed_output_checkpoint(tmp_path / "one", " one")
    service = Service(load_config(None, {"model": str(model), "dtype": "float32", "warmup": False}, environ={}))
    service.load()
    assert service.served is not None, service.load_error
    gate = threading.Event()
    real_open = service.open

    def slow_open(*args: object, **kwargs: object) -> object:
        assert gate.wait(30)
        return real_open(*args, **kwargs)  # type: ignore[arg-type]

    service.open = slow_open  # type: ignore[method-assign]
    swapper = HotSwapper(service)
    request = SwapRequest(model="m", version="two", path=str(model))

    async def scenario() -> None:
        first = asyncio.create_task(swapper.swap(request))
        for _ in range(500):
            if swapper.busy:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(APIError) as refused:
            await swapper.swap(request)
        assert refused.value.status == 409 and refused.value.code == "swap_in_progress"
        gate.set()
        assert await first == {"status": "ok", "model": "m", "version": "two"}

    try:
        asyncio.run(scenario())
        assert service.served.ref == "m@two" and not service.retiring  # type: ignore[union-attr]
    finally:
        gate.set()
        service.shutdown()


def test_admin_key_sources_and_start_errors(tmp_path: Path) -> None:
    from dlm.cli.server.config import key_id, load_config
    from dlm.engine.errors import UsageError

    key_file = tmp_path / "admin.key"
    key_file.write_text("sk-admin-file\n")
    assert load_config(None, {"admin_key_file": key_file}, environ={}).configured_admin_key() == "sk-admin-file"
    from_env = load_config(None, {}, environ={"DLM_ADMIN_KEY": "sk-admin-env"})
    assert from_env.configured_admin_key() == "sk-admin-env" and from_env.admin_enabled
    public = json.dumps(from_env.public())
    assert "sk-admin-env" not in public and key_id("sk-admin-env") in public
    assert not load_config(None, {}, environ={}).admin_enabled
    with pytest.raises(UsageError, match="not both"):
        load_config(None, {"model": "x", "deployment": "prod"}, environ={})
    code, _, stderr = cli("serve", "--deployment", "nothing", "--store", str(tmp_path / "store"))
    assert code == 2 and "there is no store at" in stderr and not (tmp_path / "store").exists()
    (tmp_path / "store").mkdir()
    code, _, stderr = cli("serve", "--deployment", "nothing", "--store", str(tmp_path / "store"))
    assert code == 2 and "has no release" in stderr
