"""The checks of `dlm validate` for what only a diffusion server offers: schema-shaped JSON
(`response_format`) and canvas streaming (`stream_options.include_canvas`).

A server that refuses a capability as unsupported (a block-causal family, another server
altogether) skips its check; one that accepts it must keep its promise: the answer parses
and validates against the schema, and the canvas events are well-formed, one per step, with
the ordinary deltas unchanged beside them.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from dlm_cli.checks.contract import chat_body, choices_body, refused_field
from dlm_cli.checks.runner import Check, CheckFailed, CheckSkipped, Context
from dlm_cli.client.api import error_message

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age"],
}
SCHEMA_TOKENS = 64  # max_tokens of the check: the skeleton above needs about 40
STATES = ("committed", "provisional", "masked")


def structured_output(ctx: Context) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    body = chat_body(ctx, max_tokens=SCHEMA_TOKENS, response_format=fmt)
    response = ctx.client.post("/v1/chat/completions", body)
    if refused_field(response, {"response_format": fmt}) is not None:
        raise CheckSkipped(f"the server refuses response_format as unsupported: {error_message(response)}")
    content = choices_body(response, "/v1/chat/completions")["choices"][0].get("message", {}).get("content")
    try:
        jsonschema.validate(json.loads(content), SCHEMA)
    except (TypeError, ValueError, jsonschema.ValidationError) as exc:
        raise CheckFailed(f"the answer does not validate against the schema: {content!r:.80} ({exc})") from None
    return f"{content!r:.60} validates"


def canvas_stream(ctx: Context) -> str:
    body = {**chat_body(ctx), "stream_options": {"include_canvas": True}}
    result = ctx.client.stream("/v1/chat/completions", body, keep_events=True)
    if result.status != 200 or result.error:
        raise CheckFailed(f"canvas stream: HTTP {result.status}: {result.error}")
    canvases = [e["canvas"] for e in result.events if str(e.get("object", "")).endswith(".canvas")]
    if not canvases:
        raise CheckSkipped("the server sent no canvas events (it does not offer canvas streaming)")
    steps = [c.get("step") for c in canvases]
    if steps != sorted(set(steps)):
        raise CheckFailed(f"canvas steps are not one per denoising step: {steps[:10]}")
    for canvas in canvases:
        for token in canvas.get("tokens", []):
            if token.get("state") not in STATES or (token.get("id") is None) != (token.get("state") == "masked"):
                raise CheckFailed(f"malformed canvas token {token}")
    if any(t.get("state") != "committed" for t in canvases[-1].get("tokens", [])):
        raise CheckFailed("the last canvas event still has uncommitted positions")
    expected = ctx.facts["chat"]["choices"][0]["message"]["content"]
    if result.text != expected:
        raise CheckFailed(f"deltas beside the canvas differ from the answer: {result.text[:60]!r} vs {expected[:60]!r}")
    return f"{len(canvases)} canvas events, deltas equal the answer"


CAPABILITY_CHECKS = [
    Check("structured_output", structured_output, ("chat",)),
    Check("canvas_stream", canvas_stream, ("chat_stream",)),
]
