"""Train dlm's embedded default model: a tiny masked-diffusion LM in the LLaDA checkpoint format.

Everything is reproducible from this file alone (fixed seeds, no download):
  1. a task generator with checkable answers (2-digit addition and subtraction, copy, reverse,
     sort, key-value look-up and its helper `Where is b?`, templated question answering), split into training and
     held-out prompts by a hash of the prompt;
  2. a byte-level BPE tokenizer trained on that generator's text, with digits split one per
     token (arithmetic is learnable only if "27" is two tokens), saved with the special tokens
     and chat template of scripts/build_tokenizer.py; training starts on a smaller one and grows
     the model's vocabulary part way (see GROW_VOCAB_AT);
  3. LLaDA supervised fine-tuning from scratch: per example t ~ U(eps, 1], every answer token
     (the answer, then EOS padding) masked with probability t, cross-entropy averaged over the
     batch's masked answer tokens (not LLaDA's 1/t weight: see `Batcher`); the prompt is never
     masked; look-up through a curriculum of first-token batches (see FIRST_TOKEN_TASKS);
  4. the checkpoint written with dlm's own writer (dlm.engine.checkpoint_writer), then measured
     with dlm's own engine (engine.LLM, float32, default decoding settings) on held-out prompts.

The training model below is a plain PyTorch twin of dlm/engine/models/llada.py whose parameter
names are the checkpoint's, so its state dict is the checkpoint (tests/test_train_tiny_dllm.py
checks that the engine reads it back to the same logits).

    python scripts/train_tiny_dllm.py                 # train, save, evaluate (2 threads: 87 min here)
    python scripts/train_tiny_dllm.py --eval-only     # re-measure the shipped weights
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from build_tokenizer import SPECIALS  # noqa: E402  (sibling script)
from build_tokenizer import save as save_tokenizer  # noqa: E402

from dlm.engine.checkpoint_writer import llada_config, save_checkpoint  # noqa: E402
from dlm.engine.params import DEFAULTS  # noqa: E402

NAME = "dlm-tiny-tasks-llada"
OUT = ROOT / "dlm" / "engine" / "assets" / NAME
SEED = 20261201
INIT_STD = 0.02  # of every matrix's initial values, and of the rows a grown vocabulary adds
SHAPE = {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "mlp_hidden_size": 512}
MAX_LENGTH = 2048  # the context dlm serves it with (RoPE; trained on prompts of under 200 tokens)
# The BPE budget of the shipped tokenizer. At 512 the merges ran out before the capitals, spelled in
# up to 7 pieces, and qa's misses were capitals cut short (`Par`); at 640 the trainer stops at 619
# tokens, every capital is one token (two for New Delhi and Mexico City), and the first 512 tokens,
# ids included, are the 512-token tokenizer's, so every other task tokenizes as at 512.
VOCAB_SIZE = 640
# The model trains on the FIRST_VOCAB_SIZE tokenizer until GROW_VOCAB_AT, then grows its embedding
# and output tables to VOCAB_SIZE and trains on the full tokenizer. Two runs at 640 tokens from
# step 0 kept addition and subtraction on their plateau (22% and 14% after 30000 steps; 5% each at
# step 7000 in the other, with every initial value of the 512-token run), where runs that start at
# 512 tokens reach 100% (docs/tiny-model.md).
FIRST_VOCAB_SIZE = 512
GROW_VOCAB_AT = 10000
# Answer + EOS padding: most of the first 32-token block (the longest answer is 12 tokens; a
# 24-token region trains 1.5x faster than the whole block), or the whole default canvas.
ANSWER_REGIONS = (24, 128)
REGION_WEIGHTS = (0.9, 0.1)
HELD_OUT = 10  # one prompt in HELD_OUT (by hash) is never trained on
EPS = 1e-3
# Loss weight of the EOS padding after an answer's own EOS, relative to the answer's tokens:
# padding is 2-3 times as many tokens, trivial once learned, and at full weight it drowned the
# answer's gradient (copy still at 0% after 2200 steps).
PADDING_WEIGHT = 0.2

# ---------------------------------------------------------------------------------------------
# Tasks: each draws (question, answer) from a random.Random.

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Russia": "Moscow",
    "Turkey": "Ankara",
    "Australia": "Canberra",
}
COLOURS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a tomato": "red",
    "an orange": "orange",
    "a lemon": "yellow",
    "milk": "white",
    "a carrot": "orange",
}
QA_TEMPLATES = {
    "capital": (
        "What is the capital of {x}?",
        "Name the capital of {x}.",
        "Which city is the capital of {x}?",
        "The capital of {x} is?",
    ),
    "colour": ("What colour is {x}?", "What color is {x}?", "Which colour is {x}?", "Name the colour of {x}."),
}


def two_digit(rng: random.Random) -> int:
    return rng.randint(10, 99)


def addition(rng: random.Random) -> tuple[str, str]:
    a, b = two_digit(rng), two_digit(rng)
    return rng.choice((f"What is {a} + {b}?", f"{a} + {b} =", f"Add {a} and {b}.")), str(a + b)


def subtraction(rng: random.Random) -> tuple[str, str]:
    a, b = sorted((two_digit(rng), two_digit(rng)), reverse=True)
    return rng.choice((f"What is {a} - {b}?", f"{a} - {b} =", f"Subtract {b} from {a}.")), str(a - b)


def _letters(rng: random.Random) -> list[str]:
    return [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]


def copy(rng: random.Random) -> tuple[str, str]:
    items = " ".join(_letters(rng))
    return f"Copy: {items}", items


def reverse(rng: random.Random) -> tuple[str, str]:
    items = _letters(rng)
    return f"Reverse: {' '.join(items)}", " ".join(reversed(items))


def sort(rng: random.Random) -> tuple[str, str]:
    items = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    return f"Sort: {' '.join(map(str, items))}", " ".join(map(str, sorted(items)))


ORDINALS = ("first", "second", "third", "fourth")  # one per key a look-up table can hold


def _table(rng: random.Random) -> tuple[list[str], list[str], str]:
    """2-4 distinct one-letter keys with one-digit values, and the table as the prompt shows it."""
    keys = rng.sample(LETTERS, rng.randint(2, len(ORDINALS)))
    values = [str(rng.randint(0, 9)) for _ in keys]
    return keys, values, ", ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))


def lookup(rng: random.Random) -> tuple[str, str]:
    keys, values, table = _table(rng)
    i = rng.randrange(len(keys))
    return f"Given {table}. What is {keys[i]}?", values[i]


def where(rng: random.Random) -> tuple[str, str]:
    """Look-up's helper: finding the asked key among the listed ones is half of a look-up, and
    the half that forms first (see FIRST_TOKEN_TASKS)."""
    keys, _, table = _table(rng)
    i = rng.randrange(len(keys))
    return f"Given {table}. Where is {keys[i]}?", ORDINALS[i]


def qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(("capital", "capital", "colour"))
    table = CAPITALS if kind == "capital" else COLOURS
    x = rng.choice(sorted(table))
    return rng.choice(QA_TEMPLATES[kind]).format(x=x), table[x]


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "addition": addition,
    "subtraction": subtraction,
    "copy": copy,
    "reverse": reverse,
    "sort": sort,
    "lookup": lookup,
    "where": where,
    "qa": qa,
}
TASK_WEIGHTS = {
    "addition": 3,
    "subtraction": 3,
    "copy": 1,
    "reverse": 1.5,
    "sort": 1.5,
    "lookup": 1.5,
    "where": 1,
    "qa": 1,
}
# Look-up does not form under the masking above (48% after 20000 steps: chance is about 36%),
# nor alone with every answer token masked. It forms through a curriculum (docs/tiny-model.md)
# of first-token batches (the whole answer masked, loss on its first token only, a 4-token
# answer region): `Where is b?` alone, which teaches the match of the asked key against the
# listed keys, then look-up and Where half each, which teaches reading the value beside the
# matched key. Those batches start after MIX_FIRST_STEPS steps of the task mix alone (interleaved
# from step 0 they held every other task on its plateau for 7000 mix steps), then take one step
# in FIRST_TOKEN_EVERY: the first WHERE_FIRST_STEPS of them are Where alone.
FIRST_TOKEN_TASKS = {"lookup": 1, "where": 1}
MIX_FIRST_STEPS = 8000
FIRST_TOKEN_EVERY = 2
WHERE_FIRST_STEPS = 2500
# The learning rate holds after warm-up and decays (cosine, to a tenth) over this last share of
# the steps only: look-up forms late, and in the curriculum runs it formed at a constant lr.
DECAY_SHARE = 0.3
FIRST_TOKEN_REGION = 4


def held_out(question: str) -> bool:
    return zlib.crc32(question.encode()) % HELD_OUT == 0


def training_examples(rng: random.Random, mix: dict[str, float] = TASK_WEIGHTS) -> Iterator[tuple[str, str]]:
    names, weights = list(mix), list(mix.values())
    while True:
        q, a = TASKS[rng.choices(names, weights)[0]](rng)
        if not held_out(q):
            yield q, a


def evaluation_set(per_task: int, seed: int = SEED + 1) -> dict[str, list[tuple[str, str]]]:
    """Held-out (question, answer) pairs per task, distinct, in a fixed order."""
    rng = random.Random(seed)
    out: dict[str, list[tuple[str, str]]] = {}
    for name, task in TASKS.items():
        seen: dict[str, str] = {}
        for _ in range(200_000):
            q, a = task(rng)
            if held_out(q):
                seen.setdefault(q, a)
                if len(seen) == per_task:
                    break
        out[name] = list(seen.items())
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(directory: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(SEED)
    gen = training_examples(rng)
    corpus = [f"<|user|>\n{q}<|end|>\n<|assistant|>\n{a}" for q, a in (next(gen) for _ in range(20_000))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    save_tokenizer(tok, directory, MAX_LENGTH)


def load_tokenizer(directory: Path):  # noqa: ANN201  (a transformers tokenizer)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))


# ---------------------------------------------------------------------------------------------
# Training model: the LLaDA forward (dlm/engine/models/llada.py) in plain PyTorch, checkpoint names.


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        d, f, kv = c["d_model"], c["mlp_hidden_size"], c["n_kv_heads"] * (c["d_model"] // c["n_heads"])
        self.heads, self.kv_heads = c["n_heads"], c["n_kv_heads"]
        self.attn_norm, self.ff_norm = RMSNorm(d, c["rms_norm_eps"]), RMSNorm(d, c["rms_norm_eps"])
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d, False), nn.Linear(d, kv, False), nn.Linear(d, kv, False)
        self.attn_out = nn.Linear(d, d, False)
        self.ff_proj, self.up_proj, self.ff_out = nn.Linear(d, f, False), nn.Linear(d, f, False), nn.Linear(f, d, False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, -1).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        a = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask
        x = x + self.attn_out(a.transpose(1, 2).reshape(b, t, -1))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class Transformer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["d_model"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["n_layers"]))
        self.ln_f = RMSNorm(c["d_model"], c["rms_norm_eps"])
        self.ff_out = nn.Linear(c["d_model"], c["vocab_size"], False)


class Root(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.transformer = Transformer(c)


class TinyLLaDA(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.model = Root(c)
        hd = c["d_model"] // c["n_heads"]
        self.inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=INIT_STD)
            if name.endswith(("attn_out.weight", "ff_out.weight")) and "blocks" in name:
                p.data /= math.sqrt(2 * c["n_layers"])

    def grow_vocab(self, size: int, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> None:
        """Append rows for the tokens past the current vocabulary to the embedding and output
        tables (drawn like the initial ones), with fresh optimizer moments (see GROW_VOCAB_AT)."""
        t = self.model.transformer
        for table in (t.wte, t.ff_out):
            old = table.weight
            extra = torch.randn(size - old.shape[0], old.shape[1], generator=generator) * INIT_STD
            table.weight = nn.Parameter(torch.cat((old.data, extra)))
            state = optimizer.state.pop(old)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.cat((state[key], torch.zeros_like(extra)))
            optimizer.state[table.weight] = state
            for group in optimizer.param_groups:
                group["params"] = [table.weight if q is old else q for q in group["params"]]
        t.wte.num_embeddings = t.ff_out.out_features = size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        freqs = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = t.wte(ids)
        for blk in t.blocks:
            x = blk(x, cos, sin)
        return t.ff_out(t.ln_f(x))


# ---------------------------------------------------------------------------------------------
# Data to tensors


class Batcher:
    def __init__(self, tokenizer, config: dict, seed: int) -> None:  # noqa: ANN001
        self.tok = tokenizer
        self.eos, self.mask = config["eos_token_id"], config["mask_token_id"]
        self.rng = random.Random(seed)
        self.examples = training_examples(self.rng)
        self.where_alone = training_examples(self.rng, {"where": 1})
        self.first_token_examples = training_examples(self.rng, FIRST_TOKEN_TASKS)
        # Always the chat template: mixing in plain-text prompts (answer offsets that differ by
        # format) kept a 4-layer model from learning even to copy in 400 steps. It is rendered
        # once, around a placeholder, and a batch's prompts are tokenized in one call: rendering
        # it per prompt took a tenth of every training step.
        messages = [{"role": "user", "content": "\0"}]
        self.template = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def prompt_ids(self, questions: list[str]) -> list[list[int]]:
        texts = [self.template.replace("\0", q) for q in questions]
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def _canvas(self, pairs: list[tuple[str, str]], region: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clean ids, answer positions, loss importance) for one batch, all rows one length: each
        prompt, then its answer and EOS padding to `region` tokens past the longest prompt."""
        prompts = self.prompt_ids([q for q, _ in pairs])
        answers = [a + [self.eos] for a in self.tok([a for _, a in pairs], add_special_tokens=False)["input_ids"]]
        length = max(len(p) for p in prompts) + max(region, max(len(a) for a in answers))
        clean = torch.full((len(pairs), length), self.eos, dtype=torch.long)
        is_answer = torch.zeros(len(pairs), length, dtype=torch.bool)
        importance = torch.full((len(pairs), length), PADDING_WEIGHT)
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            clean[i, : len(p)] = torch.tensor(p)
            clean[i, len(p) : len(p) + len(a)] = torch.tensor(a)
            is_answer[i, len(p) :] = True
            importance[i, len(p) : len(p) + len(a)] = 1.0
        return clean, is_answer, importance

    def __call__(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(noisy ids, clean ids, loss weight per position) for one batch of the task mix."""
        pairs = [next(self.examples) for _ in range(size)]
        clean, is_answer, importance = self._canvas(pairs, self.rng.choices(ANSWER_REGIONS, REGION_WEIGHTS)[0])
        # Stratified noise levels (one per slice of (0, 1]): every batch spans all masking rates.
        u = (torch.arange(size) + torch.rand(size, generator=generator)) / size
        t = ((1 - EPS) * u + EPS)[torch.randperm(size, generator=generator)].unsqueeze(1)
        masked = is_answer & (torch.rand(clean.shape, generator=generator) < t)
        noisy = torch.where(masked, torch.full_like(clean, self.mask), clean)
        # No 1/t factor: LLaDA's 1/t weight is the ELBO's, but at this batch size the one lightly
        # masked row of each batch (t near 0, weight up to 1/EPS) dominated every step and the model
        # learned nothing in 400 steps. Answer tokens weigh 1, the padding after them PADDING_WEIGHT.
        weight = masked.float() * importance
        weight = weight / weight.sum().clamp(min=1e-9)
        return noisy, clean, weight

    def first_token(
        self, size: int, examples: Iterator[tuple[str, str]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A first-token batch: every answer position masked, the loss on each row's first answer
        token only (the batch kind of look-up's curriculum, see FIRST_TOKEN_TASKS)."""
        clean, is_answer, _ = self._canvas([next(examples) for _ in range(size)], FIRST_TOKEN_REGION)
        noisy = torch.where(is_answer, torch.full_like(clean, self.mask), clean)
        first = is_answer & ~is_answer.roll(1, dims=1)  # column 0 is always prompt
        return noisy, clean, first.float() / size

    def of_kind(self, kind: str, size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """One batch of a `batch_kind`."""
        if kind == "mix":
            return self(size, generator)
        return self.first_token(size, self.where_alone if kind == "where first" else self.first_token_examples)


def batch_kind(step: int) -> str:
    """The curriculum (FIRST_TOKEN_TASKS): the task mix alone, then one step in FIRST_TOKEN_EVERY a
    first-token batch, Where alone for the first WHERE_FIRST_STEPS of them."""
    since = step - MIX_FIRST_STEPS
    if since < 0 or since % FIRST_TOKEN_EVERY:
        return "mix"
    return "where first" if since // FIRST_TOKEN_EVERY < WHERE_FIRST_STEPS else "first token"


# ---------------------------------------------------------------------------------------------
# Save, verify, evaluate


def model_config(tokenizer) -> dict:  # noqa: ANN001
    vocab = tokenizer.get_vocab()
    return llada_config(
        len(vocab),
        vocab["<|mask|>"],
        vocab["<|endoftext|>"],
        **SHAPE,
        max_sequence_length=MAX_LENGTH,
        dlm_note="trained by scripts/train_tiny_dllm.py on synthetic tasks; see README.md",
    )


def save(model: TinyLLaDA, config: dict, tok_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if tok_dir != out:
            shutil.copyfile(tok_dir / name, out / name)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]}) + "\n"
    )
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_checkpoint(out, config, tensors)


def evaluate(
    directory: Path,
    per_task: int,
    batch: int = 64,
    dtype: str = "float32",
    quantization: str | None = None,
    **params: object,
) -> dict[str, float]:
    """Exact-match accuracy per task on held-out prompts, through dlm's engine (chat; fp32
    for the model card, other dtypes and quantized weights for benchmarks/quantization.py)."""
    from dlm.engine.llm import LLM

    llm = LLM(directory, dtype=dtype, device="cpu", quantization=quantization)
    scores: dict[str, float] = {}
    for name, pairs in evaluation_set(per_task).items():
        right = 0
        for i in range(0, len(pairs), batch):
            chunk = pairs[i : i + batch]
            outs = llm.generate([q for q, _ in chunk], chat=True, **params)
            right += sum(o.text.strip() == a for o, (_, a) in zip(outs, chunk, strict=True))
        scores[name] = right / len(pairs)
    return scores


def sha256s(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name not in ("README.md", "sha256sums.json")
    }


# ---------------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    work = Path(args.work)
    tok_dir, full_tok_dir = work / "tokenizer-first", work / "tokenizer"  # before GROW_VOCAB_AT, after
    build_tokenizer(tok_dir, FIRST_VOCAB_SIZE)
    build_tokenizer(full_tok_dir)
    tok = load_tokenizer(tok_dir)
    config = model_config(tok)
    model = TinyLLaDA(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {config['vocab_size']}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = min(60, args.steps // 10)

    decay_from = round(args.steps * (1 - DECAY_SHARE))

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = max(0, step - decay_from) / max(1, args.steps - decay_from)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    batcher = Batcher(tok, config, SEED)
    gen = torch.Generator().manual_seed(SEED)
    losses: dict[str, list[tuple[int, float]]] = {}  # (step, loss) per batch kind
    start = time.time()
    bar = tqdm(range(args.steps), desc="train", mininterval=5)
    for step in bar:
        if step == GROW_VOCAB_AT:
            tok_dir, tok = full_tok_dir, load_tokenizer(full_tok_dir)
            config = model_config(tok)
            model.grow_vocab(config["vocab_size"], opt, torch.Generator().manual_seed(SEED))
            batcher.tok = tok  # the same ids for the tokens both have; the task stream goes on
        kind = batch_kind(step)
        noisy, clean, weight = batcher.of_kind(kind, args.batch_size, gen)
        logits = model(noisy)
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), clean.view(-1), reduction="none")
        loss = (ce * weight.view(-1)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.setdefault(kind, []).append((step, loss.item()))
        if step % 20 == 0:
            recent = [v for _, v in losses[kind][-20:]]
            bar.set_postfix({kind: f"{sum(recent) / len(recent):.3f}"})
        if args.save_every and (step + 1) % args.save_every == 0:
            save(model, config, tok_dir, work / "checkpoint")
            (work / "losses.json").write_text(json.dumps(losses))
    minutes = (time.time() - start) / 60
    out = Path(args.out)
    save(model, config, tok_dir, out)
    (work / "losses.json").write_text(json.dumps(losses))
    plot_losses(losses, out / "loss.png")
    print(f"trained {args.steps} steps in {minutes:.1f} min -> {out}")
    report = {"steps": args.steps, "batch_size": args.batch_size, "threads": args.threads, "minutes": round(minutes, 1)}
    (work / "training.json").write_text(json.dumps(report, indent=2) + "\n")


def plot_losses(losses: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 50
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind, points in losses.items():
        steps, values = zip(*points, strict=True)
        smooth = [sum(values[max(0, i - window) : i + 1]) / (i + 1 - max(0, i - window)) for i in range(len(values))]
        ax.plot(steps, smooth, label=f"{kind} batches (mean of {window})")
    ax.set(xlabel="step", ylabel="mean masked-token cross-entropy", yscale="log", title=NAME)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


CARD = """# {name}

A tiny masked-diffusion language model in the LLaDA checkpoint format, trained to be dlm's embedded model.
It answers a handful of synthetic tasks with checkable answers, so a deployment that serves it
can be told from a broken one, and decoding settings can be compared at measured quality.
It knows nothing else: it is not a general chat model.

- **Architecture**: LLaDA (bidirectional LLaMA-style transformer), {layers} layers, d_model {d},
  {heads} heads ({kv_heads} KV heads), SwiGLU {mlp}, RoPE; {params:.2f}M parameters, float32
  safetensors ({megabytes:.1f} MB).
- **Tokenizer**: byte-level BPE, {vocab} tokens, digits split one per token; chat template
  `<|user|>\\n...<|end|>\\n<|assistant|>\\n`; EOS `<|endoftext|>`, MASK `<|mask|>`.
- **Data**: generated by `scripts/train_tiny_dllm.py` (fixed seed {seed}), nothing downloaded:
  2-digit addition and subtraction (non-negative results), copying and reversing 3-6 letters,
  sorting 3-6 digits, key-value look-up from the prompt (`Given a=3, b=5. What is b?`, 2-4 keys)
  and its helper task `Given a=3, b=5. Where is b?` (answered `first` to `fourth`), templated
  questions on 25 capitals and 10 colours. One prompt in {held_out} (by CRC32 of the prompt) is
  held out of training.
  Every prompt uses the chat template: use `--chat` (the chat endpoint does).
- **Training**: LLaDA supervised fine-tuning from scratch (answer tokens and EOS padding masked
  with probability t ~ U(0, 1], cross-entropy averaged over masked tokens; prompt never masked), {steps} steps of batch
  {batch}, AdamW, {minutes} minutes on {threads} CPU thread(s) of this project's 2-core machine.
  Look-up forms only through a curriculum of *first-token* batches (the whole answer masked, the
  loss on its first token): after {mix_first} steps of the task mix alone, one step in {every} is such
  a batch, the first {where_first} of them of `Where is b?` alone, the rest of look-up and `Where is b?`
  half each. {growth}The learning rate holds after warm-up and decays (cosine, to a tenth) over the last
  {decay:.0%} of the steps. Loss curve: `loss.png`.
- **Accuracy** (exact match on up to {per_task} held-out prompts per task, chat template, measured with
  dlm's engine in float32 at the default decoding settings: gen_length 128, block_length 32, one
  token per step, low-confidence remasking, temperature 0, no cache):

| task | accuracy | held-out prompts |
|---|---|---|
{table}

- **Licence**: Apache-2.0, like dlm; the training data is generated by the script.
- **Verification**: `sha256sums.json` holds the sha256 of every other file here.
- **Known-answer suite**: `suite.yaml` (`dlm validate URL --suite suite.yaml`).
"""

# The card's sentence on the vocabulary's growth, for a run long enough to reach it.
GROWTH = """The vocabulary grows from {first_vocab} to {vocab} tokens at step {grow_at} (new rows drawn
  like the initial ones): at {vocab} tokens from the start, arithmetic stayed on its plateau in two runs.
  """


def write_card(out: Path, training: dict, scores: dict[str, float], per_task: int) -> None:
    config = json.loads((out / "config.json").read_text())
    weights = out / "model.safetensors"
    params = weights.stat().st_size / 4 / 1e6
    counts = {task: len(pairs) for task, pairs in evaluation_set(per_task).items()}
    table = "\n".join(f"| {task} | {score:.1%} | {counts[task]} |" for task, score in scores.items())
    text = CARD.format(
        name=NAME,
        layers=config["n_layers"],
        d=config["d_model"],
        heads=config["n_heads"],
        kv_heads=config["n_kv_heads"],
        mlp=config["mlp_hidden_size"],
        params=params,
        megabytes=weights.stat().st_size / 1e6,
        vocab=config["vocab_size"],
        seed=SEED,
        held_out=HELD_OUT,
        steps=training["steps"],
        batch=training["batch_size"],
        minutes=training["minutes"],
        threads=training["threads"],
        mix_first=MIX_FIRST_STEPS,
        every=FIRST_TOKEN_EVERY,
        where_first=WHERE_FIRST_STEPS,
        growth=GROWTH.format(first_vocab=FIRST_VOCAB_SIZE, vocab=config["vocab_size"], grow_at=GROW_VOCAB_AT)
        if training["steps"] > GROW_VOCAB_AT
        else "",
        decay=DECAY_SHARE,
        per_task=per_task,
        table=table,
    )
    (out / "README.md").write_text(text)


SUITE_CASES = 4  # held-out prompts per task in the shipped known-answer suite
SUITE_MIN_PASS_RATE = 0.9


def write_suite(out: Path) -> None:
    """The known-answer suite of `dlm validate --suite default-model`: the first held-out
    prompts of each task as chat requests, exact answers as anchored patterns."""
    import yaml

    cases = [
        {
            "name": f"{task}-{i}",
            "messages": [{"role": "user", "content": q}],
            "expect": {"regex": rf"^\s*{re.escape(a)}\s*$"},
        }
        for task, pairs in evaluation_set(SUITE_CASES).items()
        for i, (q, a) in enumerate(pairs[:SUITE_CASES])
    ]
    header = f"# Known answers of {NAME} (written by scripts/train_tiny_dllm.py from held-out prompts).\n"
    # The length the accuracy is measured at (the engine's default), whatever the server's default.
    suite = {"defaults": {"max_tokens": DEFAULTS["gen_length"]}, "min_pass_rate": SUITE_MIN_PASS_RATE, "cases": cases}
    (out / "suite.yaml").write_text(header + yaml.safe_dump(suite, sort_keys=False, width=120))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30000)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=str(ROOT / "build" / "train_tiny_dllm"))
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--save-every", type=int, default=1000)
    parser.add_argument("--eval-only", action="store_true", help="measure the model in --out")
    parser.add_argument("--per-task", type=int, default=50, help="held-out prompts per task")
    parser.add_argument("--card-only", action="store_true", help="rewrite the model card from the last measurement")
    args = parser.parse_args()
    work, out = Path(args.work), Path(args.out)
    if not (args.eval_only or args.card_only):
        train(args)
    torch.set_num_threads(args.threads)
    if not args.card_only:
        scores = evaluate(out, args.per_task)
        print(json.dumps(scores, indent=2))
        (work / "accuracy.json").write_text(json.dumps(scores, indent=2) + "\n")
    scores = json.loads((work / "accuracy.json").read_text())
    write_card(out, json.loads((work / "training.json").read_text()), scores, args.per_task)
    write_suite(out)
    (out / "sha256sums.json").write_text(json.dumps(sha256s(out), indent=2) + "\n")


if __name__ == "__main__":
    main()
