"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the status.

Every failure the server answers goes through `APIError` or one of the handlers below, so
no input produces a bare 500 or a framework-shaped body.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from dlm.engine.errors import UnknownKey, Unsupported, UsageError

log = logging.getLogger("dlm.server")

CLIENT_CLOSED = 499  # nginx's code for "client closed the request": logged, never sent
REQUEST_ID = "X-Request-Id"  # a generation request's id, as its log line and its answer's `id` carry it


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        """The answer; `request_id`: a generation request's id (its log line's), sent as
        `X-Request-Id` as every answer of those routes is."""
        headers = {**self.headers, REQUEST_ID: request_id} if request_id is not None else self.headers
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


INTERNAL = APIError(500, "internal server error", type="server_error")  # what nobody anticipated


def internal(exc: BaseException | None = None) -> APIError:
    """The 500 of a failure nobody anticipated. A server's clients learn no more than that (its
    cause and traceback are in the server's log, under the request's id); `dlm batch`, whose
    client is the operator running the app in process, has the cause named in its line."""
    if exc is None:
        return INTERNAL
    cause = f"{type(exc).__name__}: {exc}"[:500]
    return APIError(500, f"internal server error: {cause}", type="server_error", code="internal_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def refusal_code(exc: UsageError) -> str:
    """The documented 400 code of an engine refusal, read from its type (never its message):
    a key the object does not have, a field this model cannot honour, else a bad value."""
    if isinstance(exc, UnknownKey):
        return "unknown_parameter"
    return "unsupported" if isinstance(exc, Unsupported) else "invalid_value"


_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|[\[(]")


def validation_error(errors: list[Any]) -> APIError:
    """The deepest pydantic error (the first of those), named by its field path. Pydantic adds
    the tried type of each union member to the path (`prompt.str`); those tags are not fields
    and are dropped. Deepest: a value that fails every member of a union fails each its own
    way, and the member that got furthest into it names what is wrong; the first, a string's
    "Input should be a valid string" for a content list with an image part, named a type the
    client had not meant to send. A validator's `unsupported` error keeps that code."""
    fields = [[str(p) for p in e.get("loc", ()) if p != "body" and not _TYPE_TAG.search(str(p))] for e in errors]
    if not errors:
        errors, fields = [{"msg": "invalid request"}], [[]]
    deepest = max(range(len(errors)), key=lambda i: len(fields[i]))
    first, param = errors[deepest], ".".join(fields[deepest]) or None
    if first.get("type") == "extra_forbidden":  # a misspelt or foreign field is refused, never ignored
        return bad_request(f"unrecognized request field {param!r}", param=param, code="unknown_parameter")
    text = str(first.get("msg")).removeprefix("Value error, ")  # pydantic's wrapping of our ValueErrors
    message = f"{param}: {text}" if param else text
    code = "unsupported" if first.get("type") == "unsupported" else "invalid_value"
    return bad_request(message, param=param, code=code)


def method_not_allowed(request: Request) -> APIError:
    """405 `method_not_allowed` with the `Allow` header HTTP requires (RFC 9110 15.5.6), read
    from the routing table: every method of every route on the path. Starlette's header names
    the first such route's only, which left out the HEAD twins of GET routes (app.py)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    allow = ", ".join(sorted(methods))
    return APIError(
        405,
        f"{request.method} is not allowed on {request.url.path}: it takes {allow}",
        code="method_not_allowed",
        headers={"Allow": allow},
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            return method_not_allowed(request).response()
        if exc.status_code == 404 and exc.detail == "Not Found":  # the router's: no such path
            # OpenAI SDKs show only the message: a bare "Not Found" for `client.responses` or
            # `client.embeddings` left a user guessing whether the model or the route was missing.
            message = f"no route {request.method} {request.url.path} (the routes served: docs/serve.md, Endpoints)"
            return APIError(404, message, type="not_found_error", headers=exc.headers).response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return INTERNAL.response()
