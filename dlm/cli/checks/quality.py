"""Output-quality checks of `dlm validate` that hold for any dLLM server, trained model or not.

The contract checks prove the surface (shapes, streams, repeatability); these catch the
ways a dLLM server breaks the text itself: an answer that changes when other requests share
its batch, MASK or padding tokens leaking into text, and step counts no denoiser can produce.
They reuse the answers the contract checks already fetched (`ctx.facts`).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from dlm.cli.checks.contract import advertised, choices_body, completion_body
from dlm.cli.checks.runner import Check, CheckFailed, CheckSkipped, Context

# Prompts of other lengths sent beside the checked one, so a batching server batches them.
COMPANIONS = ("Hi.", "Count from one to twenty, slowly, in words.", "Name a colour.")
# MASK and padding tokens of the families dlm serves. Not U+FFFD or control characters: a
# byte-level model (random weights above all) may legitimately emit byte sequences that decode so.
LEAK = re.compile(r"<\|[^|<>]*(mask|pad)[^|<>]*\|>|\[MASK\]|\[PAD\]|<mask>|<pad>", re.IGNORECASE)
OVERLOADED = (429, 503)  # a full queue: the burst check judges how it is reported


def batch_invariance(ctx: Context) -> str:
    """The same request at temperature 0 alone and among concurrent others gives the same text."""
    alone = ctx.facts["completion"]["choices"][0]["text"]
    bodies = [completion_body(ctx)] + [completion_body(ctx, prompt=p) for p in COMPANIONS]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        responses = list(pool.map(lambda body: ctx.client.post("/v1/completions", body), bodies))
    if any(r.status_code in OVERLOADED for r in responses):
        raise CheckSkipped(f"the server turned away some of {len(bodies)} concurrent requests (its queue is full)")
    together = choices_body(responses[0], "/v1/completions")["choices"][0]["text"]
    if together != alone:
        raise CheckFailed(
            f"with {len(COMPANIONS)} concurrent requests the text differs from the answer alone: "
            f"{together[:60]!r} vs {alone[:60]!r}"
        )
    return f"same text alone and among {len(bodies)} concurrent requests"


def no_leaks(ctx: Context) -> str:
    """No MASK or padding token in the answers (a decoder that skips no special tokens, or a
    canvas position returned before it was unmasked)."""
    texts = {
        "completion": ctx.facts["completion"]["choices"][0]["text"],
        "chat": (ctx.facts.get("chat", {}).get("choices") or [{}])[0].get("message", {}).get("content") or "",
    }
    for what, text in texts.items():
        found = LEAK.search(text)
        if found:
            raise CheckFailed(f"the {what} answer holds {found.group(0)!r}: {text[:60]!r}")
    return "no MASK or padding token in the answers"


def plausible_steps(ctx: Context) -> str:
    """A denoiser commits at least one token per forward, so a request with default steps
    takes 1..max_tokens denoising steps (or, when the model's block layout needs more, no more
    than `steps=1` takes); a finished (`stop`) answer is shorter than max_tokens. A model that
    commits no token at a step (it refines whole canvases, so it offers no `logprobs`) is not
    bound by its tokens."""
    body = ctx.facts["completion"]
    usage, finish = body.get("usage") or {}, body["choices"][0].get("finish_reason")
    limit = ctx.options.max_tokens
    steps, tokens = usage.get("denoising_steps"), usage.get("completion_tokens")
    if not isinstance(steps, int) or steps < 1:
        raise CheckFailed(f"denoising_steps {steps} is not a positive count at default steps")
    if steps > limit:
        listed = advertised(ctx)
        if listed and "logprobs" not in listed:
            raise CheckSkipped(
                f"{steps} steps for {limit} tokens: the model commits no token at a step (it refines whole "
                "canvases; /v1/models lists no logprobs), so its steps are not bounded by its tokens"
            )
        response = ctx.client.post("/v1/completions", completion_body(ctx, steps=1))
        floor = (choices_body(response, "/v1/completions").get("usage") or {}).get("denoising_steps")
        if not isinstance(floor, int) or steps > floor:
            raise CheckFailed(
                f"denoising_steps {steps} outside 1..max_tokens ({limit}) at default steps "
                f"(and above the {floor} that steps=1 takes)"
            )
    if finish == "stop" and isinstance(tokens, int) and tokens >= limit:
        raise CheckFailed(f"finish_reason stop with {tokens} completion tokens, not fewer than max_tokens ({limit})")
    return f"{steps} steps for {limit} canvas tokens ({limit / steps:.2f} tokens per forward), finish {finish}"


QUALITY_CHECKS = [
    Check("batch_invariance", batch_invariance, ("completion",)),
    Check("no_leaks", no_leaks, ("completion",)),
    Check("plausible_steps", plausible_steps, ("usage",)),
]
