"""`dlm batch`: offline inference over an OpenAI Batch API file, through the server's own code.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}` (the format `vllm run-batch` reads). The requests go
to an in-process instance of the HTTP app (`dlm.cli.server.app`, over an ASGI transport, no
socket), so a batch line gets exactly the answer the server gives the same request: the same
validation, defaults, limits and continuous batching. Up to `concurrency` requests are in
flight at once, so the engine decodes them together.

A 429 (a rate limit of `--config`, a full queue) is a shortage that waiting cures, never a
line's answer: the request is sent again after the Retry-After the server gave.

Every line gets a result line: a request the app fails on (an exception where the server
would answer 500) gets a 500 `server_error` record like any refused request, and the other
lines go on; one bad line never stops a batch.

Resumable: every result is appended to the output as one line and flushed as soon as it is
known. A rerun reads the output first, drops a last line cut short by a kill, and sends only
the requests whose `custom_id` has no result yet, so a run killed at any moment and started
again ends with each request answered exactly once. A result's id is a digest of the request
line it answers (`request_id`), so a rerun whose INPUT changed a request already answered, or
lost one, is refused instead of keeping an answer to another question. A run holds an
exclusive lock on the output (`claim_output`), so a second run on the same output is refused
rather than answering everything again.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dlm.cli.jsonl import LineError, lines, objects, read_objects
from dlm.cli.server.config import ServeConfig
from dlm.engine.errors import DlmError, UsageError

URLS = ("/v1/completions", "/v1/chat/completions")
LINE_FIELDS = ("custom_id", "method", "url", "body")  # the Batch API's request line, nothing else
ID_PREFIX = "batch_req_"
# How every result line starts (`BatchOutput.append` writes `json.dumps` of `result_line`,
# whose first key is "id"): a last line without its newline is one of ours cut by a kill
# only if it starts so (or is shorter than this and a start of it).
RESULT_START = f'{{"id": "{ID_PREFIX}'.encode()
# JSON text (`json.dumps(..., ensure_ascii=False)`) as UTF-8 bytes. A JSON string may hold an
# unpaired surrogate (`"\ud800"` reads as one), which UTF-8 cannot encode; it can only sit
# inside a string, where "backslashreplace" writes it back as the same `\ud800` escape, so
# the bytes read back as the value they were made from.
UNPAIRED = "backslashreplace"


def json_bytes(value: Any) -> bytes:
    """`value` as compact JSON in UTF-8, as an HTTP client sends a body; an unpaired
    surrogate escaped (`UNPAIRED`), so the server reads it and answers as it does for one."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", UNPAIRED)


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
        unknown = [key for key in item if key not in LINE_FIELDS]
        if unknown:  # a parameter beside the body (`"max_tokens": 5`) would be silently ignored
            raise UsageError(
                f"{path}:{number}: unknown field {unknown[0]!r}: a line has {', '.join(LINE_FIELDS)} "
                "(request parameters go in body)"
            )
        if not isinstance(custom_id, str) or not custom_id:
            raise UsageError(f"{path}:{number}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise UsageError(f"{path}:{number}: custom_id {custom_id!r} appears twice")
        method = item.get("method", "POST")
        if method != "POST" or url not in URLS:
            raise UsageError(
                f"{path}:{number}: only POST to {' or '.join(URLS)} is supported, got {method!r} to {url!r}"
            )
        if not isinstance(body, dict):
            raise UsageError(f"{path}:{number}: body must be a JSON object")
        if body.get("stream"):
            raise UsageError(f"{path}:{number}: a batch request cannot stream")
        seen.add(custom_id)
        requests.append(BatchRequest(custom_id, url, body))
    return requests


def request_id(request: BatchRequest) -> str:
    """The id of the result line answering `request`: a digest of its custom_id, url and body
    (32 hex digits, as long as a uuid), so a rerun can tell that a line of OUTPUT
    still answers the request INPUT now holds under that custom_id."""
    line = json.dumps([request.custom_id, request.url, request.body], ensure_ascii=False, sort_keys=True)
    return ID_PREFIX + hashlib.sha256(line.encode("utf-8", UNPAIRED)).hexdigest()[:32]


class BatchOutput:
    """The output file of one run, held under an exclusive lock: the requests of INPUT it
    does not answer yet (`todo`), and `append` for new results."""

    def __init__(self, path: Path, handle: IO[bytes], todo: list[BatchRequest]) -> None:
        self.path, self._handle, self.todo = path, handle, todo

    def append(self, record: dict[str, Any]) -> None:
        """One result line, on disk (fsynced) before this returns: a result written is a
        result kept, whatever kills the run next."""
        self._handle.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", UNPAIRED))
        self._handle.flush()
        os.fsync(self._handle.fileno())


@contextmanager
def claim_output(path: Path, requests: list[BatchRequest]) -> Iterator[BatchOutput]:
    """Open OUTPUT (created if missing) for a run answering `requests`: refuse it while
    another run holds it, when it is not a `dlm batch` output, or when it answers other
    requests than these (nothing in it is changed then); drop a last line cut short by a
    kill. The lock (flock on the file itself) lasts for the block; the kernel
    drops it when the holder dies, so a killed run never blocks the next."""
    if path.is_dir():
        raise UsageError(f"OUTPUT {path} is a directory")
    if path.exists() and not path.is_file():  # a FIFO would fail the open ("not seekable"), or block
        raise UsageError(f"OUTPUT {path} is not a regular file")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise UsageError(f"OUTPUT {path} is not a regular file")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _flock_holder(handle.fileno())
            by = f" (pid {holder})" if holder is not None else ""
            raise DlmError(
                f"another dlm batch{by} is writing {path}; wait for it to end, or give another OUTPUT"
            ) from None
        handle.seek(0)
        raw = handle.read()
        whole, _, tail = raw.rpartition(b"\n")
        todo = _unanswered(path, _answered(path, whole), requests)
        if tail and not (tail.startswith(RESULT_START) or RESULT_START.startswith(tail)):
            raise UsageError(
                f"OUTPUT {path} is not a dlm batch output (its last line is not a result cut short); "
                "refusing to append to it"
            )
        if tail:  # the line a kill cut short: its request is sent again
            handle.truncate(len(raw) - len(tail))
        yield BatchOutput(path, handle, todo)


def _answered(path: Path, whole: bytes) -> dict[str, tuple[int, Any]]:
    """The complete lines of an output: custom_id -> (line number, the line's id);
    UsageError naming the first line that is not a result."""
    try:
        text = whole.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"OUTPUT {path} is not a dlm batch output (not UTF-8); refusing to append to it") from None
    done = {}
    refusal = "OUTPUT is not a dlm batch output, refusing to append to it"
    try:
        for number, item in objects(text):
            if not isinstance(item.get("custom_id"), str) or not {"response", "error"} <= item.keys():
                raise UsageError(f"{path}:{number}: not a result (custom_id, response, error): {refusal}")
            done[item["custom_id"]] = (number, item.get("id"))
    except LineError as exc:
        raise UsageError(f"{path}:{exc.number}: {exc.problem}: {refusal}") from None
    return done


def _unanswered(path: Path, answered: dict[str, tuple[int, Any]], requests: list[BatchRequest]) -> list[BatchRequest]:
    """The requests no line of OUTPUT answers. A line answering a custom_id INPUT does not
    hold, or holding the id of another request under its custom_id (its url or body changed
    since), is a UsageError: resuming would keep an answer to a question nobody asks now."""
    asked = {r.custom_id: r for r in requests}
    fix = "delete that line from OUTPUT to answer the request again, or give another OUTPUT"
    for custom_id, (number, line_id) in answered.items():
        request = asked.get(custom_id)
        if request is None:
            raise UsageError(f"{path}:{number}: answers custom_id {custom_id!r}, which INPUT does not hold: {fix}")
        if line_id != request_id(request):
            raise UsageError(
                f"{path}:{number}: answers custom_id {custom_id!r} for another request than INPUT's "
                f"(its url or body changed since, or OUTPUT comes from another batch): {fix}"
            )
    return [r for r in requests if r.custom_id not in answered]


def _flock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file open as `fd`, from /proc/locks (Linux), or None."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    for entry in lines(table):
        fields = entry.split()  # "1: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF"; waiters have "->"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key and fields[4].isdigit():
            return int(fields[4])
    return None


def result_line(request: BatchRequest, status: int, body: Any) -> dict[str, Any]:
    """One output line in the Batch API's shape (an error body is both the response and `error`)."""
    line_id = request_id(request)
    error = None if status == 200 else (body.get("error") if isinstance(body, dict) else {"message": str(body)})
    return {
        "id": line_id,
        "custom_id": request.custom_id,
        "response": {"status_code": status, "request_id": line_id, "body": body},
        "error": error,
    }


def _retry_after(header: str | None) -> float:
    """Seconds to wait before sending a request the server answered 429 again: its
    Retry-After (whole seconds), 1 when it gives none."""
    try:
        return max(float(header or 1), 0.1)
    except ValueError:
        return 1.0


async def run_batch(
    config: ServeConfig,
    requests: list[BatchRequest],
    output: BatchOutput,
    concurrency: int,
    on_result: Callable[[], None] | None = None,
) -> BatchSummary:
    """Send the requests the output does not answer yet to an in-process server; append each
    result as it comes."""
    import httpx

    from dlm.cli.server import errors
    from dlm.cli.server.app import create_app
    from dlm.cli.server.metrics_push import batch_instance

    todo = output.todo
    # the client is the operator: 500s name their cause; pushed metrics are this run's own group
    app = create_app(config, failure_detail=True, push_instance=batch_instance(output.path))
    keys = config.keys()
    headers = {"Content-Type": "application/json"}
    if keys:
        headers["Authorization"] = f"Bearer {keys[0]}"
    completed = failed = 0

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, request: BatchRequest) -> None:
        nonlocal completed, failed
        try:
            async with gate:
                response = await client.post(request.url, content=json_bytes(request.body), headers=headers)
                while response.status_code == 429:  # a shortage that waiting cures, not this line's answer
                    await asyncio.sleep(_retry_after(response.headers.get("Retry-After")))
                    response = await client.post(request.url, content=json_bytes(request.body), headers=headers)
            status, body = response.status_code, response.json()
        except Exception as exc:  # noqa: BLE001 - whatever the app raised is this line's answer, not the batch's end
            status, body = 500, errors.internal(exc).body()
        output.append(result_line(request, status, body))
        if status == 200:
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
        transport = httpx.ASGITransport(app=app)  # an app exception reaches `one` as itself
        timeout = httpx.Timeout(config.request_timeout + config.ready_wait)
        async with httpx.AsyncClient(transport=transport, base_url="http://dlm-batch", timeout=timeout) as client:
            gate = asyncio.Semaphore(concurrency)
            await asyncio.gather(*(one(client, gate, r) for r in todo))
    return BatchSummary(len(requests), len(requests) - len(todo), completed, failed)
