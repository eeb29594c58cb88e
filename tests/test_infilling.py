"""Infilling (`suffix`): the answer is decoded between the prompt and a fixed suffix.

The oracle is the literal reference loop (tests/oracles/reference_loop.py) run over the whole
canvas [prompt, MASK x n, suffix] with the suffix never decided; the engine must commit the
same middle, on the tiny reference LLaDA and Dream checkpoints (float32). The same request
without the suffix decodes a different middle here, so the suffix is really attended to.
Block-causal families refuse it naming `suffix`; the CLI and the HTTP server give the same
middle as the engine.
"""

from __future__ import annotations

import pytest
import torch

from dlm.engine.errors import Unsupported, UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.registry import family_named
from tests.generate_cli import generate_json
from tests.oracles.reference_loop import reference_dream_generate, reference_generate

PROMPT = [5, 17, 42, 99, 7, 3]
SUFFIX = [11, 250, 31, 64]


LLADA_SETTINGS = [
    dict(gen_length=16, steps=16, block_length=8),
    dict(gen_length=16, steps=8, block_length=16, threshold=0.3),
]


@pytest.mark.parametrize("setting", LLADA_SETTINGS, ids=["schedule", "threshold"])
def test_llada_middle_equals_the_reference_loop_over_the_full_canvas(reference_llada: LLM, setting: dict) -> None:
    out = reference_llada.generate(PROMPT, suffix=SUFFIX, early_stop=False, **setting)[0]
    model = reference_llada.engine.loaded.model
    x, nfe = reference_generate(
        model,
        torch.tensor([PROMPT]),
        mask_id=reference_llada.config.mask_token_id,
        suffix=torch.tensor([SUFFIX]),
        **setting,
    )
    p, n = len(PROMPT), setting["gen_length"]
    assert out.output_ids == x[0, p : p + n].tolist()
    assert x[0, p + n :].tolist() == SUFFIX
    assert out.nfe == nfe
    plain = reference_llada.generate(PROMPT, early_stop=False, **setting)[0]
    assert plain.output_ids != out.output_ids, "the suffix changed nothing: the test could not fail"


@pytest.mark.parametrize("alg", ["entropy", "maskgit_plus"])
def test_dream_middle_equals_the_reference_loop_over_the_full_canvas(reference_dream: LLM, alg: str) -> None:
    setting = dict(gen_length=16, steps=16, block_length=16)
    out = reference_dream.generate(PROMPT, suffix=SUFFIX, alg=alg, early_stop=False, **setting)[0]
    x, nfe = reference_dream_generate(
        reference_dream.engine.loaded.model,
        torch.tensor([PROMPT]),
        mask_id=reference_dream.config.mask_token_id,
        alg=alg,
        suffix=torch.tensor([SUFFIX]),
        **setting,
    )
    p = len(PROMPT)
    assert out.output_ids == x[0, p : p + 16].tolist()
    assert out.nfe == nfe
    plain = reference_dream.generate(PROMPT, alg=alg, early_stop=False, **setting)[0]
    assert plain.output_ids != out.output_ids, "the suffix changed nothing: the test could not fail"


def test_suffix_survives_an_early_stop(reference_llada: LLM) -> None:
    """EOS early stop fills the rest of the answer with EOS, never the suffix."""
    params = GenerationParams(gen_length=16, block_length=8, suffix=tuple(SUFFIX))
    seq = reference_llada.engine.make_sequence(PROMPT, params)
    eos = 7
    seq.eos_ids = (eos,)
    start, end = seq.block_bounds()
    seq.commit(torch.arange(start, end), torch.full((end - start,), eos))
    assert seq.finish_reason == "stop"
    assert seq.canvas[seq.answer_end :].tolist() == SUFFIX
    assert seq.output_ids == [eos] * 16


def test_block_causal_families_refuse_a_suffix_naming_it() -> None:
    for name in ("sdar", "llada2_moe", "pangu", "clover"):
        with pytest.raises(Unsupported) as refused:
            GenerationParams(gen_length=32, suffix=(1, 2)).validate(4, 4096, family_named(name))
        assert refused.value.field == "suffix"
    GenerationParams(gen_length=32, suffix=(1, 2)).validate(4, 4096, family_named("dream"))


def test_the_suffix_counts_in_the_length_and_the_vocabulary(reference_llada: LLM) -> None:
    limit = reference_llada.config.max_position_embeddings
    with pytest.raises(UsageError) as refused:
        reference_llada.engine.validate(GenerationParams(gen_length=8, suffix=(1,) * limit), 4)
    assert refused.value.field == "prompt" and "suffix" in str(refused.value)
    with pytest.raises(UsageError) as bad:
        reference_llada.engine.make_sequence(PROMPT, GenerationParams(gen_length=8, suffix=(10**9,)))
    assert bad.value.field == "suffix"


def test_cli_suffix_ids_give_the_engine_middle(reference_llada: LLM) -> None:
    out = reference_llada.generate(PROMPT, suffix=SUFFIX, gen_length=16, steps=16, block_length=8, early_stop=False)[0]
    suffix = ",".join(map(str, SUFFIX))
    flags = ("--gen-length", "16", "--steps", "16", "--block-length", "8", "--no-early-stop")
    payload = generate_json(reference_llada.model_dir, PROMPT, "--suffix-ids", suffix, *flags)
    assert payload["output_ids"] == out.output_ids
