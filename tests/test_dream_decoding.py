"""Dream's algorithms and the caches against the literal reference loops, where no vector exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm.engine.decoding.sampling import filter_logits
from dlm.engine.llm import LLM
from tests.oracles.reference_loop import reference_dream_generate, reference_generate

PROMPT = [5, 17, 42, 99, 3, 7, 11]


@pytest.fixture(scope="module")
def dream(tiny_dream: Path) -> LLM:
    return LLM(tiny_dream, dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gen_length=32, steps=16, block_length=8, alg="maskgit_plus"),
        dict(gen_length=32, steps=32, block_length=16, alg="topk_margin", cache="dual"),
        dict(gen_length=32, steps=16, block_length=16, alg="entropy", cache="prefix"),
        dict(gen_length=32, steps=32, block_length=8, alg="confidence_threshold", threshold=0.3),
        dict(gen_length=32, steps=8, block_length=16, alg="confidence_threshold", threshold=0.3),  # adds steps
        dict(gen_length=24, steps=12, block_length=24, alg="origin", seed=3),
    ],
    ids=["maskgit-blocks", "margin-dual", "entropy-prefix", "threshold-nocache", "threshold-carry", "origin-seeded"],
)
def test_dream_engine_matches_reference_loop(dream: LLM, kwargs: dict) -> None:
    seed = kwargs.get("seed")
    out = dream.generate(PROMPT, early_stop=False, **kwargs)[0]
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "seed"}
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    x, nfe = reference_dream_generate(
        dream.engine.loaded.model,
        torch.tensor([PROMPT]),
        mask_id=dream.config.mask_token_id,
        generator=generator,
        **ref_kwargs,
    )
    assert out.output_ids == x[0, len(PROMPT) :].tolist()
    assert out.nfe == nfe


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_llada_factor_rule_with_cache_matches_reference_loop(tiny_llada: Path, cache: str) -> None:
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    kwargs = dict(gen_length=32, steps=32, block_length=8, factor=1.0, cache=cache)
    out = llm.generate(PROMPT, early_stop=False, **kwargs)[0]
    x, nfe = reference_generate(
        llm.engine.loaded.model, torch.tensor([PROMPT]), mask_id=llm.config.mask_token_id, **kwargs
    )
    assert out.output_ids == x[0, len(PROMPT) :].tolist() and out.nfe == nfe


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(alg="entropy", alg_temp=0.5),
        dict(alg="maskgit_plus", temperature=0.8, top_p=0.9),
        dict(alg="topk_margin", temperature=1.0, top_k=5, cache="dual"),
    ],
)
def test_dream_sampling_is_seeded_and_completes(dream: LLM, kwargs: dict) -> None:
    run = lambda seed: dream.generate(PROMPT, gen_length=16, block_length=8, seed=seed, **kwargs)[0]  # noqa: E731
    a, b = run(5), run(5)
    assert a.output_ids == b.output_ids
    assert dream.config.mask_token_id not in a.output_ids


def test_filter_logits_keeps_nucleus_and_top_k() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    low = torch.finfo(logits.dtype).min
    kept = lambda out: (out[0] > low).tolist()  # noqa: E731
    assert kept(filter_logits(logits, 0.7, None)) == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert kept(filter_logits(logits, 0.4, None)) == [True, False, False, False]
    assert kept(filter_logits(logits, None, 3)) == [True, True, True, False]
    assert kept(filter_logits(logits, 1.0, None)) == [True] * 4


def test_mask_token_is_never_proposed() -> None:
    """Committing MASK would leave a position masked forever; the model's probabilities of the
    other tokens are unchanged."""
    from dlm.kernels.token_stats import token_stats_torch, token_stats_unfused

    hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(1))
    weight[7] = hidden.mean(0) * 50  # token 7 (MASK) dominates every row
    plain = token_stats_unfused(hidden, weight)
    assert (plain.token == 7).all()
    for stats in (
        token_stats_torch(hidden, weight, exclude_token=7, chunk_size=16),
        token_stats_unfused(hidden, weight, exclude_token=7),
    ):
        assert not (stats.token == 7).any()
        full = torch.softmax((hidden @ weight.T).double(), -1)
        assert torch.allclose(stats.prob, full.gather(1, stats.token[:, None])[:, 0], rtol=1e-5)
