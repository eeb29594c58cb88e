"""`/health` latency while clients send abusive bodies: a liveness probe must keep answering.

Starts `dlm serve` (embedded model unless MODEL_DIR), measures `/health` from one prober
thread while idle, then while `--clients` threads post in a loop, one scenario at a time:

- `900KB`: a 900 KB text prompt (refused by the size check before tokenising);
- `at-limit`: a prompt just under the size check (tokenised on the preparation pool, then
  refused for context length);
- `chat`: a chat of just under the message limit (its template rendered on the pool);
- `exponential`: a 400-byte response_format of arrays of 64 items nested 6 deep (64**6
  integers: refused once the skeleton cannot fit, after bounded work);
- `enum-n`: a 10,000-value enum with `n` 64 (an 89 KB body: laid out once, off the loop,
  then 64 samples decoded);
- `large-answer`: a non-streamed chat answer of n 15 x 1024 tokens with 20 log-probability
  alternatives each (24 MB of JSON, encoded on a worker thread in slices:
  dlm/cli/server/answer_json.py); `large-answer-one-call`, the same against a second server
  whose answers are encoded in one `json.dumps` call (Starlette's `JSONResponse`, what the
  slices replaced), started after the first has stopped: the slices' effect, side by side;
- `silent-streams`: 20 canvas streams whose clients never read (a 4 KB receive buffer),
  held open, then closed (`while_closing`: /health while they close); `reading-streams`, the
  same streams read to their end, is the control for its memory;
- `tenant-flood`: key A keeps the queue full from `--flood` connections of long requests
  (waiting `Retry-After` after a 429, as clients do) while key B sends one request at a
  time; B's statuses are reported (it must never get 429). `429-storm` is the same flood
  without waiting: a request-rate flood, what `--requests-per-minute` is for.

The server has two API keys (so tenants' shares apply) and `--max-queue 128`.

Prints p50/p99/max of `/health` per scenario, its ratio to idle (goal: p99 under 100 ms) and
the server's peak resident memory during the scenario (`rss_max_mb`, from /proc).

    python benchmarks/health_under_load.py [MODEL_DIR] --seconds 20 --clients 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from dlm.cli.server.prepare import CHARS_PER_TOKEN, TOKENS_PER_MESSAGE  # noqa: E402
from dlm.engine.home import dlm_home  # noqa: E402
from tests.serving import ServerProcess  # noqa: E402

KEY_A, KEY_B, ADMIN = "sk-bench-tenant-a", "sk-bench-tenant-b", "sk-bench-operator"
ONE_CALL = "large-answer-one-call"
# `dlm` with the answer's JSON encoded in one call, as before dlm/cli/server/answer_json.py.
ONE_CALL_ENTRY = (
    "import sys; from fastapi.responses import JSONResponse; import dlm.cli.server.generation as g; "
    "g.json_response = lambda body, headers=None: JSONResponse(body, headers=headers); "
    "from dlm.cli.main import main; sys.argv[0] = 'dlm'; main()"
)


def rss_mb(pid: int) -> float:
    """The process's resident memory (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """The peak resident memory of `pid` while the block runs (sampled every 0.2 s)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss_mb(pid), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, rss_mb(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def probe(url: str, seconds: float, interval: float = 0.02) -> list[float]:
    """`/health` round trips (seconds) for `seconds`, one at a time on one connection."""
    out: list[float] = []
    end = time.monotonic() + seconds
    with httpx.Client(timeout=30) as http:
        while time.monotonic() < end:
            start = time.perf_counter()
            response = http.get(url + "/health")
            out.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text
            time.sleep(interval)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(1000 * statistics.median(ordered), 2),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
        "max_ms": round(1000 * ordered[-1], 2),
    }


def client(
    url: str,
    path: str,
    body: bytes,
    stop: Any,
    statuses: Any,
    key: str = KEY_A,
    threads: int = 1,
    backoff: bool = False,
) -> None:
    """Post `body` in a loop from `threads` connections until `stop` is set, counting statuses
    (a separate process, so the clients' own CPU work does not delay the prober's thread);
    with `backoff`, wait `Retry-After` after a 429."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}

    def loop() -> None:
        with httpx.Client(timeout=600) as http:
            while not stop.is_set():
                try:
                    response = http.post(url + path, content=body, headers=headers)
                    status = response.status_code
                except httpx.HTTPError:
                    status = -1
                statuses[status] = statuses.get(status, 0) + 1
                if backoff and status == 429:
                    stop.wait(float(response.headers.get("retry-after", "1")))

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def load(
    server: ServerProcess, path: str, body: bytes, clients: int, seconds: float, threads: int = 1
) -> dict[str, Any]:
    """Probe `/health` while `clients` processes post `body` in a loop; statuses seen."""
    url = server.url
    with multiprocessing.Manager() as manager, PeakRss(server.proc.pid) as rss:
        stop, statuses = manager.Event(), manager.dict()
        procs = [
            multiprocessing.Process(target=client, args=(url, path, body, stop, statuses, KEY_A, threads))
            for _ in range(clients)
        ]
        for p in procs:
            p.start()
        time.sleep(2.0)  # every client has a request in flight
        samples = probe(url, seconds)
        stop.set()
        for p in procs:
            p.join(600)
        return {**summary(samples), "statuses": dict(statuses), "rss_max_mb": round(rss.peak)}


def reading_streams(server: ServerProcess, body: bytes, streams: int, seconds: float) -> dict[str, Any]:
    """`/health` and memory while `streams` canvas streams are read to their end (the control)."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"}

    def read() -> None:
        with (
            httpx.Client(timeout=600) as http,
            http.stream("POST", server.url + "/v1/completions", content=body, headers=headers) as r,
        ):
            for _ in r.iter_bytes():
                pass

    with PeakRss(server.proc.pid) as rss:
        readers = [threading.Thread(target=read) for _ in range(streams)]
        for reader in readers:
            reader.start()
        time.sleep(2.0)
        held = summary(probe(server.url, seconds))
        for reader in readers:
            reader.join(600)
    return {**held, "rss_max_mb": round(rss.peak)}


def silent_streams(server: ServerProcess, body: bytes, streams: int, seconds: float) -> dict[str, Any]:
    """`/health` while `streams` canvas streams are held by clients that never read, then
    while they close."""
    host, port = server.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with PeakRss(server.proc.pid) as rss:
        socks = []
        for _ in range(streams):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(head + body)
            socks.append(sock)
        time.sleep(2.0)
        held = summary(probe(server.url, seconds))
        closing = threading.Thread(target=lambda: [s.close() for s in socks])
        closing.start()
        closed = summary(probe(server.url, min(seconds, 10)))
        closing.join()
    logged = [line for line in server.request_logs() if line.get("stream")][-streams:]
    outcomes: dict[str, int] = {}
    for line in logged:
        outcomes[f"{line['status']} {line.get('outcome')}"] = (
            outcomes.get(f"{line['status']} {line.get('outcome')}", 0) + 1
        )
    return {**held, "while_closing": closed, "logged": outcomes, "rss_max_mb": round(rss.peak)}


def tenant_flood(server: ServerProcess, flood: bytes, flooders: int, seconds: float, backoff: bool) -> dict[str, Any]:
    """Key A floods from `flooders` connections; key B posts one request at a time."""
    url = server.url
    with multiprocessing.Manager() as manager, PeakRss(server.proc.pid) as rss:
        stop, a, b = manager.Event(), manager.dict(), manager.dict()
        path = "/v1/completions"
        small = json.dumps({"prompt": "tenant b", "max_tokens": 8, "steps": 8}).encode()
        procs = [
            multiprocessing.Process(target=client, args=(url, path, flood, stop, a, KEY_A, -(-flooders // 4), backoff))
            for _ in range(4)
        ]
        procs.append(multiprocessing.Process(target=client, args=(url, path, small, stop, b, KEY_B, 1)))
        for p in procs:
            p.start()
        time.sleep(3.0)
        samples = probe(url, seconds)
        stop.set()
        for p in procs:
            p.join(600)
        return {**summary(samples), "statuses_a": dict(a), "statuses_b": dict(b), "rss_max_mb": round(rss.peak)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: embedded model)")
    ap.add_argument("--seconds", type=float, default=20.0, help="probing time per scenario")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--scenarios",
        default="900KB,at-limit,chat,exponential,enum-n,large-answer,reading-streams,silent-streams,tenant-flood,"
        f"429-storm,{ONE_CALL}",
        help="comma-separated, from the list above",
    )
    ap.add_argument("--flood", type=int, default=96, help="key A's connections in tenant-flood")
    ap.add_argument("--request-timeout", type=float, default=10.0, help="the server's, for silent-streams")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the result here")
    args = ap.parse_args()

    chars = args.max_model_len * CHARS_PER_TOKEN - 16
    messages = args.max_model_len // TOKENS_PER_MESSAGE - 1
    nested: dict[str, Any] = {"type": "integer"}
    for _ in range(6):
        nested = {"type": "array", "items": nested, "minItems": 64, "maxItems": 64}
    enum = {"type": "array", "items": {"enum": [f"v{i:04d}" for i in range(10_000)]}, "minItems": 1, "maxItems": 1}
    ask = [{"role": "user", "content": "Answer in JSON."}]
    scenarios = {
        "900KB": ("/v1/completions", {"prompt": "lorem ipsum " * 75_000}),
        "at-limit": ("/v1/completions", {"prompt": ("lorem ipsum " * (chars // 12 + 1))[:chars]}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * messages}),
        "exponential": ("/v1/chat/completions", {"messages": ask, "response_format": _schema(nested)}),
        "enum-n": (
            "/v1/chat/completions",
            {"messages": ask, "n": 64, "max_tokens": 32, "steps": 8, "response_format": _schema(enum)},
        ),
        "large-answer": (
            "/v1/chat/completions",
            {"messages": ask, "n": 15, "max_tokens": 1024, "block_length": 1024, "steps": 4, "logprobs": True}
            | {"top_logprobs": 20},
        ),
    }
    canvas = {"prompt": "x", "max_tokens": 1024, "stream": True, "stream_options": {"include_canvas": True}}
    flood = {"prompt": "tenant a", "max_tokens": 256, "steps": 256}
    server_args = [
        *([args.model] if args.model else []),
        *("--max-model-len", str(args.max_model_len), "--request-timeout", str(args.request_timeout)),
        *("--api-key", KEY_A, "--api-key", KEY_B, "--max-queue", "128"),
    ]
    names = args.scenarios.split(",")
    server = ServerProcess(server_args, dlm_home(), env={"DLM_ADMIN_KEY": ADMIN})
    try:
        server.wait_ready()
        result: dict[str, Any] = {
            "clients": args.clients,
            "seconds": args.seconds,
            "idle": {**summary(probe(server.url, 5)), "rss_mb": round(rss_mb(server.proc.pid))},
        }
        for name in names:
            if name == ONE_CALL:
                continue  # its own server, below
            if name == "silent-streams":
                result[name] = silent_streams(server, json.dumps(canvas).encode(), 20, args.seconds)
            elif name == "reading-streams":
                result[name] = reading_streams(server, json.dumps(canvas).encode(), 20, args.seconds)
            elif name in ("tenant-flood", "429-storm"):
                backoff = name == "tenant-flood"
                result[name] = tenant_flood(server, json.dumps(flood).encode(), args.flood, args.seconds, backoff)
            else:
                path, body = scenarios[name]
                raw = json.dumps(body).encode()
                result[name] = {"body_bytes": len(raw), **load(server, path, raw, args.clients, args.seconds)}
            result[name]["p99_vs_idle"] = round(result[name]["p99_ms"] / result["idle"]["p99_ms"], 1)
    finally:
        server.terminate()
    if ONE_CALL in names:
        path, body = scenarios["large-answer"]
        server = ServerProcess(server_args, dlm_home(), env={"DLM_ADMIN_KEY": ADMIN}, entry=("-c", ONE_CALL_ENTRY))
        try:
            server.wait_ready()
            result[ONE_CALL] = load(server, path, json.dumps(body).encode(), args.clients, args.seconds)
            result[ONE_CALL]["p99_vs_idle"] = round(result[ONE_CALL]["p99_ms"] / result["idle"]["p99_ms"], 1)
        finally:
            server.terminate()
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


if __name__ == "__main__":
    main()
