"""Structured output (`response_format`): schemas drawn from the supported subset always
come back as text that parses and validates (in-process engines, random weights: the
skeleton and the token masks guarantee it, not the model); what dlm cannot enforce is
refused naming the keyword; families that cannot attend a skeleton ahead of them refuse."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlm.engine.errors import Unsupported, UsageError
from dlm.engine.params import GenerationParams
from dlm.engine.registry import family_named
from dlm.engine.structured import EnumSlot, Literal, compile_response_format

GEN_LENGTH = 256
BATCH = 10  # requests decoded together per hypothesis example (one batched forward per step)
# Requests per family: the quick loop, and the slow test's share of the 500 in all.
QUICK = {"tiny:llada": 1, "tiny:dream": 1}  # the default model: in the slow run
FULL = {"tiny:llada": 28, "tiny:dream": 20, None: 2}  # x BATCH = 500 requests (the default model is the slowest)
assert sum(FULL.values()) * BATCH == 500

NAMES = st.text(alphabet="abcdefgh_ XY\u00e9", min_size=1, max_size=6)


@st.composite
def _bounded(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": kind}
    low = draw(st.none() | st.integers(-2000, 2000))
    span = draw(st.none() | st.integers(0, 5000))
    if low is not None:
        key = draw(st.sampled_from(["minimum", "exclusiveMinimum"]))
        schema[key] = low if kind == "integer" else low / 2
    if span is not None:
        top = (low if low is not None else 0) + span + 2  # never empty, exclusive bounds included
        key = draw(st.sampled_from(["maximum", "exclusiveMaximum"]))
        schema[key] = top if kind == "integer" else top / 2 + 1
    return schema


def _sized(draw: st.DrawFn, schema: dict[str, Any], bound: str, most_low: int, most_span: int) -> dict[str, Any]:
    """`schema` with an optional min`bound` (up to `most_low`) and an optional max`bound`
    never below it (`most_span` above it at most): a string's Length, an array's Items."""
    low = draw(st.none() | st.integers(0, most_low))
    if low is not None:
        schema["min" + bound] = low
    if draw(st.booleans()):
        schema["max" + bound] = (low or 0) + draw(st.integers(0, most_span))
    return schema


@st.composite
def _string(draw: st.DrawFn) -> dict[str, Any]:
    return _sized(draw, {"type": "string"}, "Length", most_low=6, most_span=8)


SCALARS = st.one_of(
    _string(),
    _bounded("integer"),
    _bounded("number"),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.just({"type": ["integer", "null"], "maximum": 99}),
    st.lists(st.text(max_size=5) | st.integers(-50, 50) | st.booleans(), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    ),
    (st.text(max_size=4) | st.integers()).map(lambda value: {"const": value}),
)


def _object(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        properties = draw(st.dictionaries(NAMES, children, min_size=0, max_size=3))
        required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True)) if properties else []
        schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    return build()


def _array(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        return _sized(draw, {"type": "array", "items": draw(children)}, "Items", most_low=2, most_span=2)

    return build()


def _size(schema: dict[str, Any]) -> int:
    """An upper bound on the skeleton's tokens (a token spans at least one byte)."""
    skeleton = compile_response_format(_format(schema))
    assert skeleton is not None
    return sum(
        len(p.text.encode())
        if isinstance(p, Literal)
        else max(len(v.encode()) for v in p.values)
        if isinstance(p, EnumSlot)
        else p.length
        for p in skeleton.pieces
    )


SCHEMAS = st.recursive(SCALARS, lambda c: _object(c) | _array(c), max_leaves=5).filter(lambda s: _size(s) <= GEN_LENGTH)
REQUESTS = st.tuples(SCHEMAS, st.sampled_from([0.0, 0.0, 1.0]), st.integers(0, 2**31 - 1))


def _format(schema: dict[str, Any]) -> str:
    return json.dumps({"type": "json_schema", "json_schema": {"name": "drawn", "schema": schema}})


@cache
def _llm(model: str | None) -> Any:
    from dlm.engine.llm import LLM

    return LLM(model, device="cpu", dtype="float32")


def _decode_batch(model: str | None, requests: list[tuple[dict[str, Any], float, int]]) -> None:
    """Decode the requests together through the engine (as a server batches them) and check
    each answer parses and validates, within the forwards its parameters promise."""
    from dlm.engine.tokenizer import decode

    llm = _llm(model)
    prompt = llm.encode("Answer in JSON:")
    seqs = []
    for schema, temperature, seed in requests:
        params = GenerationParams(
            gen_length=GEN_LENGTH, response_format=_format(schema), temperature=temperature, seed=seed
        )
        seqs.append(llm.engine.add_request(prompt, params))
    while any(not s.finished for s in seqs):
        llm.engine.step()
    for (schema, _, _), seq in zip(requests, seqs):
        text = decode(llm.tokenizer, seq.output_ids, seq.stop_ids)
        jsonschema.validate(json.loads(text), schema)
        assert seq.nfe <= seq.params.max_forwards


def _run(model: str | None, examples: int) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    @given(st.lists(REQUESTS, min_size=BATCH, max_size=BATCH))
    def check(requests: list[tuple[dict[str, Any], float, int]]) -> None:
        _decode_batch(model, requests)

    check()


@pytest.mark.parametrize("model", list(QUICK), ids=lambda m: m or "default")
def test_drawn_schemas_always_parse_and_validate(model: str | None) -> None:
    _run(model, QUICK[model])


@pytest.mark.slow
@pytest.mark.parametrize("model", list(FULL), ids=lambda m: m or "default")
def test_five_hundred_drawn_schemas_parse_and_validate(model: str | None) -> None:
    """The acceptance run: 500 requests in all over LLaDA, Dream and the default model."""
    _run(model, FULL[model])


def test_the_skeleton_is_committed_and_only_values_are_decoded() -> None:
    """Keys, braces and quotes are on the canvas before the first forward; the forwards
    spent are at most the value tokens (fewer than unconstrained decoding of the length)."""
    llm = _llm("tiny:llada")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}}}
    params = GenerationParams(gen_length=64, response_format=_format(schema))
    seq = llm.engine.make_sequence(llm.encode("x"), params)
    laid = llm.tokenizer.decode([t for t in seq.output_ids if t != llm.config.mask_token_id], skip_special_tokens=True)
    assert laid.startswith('{"name": "') and '"ok": ' in laid and laid.endswith("}")
    slots = seq.masks_left
    out = llm.generate("x", params)[0]
    assert json.loads(out.text)["ok"] in (True, False)
    assert out.nfe <= slots < 64


def test_keys_and_values_that_spell_special_tokens_stay_text() -> None:
    schema = {"type": "object", "properties": {"<|endoftext|>": {"enum": ["<|mask|>", "x"]}}}
    out = _llm("tiny:llada").generate("x", gen_length=64, response_format=_format(schema))[0]
    jsonschema.validate(json.loads(out.text), schema)


def test_json_object_is_a_generic_object() -> None:
    out = _llm("tiny:dream").generate("x", gen_length=128, response_format='{"type": "json_object"}')[0]
    assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "string", "pattern": "^a+$"}, "pattern"),
        ({"type": "string", "format": "email"}, "format"),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "anyOf"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "integer", "multipleOf": 3}, "multipleOf"),
        (
            {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
            "$ref",
        ),
        ({"type": "object", "properties": {}, "required": ["a"]}, "required"),
        # Bounds: the keyword the client wrote, never the `maximum` or `minimum` it amounts to.
        ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "exclusiveMaximum"),
        ({"type": "integer", "minimum": 0, "exclusiveMinimum": 5, "maximum": 3}, "maximum"),
        ({"type": "integer", "exclusiveMinimum": 1e12}, "exclusiveMinimum"),
        ({"type": "integer", "exclusiveMaximum": -1e12}, "exclusiveMaximum"),
        ({"type": "number", "exclusiveMinimum": 999_999_998}, "exclusiveMinimum"),
        ({"type": "number", "exclusiveMaximum": -999_999_998}, "exclusiveMaximum"),
    ],
)
def test_what_cannot_be_enforced_is_refused_naming_the_keyword(schema: dict[str, Any], keyword: str) -> None:
    with pytest.raises(Unsupported, match=f"'{keyword.replace('$', '[$]')}'") as caught:
        GenerationParams(response_format=_format(schema)).validate(4, 1024)
    assert caught.value.field == "response_format"


def test_local_references_without_cycles_are_followed() -> None:
    schema = {"$defs": {"p": {"type": "integer", "minimum": 0}}, "type": "array", "items": {"$ref": "#/$defs/p"}}
    out = _llm("tiny:llada").generate("x", gen_length=64, response_format=_format(schema))[0]
    jsonschema.validate(json.loads(out.text), schema)


def test_families_that_cannot_attend_the_skeleton_refuse() -> None:
    fmt = '{"type": "json_object"}'
    for family in ("sdar", "llada2_moe"):
        with pytest.raises(Unsupported, match="bidirectional") as caught:
            GenerationParams(response_format=fmt).validate(4, 1024, family_named(family))
        assert caught.value.field == "response_format"
    with pytest.raises(Unsupported) as caught:
        GenerationParams(response_format=fmt, cache="prefix").validate(4, 1024, family_named("dream"))
    assert caught.value.field == "cache"
    text = GenerationParams(response_format='{"type": "text"}').validate(4, 1024, family_named("sdar"))
    assert text.response_format is not None  # plain text asks for nothing: any family takes it


def test_a_skeleton_longer_than_max_tokens_is_refused() -> None:
    schema = {"type": "array", "items": {"type": "string", "minLength": 30}, "minItems": 5}
    with pytest.raises(UsageError, match=r"needs .*tokens.* than gen_length \(32\)") as caught:
        _llm("tiny:llada").generate("x", gen_length=32, response_format=_format(schema))  # as Python spells it
    assert caught.value.field == "gen_length"


def test_bad_response_formats_are_usage_errors() -> None:
    for bad in ("not json", '{"type": "xml"}', '{"type": "json_schema"}', "[1]"):
        with pytest.raises(UsageError) as caught:
            GenerationParams(response_format=bad).validate(4, 1024)
        assert caught.value.field == "response_format"


def test_the_vocabulary_keeps_string_content_clean() -> None:
    """String content never holds a quote, backslash or control character; with a tokenizer
    that cleans up spaces on decoding, no punctuation it would merge either; a tokenizer
    without single digit tokens cannot carry a response format."""
    from dlm.engine.decoding.constrain import Vocabulary
    from dlm.engine.tiny_models import tokenizer_assets
    from dlm.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_assets())
    size = len(tokenizer)
    vocab = Vocabulary.from_tokenizer(tokenizer, size, set())
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    for i in vocab.content.nonzero()[:, 0].tolist():
        assert not any(c in '"\\' or ord(c) < 0x20 for c in texts[i]), texts[i]
    assert all(texts[i].strip(" \t\n\r") == "" for i in vocab.space.nonzero()[:, 0].tolist())
    assert [texts[t] for t in vocab.digits] == list("0123456789")
    tokenizer.clean_up_tokenization_spaces = True
    cleaned = Vocabulary.from_tokenizer(tokenizer, size, set())
    assert not any(texts[i].startswith((".", ",")) for i in cleaned.content.nonzero()[:, 0].tolist())
    with pytest.raises(UsageError, match="single tokens") as caught:
        Vocabulary.from_tokenizer(tokenizer, size, {vocab.digits[7]})
    assert caught.value.field == "response_format"


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(SCHEMAS, st.randoms(use_true_random=False))
def test_any_choice_within_the_masks_validates(schema: dict[str, Any], rng: Any) -> None:
    """The masks alone guarantee the answer, whatever a model would prefer: open positions
    decided in random subsets, each to a random allowed token (no model, the shipped
    tokenizer), still parse and validate."""
    import torch

    from dlm.engine.decoding.constrain import Vocabulary, layout
    from dlm.engine.tiny_models import special_ids, tokenizer_assets

    tokenizer = _tokenizer(tokenizer_assets())
    _, mask, eos = special_ids()
    vocab = _vocabulary(tokenizer_assets())
    skeleton = compile_response_format(_format(schema))
    assert skeleton is not None and isinstance(vocab, Vocabulary)
    prompt = [10, 11, 12]
    answer, constraint = layout(skeleton, vocab, GEN_LENGTH, mask, eos, len(prompt))
    canvas = torch.tensor(prompt + answer)
    while bool((canvas == mask).any()):
        open_ = constraint.open_positions(canvas, (canvas == mask).nonzero()[:, 0]).tolist()
        chosen = rng.sample(open_, rng.randint(1, len(open_)))
        for position, row in zip(chosen, constraint.allowed(canvas, torch.tensor(chosen))):
            canvas[position] = rng.choice(row.nonzero()[:, 0].tolist())
    ids = canvas[len(prompt) :].tolist()
    text = tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)


@cache
def _tokenizer(path: Any) -> Any:
    from dlm.engine.tokenizer import load_tokenizer

    return load_tokenizer(path)


@cache
def _vocabulary(path: Any) -> Any:
    from dlm.engine.decoding.constrain import Vocabulary
    from dlm.engine.tiny_models import special_ids

    size, mask, eos = special_ids()
    return Vocabulary.from_tokenizer(_tokenizer(path), size, {mask, eos})


def _nested_arrays(items: int, depth: int) -> dict[str, Any]:
    """Arrays of exactly `items` items nested `depth` deep: items**depth integers."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "minItems": items, "maxItems": items}
    return schema


def _refs(uses: int, depth: int, leaf: dict[str, Any]) -> dict[str, Any]:
    """Each definition uses the one below it `uses` times: uses**depth expansions of `leaf`."""
    defs = {"d0": leaf}
    for level in range(1, depth + 1):
        defs[f"d{level}"] = {
            "type": "object",
            "properties": {f"k{i}": {"$ref": f"#/$defs/d{level - 1}"} for i in range(uses)},
        }
    return {"$defs": defs, "$ref": f"#/$defs/d{depth}"}


@pytest.mark.parametrize(
    ("schema", "max_tokens", "field"),
    [
        (_nested_arrays(64, 5), None, "response_format"),  # 10**9 integers: beyond the documented cap
        (_nested_arrays(64, 5), 1024, "gen_length"),  # ... and beyond max_tokens first
        (_refs(40, 5, {"const": 1}), None, "response_format"),  # 40**5 uses of one definition
        (_refs(30, 4, {"type": "boolean"}), 4096, "gen_length"),
    ],
    ids=["arrays-cap", "arrays-max-tokens", "refs-cap", "refs-max-tokens"],
)
def test_a_skeleton_cannot_grow_without_bound_while_compiling(
    monkeypatch: pytest.MonkeyPatch, schema: dict[str, Any], max_tokens: int | None, field: str
) -> None:
    """Repetition makes a few hundred bytes of schema describe billions of pieces: compiling
    stops as soon as the skeleton cannot fit max_tokens or the documented cap, having
    visited at most `MAX_SKELETON` subschemas (counted, never timed)."""
    from dlm.engine import structured

    visits = 0
    visit = structured._Compiler.value

    def counted(self: Any, *args: Any) -> None:
        nonlocal visits
        visits += 1
        assert visits <= structured.MAX_SKELETON + 1, "the compile visits subschemas without bound"
        visit(self, *args)

    monkeypatch.setattr(structured._Compiler, "value", counted)
    with pytest.raises(UsageError) as caught:
        compile_response_format(_format(schema), max_tokens)
    assert caught.value.field == field, caught.value
    assert (f"gen_length ({max_tokens})" if field == "gen_length" else str(structured.MAX_SKELETON)) in str(
        caught.value
    )


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": 5}, "required"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": [{"a": 1}]}, "required/0"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": [["a"]]}, "required/0"),
        ({"type": "object", "properties": {"1": {"type": "string"}}, "required": [1]}, "required/0"),
        ({"type": "array", "items": {"type": "string"}, "minItems": -1}, "minItems"),
        ({"type": "array", "items": {"type": "string"}, "maxItems": "3"}, "maxItems"),
        ({"type": 5}, "type"),
        ({"type": "object", "properties": [{"a": 1}]}, "properties"),
        ({"enum": "red"}, "enum"),
        ({"$defs": {"a": 5}, "$ref": "#/$defs/a"}, "$defs/a"),
    ],
)
def test_a_schema_that_is_not_a_json_schema_is_a_usage_error(schema: dict[str, Any], where: str) -> None:
    """The metaschema check at the boundary: whatever the fuzzer sends is refused naming the
    place (`required` that is not a list of strings used to raise TypeError: a 500)."""
    with pytest.raises(UsageError) as caught:
        GenerationParams(response_format=_format(schema)).validate(4, 1024)
    assert caught.value.field == "response_format" and f"at {where}:" in str(caught.value)


def test_the_samples_of_a_request_share_one_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's n samples are laid out once (one skeleton, one tokenizing of a large enum),
    and an enum repeated by an array is tokenized once: the work does not grow with n or
    with the repetition."""
    from dlm.engine.decoding import constrain
    from dlm.engine.runtime import engine as engine_module

    llm = _llm("tiny:llada")
    layouts, encoded = [], []
    lay, encode = engine_module.layout, llm.engine.vocabulary().encode
    monkeypatch.setattr(engine_module, "layout", lambda *a: layouts.append(1) or lay(*a))
    monkeypatch.setattr(llm.engine.vocabulary(), "encode", lambda texts: encoded.append(len(texts)) or encode(texts))
    values = [f"v{i}" for i in range(500)]
    schema = {"type": "array", "items": {"enum": values}, "minItems": 4, "maxItems": 4}
    params = GenerationParams(gen_length=64, n=6, seed=1, response_format=_format(schema), steps=8)
    seqs = llm.engine.make_sequences(llm.encode("x"), params)
    assert len(seqs) == 6 and len(layouts) == 1 and {id(s.constraint) for s in seqs} == {id(seqs[0].constraint)}
    assert sorted(encoded) == [3, 500]  # the literals "[", ", " and "]" in one batch, the enum once
    assert constrain.END not in {t for region in seqs[0].constraint.regions for t in (region.choices or {})}
    done = llm.engine.generate([llm.encode("x")], params)
    assert len(layouts) == 2 and all(json.loads(_text(s))[0] in values for s in done)


def _text(seq: Any) -> str:
    from dlm.engine.tokenizer import decode

    return str(decode(_llm("tiny:llada").tokenizer, seq.output_ids, seq.stop_ids))


def test_dlm_generate_refuses_a_malformed_schema_with_one_error_line(tiny_llada: Any) -> None:
    """The command line's boundary is the same check: exit 2 and one `error:` line naming
    the place, never a traceback (it used to raise TypeError)."""
    from tests.weights_helpers import cli

    fmt = _format({"type": "object", "properties": {"a": {"type": "string"}}, "required": 5})
    code, out, err = cli("generate", str(tiny_llada), "-p", "x", "--gen-length", "8", "--response-format", fmt)
    assert code == 2 and err.startswith("error: ") and "at required" in err, (code, out, err)
    assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1


def test_the_docs_json_object_length_is_the_codes() -> None:
    """docs/structured-output.md states how many positions `{"type": "json_object"}` takes with
    the default model's tokenizer (why its example asks 128, and 64 is refused): the skeleton
    the code lays needs exactly that many."""
    import re
    from pathlib import Path

    from dlm.engine.config import load_config
    from dlm.engine.decoding.constrain import Vocabulary, layout
    from dlm.engine.default_model import default_model_dir

    doc = (Path(__file__).parent.parent / "docs" / "structured-output.md").read_text()
    stated = int(re.search(r'`\{"type": "json_object"\}` takes (\d+) positions', " ".join(doc.split()))[1])
    config = load_config(default_model_dir())
    vocab = Vocabulary.from_tokenizer(
        _tokenizer(default_model_dir()), config.vocab_size, {config.mask_token_id, config.eos_token_id}
    )
    skeleton = compile_response_format({"type": "json_object"})
    assert skeleton is not None
    layout(skeleton, vocab, stated, config.mask_token_id, config.eos_token_id, 0)  # fits
    with pytest.raises(UsageError, match=f"needs {stated} tokens"):
        layout(skeleton, vocab, stated - 1, config.mask_token_id, config.eos_token_id, 0)
    assert 64 < stated <= 128
