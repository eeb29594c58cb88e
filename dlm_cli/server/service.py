"""Service: what the HTTP routes share: the loaded model, the async engine, limits, keys,
metrics, readiness, and the one JSON log line per request.

Loading runs in a worker thread after the socket is open, so `/health` answers while the
weights load and `/ready` turns 200 only once a warm-up forward has run.

The served model is one `LoadedModel` that a hot swap (dlm_cli/server/hotswap.py) replaces
on the event loop. A request handler reads the tokenizer, limits and engine of
`self.served` from encoding its prompt to `submit()` without awaiting in between, so
all three belong to one version, and the request keeps that version (`Job.served`) to the end.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlm_cli.server.auth import KeyRing
from dlm_cli.server.config import ServeConfig
from dlm_cli.server.errors import APIError, bad_request
from dlm_cli.server.loaded import LoadedModel
from dlm_cli.server.metrics import ServerMetrics
from dlm_cli.server.protocol import DiffusionFields
from dlm_cli.server.ratelimit import RateLimiter
from engine.errors import DlmError, EngineFailed, Unsupported, UsageError
from engine.params import GenerationParams
from engine.runtime.async_engine import AsyncEngine, Draining, RequestStream
from engine.runtime.scheduler import QueueFull, SchedulerLimits

if TYPE_CHECKING:
    from engine.llm import LLM

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
    served: LoadedModel | None = None  # the model version the request was submitted to


class Service:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.keys = KeyRing(config.keys())
        self.limiter = RateLimiter(config.requests_per_minute, config.tokens_per_minute)
        self.model_name = config.served_model_name or _default_name(config)
        self.served: LoadedModel | None = None
        self.retiring: list[LoadedModel] = []  # replaced by a hot swap, finishing their requests
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        # a deployment's checkpoint and NAME@VERSION, read as the admin endpoint registers
        self.pinned: tuple[str, str] | None = None
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
        model, ref = self.initial_checkpoint()
        self.served = self.open(model, ref, warmup=self.config.warmup)
        self.metrics.bind(
            lambda: sum(m.engine.num_running for m in self.loaded()),
            lambda: sum(m.engine.num_waiting for m in self.loaded()),
            lambda: sum(m.engine.batch_tokens for m in self.loaded()) / self.config.max_num_batched_tokens,
            lambda: sum(m.engine.cache_bytes for m in self.loaded()),
        )
        self.ready = True
        log.info(
            "ready: model %s from %s (max_model_len %d)",
            self.model_name,
            self.served.describe(),
            self.served.max_model_len,
        )

    def initial_checkpoint(self) -> tuple[str | None, str | None]:
        """What to load at start: MODEL, or the deployment's current release (read when the
        admin endpoint registered, in one store transaction, so a release made since reaches
        this server as a hot swap once it has loaded)."""
        if self.config.deployment is None:
            from dlm_cli.store.resolve import resolve_model

            return str(resolve_model(self.config.model)), None
        if self.pinned is None:
            raise DlmError(f"deployment {self.config.deployment}: the admin endpoint did not register")
        return self.pinned

    def open(self, model: str | None, ref: str | None, *, warmup: bool) -> LoadedModel:
        """Load a checkpoint, check it against the limits, warm it up and start its engine loop."""
        from engine.llm import LLM

        cfg = self.config
        llm = LLM(
            model,
            dtype=cfg.dtype,
            device=cfg.device,
            backend=cfg.backend,
            trust_remote_code=cfg.trust_remote_code,
            parallel=cfg.parallel(),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
        )
        if cfg.gpu_memory_utilization is not None and not llm.memory_capped:
            log.warning("gpu_memory_utilization applies to CUDA devices only: %s is not capped", llm.device)
        try:
            return self._serve(llm, ref, warmup)
        except BaseException:
            llm.close()  # a tensor-parallel model stops its ranks
            raise

    def _serve(self, llm: LLM, ref: str | None, warmup: bool) -> LoadedModel:
        from engine.tokenizer import has_tokenizer

        cfg = self.config
        model_len = llm.config.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > model_len:
            raise UsageError(f"max_model_len ({cfg.max_model_len}) exceeds the model's maximum ({model_len})")
        if cfg.max_model_len is not None and cfg.max_model_len > cfg.max_num_batched_tokens:
            raise UsageError(
                f"max_model_len ({cfg.max_model_len}) exceeds max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}): such a request could never run"
            )
        max_model_len = cfg.max_model_len or min(model_len, cfg.max_num_batched_tokens)
        tokenizer = llm.tokenizer if has_tokenizer(llm.model_dir) else None
        limits = SchedulerLimits(self._max_num_seqs(llm.engine), cfg.max_num_batched_tokens, cfg.max_queue)
        engine = AsyncEngine(llm.engine, limits, observer=self.metrics)
        ranks = getattr(llm.engine, "tensor_parallel_size", 1)
        if ranks > 1:  # rank 0 schedules; a rank that dies fails the engine at once, even idle
            llm.engine.on_failure(engine.fail)
            log.info("tensor parallel: %d ranks ready", ranks)
        if warmup:
            engine.warmup()
        engine.start()
        return LoadedModel(engine, tokenizer, llm.config.eos_token_id, max_model_len, llm.model_dir, ref)

    def loaded(self) -> list[LoadedModel]:
        """Every model whose engine loop may still hold requests."""
        return ([self.served] if self.served is not None else []) + self.retiring

    def _max_num_seqs(self, engine: Any) -> int:
        """The batch bound, after saying which transformers-backend path serves the model and
        what it costs; the generate path decodes one request at a time."""
        path = getattr(engine, "path", None)
        if path is None:
            return self.config.max_num_seqs
        from engine.transformers_backend import GENERATE_SERVING_COSTS, PATHS

        log.info("transformers backend, %s path: %s", path, PATHS[path])
        if path == "forward":
            return self.config.max_num_seqs
        log.info("generate path serving: %s", GENERATE_SERVING_COSTS)
        return 1

    def shutdown(self) -> None:
        for model in self.loaded():
            model.engine.stop()

    # The served model's parts, for the code that serves new requests.
    @property
    def engine(self) -> AsyncEngine | None:
        return self.served.engine if self.served is not None else None

    @property
    def tokenizer(self) -> Any:
        return self.served.tokenizer if self.served is not None else None

    @property
    def max_model_len(self) -> int:
        return self.served.max_model_len if self.served is not None else 0

    @property
    def alive(self) -> bool:
        return self.failure is None

    @property
    def engine_failure(self) -> str | None:
        """Why the served engine can run nothing more (a tensor-parallel rank died or hung)."""
        return self.engine.failure if self.engine is not None else None

    @property
    def failure(self) -> str | None:
        """Why the server is unhealthy; None while it is healthy (or still loading)."""
        if self.load_error is not None or self.engine is None:
            return self.load_error
        return self.engine_failure or (None if self.engine.alive else "the engine loop stopped")

    # ---- admission ---------------------------------------------------------------------

    def admit(self, job: Job, authorization: str | None) -> None:
        """Authenticate, check readiness, the per-key request rate and the queue."""
        job.key = self.keys.identify(authorization)
        if self.draining:
            raise APIError(503, "the server is shutting down", type="unavailable", code="draining")
        if not self.ready or self.engine is None:
            raise APIError(503, "the model is not loaded yet", type="unavailable", code="not_ready")
        if self.engine_failure is not None:
            raise _engine_failed(self.engine_failure)
        wait = self.limiter.check(job.key, "requests")
        if wait:
            raise _rate_limited(f"request rate limit ({self.config.requests_per_minute:g}/min) exceeded", wait)
        try:  # refuse overload before reading the body or tokenizing
            self.engine.scheduler.check_room()
        except QueueFull as exc:
            raise _queue_full(self.engine, exc) from None

    def check_model(self, name: str | None) -> None:
        """The served name, or NAME@VERSION of the version served now."""
        current = self.served.ref if self.served is not None else None
        if name is not None and name not in (self.model_name, current):
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def params(
        self,
        job: Job,
        body: DiffusionFields,
        max_tokens: int | None,
        temperature: float | None,
        seed: int | None,
        top_p: float | None = None,
    ) -> GenerationParams:
        """The request's generation parameters, checked against the server's limits."""
        cfg = self.config
        gen = max_tokens or cfg.default_max_tokens or cfg.max_tokens
        if gen > cfg.max_tokens:
            raise bad_request(
                f"max_tokens ({gen}) exceeds this server's limit of {cfg.max_tokens}",
                param="max_tokens",
                code="max_tokens_exceeded",
            )
        if len(job.prompt_ids) + gen > self.max_model_len:
            raise bad_request(
                f"the prompt ({len(job.prompt_ids)} tokens) plus max_tokens ({gen}) exceeds the "
                f"maximum context of {self.max_model_len} tokens",
                param="messages" if job.endpoint == "chat.completions" else "prompt",
                code="context_length_exceeded",
            )
        if body.steps is not None and body.refinement_steps is not None:
            raise bad_request("give steps (in all) or refinement_steps (per block), not both", param="refinement_steps")
        per_block = body.refinement_steps or (cfg.refinement_steps if body.steps is None else None)
        if body.steps is not None and body.steps > cfg.max_steps:
            raise bad_request(
                f"steps ({body.steps}) exceeds this server's limit of {cfg.max_steps}",
                param="steps",
                code="steps_exceeded",
            )
        if cfg.tokens_per_minute and gen > cfg.tokens_per_minute:
            raise bad_request(
                f"max_tokens ({gen}) exceeds the per-key limit of {cfg.tokens_per_minute:g} tokens per minute",
                param="max_tokens",
            )
        params = GenerationParams(
            gen_length=gen,
            steps=body.steps,
            block_length=body.block_length or cfg.block_length,
            remasking=body.remasking or "low_confidence",
            temperature=temperature or 0.0,
            cfg_scale=body.cfg_scale or 0.0,
            threshold=body.threshold,
            factor=body.factor,
            seed=seed,
            cache=body.cache or "auto",
            mode=body.decode_mode or "diffusion",
            alg=body.alg,
            alg_temp=body.alg_temp,
            top_k=body.top_k,
            top_p=None if top_p == 1.0 else top_p,  # 1 filters nothing: any family takes it
        )
        assert self.engine is not None
        validate = self.engine.engine.validate  # the family's defaults and rules, as `dlm generate`
        try:
            resolved = validate(params, len(job.prompt_ids))
            if per_block is not None and resolved.block_length is not None:
                # Per-block steps over the resolved block layout (the family's block length);
                # a block cannot take more steps than it has tokens.
                steps = min(per_block, resolved.block_length) * resolved.num_blocks
                params = replace(params, steps=steps)
                resolved = validate(params, len(job.prompt_ids))
            elif body.steps is None and resolved.steps is not None and resolved.steps > cfg.max_steps:
                # One token per step would exceed the limit: take the most steps within it
                # that still divide evenly over the blocks.
                blocks = max(1, resolved.num_blocks)
                params = replace(params, steps=max(blocks, cfg.max_steps // blocks * blocks))
                resolved = validate(params, len(job.prompt_ids))
        except UsageError as exc:
            word = str(exc).split()[0]
            code = "unsupported" if isinstance(exc, Unsupported) else "invalid_value"
            raise bad_request(str(exc), param=_PARAM.get(word, word), code=code) from None
        if resolved.steps is not None and resolved.steps > cfg.max_steps:  # e.g. decode_mode ar
            raise bad_request(
                f"this request needs {resolved.steps} denoising steps, over this server's limit of {cfg.max_steps}",
                param="steps",
                code="steps_exceeded",
            )
        return params

    def submit(self, job: Job, params: GenerationParams) -> RequestStream:
        """Charge the token rate, then queue the request on the served model (429 at once when
        the queue is full); the request stays on that model to its end."""
        wait = self.limiter.check(job.key, "tokens", params.gen_length)
        if wait:
            raise _rate_limited(f"token rate limit ({self.config.tokens_per_minute:g}/min) exceeded", wait)
        job.params = params
        assert self.served is not None
        job.served = self.served
        engine = self.served.engine
        try:
            stream = engine.submit(
                job.id,
                job.prompt_ids,
                params,
                timeout=self.config.request_timeout,
                updates=job.stream or bool(job.stops),
            )
        except QueueFull as exc:
            raise _queue_full(engine, exc) from None
        except Draining as exc:
            raise APIError(503, str(exc), type="unavailable", code="draining") from None
        except EngineFailed as exc:
            raise _engine_failed(str(exc)) from None
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
            "event": "request",
            "id": job.id,
            "endpoint": job.endpoint,
            "key": job.key,
            "status": job.status,
            "latency_s": round(time.monotonic() - job.arrival, 4),
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": len(job.completion_ids),
            "denoising_steps": job.steps,
            "finish_reason": job.finish_reason,
            "stream": job.stream,
        }
        if self.config.log_prompts:
            line["prompt"] = job.prompt_text
            line["output"] = job.output_text
        request_log.info(json.dumps(line, ensure_ascii=False))


def _rate_limited(message: str, wait: int) -> APIError:
    return APIError(
        429, message, type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(wait)}
    )


def _engine_failed(reason: str) -> APIError:
    return APIError(503, f"the engine failed: {reason}", type="unavailable", code="engine_failed")


def _queue_full(engine: AsyncEngine, exc: QueueFull) -> APIError:
    return APIError(
        429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(engine.retry_after())}
    )


def _default_name(config: ServeConfig) -> str:
    """The directory name; for a deployment, the store name of the model it serves."""
    if config.deployment is not None:
        from dlm_cli.store.releases import load_state
        from dlm_cli.store.store import Store

        current = load_state(Store(config.store), config.deployment)["current"]
        return current["model"] if current else config.deployment
    if config.model is None:
        from engine.default_model import NAME

        return NAME
    return Path(config.model).expanduser().resolve().name
