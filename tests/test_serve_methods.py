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
