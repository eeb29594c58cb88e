"""Write checkpoints in the Hugging Face on-disk format: config.json plus safetensors,
single-file or sharded with `model.safetensors.index.json`.

Used for the embedded default model and by tests, which build tiny models in the exact
real formats because nothing may be downloaded at run time.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def save_checkpoint(
    directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], shards: int = 1
) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = list(tensors)
    if shards <= 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        return
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
        total += sum(tensors[n].numel() * tensors[n].element_size() for n in part)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def random_llada_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights named and shaped exactly as a LLaDA checkpoint's.

    Shaped so that decisions are informative: norms near 1, sharper q/k for
    position-dependent attention, a larger LM head so confidences spread.
    """
    g = torch.Generator().manual_seed(seed)
    d, f = config["d_model"], config["mlp_hidden_size"]
    v = config.get("embedding_size") or config["vocab_size"]
    hd = d // config["n_heads"]
    kv = (config.get("n_kv_heads") or config["n_heads"]) * hd

    def linear(out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_dim, in_dim, generator=g) * (gain / in_dim**0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=g)

    p = "model.transformer."
    tensors = {p + "wte.weight": torch.randn(v, d, generator=g), p + "ln_f.weight": norm()}
    for i in range(config["n_layers"]):
        b = f"{p}blocks.{i}."
        tensors.update({
            b + "attn_norm.weight": norm(),
            b + "q_proj.weight": linear(d, d, 2.0),
            b + "k_proj.weight": linear(kv, d, 2.0),
            b + "v_proj.weight": linear(kv, d),
            b + "attn_out.weight": linear(d, d),
            b + "ff_norm.weight": norm(),
            b + "ff_proj.weight": linear(f, d),
            b + "up_proj.weight": linear(f, d),
            b + "ff_out.weight": linear(d, f),
        })
    if not config.get("weight_tying", False):
        tensors[p + "ff_out.weight"] = linear(v, d, 4.0)
    return tensors


def llada_config(vocab_size: int, mask_token_id: int, eos_token_id: int, **overrides: Any) -> dict[str, Any]:
    """A complete LLaDA config.json with the reference's field names."""
    config: dict[str, Any] = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "activation_type": "silu",
        "block_type": "llama",
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 4,
        "mlp_hidden_size": 128,
        "vocab_size": vocab_size,
        "embedding_size": vocab_size,
        "max_sequence_length": 512,
        "rope": True,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "include_bias": False,
        "weight_tying": False,
        "mask_token_id": mask_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def random_dream_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights named and shaped exactly as a Dream (Qwen2-style) checkpoint's, shaped
    like `random_llada_tensors` so that decisions are informative."""
    g = torch.Generator().manual_seed(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd

    def linear(out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_dim, in_dim, generator=g) * (gain / in_dim**0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=g)

    tensors = {"model.embed_tokens.weight": torch.randn(v, d, generator=g), "model.norm.weight": norm()}
    for i in range(config["num_hidden_layers"]):
        b = f"model.layers.{i}."
        tensors.update({
            b + "input_layernorm.weight": norm(),
            b + "self_attn.q_proj.weight": linear(d, d, 2.0),
            b + "self_attn.q_proj.bias": 0.1 * torch.randn(d, generator=g),
            b + "self_attn.k_proj.weight": linear(kv, d, 2.0),
            b + "self_attn.k_proj.bias": 0.1 * torch.randn(kv, generator=g),
            b + "self_attn.v_proj.weight": linear(kv, d),
            b + "self_attn.v_proj.bias": 0.1 * torch.randn(kv, generator=g),
            b + "self_attn.o_proj.weight": linear(d, d),
            b + "post_attention_layernorm.weight": norm(),
            b + "mlp.gate_proj.weight": linear(f, d),
            b + "mlp.up_proj.weight": linear(f, d),
            b + "mlp.down_proj.weight": linear(d, f),
        })
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = linear(v, d, 4.0)
        tensors["lm_head.weight"][config["mask_token_id"]] = 0.0  # a trained model never predicts MASK
    return tensors


def dream_config(vocab_size: int, mask_token_id: int, eos_token_id: int, **overrides: Any) -> dict[str, Any]:
    """A complete Dream config.json with the reference's field names."""
    config: dict[str, Any] = {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "mask_token_id": mask_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config
