"""Tiny checkpoints of every natively decoded family, for the tensor-parallel tests, and
the decoding parameters each is run with. Shapes are chosen to be split: 4 query heads over
2 KV heads (so 2 ranks split the KV heads and 4 ranks replicate them), 8 experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlm.engine.block_checkpoints import write_tiny
from dlm.engine.checkpoint_writer import (
    dream_config,
    llada_config,
    random_dream_tensors,
    random_llada_tensors,
    save_checkpoint,
)

PROMPT = list(range(5, 27))
# Per family: generation parameters that exercise its decoding path (caches, threshold).
PARAMS: dict[str, dict[str, Any]] = {
    "llada": dict(gen_length=16, block_length=8, cache="prefix"),
    # Sampling with top-p: the one path that gathers the decided rows' logits.
    "dream": dict(gen_length=16, block_length=8, cache="dual", temperature=0.7, top_p=0.9, seed=1),
    "llada2_moe": dict(gen_length=32, threshold=0.6, cache="block"),
    "sdar": dict(gen_length=16, cache="block"),
    "sdar_moe": dict(gen_length=16, cache="none", threshold=0.6),
    "pangu": dict(gen_length=32, cache="block"),
    "clover": dict(gen_length=32, threshold=0.3),
}
# Checkpoint layouts loaded (not decoded) under tensor parallelism as well: the Qwen3.5-MoE
# release layout (experts stacked on disk, weights under `model.language_model.`).
LAYOUTS = ["qwen3_5_moe_stacked"]


def write_family(directory: Path, family: str) -> Path:
    if family in ("clover", "qwen3_5_moe_stacked"):
        from tests.hybrid_checkpoints import reference_model, save_reference, to_multimodal_layout

        text = save_reference(
            reference_model(seed=5), directory / "text", model_type="clover_moe", mask_token_id=159, eos_token_id=158
        )
        return text if family == "clover" else to_multimodal_layout(text, directory / "stacked")
    if family == "dream":
        config = dream_config(vocab_size=300, mask_token_id=299, eos_token_id=298)
        save_checkpoint(directory, config, random_dream_tensors(config, seed=3))
        return directory
    if family == "llada":
        config = llada_config(vocab_size=300, mask_token_id=299, eos_token_id=298, n_kv_heads=2)
        save_checkpoint(directory, config, random_llada_tensors(config, seed=3))
        return directory
    return write_tiny(directory, family, seed=3)
