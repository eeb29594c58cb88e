"""The engine reproduces the LLaDA and Fast-dLLM reference vectors, without and with caches."""

from __future__ import annotations

from typing import Any

import pytest

from dlm.engine.llm import LLM, GenerationOutput
from tests.reference_vectors import assert_reproduces, decode_vector, first_logits_match, load_vector, reference_llm

# LLaDA's own loop, then Fast-dLLM's in every cache mode, without and with the parallel-decoding
# threshold; each at both generation lengths.
VECTORS = [f"llada_generate_gen{n}" for n in (64, 128)] + [
    f"fastdllm_llada_{cache}{thr}_gen{n}"
    for cache in ("generate", "prefix_cache", "dual_cache")
    for thr in ("", "_thr0.9")
    for n in (64, 128)
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return reference_llm("llada_tiny_v2")


def llada_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """A LLaDA / Fast-dLLM vector's decoding settings beside the shared ones."""
    threshold = meta["extra_kwargs"].get("threshold")
    return {"block_length": meta["block_length"], "remasking": meta["remasking"], "threshold": threshold}


def generate_vector(llm: LLM, name: str, **overrides: object) -> tuple[dict[str, Any], GenerationOutput]:
    """Decode vector `name`'s prompt with its settings (and `overrides`): (its JSON, our output)."""
    meta, _ = load_vector(name)
    return meta, decode_vector(llm, meta, **llada_settings(meta), **overrides)


@pytest.mark.parametrize("name", VECTORS)
def test_generated_ids_and_forward_count(llm: LLM, name: str) -> None:
    meta, _ = load_vector(name)
    assert_reproduces(llm, meta, **llada_settings(meta))


@pytest.mark.parametrize("name", ["llada_generate_gen64", "fastdllm_llada_generate_gen128"])
def test_first_forward_logits(llm: LLM, name: str) -> None:
    _, tensors = load_vector(name)
    assert first_logits_match(llm.engine.loaded.model, tensors)
