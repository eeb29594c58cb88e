"""The engine reproduces the LLaDA and Fast-dLLM reference vectors, without and with caches."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from engine.llm import LLM, GenerationOutput
from tests.oracles.reference_loop import full_logits

VECTORS = [
    "llada_generate_gen64",
    "llada_generate_gen128",
    "fastdllm_llada_generate_gen64",
    "fastdllm_llada_generate_gen128",
    "fastdllm_llada_generate_thr0.9_gen64",
    "fastdllm_llada_generate_thr0.9_gen128",
    "fastdllm_llada_prefix_cache_gen64",
    "fastdllm_llada_prefix_cache_gen128",
    "fastdllm_llada_prefix_cache_thr0.9_gen64",
    "fastdllm_llada_prefix_cache_thr0.9_gen128",
    "fastdllm_llada_dual_cache_gen64",
    "fastdllm_llada_dual_cache_gen128",
    "fastdllm_llada_dual_cache_thr0.9_gen64",
    "fastdllm_llada_dual_cache_thr0.9_gen128",
]


def cache_of(reference: str) -> str:
    """The vector's cache variant, from the reference function's name."""
    return "prefix" if "prefix_cache" in reference else "dual" if "dual_cache" in reference else "none"


@pytest.fixture(scope="module")
def llm(request: pytest.FixtureRequest) -> LLM:
    from tests.conftest import reference_dir

    ref = reference_dir()
    return LLM(ref / "models" / "llada_tiny_v2", dtype="float32", device="cpu")


def _vector(llm: LLM, name: str) -> tuple[dict, dict]:
    ref = llm.model_dir.parent.parent / "vectors"
    return json.loads((ref / f"{name}.json").read_text()), load_file(str(ref / f"{name}.safetensors"))


def generate_vector(llm: LLM, name: str, **overrides: object) -> tuple[dict, GenerationOutput]:
    """Decode vector `name`'s prompt with its settings (and `overrides`): (its JSON, our output)."""
    meta, _ = _vector(llm, name)
    out = llm.generate(
        meta["prompt_ids"],
        gen_length=meta["gen_length"],
        steps=meta["steps"],
        block_length=meta["block_length"],
        remasking=meta["remasking"],
        temperature=meta["temperature"],
        threshold=meta["extra_kwargs"].get("threshold"),
        cache=cache_of(meta["reference"]),
        early_stop=False,
        **overrides,
    )[0]
    return meta, out


@pytest.mark.parametrize("name", VECTORS)
def test_generated_ids_and_forward_count(llm: LLM, name: str) -> None:
    meta, out = generate_vector(llm, name)
    assert out.output_ids == meta["generated_ids"]
    assert out.nfe == meta["nfe"]
    assert out.query_lengths == meta["query_lengths_per_call"]


@pytest.mark.parametrize("name", ["llada_generate_gen64", "fastdllm_llada_generate_gen128"])
def test_first_forward_logits(llm: LLM, name: str) -> None:
    meta, tensors = _vector(llm, name)
    x = tensors["first_forward_input_ids"].reshape(1, -1)
    ours = full_logits(llm.engine.loaded.model, x)
    ref = tensors["first_logits"].reshape(ours.shape)
    tolerance = 1e-4 * ref.std().item()
    assert (ours - ref).abs().max().item() <= tolerance
