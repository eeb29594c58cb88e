"""Service: what the HTTP routes share: the loaded model, the async engine, limits, keys,
metrics, readiness, and the one JSON log line per request.

Loading runs in a worker thread after the socket is open, so `/health` answers while the
weights load and `/ready` turns 200 only once a warm-up forward has run.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.async_engine import AsyncEngine, Draining, RequestStream
from engine.errors import DlmError, UsageError
from engine.params import GenerationParams
from engine.scheduler import QueueFull, SchedulerLimits
from engine.server.auth import KeyRing
from engine.server.config import ServeConfig
from engine.server.errors import APIError, bad_request
from engine.server.metrics import ServerMetrics
from engine.server.protocol import DiffusionFields
from engine.server.ratelimit import RateLimiter

log = logging.getLogger("dlm.server")
request_log = logging.getLogger("dlm.requests")

# The first word of an engine validation message names the field; the API calls some differently.
_PARAM = {"gen_length": "max_tokens", "mode": "decode_mode", "the": "prompt", "prompt": "prompt"}


@dataclass
class Job:
    """One inference request's bookkeeping, from arrival to its log line."""

    endpoint: str
    key: str = "-"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_ids: list[int] = field(default_factory=list)
    params: GenerationParams | None = None
    stops: list[str] = field(default_factory=list)
    tools: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    status: int = 200
    finish_reason: str | None = None
    completion_ids: list[int] = field(default_factory=list)
    steps: int = 0
    prompt_text: str | None = None
    output_text: str | None = None


class Service:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.keys = KeyRing(config.keys())
        self.limiter = RateLimiter(config.requests_per_minute, config.tokens_per_minute)
        self.model_name = config.served_model_name or _default_name(config.model)
        self.engine: AsyncEngine | None = None
        self.tokenizer: Any = None
        self.eos_id: int | None = None
        self.max_model_len = 0
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.exit_code = 1  # of the process, when loading fails (2: the model was bad usage)

    # ---- lifecycle ---------------------------------------------------------------------

    def load(self) -> None:
        """Load weights and tokenizer, warm up, start the engine loop (worker thread)."""
        try:
            self._load()
        except DlmError as exc:
            self.load_error, self.exit_code = str(exc), exc.exit_code
        except Exception as exc:  # surfaced by /health and the exit code, never swallowed
            log.exception("loading the model failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
        if self.load_error:
            log.error("error: %s", self.load_error)

    def _load(self) -> None:
        from engine.llm import LLM
        from engine.tokenizer import has_tokenizer

        cfg = self.config
        llm = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device)
        model_len = llm.config.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > model_len:
            raise UsageError(f"max_model_len ({cfg.max_model_len}) exceeds the model's maximum ({model_len})")
        if cfg.max_model_len is not None and cfg.max_model_len > cfg.max_num_batched_tokens:
            raise UsageError(
                f"max_model_len ({cfg.max_model_len}) exceeds max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}): such a request could never run"
            )
        self.max_model_len = cfg.max_model_len or min(model_len, cfg.max_num_batched_tokens)
        self.tokenizer = llm.tokenizer if has_tokenizer(llm.model_dir) else None
        self.eos_id = llm.config.eos_token_id
        limits = SchedulerLimits(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_queue)
        engine = AsyncEngine(llm.engine, limits, observer=self.metrics)
        if cfg.warmup:
            engine.warmup()
        engine.start()
        self.engine = engine
        self.metrics.bind(
            lambda: engine.num_running, lambda: engine.num_waiting,
            lambda: engine.batch_tokens / cfg.max_num_batched_tokens,
        )
        self.ready = True
        log.info("ready: model %s from %s (max_model_len %d)", self.model_name, llm.model_dir, self.max_model_len)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    @property
    def alive(self) -> bool:
        return self.load_error is None and (self.engine is None or self.engine.alive)

    # ---- admission ---------------------------------------------------------------------

    def admit(self, job: Job, authorization: str | None) -> AsyncEngine:
        """Authenticate, check readiness and the per-key request rate; the engine to use."""
        job.key = self.keys.identify(authorization)
        if self.draining:
            raise APIError(503, "the server is shutting down", type="unavailable", code="draining")
        if not self.ready or self.engine is None:
            raise APIError(503, "the model is not loaded yet", type="unavailable", code="not_ready")
        wait = self.limiter.check(job.key, "requests")
        if wait:
            raise _rate_limited(f"request rate limit ({self.config.requests_per_minute:g}/min) exceeded", wait)
        try:  # refuse overload before reading the body or tokenizing
            self.engine.scheduler.check_room()
        except QueueFull as exc:
            raise _queue_full(self.engine, exc) from None
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                type="not_found_error", param="model", code="model_not_found",
            )

    def params(self, job: Job, body: DiffusionFields, max_tokens: int | None,
               temperature: float | None, seed: int | None) -> GenerationParams:
        """The request's generation parameters, checked against the server's limits."""
        cfg = self.config
        gen = max_tokens or cfg.default_max_tokens or cfg.max_tokens
        if gen > cfg.max_tokens:
            raise bad_request(f"max_tokens ({gen}) exceeds this server's limit of {cfg.max_tokens}",
                              param="max_tokens", code="max_tokens_exceeded")
        if len(job.prompt_ids) + gen > self.max_model_len:
            raise bad_request(
                f"the prompt ({len(job.prompt_ids)} tokens) plus max_tokens ({gen}) exceeds the "
                f"maximum context of {self.max_model_len} tokens",
                param="messages" if job.endpoint == "chat.completions" else "prompt",
                code="context_length_exceeded",
            )
        if body.steps is not None and body.steps > cfg.max_steps:
            raise bad_request(f"steps ({body.steps}) exceeds this server's limit of {cfg.max_steps}",
                              param="steps", code="steps_exceeded")
        if cfg.tokens_per_minute and gen > cfg.tokens_per_minute:
            raise bad_request(f"max_tokens ({gen}) exceeds the per-key limit of "
                              f"{cfg.tokens_per_minute:g} tokens per minute", param="max_tokens")
        params = GenerationParams(
            gen_length=gen, steps=body.steps, block_length=body.block_length,
            remasking=body.remasking or "low_confidence", temperature=temperature or 0.0,
            cfg_scale=body.cfg_scale or 0.0, threshold=body.threshold, factor=body.factor, seed=seed,
            cache=body.cache or "none", mode=body.decode_mode or "diffusion",
        )
        assert self.engine is not None
        validate = self.engine.engine.validate  # the family's defaults and rules, as `dlm generate`
        try:
            resolved = validate(params, len(job.prompt_ids))
            if body.steps is None and resolved.steps is not None and resolved.steps > cfg.max_steps:
                # One token per step would exceed the limit: take the most steps within it
                # that still divide evenly over the blocks.
                blocks = max(1, resolved.num_blocks)
                params = replace(params, steps=max(blocks, cfg.max_steps // blocks * blocks))
                resolved = validate(params, len(job.prompt_ids))
        except UsageError as exc:
            word = str(exc).split()[0]
            raise bad_request(str(exc), param=_PARAM.get(word, word), code="invalid_value") from None
        if resolved.steps is not None and resolved.steps > cfg.max_steps:  # e.g. decode_mode ar
            raise bad_request(f"this request needs {resolved.steps} denoising steps, over this server's "
                              f"limit of {cfg.max_steps}", param="steps", code="steps_exceeded")
        return params

    def submit(self, engine: AsyncEngine, job: Job, params: GenerationParams) -> RequestStream:
        """Charge the token rate, then queue the request (429 at once when the queue is full)."""
        wait = self.limiter.check(job.key, "tokens", params.gen_length)
        if wait:
            raise _rate_limited(f"token rate limit ({self.config.tokens_per_minute:g}/min) exceeded", wait)
        job.params = params
        try:
            stream = engine.submit(
                job.id, job.prompt_ids, params, timeout=self.config.request_timeout,
                updates=job.stream or bool(job.stops),
            )
        except QueueFull as exc:
            raise _queue_full(engine, exc) from None
        except Draining as exc:
            raise APIError(503, str(exc), type="unavailable", code="draining") from None
        except UsageError as exc:
            raise bad_request(str(exc), code="invalid_value") from None
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        return stream

    # ---- text --------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        from engine.tokenizer import encode

        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as token ids", param="prompt")
            return encode(self.tokenizer, prompt)
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        from engine.tokenizer import encode_chat

        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer, so no chat template", param="messages")
        try:
            return encode_chat(self.tokenizer, messages, tools)
        except UsageError as exc:
            raise bad_request(str(exc), param="messages") from None

    def decode(self, ids: list[int]) -> str:
        from engine.tokenizer import decode

        return "" if self.tokenizer is None else decode(self.tokenizer, ids, self.eos_id)

    def completion_ids(self, prefix: list[int]) -> list[int]:
        """Generated ids that count as the completion: up to and including the first EOS."""
        if self.eos_id is not None and self.eos_id in prefix:
            return prefix[: prefix.index(self.eos_id) + 1]
        return prefix

    # ---- accounting --------------------------------------------------------------------

    def reject(self, job: Job, error: APIError) -> None:
        job.status = error.status
        self.metrics.rejections.labels(error.code or error.type).inc()
        self.record(job)

    def finish(self, job: Job, stream: RequestStream, finish_reason: str, status: int) -> None:
        """Metrics and the log line of a request the engine ran."""
        job.finish_reason, job.status, job.steps = finish_reason, status, stream.seq.nfe
        m = self.metrics
        req = stream.request
        if req.admitted is not None:
            m.queue_time.observe(req.admitted - req.arrival)
        m.steps.observe(job.steps)
        if finish_reason == "timeout":
            m.timeouts.inc()
        elif finish_reason == "abort":
            m.disconnects.inc()
        elif finish_reason in ("error", "shutdown"):
            m.failures.labels(finish_reason).inc()
        else:
            m.success.labels(finish_reason).inc()
            m.generation_tokens.inc(len(job.completion_ids))
            m.e2e.observe(time.monotonic() - job.arrival)
        self.record(job)

    def record(self, job: Job) -> None:
        """One JSON line per request; prompt and output text only with --log-prompts."""
        line: dict[str, Any] = {
            "event": "request", "id": job.id, "endpoint": job.endpoint, "key": job.key,
            "status": job.status, "latency_s": round(time.monotonic() - job.arrival, 4),
            "prompt_tokens": len(job.prompt_ids), "completion_tokens": len(job.completion_ids),
            "denoising_steps": job.steps, "finish_reason": job.finish_reason, "stream": job.stream,
        }
        if self.config.log_prompts:
            line["prompt"] = job.prompt_text
            line["output"] = job.output_text
        request_log.info(json.dumps(line, ensure_ascii=False))


def _rate_limited(message: str, wait: int) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(wait)})


def _queue_full(engine: AsyncEngine, exc: QueueFull) -> APIError:
    return APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(engine.retry_after())})


def _default_name(model: str | None) -> str:
    if model is None:
        from engine.default_model import NAME

        return NAME
    return Path(model).expanduser().resolve().name
