"""Request preparation off the event loop: parse, validate, size-check and tokenise a body,
then resolve its decoding parameters and build its sequences.

Tokenising a long prompt, rendering a chat template over thousands of messages, compiling a
response format's schema and laying its skeleton out (once for all `n` samples) take CPU,
seconds of it for hostile bodies. On the event loop that would stall every route, `/health`
and `/ready` included, so a liveness probe would restart a healthy server. Here that work
runs on a one-thread pool (`Preparer`) with a bounded backlog (and a share of it per API key,
so one key cannot fill it), and sizes are checked before any of it:
a prompt cannot fit in `max_model_len` tokens when it has more than `CHARS_PER_TOKEN`
characters per token of it, or more than one message per `TOKENS_PER_MESSAGE` tokens;
either is refused with a 400 `context_length_exceeded` before tokenising.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from dlm.cli.server import errors
from dlm.cli.server.body import parse_json
from dlm.cli.server.errors import APIError, bad_request, refusal_code
from dlm.cli.server.loaded import LoadedModel
from dlm.cli.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest
from dlm.engine.errors import UsageError
from dlm.engine.structured import format_object

if TYPE_CHECKING:
    from dlm.cli.server.service import Job, Service
    from dlm.engine.params import ResolvedParams
    from dlm.engine.runtime.request import RequestState

CHARS_PER_TOKEN = 32  # no tokenizer's token spans more characters in ordinary text
TOKENS_PER_MESSAGE = 2  # a chat template marks at least a message's role and its end
# One thread: chat templates are pure Python, so a second one takes GIL time from the event
# loop (measured /health p99 107 ms with two, 60 ms with one, under four abusive clients).
WORKERS = 1

Body = CompletionRequest | ChatRequest


@dataclass
class Prepared:
    """A validated generation body and its prompt, encoded by one served model version."""

    body: Body
    prompt_ids: list[int]
    prompt_text: str | None
    max_tokens: int | None
    tools: bool = False
    suffix_ids: tuple[int, ...] = ()  # infilling: what follows the answer
    echo: str | None = None  # a completion's `echo`: the prompt's text, answered before the completion
    params: ResolvedParams | None = None  # a generation request's, resolved for the served model
    seqs: list[RequestState] = field(default_factory=list)  # and its `n` sequences, built


class Preparer:
    """A bounded pool for request preparation: at most `backlog` bodies wait or run in it (the
    queue and a batch's worth: `max_queue + max_num_seqs`), and at most `share` of one API key
    (its share of the queue and a batch's worth); beyond that a request is refused with 429 at
    once, as the engine's queue does. Read from the settings at each request, as a reload
    leaves them."""

    def __init__(self) -> None:
        self.pending = 0
        self.by_key: Counter[str] = Counter()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="dlm-prepare")

    async def prepare(
        self,
        service: Service,
        raw: bytes,
        model: type[Body] | None,
        job: Job | None = None,
        key: str = "",
        *,
        build: bool = True,
    ) -> Prepared:
        """The body parsed and encoded by the model served when it is done: after a hot swap
        in between, it is encoded again with the new version's tokenizer. `model` None: a
        chat body when it has `messages`, else a completion body (`/tokenize`). With `job` (a
        generation request, whose key counts against its share), its options are read into
        it, its parameters resolved and its sequences built, all for that same version;
        `build` False (`/tokenize`): checked as they would be built, none built."""
        key = job.key if job is not None else key
        with self._admitted(service, key):
            loop = asyncio.get_running_loop()
            while True:
                served = service.served
                if served is None:
                    raise APIError(503, "the model is not loaded yet", type="unavailable", code="not_ready")
                prepared = await loop.run_in_executor(self._pool, _prepare, service, served, raw, model, job, build)
                if service.served is served:
                    return prepared
                for seq in prepared.seqs:  # built for the version a swap replaced
                    seq.finish("abort")

    @contextmanager
    def _admitted(self, service: Service, key: str) -> Iterator[None]:
        """One body of `key` counted in the pool while it waits or runs, within the backlog
        and the key's share; else 429 at once. Every body the pool takes is counted, or
        uncounted ones (`/detokenize`'s) queued ahead of those the bound was for."""
        cfg = service.config
        backlog = max(1, cfg.max_queue + cfg.max_num_seqs)
        share = max(1, min(service.queue_share() + cfg.max_num_seqs, backlog))
        if self.pending >= backlog or self.by_key[key] >= share:
            raise APIError(
                429,
                f"{self.pending} requests are being prepared; retry shortly",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.pending += 1
        self.by_key[key] += 1
        try:
            yield
        finally:
            self.pending -= 1
            self.by_key[key] -= 1
            if not self.by_key[key]:
                del self.by_key[key]

    async def detokenize(self, service: Service, raw: bytes, key: str = "") -> str:
        """`/detokenize`: token ids back to text with the served model's tokenizer, a body
        of `key` counted in the backlog as a generation body is."""
        with self._admitted(service, key):
            served = service.served
            if served is None:
                raise APIError(503, "the model is not loaded yet", type="unavailable", code="not_ready")
            return await asyncio.get_running_loop().run_in_executor(self._pool, _detokenize, service, served, raw)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _prepare(
    service: Service,
    served: LoadedModel,
    raw: bytes,
    model: type[Body] | None,
    job: Job | None = None,
    build: bool = True,
) -> Prepared:
    """In the contract's order: JSON, fields, supported options, model, then the prompt; for
    a generation request then its options, parameters and sequences (`build` False: the
    sequences' own checks, none built)."""
    data = parse_json(raw)
    if model is None:
        model = ChatRequest if "messages" in data else CompletionRequest
        if job is not None:  # `/tokenize` validating a body as the endpoint it would go to
            job.endpoint = "chat.completions" if model is ChatRequest else "completions"
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise errors.validation_error(list(exc.errors())) from None
    if body.response_format is not None:  # any JSON value the body takes: the engine's rule decides
        try:
            format_object(body.response_format)
        except UsageError as exc:
            raise bad_request(str(exc), param=exc.field, code=refusal_code(exc)) from None
    refused = body.unsupported()
    if refused is not None:
        raise bad_request(refused[1], param=refused[0], code="unsupported")
    service.check_model(body.model)
    prepared = _chat(served, body) if isinstance(body, ChatRequest) else _completion(served, body)
    if job is not None:
        job.prompt_ids, job.prompt_text, job.tools = prepared.prompt_ids, prepared.prompt_text, prepared.tools
        job.suffix_ids, job.echo = prepared.suffix_ids, prepared.echo
        _options(job, body)
        prepared.params = service.params(job, body, prepared.max_tokens, served)
        prepared.seqs = service.build(job, prepared.params, served, dry=not build)
    return prepared


def _options(job: Job, body: Body) -> None:
    job.stops = body.stop_strings()  # GenerationParams.stop too (`Service.params`), which the engine validates
    job.stream = bool(body.stream)  # null: the default, false
    job.include_usage = bool(body.stream_options and body.stream_options.include_usage)
    job.include_canvas = bool(body.stream_options and body.stream_options.include_canvas)
    job.continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    options = {"include_usage": job.include_usage, "include_canvas": job.include_canvas}
    options["continuous_usage_stats"] = job.continuous_usage
    for name, asked in options.items():  # as OpenAI: stream options need a stream
        if asked and not job.stream:
            raise bad_request(f"stream_options.{name} needs stream: true", param="stream_options", code="invalid_value")
    job.return_token_ids = bool(body.return_token_ids)
    if isinstance(body, ChatRequest) and body.parallel_tool_calls is False:
        job.most_tool_calls = 1


def _detokenize(service: Service, served: LoadedModel, raw: bytes) -> str:
    try:
        body = DetokenizeRequest.model_validate(parse_json(raw))
    except ValidationError as exc:
        raise errors.validation_error(list(exc.errors())) from None
    service.check_model(body.model)
    if served.tokenizer is None:
        raise bad_request("this model has no tokenizer", param="tokens", code="unsupported")
    vocab = served.engine.engine.config.logits_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens", code="invalid_value"
        )
    return str(served.tokenizer.decode(body.tokens))


def _completion(served: LoadedModel, body: CompletionRequest) -> Prepared:
    """A completion's prompt: text (one string) or token ids."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(
                "one prompt per request: send several requests (they are batched on the server)",
                param="prompt",
                code="unsupported",
            )
        prompt = prompt[0]
    suffix = tuple(_text_ids(served, body.suffix, "suffix")) if body.suffix else ()
    ids = _text_ids(served, prompt, "prompt")
    text = prompt if isinstance(prompt, str) else None
    echo = (
        (served.decode(ids, ()) if text is None else text) if body.echo else None
    )  # the prompt whole: no stop cuts it
    return Prepared(body, ids, text, body.max_tokens, suffix_ids=suffix, echo=echo)


def _text_ids(served: LoadedModel, text: str | list[int], param: str) -> list[int]:
    """A completion's text field as token ids (ids pass as they are), after the size check."""
    if not isinstance(text, str):
        return list(text)
    _fit(served, len(text), param, "characters", CHARS_PER_TOKEN)
    if served.tokenizer is None:
        raise bad_request(
            f"this model has no tokenizer: send the {param} as token ids", param=param, code="unsupported"
        )
    from dlm.engine.tokenizer import encode

    return encode(served.tokenizer, text)


def _chat(served: LoadedModel, body: ChatRequest) -> Prepared:
    """Render the chat template (with the tools, unless tool_choice is none); max tokens are
    max_completion_tokens, else the legacy max_tokens."""
    _fit(served, len(body.messages), "messages", "messages", 1 / TOKENS_PER_MESSAGE)
    messages = [m.for_template() for m in body.messages]
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    text = json.dumps(messages, ensure_ascii=False)
    extra = body.chat_template_kwargs or {}
    _fit(
        served,
        len(text) + len(json.dumps(tools or [])) + len(json.dumps(extra)),
        "messages",
        "characters",
        CHARS_PER_TOKEN,
    )
    if served.tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template", param="messages", code="unsupported")
    ids = _encode_chat(served.tokenizer, messages, tools, extra)
    return Prepared(body, ids, text, body.max_completion_tokens or body.max_tokens, tools is not None)


def _encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A template that fails on the client's messages or tools (a missing key, a wrong type:
    the template's own checks) is the client's 400, not a server error."""
    from dlm.engine.tokenizer import encode_chat

    try:
        return encode_chat(tokenizer, messages, tools, template_kwargs)
    except UsageError as exc:  # the messages, or chat_template_kwargs setting an argument of the call
        raise bad_request(str(exc), param=exc.field or "messages", code="invalid_value") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
        raise bad_request(
            f"the chat template cannot render these messages: {exc}", param="messages", code="invalid_value"
        ) from None


def _fit(served: LoadedModel, size: int, param: str, unit: str, per_token: float) -> None:
    """Refuse at once what cannot fit in the context, before any tokenising."""
    limit = int(served.max_model_len * per_token)
    if size > limit:
        raise bad_request(
            f"the {param} ({size} {unit}) cannot fit in the maximum context of {served.max_model_len} tokens "
            f"(at most {limit} {unit})",
            param=param,
            code="context_length_exceeded",
        )
