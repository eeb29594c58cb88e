"""Commit rules, the schedule, the chunked LM-head statistics and CFG against the oracle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm.engine.decoding.commit import above_threshold, factor_rule, top_k
from dlm.engine.decoding.schedule import linear_schedule
from dlm.engine.decoding.step import require_progress
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.runtime.sequence import Sequence
from dlm.kernels.token_stats import token_stats_torch, token_stats_unfused
from tests.oracles.reference_loop import reference_generate


def test_linear_schedule() -> None:
    assert linear_schedule(32, 32) == [1] * 32
    assert linear_schedule(10, 4) == [3, 3, 2, 2]
    assert linear_schedule(3, 5) == [1, 1, 1, 0, 0]


def test_threshold_commits_at_least_one() -> None:
    conf = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert above_threshold(conf, 0.9).tolist() == [1]
    assert set(above_threshold(conf, 0.3).tolist()) == {1, 2}
    assert set(above_threshold(conf, 0.2).tolist()) == {0, 1, 2}


def test_top_k_takes_most_confident() -> None:
    conf = torch.tensor([0.2, 0.9, 0.5, 0.1], dtype=torch.float64)
    assert set(top_k(conf, 2).tolist()) == {1, 2}


def test_factor_rule() -> None:
    # Thresholds for ranks 2, 3, 4 with factor 1: 1 - 1/3, 1 - 1/4, 1 - 1/5.
    conf = torch.tensor([0.99, 0.70, 0.60, 0.10], dtype=torch.float64)
    assert set(factor_rule(conf, 1.0).tolist()) == {0, 1}
    assert factor_rule(torch.tensor([0.1], dtype=torch.float64), 1.0).tolist() == [0]
    # A walk stopping at the last rank accepts every position (the reference's bookkeeping).
    conf = torch.tensor([0.99, 0.90, 0.10], dtype=torch.float64)
    assert set(factor_rule(conf, 1.0).tolist()) == {0, 1, 2}


def test_steps_that_cannot_finish_a_block_fail_loudly() -> None:
    params = GenerationParams(gen_length=8, block_length=8, steps=4).validate(2, 512)
    seq = Sequence([1, 2], params, mask_id=99, eos_ids=())
    with pytest.raises(RuntimeError, match="MASK token 99 was committed at \\[3\\]"):
        seq.commit(torch.tensor([2, 3]), torch.tensor([5, 99]))
    nothing, masked = torch.zeros(0, dtype=torch.long), seq.masked_positions()
    with pytest.raises(RuntimeError, match="committed none of its 8 masked positions"):
        require_progress(seq, masked, nothing)  # LLaDA's rules promise a commit every step
    dream = Sequence([1, 2], params, mask_id=99, eos_ids=(), sampler="dream")
    require_progress(dream, masked, nothing)  # Dream's timesteps may commit nothing early on
    dream.step_in_block = params.steps_per_block - 1
    with pytest.raises(RuntimeError, match="dream rules"):
        require_progress(dream, masked, nothing)  # ...but not at the block's last step


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_token_stats_match_unfused(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 16, generator=g)
    weight = torch.randn(301, 16, generator=g) * 2
    a = token_stats_torch(hidden, weight, want_entropy=True, want_margin=True, chunk_size=chunk)
    b = token_stats_unfused(hidden, weight, want_entropy=True, want_margin=True)
    assert torch.equal(a.token, b.token)
    for x, y in ((a.prob, b.prob), (a.entropy, b.entropy), (a.margin, b.margin)):
        # fp32 logits of a 7-row chunk may differ from the full matmul in the last ulp.
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-9)


def test_sampling_is_seeded_and_follows_temperature() -> None:
    hidden = torch.randn(4000, 8, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    draw = lambda seed: (
        token_stats_torch(  # noqa: E731
            hidden, weight, temperature=1.0, generator=torch.Generator().manual_seed(seed), chunk_size=2
        ).token
    )
    assert torch.equal(draw(3), draw(3))
    logits = (hidden @ weight.T).double()
    expected = torch.softmax(logits, -1).mean(0)
    observed = torch.bincount(draw(4), minlength=3).double() / 4000
    assert torch.allclose(observed, expected, atol=0.03)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gen_length=32, steps=16, block_length=8),
        dict(gen_length=32, steps=32, block_length=16, cfg_scale=1.5),
        dict(gen_length=32, steps=8, block_length=32, threshold=0.3),
        dict(gen_length=32, steps=32, block_length=8, factor=1.0),
    ],
)
def test_engine_matches_reference_loop(tiny_llada: Path, kwargs: dict) -> None:
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    prompt = [5, 17, 42, 99, 3, 7, 11]
    out = llm.generate(prompt, **kwargs)[0]
    x, nfe = reference_generate(
        llm.engine.loaded.model, torch.tensor([prompt]), mask_id=llm.config.mask_token_id, **kwargs
    )
    assert out.output_ids == x[0, len(prompt) :].tolist()
    assert out.nfe == nfe


def test_batch_of_prompts_matches_one_by_one(tiny_llada: Path) -> None:
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [100]]
    together = llm.generate(prompts, gen_length=16, block_length=8, threshold=0.5)
    for prompt, out in zip(prompts, together):
        alone = llm.generate(prompt, gen_length=16, block_length=8, threshold=0.5)[0]
        assert out.output_ids == alone.output_ids and out.nfe == alone.nfe


def test_random_remasking_and_sampling_are_reproducible(tiny_llada: Path) -> None:
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    run = lambda: (
        llm.generate(
            [1, 2, 3],
            gen_length=16,
            block_length=8,
            remasking="random",  # noqa: E731
            temperature=0.7,
            seed=11,
        )[0].output_ids
    )
    assert run() == run()
