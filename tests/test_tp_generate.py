"""Tensor parallelism end to end through the Python API: `LLM(parallel=...)` spawns the
worker ranks (gloo on CPU) and must decode exactly the ids of one process, for every
family, and with 4 ranks for an MoE family under both expert placements."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlm.engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint
from dlm.engine.llm import LLM
from dlm.engine.parallel.distributed import ParallelConfig
from dlm.engine.params import GenerationParams
from dlm.engine.registry import family_named
from tests.test_stop_string_forwards import LENGTH, late_stop
from tests.test_stop_string_forwards import PROMPT as TEXT
from tests.tiny_families import tiny_names
from tests.tp_checkpoints import PARAMS, PROMPT, write_family

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: write_family(tmp_path_factory.mktemp(f), f) for f in PARAMS}


def _decode(
    model: Path, family: str, parallel: ParallelConfig | None = None, kv_cache_dtype: str = "auto"
) -> tuple[list[int], int]:
    with LLM(model, dtype="float32", device="cpu", parallel=parallel, kv_cache_dtype=kv_cache_dtype) as llm:
        out = llm.generate(PROMPT, **PARAMS[family])[0]
    return out.output_ids, out.nfe


@pytest.mark.parametrize("family", list(PARAMS))
def test_two_ranks_decode_the_single_process_ids(checkpoints: dict[str, Path], family: str) -> None:
    single = _decode(checkpoints[family], family)
    assert _decode(checkpoints[family], family, ParallelConfig(tensor_parallel_size=2)) == single


@pytest.mark.parametrize("family", [f for f in PARAMS if family_named(f).block_causal])
def test_two_ranks_with_an_int8_kv_cache_decode_the_single_process_ids(
    checkpoints: dict[str, Path], family: str
) -> None:
    """Each rank quantizes its own KV heads, each head vector with its own scale: the same
    int8 values as one process (--kv-cache-dtype int8 reaches every rank)."""
    single = _decode(checkpoints[family], family, kv_cache_dtype="int8")
    assert _decode(checkpoints[family], family, ParallelConfig(tensor_parallel_size=2), "int8") == single


def test_four_ranks_moe_with_tensor_parallel_experts(checkpoints: dict[str, Path]) -> None:
    """4 ranks, each with a quarter of every expert (at 2 ranks `auto` placed whole experts:
    expert parallelism); the 2 KV heads are replicated, one per pair of ranks."""
    single = _decode(checkpoints["llada2_moe"], "llada2_moe")
    assert _decode(checkpoints["llada2_moe"], "llada2_moe", ParallelConfig(tensor_parallel_size=4, moe="tp")) == single


def _scheduled(engine, prompts: list[list[int]], params: GenerationParams) -> list[list[int]]:  # noqa: ANN001
    """A serving scheduler's pattern: make sequences, admit them into `running` directly,
    abort one mid-way, admit a late one, step until the rest finish."""
    first, doomed, late = (engine.make_sequence(p, params) for p in prompts)
    engine.add(first)
    engine.add(doomed)
    engine.step()
    engine.abort(doomed)
    engine.add(late)
    while engine.running:
        engine.step()
    return [first.output_ids, late.output_ids, [doomed.finish_reason]]


def test_driver_mirrors_admission_and_aborts(checkpoints: dict[str, Path]) -> None:
    prompts, params = [PROMPT, PROMPT[:9], PROMPT[3:]], GenerationParams(**PARAMS["sdar"])
    single = _scheduled(LLM(checkpoints["sdar"], dtype="float32", device="cpu").engine, prompts, params)
    with LLM(checkpoints["sdar"], dtype="float32", device="cpu", parallel=ParallelConfig(2)) as llm:
        assert _scheduled(llm.engine, prompts, params) == single


def test_two_ranks_infill_sample_and_report_logprobs_as_one_process(checkpoints: dict[str, Path]) -> None:
    """suffix, n seeded samples and logprobs (the LM head's vocabulary shards gathered on
    every rank for the committing step's log-softmax) give the single process's answers."""
    extra = dict(suffix=(3, 4, 5), n=2, seed=9, temperature=1.0, logprobs=2)

    def run(parallel: ParallelConfig | None) -> list:
        with LLM(checkpoints["llada"], dtype="float32", device="cpu", parallel=parallel) as llm:
            return llm.generate(PROMPT, **PARAMS["llada"], **extra)

    single, split = run(None), run(ParallelConfig(tensor_parallel_size=2))
    assert [o.output_ids for o in split] == [o.output_ids for o in single]
    for a, b in zip(split, single):
        assert a.logprobs is not None and b.logprobs is not None
        assert [t.token for t in a.logprobs] == [t.token for t in b.logprobs]
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-5)
        assert [[i for i, _ in t.top] for t in a.logprobs] == [[i for i, _ in t.top] for t in b.logprobs]


def test_two_ranks_with_packed_bf16_weights_decode_the_plain_weights_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bf16 (what packing applies to; the comparison is exact), each rank packs the shard
    it read (dlm/kernels/packed_linear.py): the same ids as two ranks holding plain shards
    (`DLM_KERNELS=torch`, inherited by the workers). The layers are wide enough that every
    rank's shard is above the packing floor (`MIN_WEIGHTS`); where this CPU packs nothing
    both runs are plain and the test still checks that two ranks decode in bf16."""
    config = llada_config(
        vocab_size=300, mask_token_id=299, eos_token_id=298, d_model=1024, n_heads=8, n_kv_heads=4,
        mlp_hidden_size=2048, n_layers=1,
    )  # fmt: skip
    save_checkpoint(tmp_path, config, random_llada_tensors(config, seed=3))
    ids = {}
    for kernels in ("auto", "torch"):
        monkeypatch.setenv("DLM_KERNELS", kernels)
        with LLM(tmp_path, dtype="bfloat16", device="cpu", parallel=ParallelConfig(2)) as llm:
            out = llm.generate(PROMPT, **PARAMS["llada"])[0]
        ids[kernels] = (out.output_ids, out.nfe)
    assert ids["auto"] == ids["torch"]


def _stopped(name: str, stop: str, parallel: ParallelConfig | None = None) -> tuple[str | None, list[int], str, int]:
    with LLM(f"tiny:{name}", dtype="float32", device="cpu", parallel=parallel) as llm:
        out = llm.generate(TEXT, gen_length=LENGTH, stop=stop)[0]
    return out.text, out.completion_ids, out.finish_reason, out.nfe


@pytest.mark.parametrize("name", tiny_names())
def test_two_ranks_end_at_a_stop_string_as_one_process(name: str) -> None:
    """A stop string ends a tensor-parallel request where it ends a single process's
    (dlm/engine/stops.py): the same text, ids, finish reason and forwards. The requests are
    unseeded: DiffusionGemma's family seeds them (`DEFAULT_CANVAS_SEED`) at every size."""
    with LLM(f"tiny:{name}", dtype="float32", device="cpu") as llm:
        stop, forwards = late_stop(llm)
    single = _stopped(name, stop)
    assert single[2:] == ("stop", forwards)
    assert _stopped(name, stop, ParallelConfig(tensor_parallel_size=2)) == single
