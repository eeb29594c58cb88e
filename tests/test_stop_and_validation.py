"""EOS early stop with finish_reason, and the parameter combinations dlm rejects."""

from __future__ import annotations

from pathlib import Path

import pytest

import dlm.engine.runtime.runner as runner_module
from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.registry import FAMILIES
from tests.tiny_families import tiny_names

PROMPT = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def llada(tiny_llada: Path) -> LLM:
    return LLM(tiny_llada, dtype="float32", device="cpu")


@pytest.fixture
def eos_at(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the model 'predict' EOS at chosen absolute positions (random tiny weights never
    emit EOS on cue); everything else is the real forward."""
    positions: list[int] = []
    real = runner_module.token_stats

    def patched(seq, hidden, weight, *rest):  # type: ignore[no-untyped-def]
        stats = real(seq, hidden, weight, *rest)
        for i, p in enumerate(seq.positions_to_decide().tolist()):
            if p in positions:
                stats.token[i] = seq.eos_id
        return stats

    monkeypatch.setattr(runner_module, "token_stats", patched)
    return positions


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_eos_in_a_finished_block_stops_the_request(llada: LLM, eos_at: list[int], cache: str) -> None:
    eos = llada.config.eos_token_id
    eos_at.append(len(PROMPT) + 3)  # inside block 0 of 4
    params = dict(gen_length=32, steps=32, block_length=8, cache=cache)
    stopped = llada.generate(PROMPT, **params)[0]
    assert stopped.nfe == 8  # block 0's steps only
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids[3] == eos and stopped.output_ids[8:] == [eos] * 24
    full = llada.generate(PROMPT, early_stop=False, **params)[0]
    assert full.nfe == 32 and full.finish_reason == "stop"
    assert full.output_ids[:8] == stopped.output_ids[:8]


def test_no_eos_means_length(llada: LLM) -> None:
    out = llada.generate(PROMPT, gen_length=16, block_length=8)[0]
    assert llada.config.eos_token_id not in out.output_ids
    assert out.finish_reason == "length" and out.nfe == 16


LLADA, DREAM = FAMILIES[0], next(f for f in FAMILIES if f.name == "dream")


@pytest.mark.parametrize(
    ("family", "kwargs", "message"),
    [
        (LLADA, dict(cache="block"), "not available for llada"),
        (DREAM, dict(cache="block"), "not available for dream"),
        (LLADA, dict(cache="lru"), "cache must be one of"),
        (LLADA, dict(threshold=0.9, remasking="random"), "random remasking"),
        (LLADA, dict(factor=1.0, remasking="random"), "random remasking"),
        (LLADA, dict(cfg_scale=1.0, cache="dual"), "classifier-free guidance"),
        (LLADA, dict(alg="entropy"), "Dream-family"),
        (LLADA, dict(top_p=0.9), "Dream-family"),
        (DREAM, dict(remasking="random"), "for Dream choose alg"),
        (DREAM, dict(factor=1.0), "factor rule"),
        (DREAM, dict(cfg_scale=1.0), "classifier-free guidance"),
        (DREAM, dict(alg="greedy"), "alg must be one of"),
        (DREAM, dict(alg="entropy", threshold=0.9), "confidence_threshold"),
        (DREAM, dict(alg="origin", alg_temp=0.5), "alg_temp"),
        (DREAM, dict(top_p=1.5), "top_p"),
        (DREAM, dict(top_k=0), "top_k"),
        (DREAM, dict(eps=0.0), "eps"),
    ],
)
def test_invalid_combinations_are_rejected(family, kwargs: dict, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match=message):
        GenerationParams(**kwargs).validate(8, 512, family)


def test_dream_with_a_cache_gets_two_steps_per_block_at_least() -> None:
    """Its first step (the cache's refresh) commits only the block's first token: fewer steps
    are raised to two per block, not refused."""
    p = GenerationParams(gen_length=64, steps=2, block_length=32, cache="dual").validate(8, 512, DREAM)
    assert (p.steps_per_block, p.steps) == (2, 4)


def test_dream_defaults() -> None:
    assert GenerationParams().validate(8, 512, DREAM).alg == "entropy"
    p = GenerationParams(threshold=0.8).validate(8, 512, DREAM)
    assert (p.alg, p.threshold) == ("confidence_threshold", 0.8)
    assert GenerationParams(alg="confidence_threshold").validate(8, 512, DREAM).threshold == 0.9


def test_cli_reports_the_cache_and_its_cost(tiny_dream: Path) -> None:
    from tests.generate_cli import generate_json
    from tests.test_cli import dlm

    out = generate_json(tiny_dream, [1, 2, 3], "--gen-length", "16", "--block-length", "8", "--cache", "prefix")
    assert out["cache"] == "prefix" and out["params"]["alg"] == "entropy"
    assert out["query_lengths"][:2] == [19, 16] and out["tokens_fed"] == sum(out["query_lengths"])
    assert out["finish_reason"] in ("stop", "length")
    bad = dlm("generate", str(tiny_dream), "--prompt-ids", "1,2,3", "--cache", "block", "--dtype", "float32")
    assert bad.returncode == 2 and "error: cache 'block' is not available for dream" in bad.stderr


def test_auto_cache_is_the_familys_exact_cache() -> None:
    """No `cache` asked: block-causal families take their exact block cache (same tokens,
    less work); bidirectional ones recompute, since their caches are approximate."""
    from dlm.engine.registry import family_named

    params = GenerationParams(gen_length=32)
    for name, expected in (
        ("sdar", "block"),
        ("llada2_moe", "block"),
        ("pangu", "block"),
        ("llada", "none"),
        ("dream", "none"),
        ("clover", "none"),
    ):
        assert params.validate(4, 4096, family_named(name)).cache == expected, name
    with pytest.raises(UsageError, match="auto, none, prefix, dual, block"):
        GenerationParams(gen_length=32, cache="exact").validate(4, 4096, family_named("llada"))


@pytest.mark.parametrize("name", tiny_names())
def test_top_p_one_asks_for_nothing_on_every_family_and_entry_point(name: str) -> None:
    """`top_p: 1` filters nothing (OpenAI's default, which SDKs send): every family takes it,
    as if it were not given. Only the server accepted it (it dropped the field itself), while
    `dlm generate --top-p 1` and `LLM.generate(top_p=1.0)` refused it on every family but Dream
    ("top_p applies to Dream-family models"), and Dream decoded it on its filtering path."""
    from dlm.engine.config import load_config
    from dlm.engine.family_rules import validate
    from dlm.engine.tiny_models import ensure_tiny_model

    config = load_config(ensure_tiny_model(f"tiny:{name}"))
    plain = validate(GenerationParams(gen_length=8), 4, config)
    assert validate(GenerationParams(gen_length=8, top_p=1.0), 4, config) == plain
    assert validate(GenerationParams(gen_length=8, top_p=1), 4, config).top_p is None


def test_stop_strings_without_a_tokenizer_are_refused_alike(tmp_path: Path) -> None:
    """A checkpoint with no tokenizer has no text to search: `LLM.generate(stop=...)` refused
    it, a server took it and never matched (the answer ran to its length as if none were sent)."""
    from dlm.engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint
    from dlm.engine.errors import Unsupported
    from tests.serving import in_process_server

    config = llada_config(vocab_size=300, mask_token_id=299, eos_token_id=298)
    save_checkpoint(tmp_path / "bare", config, random_llada_tensors(config, 0))  # weights and config only
    llm = LLM(str(tmp_path / "bare"), dtype="float32", device="cpu")
    with pytest.raises(Unsupported, match="stop strings need the checkpoint's tokenizer") as python:
        llm.generate([5, 6, 7], gen_length=4, stop="x")
    with in_process_server(model=str(tmp_path / "bare"), dtype="float32", device="cpu", warmup=False) as client:
        answer = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "stop": "x"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"], error["message"]) == ("stop", "unsupported", str(python.value))
