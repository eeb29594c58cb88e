"""Quantized weights (--quantization; dlm/engine/quantization.py, quantized_weights.py):
every family decodes under int8 and int4, a quantized model decodes exactly the ids of its
dequantized twin in fp32, batching stays invariant, and what cannot run is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.quantization import CHOICES, METHODS, method_named
from dlm.engine.quantized_weights import is_quantized, quantizable, storage_bytes, weight_bytes
from dlm.engine.registry import FAMILIES
from tests.quantization_checkpoints import DECODED, PARAMS, PROMPT, TINY_REFUSES_INT4, densify, int4_checkpoint
from tests.tiny_families import tiny_names

CPU_METHODS = [name for name, m in METHODS.items() if "cpu" in m.devices]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("int4_ready")
    return {f: int4_checkpoint(f, directory) for f in DECODED}


def test_every_registered_family_is_covered() -> None:
    """The matrix below is the registry's: a new family that decodes joins it."""
    assert {f.name for f in FAMILIES if f.engine} <= set(DECODED)
    assert set(CPU_METHODS) == {"int8", "int4"}


# The hybrid and the encoder-decoder take tens of seconds per decode on two shared cores.
SLOW_FAMILIES = ("clover", "diffusion_gemma")


@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FAMILIES else f for f in DECODED]
)
def test_decodes_the_ids_of_its_dequantized_twin(checkpoints: dict[str, str], family: str, method: str) -> None:
    """Quantized in fp32, the model decodes; replacing each quantized weight by the dense
    matrix it stands for decodes the same ids, so the quantized path (torchao's kernels,
    the per-expert MoE, the attention's query rows) computes what the weights say."""
    quantized = LLM(checkpoints[family], dtype="float32", device="cpu", quantization=method)
    model = quantized.engine.loaded.model
    names = quantizable(model)
    assert names and quantized.engine.loaded.quantization == method
    out = quantized.generate(PROMPT, **PARAMS[family])[0]
    assert len(out.output_ids) == PARAMS[family]["gen_length"]

    twin = LLM(checkpoints[family], dtype="float32", device="cpu", quantization=method)
    assert densify(twin.engine.loaded.model) >= len(names)
    assert not any(is_quantized(p) for p in twin.engine.loaded.model.parameters())
    assert twin.generate(PROMPT, **PARAMS[family])[0].output_ids == out.output_ids


@pytest.mark.parametrize("method", CPU_METHODS)
def test_every_quantizable_weight_is_quantized_and_only_those(method: str) -> None:
    """Linear layers and routed experts are quantized (experts one tensor per expert); the
    embedding, the LM head, routers and norms keep the model dtype; weight bytes follow the
    declared format exactly."""
    llm = LLM("tiny:llada2_moe", dtype="bfloat16", device="cpu", quantization=method)
    model = llm.engine.loaded.model
    m = METHODS[method]
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts.gate_up_proj, nn.ParameterList) and is_quantized(experts.gate_up_proj[0])
    assert len(experts.gate_up_proj) == llm.config.moe.num_experts
    assert is_quantized(model.model.layers[0].attention.query_key_value.weight)
    for kept in (model.lm_head.weight, model.model.embed().weight, model.model.layers[1].mlp.gate.weight):
        assert not is_quantized(kept) and kept.dtype == torch.bfloat16
    expected = 0
    for p in model.parameters():
        if is_quantized(p):
            expected += m.weight_bytes(p.shape[0], p.shape[1], 2, "cpu")
        else:
            expected += p.nbytes
    assert weight_bytes(model) == expected


def test_lm_head_keeps_its_chunked_statistics() -> None:
    """The LM head is not quantized, so the decided rows' statistics come from the same dense
    head, chunk by chunk, as without quantization (dlm.kernels.token_stats)."""
    plain = LLM("tiny:llada", dtype="float32", device="cpu")
    quantized = LLM("tiny:llada", dtype="float32", device="cpu", quantization="int8")
    assert torch.equal(plain.engine.loaded.model.lm_head_weight, quantized.engine.loaded.model.lm_head_weight)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_batch_of_four_equals_each_prompt_alone(method: str) -> None:
    """In bf16, the CPU serving dtype, under quantization: a request's ids do not depend on
    what else is in its batch (bidirectional and block-causal MoE)."""
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [100], [33, 44, 55, 66, 77, 88]]
    for spec, params in (
        ("tiny:llada", dict(gen_length=16, block_length=8, steps=8, cache="dual")),
        ("tiny:llada2_moe", dict(gen_length=32, threshold=0.3)),
    ):
        llm = LLM(spec, dtype="bfloat16", device="cpu", quantization=method)
        together = llm.generate(prompts, **params)
        for prompt, out in zip(prompts, together):
            assert out.output_ids == llm.generate(prompt, **params)[0].output_ids, (spec, prompt)


def test_int8_weights_are_a_quarter_of_fp32_and_int4_about_an_eighth() -> None:
    """The quantized layers' bytes, measured on the loaded model."""
    sizes = {}
    for method in (None, "int8", "int4"):
        model = LLM("tiny:sdar", dtype="float32", device="cpu", quantization=method).engine.loaded.model
        names = quantizable(model)
        params = dict(model.named_parameters())
        sizes[method] = sum(storage_bytes(params[n]) for n in names)
    assert sizes["int8"] / sizes[None] == pytest.approx(0.25, abs=0.02)  # + one fp32 scale per row
    assert sizes["int4"] / sizes[None] == pytest.approx(0.125 + 2 * 4 / 64 / 4, abs=0.01)  # fp32 scale+zero per 64


# --------------------------------------------------------------------------- refusals
def test_fp8_is_refused_on_a_cpu_before_loading() -> None:
    with pytest.raises(UsageError, match="fp8 needs a CUDA device.*runs on cpu"):
        LLM("tiny:llada", device="cpu", quantization="fp8")


def test_unknown_method_names_the_choices() -> None:
    with pytest.raises(UsageError, match="must be one of none, int8, int4, fp8, got 'int3'"):
        LLM("tiny:llada", device="cpu", quantization="int3")
    assert method_named("none") is None and CHOICES == ("none", "int8", "int4", "fp8")


def test_transformers_backend_is_refused(tmp_path: Path) -> None:
    """Its layers are the checkpoint's own: nothing dlm could quantize."""
    with pytest.raises(UsageError, match="--quantization needs the native backend"):
        LLM("tiny:llada", device="cpu", backend="transformers", quantization="int8")


@pytest.mark.parametrize("family", sorted(TINY_REFUSES_INT4))
def test_layers_int4_cannot_group_are_refused(family: str) -> None:
    """A layer whose input features no int4 group divides is named, before any weight loads;
    int8 (one scale per row) takes it."""
    with pytest.raises(UsageError, match=rf"int4 cannot quantize \S*{TINY_REFUSES_INT4[family]}.*\(128, 64, 32\)"):
        LLM(f"tiny:{family}", device="cpu", dtype="float32", quantization="int4")
    LLM(f"tiny:{family}", device="cpu", dtype="float32", quantization="int8")


# --------------------------------------------------------------------------- tensor parallelism
def _tp_decode(model: Path, family: str, method: str, ranks: int) -> list[int]:
    from dlm.engine.parallel.distributed import ParallelConfig
    from tests.tp_checkpoints import PARAMS as TP_PARAMS
    from tests.tp_checkpoints import PROMPT as TP_PROMPT

    parallel = ParallelConfig(tensor_parallel_size=ranks) if ranks > 1 else None
    with LLM(model, dtype="float32", device="cpu", parallel=parallel, quantization=method) as llm:
        return llm.generate(TP_PROMPT, **TP_PARAMS[family])[0].output_ids


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "llada2_moe"])
def test_two_ranks_decode_the_single_process_int8_ids(tmp_path: Path, family: str) -> None:
    """Each rank quantizes the shard it reads; a row split over ranks takes the whole row's
    scale (the ranks' row maxima gathered), so the ranks hold exactly the slices of the
    single-process int8 weights and decode its ids."""
    from tests.tp_checkpoints import write_family

    model = write_family(tmp_path, family)
    assert _tp_decode(model, family, "int8", 2) == _tp_decode(model, family, "int8", 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", tiny_names())
def test_two_ranks_decode_the_single_process_int8_ids_on_every_family(name: str) -> None:
    """Every family the registry decodes (`tiny_names`: a new family joins by itself), fp32:
    two gloo ranks quantizing their shards decode the ids and forwards of one process. (int4
    splits of the tiny models' 64-wide rows would cut groups: that refusal is tested below.)"""
    from dlm.engine.parallel.distributed import ParallelConfig

    outputs = []
    for parallel in (None, ParallelConfig(tensor_parallel_size=2)):
        with LLM(f"tiny:{name}", dtype="float32", device="cpu", parallel=parallel, quantization="int8") as llm:
            assert llm.quantization == "int8"
            out = llm.generate(PROMPT, gen_length=16)[0]
        outputs.append((out.output_ids, out.nfe))
    assert outputs[1] == outputs[0]


def test_a_rank_holds_the_slice_of_the_whole_int8_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of two, holding the left half of each row of a row-parallel weight: the row
    maxima of both halves are gathered, so its int8 data and scales are exactly the left
    half of the single-process quantization (a per-shard scale would differ)."""
    from dlm.engine import quantized_weights as qw

    gen = torch.Generator().manual_seed(0)
    full = torch.randn(32, 128, generator=gen)
    full[:, 100] = 9.0  # each row's largest magnitude lies in the other rank's half
    left, right = full[:, :64], full[:, 64:]
    monkeypatch.setattr(qw.parallel_state, "all_gather", lambda x: torch.stack((x, right.abs().amax(-1))))
    quantizer = qw.Quantizer(METHODS["int8"], {"w": 64}, frozenset({"w"}), torch.float32, torch.device("cpu"))
    mine, whole = quantizer("w", left), qw.quantize(METHODS["int8"], full, torch.device("cpu"), 128)
    assert torch.equal(mine.scale, whole.scale) and torch.equal(mine.qdata, whole.qdata[:, :64])


def test_a_rank_holds_the_slice_of_each_whole_int8_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacked experts [E, rows, inputs] split on their inputs (DiffusionGemma's experts under
    -tp 2, any MoE under --moe-parallel tp): the gathered row maxima are [E, rows], which
    torchao's 2-D scale rule refused at load ("Got input dim:3"); each expert of rank 0 now
    holds exactly the left half of that expert's single-process quantization."""
    from dlm.engine import quantized_weights as qw

    gen = torch.Generator().manual_seed(1)
    full = torch.randn(3, 32, 128, generator=gen)
    full[:, :, 100] = 9.0  # each row's largest magnitude lies in the other rank's half
    left, right = full[..., :64], full[..., 64:]
    monkeypatch.setattr(qw.parallel_state, "all_gather", lambda x: torch.stack((x, right.abs().amax(-1))))
    quantizer = qw.Quantizer(METHODS["int8"], {"w": 64}, frozenset({"w"}), torch.float32, torch.device("cpu"))
    mine = quantizer("w", left)
    assert isinstance(mine, nn.ParameterList) and len(mine) == 3
    for expert, whole in zip(mine, (qw.quantize(METHODS["int8"], e, torch.device("cpu"), 128) for e in full)):
        assert torch.equal(expert.scale, whole.scale) and torch.equal(expert.qdata, whole.qdata[:, :64])


@pytest.mark.slow
def test_two_ranks_decode_the_single_process_int4_ids(tmp_path: Path) -> None:
    """int4 groups are those of the whole row, and a rank's share of a row holds whole
    groups, so a split model holds the single-process int4 weights."""
    from dlm.engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint

    config = llada_config(300, 299, 298, d_model=256, n_heads=4, n_kv_heads=2, mlp_hidden_size=512)
    save_checkpoint(tmp_path, config, random_llada_tensors(config, seed=3))
    assert _tp_decode(tmp_path, "llada", "int4", 2) == _tp_decode(tmp_path, "llada", "int4", 1)


@pytest.mark.slow
def test_int4_split_that_would_cut_groups_is_refused(tmp_path: Path) -> None:
    """The tiny LLaDA's 64-input rows are one group of 64; two ranks would hold half a group."""
    from dlm.engine.parallel.distributed import ParallelConfig
    from tests.tp_checkpoints import write_family

    model = write_family(tmp_path, "llada")
    with pytest.raises(Exception, match=r"cannot split \S+ over tensor-parallel ranks: each rank's 32 of its 64"):
        LLM(model, dtype="float32", device="cpu", parallel=ParallelConfig(tensor_parallel_size=2), quantization="int4")


# --------------------------------------------------------------------------- dlm estimate
@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("family", DECODED)
def test_estimate_agrees_with_the_loaded_weight_bytes(checkpoints: dict[str, str], family: str, method: str) -> None:
    """`dlm estimate --quantization X` plans, from config.json alone, the weight bytes the
    loader then holds, within 5%, for every family (bf16, one rank)."""
    from dlm.cli.estimate.plan import Serving, architecture_from_config, parameter_components, plan_memory
    from dlm.engine.config import read_config_json
    from dlm.engine.resolve import resolve_model

    model = resolve_model(checkpoints[family])
    arch = architecture_from_config(read_config_json(model))
    measured, planned = {}, {}
    for q in (None, method):
        measured[q] = weight_bytes(LLM(model, dtype="bfloat16", device="cpu", quantization=q).engine.loaded.model)
        plan = plan_memory(arch, parameter_components(arch), Serving(dtype="bf16", quantization=q, device="cpu"))
        planned[q] = sum(r.bytes for r in plan.rows if r.name.startswith("weights:"))
    assert planned[method] == pytest.approx(measured[method], rel=0.05)
    # The tiny models are mostly embedding: the bytes quantization saves agree as well.
    assert planned[None] - planned[method] == pytest.approx(measured[None] - measured[method], rel=0.05)


@pytest.mark.parametrize("method", [name for name, m in METHODS.items() if "cuda" in m.devices])
@pytest.mark.parametrize("family", DECODED)
def test_cuda_plan_agrees_with_the_cuda_layout_of_every_weight(
    checkpoints: dict[str, str], family: str, method: str
) -> None:
    """`dlm estimate --device cuda` plans what the CUDA layouts hold, from config.json alone:
    each quantizable weight (every expert apart) at the method's CUDA bytes for its shape
    (int4: tinygemm pads inputs to 1024, which the tiny models feel 8-16x), the rest dense,
    within 5%. The layout's bytes against torchao's tensors on a GPU: benchmarks/gpu_check.py."""
    from dlm.cli.estimate.plan import Serving, architecture_from_config, parameter_components, plan_memory
    from dlm.engine.config import read_config_json
    from dlm.engine.resolve import resolve_model

    m = METHODS[method]
    dtype = m.dtypes.get("cuda", ("bfloat16",))[0]
    act = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    model = resolve_model(checkpoints[family])
    # int8 on the CPU quantizes the same weights, each expert apart: their true shapes
    loaded = LLM(model, dtype=dtype, device="cpu", quantization="int8").engine.loaded.model
    expected = 0
    for p in loaded.parameters():
        expected += m.weight_bytes(p.shape[0], p.shape[1], act, "cuda") if is_quantized(p) else p.nbytes
    arch = architecture_from_config(read_config_json(model))
    serving = Serving(dtype=dtype, quantization=method, device="cuda")
    plan = plan_memory(arch, parameter_components(arch), serving.resolved(arch))
    assert sum(r.bytes for r in plan.rows if r.name.startswith("weights:")) == pytest.approx(expected, rel=0.05)


def test_estimate_plans_per_device_and_refuses_what_the_device_cannot_run() -> None:
    """int4's padding is the device's (CUDA pads a 64-wide tiny layer's inputs to 1024, the
    CPU's packing none); fp8 and a CUDA int4 in fp32 are refused as `dlm serve` refuses them."""
    from dlm.cli.estimate.plan import Serving, architecture_from_config, parameter_components, plan_memory
    from dlm.engine.config import read_config_json
    from dlm.engine.resolve import resolve_model

    arch = architecture_from_config(read_config_json(resolve_model("tiny:llada")))
    assert METHODS["int4"].weight_bytes(64, 64, 2, "cuda") == 64 * 1024 // 2 + 1024 // 64 * 64 * 2 * 2
    assert METHODS["int4"].weight_bytes(64, 64, 2, "cpu") == 64 * 64 // 2 + 64 * 2 * 2
    with pytest.raises(UsageError, match="fp8 needs a CUDA device"):
        Serving(quantization="fp8", device="cpu").resolved(arch)
    with pytest.raises(UsageError, match="runs with --dtype bfloat16 only"):
        Serving(dtype="fp32", quantization="int4", device="cuda").resolved(arch)
    with pytest.raises(UsageError, match="--device must be one of cuda, cpu"):
        Serving(device="tpu").resolved(arch)
    assert Serving(device="CUDA:1").resolved(arch).device == "cuda"  # as `dlm serve --device` spells it
    # a model the loader cannot quantize is refused by the plan too, naming a component
    for family in TINY_REFUSES_INT4:
        tiny = architecture_from_config(read_config_json(resolve_model(f"tiny:{family}")))
        with pytest.raises(UsageError, match="int4 cannot quantize the .*: its 48 input features"):
            plan_memory(tiny, parameter_components(tiny), Serving(quantization="int4").resolved(tiny))


# --------------------------------------------------------------------------- entry points
def test_serve_setting_is_validated_from_the_declaration() -> None:
    from dlm.cli.server.config import load_config

    assert load_config(None, {"quantization": "int4"}, environ={}).quantization == "int4"
    assert load_config(None, {}, environ={"DLM_QUANTIZATION": "int8"}).quantization == "int8"
    assert load_config(None, {"quantization": "none"}, environ={}).quantization is None
    with pytest.raises(UsageError, match="invalid setting.*quantization.*one of none, int8, int4, fp8"):
        load_config(None, {"quantization": "int3"}, environ={})


@pytest.mark.slow
def test_generate_batch_estimate_take_the_option(tmp_path: Path) -> None:
    """Each command line that loads a model, and the planner, take --quantization; a method
    the device cannot run is one `error:` line, exit 2."""
    import json

    from tests.cli_process import dlm

    ids = ("tiny:llada", "--prompt-ids", "5,6,7", "--gen-length", "8", "--block-length", "8", "--device", "cpu")
    done = dlm("generate", *ids, "--quantization", "int4", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["quantization"] == "int4", done.stderr
    refused = dlm("generate", *ids, "--quantization", "fp8")
    assert refused.returncode == 2 and refused.stderr.strip().startswith("error: --quantization fp8 needs a CUDA")
    source = tmp_path / "in.jsonl"
    body = {"prompt": [5, 6, 7], "max_tokens": 8}
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    batch = dlm("batch", str(source), str(tmp_path / "out.jsonl"), "--model", "tiny:llada", "--quantization", "int8")
    assert batch.returncode == 0, batch.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text())["response"]["status_code"] == 200
    plan = dlm("estimate", "tiny:llada", "--quantization", "int8", "--json")
    assert json.loads(plan.stdout)["serving"]["quantization"] == "int8"


@pytest.mark.slow
def test_serve_answers_with_quantized_weights() -> None:
    from tests.serving import in_process_server

    with in_process_server(model="tiny:llada2_moe", dtype="float32", device="cpu", quantization="int8") as client:
        assert client.get("/health").json()["quantization"] == "int8"
        assert client.get("/v1/models").json()["data"][0]["quantization"] == "int8"  # what clients list
        answer = client.post("/v1/completions", json={"model": "tiny:llada2_moe", "prompt": [5, 6], "max_tokens": 32})
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("family", DECODED)
def test_every_family_decodes_the_same_quantized_ids_through_every_entry_point(
    checkpoints: dict[str, str], family: str, method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compared in fp32: `LLM(quantization=M)`, `dlm generate --quantization M --json`, a
    server with the setting (`return_token_ids`; /health says M) and `dlm batch --quantization
    M` give the same ids in the same forwards, for every family the registry decodes, and
    each loads its model quantized (seen on `LLM`: all run in this process). Greedy where the
    sampler has a temperature; seeded for the entropy-bound one."""
    import json

    import dlm.engine.llm as llm_module
    from dlm.engine.registry import family_named
    from tests.serving import app_client
    from tests.tiny_families import cannot
    from tests.weights_helpers import cli

    loaded: list[str | None] = []
    init = llm_module.LLM.__init__

    def recorded(llm: LLM, *args: Any, **kwargs: Any) -> None:
        init(llm, *args, **kwargs)
        loaded.append(llm.quantization)

    def quantized_only() -> bool:
        made = set(loaded)
        loaded.clear()
        return made == {method}

    monkeypatch.setattr(llm_module.LLM, "__init__", recorded)
    model, params = checkpoints[family], dict(PARAMS[family])
    if "temperature" not in cannot(family_named(family)):
        params["temperature"] = 0.0
    with LLM(model, dtype="float32", device="cpu", quantization=method) as llm:
        python = llm.generate(PROMPT, **params)[0]
    assert quantized_only()

    flags = [part for name, value in params.items() for part in (f"--{name.replace('_', '-')}", str(value))]
    prompt_ids = ",".join(map(str, PROMPT))
    code, stdout, stderr = cli(
        "generate", model, "--prompt-ids", prompt_ids, *flags, "--dtype", "float32", "--quantization", method, "--json"
    )
    assert code == 0, stderr
    generated = json.loads(stdout)
    assert generated["quantization"] == method and quantized_only()

    fields = {("max_tokens" if name == "gen_length" else name): value for name, value in params.items()}
    body = {**fields, "prompt": PROMPT, "return_token_ids": True}
    with app_client({"model": model, "warmup": False, "quantization": method, "dtype": "float32"}) as client:
        assert client.get("/health").json()["quantization"] == method
        served = client.post("/v1/completions", json=body)
    assert served.status_code == 200, served.text
    assert quantized_only()

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    code, _, stderr = cli(
        "batch", str(source), str(out), "--model", model, "--dtype", "float32", "--quantization", method
    )
    assert code == 0, stderr
    batched = json.loads(out.read_text())["response"]["body"]
    assert quantized_only()

    assert generated["output_ids"] == python.output_ids
    for answer in (served.json(), batched):
        assert answer["choices"][0]["token_ids"] == python.completion_ids == generated["completion_ids"]
        assert answer["usage"]["denoising_steps"] == python.nfe == generated["nfe"]


def test_gpu_checks_quantization_section_passes_on_a_cpu(gpu_check: Any) -> None:
    """`benchmarks/gpu_check.py`'s quantization section, prepared for a CUDA session, runs
    here on the CPU for the CPU's methods (one family each): its checks pass, so on a
    device only the CUDA kernels are new."""
    checks = gpu_check.quantization_checks("cpu", ["llada"])
    assert len(checks) == 2 * len(CPU_METHODS), checks
    assert all(ok for _, ok, _ in checks), checks
