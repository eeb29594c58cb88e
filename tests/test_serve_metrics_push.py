"""`--metrics-push-url`: the server's metrics pushed to a Prometheus Pushgateway (the guides'
monitoring address), here a fake gateway that records what it receives."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.cli.server.metrics_push import JOB
from tests.serving import app_client, wait_until


@contextmanager
def gateway(status: int = 200) -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    """A Pushgateway stand-in answering `status`; yields its URL and the pushes received
    (method, path, body)."""
    pushes: list[tuple[str, str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            pushes.append((self.command, self.path, body))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_PUT

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", pushes
    finally:
        server.shutdown()
        server.server_close()


def test_the_metrics_are_pushed_every_interval_and_once_more_at_the_end() -> None:
    with gateway() as (url, pushes):
        settings = {"model": "tiny:llada", "warmup": False, "metrics_push_url": url, "metrics_push_interval": 0.2}
        with app_client(settings) as client:
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200
            assert wait_until(lambda: len(pushes) >= 2)
            during = len(pushes)
        assert len(pushes) > during  # the last push, as the server stopped
    method, path, body = pushes[-1]
    assert method == "PUT" and path.startswith(f"/metrics/job/{JOB}/instance/"), path
    text = body.decode()
    # the final push carries the request the server answered
    assert "dlm_request_success_total{finished_reason=" in text or "dlm_request_success_total" in text, text[:500]
    assert "dlm_num_requests_running" in text


def test_a_failing_gateway_is_one_warning_and_the_server_serves_on(caplog: pytest.LogCaptureFixture) -> None:
    with gateway(status=500) as (url, pushes), caplog.at_level(logging.WARNING, logger="dlm.server"):
        settings = {"model": "tiny:llada", "warmup": False, "metrics_push_url": url, "metrics_push_interval": 0.1}
        with app_client(settings) as client:
            assert wait_until(lambda: len(pushes) >= 3)
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "metrics push" in r.getMessage()]
    assert len(warnings) == 1 and url in warnings[0], warnings


@pytest.mark.parametrize(
    "url", ["localhost:9091", "ftp://host", "http://", "http://host path", "http://host:9091?a=b", "http://h/p#f"]
)
def test_a_push_url_that_is_no_http_url_is_bad_usage(url: str) -> None:
    result = CliRunner().invoke(app, ["serve", "tiny:llada", "--metrics-push-url", url])
    assert result.exit_code == 2 and "metrics" in result.output, result.output


def test_credentials_in_the_url_are_sent_as_basic_auth_and_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A gateway behind basic auth (`http://user:secret@gateway:9091`, the URL form a
    Pushgateway's docs give): the URL's credentials were handed on as part of the host, every
    push failed ('Name or service not known') and the warning named the password. They are
    the Authorization header now, and the URL is logged without them."""
    from prometheus_client import CollectorRegistry, Counter

    from dlm.cli.server.metrics_push import MetricsPusher

    auths: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            auths.append(self.headers.get("Authorization"))
            self.send_response(200 if auths[-1] else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = CollectorRegistry()
    Counter("pushed", "a counter", registry=registry).inc()
    port = server.server_address[1]
    try:
        with caplog.at_level(logging.INFO, logger="dlm.server"):
            pusher = MetricsPusher(f"http://us%40er:s3cr%2Ft@127.0.0.1:{port}", 1.0, registry, "host:8000")
            pusher.push()
            assert not pusher.failing and auths == ["Basic dXNAZXI6czNjci90"]  # us@er:s3cr/t
            MetricsPusher(f"http://user:s3cret@127.0.0.1:{port + 1 if port < 65535 else 1}", 1.0, registry, "h").push()
    finally:
        server.shutdown()
        server.server_close()
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "metrics push to http://127.0.0.1:" in logged and "s3cret" not in logged and "user" not in logged, logged


def test_the_configuration_printed_at_start_masks_the_push_password() -> None:
    """`dlm serve` prints its configuration (stderr, or stdout with --json) at start: the push
    URL's password was printed as given."""
    from dlm.cli.server.config import load_config

    config = load_config(None, {"metrics_push_url": "http://ops:s3cret@gw:9091/x"}, environ={})
    assert config.public()["metrics_push_url"] == "http://ops:***@gw:9091/x"
    assert "s3cret" not in str(config.public())


def test_a_gateway_that_trickles_its_answer_is_given_up_at_the_push_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gateway that sends its answer a byte at a time, each within the socket timeout:
    the timeout applied per socket operation, so one push (and the last one, which shutdown
    waits for) lasted as long as the gateway liked. The push gives up at its deadline, while
    the gateway is still answering, with one warning that says so."""
    import socket

    from prometheus_client import CollectorRegistry, Counter

    from dlm.cli.server.metrics_push import MetricsPusher

    answer = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 400 + b"\r\nContent-Length: 0\r\n\r\n"
    ended = threading.Event()
    whole: list[bool] = []  # whether the gateway sent its whole answer

    def trickle(listener: socket.socket) -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)  # the request (its head and body: a few hundred bytes)
            try:
                for byte in answer:
                    connection.sendall(bytes([byte]))
                    ended.wait(0.05)  # well within the push's socket timeout (0.5 s)
                whole.append(True)
            except OSError:  # the pusher closed the connection
                whole.append(False)

    listener = socket.create_server(("127.0.0.1", 0))
    gateway = threading.Thread(target=trickle, args=(listener,), daemon=True)
    gateway.start()
    registry = CollectorRegistry()
    Counter("pushed", "a counter", registry=registry).inc()
    pusher = MetricsPusher(f"http://127.0.0.1:{listener.getsockname()[1]}", 0.5, registry, "host:8000")
    try:
        with caplog.at_level(logging.WARNING, logger="dlm.server"):
            pusher.push()
        gateway.join(60)
    finally:
        ended.set()
        listener.close()
    assert whole == [False], "the push waited for the gateway's whole answer"
    warnings = [r.getMessage() for r in caplog.records if "metrics push" in r.getMessage()]
    assert pusher.failing and len(warnings) == 1 and "within 0.5s" in warnings[0], warnings


@pytest.mark.parametrize("url", ["http://gw:9O91", "http://gw:99999", "http://:9091", "http://user:pw@/x"])
def test_a_push_url_whose_port_or_host_no_push_can_use_is_refused(url: str) -> None:
    """A port that is no number 0-65535, or no host: the URL passed the start's check, the
    server started, and every push then failed (`nonnumeric port: '9O91'`) with nothing said
    at start. It is an invalid setting now (`dlm serve`: exit 2 before any work)."""
    from dlm.cli.server.config import load_config
    from dlm.engine.errors import UsageError

    with pytest.raises(UsageError, match="invalid setting metrics_push_url"):
        load_config(None, {"metrics_push_url": url}, environ={})


def test_a_batch_run_pushes_to_its_own_group_not_a_servers(tmp_path: Path) -> None:
    """`dlm batch --config` with `metrics_push_url` pushed under instance HOSTNAME:8000 (the
    unused `port` setting's default), so each push replaced the group of a `dlm serve` on port
    8000 of the same machine, and its last push left the batch's counters as that server's.
    A run's group is HOSTNAME:OUTPUT now."""
    import base64
    import json
    import re
    import socket

    from tests.weights_helpers import cli

    source = tmp_path / "in.jsonl"
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    source.write_text(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    out = tmp_path / "out.jsonl"
    with gateway() as (url, pushes):
        settings = tmp_path / "serve.toml"
        settings.write_text(f'metrics_push_url = "{url}"\nmetrics_push_interval = 60\n')
        code, _, stderr = cli("batch", str(source), str(out), "--model", "tiny:llada", "--config", str(settings))
        assert code == 0, stderr
    assert pushes, "the run's last push did not arrive"
    _, path, body_pushed = pushes[-1]
    prefix = f"/metrics/job/{JOB}/instance@base64/"  # prometheus-client's form of a value holding '/'
    assert path.startswith(prefix), path
    instance = base64.urlsafe_b64decode(path.removeprefix(prefix) + "==").decode()
    assert instance == f"{socket.gethostname()}:{out.resolve()}"
    assert re.search(r'dlm_request_success_total\{finish_reason="(stop|length)"\} 1\.0', body_pushed.decode())
