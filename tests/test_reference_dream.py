"""The engine reproduces Dream's diffusion_generate and Fast-dLLM's Dream block-sampler vectors."""

from __future__ import annotations

import pytest

from dlm.engine.llm import LLM
from tests.reference_vectors import assert_reproduces, first_logits_match, load_vector, reference_llm

VECTORS = [
    "dream_generate_entropy_gen64",
    "dream_generate_maskgit_plus_gen64",
    "dream_generate_topk_margin_gen64",
    "fastdllm_dream_prefix_cache_entropy_gen64",
    "fastdllm_dream_prefix_cache_thr0.9_gen64",
    "fastdllm_dream_dual_cache_entropy_gen64",
    "fastdllm_dream_dual_cache_thr0.9_gen64",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return reference_llm("dream_tiny_v2")


@pytest.mark.parametrize("name", VECTORS)
def test_generated_ids_and_forward_count(llm: LLM, name: str) -> None:
    meta, _ = load_vector(name)
    kw = meta["kwargs"]
    assert_reproduces(
        llm,
        meta,
        # diffusion_generate decodes the whole generation as one block.
        block_length=kw.get("block_length", meta["gen_length"]),
        alg=kw["alg"],
        threshold=kw.get("threshold"),
    )


def test_first_forward_logits(llm: LLM) -> None:
    """Raw (unshifted) logits of the first forward, every position."""
    _, tensors = load_vector("dream_generate_entropy_gen64")
    assert first_logits_match(llm.engine.loaded.model, tensors)
