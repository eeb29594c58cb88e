"""Static-shape step forwards (dlm/engine/runtime/step_graphs.py): the CUDA-graph path's bucketing,
padding and buffers, exercised on CPU in "static" mode (no graphs exist on a CPU).

Ids through the static path equal the eager ids (fp32, exact comparison) for the bidirectional
families, solo and batched, with CFG; shapes beyond the buckets and cached rows run eagerly;
the choice of mode is explicit and CUDA-only under auto.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.runtime.runner import ModelRunner
from dlm.engine.runtime.step_graphs import MAX_GRAPH_TOKENS, WIDTH_GRANULE, ShapeBuckets, graph_mode

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 60))]


def test_buckets_round_up_to_static_shapes() -> None:
    buckets = ShapeBuckets(max_batch=8, max_width=512, min_picks=16, max_picks=32)
    assert buckets.shape(1, 10, 3) == (1, WIDTH_GRANULE, 16)
    assert buckets.shape(3, 65, 17) == (4, 2 * WIDTH_GRANULE, 32)
    assert buckets.shape(8, 512, 32) == (8, 512, 32)
    assert buckets.shape(9, 64, 16) is None  # more rows than the largest batch bucket
    assert buckets.shape(2, 513, 16) is None  # wider than the model's positions
    assert buckets.shape(2, 64, 33) is None  # more decided rows than a block
    wide = ShapeBuckets(max_batch=64, max_width=8192, min_picks=16, max_picks=32)
    assert wide.shape(8, MAX_GRAPH_TOKENS // 8, 16) is not None
    assert wide.shape(8, MAX_GRAPH_TOKENS // 8 + 1, 16) is None  # matmul-bound: eager


def test_mode_is_explicit_and_cuda_only_under_auto() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert graph_mode("auto", cpu) is None and graph_mode("auto", cuda) == "cuda"
    assert graph_mode("on", cpu) == "static" and graph_mode("on", cuda) == "cuda"
    assert graph_mode("off", cuda) is None
    with pytest.raises(UsageError) as err:
        graph_mode("always", cpu)
    assert err.value.field == "step_graphs"


def _ids(path: Path, graphs: str, params: GenerationParams) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", device="cpu")
    llm.engine.enable_step_graphs(graphs, max_batch=4)
    solo = [llm.engine.generate([p], params)[0].output_ids for p in PROMPTS]
    batched = [s.output_ids for s in llm.engine.generate(PROMPTS, params)]
    return solo + batched, llm


@pytest.mark.parametrize(("family", "cfg"), [("tiny_llada", 0.0), ("tiny_llada", 1.5), ("tiny_dream", 0.0)])
def test_static_path_gives_the_eager_ids(family: str, cfg: float, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    params = GenerationParams(gen_length=16, block_length=8, steps=8, cfg_scale=cfg)
    eager, _ = _ids(path, "off", params)
    static, llm = _ids(path, "on", params)
    assert static == eager
    runner = llm.engine.runner
    assert isinstance(runner, ModelRunner) and runner.graphs is not None
    assert runner.graphs.static_runs > 0 and runner.graphs.replays == 0  # no graphs on a CPU
    rows = 2 if cfg else 1  # CFG adds an unconditional row per request
    assert {shape[0] for shape in runner.graphs.slots} >= {rows, 4 * rows}  # solo and batched buckets


def test_cached_rows_and_block_families_run_eagerly(tiny_llada: Path) -> None:
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    assert llm.engine.enable_step_graphs("on", max_batch=4) == "static"
    runner = llm.engine.runner
    assert isinstance(runner, ModelRunner) and runner.graphs is not None
    llm.engine.generate([PROMPTS[0]], GenerationParams(gen_length=16, block_length=8, cache="dual"))
    assert runner.graphs.static_runs < 16  # the dual cache's block forwards read cached K/V: eager
    assert LLM(tiny_llada, dtype="float32", device="cpu").engine.enable_step_graphs("auto", 4) is None  # CPU
    assert LLM("tiny:sdar", dtype="float32", device="cpu").engine.enable_step_graphs("on", 4) is None


def test_the_serve_setting_is_checked_at_the_boundary() -> None:
    from dlm.cli.server.config import load_config

    assert load_config(None, {"step_graphs": "on"}).step_graphs == "on"
    with pytest.raises(UsageError, match="step_graphs"):
        load_config(None, {"step_graphs": "sometimes"})


def test_gpu_check_dry_run_covers_the_graph_path_on_cpu(gpu_check: Any) -> None:
    """`benchmarks/gpu_check.py --dry-run`'s step section, in process: its checks pass and
    its table has a row per batch size (timings are not asserted)."""
    import argparse

    args = argparse.Namespace(
        dry_run=True, batches=[1, 3], prompt=20, gen=16, block=8, steps=2, bandwidth=None, flops=None
    )
    rows, checks = gpu_check.step_benchmark(args)
    assert [r["batch"] for r in rows] == [1, 3]
    assert checks and all(ok for _, ok, _ in checks), checks
    assert all(r["forwards_per_s_on"] > 0 and r["tokens_per_s_on"] > 0 for r in rows)


def test_gpu_check_sections_are_named_and_checked(gpu_check: Any) -> None:
    """`--only` takes the sections a lent device runs one process each (docs/benchmarks.md),
    in any subset; a misspelt one is refused before any device time is spent."""
    import argparse

    assert gpu_check.sections("quantization, engine") == ["quantization", "engine"]
    assert set(gpu_check.SECTIONS) == {"kernels", "engine", "memory", "quantization", "bench", "step"}
    for bad in ("quantisation", "", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="sections are kernels, engine"):
            gpu_check.sections(bad)
