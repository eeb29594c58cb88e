"""logprobs: each generated token's log-probability at the denoising step that committed it.

The oracle is the literal reference loop (tests/oracles/reference_loop.py), which records the
float64 log-softmax of the logits row of every committing step; the engine's values must
equal it (float32 model, compared within 5e-4: the engine and the oracle run the same
arithmetic at different shapes, so different fp32 matmul kernels, whose rounding differs between
CPUs and grows through the layers and Fast-dLLM's dual cache; an AVX-512/AMX machine measured
1.7e-4 there, 1.7e-5 without a cache, and 2.4e-6 with both models cast to float64), with the
step's top alternatives sorted, never the MASK token, and the committed token's value where it appears among them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from dlm.engine.decoding.logprobs import TokenLogprob
from dlm.engine.llm import LLM
from tests.oracles.reference_loop import reference_dream_generate, reference_generate
from tests.serving import ROOT

PROMPT = [5, 17, 42, 99, 7, 3]
SUFFIX = [11, 250, 31, 64]
TOP = 3


def check_shape(tokens: list[TokenLogprob], top: int, mask_id: int) -> None:
    """Sorted alternatives, probabilities at most 1, the committed token's value consistent."""
    for t in tokens:
        assert math.exp(t.logprob) <= 1 + 1e-6
        assert len(t.top) == top
        values = [v for _, v in t.top]
        assert values == sorted(values, reverse=True)
        assert all(math.exp(v) <= 1 + 1e-6 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
        assert mask_id not in [i for i, _ in t.top]
        for token, value in t.top:
            if token == t.token:
                assert value == pytest.approx(t.logprob, abs=1e-6)


FP32 = dict(abs=5e-4)  # fp32 rounding of two kernels, grown through the layers (module docstring)


def compare_with_oracle(tokens: list[TokenLogprob], record: dict[int, torch.Tensor], start: int, mask_id: int) -> None:
    assert tokens, "no tokens to compare"
    for i, t in enumerate(tokens):
        row = record[start + i]
        assert t.logprob == pytest.approx(float(row[t.token]), **FP32), i
        row = row.clone()
        row[mask_id] = -math.inf
        expected = row.topk(len(t.top))
        assert [tok for tok, _ in t.top] == expected.indices.tolist(), i
        assert [v for _, v in t.top] == pytest.approx(expected.values.tolist(), **FP32), i


@pytest.mark.parametrize(
    "setting",
    [dict(gen_length=16, steps=16, block_length=8), dict(gen_length=16, steps=8, block_length=16, threshold=0.3)],
    ids=["schedule", "threshold"],
)
def test_llada_logprobs_are_the_committing_steps(reference_llada: LLM, setting: dict) -> None:
    out = reference_llada.generate(PROMPT, logprobs=TOP, early_stop=False, **setting)[0]
    record: dict[int, torch.Tensor] = {}
    reference_generate(
        reference_llada.engine.loaded.model,
        torch.tensor([PROMPT]),
        mask_id=reference_llada.config.mask_token_id,
        record=record,
        **setting,
    )
    assert out.logprobs is not None and len(out.logprobs) == len(out.completion_ids)
    assert [t.token for t in out.logprobs] == out.completion_ids
    compare_with_oracle(out.logprobs, record, len(PROMPT), reference_llada.config.mask_token_id)
    check_shape(out.logprobs, TOP, reference_llada.config.mask_token_id)
    for t in out.logprobs:  # greedy: the committed token is the step's most likely (MASK aside)
        assert t.top[0][0] == t.token


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_dream_logprobs_with_a_suffix_are_the_committing_steps(reference_dream: LLM, cache: str) -> None:
    """Dream reads position p from row p-1; with a cache the block's first token is committed
    by the refresh forward."""
    setting = dict(gen_length=16, steps=16, block_length=8)
    out = reference_dream.generate(
        PROMPT, suffix=SUFFIX, alg="entropy", cache=cache, logprobs=TOP, early_stop=False, **setting
    )
    record: dict[int, torch.Tensor] = {}
    reference_dream_generate(
        reference_dream.engine.loaded.model,
        torch.tensor([PROMPT]),
        mask_id=reference_dream.config.mask_token_id,
        alg="entropy",
        cache=cache,
        suffix=torch.tensor([SUFFIX]),
        record=record,
        **setting,
    )
    tokens = out[0].logprobs
    assert tokens is not None
    compare_with_oracle(tokens, record, len(PROMPT), reference_dream.config.mask_token_id)
    check_shape(tokens, TOP, reference_dream.config.mask_token_id)


def test_sampled_logprobs_keep_their_shape(reference_llada: LLM) -> None:
    outs = reference_llada.generate(PROMPT, logprobs=5, gen_length=16, temperature=1.0, seed=4, n=2, early_stop=False)
    for out in outs:
        assert out.logprobs is not None
        check_shape(out.logprobs, 5, reference_llada.config.mask_token_id)
    zero = reference_llada.generate(PROMPT, logprobs=0, gen_length=8)[0].logprobs
    assert zero is not None and all(t.top == () for t in zero)
    assert reference_llada.generate(PROMPT, gen_length=8)[0].logprobs is None


def test_logprobs_are_bounded() -> None:
    from dlm.engine.errors import UsageError
    from dlm.engine.params import MAX_TOP_LOGPROBS, GenerationParams

    with pytest.raises(UsageError) as refused:
        GenerationParams(logprobs=MAX_TOP_LOGPROBS + 1).validate(4, 4096)
    assert refused.value.field == "logprobs"


@pytest.mark.slow  # starts the CLI
def test_cli_logprobs_json(reference_llada: LLM) -> None:
    expected = reference_llada.generate(PROMPT, logprobs=2, gen_length=8, block_length=8)[0].logprobs
    assert expected is not None
    run = subprocess.run(
        [sys.executable, "-m", "dlm", "generate", str(reference_llada.model_dir), "--prompt-ids"]
        + [",".join(map(str, PROMPT)), "--gen-length", "8", "--block-length", "8", "--logprobs", "2"]
        + ["--dtype", "float32", "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)["logprobs"]
    assert [g["token"] for g in got] == [t.token for t in expected]
    assert [g["logprob"] for g in got] == pytest.approx([t.logprob for t in expected], abs=1e-6)
    assert [[tuple(p) for p in g["top"]] for g in got] == [list(t.top) for t in expected]
