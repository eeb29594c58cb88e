"""Checkpoints for the quantization tests: per natively decoded family, one whose layers
every method can take. The tiny models of most families can; two have layers whose input
features no int4 group divides (tiny:diffusion_gemma's 16-wide experts and 48-wide MLP,
tiny:clover's 48-wide shared expert), so int4 runs on the same recipes with those widths
doubled (the real checkpoints' widths are multiples of 128)."""

from __future__ import annotations

from pathlib import Path

from dlm.engine.registry import FAMILIES

# Every family dlm decodes natively, plus SDAR's MoE variant (Qwen3-MoE routing).
DECODED = sorted([f.name for f in FAMILIES if f.engine] + ["sdar_moe"])
# Families whose tiny model refuses int4, and the layer it names.
TINY_REFUSES_INT4 = {"clover": "shared_expert.down_proj", "diffusion_gemma": "experts.down_proj"}


def int4_checkpoint(family: str, directory: Path) -> str:
    """MODEL for `family` with layers int4 takes: `tiny:FAMILY`, or the tiny recipe widened."""
    if family not in TINY_REFUSES_INT4:
        return f"tiny:{family}"
    from dlm.engine.tiny_models import special_ids, write_builtin

    vocab, mask, eos = special_ids()
    if family == "clover":
        from dlm.engine.checkpoint_writer import clover_config, random_qwen3_5_moe_tensors

        config = clover_config(vocab, mask, eos, shared_expert_intermediate_size=64)
        tensors = random_qwen3_5_moe_tensors(config, seed=7)
    else:
        import json
        import tempfile

        from safetensors.torch import load_file

        from dlm.engine.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma

        with tempfile.TemporaryDirectory() as tmp:
            save_tiny_diffusion_gemma(
                Path(tmp),
                vocab_size=vocab,
                eos_token_id=eos,
                pad_token_id=eos,
                canvas_length=32,
                intermediate_size=64,
                moe_intermediate_size=32,
            )
            config = json.loads((Path(tmp) / "config.json").read_text())
            tensors = load_file(str(Path(tmp) / "model.safetensors"))
    return str(write_builtin(directory / family, config, tensors, f"# {family}, int4-ready widths\n"))
