"""The contract checks of `dlm validate`: readiness, the OpenAI surface, dLLM parameters.

Each check states one promise of the HTTP contract (design.md section 4 plus OpenAI's) and
fails with a message naming what the server did instead. The abnormal-path checks live in
`dlm.cli.checks.abnormal`; the user's expectations in `dlm.cli.checks.suite`.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from dlm.cli.checks.runner import Check, CheckFailed, CheckSkipped, Context, expect_status, json_body
from dlm.cli.client.api import StreamResult, error_message, model_cards, tls_failure
from dlm.engine.errors import DlmError

PROMPT = "Write one sentence about the sea."
FINISH_REASONS = ("stop", "length")
# A commit threshold no token's confidence can fall below (the top probability over a
# vocabulary of V tokens is at least 1/V), so each block is decoded in one step.
TINY_THRESHOLD = 1e-9
DLLM_TOKENS = 16  # max_tokens of the dLLM-parameter checks
# More steps than a 16-token answer's blocks have positions, whatever the block grid: one
# token per step, so every block spends more forwards than its least.
MANY_STEPS = 4 * DLLM_TOKENS
# The dLLM fields the checks send with max_tokens DLLM_TOKENS, each set a request of its own
# (tests/test_any_length.py sends every one to every family at every length).
LEAST = {"steps": 1}
FEW = {"steps": 2}
MANY = {"steps": MANY_STEPS}
FAST = {"threshold": TINY_THRESHOLD}
SMALL_BLOCKS = {"block_length": 4, "threshold": TINY_THRESHOLD}
LARGE_BLOCKS = {"block_length": 8, "threshold": TINY_THRESHOLD}
SMALL_BLOCKS_LEAST = {"block_length": 4, "steps": 1}
DLLM_REQUESTS = (LEAST, FEW, MANY, FAST, SMALL_BLOCKS, LARGE_BLOCKS, SMALL_BLOCKS_LEAST)


def readiness(ctx: Context) -> str:
    """Poll /ready until 200; 503 and refused connections mean 'still starting'."""
    start = time.perf_counter()
    deadline = start + ctx.options.ready_timeout
    last = "no answer"
    waited = False
    while True:
        try:
            response = ctx.client.get("/ready", key=False, timeout=5.0)
            if response.status_code == 200:
                return f"ready after {time.perf_counter() - start:.1f}s"
            if response.status_code != 503:
                expect_status(response, 200, "/ready")
            last = "HTTP 503"
        except httpx.TransportError as exc:
            failure = tls_failure(exc)
            if failure is not None:  # waiting will not fix a certificate: say so now
                raise CheckFailed(
                    f"TLS with {ctx.client.base_url} failed ({failure}); pass --cacert FILE (the server's CA) "
                    "or --insecure"
                ) from None
            last = type(exc).__name__
        if not waited:  # said once: a server still starting and a wrong URL look alike for a while
            waited = True
            ctx.note(
                f"{ctx.client.base_url}/ready: {last}; waiting up to {ctx.options.ready_timeout:g}s (--ready-timeout)"
            )
        if time.perf_counter() >= deadline:
            raise CheckFailed(f"not ready within {ctx.options.ready_timeout:g}s (last: {last})")
        time.sleep(0.25)


def liveness(ctx: Context) -> str:
    expect_status(ctx.client.get("/health", key=False), 200, "/health")
    return "/health answered 200"


def auth(ctx: Context) -> str:
    """The given key (or no key) must open /v1/models; a keyed server must say so with 401."""
    response = ctx.client.get("/v1/models")
    if response.status_code == 401:
        if ctx.client.api_key:
            raise CheckFailed("the server rejected the API key (401)")
        raise CheckFailed("the server requires an API key (401): pass --api-key")
    expect_status(response, 200, "/v1/models")
    return "key accepted" if ctx.client.api_key else "server needs no key"


def models(ctx: Context) -> str:
    body = json_body(ctx.client.get("/v1/models"), "/v1/models")
    try:
        data = model_cards(body, "/v1/models")
    except DlmError as exc:
        raise CheckFailed(str(exc)) from None
    if not data or body.get("object") != "list":
        raise CheckFailed(f"/v1/models is not a non-empty OpenAI list: {str(body)[:120]}")
    if not all(m.get("object") == "model" for m in data):
        raise CheckFailed("every /v1/models entry needs object 'model'")
    ids: list[str] = [m["id"] for m in data]
    wanted = ctx.options.model or ids[0]
    if wanted not in ids:
        raise CheckFailed(f"model {wanted!r} is not served (served: {', '.join(ids)})")
    ctx.model = wanted
    entry = data[ids.index(wanted)]
    if isinstance(entry.get("max_model_len"), int):
        ctx.max_context = entry["max_model_len"]
    context = f", context {ctx.max_context}" if ctx.max_context else ""
    return f"{len(ids)} model(s); using {wanted!r}{context}"


def completion_body(ctx: Context, **fields: Any) -> dict[str, Any]:
    return {"model": ctx.model, "prompt": PROMPT, "max_tokens": ctx.options.max_tokens, "temperature": 0, **fields}


def chat_body(ctx: Context, **fields: Any) -> dict[str, Any]:
    return {
        "model": ctx.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": ctx.options.max_tokens,
        "temperature": 0,
        **fields,
    }


def post_ok(ctx: Context, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return choices_body(ctx.client.post(path, body), path)


def choices_body(response: httpx.Response, path: str) -> dict[str, Any]:
    """The 200 JSON body of a generation request, with at least one choice."""
    expect_status(response, 200, path)
    result = json_body(response, path)
    if not isinstance(result, dict) or not result.get("choices"):
        raise CheckFailed(f"{path}: no choices in {str(result)[:120]}")
    return result


def completion(ctx: Context) -> str:
    body = post_ok(ctx, "/v1/completions", completion_body(ctx))
    if body.get("object") != "text_completion":
        raise CheckFailed(f"object is {body.get('object')!r}, not 'text_completion'")
    choice = body["choices"][0]
    if not isinstance(choice.get("text"), str):
        raise CheckFailed("choices[0].text is not a string")
    if choice.get("finish_reason") not in FINISH_REASONS:
        raise CheckFailed(f"finish_reason {choice.get('finish_reason')!r} not in {FINISH_REASONS}")
    ctx.facts["completion"] = body
    return f"{body.get('usage', {}).get('completion_tokens', '?')} tokens, finish {choice['finish_reason']}"


def usage(ctx: Context) -> str:
    return consistent_usage(ctx, ctx.facts["completion"].get("usage"))


def consistent_usage(ctx: Context, found: Any) -> str:
    """Token counts add up, stay within max_tokens, and the dLLM's step count is reported."""
    if not isinstance(found, dict):
        raise CheckFailed("the completion has no usage object")
    fields = ("prompt_tokens", "completion_tokens", "total_tokens", "denoising_steps")
    bad = [f for f in fields if not isinstance(found.get(f), int) or found[f] < 0]
    if bad:
        raise CheckFailed(f"usage lacks non-negative integer(s): {', '.join(bad)} ({found})")
    if found["prompt_tokens"] < 1:
        raise CheckFailed("usage.prompt_tokens is 0 for a non-empty prompt")
    if not 1 <= found["completion_tokens"] <= ctx.options.max_tokens:
        raise CheckFailed(
            f"completion_tokens {found['completion_tokens']} outside 1..max_tokens ({ctx.options.max_tokens})"
        )
    if found["total_tokens"] != found["prompt_tokens"] + found["completion_tokens"]:
        raise CheckFailed(f"total_tokens {found['total_tokens']} != prompt + completion tokens")
    if found["denoising_steps"] < 1:
        raise CheckFailed("usage.denoising_steps is 0 for a generated completion")
    return ", ".join(f"{f}={found[f]}" for f in fields)


def stream_matches(ctx: Context, path: str, body: dict[str, Any], expected_text: str, expected_object: str) -> str:
    """A stream must be well-formed SSE ending in [DONE], and its deltas add up to the text."""
    result: StreamResult = ctx.client.stream(
        path, {**body, "stream_options": {"include_usage": True}}, keep_events=True
    )
    if result.status != 200:
        raise CheckFailed(f"{path} stream: HTTP {result.status}: {result.error}")
    if result.error:
        raise CheckFailed(f"{path} stream: {result.error}")
    objects = {e.get("object") for e in result.events if e.get("choices")}
    if objects != {expected_object}:
        raise CheckFailed(f"chunk objects are {sorted(map(str, objects))}, expected {expected_object!r}")
    if result.text != expected_text:
        raise CheckFailed(
            f"concatenated deltas differ from the non-streaming text at temperature 0: "
            f"{result.text[:60]!r} vs {expected_text[:60]!r}"
        )
    if result.finish_reason not in FINISH_REASONS:
        raise CheckFailed(f"no chunk carried a finish_reason in {FINISH_REASONS}")
    if result.usage is None:
        raise CheckFailed("no usage chunk although stream_options.include_usage was set")
    return f"{result.chunks} chunks, first text after {(result.ttft or 0) * 1000:.0f} ms, [DONE] seen"


def completion_stream(ctx: Context) -> str:
    text = ctx.facts["completion"]["choices"][0]["text"]
    return stream_matches(ctx, "/v1/completions", completion_body(ctx), text, "text_completion")


def chat(ctx: Context) -> str:
    body = post_ok(ctx, "/v1/chat/completions", chat_body(ctx))
    if body.get("object") != "chat.completion":
        raise CheckFailed(f"object is {body.get('object')!r}, not 'chat.completion'")
    message = body["choices"][0].get("message") or {}
    if message.get("role") != "assistant" or not isinstance(message.get("content"), str):
        raise CheckFailed(f"choices[0].message is not an assistant text message: {str(message)[:120]}")
    ctx.facts["chat"] = body
    return f"{len(message['content'])} characters"


def chat_stream(ctx: Context) -> str:
    text = ctx.facts["chat"]["choices"][0]["message"]["content"]
    return stream_matches(ctx, "/v1/chat/completions", chat_body(ctx), text, "chat.completion.chunk")


def determinism(ctx: Context) -> str:
    first = ctx.facts["completion"]["choices"][0]["text"]
    for attempt in (2, 3):
        again = post_ok(ctx, "/v1/completions", completion_body(ctx))["choices"][0]["text"]
        if again != first:
            raise CheckFailed(
                f"request {attempt} at temperature 0 gave different text: {again[:60]!r} vs {first[:60]!r}"
            )
    return "3 identical answers at temperature 0"


def advertised(ctx: Context) -> list[str]:
    """The capabilities /v1/models lists for the model under test (cached in the context)."""
    if "capabilities" not in ctx.facts:
        body = json_body(ctx.client.get("/v1/models"), "/v1/models")
        entry = next((m for m in body.get("data", []) if isinstance(m, dict) and m.get("id") == ctx.model), {})
        found = entry.get("capabilities")
        ctx.facts["capabilities"] = [c for c in found if isinstance(c, str)] if isinstance(found, list) else []
    return list(ctx.facts["capabilities"])


def refused_field(response: httpx.Response, fields: dict[str, Any]) -> str | None:
    """The field a 400 `unsupported` error names, when it is one of `fields`: the server says
    it cannot honour it (e.g. a model decoding with its own generate method), rather than
    ignoring it. Anything else, a bad status included, is left to the caller to judge."""
    if response.status_code != 400:
        return None
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(error, dict) and error.get("code") == "unsupported" and error.get("param") in fields:
        return str(error["param"])
    return None


def denoising(ctx: Context, **fields: Any) -> tuple[int, str]:
    """(usage.denoising_steps, finish_reason) of a 16-token completion with these dLLM fields.
    Skips the calling check when the server refuses one of the fields as unsupported."""
    key = tuple(sorted(fields.items()))
    cache = ctx.facts.setdefault("denoising", {})
    if key not in cache:
        # A model that decodes either way may be served with --decode-mode ar, which refuses
        # these fields: they are asked of its diffusion mode, which takes them.
        mode = {"decode_mode": "diffusion"} if "decode_mode" in advertised(ctx) else {}
        body = completion_body(ctx, max_tokens=DLLM_TOKENS, **mode, **fields)
        response = ctx.client.post("/v1/completions", body)
        refused = refused_field(response, fields)
        if refused is not None:
            raise CheckSkipped(f"the server refuses {refused} as unsupported: {error_message(response)}")
        body = choices_body(response, "/v1/completions")
        steps = (body.get("usage") or {}).get("denoising_steps")
        if not isinstance(steps, int):
            raise CheckFailed("usage.denoising_steps is missing")
        cache[key] = (steps, body["choices"][0].get("finish_reason"))
    return cache[key]


def steps(ctx: Context) -> str:
    """More requested steps must spend more forwards, and no more than requested beyond what
    `steps=1` spends (a server's least: one step per block at least, plus the forwards a
    model spends on a block besides its steps, e.g. a commit pass): each further step asked
    for costs at most one forward."""
    floor, _ = denoising(ctx, **LEAST)
    low, _ = denoising(ctx, **FEW)
    high, high_finish = denoising(ctx, **MANY)
    if low > floor + 1:
        raise CheckFailed(f"steps=2 spent {low} denoising steps, more than one beyond steps=1 ({floor})")
    if high > floor + MANY_STEPS - 1:
        raise CheckFailed(f"steps={MANY_STEPS} spent {high} denoising steps (steps=1: {floor})")
    if low >= high and high_finish != "stop":
        raise CheckFailed(f"steps=2 spent {low} steps, not fewer than steps={MANY_STEPS} ({high})")
    return f"steps=1 -> {floor}, steps=2 -> {low}, steps={MANY_STEPS} -> {high} denoising steps"


def threshold(ctx: Context) -> str:
    """A threshold below every confidence commits a whole block (sub-block) per step: no more
    forwards than `steps=1` (the server's least), fewer than a step per token."""
    floor, _ = denoising(ctx, **LEAST)
    full, full_finish = denoising(ctx, **MANY)
    fast, _ = denoising(ctx, **FAST)
    if fast > floor:
        raise CheckFailed(
            f"threshold={TINY_THRESHOLD:g} spent {fast} steps, more than one per block (steps=1 spends {floor})"
        )
    if fast >= full and full_finish != "stop":
        raise CheckFailed(f"threshold did not lower denoising steps ({fast} vs {full} at steps={MANY_STEPS})")
    return f"threshold={TINY_THRESHOLD:g} -> {fast} steps (vs {full} at steps={MANY_STEPS})"


def block_length(ctx: Context) -> str:
    """With one step per block, the step count reveals the block length the server used:
    blocks of 4 take more of them than blocks of 8."""
    small, small_finish = denoising(ctx, **SMALL_BLOCKS)
    large, large_finish = denoising(ctx, **LARGE_BLOCKS)
    floor, _ = denoising(ctx, **SMALL_BLOCKS_LEAST)
    if small > floor:
        raise CheckFailed(f"block_length=4 spent {small} steps, more than one per block (steps=1 spends {floor})")
    stopped = "stop" in (small_finish, large_finish)
    if small <= large and not stopped:
        raise CheckFailed(f"block_length had no effect: 4 -> {small} steps, 8 -> {large} steps")
    return f"block_length=4 -> {small} steps, 8 -> {large} steps (one per block)"


CONTRACT_CHECKS = [
    Check("readiness", readiness),
    Check("liveness", liveness, ("readiness",)),
    Check("auth", auth, ("readiness",)),
    Check("models", models, ("auth",)),
    Check("completion", completion, ("models",)),
    Check("usage", usage, ("completion",)),
    Check("completion_stream", completion_stream, ("completion",)),
    Check("chat", chat, ("models",)),
    Check("chat_stream", chat_stream, ("chat",)),
    Check("determinism", determinism, ("completion",)),
    Check("steps", steps, ("completion",)),
    Check("threshold", threshold, ("completion",)),
    Check("block_length", block_length, ("completion",)),
]
