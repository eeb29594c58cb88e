"""Clover's block diffusion (EXPERIMENTAL) on a tiny hybrid: the cached engine against a
literal recompute-everything oracle, previews leave the state alone, CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from tests.generate_cli import generate_json
from tests.hybrid_checkpoints import reference_model, save_reference

MASK, EOS = 159, 158
PROMPT = [5, 17, 42, 99, 3, 7, 11]


@pytest.fixture(scope="module")
def clover_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_reference(
        reference_model(seed=5),
        tmp_path_factory.mktemp("clover"),
        model_type="clover_moe",
        architectures=["CloverMoeForCausalLM"],
        mask_token_id=MASK,
        eos_token_id=EOS,
    )


def oracle(model, prompt: list[int], gen_length: int, threshold: float, block: int = 32) -> tuple[list[int], int]:  # noqa: ANN001
    """The Clover loop written literally: every preview recomputes the committed prefix from
    scratch (no cache reuse), then decides the block with the threshold rule."""
    canvas, start0, forwards = prompt + [MASK] * gen_length, len(prompt), 0
    for b in range(gen_length // block):
        s, e = start0 + b * block, start0 + (b + 1) * block
        while MASK in canvas[s:e]:
            cache = model.new_cache()
            _, states = model.forward_tokens(torch.tensor([canvas[:s]]), torch.arange(s)[None], None)
            cache.commit(states, s)
            hidden, _ = model.forward_tokens(torch.tensor([canvas[s:e]]), torch.arange(s, e)[None], cache, causal=False)
            probs = torch.softmax(model.logits(hidden[0]).double(), dim=-1)
            conf, token = probs.max(-1)
            masked = [i for i in range(block) if canvas[s + i] == MASK]
            best = max(masked, key=lambda i: conf[i].item())
            for i in masked:
                if i == best or conf[i].item() >= threshold:
                    canvas[s + i] = int(token[i])
            forwards += 1
        if EOS in canvas[s:e]:
            return canvas[start0:e], forwards
    return canvas[start0:], forwards


@pytest.mark.parametrize(("threshold", "gen_length"), [(0.02, 96), (1.0, 32)])
def test_cached_engine_matches_recompute_oracle(clover_dir: Path, threshold: float, gen_length: int) -> None:
    llm = LLM(clover_dir, dtype="float32", device="cpu")
    out = llm.generate(PROMPT, gen_length=gen_length, threshold=threshold)[0]
    with torch.inference_mode():
        expected, previews = oracle(llm.engine.loaded.model, PROMPT, gen_length, threshold)
    assert out.output_ids == expected
    blocks = len(expected) // 32
    # prefill + previews + a commit pass after every block but the last one decoded
    assert out.nfe == 1 + previews + (blocks - 1)
    assert out.query_lengths[0] == len(PROMPT) and set(out.query_lengths[1:]) == {32}
    if threshold == 1.0:
        assert previews == 32 * blocks  # one token per preview


def test_preview_passes_leave_the_recurrent_state_unchanged(clover_dir: Path) -> None:
    llm = LLM(clover_dir, dtype="float32", device="cpu")
    engine = llm.engine
    seq = engine.add_request(PROMPT, GenerationParams(gen_length=64, threshold=1.0))
    engine.step()  # prefill + first preview
    cache = seq.kv_cache  # the sequence holds its HybridCache
    snapshot = [
        (s.conv.clone(), s.recurrent.clone()) if hasattr(s, "conv") else (s[0].clone(), s[1].clone())
        for s in cache.layers
    ]
    for _ in range(5):
        engine.step()
    assert cache.length == len(PROMPT) and seq.block == 0
    for before, state in zip(snapshot, cache.layers):
        after = (state.conv, state.recurrent) if hasattr(state, "conv") else state
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    while seq.block == 0:
        engine.step()
    assert cache.length == len(PROMPT) + 32  # the commit pass advanced it by one block


def test_cli_generate_json(clover_dir: Path) -> None:
    data = generate_json(clover_dir, PROMPT, "--gen-length", "32", "--threshold", "0.02")
    assert len(data["output_ids"]) == 32 and MASK not in data["output_ids"]


def test_rejections(clover_dir: Path, tmp_path: Path) -> None:
    llm = LLM(clover_dir, dtype="float32", device="cpu")
    with pytest.raises(UsageError, match="32-token blocks"):
        llm.generate(PROMPT, gen_length=64, block_length=16)
    with pytest.raises(UsageError, match="guidance"):
        llm.generate(PROMPT, gen_length=32, cfg_scale=1.0)
    config = json.loads((clover_dir / "config.json").read_text())
    del config["mask_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="mask_token_id"):
        LLM(tmp_path, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def mask_loving_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seed 0 (which the fixture above avoids) with an LM head whose MASK row points along
    the mean final hidden state of a masked block: MASK is then every position's argmax, so
    a preview that may propose MASK commits it and never fills the block."""
    model = reference_model(seed=0)
    with torch.no_grad():
        hidden = model(torch.tensor([PROMPT + [MASK] * 32]), output_hidden_states=True).hidden_states[-1]
        mean = hidden[0, len(PROMPT) :].mean(0)
        model.lm_head.weight[MASK] = 3 * mean / mean.norm()
    return save_reference(
        model,
        tmp_path_factory.mktemp("clover_mask"),
        model_type="clover_moe",
        architectures=["CloverMoeForCausalLM"],
        mask_token_id=MASK,
        eos_token_id=EOS,
    )


def test_preview_never_commits_mask_and_finishes(mask_loving_dir: Path) -> None:
    llm = LLM(mask_loving_dir, dtype="float32", device="cpu")
    engine, model = llm.engine, llm.engine.loaded.model
    start = len(PROMPT)
    with torch.inference_mode():  # the precondition: the raw preview argmax is MASK everywhere
        cache = model.new_cache()
        _, states = model.forward_tokens(torch.tensor([PROMPT]), torch.arange(start)[None], None)
        cache.commit(states, start)
        hidden, _ = model.forward_tokens(
            torch.tensor([[MASK] * 32]), torch.arange(start, start + 32)[None], cache, causal=False
        )
        assert (model.logits(hidden[0]).argmax(-1) == MASK).all()
    seq = engine.add_request(PROMPT, GenerationParams(gen_length=32, threshold=1.0))
    bound = 1 + 32  # prefill, then one token per preview
    for _ in range(bound):
        if seq.finished:
            break
        engine.step()
    assert seq.finished, "the previews kept proposing MASK"
    assert MASK not in seq.output_ids and len(seq.output_ids) == 32
    assert seq.nfe == bound
