"""The kernel self-test (Triton interpreted on CPU) and the serve-time fallback: a kernel
forced to fail (wrong output, or a compile error) is switched to its torch twin by the
dispatch, the engine's ids then equal the twins', and `/health` names the fallback."""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined

import pytest
import torch

from dlm.kernels import dispatch, selftest

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with every kernel on Triton (fallbacks are per process)."""
    monkeypatch.setattr(dispatch, "_fallen_back", {})


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break two Triton kernels: rms_norm answers 1% off, attention fails to compile."""
    real = dispatch._triton

    def rms_norm_off(*args, **kwargs):
        out, summed = real("rms_norm")(*args, **kwargs)
        return out * 1.01, summed

    def attention_fails(*args, **kwargs):
        raise RuntimeError("PTX assembly failed\nmore compiler output")

    fakes = {"rms_norm": rms_norm_off, "attention": attention_fails}
    monkeypatch.setattr(dispatch, "_triton", lambda name: fakes.get(name) or real(name))


def test_every_kernel_passes_its_self_test_interpreted() -> None:
    results = selftest.run(CPU, torch.float32)
    assert [r.name for r in results] == dispatch.triton_kernels()
    assert all(r.status == "ok" for r in results), results


def test_without_the_interpreter_cpu_kernels_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert {r.status for r in selftest.run(CPU, torch.float32)} == {"skipped"}
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert {r.status for r in selftest.run(CPU, torch.float32)} == {"absent"}


def test_guard_falls_back_for_failing_kernels(
    broken: None, monkeypatch: pytest.MonkeyPatch, tiny_llada: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dlm.engine.llm import LLM

    monkeypatch.setenv("DLM_KERNELS", "triton")
    with caplog.at_level("WARNING", logger="dlm.kernels"):
        results = {r.name: r for r in selftest.guard(CPU, torch.float32)}
    assert results["rms_norm"].status == "mismatch"
    assert results["attention"].status == "error" and "PTX assembly failed" in results["attention"].detail
    assert all(results[name].status == "ok" for name in ("token_stats", "rotary", "fused_moe"))
    assert set(dispatch.fallbacks()) == {"rms_norm", "attention"}
    assert "kernel rms_norm failed its self-test" in caplog.text
    assert dispatch.implementation("rms_norm", CPU) is dispatch.torch_twin("rms_norm")
    assert dispatch.implementation("attention", CPU) is dispatch.torch_twin("attention")
    assert dispatch.implementation("rotary", CPU) is dispatch.triton_kernel("rotary")

    # The engine through the remaining Triton kernels gives the twins' ids: the broken ones are not used.
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    params = dict(gen_length=8, block_length=8, threshold=0.3)
    through_triton = llm.generate([[5, 17, 42]], **params)[0].output_ids
    monkeypatch.setenv("DLM_KERNELS", "torch")
    assert through_triton == llm.generate([[5, 17, 42]], **params)[0].output_ids


def test_guard_does_nothing_where_the_twins_run(broken: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLM_KERNELS", raising=False)  # auto: the twins on CPU
    assert selftest.guard(CPU, torch.float32) == []
    assert dispatch.fallbacks() == {}


def test_serve_health_reports_dtype_and_kernel_fallback(
    broken: None, monkeypatch: pytest.MonkeyPatch, tiny_llada: Path
) -> None:
    from fastapi.testclient import TestClient

    from dlm.cli.server.app import create_app
    from dlm.cli.server.config import ServeConfig

    monkeypatch.setenv("DLM_KERNELS", "triton")
    app = create_app(ServeConfig(model=str(tiny_llada), dtype="float32", warmup=False))
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while (body := client.get("/health").json()).get("status") == "loading" and time.monotonic() < deadline:
            time.sleep(0.1)
    assert body["status"] == "ok", body
    assert body["dtype"]["dtype"] == "float32" and body["dtype"]["reason"] == "requested"
    kernels = body["kernels"]
    assert kernels["backend"] == "triton"
    assert kernels["self_test"]["rms_norm"] == "mismatch" and kernels["self_test"]["rotary"] == "ok"
    assert set(kernels["fallbacks"]) == {"rms_norm", "attention"}
    assert "self-test mismatch" in kernels["fallbacks"]["rms_norm"]
