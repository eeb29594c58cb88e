"""`--dtype auto` per device, with the CPU's capability and the matmul probe mocked in both
directions; the checkpoint's dtype on CUDA; devices and DLM_KERNELS checked before loading."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from dlm.engine import dtype as dtypes
from dlm.engine.device import resolve_device
from dlm.engine.errors import UsageError

CPU = torch.device("cpu")


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Mock the CPU: `flags` it advertises and the probe's seconds per dtype (counted)."""
    state: dict = {"flags": frozenset(), "seconds": {torch.float32: 1.0, torch.bfloat16: 1.0}, "probes": 0}

    def seconds(a: torch.Tensor, b: torch.Tensor) -> float:
        state["probes"] += 1
        return state["seconds"][a.dtype]

    monkeypatch.setattr(dtypes, "cpu_flags", lambda: state["flags"])
    monkeypatch.setattr(dtypes, "_matmul_seconds", seconds)
    dtypes.bf16_speedup.cache_clear()
    yield state
    dtypes.bf16_speedup.cache_clear()


def test_cpu_without_native_bf16_runs_fp32_without_probing(cpu: dict, caplog: pytest.LogCaptureFixture) -> None:
    cpu["flags"] = frozenset({"avx2", "fma"})
    with caplog.at_level(logging.INFO, logger="dlm.engine"):
        choice = dtypes.choose_dtype("auto", CPU)
    assert choice.dtype == torch.float32 and choice.bf16_speedup is None
    assert cpu["probes"] == 0
    assert "float32" in caplog.text and "no native bf16" in caplog.text


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16", "bf16"])
def test_cpu_with_native_bf16_confirmed_by_the_probe_runs_bf16(
    cpu: dict, flag: str, caplog: pytest.LogCaptureFixture
) -> None:
    cpu["flags"] = frozenset({"avx2", flag})
    cpu["seconds"] = {torch.float32: 1.0, torch.bfloat16: 0.25}
    with caplog.at_level(logging.INFO, logger="dlm.engine"):
        choice = dtypes.choose_dtype("auto", CPU)
    assert choice.dtype == torch.bfloat16
    assert choice.bf16_speedup == pytest.approx(4.0)
    assert "bfloat16" in caplog.text and "4.0x" in caplog.text  # the log carries the measured ratio


def test_cpu_flag_without_speed_runs_fp32(cpu: dict) -> None:
    """The flag alone is not trusted: a probe showing bf16 slow (emulated) keeps fp32."""
    cpu["flags"] = frozenset({"avx512_bf16"})
    cpu["seconds"] = {torch.float32: 1.0, torch.bfloat16: 80.0}
    choice = dtypes.choose_dtype("auto", CPU)
    assert choice.dtype == torch.float32
    assert choice.bf16_speedup == pytest.approx(1 / 80)


def test_probe_runs_once_per_process(cpu: dict) -> None:
    cpu["flags"] = frozenset({"amx_bf16"})
    cpu["seconds"] = {torch.float32: 1.0, torch.bfloat16: 0.5}
    dtypes.choose_dtype("auto", CPU)
    probes = cpu["probes"]
    assert probes == 2 * dtypes.PROBE_REPEATS
    for _ in range(3):
        dtypes.choose_dtype("auto", CPU)
    assert cpu["probes"] == probes  # cached


def test_explicit_dtype_is_kept_and_unknown_is_usage_error(cpu: dict) -> None:
    assert dtypes.choose_dtype("bf16", CPU).dtype == torch.bfloat16
    assert dtypes.choose_dtype("float32", CPU).reason == "requested"
    assert cpu["probes"] == 0
    with pytest.raises(UsageError, match="unknown dtype 'int3'"):
        dtypes.choose_dtype("int3", CPU)


@pytest.mark.parametrize(
    "checkpoint, bf16_supported, expected",
    [
        ("bfloat16", True, torch.bfloat16),
        ("bfloat16", False, torch.float16),
        ("float16", True, torch.float16),
        ("float32", True, torch.bfloat16),
        ("float32", False, torch.float16),
        (None, True, torch.bfloat16),
        ("torch.bfloat16", True, torch.bfloat16),
    ],
)
def test_cuda_keeps_the_checkpoint_dtype_where_supported(
    monkeypatch: pytest.MonkeyPatch, checkpoint: str | None, bf16_supported: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_supported)
    assert dtypes.choose_dtype("auto", torch.device("cuda", 0), checkpoint).dtype == expected


def test_checkpoint_dtype_reads_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert dtypes.checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text('{"text_config": {"dtype": "float16"}}')
    assert dtypes.checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text('{"torch_dtype": 3}')
    assert dtypes.checkpoint_dtype(tmp_path) is None


def test_llm_loads_in_the_chosen_dtype(cpu: dict, tiny_llada: Path) -> None:
    from dlm.engine.llm import LLM

    llm = LLM(tiny_llada, dtype="auto", device="cpu")
    assert llm.dtype == torch.float32 and llm.dtype_choice.requested == "auto"
    assert next(llm.engine.loaded.model.parameters()).dtype == torch.float32
    cpu["flags"] = frozenset({"avx512_bf16"})
    cpu["seconds"] = {torch.float32: 1.0, torch.bfloat16: 0.3}
    llm = LLM(tiny_llada, dtype="auto", device="cpu")
    assert next(llm.engine.loaded.model.parameters()).dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_usage_error() -> None:
    for device in ("cuda", "cuda:1"):
        with pytest.raises(UsageError, match="no CUDA device"):
            resolve_device(device)


def test_bad_kernel_choice_is_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLM_KERNELS", "bogus")
    with pytest.raises(UsageError, match="DLM_KERNELS must be"):
        resolve_device("cpu")
    monkeypatch.setenv("DLM_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UsageError, match="TRITON_INTERPRET=1"):
        resolve_device("cpu")
