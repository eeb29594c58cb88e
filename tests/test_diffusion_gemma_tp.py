"""DiffusionGemma at tensor-parallel size 2 (two gloo CPU processes): query heads, dense and
expert intermediate features and the vocabulary split over the ranks, the single KV head of
the full-attention layers replicated. Through `engine.LLM`, `dlm generate -tp 2` and
`dlm serve -tp 2`, the canvases get transformers' ids and forward counts (float32, seeded),
as a single process does (tests/test_diffusion_gemma.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma
from engine.llm import LLM
from engine.parallel.distributed import ParallelConfig
from engine.runtime.request import completion
from tests.conftest import ROOT, session_home
from tests.diffusion_gemma_reference import CASES, cli_args, http_body, params, reference_generate
from tests.serving import ServerProcess, ready_server

pytestmark = pytest.mark.slow  # spawns ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[tuple[list[int], int]]:
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return [reference_generate(model, case[0], case, eos=1) for case in CASES]


def test_two_ranks_give_the_reference_ids(checkpoint: Path, expected: list) -> None:
    with LLM(checkpoint, dtype="float32", device="cpu", parallel=ParallelConfig(tensor_parallel_size=2)) as llm:
        assert llm.engine.tensor_parallel_size == 2
        got = [llm.generate(case[0], params(case))[0] for case in CASES]
    assert [(out.output_ids, out.nfe) for out in got] == expected


def test_cli_two_ranks(checkpoint: Path, expected: list) -> None:
    command = [sys.executable, "-m", "dlm_cli", "generate", str(checkpoint), *cli_args(CASES[2]), "-tp", "2"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["tensor_parallel_size"] == 2
    assert (out["output_ids"], out["nfe"]) == expected[2]


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [str(checkpoint), "--dtype", "float32", "--device", "cpu", "-tp", "2"]
    with ready_server(args, session_home(tmp_path_factory)) as proc:
        yield proc


def test_serve_two_ranks_batches_canvases(server: ServerProcess, expected: list) -> None:
    with ThreadPoolExecutor(len(CASES)) as pool:
        replies = list(
            pool.map(lambda c: httpx.post(server.url + "/v1/completions", json=http_body(c), timeout=300), CASES)
        )
    for reply, (ids, forwards) in zip(replies, expected):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == completion(ids, 1)
        assert reply.json()["usage"]["denoising_steps"] == forwards
