"""`dlm serve` as a real process over TLS: per-key rate limits, readiness, and SIGTERM
draining (stop admitting, finish in-flight work, exit 0)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import session_home
from tests.serving import ServerProcess, fixed_output_checkpoint, self_signed_certificate, wait_until

pytestmark = pytest.mark.slow  # every test here starts processes

KEY_A, KEY_B = "sk-drain-aaaa", "sk-drain-bbbb"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = fixed_output_checkpoint(tmp_path_factory.mktemp("drain_model") / "drain-model")
    directory = tmp_path_factory.mktemp("drain_config")
    cert, key = self_signed_certificate(directory)
    config = directory / "serve.yaml"
    config.write_text(
        f"api-keys: [{KEY_A}, {KEY_B}]\nrequests_per_minute: 2\nshutdown_grace: 30\n"
        f"public_metrics: true\ndtype: float32\nssl_certfile: {cert}\nssl_keyfile: {key}\n"
    )
    proc = ServerProcess([str(model), "--config", str(config)], session_home(tmp_path_factory), tls=True)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.terminate()


def test_per_key_request_rate_limit(server: ServerProcess) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    for _ in range(2):
        assert server.http.post(server.url + "/v1/completions", json=body, headers=auth(KEY_A)).status_code == 200
    limited = server.http.post(server.url + "/v1/completions", json=body, headers=auth(KEY_A))
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    # Another key has its own bucket.
    assert server.http.post(server.url + "/v1/completions", json=body, headers=auth(KEY_B)).status_code == 200
    assert server.metrics()['dlm_request_rejections_total{reason="rate_limit_exceeded"}'] == 1


def test_sigterm_drains_in_flight_requests_then_exits_0(server: ServerProcess) -> None:
    results: dict[str, httpx.Response] = {}

    def long_request() -> None:
        body = {"prompt": "x", "max_tokens": 256, "block_length": 256, "steps": 256}
        results["in_flight"] = server.http.post(
            server.url + "/v1/completions", json=body, headers=auth(KEY_B), timeout=60
        )

    worker = threading.Thread(target=long_request)
    worker.start()
    assert wait_until(lambda: server.metrics()["dlm_num_requests_running"] == 1)
    server.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: server.http.get(server.url + "/ready").status_code == 503)
    ready = server.http.get(server.url + "/ready").json()["error"]
    assert ready["code"] == "draining"
    refused = server.http.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=auth(KEY_A)
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert server.http.get(server.url + "/health").status_code == 200  # alive while draining
    worker.join(60)
    response = results["in_flight"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert response.json()["usage"]["denoising_steps"] == 256  # it ran to the end
    assert server.proc.wait(30) == 0
