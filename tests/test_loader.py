"""Loading: sharded == single file, bf16 works, and broken checkpoints fail by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm.engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint
from dlm.engine.config import load_config
from dlm.engine.errors import DlmError, UsageError
from dlm.engine.llm import LLM

PROMPT = [5, 17, 42, 99, 3, 7]


def _write(tmp: Path, shards: int) -> Path:
    config = llada_config(vocab_size=300, mask_token_id=299, eos_token_id=298, n_kv_heads=2)
    save_checkpoint(tmp, config, random_llada_tensors(config, seed=1), shards=shards)
    return tmp


def test_sharded_and_single_file_give_identical_outputs(tmp_path: Path) -> None:
    single = _write(tmp_path / "single", 1)
    sharded = _write(tmp_path / "sharded", 3)
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    a = LLM(single, dtype="float32", device="cpu").generate(PROMPT, gen_length=16, block_length=8)[0]
    b = LLM(sharded, dtype="float32", device="cpu").generate(PROMPT, gen_length=16, block_length=8)[0]
    assert a.output_ids == b.output_ids and a.nfe == b.nfe == 16


def test_bf16_loading(tiny_llada: Path) -> None:
    llm = LLM(tiny_llada, dtype="bfloat16", device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in llm.engine.loaded.model.parameters())
    out = llm.generate(PROMPT, gen_length=8, block_length=8)[0]
    assert len(out.output_ids) == 8 and 299 not in out.output_ids  # no MASK left


def test_weights_are_not_held_twice(tiny_llada: Path) -> None:
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    storages = {p.untyped_storage().data_ptr() for p in llm.engine.loaded.model.parameters()}
    assert len(storages) == len(list(llm.engine.loaded.model.parameters()))
    assert not any(p.is_meta for p in llm.engine.loaded.model.parameters())


def test_missing_tensor_is_named(tiny_llada: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llada, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.transformer.blocks.1.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(UsageError, match=r"blocks\.1\.k_proj\.weight"):
        LLM(broken, dtype="float32", device="cpu")


def test_misshaped_tensor_is_named(tiny_llada: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llada, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.transformer.ln_f.weight"] = torch.ones(7)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(UsageError, match=r"ln_f\.weight.*\(7,\)"):
        LLM(broken, dtype="float32", device="cpu")


def test_missing_shard_is_named(tmp_path: Path) -> None:
    sharded = _write(tmp_path / "sharded", 2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DlmError, match="model-00002-of-00002") as refused:
        LLM(sharded, dtype="float32", device="cpu")
    assert refused.value.exit_code == 1  # a damaged checkpoint: a failed operation, not bad usage


def test_unknown_model_type_names_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt9", "architectures": ["GPT9"]}))
    with pytest.raises(UsageError, match=r"unsupported model_type 'gpt9'.*llada"):
        load_config(tmp_path)


def test_config_normalisation(tiny_llada: Path) -> None:
    cfg = load_config(tiny_llada)
    assert (cfg.family, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llada", 64, 2, 4, 2)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.logits_size, cfg.head_dim) == (299, 298, 300, 16)
