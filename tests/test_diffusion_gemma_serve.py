"""`dlm serve` decodes DiffusionGemma canvases of concurrent requests together (continuous
batching) and answers each with the ids transformers' `generate` gives for it alone (float32,
seeded), which `dlm generate` also gives (tests/test_diffusion_gemma.py)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma
from engine.runtime.request import completion
from tests.conftest import session_home
from tests.diffusion_gemma_reference import CASES, http_body, reference_generate
from tests.serving import ServerProcess, ready_server

pytestmark = pytest.mark.slow  # starts a server process


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [str(checkpoint), "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "4"]
    with ready_server(args, session_home(tmp_path_factory)) as proc:
        yield proc


def test_concurrent_requests_get_the_reference_ids(server: ServerProcess, checkpoint: Path) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = [reference_generate(model, case[0], case, eos=1) for case in CASES]
    with ThreadPoolExecutor(len(CASES)) as pool:
        replies = list(
            pool.map(lambda c: httpx.post(server.url + "/v1/completions", json=http_body(c), timeout=300), CASES)
        )
    for reply, (ids, forwards) in zip(replies, expected):
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["token_ids"] == completion(ids, {1})  # EOS 1
        assert reply.json()["usage"]["denoising_steps"] == forwards


def test_masked_diffusion_field_is_a_400_naming_it(server: ServerProcess) -> None:
    reply = httpx.post(server.url + "/v1/completions", json={**http_body(CASES[0]), "threshold": 0.9}, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "threshold"
