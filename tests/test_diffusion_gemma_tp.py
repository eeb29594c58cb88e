"""DiffusionGemma at tensor-parallel size 2 (two gloo CPU processes): query heads, dense and
expert intermediate features and the vocabulary split over the ranks, the single KV head of
the full-attention layers replicated; the canvases get transformers' ids and forward counts
(float32, seeded), as a single process does (tests/test_diffusion_gemma.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma
from engine.llm import LLM
from engine.parallel.distributed import ParallelConfig
from tests.diffusion_gemma_reference import CASES, params, reference_generate

pytestmark = pytest.mark.slow  # spawns ranks


def test_two_ranks_give_the_reference_ids(tmp_path: Path) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    checkpoint = save_tiny_diffusion_gemma(tmp_path / "tiny")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = [reference_generate(model, case[0], case, eos=1) for case in CASES]
    with LLM(checkpoint, dtype="float32", device="cpu", parallel=ParallelConfig(tensor_parallel_size=2)) as llm:
        assert llm.engine.tensor_parallel_size == 2
        got = [llm.generate(case[0], params(case))[0] for case in CASES]
    assert [(out.output_ids, out.nfe) for out in got] == expected
