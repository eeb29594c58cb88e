"""Service: what the HTTP routes share: the loaded model, the async engine, limits, keys,
metrics, readiness, and the one JSON log line per request.

Loading runs in a worker thread after the socket is open, so `/health` answers while the
weights load and `/ready` turns 200 only once a warm-up forward has run.

The served model is one `LoadedModel` that a hot swap (dlm/cli/server/hotswap.py) replaces
on the event loop. A request's prompt is encoded, its parameters resolved (`params`) and its
sequences built (`build`) off the loop, for the version `self.served` names then
(dlm/cli/server/prepare.py does it all again if a swap happened meanwhile); from there to
`submit()` the handler does not await, so tokenizer, limits and engine belong to one
version, and the request keeps that version (`Job.served`) to the end.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dlm.cli.server.auth import KeyRing
from dlm.cli.server.config import ServeConfig
from dlm.cli.server.errors import APIError, bad_request, internal, refusal_code
from dlm.cli.server.loaded import LoadedModel
from dlm.cli.server.logs import set_log_level
from dlm.cli.server.metrics import ServerMetrics
from dlm.cli.server.protocol import PARAM_FIELDS, GenerationRequest
from dlm.cli.server.ratelimit import RateLimiter
from dlm.cli.server.response_cache import CachedAnswer, ResponseCache
from dlm.engine.errors import DlmError, EngineFailed, UsageError
from dlm.engine.params import PARAMS, ResolvedParams, http_name
from dlm.engine.runtime.async_engine import AsyncEngine, Draining, RequestStream, start_on_engine_thread
from dlm.engine.runtime.prefix_cache import PrefixCacheStats
from dlm.engine.runtime.scheduler import QueueFull, SchedulerLimits
from dlm.engine.stops import ends_at_stop, require_text

if TYPE_CHECKING:
    from dlm.engine.llm import LLM
    from dlm.engine.runtime.interface import Engine
    from dlm.engine.runtime.request import RequestState

log = logging.getLogger("dlm.server")
request_log = logging.getLogger("dlm.requests")

# What became of a request, its log line's `outcome` (docs/serve.md, "Logs"): the answer left
# the process whole (answered); it was refused before decoding (refused); decoding ended by a
# timeout, an engine error or shutdown and that error was answered (failed); the client left
# first (client_closed, status 499); the client did not read the answer by its deadline and the
# connection was closed (undelivered, status 408).
Outcome = Literal["answered", "refused", "failed", "client_closed", "undelivered"]


@dataclass
class Job:
    """One inference request's bookkeeping, from arrival to its log line."""

    endpoint: str
    key: str = "-"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    written: float | None = None  # when its answer's last byte was written (its latency's end)
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_ids: list[int] = field(default_factory=list)
    suffix_ids: tuple[int, ...] = ()  # infilling: the ids after the answer
    params: ResolvedParams | None = None
    stops: list[str] = field(default_factory=list)
    tools: bool = False
    most_tool_calls: int | None = None  # 1 for `parallel_tool_calls: false`; None: every call
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    include_canvas: bool = False  # stream_options.include_canvas: canvas events after every step
    return_token_ids: bool = False
    echo: str | None = None  # completions with `echo`: the prompt's text, sent before the answer
    status: int = 200
    outcome: Outcome = "answered"
    finish_reason: str | None = None
    completion_ids: list[int] = field(default_factory=list)  # every choice's, one after another
    steps: int = 0
    prompt_text: str | None = None
    output_text: str | None = None
    served: LoadedModel | None = None  # the model version the request was submitted to
    charged_tokens: float = 0.0  # taken from its key's token budget; given back if it is refused
    length_field: str = "max_tokens"  # the body field that set its length, as the client spelt it
    # The body field that asked for logprobs, as the client spelt it: chat's switch is
    # `logprobs: true`, its count `top_logprobs` (named only when given); completions' `logprobs`.
    logprobs_field: str = "logprobs"
    cache_key: Hashable | None = None  # its answer's key in the response cache (None: not kept)
    fresh: bool = False  # its Cache-Control asks for a fresh answer: the response cache is not used
    cached: bool = False  # answered from the response cache


class Service:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.response_cache = ResponseCache(config.response_cache_size)
        self.keys = KeyRing(config.keys())
        self.tenants = len(set(config.keys()))  # API keys: each one a tenant the others must not observe
        # The batch bound the server started with: the step graphs and the memory plan were sized
        # by it, so a reload may lower `max_num_seqs`, and raise it again only up to this.
        self.max_num_seqs_at_start = config.max_num_seqs
        self.limiter = RateLimiter(config.requests_per_minute, config.tokens_per_minute)
        self.model_name = config.served_model_name or _default_name(config)
        self.served: LoadedModel | None = None
        self.retiring: list[LoadedModel] = []  # replaced by a hot swap, finishing their requests
        self.swapping = False  # a hot swap loads the version that will serve (`reloadable`)
        self.ready = False
        self.draining = False
        self.failure_detail = False  # a 500 names its cause (`create_app`: for `dlm batch`)
        self.load_error: str | None = None
        # a deployment's checkpoint and NAME@VERSION, read as the admin endpoint registers
        self.pinned: tuple[str, str] | None = None
        self.exit_code = 1  # of the process, when loading fails (2: the model was bad usage)
        self.runtime: dict[str, Any] = {}  # the served model's dtype choice and kernels, for /health

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
        # The entry point reports load_error once: `dlm serve` in its log, `dlm batch` as its error line.

    def _load(self) -> None:
        model, ref = self.initial_checkpoint()
        self.served = self.open(model, ref, warmup=self.config.warmup)
        self.metrics.bind(
            lambda: sum(m.engine.num_running for m in self.loaded()),
            lambda: sum(m.engine.num_waiting for m in self.loaded()),
            lambda: sum(m.engine.batch_tokens for m in self.loaded()) / self.config.max_num_batched_tokens,
            lambda: sum(m.engine.cache_bytes for m in self.loaded()),
        )
        self.metrics.watch_prefix_cache(
            lambda: sum((m.engine.prefix_cache_stats for m in self.loaded()), PrefixCacheStats())
        )
        self.metrics.serving(self.model_name, self.served.version, self.config.deployment)
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
            from dlm.cli.store.resolve import resolve_model

            return str(resolve_model(self.config.model)), None
        if self.pinned is None:
            raise DlmError(f"deployment {self.config.deployment}: the admin endpoint did not register")
        return self.pinned

    def open(self, model: str | None, ref: str | None, *, warmup: bool) -> LoadedModel:
        """Load a checkpoint, check it against the limits, warm it up and start its engine loop,
        all on the engine's own thread: the one thread that runs the model's torch work
        (dlm/engine/runtime/async_engine.py says why)."""
        return start_on_engine_thread(lambda: self._open_here(model, ref, warmup))

    def _open_here(self, model: str | None, ref: str | None, warmup: bool) -> tuple[AsyncEngine, LoadedModel]:
        from dlm.engine.llm import LLM

        cfg = self.config
        log.info("loading %s", model)
        llm = LLM(
            model,
            dtype=cfg.dtype,
            device=cfg.device,
            backend=cfg.backend,
            trust_remote_code=cfg.trust_remote_code,
            parallel=cfg.parallel(),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            on_load=LoadProgress(),
            quantization=cfg.quantization,
            thread_governor=cfg.thread_governor,
            kv_cache_dtype=cfg.kv_cache_dtype,
        )
        if cfg.gpu_memory_utilization is not None and not llm.memory_capped:
            log.warning("gpu_memory_utilization applies to CUDA devices only: %s is not capped", llm.device)
        if llm.thread_governor_off is not None:
            log.warning("thread_governor has no effect: %s", llm.thread_governor_off)
        try:
            return self._serve(llm, ref, warmup)
        except BaseException:
            llm.close()  # a tensor-parallel model stops its ranks
            raise

    def _serve(self, llm: LLM, ref: str | None, warmup: bool) -> tuple[AsyncEngine, LoadedModel]:
        from dlm.engine.tokenizer import has_tokenizer

        self._check_kernels(llm)
        if llm.device.type == "cuda" and self.served is None:  # the first load (a hot swap keeps the GPU)
            self.metrics.watch_gpu(llm.device)
        cfg = self.config
        max_model_len = cfg.model_len(llm.config.max_position_embeddings)
        # Checked from config.json before `dlm serve` loads a MODEL; here again for what it
        # could not check so: a deployment's releases (each hot swap) and the transformers backend.
        cfg.check_defaults(llm.engine.validate)
        tokenizer = llm.tokenizer if has_tokenizer(llm.model_dir) else None
        self._log_path(llm.engine)
        limits = self.scheduler_limits(llm.engine)
        # Sized by the batch the server started with, which a reload may raise `max_num_seqs`
        # back to: a hot swap while it is lowered must not size the new version by it.
        graphs = llm.engine.enable_step_graphs(cfg.step_graphs, _batch(llm.engine, self.max_num_seqs_at_start)) or "off"
        log.info("step graphs: %s", graphs)
        budget = int(cfg.prefix_cache_mib * 2**20)
        reuse = llm.engine.enable_prefix_cache(budget)
        if reuse:
            log.info("prefix cache: up to %.0f MiB of prompt K/V shared across requests", cfg.prefix_cache_mib)
        elif budget:
            log.info("prefix cache: off (exact reuse needs a block-causal family on one process)")
        self.runtime.update(step_graphs=graphs, prefix_cache_bytes=budget if reuse else 0)
        engine = AsyncEngine(llm.engine, limits, observer=self.metrics, governor=llm.thread_governor)
        ranks = llm.engine.tensor_parallel_size
        if ranks > 1:  # rank 0 schedules; a rank that dies fails the engine at once, even idle
            llm.engine.on_failure(engine.fail)
            log.info("tensor parallel: %d ranks ready", ranks)
        _prepare_structured(llm, tokenizer)
        if warmup:
            log.info("warming up (one request through the engine before /ready)")
            engine.warmup()
        return engine, LoadedModel(engine, tokenizer, max_model_len, llm.model_dir, ref)

    def _check_kernels(self, llm: LLM) -> None:
        """Where the dispatch would run Triton (CUDA), self-test every kernel on the model's
        device and dtype and fall back to the torch twin for any that fails (logged by
        dlm/kernels/selftest.py); record the dtype choice and the kernels for /health."""
        from dlm.kernels import dispatch, packed_linear, selftest

        tested = selftest.guard(llm.device, llm.dtype) if llm.backend == "native" else []
        self.runtime = {
            "dtype": llm.dtype_choice.to_dict(),
            "quantization": llm.quantization,
            "kv_cache_dtype": llm.engine.loaded.kv_cache_dtype,
            "thread_governor": llm.thread_governor is not None,
            "kernels": {
                "backend": dispatch.backend(llm.device),
                "linear": packed_linear.layout_of(llm.engine.loaded.model) if llm.backend == "native" else "dense",
                "self_test": {result.name: result.status for result in tested},
                "fallbacks": dispatch.fallbacks(),
            },
        }

    def reload(self, new: ServeConfig) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
        """Take `new`'s live settings (`ServeConfig.live`: request defaults and limits, the
        request timeout, rate limits, the batch and queue limits, logging), which every request
        that follows reads (the scheduler's limits from its next admission); its
        other changes need a restart and are returned unapplied. Decoding defaults the served
        model's family refuses refuse the whole reload (`UsageError`): nothing changes. The
        rate buckets start full when a rate changes. Returns (applied, needing a restart).
        Until `reloadable`, a `DlmError`, and nothing changes."""
        if not self.reloadable:
            raise DlmError("a model is loading: settings are reloaded once it serves")
        assert self.served is not None  # reloadable
        merged, applied, restart = self.config.reloaded(new)
        merged.check_defaults(self.served.engine.engine.validate)
        if merged.max_num_seqs > self.max_num_seqs_at_start:
            raise UsageError(
                f"max_num_seqs ({merged.max_num_seqs}) exceeds the {self.max_num_seqs_at_start} the server started "
                "with, which sized its step graphs and memory (a restart raises it)"
            )
        self.config = merged
        if {"max_num_seqs", "max_queue", "max_queue_per_key"} & applied.keys():
            for model in self.loaded():  # the next admission reads them (an attribute, swapped whole)
                model.engine.scheduler.limits = self.scheduler_limits(model.engine.engine)
        if {"requests_per_minute", "tokens_per_minute"} & applied.keys():
            self.limiter = RateLimiter(merged.requests_per_minute, merged.tokens_per_minute)
        if "log_level" in applied:
            set_log_level(merged.log_level)
        return applied, restart

    @property
    def reloadable(self) -> bool:
        """Whether the model that will serve is the one served, the family that checks a
        reload's defaults: not while the first load runs (that load reads the settings) nor
        while a hot swap loads the next version (it read them before the reload, its engine
        took the limits, and it serves from the switch on). A reload asked then waits."""
        return self.served is not None and not self.swapping

    def loaded(self) -> list[LoadedModel]:
        """Every model whose engine loop may still hold requests."""
        return ([self.served] if self.served is not None else []) + self.retiring

    def scheduler_limits(self, engine: Engine) -> SchedulerLimits:
        """The scheduler's limits from the settings now: the batch bound (`_batch`), the canvas
        tokens of a forward, the queue and one key's share of it."""
        cfg = self.config
        return SchedulerLimits(
            _batch(engine, cfg.max_num_seqs), cfg.max_num_batched_tokens, cfg.max_queue, self.queue_share()
        )

    def queue_share(self) -> int:
        """Waiting requests one API key may hold now: of the keys counted at start (they take a
        restart), never read again per request (a key file was read from disk at each one)."""
        return self.config.queue_share(self.tenants)

    @staticmethod
    def _log_path(engine: Engine) -> None:
        """Say which transformers-backend path serves the model and what it costs."""
        path = engine.path
        if path is not None:
            from dlm.engine.transformers_backend import GENERATE_SERVING_COSTS, PATHS

            log.info("transformers backend, %s path: %s", path, PATHS[path])
            if path == "generate":
                log.info("generate path serving: %s", GENERATE_SERVING_COSTS)

    def shutdown(self) -> None:
        for model in self.loaded():
            model.engine.stop()

    # The served model's parts, for the code that serves new requests.
    @property
    def engine(self) -> AsyncEngine | None:
        return self.served.engine if self.served is not None else None

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

    def internal_error(self, exc: Exception) -> APIError:
        """The 500 of a failure nobody anticipated (`errors.internal`), naming its cause only
        where the client is the operator (`failure_detail`)."""
        return internal(exc if self.failure_detail else None)

    @property
    def failure(self) -> str | None:
        """Why the server is unhealthy; None while it is healthy (or still loading)."""
        if self.load_error is not None or self.engine is None:
            return self.load_error
        return self.engine_failure or (None if self.engine.alive else "the engine loop stopped")

    # ---- admission ---------------------------------------------------------------------

    def authenticate(self, job: Job, authorization: str | None) -> None:
        """Who is calling (401 for a missing or wrong key): first, so an unauthenticated
        caller is neither held nor told anything about the server's state."""
        job.key = self.keys.identify(authorization)

    def admit(self, job: Job) -> None:
        """Check readiness, the authenticated key's request rate and the queue."""
        self.check_serving()
        assert self.engine is not None  # check_serving: loaded
        self.charge_request(job.key)
        try:  # refuse overload before reading the body or tokenizing
            self.engine.check_room(job.key)
        except QueueFull as exc:
            raise _queue_full(self.engine, exc) from None

    def check_serving(self) -> None:
        """503 unless the server takes work: `draining` (shutting down), `not_ready` (loading)
        or the engine failed. Every route that reads a body (generation, /tokenize,
        /detokenize) asks this one question, so a load balancer sees one state across them:
        a draining server that still answered /tokenize looked alive on that route."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="unavailable", code="draining")
        if not self.ready or self.engine is None:
            raise APIError(503, "the model is not loaded yet", type="unavailable", code="not_ready")
        if self.engine_failure is not None:
            raise _engine_failed(self.engine_failure)

    def charge_request(self, key: str) -> None:
        """One request against `key`'s request rate (429 with Retry-After beyond it): every
        route whose body goes through the preparation thread (generation, /tokenize,
        /detokenize), so the rate bounds what a key makes that thread do."""
        wait = self.limiter.check(key, "requests")
        if wait:
            raise _rate_limited(f"request rate limit ({self.config.requests_per_minute:g}/min) exceeded", wait)

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

    def params(self, job: Job, body: GenerationRequest, max_tokens: int | None, served: LoadedModel) -> ResolvedParams:
        """The request's decoding parameters, resolved and validated once for the model
        `served` and checked against the server's limits. Each body field maps onto its
        GenerationParams field; the server's defaults (block length, per-block steps,
        --max-steps) fill in, and the caller's key names its prefix-cache partition."""
        cfg = self.config
        job.length_field = length = _length_field(body)
        # Without a length, the server's default, lowered to the room the context leaves after
        # the prompt (and suffix), as OpenAI's and vLLM's default answers up to the context's end.
        room = served.max_model_len - len(job.prompt_ids) - len(job.suffix_ids)
        gen = max_tokens if max_tokens is not None else min(cfg.default_gen_length, max(room, 1))
        if gen > cfg.max_tokens:
            raise bad_request(
                f"{length} ({gen}) exceeds this server's limit of {cfg.max_tokens}",
                param=length,
                code="max_tokens_exceeded",
            )
        if gen > room:
            suffix = f" and the suffix ({len(job.suffix_ids)} tokens)" if job.suffix_ids else ""
            prompt, context = f"the prompt ({len(job.prompt_ids)} tokens)", f"{served.max_model_len} tokens"
            leave = "leave" if suffix else "leaves"
            raise bad_request(
                f"{prompt} plus {length} ({gen}){suffix} exceeds the maximum context of {context}"
                if max_tokens is not None
                else f"{prompt}{suffix} {leave} no room for an answer in the maximum context of {context}",
                param=_prompt_param(job),
                code="context_length_exceeded",
            )
        if body.steps is not None and body.steps > cfg.max_steps:
            raise _steps_exceeded(f"steps ({body.steps}) exceeds this server's limit of {cfg.max_steps}", "steps")
        self._check_charge(gen, 1, length)  # the length alone, before the family's rules: n is at least 1
        given = {name: getattr(body, key) for key, name in PARAM_FIELDS.items() if getattr(body, key) is not None}
        response_format = given.pop("response_format", None)
        if response_format is not None and response_format.get("type") != "text":  # text: nothing to enforce
            given["response_format"] = json.dumps(response_format, ensure_ascii=False)
        given.update(gen_length=gen, suffix=job.suffix_ids, stop=tuple(job.stops) or None)
        if not cfg.prefix_cache_shared:
            given["prefix_cache_partition"] = job.key
        top = body.top_logprobs_count()
        if top is not None:
            given["logprobs"] = top
            job.logprobs_field = "top_logprobs" if body.top_logprobs is not None else "logprobs"
        try:  # the family's defaults and rules, as `dlm generate` applies them
            resolved = served.engine.engine.validate(cfg.decoding_params(given), len(job.prompt_ids))
            require_text(resolved.stop, served.tokenizer is not None)
        except UsageError as exc:
            raise _refused(exc, job) from None
        try:  # its choices are queued together or not at all: a 400 when no wait lets them in
            served.engine.check_possible(job.key, resolved, len(job.prompt_ids))
        except UsageError as exc:
            raise _refused(exc, job) from None
        self._check_charge(resolved.gen_length, resolved.n, length)
        if resolved.max_forwards > cfg.max_steps:  # e.g. decode_mode ar, or more blocks than the limit
            # Named after the field that set the step count: the request's own, else its length.
            param = next((name for name in ("refinement_steps", "steps") if name in given), length)
            raise _steps_exceeded(
                f"this request may spend {resolved.max_forwards} denoising steps (forwards), over this "
                f"server's limit of {cfg.max_steps}",
                param,
            )
        return resolved

    def _check_charge(self, gen: int, n: int, length: str) -> None:
        """Refuse a request whose token charge (`charge`, what `submit` takes from its key's
        bucket) exceeds what the bucket can ever hold (`RateLimiter.capacity`): no wait would
        let it pass, so it is a 400 naming the field to lower, never a 429 (that is for a
        shortage refilling cures). The one place this is decided: `submit` asks it again
        before it charges (a reload may have lowered the rate since the parameters were
        checked), so it only ever charges requests this passed."""
        budget = self.limiter.capacity("tokens")
        amount = charge(gen, n)
        if budget is None or amount <= budget:
            return
        what = f"{length} ({gen})" if n == 1 else f"n ({n}) x {length} ({gen}) = {amount} tokens"
        raise bad_request(
            f"{what} exceeds the per-key limit of {self.config.tokens_per_minute:g} tokens per minute",
            param="n" if n > 1 else length,
            code="max_tokens_exceeded",
        )

    def build(self, job: Job, params: ResolvedParams, served: LoadedModel, *, dry: bool = False) -> list[RequestState]:
        """The request's `n` sequences on the model `served`, built (a response format laid
        out once for all of them) on the preparation thread, never on the event loop. `dry`
        (`/tokenize`): refuse what building would refuse, with the same 400, and build
        nothing (`Engine.check_request`): no sequence made only to be dropped."""
        engine = served.engine.engine
        try:
            if dry:
                engine.check_request(job.prompt_ids, params)
                return []
            return engine.make_sequences(job.prompt_ids, params)
        except UsageError as exc:
            raise _refused(exc, job) from None

    def cached(self, job: Job, params: ResolvedParams, seqs: list[RequestState]) -> CachedAnswer | None:
        """The answer the response cache keeps for `job` (dlm/cli/server/response_cache.py):
        a non-streamed request whose decoding is reproducible, looked up by everything that
        decides its answer (model version, API key, endpoint, prompt and suffix ids, resolved
        parameters, answer options), which `job.cache_key` keeps for storing a miss's answer.
        A hit ends the sequences built for it: none of them runs."""
        served = self.served
        if self.response_cache.size == 0 or job.stream or job.fresh or served is None:
            return None
        if not served.engine.engine.reproducible(params):
            return None
        job.cache_key = (
            str(served.model_dir),
            served.ref,
            job.key,
            job.endpoint,
            tuple(job.prompt_ids),
            job.suffix_ids,
            params,
            (job.tools, job.most_tool_calls, job.return_token_ids, job.echo),
        )
        self.metrics.response_cache_lookups.inc()
        answer = self.response_cache.get(job.cache_key)
        if answer is not None:
            self.metrics.response_cache_hits.inc()
            job.cached, job.served = True, served
            for seq in seqs:
                seq.finish("abort")
        return answer

    def finish_cached(self, job: Job, answer: CachedAnswer) -> None:
        """Metrics and the log line of a request answered from the response cache."""
        job.finish_reason, job.completion_ids, job.output_text = (
            answer.finish_reason,
            answer.completion_ids,
            answer.output_text,
        )
        self.metrics.success.labels(answer.finish_reason).inc()
        self.metrics.e2e.observe(time.monotonic() - job.arrival)
        self.record(job)

    def submit(self, job: Job, params: ResolvedParams, seqs: list[RequestState]) -> list[RequestStream]:
        """Charge the token rate, then queue the request's `n` sequences (built by `build` for
        the model served now) on that model, all of them or none (429 at once when the queue
        cannot take them); they stay on that model to their end. One stream per choice,
        choice i seeded `seed + i` (`GenerationParams.samples`). Sequences refused are ended,
        so nothing keeps them, and the tokens charged for them are given back. A charge the
        bucket can never hold is the 400 of `_check_charge`, asked again here: `Service.params`
        asked on the preparation thread, and a reload may have lowered the rate since; past
        it a shortage is only ever temporary (429)."""
        assert self.served is not None
        engine = self.served.engine
        try:
            self._check_charge(params.gen_length, params.n, job.length_field)
            amount = charge(params.gen_length, params.n)
            wait = self.limiter.check(job.key, "tokens", amount)
            if wait:
                raise _rate_limited(f"token rate limit ({self.config.tokens_per_minute:g}/min) exceeded", wait)
            job.charged_tokens = float(amount)
            ids = [job.id] if len(seqs) == 1 else [f"{job.id}-{i}" for i in range(len(seqs))]
            try:
                streams = engine.enqueue(
                    ids,
                    seqs,
                    timeout=self.config.request_timeout,
                    updates=job.stream,
                    canvas=job.include_canvas,
                    tenant=job.key,
                    # Its stop strings end it on the engine thread, at the step whose committed
                    # prefix first holds one: its forwards never depend on the event loop.
                    ends=ends_at_stop(self.served.text_of) if params.stop else None,
                )
            except (QueueFull, Draining, EngineFailed, UsageError) as exc:
                raise _submit_refused(engine, exc, job) from None
        except APIError:
            for seq in seqs:
                seq.finish("abort")
            self.refund_tokens(job)
            raise
        job.params, job.served = params, self.served
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        return streams

    # ---- accounting --------------------------------------------------------------------

    def refund_tokens(self, job: Job) -> None:
        """Give back the tokens `job` was charged (once)."""
        if job.charged_tokens:
            self.limiter.refund(job.key, "tokens", job.charged_tokens)
            job.charged_tokens = 0.0

    def reject(self, job: Job, error: APIError) -> None:
        job.status, job.outcome = error.status, "refused"
        # A refused request generated nothing: its tokens are given back. It stays a request
        # against requests-per-minute, so a flood of bad or overflowing ones is limited too.
        self.refund_tokens(job)
        self.metrics.rejections.labels(error.code or error.type).inc()
        self.record(job)

    def finish(self, job: Job, streams: list[RequestStream], finish_reason: str, status: int, outcome: Outcome) -> None:
        """Metrics and the log line of a request the engine ran (its choices' streams)."""
        job.finish_reason, job.status, job.outcome = finish_reason, status, outcome
        job.steps = sum(stream.seq.nfe for stream in streams)
        m = self.metrics
        for stream in streams:
            req = stream.request
            if req.admitted is not None:
                m.queue_time.observe(req.admitted - req.arrival)
        m.steps.observe(job.steps)
        m.generation_tokens.inc(len(job.completion_ids))  # generated, whatever became of them
        if outcome == "undelivered":
            m.undelivered.inc()
        elif finish_reason == "timeout":
            m.timeouts.inc()
        elif finish_reason == "abort":
            m.disconnects.inc()
        elif finish_reason in ("error", "shutdown"):
            m.failures.labels(finish_reason).inc()
        else:
            m.success.labels(finish_reason).inc()
            m.e2e.observe((job.written or time.monotonic()) - job.arrival)
        self.record(job)

    def record(self, job: Job) -> None:
        """One JSON line per request; prompt and output text only with --log-prompts."""
        line: dict[str, Any] = {
            "event": "request",
            "id": job.id,
            "endpoint": job.endpoint,
            "key": job.key,
            "status": job.status,
            "outcome": job.outcome,
            "latency_s": round((job.written or time.monotonic()) - job.arrival, 4),
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": len(job.completion_ids),
            "denoising_steps": job.steps,
            "finish_reason": job.finish_reason,
            "stream": job.stream,
        }
        if job.cached:
            line["cached"] = True
        if self.config.log_prompts:
            line["prompt"] = job.prompt_text
            line["output"] = job.output_text
        request_log.info(json.dumps(line, ensure_ascii=False))


def _prepare_structured(llm: LLM, tokenizer: Any) -> None:
    """Classify the vocabulary for response formats now, on the loading thread, rather than
    on the event loop at the first structured request (seconds for a large vocabulary)."""
    from dlm.engine.runtime.engine import LLMEngine
    from dlm.engine.structured import supported

    engine = llm.engine
    if not isinstance(engine, LLMEngine) or engine.loaded.model_dir is None or tokenizer is None:
        return  # tensor parallel: built at the first structured request; the generate path refuses them
    if supported(engine.family):
        try:
            engine.vocabulary()
        except UsageError as exc:  # e.g. no single digit tokens: structured requests get this 400
            log.info("structured output unavailable: %s", exc)


def charge(gen: int, n: int) -> int:
    """A request's tokens against its key's rate: every sample's whole canvas of `max_tokens`
    (dlm/cli/server/ratelimit.py says why), `n` samples."""
    return gen * n


def _prompt_param(job: Job) -> str:
    return "messages" if job.endpoint == "chat.completions" else "prompt"


def _batch(engine: Engine, max_num_seqs: int) -> int:
    """Sequences one forward of `engine` takes: `max_num_seqs`, or the engine's own bound where
    lower (the transformers generate path decodes one request at a time)."""
    bound = engine.max_num_seqs
    return max_num_seqs if bound is None else min(bound, max_num_seqs)


def _length_field(body: GenerationRequest) -> str:
    """The body field that set the answer's length, as the client spelt it (chat's
    `max_completion_tokens`, `max_output_tokens` and `max_tokens` may only be given equal:
    the first of them named here)."""
    if getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if body.max_output_tokens is not None:
        return "max_output_tokens"
    return "max_tokens"


def _refused(exc: UsageError, job: Job) -> APIError:
    """A 400 naming the body field the engine's refusal concerns (`exc.field`, a
    GenerationParams field or `prompt`) in the API's name for it, as its message does for
    every field it names ("top_logprobs must be in [0, 20]" of chat's `logprobs`)."""
    param = _api_name(exc.field, job) if exc.field is not None else None
    return bad_request(exc.spelt(lambda name: _api_name(name, job)), param=param, code=refusal_code(exc))


def _api_name(field: str, job: Job) -> str:
    """GenerationParams field `field` (or `prompt`) as this request's body spells it."""
    if field == "logprobs":  # GenerationParams.logprobs has no one HTTP name
        return job.logprobs_field
    if field == "gen_length":
        return job.length_field
    if field in PARAMS and (name := http_name(field)) is not None:
        return name
    return _prompt_param(job) if field == "prompt" else field


def _submit_refused(engine: AsyncEngine, exc: Exception, job: Job) -> APIError:
    if isinstance(exc, QueueFull):
        return _queue_full(engine, exc)
    if isinstance(exc, Draining):
        return APIError(503, str(exc), type="unavailable", code="draining")
    if isinstance(exc, EngineFailed):
        return _engine_failed(str(exc))
    assert isinstance(exc, UsageError)
    return _refused(exc, job)


def _steps_exceeded(message: str, param: str) -> APIError:
    return bad_request(message, param=param, code="steps_exceeded")


class LoadProgress:
    """Weight loading made visible: a log line every few seconds with the tensors read so far
    (a large checkpoint takes minutes; silence would look like a hang)."""

    EVERY_S = 5.0

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.tensors = 0

    def __call__(self, name: str) -> None:
        self.tensors += 1
        now = time.monotonic()
        if now - self.last >= self.EVERY_S:
            self.last = now
            log.info("loading weights: %d tensors read in %.0fs (now %s)", self.tensors, now - self.start, name)


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
        from dlm.cli.store.releases import load_state
        from dlm.cli.store.store import Store

        current = load_state(Store(config.store), config.deployment).current
        return current.model if current else config.deployment
    if config.model is None:
        from dlm.engine.default_model import NAME

        return NAME
    return Path(config.model).expanduser().resolve().name
