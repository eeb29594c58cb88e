"""`--dtype auto` per device and per model, with the CPU's capability and the timed forwards
mocked (no wall clock is asserted): the decision, its margin, the cache per machine and shape,
the intra-op threads; the checkpoint's dtype on CUDA; devices and DLM_KERNELS checked before
loading."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dlm.engine import cpu_plan
from dlm.engine import dtype as dtypes
from dlm.engine.cpu_plan import ModelShape
from dlm.engine.device import resolve_device
from dlm.engine.errors import UsageError
from dlm.kernels import dispatch

CPU = torch.device("cpu")


SMALL = ModelShape(hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=512, vocab=619)
LARGE = ModelShape(hidden=1024, heads=16, kv_heads=16, head_dim=64, ffn=2816, vocab=619)


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict]:
    """Mock the CPU: `flags` it advertises, its default thread count, and each candidate's
    seconds per timed forward (`seconds[shape][candidate name]`), with the calls counted; a
    DLM_HOME of its own (`home`) holds the measurements' cache."""
    state: dict = {"flags": frozenset(), "threads": 1, "seconds": {}, "calls": [], "home": tmp_path}
    monkeypatch.setenv("DLM_HOME", str(tmp_path))

    def seconds(timer: object, candidate: cpu_plan.Candidate) -> float:
        shape = getattr(timer, "shape", None)
        state["calls"].append((shape, candidate.name))
        return state["seconds"][shape][candidate.name]

    def layer_timer(shape: ModelShape) -> object:
        return SimpleNamespace(shape=shape)

    threads = torch.get_num_threads()
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: state["flags"])
    monkeypatch.setattr(cpu_plan, "_forward_seconds", seconds)
    monkeypatch.setattr(cpu_plan, "layer_timer", layer_timer)
    monkeypatch.setattr(cpu_plan, "default_threads", lambda: state["threads"])
    yield state
    torch.set_num_threads(threads)


def times(fp32: float, bf16: float, fp32_team: float = 9.0, bf16_team: float = 9.0, team: int = 1) -> dict:
    """Seconds per candidate: one thread, and (with `team` > 1) a team of that many."""
    table = {"float32/1t": fp32, "bfloat16/1t": bf16}
    if team > 1:
        table |= {f"float32/{team}t": fp32_team, f"bfloat16/{team}t": bf16_team}
    return table


def test_cpu_without_native_bf16_runs_fp32_without_timing_bf16(cpu: dict, caplog: pytest.LogCaptureFixture) -> None:
    cpu["flags"] = frozenset({"avx2", "fma"})
    with caplog.at_level(logging.INFO, logger="dlm.engine"):
        choice = dtypes.choose_dtype("auto", CPU, shape=SMALL)
    assert choice.dtype == torch.float32 and choice.bf16_speedup is None and choice.threads == 1
    assert cpu["calls"] == []  # one thread, one dtype: nothing to measure
    assert "float32" in caplog.text and "no native bf16" in caplog.text


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16", "bf16"])
def test_native_bf16_faster_at_the_models_shape_runs_bf16(
    cpu: dict, flag: str, caplog: pytest.LogCaptureFixture
) -> None:
    cpu["flags"] = frozenset({"avx2", flag})
    cpu["seconds"][LARGE] = times(fp32=1.0, bf16=0.25)
    with caplog.at_level(logging.INFO, logger="dlm.engine"):
        choice = dtypes.choose_dtype("auto", CPU, shape=LARGE)
    assert choice.dtype == torch.bfloat16
    assert choice.bf16_speedup == pytest.approx(4.0)
    assert "bfloat16" in caplog.text and "4.00x" in caplog.text  # the log carries the measured ratio


def test_the_same_cpu_decides_per_model(cpu: dict) -> None:
    """The default model's shape loses in bf16 (casts, elementwise work) while a 1024-wide
    layer wins: one CPU, two answers."""
    cpu["flags"] = frozenset({"amx_bf16"})
    cpu["seconds"][SMALL] = times(fp32=1.0, bf16=1.4)
    cpu["seconds"][LARGE] = times(fp32=1.0, bf16=0.3)
    assert dtypes.choose_dtype("auto", CPU, shape=SMALL).dtype == torch.float32
    assert dtypes.choose_dtype("auto", CPU, shape=LARGE).dtype == torch.bfloat16


def test_bf16_within_the_margin_keeps_fp32(cpu: dict) -> None:
    """A flag alone is not trusted, nor a win inside the margin: fp32 is exact and as fast."""
    cpu["flags"] = frozenset({"avx512_bf16"})
    cpu["seconds"][SMALL] = times(fp32=1.0, bf16=1.0 / (cpu_plan.BF16_MIN_SPEEDUP - 0.01))
    choice = dtypes.choose_dtype("auto", CPU, shape=SMALL)
    assert choice.dtype == torch.float32 and choice.bf16_speedup < cpu_plan.BF16_MIN_SPEEDUP
    cpu["seconds"][LARGE] = times(fp32=1.0, bf16=80.0)  # emulated bf16
    assert dtypes.choose_dtype("auto", CPU, shape=LARGE).dtype == torch.float32


def test_the_measurement_is_cached_per_machine_and_shape(cpu: dict) -> None:
    cpu["flags"] = frozenset({"amx_bf16"})
    cpu["seconds"][SMALL] = times(fp32=1.0, bf16=0.5)
    cpu["seconds"][LARGE] = times(fp32=1.0, bf16=0.5)
    first = dtypes.choose_dtype("auto", CPU, shape=SMALL)
    calls = len(cpu["calls"])
    assert calls == 2 * (1 + cpu_plan.PROBE_ROUNDS)  # a first call each, then the rounds
    assert "measured" in first.reason
    cached = json.loads((cpu["home"] / cpu_plan.CACHE_FILE).read_text())
    # The key also says how each candidate dtype's linear weights are held (a plan measured
    # with plain bf16 weights does not describe packed ones).
    layouts = "+".join(dispatch.linear_layout(d, CPU) for d in (torch.float32, torch.bfloat16))
    assert [key.split("/")[1:] for key in cached] == [[SMALL.key, "layer", layouts]]
    again = dtypes.choose_dtype("auto", CPU, shape=SMALL)
    assert len(cpu["calls"]) == calls and again.dtype == first.dtype and "cached" in again.reason
    dtypes.choose_dtype("auto", CPU, shape=LARGE)  # another shape is measured
    assert len(cpu["calls"]) == 2 * calls
    machine = cpu_plan.machine_key()
    assert all(key.startswith(machine) for key in json.loads((cpu["home"] / cpu_plan.CACHE_FILE).read_text()))


def test_a_team_is_chosen_only_when_it_pays(cpu: dict) -> None:
    """Threads are planned too: a team never takes every core (one stays for the server's
    event loop) and replaces one thread only when faster by THREADS_MIN_SPEEDUP."""
    cpu["flags"] = frozenset({"amx_bf16"})
    cpu["threads"] = 4
    cpu["seconds"][LARGE] = times(fp32=1.0, bf16=0.5, fp32_team=0.6, bf16_team=0.25, team=3)
    choice = dtypes.choose_dtype("auto", CPU, shape=LARGE)
    assert (choice.dtype, choice.threads) == (torch.bfloat16, 3)
    assert {name for _, name in cpu["calls"]} == {"float32/1t", "bfloat16/1t", "float32/3t", "bfloat16/3t"}
    cpu["seconds"][SMALL] = times(fp32=1.0, bf16=2.0, fp32_team=0.95, bf16_team=2.0, team=3)
    assert dtypes.choose_dtype("auto", CPU, shape=SMALL).threads == 1
    cpu["threads"] = 2  # two cores: one for the forwards, one for the rest
    assert cpu_plan.candidates_for([torch.float32]) == [cpu_plan.Candidate(torch.float32, 1)]


def test_explicit_dtype_is_kept_and_unknown_is_usage_error(cpu: dict) -> None:
    cpu["flags"] = frozenset({"amx_bf16"})
    assert dtypes.choose_dtype("bf16", CPU).dtype == torch.bfloat16
    assert dtypes.choose_dtype("float32", CPU, shape=SMALL).reason == "requested"
    assert cpu["calls"] == []
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


def test_llm_times_its_own_forward_keeps_that_engine_and_sets_the_threads(
    cpu: dict, tiny_llada: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM times the loaded model in each candidate (`_ModelProbe`), keeps the engine of the
    winner (no second load) and runs its forwards on this thread with the planned threads."""
    from dlm.engine import llm as llm_module
    from dlm.engine.llm import LLM

    loads: list[torch.dtype] = []
    real_load = llm_module.load_engine

    def counted_load(model_dir: Path, dtype: torch.dtype, *args: object) -> object:
        loads.append(dtype)
        return real_load(model_dir, dtype, *args)

    monkeypatch.setattr(llm_module, "load_engine", counted_load)
    probed: list[str] = []

    def model_seconds(timer: object, candidate: cpu_plan.Candidate) -> float:
        assert isinstance(timer, llm_module._ModelProbe)  # the model itself, not a layer
        probed.append(candidate.name)
        timer(candidate)  # loads that dtype's engine once
        return {"float32/1t": 1.0, "bfloat16/1t": 0.9, "float32/2t": 2.0, "bfloat16/2t": 0.4}[candidate.name]

    monkeypatch.setattr(cpu_plan, "_forward_seconds", model_seconds)
    cpu["flags"], cpu["threads"] = frozenset({"avx512_bf16"}), 3
    llm = LLM(tiny_llada, dtype="auto", device="cpu")
    assert llm.dtype == torch.bfloat16 and llm.dtype_choice.threads == 2
    assert next(llm.engine.loaded.model.parameters()).dtype == torch.bfloat16
    assert sorted(loads, key=str) == [torch.bfloat16, torch.float32]  # each dtype loaded once
    assert torch.get_num_threads() == 2
    probed.clear()
    again = LLM(tiny_llada, dtype="auto", device="cpu")  # cached: one load, in the chosen dtype
    assert probed == [] and loads[-1] == torch.bfloat16 and len(loads) == 3
    assert again.dtype_choice.threads == 2


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
