"""Batched decoding: a request's output never depends on what else is in its batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from tests.tp_checkpoints import PARAMS, write_family

PROMPTS = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [100], [33, 44, 55, 66, 77, 88]]


@pytest.fixture(scope="module")
def models(tiny_llada: Path, tiny_dream: Path) -> dict[str, LLM]:
    return {
        name: LLM(path, dtype="float32", device="cpu") for name, path in (("llada", tiny_llada), ("dream", tiny_dream))
    }


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(cache="none"),
        dict(cache="dual"),
        dict(cache="prefix"),
        dict(cache="dual", threshold=0.3),
    ],
    ids=["none", "dual", "prefix", "dual-threshold"],
)
def test_batch_of_four_equals_each_prompt_alone(models: dict[str, LLM], family: str, kwargs: dict) -> None:
    llm = models[family]
    params = dict(gen_length=24, steps=12, block_length=8, **kwargs)
    together = llm.generate(PROMPTS, **params)
    for prompt, out in zip(PROMPTS, together):
        alone = llm.generate(prompt, **params)[0]
        assert out.output_ids == alone.output_ids
        assert (out.nfe, out.query_lengths) == (alone.nfe, alone.query_lengths)


def test_finished_sequences_leave_the_batch(models: dict[str, LLM]) -> None:
    """Requests of different lengths share steps; each leaves `running` once done, and the
    forwards it took part in are only its own steps."""
    engine = models["dream"].engine
    short = engine.add_request(PROMPTS[0], GenerationParams(gen_length=8, steps=4, block_length=8, cache="dual"))
    long = engine.add_request(PROMPTS[1], GenerationParams(gen_length=32, steps=16, block_length=8, cache="dual"))
    steps, left_at = 0, None
    while engine.running:
        engine.step()
        steps += 1
        if left_at is None and short not in engine.running:
            left_at = steps
            assert short.finished and long in engine.running
    assert (left_at, short.nfe, long.nfe, steps) == (4, 4, 16, 16)
    assert short.query_lengths == [len(PROMPTS[0]) + 8, 8, 8, 8]


def test_cache_bytes_follow_the_running_requests(models: dict[str, LLM]) -> None:
    """The engine's K/V byte count (the server's dlm_kv_cache_bytes gauge) is exactly the
    caches the running requests hold: a dual cache keeps every layer's K and V for the whole
    canvas, and a finished request's cache is released."""
    engine = models["dream"].engine
    c = engine.config
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4  # fp32 K and V, every layer
    params = GenerationParams(gen_length=8, steps=4, block_length=8, cache="dual")
    short = engine.add_request(PROMPTS[0], params)
    long = engine.add_request(PROMPTS[1], GenerationParams(gen_length=32, steps=16, block_length=8, cache="dual"))
    assert engine.cache_bytes() == 0  # nothing cached before the first (refresh) forward
    engine.step()
    assert engine.cache_bytes() == per_token * (len(PROMPTS[0]) + 8 + len(PROMPTS[1]) + 32)
    while short in engine.running:
        engine.step()
    assert engine.cache_bytes() == per_token * (len(PROMPTS[1]) + 32)
    while engine.running:
        engine.step()
    assert engine.cache_bytes() == 0 and long.finished


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_batched_statistics_are_bitwise_those_of_a_solo_forward(
    models: dict[str, LLM], family: str, cache: str
) -> None:
    """Stronger than equal ids: at every step, each sequence's confidences from the batched
    forward are bit-identical to those of a forward holding it alone."""
    import copy

    engine = models[family].engine
    seqs = [
        engine.add_request(p, GenerationParams(gen_length=16, steps=8, block_length=8, cache=cache)) for p in PROMPTS
    ]
    while engine.running:
        active = list(engine.running)
        solo = [engine.runner.forward([copy.deepcopy(s)])[0] for s in active]
        batched = engine.runner.forward([copy.deepcopy(s) for s in active])
        for (pos_a, a), (pos_b, b) in zip(solo, batched):
            assert torch.equal(pos_a, pos_b) and torch.equal(a.token, b.token) and torch.equal(a.prob, b.prob)
        engine.step()
    assert all(s.finished for s in seqs)


@pytest.mark.parametrize("family", list(PARAMS))
def test_bf16_batch_of_four_equals_each_prompt_alone(tmp_path: Path, family: str) -> None:
    """The CPU serving dtype too: bf16 rounding is coarse enough that a padded row's
    attention or a GEMM over a different row count would change tokens, so attention runs
    per row over its real keys and every forward has at least MIN_ROWS rows per sequence."""
    llm = LLM(write_family(tmp_path, family), dtype="bfloat16", device="cpu")
    together = llm.generate(PROMPTS, **PARAMS[family])
    for prompt, out in zip(PROMPTS, together):
        assert out.output_ids == llm.generate(prompt, **PARAMS[family])[0].output_ids, prompt


def test_bf16_diffusion_gemma_canvases_equal_each_prompt_alone() -> None:
    """DiffusionGemma's canvases attend to prompt caches of different lengths: each row over
    its own keys, never padded to a longer neighbour's (which rounds differently in bf16 and,
    through the sampler, changes every later draw)."""
    llm = LLM("tiny:diffusion_gemma", dtype="bfloat16", device="cpu")
    together = llm.generate(PROMPTS, gen_length=16)
    for prompt, out in zip(PROMPTS, together):
        assert out.output_ids == llm.generate(prompt, gen_length=16)[0].output_ids, prompt
