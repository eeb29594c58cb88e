"""Servers for the side-by-side benchmarks: `dlm serve` and the peer `dlmserve` (PyPI), each a
real process on 127.0.0.1 at its default settings, with its RSS and a pause switch (SIGSTOP)
so the idle one takes no CPU while the other is measured.

The peer runs in its own virtual environment (it needs transformers<5), created on first use
under `~/.cache/dlm-peers/` (outside the repository) with pip from the package index. It loads
checkpoints as transformers remote code, so `peer_checkpoint` lays out a copy of a dlm
checkpoint (links to its weights and tokenizer) with LLaDA modeling code
(benchmarks/peer_llada/) and an `auto_map`; benchmarks/peer_llada/dlmserve_main.py starts it
with the checkpoint's mask token. docs/benchmarks.md lists these workarounds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PEER_CODE = ROOT / "benchmarks" / "peer_llada"
PEERS_HOME = Path(os.environ.get("DLM_PEERS_HOME", Path.home() / ".cache" / "dlm-peers"))
DLMSERVE = "dlmserve==0.1.1"
PEER_TORCH = "torch==2.13.0"  # the same torch build as dlm's
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process: pause/resume, RSS, JSON posts."""

    proc: subprocess.Popen[str]
    url: str
    lines: list[str]

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def _start_reader(self) -> None:
        self.lines = []
        threading.Thread(target=self._read, daemon=True).start()

    def wait_ready(self, timeout: float = 600) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{type(self).__name__} exited:\n" + "\n".join(self.lines[-30:]))
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{type(self).__name__} never became ready:\n" + "\n".join(self.lines[-30:]))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(self.url + path, json=body, timeout=3600)
        response.raise_for_status()
        return dict(response.json())

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def rss_mib(self) -> dict[str, float]:
        """Resident memory now (smaps_rollup Rss, its anonymous and file-backed parts) and
        the peak (VmHWM), MiB."""
        rollup = Path(f"/proc/{self.proc.pid}/smaps_rollup").read_text()
        fields = {k.strip(): int(v.split()[0]) for k, _, v in (line.partition(":") for line in rollup.splitlines()[1:])}
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        peak = int(re.search(r"VmHWM:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
        mib = 1024.0
        return {
            "rss": fields["Rss"] / mib,
            "anonymous": fields["Anonymous"] / mib,
            "file": (fields["Rss"] - fields["Anonymous"]) / mib,
            "peak": peak / mib,
        }

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DlmServer(Server):
    """`dlm serve MODEL` at its defaults (the environment as given: no thread setting)."""

    def __init__(self, model: str | Path | None, *args: str) -> None:
        argv = [sys.executable, "-m", "dlm", "serve", *([str(model)] if model else []), *args, "--port", "0"]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._start_reader()
        end = time.monotonic() + 600
        port = None
        while port is None and time.monotonic() < end:
            port = next((int(m.group(1)) for line in list(self.lines) if (m := LISTENING.search(line))), None)
            if self.proc.poll() is not None:
                raise RuntimeError("dlm serve exited:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        self.wait_ready()
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.post("/v1/chat/completions", {"model": self.model, **body})

    def answer(self, messages: list[dict[str, str]], gen_length: int) -> str:
        body = {"messages": messages, "max_tokens": gen_length, "steps": gen_length, "block_length": gen_length}
        return str(self.chat({**body, "temperature": 0})["choices"][0]["message"]["content"])

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/health").json())

    def step_seconds(self) -> tuple[float, float]:
        """(sum, count) of the dlm_step_duration_seconds histogram."""
        text = httpx.get(self.url + "/metrics").text

        def value(name: str) -> float:
            return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]

        return value("dlm_step_duration_seconds_sum"), value("dlm_step_duration_seconds_count")


def peer_python() -> Path:
    """The peer's virtual environment, made on first use (pip, from the package index)."""
    venv = PEERS_HOME / "dlmserve"
    python = venv / "bin" / "python"
    if not (venv / ".ready").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, PEER_TORCH], check=True)
        subprocess.run([*pip, "transformers<5", DLMSERVE], check=True)
        (venv / ".ready").write_text(DLMSERVE + "\n")
    return python


def peer_checkpoint(model_dir: Path) -> Path:
    """A directory the peer can load: links to the checkpoint's weights and tokenizer, its
    config.json plus an `auto_map` to the LLaDA remote code copied beside it."""
    out = PEERS_HOME / "checkpoints" / model_dir.resolve().name
    out.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.suffix == ".safetensors" or item.name.startswith("tokenizer") or item.name == "special_tokens_map.json":
            link = out / item.name
            link.unlink(missing_ok=True)
            link.symlink_to(item.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("modeling_llada.py", "configuration_llada.py"):
        shutil.copy(PEER_CODE / name, out / name)
    return out


class DlmserveServer(Server):
    """dlmserve on a LLaDA-family checkpoint at its defaults, except the dtype (`dtype`, env
    DLMSERVE_DTYPE): its default int4 quantises the weights (NF4), so its answers are not the
    checkpoint's; bf16 is the only unquantised dtype it has."""

    def __init__(self, model_dir: Path, mask_token: str, mask_id: int, dtype: str = "bf16") -> None:
        self.model = str(peer_checkpoint(model_dir))
        port = free_port()
        env = {**os.environ, "DLMSERVE_MODEL": self.model, "DLMSERVE_DTYPE": dtype, "DLMSERVE_DEVICE": "cpu"}
        env.pop("OMP_NUM_THREADS", None)  # its default: torch's thread count
        argv = [str(peer_python()), str(PEER_CODE / "dlmserve_main.py"), "--mask-token", mask_token]
        argv += ["--mask-id", str(mask_id), "--port", str(port)]
        if dtype == "float32":  # not one of dlmserve's: its bf16 load, in fp32
            env["DLMSERVE_DTYPE"] = "bf16"
            argv.append("--float32")
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._start_reader()
        self.url = f"http://127.0.0.1:{port}"
        self.wait_ready()

    def answer(self, messages: list[dict[str, str]], gen_length: int) -> str:
        body = {"model": self.model, "messages": messages, "max_tokens": gen_length}
        body |= {"num_denoising_steps": gen_length, "block_length": gen_length, "temperature": 0.0, "seed": 0}
        return str(self.post("/v1/chat/completions", body)["choices"][0]["message"]["content"])
