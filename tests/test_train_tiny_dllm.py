"""scripts/train_tiny_dllm.py: what it trains is what dlm serves, and its data split holds.

The script trains a plain-PyTorch twin of the LLaDA model and saves its state dict as the
checkpoint; if the twin and dlm/engine/models/llada.py ever disagree, a trained model would be
served wrong. Compared in float32 on random weights (no training needed).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import train_tiny_dllm  # noqa: E402

from dlm.engine.tokenizer import encode  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    train_tiny_dllm.build_tokenizer(directory)
    return directory


def test_engine_computes_the_training_twins_logits_float32(tokenizer_dir: Path, tmp_path: Path) -> None:
    from dlm.engine.runtime.batch import ForwardBatch
    from dlm.engine.runtime.engine import load_engine

    torch.manual_seed(0)
    config = train_tiny_dllm.model_config(train_tiny_dllm.load_tokenizer(tokenizer_dir))
    twin = train_tiny_dllm.TinyLLaDA(config)
    with torch.no_grad():  # move every weight off its initial value (norms off 1)
        for p in twin.parameters():
            p.add_(0.05 * torch.randn_like(p))
    train_tiny_dllm.save(twin, config, tokenizer_dir, tmp_path / "model")
    engine = load_engine(tmp_path / "model", torch.float32, torch.device("cpu"))
    ids = torch.randint(0, config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(24).expand(2, 24)
    hidden = engine.loaded.model(ForwardBatch(ids, rows, None, rows, None))
    with torch.no_grad():
        expected = twin(ids)
    torch.testing.assert_close(hidden @ engine.loaded.model.lm_head_weight.T, expected, rtol=1e-5, atol=1e-5)


def test_the_first_tokenizer_is_the_full_ones_prefix(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Training switches tokenizers at GROW_VOCAB_AT without touching the data stream or the
    trained rows: that holds only if every token of the first keeps its id in the full one."""
    train_tiny_dllm.build_tokenizer(tmp_path, train_tiny_dllm.FIRST_VOCAB_SIZE)
    first = train_tiny_dllm.load_tokenizer(tmp_path).get_vocab()
    full = train_tiny_dllm.load_tokenizer(tokenizer_dir).get_vocab()
    assert len(first) == train_tiny_dllm.FIRST_VOCAB_SIZE < len(full) <= train_tiny_dllm.VOCAB_SIZE
    assert {token: full.get(token) for token in first} == first


def test_growing_the_vocabulary_keeps_the_trained_rows_and_their_optimizer_state() -> None:
    torch.manual_seed(0)
    shape = {**train_tiny_dllm.SHAPE, "d_model": 16, "n_layers": 1}
    config = train_tiny_dllm.llada_config(40, 39, 38, **shape)
    model = train_tiny_dllm.TinyLLaDA(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 40, (2, 8))
    model(ids).square().mean().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: opt.state[p]["exp_avg"].clone() for k, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(ids)
    model.grow_vocab(50, opt, torch.Generator().manual_seed(0))
    after = {k: v.clone() for k, v in model.state_dict().items()}
    for name, value in before.items():
        assert torch.equal(after[name][: value.shape[0]], value), name
    table = model.model.transformer.ff_out.weight
    assert table.shape == (50, 16) and torch.equal(
        opt.state[table]["exp_avg"][:40], moments["model.transformer.ff_out.weight"]
    )
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :40], logits, rtol=0, atol=0)
    opt.zero_grad()
    model(torch.randint(40, 50, (2, 8))).square().mean().backward()  # the new tokens, in and out
    opt.step()
    for name in ("model.transformer.wte.weight", "model.transformer.ff_out.weight"):
        assert not torch.equal(model.state_dict()[name][40:], after[name][40:]), f"{name}: new rows not trained"


def test_tokenizer_splits_digits_and_has_the_chat_template(tokenizer_dir: Path) -> None:
    tok = train_tiny_dllm.load_tokenizer(tokenizer_dir)
    pieces = tok.convert_ids_to_tokens(tok("What is 27 + 58?")["input_ids"])
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["2", "7", "5", "8"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_held_out_prompts_are_never_trained_on() -> None:
    held = {q for pairs in train_tiny_dllm.evaluation_set(20).values() for q, _ in pairs}
    examples = train_tiny_dllm.training_examples(random.Random(0))
    trained = {next(examples)[0] for _ in range(20_000)}
    assert held and not held & trained


def test_batched_prompts_are_the_chat_templates_tokens(tokenizer_dir: Path) -> None:
    """The batcher renders the template once and tokenizes a batch in one call (for speed); the
    ids must be the ones the chat endpoint produces for each prompt on its own."""
    tok = train_tiny_dllm.load_tokenizer(tokenizer_dir)
    config = train_tiny_dllm.model_config(tok)
    batcher = train_tiny_dllm.Batcher(tok, config, seed=0)
    examples = train_tiny_dllm.training_examples(random.Random(1))
    questions = [next(examples)[0] for _ in range(300)]
    expected = [encode(tok, q, chat=True) for q in questions]  # the engine's own chat encoding
    assert batcher.prompt_ids(questions) == expected


def test_first_token_batches_mask_the_whole_answer_and_score_its_first_token(tokenizer_dir: Path) -> None:
    """Look-up's curriculum batch: the prompt intact, every position after it masked, and the loss
    on exactly one position per row, the answer's first token."""
    tok = train_tiny_dllm.load_tokenizer(tokenizer_dir)
    config = train_tiny_dllm.model_config(tok)
    batcher = train_tiny_dllm.Batcher(tok, config, seed=0)
    pairs = [next(batcher.first_token_examples) for _ in range(64)]
    noisy, clean, weight = batcher.first_token(64, iter(pairs))
    assert {q.split(". ")[-1].split()[0] for q, _ in pairs} == {"What", "Where"}
    prompts = batcher.prompt_ids([q for q, _ in pairs])
    for row, (p, (_, answer)) in enumerate(zip(prompts, pairs, strict=True)):
        assert noisy[row, : len(p)].tolist() == p
        assert (noisy[row, len(p) :] == config["mask_token_id"]).all()
        assert weight[row].nonzero().flatten().tolist() == [len(p)]
        assert tok.decode(clean[row, len(p) : len(p) + 1]) == tok.decode(tok(answer)["input_ids"][:1])
    assert weight.sum().item() == pytest.approx(1.0)


def test_the_curriculum_starts_with_the_mix_then_interleaves_where_then_look_up() -> None:
    t = train_tiny_dllm
    kinds = [t.batch_kind(step) for step in range(t.MIX_FIRST_STEPS + t.FIRST_TOKEN_EVERY * (t.WHERE_FIRST_STEPS + 3))]
    mixed = kinds[t.MIX_FIRST_STEPS :]
    assert set(kinds[: t.MIX_FIRST_STEPS]) == {"mix"}
    assert mixed[:: t.FIRST_TOKEN_EVERY] == ["where first"] * t.WHERE_FIRST_STEPS + ["first token"] * 3
    assert mixed.count("mix") == len(mixed) * (t.FIRST_TOKEN_EVERY - 1) // t.FIRST_TOKEN_EVERY
