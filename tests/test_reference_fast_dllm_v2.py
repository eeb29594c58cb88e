"""Fast-dLLM v2 against its authors' own `generate` (tests/data/fast_dllm_v2, made by
scripts/fast_dllm_v2_reference.py on the tiny checkpoint written here): the same ids and
forward counts for several prompts, thresholds, block / sub-block sizes and stop tokens,
through the engine, `engine.LLM`, `dlm generate` and (slow) `dlm serve` and 2 ranks. In
float32, as the vectors were made.

How the reference's counts map onto ours (docs/block-diffusion.md, Fast-dLLM v2):
- its `max_new_tokens` M decodes M / B blocks from the block that holds the prompt's end,
  i.e. dlm's absolute grid with `gen_length` M (M - B when the prompt ends inside a block);
- after its last block it spends one forward to predict one token past the grid; dlm's
  request ends at the grid, so it has neither that forward nor that token;
- for a prompt longer than a block that ends inside one, the reference prefills the whole
  blocks in a forward of their own; dlm feeds them with the first denoising step of the
  block holding the prompt's tail (block-causal attention makes the two the same), one
  forward fewer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.block_checkpoints import write_tiny
from dlm.engine.config import config_from_dict
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from tests.oracles.block_reference_loop import masked_logits

DATA = Path(__file__).parent / "data" / "fast_dllm_v2"
VECTORS: dict[str, Any] = json.loads((DATA / "vectors.json").read_text())
CASES = VECTORS["cases"]


def _id(case: dict[str, Any]) -> str:
    stop = "eos" if case["stop_token"] == VECTORS["eos_id"] else f"stop{case['stop_token']}"
    return f"p{len(case['prompt_ids'])}-b{case['block_size']}-thr{case['threshold']}-{stop}"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _checkpoint(directory: Path, **overrides: Any) -> Path:
    seed = VECTORS["checkpoint"]["seed"]
    path = write_tiny(directory, "fast_dllm_v2", seed=seed, **overrides)
    # The vectors hold for these weights only: a change of the writer must show as such.
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == VECTORS["weights_sha256"]
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("fast_dllm_v2"))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(checkpoint, dtype="float32", device="cpu")


def expected(case: dict[str, Any]) -> tuple[dict[str, Any], list[int], int, str]:
    """(dlm's parameters, its generated ids, its forwards, its finish reason) for a vector."""
    p, b, m = len(case["prompt_ids"]), case["block_size"], case["max_new_tokens"]
    params = dict(gen_length=m - b if p % b else m, block_length=b, threshold=case["threshold"])
    ids, nfe = case["generated_ids"], case["nfe"]
    merged_prefill = 1 if p > b and p % b else 0
    if p + len(ids) == p // b * b + m + 1:  # ran to the end: drop the token past the grid
        return params, ids[:-1], nfe - 1 - merged_prefill, "length"
    return params, ids, nfe - merged_prefill, "stop"


def test_sub_blocks_match_the_vectors() -> None:
    """dlm denoises a block in 4 sub-blocks; the vectors use the reference's sub-block size
    B / 4 (its default: 8 in a block of 32)."""
    assert all(c["small_block_size"] * 4 == c["block_size"] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_engine_reproduces_ids_and_forwards(llm: LLM, case: dict[str, Any]) -> None:
    params, ids, nfe, finish = expected(case)
    engine = llm.engine
    saved = engine.config
    engine.config = dataclasses.replace(saved, eos_token_ids=(case["stop_token"],))  # the stop vectors
    try:
        seq = engine.generate([case["prompt_ids"]], GenerationParams(cache="block", **params))[0]
    finally:
        engine.config = saved
    assert seq.generated_ids == ids
    assert seq.nfe == nfe
    assert seq.finish_reason == finish


def test_llm_api_and_cache_none_agree(llm: LLM) -> None:
    for case in CASES[::7]:
        params, ids, _, _ = expected(case)
        if case["stop_token"] != VECTORS["eos_id"]:
            continue
        out = llm.generate(case["prompt_ids"], cache="none", **params)[0]
        assert out.output_ids == ids[: params["gen_length"]]
        cached = llm.generate(case["prompt_ids"], **params)[0]  # --cache auto: the exact block cache
        assert (cached.cache, cached.output_ids) == ("block", out.output_ids)


def test_first_forward_logits(llm: LLM) -> None:
    """The reference's prefill forward (block-causal over whole blocks) in float32: within
    1e-4 of the logits' standard deviation."""
    tensors = load_file(str(DATA / "first_forward.safetensors"))
    x = tensors["input_ids"][0]
    block = VECTORS["first_forward"]["block_size"]
    ours = masked_logits(llm.engine.loaded.model, x, torch.arange(len(x)) // block * block)
    ref = tensors["logits"][0]
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.std().item()


def test_hub_config_reads_as_the_family() -> None:
    """The hub's config.json (no mask_token_id, `bd_size`, no attention_bias field) parses
    to the family's facts: MASK 151665, the block size, q/k/v biases without an o bias."""
    from dlm.engine.block_checkpoints import family_config

    raw = family_config("fast_dllm_v2", vocab_size=152064, eos_token_id=151645, bd_size=32)
    del raw["mask_token_id"]
    config = config_from_dict(raw)
    assert config.family == "fast_dllm_v2"
    assert (config.mask_token_id, config.block_length, config.logits_shift) == (151665, 32, 1)
    assert (config.qkv_bias, config.o_bias, config.qk_norm) == (True, False, False)


def test_cli_generate_reproduces_a_stop_and_a_length_vector(tmp_path: Path) -> None:
    runner = CliRunner()
    picks = [c for c in CASES if c["threshold"] == 0.7 and len(c["prompt_ids"]) == 19]
    assert {expected(c)[3] for c in picks} == {"stop", "length"}
    for case in picks:
        params, ids, nfe, finish = expected(case)
        model = _checkpoint(tmp_path / str(case["stop_token"]), eos_token_id=case["stop_token"])
        flags = [part for name, value in params.items() for part in (f"--{name.replace('_', '-')}", str(value))]
        args = ["generate", str(model), "--prompt-ids", ",".join(map(str, case["prompt_ids"])), *flags]
        result = runner.invoke(app, [*args, "--dtype", "float32", "--device", "cpu", "--json"])
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert (out["output_ids"], out["nfe"], out["finish_reason"]) == (ids[: params["gen_length"]], nfe, finish)


def _eos_cases() -> list[dict[str, Any]]:
    """The vectors whose stop token is the checkpoint's own EOS (they run to the length)."""
    return [c for c in CASES if c["stop_token"] == VECTORS["eos_id"]]


@pytest.mark.slow
def test_serve_reproduces_the_vectors(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> None:
    from tests.conftest import session_home
    from tests.serving import ServerProcess

    server = ServerProcess(
        [str(checkpoint), "--dtype", "float32", "--device", "cpu", "--no-warmup"], session_home(tmp_path_factory)
    )
    try:
        server.wait_ready()
        for case in _eos_cases():
            params, ids, nfe, finish = expected(case)
            body = {
                "prompt": case["prompt_ids"],
                "max_tokens": params["gen_length"],
                "block_length": params["block_length"],
                "threshold": params["threshold"],
                "temperature": 0,
                "return_token_ids": True,
            }
            response = server.http.post(server.url + "/v1/completions", json=body)
            assert response.status_code == 200, response.text
            got = response.json()
            assert got["choices"][0]["token_ids"] == ids[: params["gen_length"]], _id(case)
            assert got["usage"]["denoising_steps"] == nfe, _id(case)
            assert got["choices"][0]["finish_reason"] == finish
    finally:
        server.terminate()


@pytest.mark.slow
def test_two_ranks_reproduce_the_vectors(tmp_path: Path, checkpoint: Path) -> None:
    from dlm.engine.parallel.distributed import ParallelConfig

    stop = next(c for c in CASES if expected(c)[3] == "stop")
    stopping = _checkpoint(tmp_path / "stop", eos_token_id=stop["stop_token"])
    for directory, cases in ((checkpoint, _eos_cases()[::2]), (stopping, [stop])):
        with LLM(directory, dtype="float32", device="cpu", parallel=ParallelConfig(tensor_parallel_size=2)) as llm:
            for case in cases:
                params, ids, nfe, finish = expected(case)
                out = llm.generate(case["prompt_ids"], **params)[0]
                assert (out.output_ids, out.nfe, out.finish_reason) == (ids[: params["gen_length"]], nfe, finish)
