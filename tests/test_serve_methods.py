"""HTTP methods, in process (the app over tiny SDAR): every GET route answers HEAD (status and
headers, no body), and a method a route does not take is a 405 with a code and the `Allow`
header HTTP requires."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.serving import app_client


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with app_client({"model": "tiny:sdar", "warmup": False}) as test_client:
        yield test_client


def get_paths(client: TestClient) -> list[str]:
    """Every route's path that takes GET, its `{model}` the served model's name."""
    name = client.app.state.service.model_name  # type: ignore[attr-defined]
    paths = [route.path for route in client.app.routes if "GET" in (getattr(route, "methods", None) or ())]  # type: ignore[attr-defined]
    return [path.replace("{model:path}", name) for path in paths]


def test_every_get_route_answers_head(client: TestClient) -> None:
    paths = get_paths(client)
    assert {"/health", "/ready", "/version", "/v1/models", "/metrics"} <= set(paths)
    for path in paths:
        get, head = client.get(path), client.head(path)
        assert head.status_code == get.status_code == 200, (path, head.status_code, head.text)
        assert head.headers["content-type"] == get.headers["content-type"], path
        assert head.content == b"", path


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("GET", "/v1/completions", {"POST"}),
        ("PUT", "/v1/chat/completions", {"POST"}),
        ("POST", "/health", {"GET", "HEAD"}),  # a GET route's HEAD twin is named too
        ("DELETE", "/v1/models", {"GET", "HEAD"}),
    ],
)
def test_a_method_not_allowed_is_a_405_with_its_code_and_allow(
    client: TestClient, method: str, path: str, allow: set[str]
) -> None:
    response = client.request(method, path)
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) == allow
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    assert method in error["message"] and path in error["message"]
