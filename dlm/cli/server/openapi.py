"""The server's OpenAPI description (`/openapi.json`, browsed at `/docs`): FastAPI's own, plus
what it cannot see.

The handlers read their bodies themselves (dlm/cli/server/app.py says why), so FastAPI finds no
request model in their signatures: each route names its body here, and the schemas are those
of the pydantic models that validate it (dlm/cli/server/protocol.py), whose decoding fields
carry the description, default and range of their one declaration (dlm/engine/params.py).
What is this server's own (its `max_tokens` default and limit) is stated as it is configured.
Errors are OpenAI's body (`ErrorResponse`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from dlm.cli.server.config import ServeConfig
from dlm.cli.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest
from dlm.cli.version import dlm_version

DESCRIPTION = (
    "An OpenAI-compatible API served by a diffusion language model (dlm): completions and chat, "
    "streamed or not. The decoding fields of a diffusion model (steps, block_length, threshold, ...) "
    "are top-level body fields (OpenAI SDKs send them via extra_body); usage adds denoising_steps."
)
# The schemas /openapi.json lists, named as the routes refer to them.
MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatRequest, DetokenizeRequest)
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def body(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body (one of `models`); its errors are every route's (`_errors`)."""
    schema = _ref(models[0].__name__) if len(models) == 1 else {"oneOf": [_ref(m.__name__) for m in models]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# What a route answers that is not JSON: /metrics is Prometheus' text format, and a generation
# route with `stream: true` answers server-sent events (the same 200).
PLAIN_TEXT = {"text/plain": {"schema": {"type": "string"}}}
EVENT_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}
MEDIA_TYPES: dict[str, dict[str, Any]] = {
    "/metrics": PLAIN_TEXT,
    "/v1/completions": {"application/json": {"schema": {}}, **EVENT_STREAM},
    "/v1/chat/completions": {"application/json": {"schema": {}}, **EVENT_STREAM},
}


def _media_types(paths: dict[str, Any]) -> None:
    """The 200's media types of the routes whose answer is not (only) JSON, FastAPI's guess."""
    for path, content in MEDIA_TYPES.items():
        for operation in paths.get(path, {}).values():
            operation["responses"]["200"]["content"] = content


def _errors(schema: dict[str, Any]) -> None:
    """Every route may answer an OpenAI error: 431 (an oversized head) and 500 on all, 403 off
    the allow-list, 401 without the key, 404 for another model, 503 from the probes. FastAPI's
    422 (`HTTPValidationError`) is never answered: a request it would refuse is a 400 in
    OpenAI's shape (dlm/cli/server/errors.py), so it and its schemas go."""
    error = {"description": "an OpenAI error body", "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    for operations in schema["paths"].values():
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            responses.setdefault("4XX", error)
            responses.setdefault("5XX", error)
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)


def install(app: FastAPI, settings: Callable[[], ServeConfig]) -> None:
    """Build the description on first request, with the request models' schemas; the length
    default is `settings()`'s as the document is read (a reload changes it)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title="dlm", version=dlm_version(), description=DESCRIPTION, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in MODELS:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            components["ErrorResponse"] = ERROR
            _media_types(schema["paths"])
            _errors(schema)
            app.openapi_schema = schema
        config = settings()
        for name in ("CompletionRequest", "ChatRequest"):  # this server's length default and limit
            length = app.openapi_schema["components"]["schemas"][name]["properties"]["max_tokens"]
            length["default"] = config.default_gen_length
            length["anyOf"][0]["maximum"] = config.max_tokens
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
