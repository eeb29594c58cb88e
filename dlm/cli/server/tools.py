"""Tool calls in the Qwen/Hermes style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The model writes tool calls as tagged JSON in its text; OpenAI clients expect them as
`message.tool_calls`. Blocks that are not valid JSON objects with a `name` stay in the
content untouched, so a malformed call is visible rather than silently dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split generated text into (the text without its valid tool-call blocks, tool_calls)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _to_call(match.group(1))
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept), calls


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
    the first `<tool_call>`, or up to a trailing partial `<tool_call` tag."""
    cut = text.find(OPEN)
    if cut >= 0:
        return text[:cut]
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return text[:-n]
    return text
