"""Tool calls in the Qwen/Hermes style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The model writes tool calls as tagged JSON in its text; OpenAI clients expect them as
`message.tool_calls`. Blocks that are not valid JSON objects with a `name` stay in the
content untouched, so a malformed call is visible rather than silently dropped.

Whitespace that touches a block taken as a call goes with it ("Sure. <tool_call>..." answers
"Sure."), and only that whitespace: a streamed answer sends its content before it can know
whether a call follows, so `streamable` holds back trailing whitespace, and the streamed and
the whole answer's content are the same text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def parse_tool_calls(text: str, most: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Split generated text into (the text without its valid tool-call blocks, tool_calls).
    At most `most` blocks become calls (1: the request's `parallel_tool_calls: false`); the
    blocks after them stay in the text, as written, rather than being dropped unseen. Text on
    both sides of a call is kept, a line apart."""
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []  # the text between the blocks taken
    last = 0
    for match in _BLOCK.finditer(text):
        if most is not None and len(calls) >= most:
            break
        call = _to_call(match.group(1))
        if call is None:
            continue
        pieces.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    if not calls:
        return text, calls
    pieces.append(text[last:])
    trimmed = [piece.lstrip() if i else piece for i, piece in enumerate(pieces)]
    trimmed = [piece.rstrip() if i < len(pieces) - 1 else piece for i, piece in enumerate(trimmed)]
    return "\n".join(piece for piece in trimmed if piece), calls


def _to_call(payload: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def streamable(text: str) -> str:
    """The part of `text` that can be streamed as content while tool calls may follow: up to
    the first `<tool_call>`, or up to a trailing partial `<tool_call` tag, less the whitespace
    before it (it goes with a call, if one follows)."""
    cut = text.find(OPEN)
    if cut >= 0:
        return text[:cut].rstrip()
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return text[:-n].rstrip()
    return text.rstrip()
