"""A temperature near 0 is the greedy limit, a huge one the uniform limit: never a failed step.

Any positive `temperature` (and Dream's `alg_temp`, DiffusionGemma's `min_temperature` and
`max_temperature`) is a valid value, however small or large: 1e-40 is a float32 0, 5e-324 the
least double, 1e39 a float32 inf. Samplers divided the logits by it as sent, which overflowed
(the largest past the dtype's range, then inf - inf in the softmax), divided by zero, or divided
an excluded token's -inf by inf: NaN probabilities failed the step, a 500 for the request and
for every other request decoded in the same forward, and LLaDA's Gumbel-max took the first
positive logit for the largest. `validate()` now resolves a positive temperature into
[`MIN_TEMPERATURE`, `MAX_TEMPERATURE`], the one range every sampler sees.
"""

from __future__ import annotations

import pytest

from dlm.engine.llm import LLM
from dlm.engine.params import MAX_TEMPERATURE, MIN_TEMPERATURE, TEMPERATURES, GenerationParams
from dlm.engine.registry import FAMILIES
from tests.serving import in_process_server
from tests.tiny_families import tiny_names

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = (1e-40, 5e-324)
HUGE = (1e39, 1e300)


def test_an_extreme_temperature_resolves_into_the_range() -> None:
    dream = next(f for f in FAMILIES if f.name == "dream")
    p = GenerationParams(gen_length=8, temperature=5e-324, alg_temp=1e-40).validate(4, 64, dream)
    assert (p.temperature, p.alg_temp) == (MIN_TEMPERATURE, MIN_TEMPERATURE)
    huge = GenerationParams(gen_length=8, temperature=1e300, alg_temp=1e39).validate(4, 64, dream)
    assert (huge.temperature, huge.alg_temp) == (MAX_TEMPERATURE, MAX_TEMPERATURE)
    ordinary = GenerationParams(gen_length=8, temperature=0.7, alg_temp=0.1).validate(4, 64, dream)
    assert (ordinary.temperature, ordinary.alg_temp) == (0.7, 0.1)  # untouched
    assert GenerationParams(gen_length=8).validate(4, 64, dream).temperature == 0.0  # greedy stays greedy
    assert set(TEMPERATURES) <= {f for f in GenerationParams.__dataclass_fields__}


def _runs(name: str, llm: LLM) -> list[dict[str, object]]:
    """Every sampled path of the family at a tiny temperature: its own sampler, and (with
    `ignore_eos`) the restricted distribution every family shares; Dream's `alg_temp`;
    the entropy-bound sampler's temperatures (it takes no `temperature`)."""
    if llm.engine.family.sampler == "entropy_bound":
        extremes = [dict(min_temperature=t, max_temperature=2 * t) for t in (1e-40, 1e-300, *HUGE)]
        return extremes + [{**e, "ignore_eos": True} for e in extremes]
    runs: list[dict[str, object]] = [dict(temperature=t) for t in (*TINY, *HUGE)]
    runs += [dict(temperature=t, ignore_eos=True) for t in (*TINY, *HUGE)]
    if llm.engine.family.sampler == "dream":
        runs += [dict(alg="maskgit_plus", alg_temp=t, steps=4) for t in (*TINY, *HUGE)]
        runs += [dict(temperature=t, top_p=0.5) for t in HUGE]
    return runs


@pytest.mark.parametrize("name", tiny_names())
def test_an_extreme_temperature_decodes_on_every_family(name: str) -> None:
    with LLM(f"tiny:{name}", dtype="float32", device="cpu") as llm:
        greedy = llm.generate("Sort: 4 3 9", gen_length=8)[0]
        for kwargs in _runs(name, llm):
            out = llm.generate("Sort: 4 3 9", gen_length=8, **kwargs)[0]  # type: ignore[arg-type]
            assert out.finish_reason in ("stop", "length"), kwargs
            if llm.engine.family.sampler == "llada" and "ignore_eos" not in kwargs and kwargs["temperature"] in TINY:
                # Gumbel-max at the greedy limit: the argmax, with the model's own confidences.
                assert out.output_ids == greedy.output_ids, kwargs


def test_an_extreme_temperature_is_answered_over_http() -> None:
    """Dream samples through its filtered distribution: the request is answered, not a 500."""
    with in_process_server(model="tiny:dream", warmup=False) as client:
        for body in (
            {"temperature": 1e-40},
            {"temperature": 5e-324, "n": 2},
            {"alg_temp": 5e-324},
            {"temperature": 1e39},
        ):
            r = client.post("/v1/completions", json={"prompt": "Sort: 4 3 9", "max_tokens": 8, **body})
            assert r.status_code == 200, r.text


def test_diffusion_gemma_in_float16_takes_a_low_temperature() -> None:
    """DiffusionGemma's tempered logits condition its next step in the model's dtype: in
    float16 (a GPU without bf16 loads a float16 checkpoint so) logits of 30 at a temperature of
    1e-4 passed its range of 65504, and the next step's softmax of inf failed the request."""
    import torch

    with LLM("tiny:diffusion_gemma", dtype="float16", device="cpu") as llm:
        for low in (1e-4, 1e-20):
            out = llm.generate("Sort: 4 3 9", gen_length=8, min_temperature=low, max_temperature=2 * low)[0]
            assert out.finish_reason == "length"
    from dlm.engine.decoding.entropy_bound import conditioning

    logits = torch.tensor([[[3e5, 2.9e5, -4e5, 10.0]]])
    held = conditioning(logits, torch.float16)
    assert held.dtype == torch.float16 and not held.isnan().any()
    assert torch.equal(held.float().softmax(-1), logits.softmax(-1))  # the distribution the model takes
    assert torch.equal(conditioning(logits, torch.float32), logits)  # as the reference: unchanged
