"""`n`: several samples of one prompt, decoded together; sample i is seeded seed + i and
equals a separate request with that seed (batched decoding is batch-invariant)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import MAX_N, SEED_LIMIT, GenerationParams
from tests.serving import ROOT

PROMPT = [5, 17, 42, 99, 7, 3]
SAMPLING = dict(gen_length=16, block_length=8, temperature=1.0, early_stop=False)


def test_n_samples_equal_separate_requests_with_their_seeds(reference_llada: LLM) -> None:
    outs = reference_llada.generate([PROMPT, PROMPT[:4]], n=3, seed=7, logprobs=1, **SAMPLING)
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    assert [o.prompt_ids for o in outs] == [PROMPT] * 3 + [PROMPT[:4]] * 3
    for o in outs:
        alone = reference_llada.generate(o.prompt_ids, seed=7 + o.index, logprobs=1, **SAMPLING)[0]
        assert o.output_ids == alone.output_ids
        assert o.logprobs == alone.logprobs
    assert len({tuple(o.output_ids) for o in outs[:3]}) == 3, "distinct seeds gave equal samples"


def test_greedy_n_gives_equal_samples(reference_llada: LLM) -> None:
    """Allowed, as vLLM allows it: deterministic decoding has one answer, n times."""
    outs = reference_llada.generate(PROMPT, n=2, gen_length=8)
    assert outs[0].output_ids == outs[1].output_ids


def test_n_is_bounded_and_seeds_stay_in_range() -> None:
    with pytest.raises(UsageError) as refused:
        GenerationParams(n=MAX_N + 1).validate(4, 4096)
    assert refused.value.field == "n"
    with pytest.raises(UsageError) as seeds:
        GenerationParams(n=2, seed=SEED_LIMIT - 1).validate(4, 4096)
    assert seeds.value.field == "seed"
    samples = GenerationParams(n=3, seed=10).samples()
    assert [(s.n, s.seed) for s in samples] == [(1, 10), (1, 11), (1, 12)]


@pytest.mark.slow  # starts the CLI
def test_cli_n_samples(reference_llada: LLM) -> None:
    expected = reference_llada.generate(PROMPT, n=2, seed=3, **SAMPLING)
    run = subprocess.run(
        [sys.executable, "-m", "dlm", "generate", str(reference_llada.model_dir), "--prompt-ids"]
        + [",".join(map(str, PROMPT)), "--gen-length", "16", "--block-length", "8", "--temperature", "1"]
        + ["--no-early-stop", "--n", "2", "--seed", "3", "--dtype", "float32", "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["output_ids"] == expected[0].output_ids
    assert [s["index"] for s in result["samples"]] == [0, 1]
    assert [s["output_ids"] for s in result["samples"]] == [o.output_ids for o in expected]
