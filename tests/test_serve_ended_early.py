"""A request ended before its answer was complete (here: by shutdown, the drain past its
grace) logs and counts the completion tokens it had generated, not 0 after its client had
received deltas. In process (the app over tiny SDAR), the drain run on the app's loop."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tests.serving import app_client


def test_a_stream_ended_by_shutdown_counts_what_it_generated(caplog: pytest.LogCaptureFixture) -> None:
    body = {"prompt": "hi", "max_tokens": 512, "ignore_eos": True, "block_length": 4, "stream": True}
    with app_client({"model": "tiny:sdar", "warmup": False, "max_tokens": 512}) as client:
        service: Any = client.app.state.service  # type: ignore[attr-defined]
        sent, events = "", []
        with caplog.at_level(logging.INFO, logger="dlm.requests"):
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                drained = False
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: ") :])
                    events.append(event)
                    sent += "".join(c.get("text") or "" for c in event.get("choices", []))
                    if sent and not drained:  # deltas reached the client: now shut down
                        drained = True
                        assert client.portal is not None
                        client.portal.call(service.engine.drain, 0.0)
        generation = service.metrics.render().decode()
    assert sent and events[-1]["error"]["code"] == "shutdown", events[-1]
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "dlm.requests"]
    (logged,) = [line for line in lines if line["endpoint"] == "completions"]
    assert (logged["outcome"], logged["finish_reason"]) == ("failed", "shutdown"), logged
    assert logged["completion_tokens"] > 0, logged
    total = next(x for x in generation.splitlines() if x.startswith("dlm_generation_tokens_total "))
    assert float(total.split()[1]) == logged["completion_tokens"]
