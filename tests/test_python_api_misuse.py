"""The Python API misused: values of the wrong type, prompts of the wrong shape.

The command line (typer) and the HTTP schema (pydantic, strict) hand the engine values of
each field's declared type; `LLM.generate(**params)` takes any object. A value of another type
is a `UsageError` naming the field, as an out-of-range value is: never a comparison or torch
traceback from deep in the engine, and never silently taken (a truthy string for a flag).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from dlm.engine.errors import UsageError
from dlm.engine.params import PARAMS, SCALAR_TYPES, GenerationParams
from tests.tiny_families import tiny_names


def _wrong_values(name: str) -> list[Any]:
    """Values of other types than field `name` takes."""
    kinds = SCALAR_TYPES[name]
    wrong: list[Any] = []
    if str not in kinds:
        wrong.append("1")
    if int in kinds or float in kinds:
        wrong.append(True)  # Python's bool is an int, not a count or a number here
    if int in kinds and float not in kinds:
        wrong.append(1.5)
    if bool in kinds or str in kinds:
        wrong.append(1)
    if type(None) not in kinds:
        wrong.append(None)
    return wrong


def test_every_scalar_field_is_type_checked() -> None:
    """Every field is held to its declared type, by this check or a rule of its own."""
    assert set(PARAMS) - set(SCALAR_TYPES) == {"stop_token_ids", "stop", "suffix", "response_format"}


@pytest.mark.parametrize(
    ("name", "value"), [(name, value) for name in SCALAR_TYPES for value in _wrong_values(name)], ids=repr
)
def test_a_value_of_the_wrong_type_is_a_usage_error_naming_its_field(name: str, value: Any) -> None:
    with pytest.raises(UsageError) as refused:
        GenerationParams(**{name: value}).check_ranges(vocab=100)
    assert refused.value.field == name
    assert str(refused.value).startswith(f"{name} must be ")


def test_an_integer_is_a_number() -> None:
    GenerationParams(temperature=1, cfg_scale=0, threshold=1).check_ranges()


def test_the_python_api_refuses_a_float_seed(tiny_llada: Any) -> None:
    """`seed=1.5` reached torch.Generator.manual_seed: a RuntimeError traceback."""
    from dlm.engine.llm import LLM

    with LLM(tiny_llada, dtype="float32", device="cpu") as llm:
        with pytest.raises(UsageError, match="seed must be an integer"):
            llm.generate([5, 6, 7], gen_length=4, seed=1.5, temperature=0.5)
        with pytest.raises(UsageError, match="ignore_eos must be true or false"):
            llm.generate([5, 6, 7], gen_length=4, ignore_eos="no")


@pytest.mark.parametrize(
    ("prompts", "words"),
    [
        (None, "prompts must be a text, a list of token ids, or a list of those, got NoneType"),
        (5, "got int"),
        (b"hi", "got bytes"),  # was read as the token ids 104, 105
        ([True, False], "got bool"),  # was read as the token ids 1, 0
        ([[1.5, 2.0]], "prompt token ids must be integers, got 1.5"),  # was truncated to 1, 2
        ([["12"]], "prompt token ids must be integers, got '12'"),  # was read as 12
        (torch.tensor(3), "got Tensor"),  # a 0-d tensor: "iteration over a 0-d tensor" (TypeError)
    ],
    ids=repr,
)
def test_a_prompt_that_is_neither_text_nor_ids_is_a_usage_error(tiny_llada: Any, prompts: Any, words: str) -> None:
    from dlm.engine.llm import LLM

    with LLM(tiny_llada, dtype="float32", device="cpu") as llm:
        with pytest.raises(UsageError, match=re.escape(words)) as refused:
            llm.generate(prompts, gen_length=4)
    assert refused.value.field == "prompt"


def test_prompts_from_any_iterable_are_the_prompts_of_a_list(tiny_llada: Any) -> None:
    """A generator of prompts, a tuple, a numpy array or torch tensor of ids (one prompt; a 2-D
    array, one per row) decode as the same prompts in a list: a generator was "not
    subscriptable", an array's truth value "ambiguous"."""
    import numpy
    import torch

    from dlm.engine.llm import LLM

    with LLM(tiny_llada, dtype="float32", device="cpu") as llm:

        def ids(prompts: Any) -> list[list[int]]:
            return [out.output_ids for out in llm.generate(prompts, gen_length=4)]

        one, two = [5, 6, 7], [8, 9, 10]
        expected = ids([one, two])
        assert ids(p for p in (one, two)) == expected
        assert ids(numpy.array([one, two])) == expected
        assert ids(iter(one)) == ids(tuple(one)) == ids(numpy.array(one)) == ids(torch.tensor(one)) == expected[:1]


def test_params_that_are_not_generation_params_are_a_usage_error(tiny_llada: Any) -> None:
    """A dict of fields as `params` was an AttributeError ('dict' object has no attribute 'stop')."""
    from dlm.engine.llm import LLM

    with LLM(tiny_llada, dtype="float32", device="cpu") as llm:
        with pytest.raises(UsageError, match="params must be a GenerationParams, got dict"):
            llm.generate([5, 6], {"gen_length": 4})  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="chat_template_kwargs must be a dict, got list") as refused:
            llm.generate("hi", chat=True, chat_template_kwargs=[1], gen_length=4)  # type: ignore[arg-type]
        assert refused.value.field == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("suffix", "words"),
    [
        (None, "suffix must be text or a list of token ids, got None"),  # was "not iterable"
        (b"ab", "suffix must be text or a list of token ids"),  # was read as the ids 97, 98
        ([1.5], "suffix token ids must be integers, got 1.5"),  # was truncated to 1
        ([True], "suffix token ids must be integers, got True"),
    ],
    ids=repr,
)
def test_a_suffix_that_is_neither_text_nor_ids_is_a_usage_error(tiny_llada: Any, suffix: Any, words: str) -> None:
    from dlm.engine.llm import LLM

    with LLM(tiny_llada, dtype="float32", device="cpu") as llm:
        with pytest.raises(UsageError, match=re.escape(words)) as refused:
            llm.generate([5, 6, 7], gen_length=4, suffix=suffix)
    assert refused.value.field == "suffix"


def test_generate_after_close_is_a_usage_error(tiny_llada: Any) -> None:
    """A closed LLM answered on one process and failed as a broken group at two ranks (its
    ranks stopped): now the same refusal at any size. `close` stays idempotent."""
    from dlm.engine.llm import LLM

    with LLM(tiny_llada, dtype="float32", device="cpu") as llm:
        assert llm.generate([5, 6], gen_length=2)
    with pytest.raises(UsageError, match="this LLM is closed"):
        llm.generate([5, 6], gen_length=2)
    llm.close()


@pytest.mark.parametrize("family", tiny_names())
def test_a_gen_length_past_the_context_is_named_as_such(family: str) -> None:
    """A gen_length past the model's length that 32 does not divide is one block of that
    length (the default block): the block check, made first, named block_length, which the
    request did not give (`dlm generate --gen-length 3001`: "block_length (3001) exceeds")."""
    from dlm.engine.config import load_config
    from dlm.engine.family_rules import validate
    from dlm.engine.tiny_models import ensure_tiny_model

    config = load_config(ensure_tiny_model(f"tiny:{family}"))
    gen_length = config.max_position_embeddings + 1
    gen_length += 1 if gen_length % 2 == 0 else 0  # no block of a power of two divides it
    with pytest.raises(UsageError) as refused:
        validate(GenerationParams(gen_length=gen_length), 1, config)
    assert refused.value.field == "prompt"
    assert f"gen_length ({gen_length}) exceeds" in str(refused.value)
