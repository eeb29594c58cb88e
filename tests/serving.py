"""Helpers for the server tests: run `dlm serve` as a real process on 127.0.0.1 (ephemeral
port), read its metrics and JSON logs, and build a checkpoint whose output is known."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        home: Path,
        env: dict[str, str] | None = None,
        tls: bool = False,
        port: int = 0,
        entry: tuple[str, ...] = ("-m", "dlm"),
    ) -> None:
        """`entry`: how Python starts the CLI (a benchmark may start it through `-c CODE` that
        swaps one piece first, to compare it with the code as it is)."""
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, *entry, "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            # One intra-op thread: on a shared 2-core machine OpenMP threads spinning against
            # other processes make each forward tens of times slower.
            env={"OMP_NUM_THREADS": "1", **os.environ, "DLM_HOME": str(home), **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            port = self._wait_port()
        except RuntimeError:
            self.proc.kill()  # never leave a server behind
            raise
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        self.http = httpx.Client(verify=False, timeout=120)  # tests trust their self-signed certificate

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def _wait_port(self, timeout: float = 120) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.lines):
                match = LISTENING.search(line)
                if match:
                    return int(match.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError("dlm serve exited:\n" + "\n".join(self.lines))
            time.sleep(0.05)
        raise RuntimeError("dlm serve did not start listening:\n" + "\n".join(self.lines))

    def wait_ready(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.http.get(self.url + "/ready").status_code == 200:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("dlm serve never became ready:\n" + "\n".join(self.lines))

    def metrics(self, key: str | None = None) -> dict[str, float]:
        """Every sample as `name{label="v",...}` -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = self.http.get(self.url + "/metrics", headers=headers)
        response.raise_for_status()
        out = {}
        for family in text_string_to_metric_families(response.text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def request_logs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines) if line.startswith('{"event": "request"')]

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@contextmanager
def ready_server(
    args: list[str], home: Path, env: dict[str, str] | None = None, tls: bool = False
) -> Iterator[ServerProcess]:
    """A ready `dlm serve` for the block; it must exit cleanly (0) after SIGTERM."""
    proc = ServerProcess(args, home, env=env, tls=tls)
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.terminate() == 0, "\n".join(proc.lines)


@contextmanager
def app_client(settings: dict[str, Any]) -> Iterator[Any]:
    """The app of `settings` in process (Starlette's TestClient), once its model is ready."""
    from fastapi.testclient import TestClient

    from dlm.cli.server.app import create_app
    from dlm.cli.server.config import load_config

    with TestClient(create_app(load_config(None, settings, environ={}))) as client:
        end = time.monotonic() + 300
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < end, client.get("/health").json()
            time.sleep(0.1)
        yield client


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll `predicate` (bounded) until it is true."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def fixed_output_checkpoint(directory: Path, token_text: str = TOOL_CALL, id_offset: int = 0) -> Path:
    """A tiny LLaDA checkpoint that writes one known token at every masked position.

    The token's id is the first free one plus `id_offset`: checkpoints made with different
    offsets differ in their weights, not only in their tokenizers.

    The token is added to the shipped tokenizer with `token_text` as its content, and the
    chat template shows `tools` to the model (Hermes style), so the server's tool-call path
    runs end to end. The weights are built so the answer is certain: blocks add nothing to
    the residual stream, every embedding is the same unit vector, and only the known token's
    LM-head row points along it.
    """
    import torch

    from dlm.engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint

    assets = ROOT / "dlm" / "engine" / "assets" / "tiny_tokenizer"
    tokenizer = json.loads((assets / "tokenizer.json").read_text())
    first_free = max([*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]) + 1
    token_id = first_free + id_offset
    for i, text in enumerate([*(f"<|unused_{j}|>" for j in range(id_offset)), token_text]):
        tokenizer["added_tokens"].append(
            {  # ids must be contiguous: fillers before the known token
                "id": first_free + i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": text != token_text,
            }
        )
    config = llada_config(vocab_size=token_id + 1, mask_token_id=1, eos_token_id=0, max_sequence_length=2048)
    tensors = random_llada_tensors(config, seed=1)
    p = "model.transformer."
    for name in tensors:
        if name.endswith("attn_out.weight") or (".blocks." in name and name.endswith("ff_out.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    d = config["d_model"]
    tensors[p + "wte.weight"] = torch.zeros(token_id + 1, d)
    tensors[p + "wte.weight"][:, 0] = 1.0
    tensors[p + "ln_f.weight"] = torch.ones(d)
    tensors[p + "ff_out.weight"] = torch.zeros(token_id + 1, d)
    tensors[p + "ff_out.weight"][token_id, 0] = 10.0
    save_checkpoint(directory, config, tensors)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    tokenizer_config = json.loads((assets / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TOOLS_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A localhost certificate and key made with the openssl command."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


class _LoopTransport(httpx.BaseTransport):
    """A synchronous httpx transport into an ASGI app whose event loop runs on another thread
    (so sync clients, the OpenAI SDK's included, reach an in-process server)."""

    def __init__(self, app: Any, loop: Any) -> None:
        self.inner, self.loop = httpx.ASGITransport(app=app), loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        import asyncio

        async def send() -> tuple[int, httpx.Headers, bytes]:
            forwarded = httpx.Request(request.method, request.url, headers=request.headers, content=request.read())
            response = await self.inner.handle_async_request(forwarded)
            return response.status_code, response.headers, await response.aread()

        status, headers, content = asyncio.run_coroutine_threadsafe(send(), self.loop).result()
        return httpx.Response(status, headers=headers, content=content)


@contextmanager
def in_process_server(**settings: Any) -> Iterator[httpx.Client]:
    """The server's app (`ServeConfig(**settings)`) in this process, loaded and ready, no
    socket: an httpx client to it (base URL http://dlm). Loading failures fail the block."""
    import asyncio

    from dlm.cli.server.app import create_app
    from dlm.cli.server.config import ServeConfig

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    app = create_app(ServeConfig(**settings))
    lifespan = app.router.lifespan_context(app)

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    async def loaded() -> None:
        await app.state.loading

    run(lifespan.__aenter__())
    try:
        run(loaded())
        assert app.state.service.load_error is None, app.state.service.load_error
        with httpx.Client(transport=_LoopTransport(app, loop), base_url="http://dlm", timeout=300) as client:
            yield client
    finally:
        run(lifespan.__aexit__(None, None, None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def sse_events(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to `[DONE]`."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events
