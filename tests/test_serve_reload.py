"""Settings changed without a restart (the deployment guides' config centre, 热更新): SIGHUP
reads the --config file again and applies its live settings (`ServeConfig.live`)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from dlm.cli.server.config import ServeConfig, load_config
from dlm.cli.server.run import DrainingServer
from dlm.cli.server.service import Service
from dlm.engine.errors import UsageError
from tests.conftest import session_home
from tests.serving import ServerProcess, app_client, wait_until

BASE = {"model": "tiny:llada", "warmup": False}
ASK = {"prompt": "hi", "max_tokens": 8, "steps": 8}


@pytest.fixture
def client() -> Iterator[TestClient]:
    with app_client(BASE) as test_client:
        yield test_client


def test_live_settings_apply_to_the_next_request_and_the_rest_wait_for_a_restart(client: TestClient) -> None:
    service = client.app.state.service  # type: ignore[attr-defined]
    assert client.post("/v1/completions", json=ASK).status_code == 200
    new = load_config(None, {**BASE, "max_steps": 4, "requests_per_minute": 2, "prefix_cache_mib": 3}, environ={})
    applied, restart = service.reload(new)
    assert applied == {"max_steps": (1024, 4), "requests_per_minute": (0, 2)} and restart == ["prefix_cache_mib"]
    assert service.config.prefix_cache_mib == 1024  # not applied
    refused = client.post("/v1/completions", json=ASK)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "steps_exceeded", refused.text
    assert client.post("/v1/completions", json={**ASK, "steps": 4}).status_code == 200
    assert client.post("/v1/completions", json={**ASK, "steps": 4}).status_code == 429  # 2 a minute, both taken


def test_the_batch_and_queue_limits_apply_to_the_next_admission(client: TestClient) -> None:
    """Guide 004's batch size and concurrency limit, hot-updated: the scheduler's limits and
    the preparation backlog follow the reload; the batch bound only up to the one the server
    started with (its step graphs and memory were sized by it)."""
    service = client.app.state.service  # type: ignore[attr-defined]
    scheduler = service.served.engine.scheduler
    assert (scheduler.limits.max_num_seqs, scheduler.limits.max_queue) == (8, 64)
    applied, _ = service.reload(load_config(None, {**BASE, "max_num_seqs": 2, "max_queue": 0}, environ={}))
    assert applied == {"max_num_seqs": (8, 2), "max_queue": (64, 0)}
    assert (scheduler.limits.max_num_seqs, scheduler.limits.max_queue) == (2, 0)
    answer = client.post("/v1/completions", json={**ASK, "n": 3})  # 2 decoded together, none may wait
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", answer.text
    assert client.post("/v1/completions", json={**ASK, "n": 2}).status_code == 200
    with pytest.raises(UsageError, match="exceeds the 8 the server started with"):
        service.reload(load_config(None, {**BASE, "max_num_seqs": 9}, environ={}))
    assert scheduler.limits.max_num_seqs == 2 and service.config.max_num_seqs == 2  # unchanged
    service.reload(load_config(None, BASE, environ={}))  # back to 8, as started
    assert (scheduler.limits.max_num_seqs, scheduler.limits.max_queue) == (8, 64)


def test_a_version_loaded_while_the_batch_is_lowered_is_sized_for_the_batch_a_reload_may_restore() -> None:
    """A hot swap's new version while a reload has lowered `max_num_seqs`: its step graphs
    are sized by the batch the server started with, which a reload may raise it back to (they
    were sized by the lowered one, 1: batches of 8 then ran without their static shapes)."""
    with app_client({**BASE, "step_graphs": "on"}) as client:
        service = client.app.state.service  # type: ignore[attr-defined]
        assert service.served.engine.engine.runner.graphs.buckets.max_batch == 16  # 8, CFG rows twice
        service.reload(load_config(None, {**BASE, "step_graphs": "on", "max_num_seqs": 1}, environ={}))
        new = service.open("tiny:llada", None, warmup=False)  # what a hot swap loads
        try:
            assert new.engine.scheduler.limits.max_num_seqs == 1  # the batch served now
            assert new.engine.engine.runner.graphs.buckets.max_batch == 16
        finally:
            new.engine.stop()


def test_defaults_the_family_refuses_refuse_the_whole_reload(client: TestClient) -> None:
    service = client.app.state.service  # type: ignore[attr-defined]
    new = load_config(None, {**BASE, "decode_mode": "ar", "max_steps": 4}, environ={})
    with pytest.raises(UsageError, match="decode"):
        service.reload(new)
    assert service.config.max_steps == 1024 and service.config.decode_mode == "diffusion"
    assert client.post("/v1/completions", json=ASK).status_code == 200


def test_the_live_settings_are_the_documented_ones() -> None:
    text = (Path(__file__).parent.parent / "docs" / "serve.md").read_text()
    section = text[text.index("## Changing settings without a restart") :]
    section = section[: section.index("\n## ", 1)]
    listed = set(re.findall(r"`([a-z_]+)`", next(p for p in section.split("\n\n") if p.startswith("`"))))
    assert listed == set(ServeConfig.live()), listed ^ set(ServeConfig.live())


@pytest.mark.slow
def test_sighup_reads_the_config_file_again(tmp_path_factory: pytest.TempPathFactory) -> None:
    config = tmp_path_factory.mktemp("reload") / "serve.yaml"
    config.write_text("max_steps: 64\nwarmup: false\n")
    server = ServerProcess(["tiny:llada", "--config", str(config)], session_home(tmp_path_factory))
    try:
        server.wait_ready()
        assert server.http.post(server.url + "/v1/completions", json=ASK).status_code == 200
        config.write_text("max_steps: 4\nwarmup: false\nmax_num_batched_tokens: 4096\n")
        os.kill(server.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: any("settings reloaded: max_steps 64 -> 4" in line for line in server.lines), 30), (
            server.lines[-5:]
        )
        assert any("need a restart, not applied: max_num_batched_tokens" in line for line in server.lines)
        assert server.http.post(server.url + "/v1/completions", json=ASK).status_code == 400
        config.write_text("max_steps: [\n")  # a file that does not read: nothing changes
        os.kill(server.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: any("settings not reloaded" in line for line in server.lines), 30)
        assert server.http.post(server.url + "/v1/completions", json={**ASK, "steps": 4}).status_code == 200
        assert server.proc.poll() is None and not any("Traceback" in line for line in server.lines)
    finally:
        server.terminate()


@pytest.mark.slow
def test_a_sighup_as_the_server_starts_is_a_reload_not_its_death(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A SIGHUP in the half second before the server's handler is installed (its modules
    importing, its settings read) ended the process, SIGHUP's default. It is answered as a
    reload once the server can read its settings (tests/interrupt_points.py lands it)."""
    config = tmp_path_factory.mktemp("early-hangup") / "serve.yaml"
    config.write_text("warmup: false\n")
    server = ServerProcess(
        ["tiny:llada", "--config", str(config)],
        session_home(tmp_path_factory),
        entry=("-m", "tests.interrupt_points", "hangup"),
    )
    try:
        server.wait_ready()
        assert wait_until(lambda: any("settings reloaded" in line for line in server.lines), 30), server.lines[-5:]
        assert server.http.post(server.url + "/v1/completions", json=ASK).status_code == 200
        assert server.proc.poll() is None and not any("Traceback" in line for line in server.lines)
    finally:
        server.terminate()


def test_a_default_length_left_unset_stays_the_one_the_served_max_tokens_gives() -> None:
    """A file that changed max_tokens (a restart's) and gave no default_max_tokens reloaded
    the default derived from its max_tokens: served 64, the default became 128 and every
    request without max_tokens was refused 'max_tokens (128) exceeds this server's limit of 64'."""
    base = {**BASE, "max_tokens": 64}
    with app_client(base) as client:
        service = client.app.state.service  # type: ignore[attr-defined]
        applied, restart = service.reload(load_config(None, {**base, "max_tokens": 1024}, environ={}))
        assert applied == {} and restart == ["max_tokens"]
        answer = client.post("/v1/completions", json={"prompt": "hi", "steps": 8})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 64, answer.text
        with pytest.raises(UsageError, match=r"default_max_tokens \(100\) exceeds max_tokens \(64\)"):
            service.reload(load_config(None, {**base, "max_tokens": 1024, "default_max_tokens": 100}, environ={}))
        assert service.config.default_max_tokens == 64
        applied, _ = service.reload(load_config(None, {**base, "default_max_tokens": 16}, environ={}))
        assert applied == {"default_max_tokens": (64, 16)}
        applied, _ = service.reload(load_config(None, base, environ={}))  # given no more: derived again
        assert applied == {"default_max_tokens": (16, 64)}


def test_the_openapi_document_states_the_default_length_a_reload_set(client: TestClient) -> None:
    """/openapi.json was built once with the start's default_max_tokens: after a reload it
    still stated the old default of every request that gives no max_tokens."""

    def stated() -> object:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        return {schemas[name]["properties"]["max_tokens"]["default"] for name in ("CompletionRequest", "ChatRequest")}

    assert stated() == {128}
    client.app.state.service.reload(load_config(None, {**BASE, "default_max_tokens": 16}, environ={}))  # type: ignore[attr-defined]
    assert stated() == {16}


def test_a_sighup_during_a_reload_reads_the_settings_again(client: TestClient) -> None:
    """SIGHUPs while a reload read the settings were dropped: a config centre that rewrote
    the file again in that moment left the server on the previous file's settings."""
    service = client.app.state.service  # type: ignore[attr-defined]
    release, reads = threading.Event(), []

    def settings() -> ServeConfig:
        reads.append(len(reads))
        release.wait(10)  # the first read lasts until every signal has come
        return load_config(None, {**BASE, "max_steps": 100 + len(reads)}, environ={})

    server = DrainingServer(uvicorn.Config(client.app), service, settings)

    async def storm() -> None:
        for _ in range(5):
            server._reload_requested()
            await asyncio.sleep(0.05)
        release.set()
        while server._reloading is not None and not server._reloading.done():
            await server._reloading

    asyncio.run(storm())
    assert len(reads) == 2 and service.config.max_steps == 102, (reads, service.config.max_steps)


def test_a_sighup_while_the_model_loads_is_answered_once_it_has_loaded() -> None:
    """A SIGHUP while the model loaded applied defaults no family had checked: decode_mode ar
    on LLaDA was 'reloaded', then the load refused it and the server exited with code 2."""
    service = Service(load_config(None, BASE, environ={}))
    ar = load_config(None, {**BASE, "decode_mode": "ar", "max_steps": 4}, environ={})
    server = DrainingServer(uvicorn.Config(lambda: None), service, lambda: ar)

    async def signal_while_loading() -> None:
        server._reload_requested()  # nothing loaded yet
        await asyncio.to_thread(service.load)
        assert service.load_error is None, service.load_error
        await server.on_tick(0)  # loaded: the reload runs, and is refused
        assert server._reloading is not None
        await server._reloading

    try:
        asyncio.run(signal_while_loading())
        assert service.config.decode_mode == "diffusion" and service.config.max_steps == 1024
    finally:
        service.shutdown()


def test_the_key_file_is_read_once_not_per_request(tmp_path: Path) -> None:
    """The preparation backlog's per-key share, worked out per request since the queue limits
    became live, read --api-key-file from disk at every request (on the event loop): with the
    file gone, every request was a 500. The keys take a restart; their count is the start's."""
    keys = tmp_path / "keys"
    keys.write_text("sk-one\nsk-two\n")
    with app_client({**BASE, "api_key_file": str(keys)}) as client:
        keys.unlink()
        answer = client.post("/v1/completions", json=ASK, headers={"Authorization": "Bearer sk-two"})
        assert answer.status_code == 200, answer.text
        assert client.app.state.service.queue_share() == 32  # type: ignore[attr-defined]  # half of 64: two keys


def test_a_sighup_during_a_hot_swap_is_checked_against_the_version_swapped_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGHUP while a hot swap loaded the next version was checked against the version
    leaving: `decode_mode: ar`, which SDAR decodes, was applied, and LLaDA, swapped in a moment
    later, served it as every request's default (each one a 400). The reload waits for the
    swap, as one during the first load waits for it, and the version swapped in refuses it."""
    import httpx

    from dlm.cli.store.admin import SWAP_PATH
    from dlm.engine.runtime.async_engine import AsyncEngine
    from dlm.engine.tiny_models import ensure_tiny_model

    sdar = {**BASE, "model": "tiny:sdar", "admin_key": "k" * 32}
    warming, release = threading.Event(), threading.Event()
    warmup = AsyncEngine.warmup

    def held_warmup(engine: AsyncEngine) -> None:  # the swap's new version, its defaults checked
        warming.set()
        release.wait(60)
        warmup(engine)

    monkeypatch.setattr(AsyncEngine, "warmup", held_warmup)
    with app_client(sdar) as client:
        service = client.app.state.service  # type: ignore[attr-defined]
        admin = client.app.state.admin  # type: ignore[attr-defined]
        swap = {"model": "m", "version": "v2", "path": str(ensure_tiny_model("tiny:llada"))}
        answers: list[httpx.Response] = []
        swapping = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    admin.url + SWAP_PATH, json=swap, headers={"Authorization": f"Bearer {admin.key}"}, timeout=120
                )
            )
        )
        swapping.start()
        ar = load_config(None, {**sdar, "decode_mode": "ar"}, environ={})
        server = DrainingServer(uvicorn.Config(client.app), service, lambda: ar)

        async def signal_during_the_swap() -> None:
            assert await asyncio.to_thread(warming.wait, 60)
            server._reload_requested()  # SDAR serves, LLaDA is about to
            if server._reloading is not None:
                await server._reloading
            release.set()
            await asyncio.to_thread(swapping.join, 120)
            await server.on_tick(0)  # the swap is over: the reload runs, and LLaDA refuses it
            assert server._reloading is not None
            await server._reloading

        try:
            asyncio.run(signal_during_the_swap())
        finally:
            release.set()
            swapping.join(120)
        assert answers and answers[0].status_code == 200, answers and answers[0].text
        assert service.served.ref == "m@v2" and service.config.decode_mode == "diffusion"
        answer = client.post("/v1/completions", json=ASK)
        assert answer.status_code == 200, answer.text


def test_a_reload_that_read_its_settings_as_a_hot_swap_began_runs_again_after_it(client: TestClient) -> None:
    """The settings were read while no swap ran, and a swap began meanwhile: the reload is
    not applied against the version leaving, nor dropped; it runs once the swap is over."""
    service = client.app.state.service  # type: ignore[attr-defined]
    reads: list[int] = []

    def settings() -> ServeConfig:
        reads.append(len(reads))
        service.swapping = len(reads) == 1  # a hot swap begins while the file is first read
        return load_config(None, {**BASE, "max_steps": 64}, environ={})

    server = DrainingServer(uvicorn.Config(client.app), service, settings)

    async def reload_across_a_swap() -> None:
        server._reload_requested()
        assert server._reloading is not None
        await server._reloading
        assert service.config.max_steps == 1024  # not during the swap
        service.swapping = False  # switched
        await server.on_tick(0)  # read again, and applied
        await server._reloading

    try:
        asyncio.run(reload_across_a_swap())
    finally:
        service.swapping = False
    assert service.config.max_steps == 64 and len(reads) == 2


def test_a_token_rate_lowered_while_a_request_is_prepared_is_its_400_not_a_500(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGHUP that lowers `tokens_per_minute` below a request's charge after its parameters
    were checked (on the preparation thread) and before it is charged (on the event loop):
    the bucket's OverCapacity escaped as a 500 with a traceback. It is the 400 the check
    answers for the new rate, as for a request that arrives after the reload."""
    service = client.app.state.service  # type: ignore[attr-defined]
    checked = service.params

    def reloaded_meanwhile(*args: object, **kwargs: object) -> object:
        resolved = checked(*args, **kwargs)
        service.reload(load_config(None, {**BASE, "tokens_per_minute": 4}, environ={}))
        return resolved

    monkeypatch.setattr(service, "params", reloaded_meanwhile)
    answer = client.post("/v1/completions", json=ASK)  # 8 tokens: over the 4 a minute now
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("max_tokens_exceeded", "max_tokens"), error


def test_a_key_file_edited_on_disk_is_named_as_needing_a_restart(tmp_path: Path) -> None:
    """Keys take a restart, and a reload names what it did not apply; but a key file edited in
    place (a rotated Secret) kept its path, so SIGHUP said 'no live setting changed' while
    the new key got 401. The keys compared are those each reading found."""
    keys = tmp_path / "keys"
    keys.write_text("sk-one\n")
    settings = {**BASE, "api_key_file": str(keys)}
    served = load_config(None, settings, environ={})
    keys.write_text("sk-one\nsk-two\n")
    merged, applied, restart = served.reloaded(load_config(None, settings, environ={}))
    assert (applied, restart) == ({}, ["api_key_file"])
    assert merged.keys() == ["sk-one"]  # not applied: the keys served are the start's
    assert served.reloaded(load_config(None, settings, environ={}))[2] == ["api_key_file"]
    keys.write_text("sk-one\n")  # as served again: nothing to name
    assert served.reloaded(load_config(None, settings, environ={}))[2] == []
