"""Tenants (API keys) of one server, in process (the app over tiny SDAR, a block-causal family
with the prefix cache): what one tenant can observe of another. /metrics is the operator's,
the prefix cache is partitioned by key (shared only when configured), and one key cannot
fill the preparation backlog (the engine queue's share: tests/test_serve_scheduler.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.serving import app_client

A, B, ADMIN = "sk-tenant-a-1234", "sk-tenant-b-5678", "sk-operator-9012"
PROMPT = list(range(10, 90))  # 80 token ids: several whole prefix-cache pages


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with app_client({"model": "tiny:sdar", "api_keys": [A, B], "admin_key": ADMIN, "warmup": False}) as test_client:
        yield test_client


def _hits(client: TestClient) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics", headers=_auth(ADMIN)).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["dlm_prefix_cache_hits"].samples[0].value


def _ask(client: TestClient, key: str, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    answer = client.post("/v1/completions", json=body, headers=_auth(key))
    assert answer.status_code == 200, answer.text


def test_metrics_are_the_operators_when_the_server_has_tenants(client: TestClient) -> None:
    """Any tenant's key reading /metrics would see every tenant's traffic (and the
    prefix-cache counter that revealed prompts): 403 for tenants, 200 for the admin key."""
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=_auth("sk-wrong")).status_code == 401
    for key in (A, B):
        refused = client.get("/metrics", headers=_auth(key))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert client.get("/metrics", headers=_auth(ADMIN)).status_code == 200


def test_one_tenant_never_hits_another_tenants_cached_prompt(client: TestClient) -> None:
    """Tenant B sending A's prompt finds nothing of it in the prefix cache (neither a hit
    counted nor a faster start); A sending it again does; with --prefix-cache-shared the keys
    share pages."""
    prompt = [7, *PROMPT]
    _ask(client, A, prompt)
    before = _hits(client)
    _ask(client, B, prompt)
    assert _hits(client) == before  # B's lookup missed A's pages
    _ask(client, A, prompt)
    mine = _hits(client) - before
    assert mine >= 64  # A's own repeat reads its pages
    config = client.app.state.service.config  # type: ignore[attr-defined]
    config.prefix_cache_shared = True
    try:
        shared = [8, *PROMPT]
        _ask(client, A, shared)
        before = _hits(client)
        _ask(client, B, shared)
        assert _hits(client) - before == mine  # one shared partition: B reads A's pages
    finally:
        config.prefix_cache_shared = False


def test_one_key_cannot_fill_the_preparation_backlog() -> None:
    """Bodies being prepared count against their key's share of the backlog: a key at its
    share gets 429 while another key's body is prepared."""
    from dlm.cli.server.errors import APIError
    from dlm.cli.server.prepare import Preparer
    from tests.test_serve_prepare import FakeService, Served, bounds

    async def go() -> None:
        preparer = Preparer()
        preparer.pending, preparer.by_key["a"] = 2, 2  # two of key a's bodies in preparation
        limits = bounds(backlog=4, share=2)
        try:
            with pytest.raises(APIError) as caught:
                await preparer.prepare(FakeService(Served(), config=limits), b'{"prompt": "x"}', None, key="a")
            assert (caught.value.status, caught.value.code) == (429, "queue_full")
            prepared = await preparer.prepare(
                FakeService(Served(), config=limits), json.dumps({"prompt": "x"}).encode(), None, key="b"
            )
            assert prepared.prompt_ids == [1]
        finally:
            preparer.close()

    asyncio.run(go())
