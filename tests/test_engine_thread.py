"""One thread does all of a served model's torch work (dlm/engine/runtime/async_engine.py):
the server loads the model, warms it up and runs every step on its engine thread, with the
intra-op threads the CPU plan chose set on that thread. Checked by recording which thread
runs each of them (deterministic: no time is measured)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dlm.engine import cpu_plan
from dlm.engine.llm import LLM
from dlm.engine.runtime.async_engine import ENGINE_THREAD, AsyncEngine
from dlm.engine.runtime.engine import LLMEngine
from tests.serving import in_process_server


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, list[tuple[str, int]]]]:
    """(thread name, torch threads) of every model load, warm-up and step; the CPU plan's
    timed forwards are mocked to choose a team of 2 (of a mocked 3-core default)."""
    calls: dict[str, list[tuple[str, int]]] = {"load": [], "warmup": [], "step": []}

    def record(kind: str, method: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(self, *args, **kwargs)  # the load sets the threads: record after it
            calls[kind].append((threading.current_thread().name, torch.get_num_threads()))
            return result

        return wrapper

    seconds = {"float32/1t": 1.0, "float32/2t": 0.5, "bfloat16/1t": 2.0, "bfloat16/2t": 2.0}
    monkeypatch.setenv("DLM_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_plan, "default_threads", lambda: 3)
    monkeypatch.setattr(cpu_plan, "_forward_seconds", lambda timer, c: seconds[c.name])
    monkeypatch.setattr(LLM, "__init__", record("load", LLM.__init__))
    monkeypatch.setattr(AsyncEngine, "warmup", record("warmup", AsyncEngine.warmup))
    monkeypatch.setattr(LLMEngine, "step", record("step", LLMEngine.step))
    threads = torch.get_num_threads()
    yield calls
    torch.set_num_threads(threads)


def test_serve_loads_warms_up_and_steps_on_the_engine_thread(recorded: dict) -> None:
    with in_process_server(model="tiny:llada", dtype="auto", device="cpu", warmup=True) as client:
        for _ in range(2):
            response = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8})
            assert response.status_code == 200, response.text
        health = client.get("/health").json()
    assert health["dtype"]["threads"] == 2
    every = recorded["load"] + recorded["warmup"] + recorded["step"]
    assert recorded["load"] and recorded["warmup"] and len(recorded["step"]) >= 2
    assert {name for name, _ in every} == {ENGINE_THREAD}  # one thread: one OpenMP team
    assert {threads for _, threads in every} == {2}  # the plan's threads, set on that thread
