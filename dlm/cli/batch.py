"""`dlm batch`: offline inference over an OpenAI Batch API file, through the server's own code.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}` (the format `vllm run-batch` reads). The requests go
to an in-process instance of the HTTP app (`dlm.cli.server.app`, over an ASGI transport, no
socket), so a batch line gets exactly the answer the server gives the same request: the same
validation, defaults, limits and continuous batching. Up to `concurrency` requests are in
flight at once, so the engine decodes them together.

Resumable: every result is appended to the output as one line and flushed as soon as it is
known. A rerun reads the output first, drops a last line cut short by a kill, and sends only
the requests whose `custom_id` has no result yet, so a run killed at any moment and started
again ends with each request answered exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.cli.jsonl import read_objects
from dlm.cli.server.config import ServeConfig
from dlm.engine.errors import DlmError, UsageError

URLS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchSummary:
    total: int
    skipped: int  # answered by an earlier run
    completed: int  # answered now with HTTP 200
    failed: int  # answered now with an error


def read_requests(path: Path) -> list[BatchRequest]:
    """The input file, checked whole before any request runs (a bad line is a usage error
    naming it, never a half-done batch)."""
    requests: list[BatchRequest] = []
    seen: set[str] = set()
    for number, item in read_objects(path):
        custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            raise UsageError(f"{path}:{number}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise UsageError(f"{path}:{number}: custom_id {custom_id!r} appears twice")
        if item.get("method", "POST") != "POST" or url not in URLS:
            raise UsageError(f"{path}:{number}: only POST to {' or '.join(URLS)} is supported, got {url!r}")
        if not isinstance(body, dict):
            raise UsageError(f"{path}:{number}: body must be a JSON object")
        if body.get("stream"):
            raise UsageError(f"{path}:{number}: a batch request cannot stream")
        seen.add(custom_id)
        requests.append(BatchRequest(custom_id, url, body))
    return requests


def answered(output: Path) -> set[str]:
    """custom_ids the output already answers; a last line cut short by a kill is removed."""
    if not output.exists():
        return set()
    raw = output.read_bytes()
    keep = raw if raw.endswith(b"\n") or not raw else raw[: raw.rfind(b"\n") + 1]
    if keep != raw:
        with open(output, "r+b") as handle:
            handle.truncate(len(keep))
    done = set()
    for line in keep.decode("utf-8").splitlines():
        if line.strip():
            done.add(json.loads(line)["custom_id"])
    return done


def result_line(request: BatchRequest, status: int, body: Any) -> dict[str, Any]:
    """One output line in the Batch API's shape (an error body is both the response and `error`)."""
    request_id = f"batch_req_{uuid.uuid4().hex}"
    error = None if status == 200 else (body.get("error") if isinstance(body, dict) else {"message": str(body)})
    return {
        "id": request_id,
        "custom_id": request.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


async def run_batch(
    config: ServeConfig,
    requests: list[BatchRequest],
    output: Path,
    concurrency: int,
    on_result: Callable[[], None] | None = None,
) -> BatchSummary:
    """Send the requests the output does not answer yet to an in-process server; append each
    result as it comes."""
    import httpx

    from dlm.cli.server.app import create_app

    done = answered(output)
    todo = [r for r in requests if r.custom_id not in done]
    app = create_app(config)
    keys = config.keys()
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    completed = failed = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as sink:

        async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, request: BatchRequest) -> None:
            nonlocal completed, failed
            async with gate:
                response = await client.post(request.url, json=request.body, headers=headers)
            body = response.json()
            sink.write(json.dumps(result_line(request, response.status_code, body), ensure_ascii=False) + "\n")
            sink.flush()
            os.fsync(sink.fileno())  # a result written is a result kept, whatever kills us next
            if response.status_code == 200:
                completed += 1
            else:
                failed += 1
            if on_result is not None:
                on_result()

        async with app.router.lifespan_context(app):
            await app.state.loading  # no request is sent (and none answered 503) before the model is up
            service = app.state.service
            if service.load_error is not None:
                raise (UsageError if service.exit_code == 2 else DlmError)(service.load_error)
            transport = httpx.ASGITransport(app=app)
            timeout = httpx.Timeout(config.request_timeout + config.ready_wait)
            async with httpx.AsyncClient(transport=transport, base_url="http://dlm-batch", timeout=timeout) as client:
                gate = asyncio.Semaphore(concurrency)
                await asyncio.gather(*(one(client, gate, r) for r in todo))
    return BatchSummary(len(requests), len(requests) - len(todo), completed, failed)
