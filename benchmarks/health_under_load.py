"""`/health` latency while clients send abusive bodies: a liveness probe must keep answering.

Starts `dlm serve` (embedded model unless MODEL_DIR), measures `/health` from one prober
thread while idle, then while `--clients` threads post in a loop, one scenario at a time:

- `900KB`: a 900 KB text prompt (refused by the size check before tokenising);
- `at-limit`: a prompt just under the size check (tokenised on the preparation pool, then
  refused for context length);
- `chat`: a chat of just under the message limit (its template rendered on the pool).

Prints p50/p99/max of `/health` per scenario and its ratio to idle (goal: p99 under 100 ms).

    python benchmarks/health_under_load.py [MODEL_DIR] --seconds 20 --clients 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from dlm.cli.server.prepare import CHARS_PER_TOKEN, TOKENS_PER_MESSAGE  # noqa: E402
from dlm.engine.home import dlm_home  # noqa: E402
from tests.serving import ServerProcess  # noqa: E402


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


def client(url: str, path: str, body: bytes, stop: Any, statuses: Any) -> None:
    """Post `body` in a loop until `stop` is set, counting statuses (a separate process, so
    the clients' own CPU work does not delay the prober's thread)."""
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            status = http.post(url + path, content=body, headers={"Content-Type": "application/json"}).status_code
            statuses[status] = statuses.get(status, 0) + 1


def load(url: str, path: str, body: bytes, clients: int, seconds: float) -> dict[str, Any]:
    """Probe `/health` while `clients` processes post `body` in a loop; statuses seen."""
    with multiprocessing.Manager() as manager:
        stop, statuses = manager.Event(), manager.dict()
        procs = [multiprocessing.Process(target=client, args=(url, path, body, stop, statuses)) for _ in range(clients)]
        for p in procs:
            p.start()
        time.sleep(2.0)  # every client has a request in flight
        samples = probe(url, seconds)
        stop.set()
        for p in procs:
            p.join(120)
        return {**summary(samples), "statuses": dict(statuses)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: embedded model)")
    ap.add_argument("--seconds", type=float, default=20.0, help="probing time per scenario")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--scenarios", default="900KB,at-limit,chat", help="comma-separated, from the list above")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the result here")
    args = ap.parse_args()

    chars = args.max_model_len * CHARS_PER_TOKEN - 16
    messages = args.max_model_len // TOKENS_PER_MESSAGE - 1
    scenarios = {
        "900KB": ("/v1/completions", {"prompt": "lorem ipsum " * 75_000}),
        "at-limit": ("/v1/completions", {"prompt": ("lorem ipsum " * (chars // 12 + 1))[:chars]}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * messages}),
    }
    server_args = [*([args.model] if args.model else []), "--max-model-len", str(args.max_model_len)]
    server = ServerProcess(server_args, dlm_home())
    try:
        server.wait_ready()
        result: dict[str, Any] = {
            "clients": args.clients,
            "seconds": args.seconds,
            "idle": summary(probe(server.url, 5)),
        }
        for name in args.scenarios.split(","):
            path, body = scenarios[name]
            raw = json.dumps(body).encode()
            result[name] = {"body_bytes": len(raw), **load(server.url, path, raw, args.clients, args.seconds)}
            result[name]["p99_vs_idle"] = round(result[name]["p99_ms"] / result["idle"]["p99_ms"], 1)
    finally:
        server.terminate()
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
