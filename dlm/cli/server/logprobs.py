"""Generated tokens' log-probabilities in the OpenAI response shapes.

The engine reports, per generated token, its log-probability at the denoising step that
committed it and that step's most likely alternatives (dlm/engine/decoding/logprobs.py: not an
autoregressive next-token probability). Here they become a completion choice's `logprobs`
(`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`) or a chat
choice's (`content`: one entry per token with `bytes` and `top_logprobs`), for a whole answer
or for the tokens one streamed chunk adds. A token's text is its own decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dlm.engine.decoding.logprobs import TokenLogprob

Text = Callable[[int], str]  # a token id's own text


def completion_logprobs(tokens: list[TokenLogprob], text: Text, offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs`; `offset`: characters of the answer before `tokens`.
    The committed token is always in its `top_logprobs` (as the OpenAI API answers, up to
    logprobs + 1 entries)."""
    strings = [text(t.token) for t in tokens]
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
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


def chat_logprobs(tokens: list[TokenLogprob], text: Text) -> dict[str, Any]:
    """A chat choice's `logprobs`: `content`, one entry per token."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        s = text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    content = [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens]
    return {"content": content, "refusal": None}
