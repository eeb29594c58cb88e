"""The hybrid's memory terms in `dlm estimate` (dlm/cli/estimate/plan.py, their one source): equal
to what a real HybridCache holds, shown in the plan's --json and table, and the
Qwen3.5-35B-A3B / Clover numbers they give."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from dlm.cli.estimate.plan import architecture_from_config
from dlm.cli.main import app
from dlm.engine.runtime.engine import load_model
from tests.hybrid_checkpoints import reference_model, save_reference


def test_estimate_terms_equal_a_real_cache(tmp_path: Path) -> None:
    directory = save_reference(reference_model(seed=1), tmp_path)
    loaded = load_model(directory, torch.bfloat16, torch.device("cpu"))
    model, tokens, batch = loaded.model, 21, 3
    cache = model.new_cache()
    with torch.inference_mode():
        _, states = model.forward_tokens(torch.arange(tokens)[None], torch.arange(tokens)[None], cache)
    cache.commit(states, tokens)

    result = CliRunner().invoke(
        app,
        [
            "estimate",
            str(directory),
            "--dtype",
            "bf16",
            "--batch",
            str(batch),
            "--context",
            "64",
            "--gen-length",
            "32",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    memory = json.loads(result.stdout)["memory_per_gpu"]
    seq = memory["per_sequence"]
    assert seq["linear_state_bytes"] > 0
    assert cache.nbytes == tokens * seq["kv_bytes_per_token"] + seq["linear_state_bytes"]
    rows = {r["name"]: r["bytes"] for r in memory["rows"]}
    assert rows["linear-attention state"] == batch * seq["linear_state_bytes"]
    assert rows["KV cache"] == batch * 64 * seq["kv_bytes_per_token"]

    table = CliRunner().invoke(
        app, ["estimate", str(directory), "--dtype", "bf16", "--context", "64", "--gen-length", "32"]
    )
    assert table.exit_code == 0, table.output
    assert "linear-attention state" in table.stderr and "whatever its length" in table.stderr


def test_clover_35b_terms() -> None:
    """transformers' Qwen3_5MoeTextConfig defaults (= Qwen3.5-35B-A3B, the Clover base)."""
    arch = architecture_from_config(
        {
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 248320,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "moe_intermediate_size": 512,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "shared_expert_intermediate_size": 512,
        }
    )
    assert arch.full_attention_layers == 10 and arch.linear is not None
    assert arch.kv_bytes_per_token(2) == 10 * 2 * 2 * 256 * 2  # 20 KiB per token in bf16
    # 30 layers x (conv ring 8192 x 3 x 2 B + S 32 x 128 x 128 x 4 B) = about 61.4 MiB per sequence
    assert arch.linear.state_bytes(2) == 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert arch.linear.state_bytes(2, tp=2) * 2 == arch.linear.state_bytes(2)  # heads split over TP
