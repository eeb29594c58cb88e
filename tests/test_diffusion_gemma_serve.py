"""`dlm serve` decodes DiffusionGemma canvases of concurrent requests together (continuous
batching) and answers each with the ids transformers' `generate` gives for it alone (float32,
seeded), which `dlm generate` also gives (tests/test_diffusion_gemma.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dlm.engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma
from tests.conftest import session_home
from tests.diffusion_gemma_reference import (
    CASES,
    assert_concurrent_cases_match,
    http_body,
    reference_results,
    tiny_server,
)
from tests.serving import ServerProcess

pytestmark = pytest.mark.slow  # starts a server process


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with tiny_server(checkpoint, session_home(tmp_path_factory), "--max-num-seqs", "4") as proc:
        yield proc


def test_concurrent_requests_get_the_reference_ids(server: ServerProcess, checkpoint: Path) -> None:
    assert_concurrent_cases_match(server, reference_results(checkpoint))


def test_masked_diffusion_field_is_a_400_naming_it(server: ServerProcess) -> None:
    reply = httpx.post(server.url + "/v1/completions", json={**http_body(CASES[0]), "threshold": 0.9}, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "threshold"
