"""Tiny Qwen3.5-MoE hybrid checkpoints written by transformers itself (`save_pretrained`),
so dlm's loader meets the real on-disk format, and the transformers model that wrote them
serves as the reference implementation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Both orders of the two mixers, so states pass in both directions.
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)


def reference_model(seed: int = 0, **overrides: Any) -> Any:
    """A transformers Qwen3_5MoeForCausalLM with every weight randomised (norm weights
    included, so the zero-centred (1 + w) scales are exercised), fp32, eval mode.

    Gains are moderate on purpose: the DeltaNet output norm rescales near-zero head outputs,
    which amplifies fp32 rounding; with much larger gains transformers' own fp32 and
    fp64 runs already differ by more than the 1e-4-of-std bound, which would test noise,
    not the implementation."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**{**TINY, **overrides})
    model = Qwen3_5MoeForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 4.0, generator=g).log())
            elif name.endswith("dt_bias") or p.dim() == 1:
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                # The last axis is the fan-in: linears, stacked experts, conv taps alike.
                p.copy_(torch.randn(p.shape, generator=g) * 0.9 / p.shape[-1] ** 0.5)
    return model


def save_reference(model: Any, directory: Path, **config_extra: Any) -> Path:
    """save_pretrained (per-expert tensors, flat text config), plus extra config fields."""
    model.save_pretrained(str(directory))
    if config_extra:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        config.update(config_extra)
        path.write_text(json.dumps(config, indent=2))
    return directory


def to_multimodal_layout(src: Path, dst: Path) -> Path:
    """Rewrite a text checkpoint the way Qwen3.5 releases ship: `qwen3_5_moe` with a nested
    `text_config`, weights under `model.language_model.`, experts stacked, an MTP tensor."""
    text = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            owner, rest = name.split(".mlp.experts.")
            index, proj, _ = rest.split(".")
            experts.setdefault(owner, {}).setdefault(int(index), {})[proj] = t
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    for owner, per in experts.items():
        owner = owner.replace("model.", "model.language_model.", 1)
        order = sorted(per)
        out[f"{owner}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((per[e]["gate_proj"], per[e]["up_proj"])) for e in order]
        )
        out[f"{owner}.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in order])
    out["mtp.fc.weight"] = torch.zeros(2, 2)  # multi-token-prediction head: must be ignored
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    text["model_type"] = "qwen3_5_moe_text"
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
