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
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dlm.engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma
from dlm.engine.llm import LLM
from dlm.engine.parallel import distributed
from dlm.engine.parallel.distributed import ParallelConfig
from dlm.engine.runtime.engine import load_model
from tests.conftest import ROOT, session_home
from tests.diffusion_gemma_reference import (
    CASES,
    assert_concurrent_cases_match,
    cli_args,
    logits_inputs,
    params,
    reference_results,
    tiny_server,
)
from tests.serving import ServerProcess

pytestmark = pytest.mark.slow  # spawns ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[tuple[list[int], int]]:
    return reference_results(checkpoint)


RANKS = 2


def _rank_entry(rank: int, port: int, directory: str, result: str) -> None:
    """One rank: load its shard, run the first and a self-conditioned decoder forward (the
    logits come back gathered), and report its parameter bytes."""
    import torch.distributed as dist

    place = distributed.Place(rank, RANKS, rank, "127.0.0.1", port)
    group = distributed.join(place, ParallelConfig(RANKS, timeout_s=60), torch.device("cpu"))
    model = load_model(Path(directory), torch.float32, torch.device("cpu")).model
    prompt, canvas, previous = logits_inputs()
    cache = model.new_cache()
    model.encode(prompt, cache)
    logits = [model.denoise(canvas, [cache], [None]), model.denoise(canvas, [cache], [previous])]
    sizes: list[int] = [0] * RANKS
    dist.all_gather_object(sizes, sum(p.numel() for p in model.parameters()))
    if rank == 0:
        torch.save((logits, sizes), result)
    distributed.leave(group)


def test_sharded_first_forward_logits_match_transformers(checkpoint: Path, tmp_path: Path) -> None:
    """Float32, 2 ranks: the gathered logits of the first forward (after a prompt longer than
    the sliding window) and of a self-conditioned one within 1e-4 of their standard deviation
    of transformers'; each rank holds well under the whole model."""
    from transformers import DiffusionGemmaForBlockDiffusion

    result = tmp_path / "rank0.pt"
    mp.spawn(_rank_entry, args=(distributed._free_port(), str(checkpoint), str(result)), nprocs=RANKS, join=True)
    logits, sizes = torch.load(result)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.config.canvas_length = 8
    prompt, canvas, previous = logits_inputs()
    with torch.no_grad():
        first = model(input_ids=prompt[None], decoder_input_ids=canvas)
        conditioned = model(cache=first.cache, decoder_input_ids=canvas, self_conditioning_logits=previous)
    for want, got in zip((first.logits, conditioned.logits), logits):
        assert float((want - got).abs().max()) <= 1e-4 * float(want.std())
    whole = sum(p.numel() for p in load_model(checkpoint, torch.float32, torch.device("meta")).model.parameters())
    assert all(size < 0.75 * whole for size in sizes)


def _unseeded(llm: LLM) -> list[tuple[list[int], int]]:
    """Two samples of a request that gives no seed (as `LLM.generate` and `dlm batch` send
    it, unresolved): the family seeds it `DEFAULT_CANVAS_SEED`, sample i with that seed + i."""
    return [(out.output_ids, out.nfe) for out in llm.generate(CASES[2][0], gen_length=24, n=2)]


def test_two_ranks_give_the_reference_ids(checkpoint: Path, expected: list) -> None:
    """Seeded, transformers' ids; unseeded, the single process's: the driver used to draw a
    random seed before the family's default applied, so every 2-rank answer differed."""
    with LLM(checkpoint, dtype="float32", device="cpu") as llm:
        single = _unseeded(llm)
    with LLM(checkpoint, dtype="float32", device="cpu", parallel=ParallelConfig(tensor_parallel_size=2)) as llm:
        assert llm.engine.tensor_parallel_size == 2
        got = [llm.generate(case[0], params(case))[0] for case in CASES]
        unseeded = _unseeded(llm)
    assert [(out.output_ids, out.nfe) for out in got] == expected
    assert unseeded == single and single[0] != single[1]


def test_cli_two_ranks(checkpoint: Path, expected: list) -> None:
    command = [sys.executable, "-m", "dlm", "generate", str(checkpoint), *cli_args(CASES[2]), "-tp", "2"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["tensor_parallel_size"] == 2
    assert (out["output_ids"], out["nfe"]) == expected[2]


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with tiny_server(checkpoint, session_home(tmp_path_factory), "-tp", "2") as proc:
        yield proc


def test_serve_two_ranks_batches_canvases(server: ServerProcess, expected: list) -> None:
    assert_concurrent_cases_match(server, expected)
