"""The FastAPI app: OpenAI routes, health, readiness and metrics.

Bodies are read and validated inside the handlers (not by FastAPI's signature parsing) so
the order is always: API key, readiness, request rate, body size, JSON, fields, model,
prompt size, limits, queue. An unauthenticated caller learns nothing about the body, and
every refusal is counted and logged the same way. Parsing and tokenising run on a bounded
pool (dlm/cli/server/prepare.py), so no body, however large, delays `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dlm.cli.server import errors, heap, openapi
from dlm.cli.server.admin import AdminEndpoint
from dlm.cli.server.body import read_body
from dlm.cli.server.config import ServeConfig
from dlm.cli.server.errors import APIError, bad_request
from dlm.cli.server.generation import Responder
from dlm.cli.server.prepare import Preparer
from dlm.cli.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest
from dlm.cli.server.service import Job, Service
from dlm.cli.version import dlm_version


def create_app(config: ServeConfig) -> FastAPI:
    service = Service(config)
    preparer = Preparer(config.max_queue + config.max_num_seqs)
    admin = AdminEndpoint(service) if config.admin_enabled else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if admin is not None:  # registered before loading reads the deployment's current version
            await admin.start()
        # The model loads beside the running server: /health answers at once, /ready turns
        # 200 when loading ends, and generation requests that arrive meanwhile wait for it
        # (within `ready_wait`) rather than get 503 right after the server said it listens.
        loading = app.state.loading = asyncio.create_task(asyncio.to_thread(_load_then_freeze, service))
        try:
            yield
        finally:  # also when the block raises (`dlm batch` runs the lifespan around its own work)
            service.draining = True
            if admin is not None:
                await admin.stop()
            await loading
            service.shutdown()
            preparer.close()

    # /openapi.json and /docs are FastAPI's, with the bodies the handlers read (openapi.py).
    app = FastAPI(
        title="dlm",
        lifespan=lifespan,
        docs_url="/docs" if config.openapi else None,
        redoc_url=None,
        openapi_url="/openapi.json" if config.openapi else None,
    )
    openapi.install(app, config)
    app.state.service = service
    app.state.admin = admin
    app.state.loading = None  # the loading task, once the lifespan starts it
    errors.install(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Alive: the process answers and the engine loop runs (or the model is loading)."""
        if service.failure is not None:
            return APIError(503, service.failure, type="unavailable", code="unhealthy").response()
        return JSONResponse({"status": "ok" if service.ready else "loading", **service.runtime})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Ready: weights loaded, warm-up forward done, not draining."""
        if service.draining:
            return APIError(503, "the server is shutting down", type="unavailable", code="draining").response()
        if not service.ready or not service.alive:
            return APIError(503, "the model is not ready", type="unavailable", code="not_ready").response()
        return JSONResponse({"status": "ready", "model": service.model_name})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not config.public_metrics:
            service.keys.identify(request.headers.get("authorization"))
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> JSONResponse:
        """dlm's version, as vLLM's `/version` answers (no key needed: it says nothing of the model)."""
        return JSONResponse({"version": dlm_version()})

    async def utility(request: Request) -> bytes:
        """The preamble of `/tokenize` and `/detokenize`: key, readiness, body."""
        service.keys.identify(request.headers.get("authorization"))
        if not service.ready:
            raise APIError(503, "the model is not loaded yet", type="unavailable", code="not_ready")
        return await read_body(request, config.max_body_bytes, config.read_timeout)

    @app.post("/tokenize", openapi_extra=openapi.body(CompletionRequest, ChatRequest))
    async def tokenize(request: Request) -> JSONResponse:
        """A completion's `prompt` or a chat's `messages` (template applied) as the token ids
        the server would decode from, as vLLM's `/tokenize` answers."""
        prepared = await preparer.prepare(service, await utility(request), None)
        ids = prepared.prompt_ids
        return JSONResponse({"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids})

    @app.post("/detokenize", openapi_extra=openapi.body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse({"prompt": await preparer.detokenize(service, await utility(request))})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        service.keys.identify(request.headers.get("authorization"))
        card = {
            "id": service.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dlm",
            "max_model_len": service.max_model_len or None,
        }
        served = service.served
        if served is not None:  # what was loaded (vLLM's `root`): a deployment's release, else the checkpoint's name
            card["root"] = served.ref or served.model_dir.name
        if served is not None and served.ref is not None:
            card["version"] = served.version
        if served is not None:  # the request features the loaded family honours (dlm/engine/capabilities.py)
            card["capabilities"] = list(served.engine.engine.capabilities)
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(request: Request, job: Job, model: type[CompletionRequest | ChatRequest]) -> Response:
        """What both generation routes do, in the contract's order: API key, readiness and
        request rate (`admit`), body; then, on the preparation pool, fields, model and the
        prompt's size and tokens; then options, limits, queue. A refusal anywhere is counted
        and logged once (`reject`)."""
        try:
            service.authenticate(job, request.headers.get("authorization"))
            loading: asyncio.Task[None] | None = request.app.state.loading
            if not service.ready and loading is not None and not loading.done():  # held, within a bound
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(loading), config.ready_wait)
            service.admit(job)
            raw = await read_body(request, config.max_body_bytes, config.read_timeout)
            prepared = await preparer.prepare(service, raw, model)
            body = prepared.body
            job.prompt_ids, job.prompt_text, job.tools = prepared.prompt_ids, prepared.prompt_text, prepared.tools
            job.suffix_ids, job.echo = prepared.suffix_ids, prepared.echo
            _options(job, body)
            params = service.params(job, body, prepared.max_tokens)
            streams = service.submit(job, params)
        except APIError as exc:
            service.reject(job, exc)
            raise
        responder = Responder(service, job, streams)
        return responder.streaming() if body.stream else await responder.respond(request)

    @app.post("/v1/completions", openapi_extra=openapi.body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await generate(request, Job("completions"), CompletionRequest)

    @app.post("/v1/chat/completions", openapi_extra=openapi.body(ChatRequest))
    async def chat(request: Request) -> Response:
        return await generate(request, Job("chat.completions"), ChatRequest)

    return app


def _options(job: Job, body: CompletionRequest | ChatRequest) -> None:
    job.stops = body.stop_strings()
    job.stream = body.stream
    job.include_usage = bool(body.stream_options and body.stream_options.include_usage)
    job.include_canvas = bool(body.stream_options and body.stream_options.include_canvas)
    if job.include_canvas and not body.stream:
        raise bad_request(
            "stream_options.include_canvas needs stream: true", param="stream_options", code="invalid_value"
        )
    job.return_token_ids = body.return_token_ids


def _load_then_freeze(service: Service) -> None:
    """Load, then keep what loading made out of the cyclic GC's full collections."""
    service.load()
    heap.freeze()
