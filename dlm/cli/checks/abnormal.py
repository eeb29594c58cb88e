"""Abnormal-path checks: bad input, missing keys, tiny timeouts, bursts, and /metrics.

The promise under test is that a server answers every abuse with its documented status
(400/401/404/429 with an OpenAI error body, a client-side timeout) and never with a 5xx or
a hang, and that it keeps serving afterwards.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from dlm.cli.checks.contract import completion_body, post_ok
from dlm.cli.checks.runner import Check, CheckFailed, CheckSkipped, Context, expect_status
from dlm.cli.client.api import openai_error_problem
from dlm.cli.client.metrics import EXPECTED_METRICS, MetricsFormatError, missing_metrics

WORD = " sea"  # one token per repetition in common BPE vocabularies; measured, not assumed
# Over-long prompt for a server that advertises no context: longer than any served today.
UNADVERTISED_CONTEXT = 262_144


def expect_error(response: httpx.Response, expected: tuple[int, ...], what: str) -> None:
    """The answer must be one of the expected 4xx statuses with an OpenAI error body."""
    if response.status_code not in expected:
        raise CheckFailed(
            f"{what}: HTTP {response.status_code}, expected {' or '.join(map(str, expected))}: {response.text[:60]!r}"
        )
    problem = openai_error_problem(response)
    if problem:
        raise CheckFailed(f"{what}: {problem}")


def prompt_tokens(ctx: Context, words: int) -> int:
    body = post_ok(ctx, "/v1/completions", completion_body(ctx, prompt=WORD * words, max_tokens=1))
    return int(body["usage"]["prompt_tokens"])


def prompt_of_tokens(ctx: Context, tokens: int) -> str:
    """A prompt of about `tokens` tokens, from two measurements of the server's tokenizer."""
    if "prompt_line" not in ctx.facts:
        short, long_ = prompt_tokens(ctx, 4), prompt_tokens(ctx, 12)
        slope = (long_ - short) / 8
        if slope <= 0:
            raise CheckFailed("usage.prompt_tokens does not grow with the prompt")
        ctx.facts["prompt_line"] = (short - 4 * slope, slope)
    intercept, slope = ctx.facts["prompt_line"]
    return WORD * max(1, math.ceil((tokens - intercept) / slope))


def context_limit(ctx: Context) -> int | None:
    return ctx.options.min_context or ctx.max_context


def overlong_prompt(ctx: Context) -> str:
    """A prompt over the context gets 400 (or 413 from a body-size cap), not a 5xx."""
    limit = ctx.max_context or UNADVERTISED_CONTEXT
    body = completion_body(ctx, prompt=prompt_of_tokens(ctx, limit + 64))
    expect_error(ctx.client.post("/v1/completions", body), (400, 413), "prompt over the context")
    return f"prompt of ~{limit + 64} tokens rejected"


def context_window(ctx: Context) -> str:
    """A prompt that fills the advertised (or required) context must be served."""
    limit = context_limit(ctx)
    if limit is None:
        raise CheckSkipped("the server advertises no max_model_len; pass --min-context")
    if ctx.max_context is not None and limit > ctx.max_context:
        raise CheckFailed(f"the server's context is {ctx.max_context} tokens, less than the required {limit}")
    max_tokens = 4
    target = limit - max_tokens - 8
    response = ctx.client.post(
        "/v1/completions", completion_body(ctx, prompt=prompt_of_tokens(ctx, target), max_tokens=max_tokens)
    )
    expect_status(response, 200, f"prompt of ~{target} tokens within a context of {limit}")
    sent = response.json()["usage"]["prompt_tokens"]
    return f"served a {sent}-token prompt (context {limit})"


INVALID_REQUESTS: list[tuple[str, dict[str, Any] | bytes, tuple[int, ...]]] = [
    ("malformed JSON", b'{"model": ', (400,)),
    ("prompt missing", {"max_tokens": 4}, (400,)),
    ("max_tokens of the wrong type", {"max_tokens": "many"}, (400,)),
    ("max_tokens 0", {"max_tokens": 0}, (400,)),
    ("negative temperature", {"temperature": -1}, (400,)),
    ("steps 0", {"steps": 0}, (400,)),
    ("block_length 0", {"block_length": 0}, (400,)),
    ("unknown remasking", {"remasking": "sideways"}, (400,)),
    ("threshold above 1", {"threshold": 2.0}, (400,)),
    ("unknown cache", {"cache": "bogus"}, (400,)),
    ("unknown model", {"model": "no-such-model"}, (404,)),
]


def invalid_params(ctx: Context) -> str:
    problems = []
    for what, change, expected in INVALID_REQUESTS:
        if isinstance(change, bytes):
            response = ctx.client.post("/v1/completions", content=change)
        else:
            body = completion_body(ctx, **{"max_tokens": 4, **change})
            if what == "prompt missing":
                body.pop("prompt")
            response = ctx.client.post("/v1/completions", body)
        try:
            expect_error(response, expected, what)
        except CheckFailed as exc:
            problems.append(str(exc))
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckFailed(f"{len(problems)} of {len(INVALID_REQUESTS)} mishandled: " + "; ".join(problems[:3]) + more)
    return f"{len(INVALID_REQUESTS)} invalid requests rejected with 400/404 and an error body"


def key_rejected(ctx: Context, key: str | None, what: str) -> str:
    if not ctx.client.api_key:
        raise CheckSkipped("no --api-key given (a server without keys has nothing to check)")
    expect_error(ctx.client.get("/v1/models", key=key), (401,), f"/v1/models with {what}")
    expect_error(
        ctx.client.post("/v1/completions", completion_body(ctx), key=key), (401,), f"/v1/completions with {what}"
    )
    return f"{what}: 401 with an error body"


def missing_key(ctx: Context) -> str:
    return key_rejected(ctx, None, "no key")


def wrong_key(ctx: Context) -> str:
    return key_rejected(ctx, f"{ctx.client.api_key}-wrong", "a wrong key")


def client_timeout(ctx: Context) -> str:
    """A client that gives up almost at once must not hurt the server."""
    tiny = httpx.Timeout(ctx.client.timeout, read=ctx.options.client_timeout)
    body = completion_body(ctx, max_tokens=64, stream=True)
    try:
        with ctx.client.http.stream(
            "POST", "/v1/completions", json=body, headers=ctx.client.headers(), timeout=tiny
        ) as response:
            if response.status_code >= 500:
                raise CheckFailed(f"HTTP {response.status_code} before the client timed out")
            for _ in response.iter_lines():
                pass
        outcome = "the request finished before the client's timeout"
    except httpx.ReadTimeout:
        outcome = f"client gave up after {ctx.options.client_timeout * 1000:g} ms"
    expect_status(ctx.client.get("/health", key=False), 200, "/health after the timeout")
    post_ok(ctx, "/v1/completions", completion_body(ctx, max_tokens=4))
    return f"{outcome}; the server still serves"


def burst(ctx: Context) -> str:
    """More concurrent requests than the queue holds: each gets 200 or 429 with Retry-After."""
    n = ctx.options.burst
    body = completion_body(ctx, max_tokens=8)

    def one(_: int) -> tuple[int, str | None, str | None]:
        try:
            response = ctx.client.post("/v1/completions", body)
        except httpx.TimeoutException:
            return -1, None, "no answer within the client timeout"
        problem = openai_error_problem(response) if response.status_code != 200 else None
        return response.status_code, response.headers.get("retry-after"), problem

    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(one, range(n)))
    statuses = [s for s, _, _ in answers]
    hung = statuses.count(-1)
    bad = sorted({s for s in statuses if s not in (200, 429, -1)})
    no_retry = sum(1 for s, retry, _ in answers if s == 429 and not retry)
    problems = [p for s, _, p in answers if s == 429 and p]
    counts = f"{statuses.count(200)} ok, {statuses.count(429)} rejected with 429"
    if hung or bad or no_retry or problems:
        raise CheckFailed(
            f"{n} concurrent requests: {counts}, {hung} hung, other statuses {bad}, "
            f"{no_retry} 429s without Retry-After" + (f"; {problems[0]}" if problems else "")
        )
    return f"{n} concurrent requests: {counts}"


def metrics(ctx: Context) -> str:
    response = ctx.client.get("/metrics")
    if response.status_code == 403:  # a server of several tenants keeps them to its admin key
        raise CheckSkipped("/metrics answers 403 to this API key: the server keeps it to its operator")
    expect_status(response, 200, "/metrics")
    try:
        missing = missing_metrics(response.text)
    except MetricsFormatError as exc:
        raise CheckFailed(str(exc)) from None
    if missing:
        raise CheckFailed(f"/metrics lacks {', '.join(missing)}")
    return f"all {len(EXPECTED_METRICS)} expected metric names present"


ABNORMAL_CHECKS = [
    Check("context_window", context_window, ("completion",)),
    Check("overlong_prompt", overlong_prompt, ("completion",)),
    Check("invalid_params", invalid_params, ("models",)),
    Check("missing_key", missing_key, ("models",)),
    Check("wrong_key", wrong_key, ("models",)),
    Check("client_timeout", client_timeout, ("completion",)),
    Check("burst", burst, ("completion",)),
    Check("metrics", metrics, ("auth",)),
]
