"""The shared reference directory's checkpoints and vectors, as the reference tests read them.

Checkpoints load in float32 on the CPU: the vectors were made in float32 and are compared in
float32. A missing directory skips (or fails under CI) through `tests.conftest.reference_dir`.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load_file

from dlm.engine.llm import LLM, GenerationOutput
from tests.conftest import reference_dir


def reference_llm(model: str) -> LLM:
    """The reference checkpoint `models/MODEL`, loaded in float32 on the CPU."""
    ref = reference_dir()
    assert ref is not None
    return LLM(ref / "models" / model, dtype="float32", device="cpu")


def load_vector(name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Vector NAME: its JSON record and its tensors."""
    ref = reference_dir()
    assert ref is not None
    vectors = ref / "vectors"
    return json.loads((vectors / f"{name}.json").read_text()), load_file(str(vectors / f"{name}.safetensors"))


def cache_of(reference: str) -> str:
    """A LLaDA/Dream vector's cache variant, from the reference function's name."""
    return "prefix" if "prefix_cache" in reference else "dual" if "dual_cache" in reference else "none"


def decode_vector(llm: LLM, meta: dict[str, Any], **params: Any) -> GenerationOutput:
    """The engine's decoding of a LLaDA/Dream vector's prompt (temperature and cache variant as
    the vector says, no early stop); `params` are the family's decoding settings from the vector
    (and any extra field under test)."""
    return llm.generate(
        meta["prompt_ids"],
        gen_length=meta["gen_length"],
        steps=meta["steps"],
        temperature=meta["temperature"],
        cache=cache_of(meta["reference"]),
        early_stop=False,
        **params,
    )[0]


def assert_reproduces(llm: LLM, meta: dict[str, Any], **params: Any) -> None:
    """The engine decodes the vector to the reference's ids, with its forwards and the length
    fed to each."""
    out = decode_vector(llm, meta, **params)
    assert out.output_ids == meta["generated_ids"]
    assert out.nfe == meta["nfe"]
    assert out.query_lengths == meta["query_lengths_per_call"]


def first_logits_match(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the model's first-forward logits (every position, bidirectional) are within
    1e-4 of the reference's standard deviation."""
    from tests.oracles.reference_loop import full_logits

    x = tensors["first_forward_input_ids"].reshape(1, -1)
    ours = full_logits(model, x)
    ref = tensors["first_logits"].reshape(ours.shape)
    return (ours - ref).abs().max().item() <= 1e-4 * ref.std().item()
