"""Rebuild dlm/engine/assets/tiny_tokenizer (the embedded default model's tokenizer).

A byte-level BPE trained on this repository's own Python and Markdown files, so the
result depends only on the repository. The shipped files are what dlm uses; this script
documents how they were made: `python scripts/build_tokenizer.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "dlm" / "engine" / "assets" / "tiny_tokenizer"
SPECIALS = ["<|endoftext|>", "<|mask|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus() -> list[str]:
    files = sorted(
        p for ext in ("*.py", "*.md") for p in ROOT.rglob(ext) if ".venv" not in p.parts and "assets" not in p.parts
    )
    return [p.read_text(errors="ignore") for p in files]


def save(tok: Tokenizer, directory: Path, max_length: int) -> None:
    """tokenizer.json, and a tokenizer_config.json naming the special tokens and the chat template
    (also used by scripts/train_tiny_dllm.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    save(tok, OUT, 2048)
    print(f"vocab {tok.get_vocab_size()} -> {OUT}")


if __name__ == "__main__":
    main()
