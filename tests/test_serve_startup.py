"""A request sent the moment `dlm serve` says it is listening is answered, not refused.

The port opens before the model loads (a busy port fails at once, /health answers during
loading); generation requests that arrive meanwhile wait for the model within `--ready-wait`.
Once ready, the server logs one line with the URL it serves at (the bound port, also for
`--port 0`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.serving import ServerProcess, wait_until

pytestmark = pytest.mark.slow  # starts a server


def test_a_request_sent_at_listening_time_waits_for_the_model(tmp_path: Path) -> None:
    server = ServerProcess(["--no-warmup"], tmp_path / "home")  # returns as soon as it listens
    try:
        early = server.http.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8})
        assert early.status_code == 200, early.text
        assert early.json()["choices"][0]["finish_reason"] in ("stop", "length")
        port = server.url.rsplit(":", 1)[1]
        ready = re.compile(rf"ready: serving \S+ at http://127\.0\.0\.1:{port}/v1")
        assert wait_until(lambda: any(ready.search(line) for line in server.lines), timeout=30), server.lines
    finally:
        assert server.terminate() == 0
