"""A stream whose client leaves while the server is writing to it: the request leaves the
engine and is logged at once, not whenever the garbage collector finds its event generator."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Any

from dlm.cli.server.app import create_app
from dlm.cli.server.config import ServeConfig

BODY = json.dumps({"prompt": "hi", "max_tokens": 512, "n": 2, "stream": True}).encode()


def test_a_client_gone_while_a_chunk_is_written_ends_its_request_at_once() -> None:
    """uvicorn's ASGI 2.3: Starlette's StreamingResponse watches for the disconnect and cancels
    its writer; cancelled in the middle of a write, it left the response's event generator
    suspended and never closed it, so the request went on decoding (and was logged
    `client_closed`) only once a garbage collection finalised the generator."""

    async def scenario() -> tuple[int, int, float | None]:
        app = create_app(ServeConfig(model="tiny:llada", warmup=False))
        async with app.router.lifespan_context(app):
            await app.state.loading
            service = app.state.service
            gone = asyncio.Event()
            received: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                if not received:
                    received.append({})
                    return {"type": "http.request", "body": BODY, "more_body": False}
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body" and message.get("body"):
                    gone.set()  # the client leaves while this chunk is being written
                    await asyncio.Event().wait()  # a write that never completes

            scope = {
                "type": "http",
                "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/v1/completions",
                "raw_path": b"/v1/completions",
                "query_string": b"",
                "root_path": "",
                "headers": [(b"content-type", b"application/json"), (b"host", b"dlm")],
                "client": ("127.0.0.1", 1),
                "server": ("127.0.0.1", 80),
            }
            gc.disable()  # what was left behind is left behind: no collection may end it
            try:
                await asyncio.wait_for(app(scope, receive, send), 30)
                for _ in range(20):  # a few turns of the loop
                    await asyncio.sleep(0.01)
                engine = service.served.engine
                closed = service.metrics.registry.get_sample_value("dlm_http_requests_client_disconnected_total")
                return engine.num_running, engine.num_waiting, closed
            finally:
                gc.enable()

    assert asyncio.run(scenario()) == (0, 0, 1.0)  # both choices out of the batch, the client counted gone
