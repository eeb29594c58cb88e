"""The FastAPI app: OpenAI routes, health, readiness and metrics.

Bodies are read and validated inside the handlers (not by FastAPI's signature parsing) so
the order is always: API key, readiness, request rate, body size, JSON, fields, model,
limits, queue. An unauthenticated caller learns nothing about the body, and every refusal
is counted and logged the same way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from dlm_cli.server import errors
from dlm_cli.server.admin import AdminEndpoint
from dlm_cli.server.config import ServeConfig
from dlm_cli.server.errors import APIError, bad_request
from dlm_cli.server.generation import Responder
from dlm_cli.server.protocol import ChatRequest, CompletionRequest
from dlm_cli.server.service import Job, Service

Body = TypeVar("Body", bound=BaseModel)
Req = TypeVar("Req", CompletionRequest, ChatRequest)
# A generation route's own part: encode the body's prompt into the job, return max tokens.
Encoder = Callable[[Service, Job, Req], int | None]


def create_app(config: ServeConfig) -> FastAPI:
    service = Service(config)
    admin = AdminEndpoint(service) if config.admin_enabled else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if admin is not None:  # registered before loading reads the deployment's current version
            await admin.start()
        loading = asyncio.create_task(asyncio.to_thread(service.load))
        yield
        service.draining = True
        if admin is not None:
            await admin.stop()
        await loading
        service.shutdown()

    app = FastAPI(title="dlm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.admin = admin
    errors.install(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Alive: the process answers and the engine loop runs (or the model is loading)."""
        if service.failure is not None:
            return APIError(503, service.failure, type="unavailable", code="unhealthy").response()
        return JSONResponse({"status": "ok" if service.ready else "loading"})

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
        if served is not None and served.ref is not None:  # a deployment: which release serves
            card.update(root=served.ref, version=served.version)
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(request: Request, job: Job, model: type[Req], encode: Encoder[Req]) -> Response:
        """What both generation routes do, in the contract's order: API key, readiness and
        request rate (`admit`), body, fields, model; the route's prompt (`encode`, which
        returns the requested max tokens); options, limits, queue. A refusal anywhere is
        counted and logged once (`reject`)."""
        try:
            service.admit(job, request.headers.get("authorization"))
            body = await _parse(request, model, config.max_body_bytes)
            _supported(body)
            service.check_model(body.model)
            max_tokens = encode(service, job, body)
            _options(job, body)
            params = service.params(job, body, max_tokens)
            stream = service.submit(job, params)
        except APIError as exc:
            service.reject(job, exc)
            raise
        responder = Responder(service, job, stream)
        return responder.streaming() if body.stream else await responder.respond(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, Job("completions"), CompletionRequest, _completion_prompt)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, Job("chat.completions"), ChatRequest, _chat_prompt)

    return app


async def _parse(request: Request, model: type[Body], limit: int) -> Body:
    """Read at most `limit` bytes of JSON and validate it against `model`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise _too_large(limit)
    try:
        data: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise errors.validation_error(list(exc.errors())) from None


def _completion_prompt(service: Service, job: Job, body: CompletionRequest) -> int | None:
    """Encode a completion's prompt (text, or token ids) into `job`; its max_tokens."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(
                "one prompt per request: send several requests (they are batched on the server)", param="prompt"
            )
        prompt = prompt[0]  # type: ignore[assignment]
    job.prompt_ids = service.encode_prompt(prompt)  # type: ignore[arg-type]
    job.prompt_text = prompt if isinstance(prompt, str) else None
    return body.max_tokens


def _chat_prompt(service: Service, job: Job, body: ChatRequest) -> int | None:
    """Render the chat template (with the tools, unless tool_choice is none) into `job`;
    its max tokens (max_completion_tokens, else the legacy max_tokens)."""
    messages = [m.for_template() for m in body.messages]
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    job.prompt_ids = service.encode_chat(messages, tools)
    job.prompt_text = json.dumps(messages, ensure_ascii=False)
    job.tools = tools is not None
    return body.max_completion_tokens or body.max_tokens


def _supported(body: CompletionRequest | ChatRequest) -> None:
    refused = body.unsupported()
    if refused is not None:
        raise bad_request(refused[1], param=refused[0], code="unsupported")


def _options(job: Job, body: CompletionRequest | ChatRequest) -> None:
    job.stops = body.stop_strings()
    job.stream = body.stream
    job.include_usage = bool(body.stream_options and body.stream_options.include_usage)
    job.return_token_ids = body.return_token_ids


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
