"""Sizes a request may ask for are bounded where parameters are validated, on every family:
`steps` and `refinement_steps` at `MAX_STEPS`, `block_length` at the model's maximum length.
Unbounded, steps 2**31 built a 17 GB schedule (MemoryError, a traceback from `dlm generate`),
DiffusionGemma's int32 step fraction overflowed, and a block-causal canvas of block_length
2**31 (it runs to a block boundary) failed the allocator."""

from __future__ import annotations

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import MAX_STEPS, GenerationParams
from dlm.engine.registry import family_named
from tests.tiny_families import tiny_names

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=tiny_names())
def llm(request: pytest.FixtureRequest) -> LLM:
    return LLM(f"tiny:{request.param}", dtype="float32", device="cpu")


@pytest.mark.parametrize("field", ["steps", "refinement_steps", "block_length"])
def test_a_size_past_its_bound_is_refused_naming_the_field(llm: LLM, field: str) -> None:
    with pytest.raises(UsageError) as caught:
        llm.generate("Sort: 4 3 9", gen_length=8, **{field: 2**31})
    assert caught.value.field == field, caught.value
    if field != "block_length":
        assert f"in [1, {MAX_STEPS}]" in str(caught.value)
    elif not family_named(llm.engine.config.family).fixed_block:  # Clover refuses every other block
        assert "exceeds the model's maximum length" in str(caught.value)


def test_the_bounds_themselves_are_taken(llm: LLM) -> None:
    """MAX_STEPS and a block of the whole context pass validation (not run: Dream and the
    canvas family spend every step they are given; a whole-context block is a long decode)."""
    config = llm.engine.config
    family = family_named(config.family)
    context = config.max_position_embeddings
    resolved = GenerationParams(gen_length=8, steps=MAX_STEPS).validate(4, context, family)
    assert resolved.steps <= MAX_STEPS
    if not family.fixed_block:  # Clover decodes its own block only
        assert GenerationParams(gen_length=8, block_length=context).validate(4, context, family).block_length == context
