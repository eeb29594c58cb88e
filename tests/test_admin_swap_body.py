"""`POST /admin/swap`'s body is read and parsed as the API's are (dlm/cli/server/body.py):
capped while it arrives and a key given twice refused. It was read whole before its cap was
applied, and pydantic's JSON parser kept the last of two values of one key."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import Message, Scope

from dlm.cli.server.admin import MAX_BODY, create_admin_app
from dlm.cli.server.config import load_config
from dlm.cli.server.hotswap import HotSwapper, SwapRequest
from dlm.cli.server.service import Service
from dlm.cli.store.admin import SWAP_PATH

KEY = "sk-admin-test"
CHUNK = 1024


class RecordingSwapper(HotSwapper):
    """Answers each swap at once and keeps what it was asked: no model is loaded."""

    def __init__(self, service: Service) -> None:
        super().__init__(service)
        self.requests: list[SwapRequest] = []

    async def swap(self, request: SwapRequest) -> dict[str, Any]:
        self.requests.append(request)
        return {"status": "ok", "model": request.model, "version": request.version}


@pytest.fixture
def swapper() -> RecordingSwapper:
    return RecordingSwapper(Service(load_config(None, {"model": "tiny:sdar", "warmup": False}, environ={})))


def test_a_key_given_twice_is_refused_not_resolved_to_its_last_value(swapper: RecordingSwapper) -> None:
    client = TestClient(create_admin_app(swapper, KEY))
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = '{"model": "a", "model": "b", "version": "v2", "path": "/models/v2"}'
    refused = client.post(SWAP_PATH, content=body, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_json"
    assert "'model' appears twice" in refused.json()["error"]["message"]
    assert swapper.requests == []
    one = client.post(SWAP_PATH, content=body.replace('"model": "a", ', ""), headers=headers)
    assert one.status_code == 200 and [r.model for r in swapper.requests] == ["b"]


async def _post_streamed(app: FastAPI, chunks: int) -> tuple[int, int]:
    """POST `chunks` chunks of `CHUNK` bytes with no Content-Length, straight through ASGI; the
    answer's status and how many chunks the app pulled."""
    pulled = 0
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b" " * CHUNK, "more_body": pulled < chunks}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": SWAP_PATH,
        "raw_path": SWAP_PATH.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, pulled


def test_a_body_past_the_cap_is_refused_before_it_is_read_whole(swapper: RecordingSwapper) -> None:
    chunks = 16 * MAX_BODY // CHUNK
    status, pulled = asyncio.run(_post_streamed(create_admin_app(swapper, KEY), chunks))
    assert status == 413 and pulled * CHUNK <= MAX_BODY + CHUNK
    assert swapper.requests == []
