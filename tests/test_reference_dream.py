"""The engine reproduces Dream's diffusion_generate and Fast-dLLM's Dream block-sampler vectors."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from engine.llm import LLM
from tests.oracles.reference_loop import full_logits
from tests.test_reference_llada import cache_of

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
    from tests.conftest import reference_dir

    ref = reference_dir()
    return LLM(ref / "models" / "dream_tiny_v2", dtype="float32", device="cpu")


def _vector(llm: LLM, name: str) -> tuple[dict, dict]:
    ref = llm.model_dir.parent.parent / "vectors"
    return json.loads((ref / f"{name}.json").read_text()), load_file(str(ref / f"{name}.safetensors"))


@pytest.mark.parametrize("name", VECTORS)
def test_generated_ids_and_forward_count(llm: LLM, name: str) -> None:
    meta, _ = _vector(llm, name)
    kw = meta["kwargs"]
    out = llm.generate(
        meta["prompt_ids"],
        gen_length=meta["gen_length"],
        steps=meta["steps"],
        # diffusion_generate decodes the whole generation as one block.
        block_length=kw.get("block_length", meta["gen_length"]),
        temperature=meta["temperature"],
        alg=kw["alg"],
        threshold=kw.get("threshold"),
        cache=cache_of(meta["reference"]),
        early_stop=False,
    )[0]
    assert out.output_ids == meta["generated_ids"]
    assert out.nfe == meta["nfe"]
    assert out.query_lengths == meta["query_lengths_per_call"]


def test_first_forward_logits(llm: LLM) -> None:
    """Raw (unshifted) logits of the first forward, every position."""
    _, tensors = _vector(llm, "dream_generate_entropy_gen64")
    x = tensors["first_forward_input_ids"].reshape(1, -1)
    ours = full_logits(llm.engine.loaded.model, x)
    ref = tensors["first_logits"].reshape(ours.shape)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.std().item()
