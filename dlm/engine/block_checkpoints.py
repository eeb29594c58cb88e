"""Tiny random-weight checkpoints of the block-causal families, in their real formats.

`tiny:FAMILY` (dlm/engine/tiny_models.py), tests and benchmarks need LLaDA2 / SDAR (dense and
MoE) / openPangu / Fast-dLLM v2 checkpoints with the real config fields and tensor names, and
nothing may be downloaded. Weights are random but shaped so decisions are informative (as the
reference fixtures are): norms near 1, sharper q/k, a larger LM head so confidences spread, a
nonzero expert bias. Which biases and norms a layer has is read from the family's record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dlm.engine.checkpoint_writer import RandomWeights, save_checkpoint
from dlm.engine.registry import family_for

SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 320,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}


def llada2_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        **SHAPE,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000.0,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_bias": False,
        "first_k_dense_replace": 1,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "routed_scaling_factor": 2.5,
        "score_function": "sigmoid",
        "norm_topk_prob": True,
        "moe_router_enable_expert_bias": True,
        "tie_word_embeddings": False,
        "mask_token_id": 319,
        "eos_token_id": 318,
        "pad_token_id": 318,
    }
    config.update(overrides)
    return config


def qwen_style_config(family: str, **overrides: Any) -> dict[str, Any]:
    """`sdar`, `sdar_moe`, `pangu` (model_type PanguEmbedded) or `fast_dllm_v2`
    (Fast_dLLM_Qwen)."""
    names = {
        "sdar": ("sdar", "SDARForCausalLM"),
        "sdar_moe": ("sdar_moe", "SDARMoeForCausalLM"),
        "pangu": ("PanguEmbedded", "PanguEmbeddedForCausalLM"),
        "fast_dllm_v2": ("Fast_dLLM_Qwen", "Fast_dLLM_QwenForCausalLM"),
    }
    model_type, arch = names[family]
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        **SHAPE,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "mask_token_id": 319,
        "eos_token_id": 318,
        "pad_token_id": 0,
        "block_size": 4,
        "attention_bias": False,
    }
    if family == "sdar_moe":
        config.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if family == "pangu":
        del config["block_size"], config["attention_bias"]
        config.update(bias=True, rope_theta=16000000.0)
        del config["mask_token_id"]  # the real config omits it: the family default is 45830
        config["vocab_size"] = 45840  # so that MASK 45830 is a real row
    if family == "fast_dllm_v2":
        # The hub's Qwen2.5-derived config: `bd_size` for the block, q/k/v biases implied (no
        # attention_bias field), remote code named in auto_map. The real file has no
        # mask_token_id (151665 is an argument of the reference's generate); the tiny one
        # must carry it, since its vocabulary is small.
        del config["block_size"], config["attention_bias"]
        layers = config["num_hidden_layers"]
        config.update(
            bd_size=8,
            hidden_act="silu",
            bos_token_id=config["eos_token_id"],
            pad_token_id=config["eos_token_id"],
            attention_dropout=0.0,
            initializer_range=0.02,
            layer_types=["full_attention"] * layers,
            max_window_layers=layers,
            use_sliding_window=False,
            sliding_window=None,
            use_cache=True,
            auto_map={
                "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                "AutoModel": "modeling.Fast_dLLM_QwenModel",
                "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
            },
        )
    config.update(overrides)
    return config


def family_config(family: str, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny `family` checkpoint (llada2_moe, sdar, sdar_moe, pangu, fast_dllm_v2)."""
    return llada2_config(**overrides) if family == "llada2_moe" else qwen_style_config(family, **overrides)


def random_block_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the tensor names of the config's family."""
    llada2 = config["model_type"] == "llada2_moe"
    r = RandomWeights(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    embed = "model.word_embeddings.weight" if llada2 else "model.embed_tokens.weight"
    t = {embed: r.normal(v, d), "model.norm.weight": r.norm(d), "lm_head.weight": r.linear(v, d, 8.0)}
    family = family_for(config)  # its record says which biases and norms the layers have
    qkv_bias, o_bias, qk_norm = (flag.read(config) for flag in (family.qkv_bias, family.o_bias, family.qk_norm))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = r.norm(d)
        t[p + "post_attention_layernorm.weight"] = r.norm(d)
        if llada2:
            t[p + "attention.query_key_value.weight"] = r.linear(q + 2 * kv, d, 2.0)
            t[p + "attention.dense.weight"] = r.linear(d, q)
            t[p + "attention.query_layernorm.weight"] = r.norm(hd, 2.0)
            t[p + "attention.key_layernorm.weight"] = r.norm(hd, 2.0)
        else:
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", d)):
                t[f"{p}self_attn.{name}.weight"] = r.linear(rows, q if name == "o_proj" else d, 2.0)
                if o_bias if name == "o_proj" else qkv_bias:
                    t[f"{p}self_attn.{name}.bias"] = r.bias(rows)
            if qk_norm:
                t[p + "self_attn.q_norm.weight"] = r.norm(hd, 2.0)
                t[p + "self_attn.k_norm.weight"] = r.norm(hd, 2.0)
        experts = config.get("num_experts") or 0
        moe = experts and i >= config.get("first_k_dense_replace", 0)
        if not moe:
            t.update(r.swiglu(p + "mlp.", d, f))
            continue
        t[p + "mlp.gate.weight"] = r.linear(experts, d, 2.0)
        if config.get("moe_router_enable_expert_bias"):
            t[p + "mlp.gate.expert_bias"] = r.bias(experts)
        for e in range(experts):
            t.update(r.swiglu(f"{p}mlp.experts.{e}.", d, config["moe_intermediate_size"]))
        if config.get("num_shared_experts"):
            shared = config["moe_intermediate_size"] * config["num_shared_experts"]
            t.update(r.swiglu(p + "mlp.shared_experts.", d, shared))
    return t


def write_tiny(directory: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny checkpoint of `family` (llada2_moe, sdar, sdar_moe, pangu, fast_dllm_v2) to `directory`."""
    config = family_config(family, **overrides)
    save_checkpoint(Path(directory), config, random_block_tensors(config, seed))
    return Path(directory)
