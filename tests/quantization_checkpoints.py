"""Checkpoints for the quantization tests: per natively decoded family, one whose layers
every method can take. The tiny models of most families can; two have layers whose input
features no int4 group divides (tiny:diffusion_gemma's 16-wide experts and 48-wide MLP,
tiny:clover's 48-wide shared expert), so int4 runs on the same recipes with those widths
doubled (the real checkpoints' widths are multiples of 128)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dlm.engine.quantized_weights import dense, is_quantized
from dlm.engine.registry import FAMILIES

# Every family dlm decodes natively, plus SDAR's MoE variant (Qwen3-MoE routing).
DECODED = sorted([f.name for f in FAMILIES if f.engine] + ["sdar_moe"])
# The decodes the quantization checks run (tests/test_quantization.py, benchmarks/gpu_check.py).
PROMPT = list(range(5, 17))
# Short decodes: block families decode one 32-token block (their trained block size).
PARAMS = {f: dict(gen_length=32, threshold=0.2) for f in DECODED}
PARAMS |= {"llada": dict(gen_length=8, block_length=8, steps=4), "dream": dict(gen_length=8, block_length=8, steps=4)}
PARAMS["sdar"] = PARAMS["sdar_moe"] = dict(gen_length=8)
PARAMS["diffusion_gemma"] = dict(gen_length=32, seed=3)
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


def densify(model: nn.Module) -> int:
    """Replace every quantized weight by the dense matrix its kernel multiplies by: the
    model's dequantized twin. Returns how many weights were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for attr, child in list(module.named_children()):
            if isinstance(child, nn.ParameterList) and child and is_quantized(child[0]):
                stacked = torch.stack([dense(w) for w in child])
                delattr(module, attr)
                module.register_parameter(attr, nn.Parameter(stacked, requires_grad=False))
                replaced += len(child)
        for attr, param in list(module.named_parameters(recurse=False)):
            if is_quantized(param):
                setattr(module, attr, nn.Parameter(dense(param), requires_grad=False))
                replaced += 1
    return replaced
