"""Generated tokens' log-probabilities in the OpenAI response shapes.

The engine reports, per generated token, its log-probability at the denoising step that
committed it and that step's most likely alternatives (dlm/engine/decoding/logprobs.py: not an
autoregressive next-token probability). Here they become a completion choice's `logprobs`
(`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`) or a chat
choice's (`content`: one entry per token with `bytes` and `top_logprobs`), for a whole answer
or for the tokens one streamed chunk adds. A token's text is its own decoding; a chat entry's
`bytes` are the token's raw bytes (`token_bytes`), which for a byte-level token holding part of
a UTF-8 character (decoded alone as U+FFFD) are that part, so a client can join them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from dlm.engine.decoding.logprobs import TokenLogprob

Text = Callable[[int], str]  # a token id's own text
Bytes = Callable[[int], bytes]  # a token id's raw bytes

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (as `tokenizers`' ByteLevel spells bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer: Any, token: int, text: str) -> bytes:
    """A token's raw bytes: an added token's content, a byte-level (GPT-2 style) piece's
    bytes, a SentencePiece byte token's byte; otherwise its text (`text`) in UTF-8."""
    if tokenizer is None:
        return text.encode("utf-8")
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token)
    if added is not None:
        return str(added.content).encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(piece, str):
        return text.encode("utf-8")
    byte = _BYTE_FALLBACK.fullmatch(piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None)) or hasattr(tokenizer, "byte_decoder")
    decoder = _byte_decoder()
    if byte_level and all(c in decoder for c in piece):
        return bytes(decoder[c] for c in piece)
    return text.encode("utf-8")


def completion_logprobs(tokens: list[TokenLogprob], text: Text, offsets: list[int]) -> dict[str, Any]:
    """A completion choice's `logprobs`; `offsets`: where each token begins in the answer's
    text (the caller knows the text). The committed token is always in its `top_logprobs` (as
    the OpenAI API answers, up to logprobs + 1 entries)."""
    strings = [text(t.token) for t in tokens]
    tops = []
    for t, s in zip(tokens, strings):
        top = {s: t.logprob}
        for token, logprob in t.top:
            top.setdefault(text(token), logprob)
        tops.append(top)
    return {
        "tokens": strings,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokens: list[TokenLogprob], text: Text, raw: Bytes | None = None) -> dict[str, Any]:
    """A chat choice's `logprobs`: `content`, one entry per token; `raw`: a token's bytes
    (default: its text in UTF-8)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        s = text(token)
        data = raw(token) if raw is not None else s.encode("utf-8")
        return {"token": s, "logprob": logprob, "bytes": list(data)}

    content = [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens]
    return {"content": content, "refusal": None}
