"""Checks of the request features a server advertises: `/v1/models` lists them per model
(`capabilities`, from the family record: dlm/engine/capabilities.py) and each one listed must
work as documented; one not listed is skipped. `PROBES` has one check per capability dlm
knows; a server advertising a capability with no probe here fails `capabilities`, so a new
capability cannot ship without its check.

Beyond plain decoding: infilling (`suffix`), committing-step `logprobs`, `n` seeded samples,
schema-shaped JSON (`response_format`: the answer parses and validates against the schema)
and canvas streaming (`include_canvas`: well-formed canvas events, one per step, with the
ordinary deltas unchanged beside them).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import jsonschema

from dlm.cli.checks.contract import (
    FINISH_REASONS,
    advertised,
    chat_body,
    choices_body,
    completion_body,
    consistent_usage,
    post_ok,
    refused_field,
)
from dlm.cli.checks.runner import Check, CheckFailed, CheckSkipped, Context
from dlm.cli.client.api import error_message
from dlm.engine.params import MODES

LOGPROBS_TOP = 2
N = 2
SEED = 1234


def capabilities(ctx: Context) -> str:
    listed = advertised(ctx)
    if not listed:
        raise CheckSkipped("/v1/models lists no capabilities")
    unknown = [c for c in listed if c not in PROBES]
    if unknown:
        raise CheckFailed(f"advertised capabilities with no check in this dlm: {', '.join(unknown)}")
    return ", ".join(listed)


def suffix(ctx: Context) -> str:
    """Infilling: a completion with a suffix answers a text choice (and the same one twice at
    temperature 0)."""
    body = completion_body(ctx, suffix=" That is the whole story.")
    first = post_ok(ctx, "/v1/completions", body)["choices"][0]
    again = post_ok(ctx, "/v1/completions", body)["choices"][0]
    if not isinstance(first.get("text"), str):
        raise CheckFailed("choices[0].text is not a string")
    if first["text"] != again["text"]:
        raise CheckFailed("the same infilling request at temperature 0 answered two different middles")
    return f"middle of {len(first['text'])} characters"


def _check_top(values: list[float], what: str) -> None:
    if values != sorted(values, reverse=True):
        raise CheckFailed(f"{what}: top alternatives are not sorted most likely first")
    if any(v > 1e-6 for v in values) or sum(math.exp(v) for v in values) > 1 + 1e-4:
        raise CheckFailed(f"{what}: log-probabilities above 0 or probabilities summing over 1")


def logprobs(ctx: Context) -> str:
    """Completion and chat logprobs: one per completion token, probabilities at most 1,
    alternatives sorted, the chosen token listed among the completion's alternatives."""
    body = post_ok(ctx, "/v1/completions", completion_body(ctx, logprobs=LOGPROBS_TOP))
    found: Any = body["choices"][0].get("logprobs")
    if not isinstance(found, dict) or not isinstance(found.get("token_logprobs"), list):
        raise CheckFailed("/v1/completions: choices[0].logprobs has no token_logprobs")
    tokens, values, tops = found["tokens"], found["token_logprobs"], found["top_logprobs"]
    completion_tokens = body.get("usage", {}).get("completion_tokens")
    if not len(tokens) == len(values) == len(tops) or len(values) > (completion_tokens or len(values)):
        raise CheckFailed("/v1/completions: tokens, token_logprobs and top_logprobs differ in length")
    for token, value, top in zip(tokens, values, tops):
        if value > 1e-6 or top.get(token) != value:
            raise CheckFailed(f"/v1/completions: token {token!r}: logprob {value} above 0 or not among its top")
        _check_top(sorted(top.values(), reverse=True), "/v1/completions")
    chat = post_ok(ctx, "/v1/chat/completions", chat_body(ctx, logprobs=True, top_logprobs=LOGPROBS_TOP))
    content = (chat["choices"][0].get("logprobs") or {}).get("content")
    if not isinstance(content, list) or not content:
        raise CheckFailed("/v1/chat/completions: choices[0].logprobs.content is empty")
    for entry in content:
        _check_top([t["logprob"] for t in entry["top_logprobs"]], "/v1/chat/completions")
        if len(entry["top_logprobs"]) > LOGPROBS_TOP or entry["logprob"] > 1e-6:
            raise CheckFailed("/v1/chat/completions: more alternatives than asked, or a logprob above 0")
    return f"{len(values)} completion and {len(content)} chat tokens"


def n(ctx: Context) -> str:
    """n seeded samples: choices 0..n-1, choice i equal to a request seeded seed + i. Sampled
    at temperature 1, or by the model's own sampler where it refuses `temperature` as
    unsupported (e.g. DiffusionGemma's entropy-bound sampler, which always samples)."""
    sampling: dict[str, Any] = {"temperature": 1.0, "seed": SEED}
    response = ctx.client.post("/v1/completions", completion_body(ctx, n=N, **sampling))
    if refused_field(response, {"temperature": 1.0}) is not None:
        sampling = {"seed": SEED}
        response = ctx.client.post("/v1/completions", completion_body(ctx, n=N, **sampling))
    body = choices_body(response, "/v1/completions")
    indices = [c.get("index") for c in body["choices"]]
    if indices != list(range(N)):
        raise CheckFailed(f"choice indices are {indices}, expected {list(range(N))}")
    alone = post_ok(ctx, "/v1/completions", completion_body(ctx, **{**sampling, "seed": SEED + 1}))
    if alone["choices"][0]["text"] != body["choices"][1]["text"]:
        raise CheckFailed(f"choice 1 differs from the same request seeded {SEED + 1}")
    return f"{N} choices, choice 1 equals seed {SEED + 1}"


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
    # the same request unstreamed (temperature 0): what the deltas beside the canvas must spell
    expected = post_ok(ctx, "/v1/chat/completions", chat_body(ctx))["choices"][0]["message"]["content"]
    if result.text != expected:
        raise CheckFailed(f"deltas beside the canvas differ from the answer: {result.text[:60]!r} vs {expected[:60]!r}")
    return f"{len(canvases)} canvas events, deltas equal the answer"


def decode_modes(ctx: Context) -> str:
    """Guide 003's dual-mode acceptance: the same prompt in every decoding mode answers 200 with
    a text of at least one token, a valid finish reason and usage that adds up; the detail
    gives each mode's steps and time, the throughput the guide compares."""
    found = []
    for mode in MODES:
        start = time.perf_counter()
        body = post_ok(ctx, "/v1/completions", completion_body(ctx, decode_mode=mode))
        seconds = time.perf_counter() - start
        choice = body["choices"][0]
        if not isinstance(choice.get("text"), str):
            raise CheckFailed(f"decode_mode {mode}: choices[0].text is not a string")
        if choice.get("finish_reason") not in FINISH_REASONS:
            raise CheckFailed(
                f"decode_mode {mode}: finish_reason {choice.get('finish_reason')!r} not in {FINISH_REASONS}"
            )
        try:
            consistent_usage(ctx, body.get("usage"))
        except CheckFailed as exc:
            raise CheckFailed(f"decode_mode {mode}: {exc}") from None
        used = body["usage"]
        found.append(f"{mode} {used['completion_tokens']} tokens in {used['denoising_steps']} steps, {seconds:.2f}s")
    return "; ".join(found)


# capability -> (its check, the checks it needs first)
PROBES: dict[str, tuple[Callable[[Context], str], tuple[str, ...]]] = {
    "suffix": (suffix, ("completion",)),
    "logprobs": (logprobs, ("completion",)),
    "n": (n, ("completion",)),
    "response_format": (structured_output, ("chat",)),
    "decode_mode": (decode_modes, ("completion", "usage")),
    "include_canvas": (canvas_stream, ("chat_stream",)),
}


def _probe(name: str, run: Callable[[Context], str]) -> Callable[[Context], str]:
    def check(ctx: Context) -> str:
        if name not in advertised(ctx):
            raise CheckSkipped(f"the server does not advertise {name}")
        return run(ctx)

    return check


CAPABILITY_CHECKS = [Check("capabilities", capabilities, ("models",))] + [
    Check(f"capability_{name}", _probe(name, run), needs) for name, (run, needs) in PROBES.items()
]
