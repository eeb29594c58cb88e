"""The dispatch: backend choice, the engine through Triton (interpreted) giving the same ids
as through the torch twins, and the LM-head statistics' memory bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm.engine.llm import LLM
from dlm.kernels import dispatch
from dlm.kernels.peak_memory import PeakTensorMemory
from dlm.kernels.token_stats import token_stats_torch, token_stats_unfused


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
    with pytest.raises(dispatch.KernelChoiceError, match="TRITON_INTERPRET"):
        dispatch.backend(cpu)
    monkeypatch.setenv("DLM_KERNELS", "cuda")
    with pytest.raises(dispatch.KernelChoiceError, match="DLM_KERNELS"):
        dispatch.backend(cpu)


def through_both(llm: LLM, prompts: list[list[int]], kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """Generate with the torch twins, then with the Triton kernels (interpreted): (twins'
    outputs, kernels' outputs, the kernels the second run dispatched)."""
    monkeypatch.setenv("DLM_KERNELS", "torch")
    twins = llm.generate(prompts, **kwargs)
    monkeypatch.setenv("DLM_KERNELS", "triton")
    calls: list[str] = []
    real = dispatch.implementation
    monkeypatch.setattr(dispatch, "implementation", lambda name, device: calls.append(name) or real(name, device))
    kernels = llm.generate(prompts, **kwargs)
    monkeypatch.setattr(dispatch, "implementation", real)
    return twins, kernels, set(calls)


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
    twins, kernels, calls = through_both(llm, prompts, kwargs, monkeypatch)
    assert {"token_stats", "rms_norm", "rotary", "attention"} <= calls
    assert [o.output_ids for o in kernels] == [o.output_ids for o in twins]
    assert [o.nfe for o in kernels] == [o.nfe for o in twins]


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("dream", dict(gen_length=8, block_length=4, steps=4)),  # entropy: token_stats' entropy
        ("dream", dict(gen_length=8, block_length=4, steps=4, alg="topk_margin", cache="prefix")),
        ("dream", dict(gen_length=8, block_length=4, alg="confidence_threshold", threshold=0.3, cache="dual")),
        ("llada", dict(gen_length=8, block_length=4, threshold=0.3, cache="dual")),
    ],
)
def test_bidirectional_caches_identical_through_triton_and_torch(
    tiny_dream: Path, tiny_llada: Path, monkeypatch: pytest.MonkeyPatch, family: str, kwargs: dict
) -> None:
    """Dream (shifted logits, MASK excluded by the token_stats kernel) and the Fast-dLLM
    prefix/dual caches (cached keys through the attention kernel's kv_lens): same ids with
    the Triton kernels (interpreted) as with the torch twins, ragged prompts batched."""
    llm = LLM(tiny_dream if family == "dream" else tiny_llada, dtype="float32", device="cpu")
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3]]
    twins, kernels, calls = through_both(llm, prompts, kwargs, monkeypatch)
    assert {"token_stats", "rms_norm", "rotary", "attention"} <= calls
    assert [o.output_ids for o in kernels] == [o.output_ids for o in twins]
    assert [o.query_lengths for o in kernels] == [o.query_lengths for o in twins]


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


@pytest.mark.parametrize(
    "family",
    ["llada2_moe", "sdar", "sdar_moe", pytest.param("pangu", marks=pytest.mark.slow)],  # pangu: ~40 s
)
def test_block_families_identical_through_triton_and_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """Every block-causal family: same ids with the Triton kernels (interpreted) as with
    the torch twins, on the serving path (exact block cache). openPangu decodes its fixed
    32-token blocks in sub-blocks, so it gets one short prompt to stay within the budget."""
    from dlm.engine.block_checkpoints import write_tiny

    llm = LLM(write_tiny(tmp_path / family, family), dtype="float32", device="cpu")
    prompts = [[5, 17, 42, 8, 9]] if family == "pangu" else [[5, 17, 42, 8, 9], [9, 8, 7]]
    kwargs = dict(gen_length=8, block_length=4, threshold=0.5, cache="block")
    twins, kernels, calls = through_both(llm, prompts, kwargs, monkeypatch)
    assert {"token_stats", "rms_norm", "rotary"} <= calls
    assert ("fused_moe" in calls) == family.endswith("_moe")  # the MoE layers go through the kernel
    assert [o.output_ids for o in kernels] == [o.output_ids for o in twins]


@pytest.mark.slow  # a minute in Triton's interpreter: the full suite, not the quick loop
def test_clover_identical_through_triton_and_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hybrid (Gated DeltaNet + gated attention) family under Clover's decoder."""
    from tests.hybrid_checkpoints import reference_model, save_reference

    directory = save_reference(
        reference_model(seed=5),
        tmp_path / "clover",
        model_type="clover_moe",
        architectures=["CloverMoeForCausalLM"],
        mask_token_id=159,
        eos_token_id=158,
    )
    llm = LLM(directory, dtype="float32", device="cpu")
    kwargs = dict(gen_length=32, block_length=32, threshold=0.5)
    monkeypatch.setenv("DLM_KERNELS", "torch")
    twins = llm.generate([5, 17, 42, 99, 3, 7, 11], **kwargs)
    monkeypatch.setenv("DLM_KERNELS", "triton")
    calls: list[str] = []
    real = dispatch.implementation
    monkeypatch.setattr(dispatch, "implementation", lambda name, device: calls.append(name) or real(name, device))
    kernels = llm.generate([5, 17, 42, 99, 3, 7, 11], **kwargs)
    assert {"token_stats", "rms_norm", "rotary", "fused_moe"} <= set(calls)
    assert [o.output_ids for o in kernels] == [o.output_ids for o in twins]
