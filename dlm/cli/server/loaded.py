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
from dlm.engine.stops import TextOf, stop_cut


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

    def text_of(self, seq: RequestState) -> TextOf:
        """The text of `seq`'s generated ids with this model's tokenizer (up to a stop id): what
        its stop strings are searched in (dlm/engine/stops.py)."""
        return lambda ids: self.decode(ids, seq.stop_ids)

    def stop_cut(self, prefix: list[int], seq: RequestState) -> tuple[str, int | None]:
        """The text of `seq`'s committed `prefix` and where its first stop string starts (None:
        none yet): the engine's rule (`dlm.engine.stops.stop_cut`), which the engine thread
        (ending the request at the step that commits it, `RequestStream.ends`) and the answer's
        text (`Responder.text`) both apply."""
        return stop_cut(self.text_of(seq), prefix, seq.params)

    def completion_ids(self, prefix: list[int], stops: Collection[int]) -> list[int]:
        """Generated ids that count as the completion: up to and including the first stop id."""
        return completion(prefix, stops)

    def describe(self) -> str:
        return self.ref or str(self.model_dir)
