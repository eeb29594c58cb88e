"""A compiled skeleton (dlm/engine/structured.py) laid on a request's canvas, and the token masks
its value slots are decoded under.

`Vocabulary` classifies every token of the checkpoint's tokenizer once, by its text:
JSON whitespace (the pads), string content (no quote, backslash, control character or
broken UTF-8), single characters, digits, the minus, the decimal point and the quote.
`layout` tokenizes the skeleton's literals and slots' fixed alternatives into the answer's
ids (MASK at every slot position, EOS after the skeleton) and returns the `Constraint` the
sequence keeps. At each step the constraint says which positions may be decided (the
leftmost MASK of every slot: a slot is written left to right, slots in parallel) and the
tokens each may take (its automaton's state after the slot's committed tokens), so every
answer parses and validates by construction.

`layout` runs once per request (its `n` samples share the result, which nothing writes),
and an enum repeated in the skeleton is tokenized once, in one batch, into a trie of its
alternatives, so deciding an enum position costs the slot's length, not the enum's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dlm.engine.errors import Name, Unsupported, UsageError
from dlm.engine.structured import (
    FIELD,
    FRACTION_DIGITS,
    EnumSlot,
    Literal,
    NumberSide,
    NumberSlot,
    Skeleton,
    StringSlot,
)

JSON_SPACE = frozenset(" \t\n\r")


@dataclass
class Vocabulary:
    """Token classes of one tokenizer (bool vectors over the model's logits)."""

    size: int
    space: torch.Tensor  # JSON whitespace only: pads
    content: torch.Tensor  # may appear inside a JSON string
    char: torch.Tensor  # string content of exactly one character
    digits: list[int]  # the token of "0".."9"
    minus: int
    point: int
    quote: int
    encode: Callable[[list[str]], list[list[int]]]  # texts to their ids, in one batch

    @staticmethod
    def from_tokenizer(tokenizer: Any, size: int, excluded: set[int]) -> Vocabulary:
        """Classify every id below `size` (the logits' width) by its decoded text; ids in
        `excluded` (MASK, EOS, special tokens) are never allowed in a slot."""
        texts = tokenizer.batch_decode([[i] for i in range(min(size, len(tokenizer)))], skip_special_tokens=True)
        special = set(getattr(tokenizer, "all_special_ids", [])) | excluded
        # A tokenizer that cleans up spaces on decoding (" ." -> ".") would shorten strings
        # behind minLength's back: such punctuation is kept out of string content.
        cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        space, content, char = [False] * size, [False] * size, [False] * size
        exact: dict[str, int] = {}
        for i, text in enumerate(texts):
            if i in special or not text or "\ufffd" in text:
                continue
            exact.setdefault(text, i)
            space[i] = all(c in JSON_SPACE for c in text)
            if not any(c in '"\\' or ord(c) < 0x20 for c in text) and not (cleanup and _cleaned(text)):
                content[i] = True
                char[i] = len(text) == 1
        needed = [*"0123456789", "-", ".", '"', " "]
        absent = [t for t in needed if t not in exact]
        if absent:
            raise Unsupported(
                f"response_format needs single tokens for {absent!r}, which this tokenizer lacks", field=FIELD
            )

        def encode(texts: list[str]) -> list[list[int]]:
            # A key or value that spells a special token ("<|endoftext|>") is text here.
            if not texts:
                return []
            return [
                list(ids) for ids in tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            ]

        # The answer's text must be its tokens' texts put end to end (byte-level BPE): a
        # tokenizer that joins tokens with spaces (WordPiece) would change keys and values.
        pieces = ['{"key": "', "va", "lue", '", "n": ', "-", "1", "2", ".", "5", " ", "]}"]
        ids = [t for piece in encode(pieces) for t in piece] + [exact[" "], exact['"'], exact["7"]]
        expected = "".join(pieces) + ' "7'
        if tokenizer.decode(ids, skip_special_tokens=True) != expected:
            raise Unsupported(
                "response_format needs a tokenizer whose text is its tokens' texts end to end "
                "(byte-level BPE); this one joins or rewrites them",
                field=FIELD,
            )

        digits = [exact[d] for d in "0123456789"]
        space_t, content_t, char_t = torch.tensor(space), torch.tensor(content), torch.tensor(char)
        return Vocabulary(size, space_t, content_t, char_t, digits, exact["-"], exact["."], exact['"'], encode)

    def ids(self, tokens: set[int] | torch.Tensor) -> torch.Tensor:
        """A bool vector over the vocabulary: `tokens` as ids, or already a vector."""
        if isinstance(tokens, torch.Tensor):
            return tokens.clone()
        out = torch.zeros(self.size, dtype=torch.bool)
        out[list(tokens)] = True
        return out


def _cleaned(text: str) -> bool:
    """Whether decoding's space clean-up could change `text` or its junction with a space."""
    return text.startswith((".", "?", "!", ",", "'", "n't")) or any(
        f" {p}" in text for p in (".", "?", "!", ",", "'", "n't")
    )


END = -1  # a trie key (token ids are >= 0): an alternative ends here

Trie = dict[int, "Trie"]  # token id -> the alternatives that continue with it


@dataclass
class _Region:
    """One slot's span of answer positions."""

    start: int
    end: int
    slot: StringSlot | NumberSlot | EnumSlot
    choices: Trie | None = None  # EnumSlot: its values' ids


@dataclass
class Constraint:
    """What a sequence with a response format decides, and under which token masks."""

    vocab: Vocabulary
    regions: list[_Region]
    region_of: torch.Tensor  # [gen_length] long: the region of each answer position, -1 fixed
    offset: int  # canvas index of the answer's first position
    mask_id: int

    def open_positions(self, canvas: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """Of the MASK positions `masked` (absolute), those that may be decided now: the
        leftmost MASK of their slot."""
        rel = masked - self.offset
        previous = torch.where(rel > 0, self.region_of[(rel - 1).clamp_min(0)], -2)
        keep = (canvas[masked - 1] != self.mask_id) | (previous != self.region_of[rel])
        return masked[keep]

    def allowed(self, canvas: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[len(positions), vocab] bool: the tokens each decided position may take."""
        rows = []
        for pos in positions.tolist():
            region = self.regions[int(self.region_of[pos - self.offset])]
            done = canvas[self.offset + region.start : pos].tolist()
            tokens, pad = self._next(region, done)
            row = self.vocab.ids(tokens)
            if pad:
                row |= self.vocab.space
            rows.append(row)
        return torch.stack(rows) if rows else torch.zeros((0, self.vocab.size), dtype=torch.bool)

    def _next(self, region: _Region, done: list[int]) -> tuple[set[int] | torch.Tensor, bool]:
        """The tokens the slot's next position may take, and whether a pad may."""
        v, slot = self.vocab, region.slot
        if isinstance(slot, EnumSlot):
            assert region.choices is not None
            return _enum_next(region.choices, done, v)
        if isinstance(slot, StringSlot):
            if v.quote in done:
                return set(), True
            tokens: set[int] | torch.Tensor = set()
            if len(done) < slot.max_tokens:
                tokens = v.char if slot.single_char else v.content
            if len(done) >= slot.min_tokens:
                tokens = v.ids({v.quote}) | (tokens if isinstance(tokens, torch.Tensor) else v.ids(tokens))
            return tokens, False
        if done and bool(v.space[done[-1]]):
            return set(), True
        return _number_next(slot, done, v)


def _enum_next(choices: Trie, done: list[int], v: Vocabulary) -> tuple[set[int], bool]:
    """Tokens that keep some alternative consistent: its next id, or a pad once it is whole
    (followed only by pads). The walk follows `done` down the trie: its length, not the enum's."""
    node: Trie | None = choices
    padding = False  # some alternative ended, and only pads came after it
    for t in done:
        space = bool(v.space[t])
        padding = space and (padding or (node is not None and END in node))
        node = node.get(t) if node is not None else None
        if node is None and not padding:
            return set(), False
    if node is None:
        return set(), True
    return {t for t in node if t != END}, padding or END in node


def _trie(alternatives: list[list[int]]) -> Trie:
    root: Trie = {}
    for ids in alternatives:
        node = root
        for t in ids:
            node = node.setdefault(t, {})
        node[END] = {}
    return root


def _number_next(slot: NumberSlot, done: list[int], v: Vocabulary) -> tuple[set[int], bool]:
    """An optional minus, digits within the side's rules, an optional fraction, then pads."""
    if not done:
        out: set[int] = {v.minus} if slot.negative is not None else set()
        if slot.positive is not None:
            out |= _first_digits(slot.positive, v)
        return out, False
    negative = done[0] == v.minus
    body = done[1:] if negative else done
    side = slot.negative if negative else slot.positive
    assert side is not None
    if not body:
        return _first_digits(side, v) - {v.digits[0]}, False
    if v.point in body:
        decimals = len(body) - body.index(v.point) - 1
        return (set(v.digits) if decimals < FRACTION_DIGITS else set()), decimals > 0
    if body == [v.digits[0]]:  # a lone zero: no more integer digits
        return ({v.point} if side.fraction else set()), True
    out = set(v.digits) if len(body) < side.max_digits else set()
    whole = len(body) >= side.min_digits  # the integer part already keeps the lower bound
    if side.fraction and whole:
        out.add(v.point)
    return out, whole


def _first_digits(side: NumberSide, v: Vocabulary) -> set[int]:
    out = {v.digits[d] for d in range(side.first_min, side.first_max + 1)} if side.nonzero else set()
    if side.zero:
        out.add(v.digits[0])
    return out


def layout(
    skeleton: Skeleton, vocab: Vocabulary, gen_length: int, mask_id: int, eos_id: int | None, offset: int
) -> tuple[list[int], Constraint]:
    """The answer's ids (literals' tokens, MASK at slot positions, EOS or pads after) and the
    constraint over them. A skeleton longer than `gen_length` is refused (max_tokens). Each
    distinct text and enum is tokenized once (one batch call), however often it repeats."""
    texts = {p.text for p in skeleton.pieces if isinstance(p, Literal)}
    literal = dict(zip(texts, vocab.encode(list(texts))))
    enums: dict[EnumSlot, tuple[Trie, int]] = {}  # by identity: a repeated enum is one object
    for piece in skeleton.pieces:
        if isinstance(piece, EnumSlot) and piece not in enums:
            alternatives = vocab.encode(list(piece.values))
            enums[piece] = (_trie(alternatives), max(len(a) for a in alternatives))
    ids: list[int] = []
    regions: list[_Region] = []
    for piece in skeleton.pieces:
        if isinstance(piece, Literal):
            ids += literal[piece.text]
            continue
        choices, length = enums[piece] if isinstance(piece, EnumSlot) else (None, piece.length)
        regions.append(_Region(len(ids), len(ids) + length, piece, choices))
        ids += [mask_id] * length
    if len(ids) > gen_length:
        raise UsageError(
            (
                f"response_format: this schema's skeleton needs {len(ids)} tokens, more than ",
                Name("gen_length"),
                f" ({gen_length})",
            ),
            field="gen_length",
        )
    filler = eos_id if eos_id is not None else int(vocab.space.nonzero()[0, 0])  # no EOS: trailing pads
    answer = ids + [filler] * (gen_length - len(ids))
    region_of = torch.full((gen_length,), -1, dtype=torch.long)
    for k, region in enumerate(regions):
        region_of[region.start : region.end] = k
    return answer, Constraint(vocab, regions, region_of, offset, mask_id)
