"""Structured output: a JSON schema compiled into a skeleton for the canvas (torch-free).

An autoregressive server enforces a schema by masking logits left to right. A diffusion
model can do better: everything the schema fixes (braces, keys, quotes, colons, commas) is
laid on the canvas as committed tokens before the first forward, and only the value slots
are denoised, each under a token mask of its type (dlm/engine/decoding/constrain.py). So the
answer always parses and validates, and the forwards are spent on the values alone.

`compile_response_format` turns an OpenAI `response_format` into a `Skeleton`: a list of
`Literal` text pieces and value `Slot`s. Each slot is a small automaton over token classes,
decided left to right inside the slot (slots advance in parallel), so a slot of variable
length ends with JSON whitespace the decoder chooses (a pad after the value):
- `StringSlot`: content tokens (no quote, backslash or control character), then the closing
  quote once `min_tokens` are written, then pads; with `maxLength`, one character per token;
- `NumberSlot`: an optional minus, digits without a leading zero, an optional fraction,
  then pads; bounds are kept by digit counts (`NumberSide`, conservative: always inside them);
- `EnumSlot`: one of the JSON texts of `enum` (booleans are `[true, false]`), then pads.

Rules that make a bounded, always-valid skeleton (documented in docs/structured-output.md):
every declared property is written, in declaration order (required or optional); an array
has `DEFAULT_ITEMS` items, clamped to [minItems, maxItems]; a string has at most
`STRING_TOKENS` content tokens (at least `minLength`); an integer or number has at most
`MAX_DIGITS` integer digits and `FRACTION_DIGITS` decimals; a range with both bounds is
an enumeration of its integers (at most `ENUM_SPAN` + 1, evenly spread). `json_object` is a generic object of
`OBJECT_KEYS` string keys with string values. A keyword dlm cannot enforce is refused with a
`UsageError` naming it (field `response_format`), never ignored; so is a key the
response format's object (or its `json_schema` object) does not have (`UnknownKey`, checked by
`format_object`, the one rule every entry point applies: a server calls it at its boundary).

The input is untrusted (an HTTP body), so the work is bounded before it is done: the schema
is first checked against JSON Schema's own metaschema (draft 2020-12), so the compiler only
ever meets well-typed keywords (`required` a list of strings, `minItems` an integer, ...);
then compiling stops as soon as the skeleton cannot fit, either the request's `max_tokens`
(each slot takes its positions and each run of fixed text at least one) or `MAX_SKELETON`
(characters of fixed text plus value positions, and subschemas visited). Repetition makes a
small schema large (arrays of `minItems` items nested, a `$ref` used many times): without the
bound a 400-byte schema would compile billions of pieces. An enum repeated by an array is
compiled once (one `EnumSlot` for every copy).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from dlm.engine.errors import Name, UnknownKey, Unsupported, UsageError

if TYPE_CHECKING:
    from dlm.engine.registry import Family

FIELD = "response_format"
# The keys of each response format type (OpenAI's), and those of its `json_schema` object:
# any other key is refused (`UnknownKey`), on every entry point (`format_object`).
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "text": ("type",),
    "json_object": ("type",),
    "json_schema": ("type", "json_schema"),
}
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
STRING_TOKENS = 12  # content tokens of a string without maxLength
MAX_DIGITS = 9  # integer digits of an unbounded number
FRACTION_DIGITS = 3  # decimals of a `number`
DEFAULT_ITEMS = 3  # items of an array, clamped to [minItems, maxItems]
MAX_ITEMS = 64  # minItems above this is refused
ENUM_SPAN = 64  # a range with both bounds is an enumeration of at most this many + 1 integers
OBJECT_KEYS = 3  # pairs of a json_object
MAX_DEPTH = 12  # nesting deeper than this is refused
# The largest skeleton compiled: characters of fixed text plus value positions; subschemas
# visited are bounded by it too. Far above what any max_tokens holds (a token of JSON spans
# a few characters); it bounds the work when max_tokens is not known or huge.
MAX_SKELETON = 32768

# Keywords that only annotate, or that the skeleton satisfies by construction.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions", "strict"}
)
HANDLED = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",  # only declared properties are written
        "items",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "enum",
        "const",
        "$ref",
    }
)


@dataclass(frozen=True)
class Literal:
    """Text the schema fixes: committed on the canvas before decoding."""

    text: str


@dataclass(frozen=True)
class StringSlot:
    """A string's content after its (fixed) opening quote: `min_tokens` to `max_tokens`
    content tokens, then the closing quote, then pads. `single_char`: one character per
    token (so `maxLength` counts tokens)."""

    min_tokens: int
    max_tokens: int
    single_char: bool

    @property
    def length(self) -> int:
        return self.max_tokens + 1  # the closing quote always fits


@dataclass(frozen=True)
class NumberSide:
    """The magnitudes one sign may take: `min_digits`..`max_digits` integer digits, the
    first in [first_min, first_max]; `zero`: the integer part may be a lone 0;
    `fraction`: decimals may follow (only where they cannot cross a bound)."""

    zero: bool
    first_min: int
    first_max: int
    min_digits: int
    max_digits: int
    fraction: bool

    @property
    def nonzero(self) -> bool:
        return self.max_digits >= self.min_digits and self.first_min <= self.first_max


@dataclass(frozen=True)
class NumberSlot:
    positive: NumberSide | None  # values >= 0
    negative: NumberSide | None  # values <= -1 (after a minus)

    @property
    def length(self) -> int:
        digits = max(s.max_digits for s in (self.positive, self.negative) if s is not None)
        return 1 + max(digits, 1) + 1 + FRACTION_DIGITS


@dataclass(frozen=True, eq=False)
class EnumSlot:
    """One of `values` (JSON texts), then pads. Compared by identity: an enum repeated by an
    array is one slot object, laid out once (dlm/engine/decoding/constrain.py)."""

    values: tuple[str, ...]

    @cached_property
    def chars(self) -> int:
        """The longest value's characters: an upper bound on its tokens."""
        return max(len(v) for v in self.values)


Piece = Literal | StringSlot | NumberSlot | EnumSlot
Slot = StringSlot | NumberSlot | EnumSlot


@dataclass(frozen=True)
class Skeleton:
    pieces: tuple[Piece, ...]  # consecutive literals merged
    visited: int = field(default=0, compare=False)  # subschemas the compile visited (its work)

    @property
    def slots(self) -> int:
        return sum(not isinstance(p, Literal) for p in self.pieces)


def supported(family: Family) -> bool:
    """Whether a family can decode a skeleton: the one fact behind both the refusal and the
    capability listing (dlm/engine/capabilities.py). Its attention must reach the skeleton laid
    after the current block: bidirectional (not block-causal, not Clover's hybrid, not
    DiffusionGemma's canvas decoder, which resamples every position)."""
    return family.attention == "bidirectional"


def compile_response_format(text: Any, max_tokens: int | None = None) -> Skeleton | None:
    """The skeleton of a `response_format` given as JSON text, or as the object itself from
    the Python API (None: plain text). `max_tokens`: refuse (field `gen_length`) as soon as
    the skeleton cannot fit that many positions."""
    if text is None:
        return None
    try:
        return _compile(format_spec(text), max_tokens)
    except RecursionError:  # a schema nested thousands deep (the command line has no body limits)
        raise UsageError("response_format is nested too deeply", field=FIELD) from None


def asks_structure(text: Any) -> bool:
    """Whether a `response_format` asks for JSON (not plain text), known before its schema is
    compiled: what refuses the request whatever the schema (a family without bidirectional
    attention, `ignore_eos`) is then said before what depends on it (a skeleton too long)."""
    if text is None:
        return False
    try:
        return format_spec(text)["type"] != "text"
    except RecursionError:
        raise UsageError("response_format is nested too deeply", field=FIELD) from None


def format_spec(text: Any) -> dict[str, Any]:
    """The response format given as JSON text (`dlm generate`'s flag, GenerationParams' field)
    or as the value itself (the Python API may pass the object), its shape checked by
    `format_object`."""
    if isinstance(text, str):
        try:
            text = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"response_format is not valid JSON: {exc}", field=FIELD) from None
    return format_object(text)


def format_object(spec: Any) -> dict[str, Any]:
    """The response format's value checked: the one rule for it on every entry point (`dlm
    generate`, `dlm batch`, the Python API and a server's body, whose parsed value is checked
    here at its boundary: a string there is a string, not JSON text). A value that is not an
    object, a missing or unknown `type`, a key the type does not have (`UnknownKey`), a
    `json_schema` object without its `schema` or `name`, a key it does not have, or a `name`,
    `description` or `strict` of the wrong type is refused, naming the place, in the same
    words whichever entry point it came through; the schema itself is `_compile`'s to check."""
    if not isinstance(spec, dict):
        raise UsageError(f"response_format must be a JSON object, got {json_type(spec)}", field=FIELD)
    if "type" not in spec:
        raise UsageError("response_format.type is required: text, json_object or json_schema", field=FIELD)
    kind = spec["type"]
    keys = FORMAT_KEYS.get(kind) if isinstance(kind, str) else None
    if keys is None:
        raise UsageError(f"response_format type must be text, json_object or json_schema, got {kind!r}", field=FIELD)
    for key in spec:
        if key not in keys:
            raise UnknownKey(f"response_format.{key}", FIELD)
    if kind == "json_schema":
        _check_wrapper(spec.get("json_schema"))
    return spec


def json_type(value: Any) -> str:
    """The JSON name of a value's type (a client sent JSON; the Python API's list or tuple is
    an array too), the Python name of anything JSON has no name for."""
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), ((list, tuple), "array")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _check_wrapper(wrapper: Any) -> None:
    """The `json_schema` object: its `schema` (checked when compiled), a string `name`, an
    optional string `description` and boolean `strict`, and nothing else."""
    if not isinstance(wrapper, dict) or "schema" not in wrapper:
        raise UsageError(
            "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}", field=FIELD
        )
    for key in wrapper:
        if key not in JSON_SCHEMA_KEYS:
            raise UnknownKey(f"response_format.json_schema.{key}", FIELD)
    if "name" not in wrapper:
        raise UsageError("response_format.json_schema.name is required", field=FIELD)
    for key, kind, optional in (("name", str, False), ("description", str, True), ("strict", bool, True)):
        given = wrapper.get(key)
        if key in wrapper and not isinstance(given, kind) and not (optional and given is None):
            expected = "a string" if kind is str else "a boolean"
            raise UsageError(
                f"response_format.json_schema.{key} must be {expected}, got {type(given).__name__}", field=FIELD
            )


def _compile(spec: dict[str, Any], max_tokens: int | None) -> Skeleton | None:
    """The skeleton of a response format `format_spec` checked."""
    kind = spec["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _Compiler({}, max_tokens).skeleton(None)
    schema = spec["json_schema"]["schema"]
    if not isinstance(schema, dict | bool):
        raise UsageError("response_format json_schema.schema must be an object", field=FIELD)
    check_schema(schema)
    return _Compiler(schema if isinstance(schema, dict) else {}, max_tokens).skeleton(schema)


def check_schema(schema: dict[str, Any] | bool) -> None:
    """A `UsageError` naming the first place where `schema` is not a JSON Schema (draft
    2020-12's metaschema, whatever `$schema` says: the dialect OpenAI's structured outputs
    speak), so the compiler meets only well-typed keywords."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    error = best_match(Draft202012Validator(Draft202012Validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the root"
        raise UsageError(
            f"response_format: the schema is not a valid JSON Schema at {where}: {error.message}", field=FIELD
        )


def refuse(keyword: str, why: str) -> Unsupported:
    return Unsupported(f"response_format: the schema keyword {keyword!r} is not supported: {why}", field=FIELD)


class _Compiler:
    """Builds the pieces, counting as it goes: `size` (characters of fixed text plus value
    positions), `positions` (a lower bound on the tokens: each slot's positions, at least one
    per run of fixed text) and `visited` subschemas; it stops as soon as one is over its bound."""

    def __init__(self, root: dict[str, Any], max_tokens: int | None) -> None:
        self.root = root
        self.max_tokens = max_tokens
        self.pieces: list[Piece] = []
        self.literal: list[str] = []  # fixed text not yet closed into a Literal (joined once)
        self.size = self.positions = self.visited = 0
        # an enum's piece by the identity of its value list (kept alive here, so an id is never reused)
        self.choices: dict[int, tuple[list[Any], Piece]] = {}

    def skeleton(self, schema: dict[str, Any] | bool | None) -> Skeleton:
        if schema is None:  # json_object: a generic object of string pairs
            self.text("{")
            for i in range(OBJECT_KEYS):
                self.text(", " if i else "")
                self.text('"')
                self.slot(StringSlot(1, STRING_TOKENS, False))
                self.text(': "')
                self.slot(StringSlot(0, STRING_TOKENS, False))
            self.text("}")
        else:
            self.value(schema, 0, ())
        self.close()
        return Skeleton(tuple(self.pieces), self.visited)

    def grow(self, size: int, positions: int) -> None:
        """Count a piece; refuse the schema as soon as its skeleton cannot fit."""
        self.size += size
        self.positions += positions
        if self.size > MAX_SKELETON:
            raise UsageError(
                f"response_format: the schema's skeleton exceeds {MAX_SKELETON} characters of fixed text and "
                "value positions (arrays of many items nested, or a $ref used many times)",
                field=FIELD,
            )
        if self.max_tokens is not None and self.positions > self.max_tokens:
            raise UsageError(
                (
                    "response_format: this schema's skeleton needs more tokens than ",
                    Name("gen_length"),
                    f" ({self.max_tokens})",
                ),
                field="gen_length",
            )

    def text(self, text: str) -> None:
        if not text:
            return
        self.grow(len(text), 0 if self.literal else 1)
        self.literal.append(text)

    def close(self) -> None:
        if self.literal:
            self.pieces.append(Literal("".join(self.literal)))
            self.literal = []

    def slot(self, piece: Slot) -> None:
        length = piece.chars if isinstance(piece, EnumSlot) else piece.length
        self.grow(length, 1 if isinstance(piece, EnumSlot) else length)
        self.close()
        self.pieces.append(piece)

    def value(self, schema: dict[str, Any] | bool, depth: int, refs: tuple[str, ...]) -> None:
        if schema is True:
            schema = {}
        if schema is False:
            raise refuse("false", "a schema that accepts nothing has no answer")
        if not isinstance(schema, dict):
            raise UsageError("response_format: every subschema must be an object", field=FIELD)
        self.visited += 1
        if self.visited > MAX_SKELETON:
            raise UsageError(
                f"response_format: the schema has more than {MAX_SKELETON} subschemas to compile", field=FIELD
            )
        if depth > MAX_DEPTH:
            raise refuse("properties", f"nesting deeper than {MAX_DEPTH} levels")
        for keyword in schema:
            if keyword not in HANDLED and keyword not in ANNOTATIONS:
                raise refuse(keyword, "dlm cannot enforce it on the canvas")
        if "$ref" in schema:
            ref = schema["$ref"]
            if ref in refs:
                raise refuse("$ref", f"{ref} refers to itself (unbounded recursion)")
            self.value(self.resolve(ref), depth + 1, (*refs, ref))
            return
        if "const" in schema:
            self.text(_dump(schema["const"]))
            return
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise UsageError("response_format: enum must be a non-empty list", field=FIELD)
            self.choice(values)
            return
        kind = _type(schema)
        if kind == "object":
            self.object(schema, depth, refs)
        elif kind == "array":
            self.array(schema, depth, refs)
        elif kind == "string":
            self.string(schema)
        elif kind in ("integer", "number"):
            self.number(schema, kind == "integer")
        elif kind == "boolean":
            self.choice([True, False])
        elif kind == "null":
            self.text("null")
        else:
            raise refuse("type", f"unknown type {kind!r}")

    def resolve(self, ref: Any) -> dict[str, Any] | bool:
        prefixes = ("#/$defs/", "#/definitions/")
        if not isinstance(ref, str) or not ref.startswith(prefixes):
            raise refuse("$ref", "only local references into #/$defs or #/definitions are followed")
        section, _, name = ref[2:].partition("/")
        target = self.root.get(section, {}).get(name) if isinstance(self.root.get(section), dict) else None
        if target is None:
            raise UsageError(f"response_format: $ref {ref} names no definition", field=FIELD)
        return target  # type: ignore[no-any-return]

    def choice(self, values: list[Any]) -> None:
        known = self.choices.get(id(values))
        if known is None:
            texts = tuple(dict.fromkeys(_dump(v) for v in values))
            known = self.choices[id(values)] = (values, Literal(texts[0]) if len(texts) == 1 else EnumSlot(texts))
        piece = known[1]
        if isinstance(piece, Literal):
            self.text(piece.text)
        else:
            self.slot(piece)

    def object(self, schema: dict[str, Any], depth: int, refs: tuple[str, ...]) -> None:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise UsageError("response_format: properties must be an object", field=FIELD)
        missing = [k for k in schema.get("required", []) if k not in properties]
        if missing:
            raise refuse("required", f"{missing[0]!r} is required but not among the properties")
        self.text("{")
        for i, (key, sub) in enumerate(properties.items()):
            self.text((", " if i else "") + json.dumps(key, ensure_ascii=False) + ": ")
            self.value(sub, depth + 1, refs)
        self.text("}")

    def array(self, schema: dict[str, Any], depth: int, refs: tuple[str, ...]) -> None:
        low = _int(schema, "minItems", 0)
        high = _int(schema, "maxItems", max(low, DEFAULT_ITEMS))
        if low > MAX_ITEMS:
            raise refuse("minItems", f"more than {MAX_ITEMS} items")
        if high < low:
            raise UsageError("response_format: maxItems is below minItems", field=FIELD)
        items = schema.get("items", {})
        if isinstance(items, list):
            raise refuse("items", "tuple validation (a list of schemas)")
        count = min(max(DEFAULT_ITEMS, low), high)
        self.text("[")
        for i in range(count):
            self.text(", " if i else "")
            self.value(items, depth + 1, refs)
        self.text("]")

    def string(self, schema: dict[str, Any]) -> None:
        low = _int(schema, "minLength", 0)
        high = schema.get("maxLength")
        if high is not None:
            high = _int(schema, "maxLength", 0)
            if high < low:
                raise UsageError("response_format: maxLength is below minLength", field=FIELD)
        if low > 256:
            raise refuse("minLength", "strings longer than 256 characters")
        top = max(STRING_TOKENS, low) if high is None else min(high, max(STRING_TOKENS, low))
        self.text('"')
        self.slot(StringSlot(low, top, high is not None))

    def number(self, schema: dict[str, Any], integer: bool) -> None:
        low, high = _bounds(schema)
        if low is not None and high is not None:
            if high.value < low.value:
                raise refuse(
                    high.keyword,
                    f"with {low.keyword!r}, the range holds no integer (a bounded range is written as its integers)",
                )
            # A bounded range: its integers, or ENUM_SPAN + 1 of them evenly spread over it.
            step = max(1, -(-(high.value - low.value) // ENUM_SPAN))
            self.choice(sorted({*range(low.value, high.value + 1, step), high.value}))
            return
        lo, hi = (low.value if low else None), (high.value if high else None)
        positive = _side(max(lo, 0) if lo is not None else 0, hi, not integer) if hi is None or hi >= 0 else None
        negative = None
        if lo is None or lo <= -1:
            negative = _side(max(1, -hi) if hi is not None else 1, -lo if lo is not None else None, not integer)
        sides = [s for s in (positive, negative) if s is not None and (s.zero or s.nonzero)]
        if not sides:
            # Reached with one bound only (two take the branch above): the refusal names it.
            keyword = next(bound.keyword for bound in (low, high) if bound is not None)
            raise refuse(keyword, "dlm cannot write a value inside these bounds")
        self.slot(
            NumberSlot(
                positive if positive is not None and (positive.zero or positive.nonzero) else None,
                negative if negative is not None and negative.nonzero else None,
            )
        )


def _side(low: int, high: int | None, fraction: bool) -> NumberSide:
    """Digit rules for magnitudes in [low, high] (high None: unbounded): conservative, so
    every number written is inside."""
    if high is None:
        max_digits = MAX_DIGITS
    else:
        max_digits = min(MAX_DIGITS, len(str(high + 1)) - 1)  # 10**d - 1 <= high
    first_max = 9
    if high is not None and 1 <= high <= 9:
        max_digits, first_max = 1, high
    first_min, min_digits = (max(low, 1), 1) if low <= 9 else (1, len(str(low)) + 1)
    # Decimals only where the integer part's bound leaves room for them: below 10**d <= high.
    frac = fraction and (high is None or (max_digits >= 1 and 10**max_digits <= high and first_max == 9))
    return NumberSide(low == 0, first_min, first_max, min_digits, max_digits, frac)


@dataclass(frozen=True)
class Bound:
    """An inclusive integer bound every written value keeps, and the schema keyword it comes
    from as the client wrote it (`exclusiveMaximum`, not the `maximum` it amounts to), so a
    refusal names what the client can find in its schema."""

    value: int
    keyword: str


def _bounds(schema: dict[str, Any]) -> tuple[Bound | None, Bound | None]:
    """The tightest lower and upper bounds of the schema (None: unbounded on that side)."""
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key in schema:
            value = schema[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise UsageError(f"response_format: {key} must be a number", field=FIELD)
    lows, highs = [], []
    if "minimum" in schema:
        lows.append(Bound(math.ceil(schema["minimum"]), "minimum"))
    if "exclusiveMinimum" in schema:
        lows.append(Bound(math.floor(schema["exclusiveMinimum"]) + 1, "exclusiveMinimum"))
    if "maximum" in schema:
        highs.append(Bound(math.floor(schema["maximum"]), "maximum"))
    if "exclusiveMaximum" in schema:
        highs.append(Bound(math.ceil(schema["exclusiveMaximum"]) - 1, "exclusiveMaximum"))
    lo = max(lows, key=lambda b: b.value, default=None)
    hi = min(highs, key=lambda b: b.value, default=None)
    for bound in (lo, hi):
        if bound is not None and abs(bound.value) >= 10**MAX_DIGITS:
            raise refuse(bound.keyword, f"bounds beyond {MAX_DIGITS} digits")
    return lo, hi


def _type(schema: dict[str, Any]) -> str:
    """The schema's type; a list of types takes its first; untyped schemas by their keywords
    (anything else: a string, which an untyped schema accepts)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        if not kind:
            raise UsageError("response_format: type must not be an empty list", field=FIELD)
        kind = kind[0]
    if kind is None:
        if "properties" in schema or "required" in schema:
            return "object"
        if "items" in schema or "minItems" in schema or "maxItems" in schema:
            return "array"
        return "string"
    if not isinstance(kind, str):
        raise UsageError("response_format: type must be a string", field=FIELD)
    return kind


def _int(schema: dict[str, Any], key: str, default: int) -> int:
    value = schema.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"response_format: {key} must be a non-negative integer", field=FIELD)
    return value


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
