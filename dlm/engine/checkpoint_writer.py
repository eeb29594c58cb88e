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


def save_checkpoint(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = list(tensors)
    if shards <= 1:
        save_file(
            {n: tensors[n].contiguous() for n in names}, str(directory / "model.safetensors"), metadata={"format": "pt"}
        )
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


class RandomWeights:
    """Random tensors for tiny checkpoints, drawn from one seeded generator in call order (a
    writer fixes its values by the order in which it names tensors). Shaped so decisions are
    informative: norms near 1 (times `gain`), matrices scaled by gain/sqrt(fan-in) (sharper
    q/k with a gain above 1, a larger LM head so confidences spread), small biases."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def linear(self, out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
        return self.normal(out_dim, in_dim) * (gain / in_dim**0.5)

    def norm(self, size: int, gain: float = 1.0) -> torch.Tensor:
        return gain * (1.0 + 0.1 * self.normal(size))

    def bias(self, size: int) -> torch.Tensor:
        return 0.1 * self.normal(size)

    def swiglu(
        self, prefix: str, d: int, f: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    ) -> dict[str, torch.Tensor]:
        """A SwiGLU MLP's gate, up and down projections under the checkpoint's `names`."""
        gate, up, down = names
        return {
            prefix + f"{gate}.weight": self.linear(f, d),
            prefix + f"{up}.weight": self.linear(f, d),
            prefix + f"{down}.weight": self.linear(d, f),
        }


def random_llada_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights named and shaped exactly as a LLaDA checkpoint's (`RandomWeights`)."""
    r = RandomWeights(seed)
    d, f = config["d_model"], config["mlp_hidden_size"]
    v = config.get("embedding_size") or config["vocab_size"]
    hd = d // config["n_heads"]
    kv = (config.get("n_kv_heads") or config["n_heads"]) * hd
    p = "model.transformer."
    tensors = {p + "wte.weight": r.normal(v, d), p + "ln_f.weight": r.norm(d)}
    for i in range(config["n_layers"]):
        b = f"{p}blocks.{i}."
        tensors.update(
            {
                b + "attn_norm.weight": r.norm(d),
                b + "q_proj.weight": r.linear(d, d, 2.0),
                b + "k_proj.weight": r.linear(kv, d, 2.0),
                b + "v_proj.weight": r.linear(kv, d),
                b + "attn_out.weight": r.linear(d, d),
                b + "ff_norm.weight": r.norm(d),
                **r.swiglu(b, d, f, ("ff_proj", "up_proj", "ff_out")),
            }
        )
    if not config.get("weight_tying", False):
        tensors[p + "ff_out.weight"] = r.linear(v, d, 4.0)
    return tensors


def _with_tokens(
    config: dict[str, Any], mask_token_id: int, eos_token_id: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    """A family's fields, then the special tokens (EOS pads) and fp32, then the caller's overrides."""
    tokens = {"mask_token_id": mask_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}
    return {**config, **tokens, "torch_dtype": "float32", **overrides}


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
    }
    return _with_tokens(config, mask_token_id, eos_token_id, overrides)


def random_dream_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights named and shaped exactly as a Dream / DiffuCoder checkpoint's, in the
    Qwen2 layout (`model.layers.N.self_attn.q_proj.*`, `model.layers.N.mlp.gate_proj.weight`,
    ...): q/k/v biases, no o_proj bias (`RandomWeights`)."""
    r = RandomWeights(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or d // heads
    q, kv = heads * hd, (config.get("num_key_value_heads") or heads) * hd
    tensors = {"model.embed_tokens.weight": r.normal(v, d), "model.norm.weight": r.norm(d)}
    for i in range(config["num_hidden_layers"]):
        b = f"model.layers.{i}."
        tensors.update(
            {
                b + "input_layernorm.weight": r.norm(d),
                b + "self_attn.q_proj.weight": r.linear(q, d, 2.0),
                b + "self_attn.q_proj.bias": r.bias(q),
                b + "self_attn.k_proj.weight": r.linear(kv, d, 2.0),
                b + "self_attn.k_proj.bias": r.bias(kv),
                b + "self_attn.v_proj.weight": r.linear(kv, d),
                b + "self_attn.v_proj.bias": r.bias(kv),
                b + "self_attn.o_proj.weight": r.linear(d, q),
                b + "post_attention_layernorm.weight": r.norm(d),
                **r.swiglu(b + "mlp.", d, f),
            }
        )
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = r.linear(v, d, 4.0)
        if config.get("mask_token_id") is not None:  # a trained model never predicts MASK
            tensors["lm_head.weight"][config["mask_token_id"]] = 0.0
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
    }
    return _with_tokens(config, mask_token_id, eos_token_id, overrides)


def qwen3_5_moe_config(vocab_size: int, mask_token_id: int, eos_token_id: int, **overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3.5-MoE text config.json: Gated DeltaNet layers with gated full attention
    every fourth layer, routed + shared experts (the hybrid behind Clover)."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "attn_output_gate": True,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
    }
    return _with_tokens(config, mask_token_id, eos_token_id, overrides)


def clover_config(vocab_size: int, mask_token_id: int, eos_token_id: int, **overrides: Any) -> dict[str, Any]:
    """A tiny Clover (`clover_moe`) config.json: block diffusion over the Qwen3.5-MoE hybrid."""
    clover = {"architectures": ["CloverMoeForCausalLM"], "model_type": "clover_moe"}
    return qwen3_5_moe_config(vocab_size, mask_token_id, eos_token_id, **{**clover, **overrides})


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Random weights for the given names and shapes: norms near 1, matrices scaled by
    1/sqrt(fan-in), other vectors (biases, gates' parameters) small."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        if len(shape) >= 2:
            out[name] = t / shape[-1] ** 0.5
        elif "norm" in name:
            out[name] = 1.0 + 0.1 * t
        else:
            out[name] = 0.1 * t
    return out


def _swiglu(prefix: str, d: int, f: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (f, d), prefix + "up_proj.weight": (f, d), prefix + "down_proj.weight": (d, f)}


def random_qwen3_5_moe_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The Qwen3.5-MoE text hybrid behind Clover: Gated DeltaNet layers (`linear_attn.*`),
    gated full attention every `full_attention_interval`-th layer (q_proj emits query and
    gate), and 256-expert MoE with a sigmoid-gated shared expert. Experts are written one
    tensor per expert and projection, the per-expert on-disk form."""
    d, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["head_dim"]
    kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
    kd, vd = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv = 2 * kh * kd + vh * vd
    interval = config.get("full_attention_interval", 4)
    experts, fe, fs = config["num_experts"], config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        if (i + 1) % interval == 0:
            a = p + "self_attn."
            shapes.update(
                {
                    a + "q_proj.weight": (2 * heads * hd, d),
                    a + "k_proj.weight": (kv * hd, d),
                    a + "v_proj.weight": (kv * hd, d),
                    a + "o_proj.weight": (d, heads * hd),
                    a + "q_norm.weight": (hd,),
                    a + "k_norm.weight": (hd,),
                }
            )
        else:
            g = p + "linear_attn."
            shapes.update(
                {
                    g + "in_proj_qkv.weight": (conv, d),
                    g + "in_proj_z.weight": (vh * vd, d),
                    g + "in_proj_b.weight": (vh, d),
                    g + "in_proj_a.weight": (vh, d),
                    g + "conv1d.weight": (conv, 1, config["linear_conv_kernel_dim"]),
                    g + "dt_bias": (vh,),
                    g + "A_log": (vh,),
                    g + "norm.weight": (vd,),
                    g + "out_proj.weight": (d, vh * vd),
                }
            )
        shapes[p + "mlp.gate.weight"] = (experts, d)
        for e in range(experts):
            shapes.update(_swiglu(f"{p}mlp.experts.{e}.", d, fe))
        shapes.update(_swiglu(p + "mlp.shared_expert.", d, fs))
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, d)
    shapes["model.norm.weight"] = (d,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    return random_tensors(shapes, seed)
