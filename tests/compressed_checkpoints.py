"""Tiny pre-quantized checkpoints in the compressed-tensors format, written with the
compressed-tensors library itself (the packer llm-compressor uses), from a dense checkpoint:
what a W8A16 / W4A16 release on the hub holds, without downloading one.

Every 2-D `.weight` of a linear layer is quantized (scales from the library's own
`calculate_qparams` over each row or group's range); the embedding, the LM head and the
routers are left dense and listed in `ignore`, as llm-compressor's recipes do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Checkpoint names of tensors that stay dense (embeddings, LM heads, routers), by suffix.
DENSE = ("wte.weight", "embed_tokens.weight", "word_embeddings.weight", "lm_head.weight", "mlp.gate.weight")
LLADA_HEAD = "model.transformer.ff_out.weight"


def compress(dense: Path, out: Path, bits: int, group_size: int | None = None) -> Path:
    """Write `dense` (a single-file checkpoint) as a compressed-tensors checkpoint in `out`:
    int8 per channel (format int-quantized) or int4 in groups (format pack-quantized)."""
    from compressed_tensors.compressors import IntQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = "channel" if group_size is None else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    fmt, compressor = (
        ("int-quantized", IntQuantizationCompressor) if bits == 8 else ("pack-quantized", PackedQuantizationCompressor)
    )
    tensors = load_file(str(dense / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.dim() != 2 or not name.endswith(".weight") or name.endswith(DENSE) or name == LLADA_HEAD:
            stored[name] = tensor
            continue
        rows = tensor.float().reshape(tensor.shape[0], -1, group_size or tensor.shape[1])
        scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
        layer = name.removesuffix(".weight")
        module = {"weight": tensor.float(), "weight_scale": scale, "weight_zero_point": zero}
        for key, value in compressor.compress(module, scheme).items():
            stored[f"{layer}.{key}"] = value.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(out / "model.safetensors"))
    config = json.loads((dense / "config.json").read_text())
    quantization = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=["lm_head", "re:.*mlp.gate$", "re:.*ff_out$"],
    )
    config["quantization_config"] = quantization.model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in dense.iterdir():
        if extra.name not in ("config.json", "model.safetensors") and extra.is_file():
            shutil.copyfile(extra, out / extra.name)
    return out
