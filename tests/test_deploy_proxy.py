"""`dlm serve` replicas behind HAProxy (`dlm deploy haproxy`), all on 127.0.0.1.

- Two real replicas behind the proxy: a load runs while each replica in turn is restarted
  (SIGTERM, drain, start again on its port): no request fails and both served traffic.
- SSE through the proxy is not buffered: the first chunk arrives while the replica is still
  decoding the request, as it does directly.
- The weighted split between two groups: 400 requests land within 5 points of the weights.
  That test uses stub upstreams (a few lines of http.server below): it checks the proxy's
  routing, which does not depend on what answers behind it.

HAProxy comes from the system's packages (`apt-get install haproxy`; .ci/run installs it).
Without it these tests skip with the reason, except under CI=true, where they fail.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from dlm.cli.deploy.haproxy import ProxySettings, parse_group, render
from dlm.cli.main import app
from tests.serving import ROOT, ServerProcess, wait_until

HAPROXY = shutil.which("haproxy")
if HAPROXY is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("haproxy is not installed: CI must install it (apt-get install -y haproxy)")
    pytest.skip("haproxy is not installed (apt-get install haproxy)", allow_module_level=True)

SERVED_BY = "X-Dlm-Served-By"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """haproxy in the foreground, on a rendered configuration."""

    def __init__(self, groups: list[str], directory: Path) -> None:
        self.port = free_port()
        settings = ProxySettings(
            groups=tuple(parse_group(g) for g in groups),
            bind=f"127.0.0.1:{self.port}",
            check_interval_ms=200,
            request_timeout=60,
        )
        config = directory / f"haproxy-{self.port}.cfg"
        config.write_text(render(settings))
        self.log = directory / f"haproxy-{self.port}.log"
        with self.log.open("w") as log:  # a file: a pipe nobody reads could fill and stall haproxy
            self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stderr=log, stdout=log)
        self.url = f"http://127.0.0.1:{self.port}"

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        if not wait_until(listening, timeout=20):
            self.stop()
            raise RuntimeError("haproxy did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_replicas(home: Path, ports: list[int]) -> list[ServerProcess]:
    """Start replicas side by side (each start loads torch and the model)."""
    started: dict[int, ServerProcess] = {}
    errors: list[BaseException] = []

    def one(port: int) -> None:
        try:
            started[port] = ServerProcess(["tiny:llada", "--max-num-seqs", "4"], home, port=port)
            started[port].wait_ready()
        except BaseException as exc:  # reported below, after every start has ended
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in ports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for server in started.values():
            server.terminate()
        raise errors[0]
    return [started[p] for p in ports]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[ServerProcess], Proxy, Path]]:
    home = tmp_path_factory.mktemp("home")
    ports = [free_port(), free_port()]
    replicas = start_replicas(home, ports)
    proxy = None
    try:
        proxy = Proxy([f"dlm={','.join(f'127.0.0.1:{p}' for p in ports)}"], home)
        yield replicas, proxy, home
    finally:
        if proxy is not None:
            proxy.stop()
        for server in replicas:
            server.terminate()


def running_requests(url: str) -> float:
    """The replica's own count of requests in its running batch (/metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("dlm_num_requests_running "))


def stream_chunks(url: str, body: dict, at_first: Callable[[], None] = lambda: None) -> int:
    """Stream a completion to its end and count its content chunks; `at_first` runs as soon
    as the first one has arrived."""
    chunks = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 1:
                    at_first()
    return chunks


@pytest.mark.slow
def test_proxy_streams_dlm_sse_without_buffering(cluster: tuple[list[ServerProcess], Proxy, Path]) -> None:
    """A real dlm stream through the proxy: its first chunk arrives while the replica is still
    generating (its running batch still holds the request), as it does directly; a buffering
    proxy would deliver it with the last, after the request left the batch. No clock is read:
    the stream is long (a chunk per 4 of its 256 denoising steps), so the replica is still at
    work when the first chunk is in, however loaded the machine."""
    replicas, _, home = cluster
    replica = replicas[0].url
    proxy = Proxy([f"one={replica.removeprefix('http://')}"], home)  # the same replica both ways
    body = {"prompt": "Hello", "max_tokens": 256, "steps": 256, "block_length": 4, "stream": True, "seed": 1}
    seen: dict[str, float] = {}
    try:
        direct = stream_chunks(replica, body, lambda: seen.setdefault("direct", running_requests(replica)))
        proxied = stream_chunks(proxy.url, body, lambda: seen.setdefault("proxied", running_requests(replica)))
    finally:
        proxy.stop()
    assert proxied == direct > 8  # the same seeded stream, many chunks long
    assert seen == {"direct": 1, "proxied": 1}  # both times the request was still being decoded


def stream_times(url: str, body: dict) -> tuple[float, float, int]:
    """Seconds to the first content chunk and to the end of the stream, and the chunk count."""
    start = time.perf_counter()
    first = None
    chunks = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - start
    assert first is not None
    return first, time.perf_counter() - start, chunks


class SlowStream(http.server.BaseHTTPRequestHandler):
    """An SSE upstream with fixed timing: one event at once, the next PAUSE seconds later."""

    PAUSE = 0.5
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # each event leaves at once, as uvicorn sends them

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in ('data: {"n": 1}', 'data: {"n": 2}', "data: [DONE]"):
            payload = (event + "\n\n").encode()
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            self.wfile.flush()
            time.sleep(self.PAUSE)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True

    def do_GET(self) -> None:  # the proxy's /ready checks
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_proxy_adds_under_50ms_to_the_first_chunk(tmp_path: Path) -> None:
    """First SSE chunk through the proxy no later than 50 ms after directly. The upstream is a
    stub with fixed timing, so the difference measures the proxy, not the model: with dlm behind
    it, the model's own step times on a shared machine vary by more than the proxy's cost (the
    test above checks a real dlm stream for the absence of buffering). Minima over alternating
    runs; a local hop costs about a millisecond, so 50 ms (the bound the issue sets) is not a
    tuned margin. A buffering proxy would be PAUSE (500 ms) late."""
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowStream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    direct_url = f"http://127.0.0.1:{upstream.server_address[1]}"
    proxy = Proxy([f"stub={direct_url.removeprefix('http://')}"], tmp_path)
    try:
        direct, proxied = [], []
        for _ in range(4):
            direct.append(stream_times(direct_url, {}))
            proxied.append(stream_times(proxy.url, {}))
    finally:
        proxy.stop()
        upstream.shutdown()
    assert min(p[0] for p in proxied) <= min(d[0] for d in direct) + 0.050
    assert all(end >= SlowStream.PAUSE for _, end, _ in proxied)  # the stream did take its time


@pytest.mark.slow
def test_dlm_loadtest_runs_through_the_proxy(cluster: tuple[list[ServerProcess], Proxy, Path], tmp_path: Path) -> None:
    _, proxy, _ = cluster
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlm",
            "loadtest",
            proxy.url,
            "-u",
            "2",
            "-t",
            "5s",
            "--out",
            str(tmp_path / "loadtest"),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    totals = json.loads(done.stdout)["totals"]
    assert totals["ok"] > 0 and totals["errors_by_status"] == {}


@pytest.mark.slow
def test_rolling_restart_behind_the_proxy_fails_no_request(cluster: tuple[list[ServerProcess], Proxy, Path]) -> None:
    replicas, proxy, home = cluster
    failures: list[str] = []
    served: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(base_url=proxy.url, timeout=60) as http:
            n = 0
            while not stop.is_set():
                n += 1
                stream = n % 2 == 0
                body = {"prompt": f"client {i} request {n}", "max_tokens": 16, "stream": stream}
                try:
                    if stream:
                        with http.stream("POST", "/v1/completions", json=body) as response:
                            lines = [line for line in response.iter_lines() if line]
                            ok = response.status_code == 200 and lines and lines[-1] == "data: [DONE]"
                            detail = f"{response.status_code} {lines[-3:]}"
                    else:
                        response = http.post("/v1/completions", json=body)
                        ok = response.status_code == 200 and response.json()["choices"][0]["finish_reason"]
                        detail = f"{response.status_code} {response.text[:200]}"
                    with lock:
                        if ok:
                            served[response.headers[SERVED_BY]] += 1
                        else:
                            failures.append(detail)
                except httpx.HTTPError as exc:
                    with lock:
                        failures.append(repr(exc))

    def served_by(name: str) -> int:
        with lock:
            return served[f"group_dlm/{name}"]

    clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in clients:
        t.start()
    try:
        assert wait_until(lambda: served_by("dlm0") > 2 and served_by("dlm1") > 2, timeout=60)
        for index in range(2):
            port = int(replicas[index].url.rsplit(":", 1)[1])
            assert replicas[index].terminate() == 0  # SIGTERM: drains its requests and exits 0
            before = served_by(f"dlm{index}")
            replicas[index] = start_replicas(home, [port])[0]
            # back in rotation once /ready answers: it serves again
            assert wait_until(lambda i=index, b=before: served_by(f"dlm{i}") > b + 2, timeout=60)
    finally:
        stop.set()
        for t in clients:
            t.join(120)
    assert failures == [], proxy.log.read_text()
    assert served_by("dlm0") > 0 and served_by("dlm1") > 0


class Stub(http.server.BaseHTTPRequestHandler):
    """Answers 200 to everything (and so to the proxy's /ready checks)."""

    def do_GET(self) -> None:
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_weighted_split_between_two_groups(tmp_path: Path) -> None:
    stubs = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub) for _ in range(3)]
    for stub in stubs:
        threading.Thread(target=stub.serve_forever, daemon=True).start()
    a, b, c = (f"127.0.0.1:{s.server_address[1]}" for s in stubs)
    proxy = Proxy([f"blue:70={a},{b}", f"green:30={c}"], tmp_path)
    try:
        with httpx.Client(base_url=proxy.url, timeout=10) as client:
            assert wait_until(lambda: client.get("/ready").status_code == 200, timeout=20)
            groups = Counter(client.get("/v1/models").headers[SERVED_BY].split("/")[0] for _ in range(400))
    finally:
        proxy.stop()
        for stub in stubs:
            stub.shutdown()
    assert sum(groups.values()) == 400
    assert abs(groups["group_blue"] / 400 - 0.70) <= 0.05
    assert abs(groups["group_green"] / 400 - 0.30) <= 0.05


@pytest.mark.slow  # runs haproxy -c
@pytest.mark.parametrize(
    "groups",
    [["dlm=10.0.0.1:8000"], ["a:80=10.0.0.1:8000,10.0.0.2:8000", "b:20=[::1]:8000"]],
)
def test_rendered_configuration_is_valid_haproxy(groups: list[str], tmp_path: Path) -> None:
    args = ["deploy", "haproxy", "--out", str(tmp_path / "haproxy.cfg")]
    result = CliRunner().invoke(app, [*args, *(x for g in groups for x in ("--group", g))])
    assert result.exit_code == 0, result.output
    check = subprocess.run([HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (["dlm"], "expected NAME[:WEIGHT]=HOST:PORT"),
        (["dlm=10.0.0.1"], "is not HOST:PORT"),
        (["dlm:0=10.0.0.1:8000"], "weight must be 1..256"),
        (["a=10.0.0.1:8000", "a=10.0.0.2:8000"], "group names repeat"),
        # Digits and letters of other scripts, which int() reads and HAProxy refuses: they
        # rendered (exit 0) a configuration `haproxy -c` rejects.
        (["a=10.0.0.1:\u0668\u0660\u0660\u0660"], "is not HOST:PORT"),  # Arabic-Indic 8000
        (["a:\u0663=10.0.0.1:8000"], "expected NAME[:WEIGHT]=HOST:PORT"),
        (["gr\u00fcn=10.0.0.1:8000"], "expected NAME[:WEIGHT]=HOST:PORT"),
        (["a=h\u00f6st:8000"], "is not HOST:PORT"),
    ],
)
def test_bad_groups_are_one_line_errors(groups: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["deploy", "haproxy", *(x for g in groups for x in ("--group", g))])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_a_bind_address_in_other_digits_is_refused() -> None:
    bind = "0.0.0.0:\u0668\u0660\u0668\u0660"  # 8080 in Arabic-Indic digits: rendered, and haproxy refused it
    result = CliRunner().invoke(app, ["deploy", "haproxy", "--group", "a=10.0.0.1:8000", "--bind", bind])
    assert result.exit_code == 2 and "--bind" in result.output and "Traceback" not in result.output
