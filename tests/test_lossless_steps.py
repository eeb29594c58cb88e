"""Lossless multi-token steps (`drafts`, dlm/engine/decoding/drafts.py): the ids are those of the
plain rule on every LLaDA / Fast-dLLM reference vector (float32), in fewer forwards."""

from __future__ import annotations

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.registry import family_named
from tests.reference_vectors import reference_llm
from tests.test_reference_llada import VECTORS, generate_vector

WIDTH = 2  # candidates per forward: enough to show fewer forwards, cheap enough for the quick loop


@pytest.fixture(scope="module")
def llm() -> LLM:
    return reference_llm("llada_tiny_v2")


# One vector per rule family in the quick loop (schedule, threshold + prefix cache, dual cache); all in the full suite.
QUICK = ("llada_generate_gen64", "fastdllm_llada_prefix_cache_thr0.9_gen64", "fastdllm_llada_dual_cache_gen64")


@pytest.mark.parametrize("name", [v if v in QUICK else pytest.param(v, marks=pytest.mark.slow) for v in VECTORS])
def test_drafted_steps_give_the_reference_ids_in_fewer_forwards(llm: LLM, name: str) -> None:
    meta, out = generate_vector(llm, name, drafts=WIDTH)
    assert out.output_ids == meta["generated_ids"]
    assert out.nfe < meta["nfe"]  # the plain rule's forwards (test_reference_llada checks dlm spends exactly those)


def test_drafts_in_a_batch_keep_every_request_its_own_ids(llm: LLM) -> None:
    """Candidate rows of one request beside another request's rows change no one's ids."""
    prompts = [[5, 9, 13, 200, 7], [42, 8, 99, 1000, 3, 17, 21]]
    kwargs = dict(gen_length=32, steps=32, block_length=16, early_stop=False)
    plain = [llm.generate(p, **kwargs)[0].output_ids for p in prompts]
    together = llm.generate(prompts, drafts=3, **kwargs)
    assert [o.output_ids for o in together] == plain


@pytest.mark.parametrize(
    ("family", "fields"),
    [
        ("llada", {"temperature": 0.5}),
        ("llada", {"remasking": "random"}),
        ("llada", {"cfg_scale": 1.0, "cache": "none"}),
        ("dream", {}),
        ("sdar", {}),
    ],
)
def test_drafts_outside_the_deterministic_llada_rules_are_refused_naming_the_field(family: str, fields: dict) -> None:
    with pytest.raises(UsageError) as err:
        GenerationParams(gen_length=32, drafts=2, **fields).validate(8, 4096, family_named(family))
    assert err.value.field == "drafts"


def test_draft_rows_count_against_the_forward_token_budget(llm: LLM) -> None:
    """The scheduler's per-forward token bound counts every candidate row a request feeds."""
    from dlm.engine.runtime.scheduler import forward_tokens

    seq = llm.engine.add_request([5, 9, 13], GenerationParams(gen_length=32, drafts=3))
    assert forward_tokens(seq) == 4 * len(seq.canvas)
    llm.engine.abort(seq)  # leave the shared engine idle for the next test


def test_drafted_steps_report_the_plain_rules_logprobs(llm: LLM) -> None:
    """A verified candidate row is the plain rule's canvas, so each token's committing-step
    logprob (and its alternatives) is the plain run's too."""
    _, plain = generate_vector(llm, "llada_generate_gen64", logprobs=3)
    _, drafted = generate_vector(llm, "llada_generate_gen64", logprobs=3, drafts=WIDTH)
    assert drafted.output_ids == plain.output_ids and drafted.nfe < plain.nfe
    assert plain.logprobs is not None and drafted.logprobs is not None
    for ours, theirs in zip(drafted.logprobs, plain.logprobs, strict=True):
        assert ours.token == theirs.token and abs(ours.logprob - theirs.logprob) <= 1e-5
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
