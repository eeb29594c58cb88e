"""The dispatch: backend choice, the engine through Triton (interpreted) giving the same ids
as through the torch twins, and the LM-head statistics' memory bound."""
from __future__ import annotations

import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined

import pytest
import torch

from engine.llm import LLM
from kernels import dispatch
from kernels.peak_memory import PeakTensorMemory
from kernels.token_stats import token_stats_torch, token_stats_unfused


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("DLM_KERNELS", raising=False)
    assert dispatch.backend(cpu) == "torch"
    assert dispatch.backend(cuda) == "triton"
    monkeypatch.setenv("DLM_KERNELS", "torch")
    assert dispatch.backend(cuda) == "torch"
    monkeypatch.setenv("DLM_KERNELS", "triton")
    assert dispatch.backend(cpu) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.backend(cpu)
    monkeypatch.setenv("DLM_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DLM_KERNELS"):
        dispatch.backend(cpu)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gen_length=8, block_length=8, threshold=0.3),
        dict(gen_length=8, block_length=4, steps=4, temperature=0.8, seed=3),
    ],
)
def test_engine_ids_identical_through_triton_and_torch(
    tiny_llada: Path, monkeypatch: pytest.MonkeyPatch, kwargs: dict
) -> None:
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3]]  # ragged: padding and kv_lens
    monkeypatch.setenv("DLM_KERNELS", "torch")
    twins = llm.generate(prompts, **kwargs)
    monkeypatch.setenv("DLM_KERNELS", "triton")
    calls: list[str] = []
    real = dispatch.implementation
    monkeypatch.setattr(dispatch, "implementation", lambda name, device: calls.append(name) or real(name, device))
    kernels = llm.generate(prompts, **kwargs)
    assert {"token_stats", "rms_norm", "rotary", "attention"} <= set(calls)
    assert [o.output_ids for o in kernels] == [o.output_ids for o in twins]
    assert [o.nfe for o in kernels] == [o.nfe for o in twins]


def test_chunked_lm_head_stats_use_an_eighth_of_the_unfused_peak() -> None:
    # The acceptance shape (32 positions, vocab 157184) with a small hidden size: the
    # weight exists before the call, so the hidden size does not change either peak.
    hidden = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(157184, 64, generator=torch.Generator().manual_seed(1))
    peaks = []
    for fn in (token_stats_torch, token_stats_unfused):
        with PeakTensorMemory() as memory:
            fn(hidden, weight, want_entropy=True, want_margin=True)
        peaks.append(memory.peak)
    chunked, unfused = peaks
    assert unfused >= 32 * 157184 * 8  # sanity: the float64 logits alone
    assert chunked * 8 <= unfused, (chunked, unfused)


def test_peak_memory_counts_new_storages_until_released() -> None:
    with PeakTensorMemory() as memory:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 8000 live
        del a
        _view = b[3:]  # no new storage
        c = torch.ones(250)  # 4000 + 1000 live
    assert memory.peak == 8000 and memory.current == 5000
    del b, c, _view


@pytest.mark.parametrize("family", ["llada2_moe", "sdar", "sdar_moe", "pangu"])
def test_block_families_identical_through_triton_and_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """Every block-causal family: same ids with the Triton kernels (interpreted) as with
    the torch twins, exact cache and recompute alike."""
    from engine.block_checkpoints import write_tiny

    llm = LLM(write_tiny(tmp_path / family, family), dtype="float32", device="cpu")
    prompts = [[5, 17, 42, 8, 9], [9, 8, 7]]
    for cache in ("block", "none"):
        kwargs = dict(gen_length=8, block_length=4, threshold=0.5, cache=cache)
        monkeypatch.setenv("DLM_KERNELS", "torch")
        twins = llm.generate(prompts, **kwargs)
        monkeypatch.setenv("DLM_KERNELS", "triton")
        calls: list[str] = []
        real = dispatch.implementation
        monkeypatch.setattr(dispatch, "implementation", lambda name, device: calls.append(name) or real(name, device))
        kernels = llm.generate(prompts, **kwargs)
        monkeypatch.setattr(dispatch, "implementation", real)
        assert {"token_stats", "rms_norm", "rotary"} <= set(calls)
        assert [o.output_ids for o in kernels] == [o.output_ids for o in twins]
