"""`--kv-cache-dtype int8`: the block-causal families' exact K/V cache stored as int8 with a
float32 scale per head vector (the deployment guides' KV-cache quantization). Compared in
float32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dlm.cli.estimate.plan import Serving, architecture_from_config, plan_memory
from dlm.cli.server.config import load_config
from dlm.engine.config import read_config_json
from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.registry import FAMILIES
from dlm.engine.runtime.kv_cache import INITIAL_CAPACITY, SequenceKVCache
from dlm.engine.tiny_models import ensure_tiny_model
from tests.generate_cli import generate_json
from tests.serving import app_client
from tests.weights_helpers import cli

BLOCK_CAUSAL = [f.name for f in FAMILIES if f.block_causal and f.engine]
OTHERS = [f.name for f in FAMILIES if not f.block_causal and f.engine]
HEADS, DIM = 2, 16


def filled(storage: str, n: int, seed: int = 0) -> tuple[SequenceKVCache, torch.Tensor, torch.Tensor]:
    """A one-layer cache with `n` positions of random keys and values (float32), stored in pieces."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(HEADS, n, DIM, generator=g), torch.randn(HEADS, n, DIM, generator=g)
    k[:, 3] = 0.0  # an all-zero head vector: its scale must not divide by zero
    cache = SequenceKVCache(1, HEADS, DIM, torch.float32, torch.device("cpu"), storage)
    for start in range(0, n, 100):  # grows past INITIAL_CAPACITY, copying what it holds
        cache.store(0, k[:, start : start + 100], v[:, start : start + 100])
        cache.advance(min(100, n - start))
    return cache, k, v


def test_int8_keeps_each_value_within_half_a_step_of_its_vector_scale() -> None:
    n = INITIAL_CAPACITY + 50
    cache, k, v = filled("int8", n)
    layer = cache.layer(0)
    assert layer is not None
    for stored, original in zip(layer, (k, v)):
        assert stored.dtype == torch.float32 and stored.shape == original.shape
        step = original.abs().amax(dim=-1, keepdim=True) / 127
        assert bool(((stored - original).abs() <= step / 2 + 1e-6).all())
    assert bool((layer[0][:, 3] == 0).all())


def test_int8_holds_one_byte_a_value_plus_a_float32_scale_per_vector() -> None:
    auto, _, _ = filled("auto", 300)
    int8, _, _ = filled("int8", 300)
    assert int8.nbytes * 4 * DIM == auto.nbytes * (DIM + 4)  # fp32: 4 bytes a value; int8: 1 + 4/DIM


@pytest.mark.parametrize("name", BLOCK_CAUSAL)
def test_every_block_causal_family_decodes_with_an_int8_cache(name: str) -> None:
    caches: dict[str, list[int]] = {}
    for storage in ("auto", "int8"):
        llm = LLM(f"tiny:{name}", dtype="float32", device="cpu", kv_cache_dtype=storage)
        assert llm.engine.loaded.kv_cache_dtype == storage
        sizes: list[int] = []

        def on_step(seqs: Any, sizes: list[int] = sizes) -> None:
            sizes.extend(s.cache.nbytes for s in seqs if getattr(s, "cache", None) is not None)

        out = llm.generate([5, 6, 7, 8], gen_length=40, on_step=on_step)[0]
        assert out.finish_reason in ("stop", "length") and len(out.completion_ids) <= 40
        caches[storage] = sizes
    assert caches["auto"] and max(caches["int8"]) < max(caches["auto"]) / 2  # fp32 to about a quarter


@pytest.mark.parametrize("name", OTHERS)
def test_a_family_without_the_block_cache_refuses_int8_before_loading(name: str) -> None:
    with pytest.raises(UsageError, match=f"block-causal families .*not {name}"):
        LLM(f"tiny:{name}", dtype="float32", device="cpu", kv_cache_dtype="int8")


def test_an_unknown_storage_is_a_setting_error() -> None:
    with pytest.raises(UsageError, match="kv_cache_dtype"):
        load_config(None, {"kv_cache_dtype": "fp8"}, environ={})


def test_the_estimate_plans_what_the_cache_holds() -> None:
    arch = architecture_from_config(read_config_json(ensure_tiny_model("tiny:sdar")))
    per_token = {kv: plan_memory(arch, [], Serving(kv_dtype=kv)).kv_bytes_per_token for kv in ("fp32", "int8")}
    c = arch.config
    vectors = 2 * c.full_attention_layers * c.num_kv_heads  # keys and values, per cached token
    assert per_token == {"fp32": vectors * c.head_dim * 4, "int8": vectors * (c.head_dim + 4)}


@pytest.mark.parametrize("storage", ["auto", "int8"])
def test_generate_json_reports_the_cache_storage_it_ran_with(storage: str) -> None:
    payload = generate_json("tiny:sdar", [5, 6, 7, 8], "--gen-length", "8", "--kv-cache-dtype", storage)
    assert payload["kv_cache_dtype"] == storage and payload["finish_reason"] in ("stop", "length")


def test_a_server_with_an_int8_cache_answers_and_says_so() -> None:
    with app_client({"model": "tiny:sdar", "warmup": False, "kv_cache_dtype": "int8", "dtype": "float32"}) as client:
        assert client.get("/health").json()["kv_cache_dtype"] == "int8"
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 16})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name", OTHERS)
def test_serve_refuses_int8_for_such_a_family_from_config_json(name: str) -> None:
    """`dlm serve tiny:llada --kv-cache-dtype int8` printed its configuration, bound its port
    and started the server before the load refused the setting; the other settings a
    checkpoint refuses (`ServeConfig.check_model`) stop it before anything starts."""
    from dlm.engine.config import load_config as model_config

    config = load_config(None, {"model": f"tiny:{name}", "kv_cache_dtype": "int8"}, environ={})
    with pytest.raises(UsageError, match="block-causal"):
        config.check_model(model_config(ensure_tiny_model(f"tiny:{name}")))
    load_config(None, {"model": "tiny:sdar", "kv_cache_dtype": "int8"}, environ={}).check_model(
        model_config(ensure_tiny_model("tiny:sdar"))
    )


@pytest.mark.parametrize("name", OTHERS)
def test_generate_batch_and_tensor_parallel_refuse_int8_for_such_a_family(name: str, tmp_path: Path) -> None:
    """The command lines that load a model refuse the setting for every family without the
    block cache as one `error:` line naming the family, exit 2, before anything is decoded
    (`dlm serve`'s refusal, `ServeConfig.check_model`, is the test above)."""
    prompt = ("--prompt-ids", "5,6,7", "--gen-length", "4", "--dtype", "float32", "--kv-cache-dtype", "int8")
    source = tmp_path / "in.jsonl"
    body = {"prompt": [5, 6, 7], "max_tokens": 4}
    source.write_text(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    for args in (
        ("generate", f"tiny:{name}", *prompt),
        ("generate", f"tiny:{name}", *prompt, "--tensor-parallel-size", "2"),
        ("batch", str(source), str(tmp_path / "out.jsonl"), "--model", f"tiny:{name}", "--kv-cache-dtype", "int8"),
    ):
        code, stdout, stderr = cli(*args)
        assert code == 2 and stdout == "", (args, stdout, stderr)
        assert stderr.startswith("error: kv_cache_dtype int8") and f"not {name}" in stderr, (args, stderr)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("name", BLOCK_CAUSAL)
def test_every_block_causal_family_decodes_the_same_int8_ids_through_every_entry_point(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compared in fp32, greedy: `LLM(kv_cache_dtype="int8")`, `dlm generate --kv-cache-dtype
    int8 --json`, a server with the setting (`return_token_ids`) and `dlm batch --kv-cache-dtype
    int8` give the same ids in the same forwards (tensor parallelism: tests/test_tp_generate.py).
    On the tiny checkpoints int8 and auto decode the same ids, so each entry point's caches are
    also seen to be made int8 (all run in this process)."""
    storages: list[str] = []
    make = SequenceKVCache.__init__

    def recorded(cache: SequenceKVCache, *args: Any, **kwargs: Any) -> None:
        make(cache, *args, **kwargs)
        storages.append("int8" if cache.quantized else "auto")

    def int8_caches_only() -> bool:
        made = set(storages)
        storages.clear()
        return made == {"int8"}

    monkeypatch.setattr(SequenceKVCache, "__init__", recorded)
    model, prompt = f"tiny:{name}", [5, 6, 7]
    with LLM(model, dtype="float32", device="cpu", kv_cache_dtype="int8") as llm:
        python = llm.generate(prompt, gen_length=16, temperature=0.0)[0]
    assert int8_caches_only()

    args = ("--prompt-ids", "5,6,7", "--gen-length", "16", "--temperature", "0", "--json")
    code, stdout, stderr = cli("generate", model, *args, "--dtype", "float32", "--kv-cache-dtype", "int8")
    assert code == 0, stderr
    generated = json.loads(stdout)
    assert generated["kv_cache_dtype"] == "int8" and int8_caches_only()  # as /health says it

    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    settings = {"model": model, "warmup": False, "kv_cache_dtype": "int8", "dtype": "float32"}
    with app_client(settings) as client:
        assert client.get("/health").json()["kv_cache_dtype"] == "int8"
        served = client.post("/v1/completions", json=body)
    assert served.status_code == 200, served.text
    assert int8_caches_only()

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    flags = ("--model", model, "--dtype", "float32", "--kv-cache-dtype", "int8")
    code, _, stderr = cli("batch", str(source), str(out), *flags)
    assert code == 0, stderr
    batched = json.loads(out.read_text())["response"]["body"]
    assert int8_caches_only()

    for answer in (served.json(), batched):
        assert answer["choices"][0]["token_ids"] == python.completion_ids == generated["completion_ids"]
        assert answer["usage"]["denoising_steps"] == python.nfe == generated["nfe"]


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCK_CAUSAL)
def test_two_ranks_with_an_int8_cache_decode_the_single_process_ids_on_every_block_causal_family(name: str) -> None:
    """Compared in fp32, from the registry (tests/test_tp_generate.py does it on its own
    checkpoints of some families; Fast-dLLM v2 had none): two gloo ranks, each quantizing
    its own KV heads, decode the ids and forwards of one process with the int8 cache."""
    from dlm.engine.parallel.distributed import ParallelConfig

    outputs = []
    for parallel in (None, ParallelConfig(tensor_parallel_size=2)):
        with LLM(f"tiny:{name}", dtype="float32", device="cpu", parallel=parallel, kv_cache_dtype="int8") as llm:
            out = llm.generate([5, 6, 7, 8], gen_length=16, temperature=0.0)[0]
        outputs.append((out.output_ids, out.nfe))
    assert outputs[1] == outputs[0]
