"""`/openapi.json` and `/docs`: a valid OpenAPI document that describes every request body the
server reads, the dLLM fields with their one declaration's description, default and range;
served without a key (as /health), and off with `--no-openapi` / `openapi = false`."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from dlm.cli.server.app import create_app
from dlm.cli.server.config import load_config
from dlm.cli.server.protocol import PARAM_FIELDS, ChatRequest, CompletionRequest, DetokenizeRequest
from dlm.engine.params import DEFAULTS, PARAMS

# The app is built, not started: no model loads (its lifespan does not run without `with`).


def client(**flags: Any) -> TestClient:
    return TestClient(create_app(load_config(flags=flags, environ={})))


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    response = client(max_tokens=512, default_max_tokens=64).get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_the_document_is_valid_openapi(spec: dict[str, Any]) -> None:
    validate(spec)
    assert spec["info"]["title"] == "dlm"


def test_every_route_that_reads_a_body_names_it(spec: dict[str, Any]) -> None:
    def body(path: str) -> Any:
        return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    ref = "#/components/schemas/"
    assert body("/v1/completions") == {"$ref": ref + "CompletionRequest"}
    assert body("/v1/chat/completions") == {"$ref": ref + "ChatRequest"}
    assert body("/tokenize") == {"oneOf": [{"$ref": ref + "CompletionRequest"}, {"$ref": ref + "ChatRequest"}]}
    assert body("/detokenize") == {"$ref": ref + "DetokenizeRequest"}
    schemas = spec["components"]["schemas"]
    for model in (CompletionRequest, ChatRequest, DetokenizeRequest):  # every field the model accepts
        assert set(model.model_fields) <= set(schemas[model.__name__]["properties"]), model.__name__
    assert spec["paths"]["/v1/completions"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"] == {
        "$ref": ref + "ErrorResponse"
    }


@pytest.mark.parametrize("model", ["CompletionRequest", "ChatRequest"])
def test_the_dllm_fields_carry_their_declaration(model: str, spec: dict[str, Any]) -> None:
    """Each decoding field, as dlm/engine/params.py declares it: help text, default (or what
    None means), range and choices; `max_tokens` with this server's default and limit."""
    properties = spec["components"]["schemas"][model]["properties"]
    for body_name, name in PARAM_FIELDS.items():
        declared, field = PARAMS[name], properties[body_name]
        assert field["description"].startswith(declared.help), body_name
        if body_name == "max_tokens":
            assert field["default"] == 64 and field["anyOf"][0]["maximum"] == 512
        elif DEFAULTS[name] is not None:
            default = DEFAULTS[name]
            assert field["default"] == (list(default) if isinstance(default, tuple) else default), body_name
        elif declared.shown:
            assert field["description"].endswith(f"Default: {declared.shown}."), body_name
        value = next((b for b in field.get("anyOf", [field]) if b.get("type") not in (None, "null")), field)
        if declared.choices:
            assert value["enum"] == list(declared.choices), body_name
        if declared.low is not None:
            assert value["exclusiveMinimum" if declared.low_open else "minimum"] == declared.low, body_name
        if declared.high is not None and body_name != "max_tokens":
            assert value["exclusiveMaximum" if declared.high_open else "maximum"] == declared.high, body_name


def test_it_needs_no_key_when_the_api_does() -> None:
    """A description of the API, like /health and /version: a browser opens /docs without a
    bearer key. The API itself still wants one."""
    keyed = client(api_keys=["sk-1"])
    assert keyed.get("/openapi.json").status_code == 200 and keyed.get("/docs").status_code == 200
    assert keyed.get("/v1/models").status_code == 401


def test_it_can_be_turned_off() -> None:
    """`--no-openapi` / `openapi = false` / DLM_OPENAPI=false: both paths are unknown (404)."""
    off = client(openapi=False)
    for path in ("/openapi.json", "/docs"):
        response = off.get(path)
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert load_config(environ={"DLM_OPENAPI": "false"}).openapi is False


def test_the_answers_media_types_are_the_real_ones(spec: dict[str, Any]) -> None:
    """/metrics answers Prometheus' text, not JSON; a generation route with `stream: true`
    answers server-sent events (the same 200) besides its JSON body."""
    paths = spec["paths"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(paths[path]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(paths["/version"]["get"]["responses"]["200"]["content"]) == {"application/json"}


def test_every_route_documents_its_error_answers(spec: dict[str, Any]) -> None:
    """Each route answers OpenAI's error body (a 404 for another model, 401, 403, 431, 503 from
    the probes, 500), never FastAPI's 422, which the document listed for /v1/models/{model}."""
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (path, method)
            for code in ("4XX", "5XX"):
                assert responses[code]["content"]["application/json"]["schema"] == error, (path, method, code)
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_a_model_not_served_is_the_documented_404() -> None:
    response = client().get("/v1/models/another")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
