"""The FastAPI app: OpenAI routes, health, readiness and metrics.

Bodies are read and validated inside the handlers (not by FastAPI's signature parsing) so
the order is always: head size, API key, readiness, request rate, body size, JSON, fields,
model, prompt size, limits, queue. An unauthenticated caller learns nothing about the body, and
every refusal is counted and logged the same way. Parsing and tokenising run on a bounded
pool (dlm/cli/server/prepare.py), so no body, however large, delays `/health`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from dlm.cli.server import errors, heap, openapi
from dlm.cli.server.admin import AdminEndpoint
from dlm.cli.server.auth import KeyRing, authorization
from dlm.cli.server.body import read_body
from dlm.cli.server.config import ServeConfig
from dlm.cli.server.connections import MAX_HEAD_BYTES, head_bytes
from dlm.cli.server.errors import APIError
from dlm.cli.server.generation import Responder, cached_response
from dlm.cli.server.metrics_push import MetricsPusher, server_instance
from dlm.cli.server.prepare import Preparer
from dlm.cli.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest
from dlm.cli.server.response_cache import bypassed
from dlm.cli.server.service import Job, Service
from dlm.cli.version import dlm_version

log = logging.getLogger("dlm.server")

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}  # path -> log name


def create_app(config: ServeConfig, failure_detail: bool = False, push_instance: str | None = None) -> FastAPI:
    """The server's app. `failure_detail`: a 500 names its cause (`errors.internal`), for a
    client that is the operator itself (`dlm batch`). `push_instance`: the `instance` the
    pushed metrics are grouped under (`server_instance` of the port bound, the OS's choice for
    --port 0; `batch_instance`); default `server_instance(config.port)`."""
    service = Service(config)
    service.failure_detail = failure_detail
    preparer = Preparer()
    admin = AdminEndpoint(service) if config.admin_enabled else None
    operators = KeyRing([admin.key] if admin is not None else [])
    pusher = (
        MetricsPusher(
            config.metrics_push_url,
            config.metrics_push_interval,
            service.metrics.registry,
            push_instance or server_instance(config.port),
        )
        if config.metrics_push_url is not None
        else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if admin is not None:  # registered before loading reads the deployment's current version
            await admin.start()
        # The model loads beside the running server: /health answers at once, /ready turns
        # 200 when loading ends, and generation requests that arrive meanwhile wait for it
        # (within `ready_wait`) rather than get 503 right after the server said it listens.
        loading = app.state.loading = asyncio.create_task(asyncio.to_thread(_load_then_freeze, service))
        pushing = asyncio.create_task(pusher.run()) if pusher is not None else None
        try:
            yield
        finally:  # also when the block raises (`dlm batch` runs the lifespan around its own work)
            service.draining = True
            if admin is not None:
                await admin.stop()
            await loading
            service.shutdown()
            preparer.close()
            if pusher is not None and pushing is not None:
                pushing.cancel()
                await asyncio.to_thread(pusher.push)  # the final counters

    # /openapi.json and /docs are FastAPI's, with the bodies the handlers read (openapi.py).
    app = FastAPI(
        title="dlm",
        lifespan=lifespan,
        docs_url="/docs" if config.openapi else None,
        redoc_url=None,
        openapi_url="/openapi.json" if config.openapi else None,
        # A path with a slash too many is unknown (404, OpenAI's error body), not Starlette's
        # 307 to the path without it: that redirect answered before the API key was checked,
        # with an empty body, to a URL built from the request's Host header (any host a client
        # names; behind a TLS proxy, http:// where the client spoke https).
        redirect_slashes=False,
    )
    openapi.install(app, lambda: service.config)  # its length default: a reload's
    app.state.service = service
    app.state.admin = admin
    app.state.loading = None  # the loading task, once the lifespan starts it
    errors.install(app)
    # The last added is the outermost: the head's size as it arrived, then its target's path.
    if config.allowed_ips:
        app.add_middleware(AllowList, service=service, networks=config.allowed_networks())
    app.add_middleware(OriginForm)
    app.add_middleware(HeadLimit, service=service)

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
        """The server's own counters. They sum every API key's traffic, so with several keys
        (tenants) they tell one about the others: then they are the operator's, read with the
        admin key (a tenant's key is a 403), unless --public-metrics; with one key or none,
        that key reads them."""
        if not config.public_metrics and not operators.knows(caller := authorization(request)):
            service.keys.identify(caller)  # 401 for a missing or wrong key
            if service.tenants > 1:
                raise APIError(
                    403,
                    "/metrics covers every API key's traffic: it needs the admin key (or --public-metrics)",
                    type="permission_error",
                    code="admin_key_required",
                )
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> JSONResponse:
        """dlm's version, as vLLM's `/version` answers (no key needed: it says nothing of the model)."""
        return JSONResponse({"version": dlm_version()})

    async def utility(request: Request) -> tuple[str, bytes]:
        """The preamble of `/tokenize` and `/detokenize`: key, readiness (as generation's),
        request rate, body."""
        key = service.keys.identify(authorization(request))
        service.check_serving()
        service.charge_request(key)  # their bodies cost the preparation thread as a generation's do
        return key, await read_body(request, config.max_body_bytes, config.read_timeout)

    @app.post("/tokenize", openapi_extra=openapi.body(CompletionRequest, ChatRequest))
    async def tokenize(request: Request) -> JSONResponse:
        """A completion's `prompt` or a chat's `messages` (template applied) as the token ids
        the server would decode from, as vLLM's `/tokenize` answers. The body is validated as
        a generation request with it is, by the same path (its parameters resolved, its
        sequences' checks run, none built), so what generation refuses, `/tokenize` refuses
        with the same 400."""
        key, raw = await utility(request)
        job = Job("completions", key=key)  # `prepare` names its endpoint from the body's kind
        prepared = await preparer.prepare(service, raw, None, job, build=False)
        ids = prepared.prompt_ids
        return JSONResponse({"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids})

    @app.post("/detokenize", openapi_extra=openapi.body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        key, raw = await utility(request)
        return JSONResponse({"prompt": await preparer.detokenize(service, raw, key)})

    def card() -> dict[str, Any]:
        """The served model's entry, as `/v1/models` lists it and `/v1/models/{model}` answers it."""
        card: dict[str, Any] = {
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
            # The weights' method (dlm/engine/quantization.py), or null: as /health says it.
            card["quantization"] = service.runtime.get("quantization")
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        service.keys.identify(authorization(request))
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> JSONResponse:
        """OpenAI's retrieve-model route (`client.models.retrieve(NAME)`): the served model's
        entry for its name (or NAME@VERSION served now), else 404 `model_not_found`. Names
        may hold slashes (`org/model`); `/v1/models/` is the list."""
        if not model:
            return await models(request)
        service.keys.identify(authorization(request))
        service.check_model(model)
        return JSONResponse(card())

    async def generate(request: Request, job: Job, model: type[CompletionRequest | ChatRequest]) -> Response:
        """What both generation routes do, in the contract's order: API key, readiness and
        request rate (`admit`), body; then, on the preparation pool, fields, model, the
        prompt's size and tokens, options, limits and the sequences (a response format laid
        out); then the queue. A refusal anywhere is counted and logged once (`reject`), and so
        is a failure nobody anticipated (a 500, never a request without its log line)."""
        try:
            service.authenticate(job, authorization(request))
            loading: asyncio.Task[None] | None = request.app.state.loading
            if not service.ready and loading is not None and not loading.done():  # held, within a bound
                # `asyncio.wait` leaves the load running at its timeout; not `asyncio.wait_for`,
                # which on Python 3.10 and 3.11 swallows a cancellation of this request that
                # comes as the load ends (the handler went on for a client that had left).
                await asyncio.wait({loading}, timeout=config.ready_wait)
            service.admit(job)
            raw = await read_body(request, config.max_body_bytes, config.read_timeout)
            prepared = await preparer.prepare(service, raw, model, job)
            assert prepared.params is not None
            job.fresh = bypassed(request.headers.get("cache-control"))
            answer = service.cached(job, prepared.params, prepared.seqs)
            if answer is not None:  # encoded off the event loop, as a miss's answer is (its logprobs: MBs)
                return await asyncio.to_thread(cached_response, service, job, answer)
            streams = service.submit(job, prepared.params, prepared.seqs)
        except APIError as exc:
            service.reject(job, exc)
            return exc.response(job.id)
        except Exception as exc:  # answered here, not by the framework's handler, which closes the connection
            log.exception("unhandled error")
            error = service.internal_error(exc)
            service.reject(job, error)
            return error.response(job.id)
        # Submitted: from here a failure nobody anticipated is the request's 500, logged
        # `failed` and counted once it is delivered, on a connection that stays usable
        # (an exception raised to the framework would close it).
        responder = Responder(service, job, streams, request)
        try:
            return responder.streaming() if job.stream else await responder.respond()
        except Exception as exc:
            log.exception("unhandled error")
            return responder.fail(exc)

    @app.post("/v1/completions", openapi_extra=openapi.body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await generate(request, Job(ENDPOINTS["/v1/completions"]), CompletionRequest)

    @app.post("/v1/chat/completions", openapi_extra=openapi.body(ChatRequest))
    async def chat(request: Request) -> Response:
        return await generate(request, Job(ENDPOINTS["/v1/chat/completions"]), ChatRequest)

    answer_head(app)
    return app


def answer_head(app: FastAPI) -> None:
    """Every GET route answers HEAD too, as HTTP requires (RFC 9110 9.3.2): the same handler,
    status and headers, the body dropped by the server. Starlette's own routes (`/docs`,
    `/openapi.json`) do; FastAPI's do not, so `curl -I` and load balancers probing with HEAD
    got a 405 from a healthy server. One rule, applied once every route exists: each GET route
    gets a HEAD twin (out of the OpenAPI document: one operation per route and method there,
    and HEAD is GET's)."""
    for route in list(app.routes):
        if isinstance(route, APIRoute) and "GET" in (route.methods or ()):
            app.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False)


async def _refuse(service: Service, error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer `error` from a middleware, before any route: counted, and on the generation
    routes logged like every refusal, with the request id of its log line."""
    endpoint = ENDPOINTS.get(scope["path"])
    job = Job(endpoint) if endpoint is not None else None
    if job is not None:
        service.reject(job, error)
    else:
        service.metrics.rejections.labels(error.code).inc()
    await error.response(job.id if job is not None else None)(scope, receive, send)


class OriginForm:
    """A request target in absolute form (`GET http://host/v1/models HTTP/1.1`), which an
    HTTP/1.1 server must accept (RFC 9112, 3.2.2), routed by its path: uvicorn passes the
    whole URL on as the path, a 404 naming the URL as a route. (Several Host headers, which
    the RFC refuses too, h11 refuses itself.)"""

    SCHEME_AND_AUTHORITY = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/]*")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (found := self.SCHEME_AND_AUTHORITY.match(scope["path"])) is not None:
            raw = scope.get("raw_path") or b""
            authority_end = raw.find(b"/", raw.find(b"://") + 3)
            scope = {
                **scope,
                "path": scope["path"][found.end() :] or "/",
                "raw_path": raw[authority_end:] if authority_end > 0 else b"/",
            }
        await self.app(scope, receive, send)


class HeadLimit:
    """431 for a request whose head (request line and headers) exceeds `MAX_HEAD_BYTES`:
    h11 bounds a head still arriving, but not one that arrives whole. Counted and, on the
    generation routes, logged like every refusal."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or head_bytes(scope) <= MAX_HEAD_BYTES:
            await self.app(scope, receive, send)
            return
        error = APIError(
            431,
            f"the request head (request line and headers) exceeds {MAX_HEAD_BYTES} bytes",
            code="request_header_fields_too_large",
        )
        await _refuse(self.service, error, scope, receive, send)


class AllowList:
    """403 for a client whose address is in no network of `allowed_ips` (the deployment guides'
    access allow-list), on every route but the probes `/health` and `/ready`, which load
    balancers and kubelets call from their own addresses. The address is uvicorn's: behind a
    proxy on 127.0.0.1 (or FORWARDED_ALLOW_IPS), the X-Forwarded-For client it names."""

    OPEN = ("/health", "/ready")

    def __init__(self, app: ASGIApp, service: Service, networks: list[Any]) -> None:
        self.app, self.service, self.networks = app, service, networks

    def allowed(self, scope: Scope) -> bool:
        import ipaddress

        client = scope.get("client")
        try:
            address = ipaddress.ip_address(client[0]) if client else None
        except ValueError:
            address = None
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address is not None and any(address in network for network in self.networks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        error = APIError(
            403,
            f"client address {client[0] if client else 'unknown'} is not in the server's allowed_ips",
            type="permission_error",
            code="ip_not_allowed",
        )
        await _refuse(self.service, error, scope, receive, send)


def _load_then_freeze(service: Service) -> None:
    """Load, then keep what loading made out of the cyclic GC's full collections."""
    service.load()
    heap.freeze()
