"""LoadedModel: one checkpoint ready to serve (its engine loop, tokenizer and limits).

A server usually holds one. During a hot swap (dlm/cli/server/hotswap.py) it holds two for a
while: new requests go to the new one while requests admitted earlier finish on the old
one. So a request keeps a reference to the LoadedModel it was admitted to and decodes its
output with that model's tokenizer, whatever the server serves by the time it ends.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlm.cli.server.logprobs import token_bytes
from dlm.engine.runtime.async_engine import AsyncEngine
from dlm.engine.runtime.request import RequestState, completion


def find_stop(text: str, stops: list[str], after: int = 0) -> int | None:
    """Where the first stop string starts among those ending past `after` characters."""
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


@dataclass(eq=False)
class LoadedModel:
    engine: AsyncEngine
    tokenizer: Any  # None when the checkpoint has no tokenizer (token-id prompts only)
    max_model_len: int
    model_dir: Path
    ref: str | None = None  # NAME@VERSION when it came from the store through a deployment
    # Each token's own text and raw bytes, once per token id (at most the vocabulary).
    _texts: dict[int, str] = field(default_factory=dict, repr=False)
    _bytes: dict[int, bytes] = field(default_factory=dict, repr=False)

    @property
    def version(self) -> str | None:
        return self.ref.partition("@")[2] if self.ref else None

    def decode(self, ids: list[int], stops: Collection[int]) -> str:
        """Text of `ids` up to the first of the request's stop ids (`RequestState.stop_ids`)."""
        from dlm.engine.tokenizer import decode

        return "" if self.tokenizer is None else decode(self.tokenizer, ids, stops)

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens spelt out); its id where there is no tokenizer.
        Decoded once per token id: an answer's logprobs (up to 21 entries per token, each
        text and bytes) and canvas events name the same tokens over and over, and decoding
        each entry on the event loop stalled every route for seconds (n 15 x 1024 tokens x
        20 alternatives: /health waited 4 s)."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = str(token) if self.tokenizer is None else str(self.tokenizer.decode([token]))
        return text

    def token_bytes(self, token: int) -> bytes:
        """One token's raw bytes (`token_bytes`), worked out once per token id."""
        raw = self._bytes.get(token)
        if raw is None:
            raw = self._bytes[token] = token_bytes(self.tokenizer, token, self.token_text(token))
        return raw

    def stop_cut(self, prefix: list[int], seq: RequestState, strings: list[str]) -> tuple[str, int | None]:
        """The text of `seq`'s committed `prefix` and where its first stop string starts (None:
        none yet). As in vLLM, a stop string ends the answer only once it has `min_tokens`
        tokens, and only where it ends after them. The one rule both the engine thread (which
        ends the request at the step that commits it, `RequestStream.ends`) and the answer's
        text (`Responder.text`) apply."""
        text = self.decode(prefix, seq.stop_ids)
        least = seq.params.min_tokens
        if not strings or (least and len(prefix) < least):
            return text, None
        after = len(self.decode(prefix[:least], seq.stop_ids)) if least else 0
        return text, find_stop(text, strings, after)

    def completion_ids(self, prefix: list[int], stops: Collection[int]) -> list[int]:
        """Generated ids that count as the completion: up to and including the first stop id."""
        return completion(prefix, stops)

    def describe(self) -> str:
        return self.ref or str(self.model_dir)
