"""Stop strings: text that ends an answer, one rule for every entry point.

`dlm generate --stop`, `LLM.generate(stop=...)`, a server's `stop` field (and so `dlm batch`)
and a tensor-parallel model all apply the rule below, written once here because the engine
owns it (the server imports it; the engine never imports the server):

- The text searched is that of the committed prefix, the part of a diffusion canvas that can
  no longer change, up to its first stop id (EOS, stop_token_ids).
- The answer is cut where the first stop string starts (`stop_cut`). As in vLLM, a stop
  string ends the answer only once it has `min_tokens` tokens, and only where it ends after
  them. Its ids are the fewest that spell the text kept (`covering`).
- The request ends at the step whose committed prefix first holds a stop string
  (`ends_at_stop`, asked by the loop that steps the engine after every step that extends the
  prefix: `Engine.generate`, a server's `AsyncEngine`), so every entry point spends the same
  forwards, and its finish reason is "stop".

Bounds (`stop_strings`): every output of a request is searched for each string, and a
server's stream checks its end against each one's prefixes on its event loop, so a request
carries at most `MAX_STOP_STRINGS` strings of at most `MAX_STOP_CHARS` characters (50,000 in
a 1 MB body held a server's /health for up to a second per request). OpenAI takes 4; vLLM's
clients send a few more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dlm.engine.errors import Unsupported, UsageError

if TYPE_CHECKING:
    from dlm.engine.params import GenerationParams
    from dlm.engine.runtime.request import RequestState

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

TextOf = Callable[[list[int]], str]  # the text of generated ids (up to their first stop id)


def stop_strings(value: Any) -> tuple[str, ...] | None:
    """A request's stop strings (one string, or a list of them) as the tuple it carries, the
    empty ones dropped (they would end every answer at once; none left is None), within the
    bounds above; else UsageError naming the field `stop`."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise UsageError(f"stop must be a string or a list of strings, got {value!r}", field="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise UsageError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", field="stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise UsageError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {longest}", field="stop")
    return tuple(s for s in stops if s) or None


def require_text(stop: tuple[str, ...] | None, has_tokenizer: bool) -> None:
    """Stop strings are searched in the answer's text: a checkpoint without a tokenizer has
    none, so a request carrying them is refused (field `stop`) rather than never matched."""
    if stop and not has_tokenizer:
        raise Unsupported("stop strings need the checkpoint's tokenizer, which this model lacks", field="stop")


def find_stop(text: str, stops: Sequence[str], after: int = 0) -> int | None:
    """Where the first stop string starts among those ending past `after` characters."""
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stop_cut(text_of: TextOf, prefix: list[int], params: GenerationParams) -> tuple[str, int | None]:
    """The text of a committed `prefix` and where its first stop string (`params.stop`)
    starts (None: none yet): only once the prefix has `params.min_tokens` tokens, and only a
    stop string ending after them."""
    text = text_of(prefix)
    least = params.min_tokens
    if not params.stop or (least and len(prefix) < least):
        return text, None
    after = len(text_of(prefix[:least])) if least else 0
    return text, find_stop(text, params.stop, after)


def covering(text_of: TextOf, ids: list[int], chars: int, start: int = 0) -> int:
    """The fewest of `ids` (at least `start`) that spell `chars` characters, a partial UTF-8
    character at their end not counted: the tokens of a text cut at a stop string (the last
    may run past it); all of them if theirs is shorter. That length only grows with the
    tokens, so a binary search finds it in log2(len(ids)) decodings."""
    low, high = start, len(ids)
    while low < high:
        mid = (low + high) // 2
        if len(text_of(ids[:mid]).rstrip("\ufffd")) < chars:
            low = mid + 1
        else:
            high = mid
    return low


def ends_at_stop(
    text_of: Callable[[RequestState], TextOf],
) -> Callable[[RequestState], Callable[[list[int]], bool]]:
    """The rule by which a sequence's stop strings end it (`text_of(seq)`: the text of its
    ids), asked by the loop stepping the engine after every step: it reads the text only when
    the committed prefix has grown since it was last asked (a step that commits nothing
    cannot add a stop string), and the sequence then leaves the batch before the next forward."""

    def rule(seq: RequestState) -> Callable[[list[int]], bool]:
        text = text_of(seq)
        seen = 0  # the prefix length last asked about

        def holds(prefix: list[int]) -> bool:
            nonlocal seen
            if len(prefix) <= seen:
                return False
            seen = len(prefix)
            return stop_cut(text, prefix, seq.params)[1] is not None

        return holds

    return rule
