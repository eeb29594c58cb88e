"""LoadedModel: one checkpoint ready to serve (its engine loop, tokenizer and limits).

A server usually holds one. During a hot swap (dlm/cli/server/hotswap.py) it holds two for a
while: new requests go to the new one while requests admitted earlier finish on the old
one. So a request keeps a reference to the LoadedModel it was admitted to and decodes its
output with that model's tokenizer, whatever the server serves by the time it ends.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.engine.runtime.async_engine import AsyncEngine
from dlm.engine.runtime.request import completion


@dataclass(eq=False)
class LoadedModel:
    engine: AsyncEngine
    tokenizer: Any  # None when the checkpoint has no tokenizer (token-id prompts only)
    max_model_len: int
    model_dir: Path
    ref: str | None = None  # NAME@VERSION when it came from the store through a deployment

    @property
    def version(self) -> str | None:
        return self.ref.partition("@")[2] if self.ref else None

    def decode(self, ids: list[int], stops: Collection[int]) -> str:
        """Text of `ids` up to the first of the request's stop ids (`RequestState.stop_ids`)."""
        from dlm.engine.tokenizer import decode

        return "" if self.tokenizer is None else decode(self.tokenizer, ids, stops)

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens spelt out); its id where there is no tokenizer."""
        return str(token) if self.tokenizer is None else str(self.tokenizer.decode([token]))

    def completion_ids(self, prefix: list[int], stops: Collection[int]) -> list[int]:
        """Generated ids that count as the completion: up to and including the first stop id."""
        return completion(prefix, stops)

    def describe(self) -> str:
        return self.ref or str(self.model_dir)
