"""Block-causal decoding on tiny checkpoints of every family, against literal oracles.

- exact cache == recomputing the whole prefix every step == the literal published loop;
- AR mode == a literal greedy causal loop, one token per forward;
- openPangu's rules (shifted logits, causal context and commit, sub-blocks);
- long prompts (chunked prefill, the cache grows), batching, validation, the CLI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.block_checkpoints import write_tiny
from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.runtime.block_batch import BlockBatch
from dlm.engine.runtime.kv_cache import SequenceKVCache
from tests.generate_cli import generate_json
from tests.oracles.block_reference_loop import masked_logits, reference_ar_generate, reference_block_generate

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llada2_moe", "sdar", "sdar_moe", "pangu", "fast_dllm_v2"]
PROMPT = list(range(5, 27))  # 22 tokens: not a multiple of the block, so grids differ


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLM]:
    return {f: LLM(write_tiny(tmp_path_factory.mktemp(f), f), dtype="float32", device="cpu") for f in FAMILIES}


def _run(llm: LLM, prompt: list[int], **kw: object):  # noqa: ANN202
    return llm.engine.generate([prompt], GenerationParams(**kw))[0]  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rule", [{"threshold": 0.6}, {}])
def test_exact_cache_matches_recompute_and_literal_loop(tiny: dict[str, LLM], family: str, rule: dict) -> None:
    llm = tiny[family]
    engine, model = llm.engine, llm.engine.loaded.model
    cached = _run(llm, PROMPT, gen_length=32, cache="block", **rule)
    recomputed = _run(llm, PROMPT, gen_length=32, cache="none", **rule)
    params = engine.validate(GenerationParams(gen_length=32, **rule), len(PROMPT))
    want, forwards = reference_block_generate(
        model, PROMPT, params, mask_id=engine.config.mask_token_id, eos_id=engine.config.eos_token_id
    )
    assert cached.generated_ids == recomputed.generated_ids == want
    assert recomputed.nfe == forwards
    assert cached.nfe <= forwards
    # With the cache, no forward re-feeds the prompt or a committed block.
    assert sum(cached.query_lengths) < sum(recomputed.query_lengths)


@pytest.mark.parametrize("family", FAMILIES)
def test_ar_mode_is_greedy_causal_decoding(tiny: dict[str, LLM], family: str) -> None:
    llm = tiny[family]
    cfg = llm.engine.config
    seq = _run(llm, PROMPT, gen_length=16, mode="ar", cache="block")
    want = reference_ar_generate(
        llm.engine.loaded.model, PROMPT, 16, mask_id=cfg.mask_token_id, eos_id=cfg.eos_token_id
    )
    assert seq.output_ids == want
    assert seq.nfe == len(want)  # one token per forward
    shifted = llm.engine.config.logits_shift  # the last row predicts: feed only the new token
    assert seq.query_lengths[1:] == [1 if shifted else 2] * (len(want) - 1)


def test_pangu_ar_and_diffusion_agree_at_one_token_per_step(tiny: dict[str, LLM]) -> None:
    llm = tiny["pangu"]
    ar = _run(llm, PROMPT, gen_length=16, mode="ar", cache="block")
    diffusion = _run(llm, PROMPT, gen_length=16, block_length=1, threshold=1.0, cache="block")
    assert diffusion.output_ids == ar.output_ids and diffusion.nfe == ar.nfe


def test_pangu_shift_causal_commit_and_sub_blocks(tiny: dict[str, LLM]) -> None:
    llm = tiny["pangu"]
    engine, model = llm.engine, llm.engine.loaded.model
    seq = engine.add_request(PROMPT, GenerationParams(gen_length=64, threshold=0.5, cache="block"))
    steps: list[list[int]] = []
    commit = seq.commit
    seq.commit = lambda pos, tok: (steps.append(pos.tolist()), commit(pos, tok))  # type: ignore[method-assign]
    while not seq.finished:
        engine.step()
    x = seq.canvas
    p = len(PROMPT)
    # Blocks start right after the prompt; each block's first token is the argmax of the
    # last row of a causal forward over everything before it (right-shifted logits), and
    # is decided alone by that (commit) forward.
    for s in (p, p + 32):
        causal = masked_logits(model, x[:s], torch.arange(s))
        assert int(causal[-1].argmax()) == int(x[s])
        assert [s] in steps
    # Inside a block, sub-blocks of 8 are decoded in order, one at a time.
    for positions in steps:
        assert len({(q - p) % 32 // 8 for q in positions}) == 1
    order = [(q - p) // 8 for positions in steps for q in positions]
    assert order == sorted(order)
    # The cache holds causal-context K/V: exactly those of a causal forward over the
    # committed tokens (the last block is never committed: nothing follows it).
    committed = seq.cached
    assert committed == p + 32
    fresh = SequenceKVCache(
        model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, torch.float32, torch.device("cpu")
    )
    ids, pos = x[None, :committed], torch.arange(committed)[None]
    with torch.inference_mode():
        model(BlockBatch(ids, pos, pos, torch.zeros(1, 0, dtype=torch.long), [fresh], [committed]))
    fresh.advance(committed)
    for layer in range(model.config.num_layers):
        for ours, want in zip(seq.cache.layer(layer), fresh.layer(layer)):
            assert torch.allclose(ours, want, atol=1e-5)


@pytest.mark.parametrize("family", ["sdar", "pangu"])
def test_long_prompt_chunked_prefill_grows_the_cache(tiny: dict[str, LLM], family: str) -> None:
    llm = tiny[family]
    prompt = [(7 * i) % 300 + 1 for i in range(3001)]
    cached = _run(llm, prompt, gen_length=8, block_length=4, threshold=0.6, cache="block")
    recomputed = _run(llm, prompt, gen_length=8, block_length=4, threshold=0.6, cache="none")
    assert cached.generated_ids == recomputed.generated_ids
    assert cached.query_lengths[0] == 2048  # the prompt is prefilled in chunks
    assert cached.cached >= 3000 and cached.cache.length == cached.cached
    live = (
        2
        * llm.engine.config.num_layers
        * cached.cache.length
        * llm.engine.config.num_kv_heads
        * llm.engine.config.head_dim
        * 4
    )
    assert live <= cached.cache.nbytes <= 2 * live  # grows by doubling: linear in the context


def test_batched_requests_match_single_runs(tiny: dict[str, LLM]) -> None:
    llm = tiny["llada2_moe"]
    prompts = [PROMPT, list(range(40, 85)), [3, 4, 5]]
    params = GenerationParams(gen_length=32, threshold=0.7, cache="block")
    together = llm.engine.generate(prompts, params)
    for prompt, seq in zip(prompts, together):
        assert seq.generated_ids == llm.engine.generate([prompt], params)[0].generated_ids


def test_a_forward_that_settles_nothing_fails_loudly(tiny: dict[str, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dlm.engine.runtime.block_runner.choose", lambda *args: torch.zeros(0, dtype=torch.long))
    with pytest.raises(RuntimeError, match="decided none of positions"):
        _run(tiny["sdar"], PROMPT, gen_length=8, block_length=4)


def test_validation(tiny: dict[str, LLM]) -> None:
    engine = tiny["sdar"].engine
    with pytest.raises(UsageError, match="bidirectional"):
        engine.validate(GenerationParams(gen_length=8, cache="prefix"), 5)
    with pytest.raises(UsageError, match="guidance"):
        engine.validate(GenerationParams(gen_length=8, cfg_scale=1.0), 5)
    assert engine.validate(GenerationParams(gen_length=8), 5).block_length == 4  # config block_size
    ar = engine.validate(GenerationParams(gen_length=8, mode="ar"), 5)
    assert (ar.block_length, ar.steps, ar.threshold) == (1, 8, None)
    with pytest.raises(UsageError, match="threshold does not apply to mode ar"):  # was silently dropped
        engine.validate(GenerationParams(gen_length=8, mode="ar", threshold=0.9), 5)
    with pytest.raises(UsageError, match="cache 'block'"):
        GenerationParams(gen_length=8, cache="block").validate(5, 100)  # bidirectional family


def test_cli_block_cache_and_ar_mode(tmp_path: Path) -> None:
    model = write_tiny(tmp_path / "sdar", "sdar")
    runner = CliRunner()
    outs = {}
    for flags in (["--cache", "block", "--threshold", "0.6"], ["--mode", "ar", "--cache", "block"]):
        outs[flags[1]] = generate_json(model, [5, 6, 7, 8, 9], "--gen-length", "8", *flags)
    outs["none"] = generate_json(model, [5, 6, 7, 8, 9], "--gen-length", "8", "--cache", "none", "--threshold", "0.6")
    assert outs["block"]["output_ids"] == outs["none"]["output_ids"]
    assert outs["ar"]["nfe"] == 8
    assert outs["ar"]["params"]["block_length"] == 1
    bad = runner.invoke(app, ["generate", str(model), "--prompt-ids", "5,6", "--cache", "dual"])
    assert bad.exit_code == 2 and "error:" in bad.output
