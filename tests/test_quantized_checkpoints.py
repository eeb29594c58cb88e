"""Pre-quantized checkpoints (compressed-tensors, dlm/engine/compressed_tensors.py), written
by the compressed-tensors library itself: they load with their own integers and scales
(exactly the library's decompression), decode the ids of their dequantized twin, go through
`dlm fetch` + `dlm verify` + `dlm serve`, and what is wrong with them is refused or reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm.cli.store.verify import verify_directory
from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from dlm.engine.quantized_weights import dense, is_quantized
from dlm.engine.resolve import resolve_model
from tests.compressed_checkpoints import compress

SCHEMES = {"int8": (8, None), "int4": (4, 32)}
PARAMS = {"llada": dict(gen_length=8, block_length=8, steps=4), "llada2_moe": dict(gen_length=32, threshold=0.3)}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("compressed")
    return {
        (family, method): compress(Path(resolve_model(f"tiny:{family}")), out / f"{family}-{method}", *SCHEMES[method])
        for family in PARAMS
        for method in SCHEMES
    }


def _library_dense(directory: Path, bits: int, group: int | None, out: Path) -> Path:
    """The checkpoint as the compressed-tensors library decompresses it (dense fp32)."""
    from compressed_tensors.compressors import IntQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=True, strategy="channel" if group is None else "group", group_size=group
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = IntQuantizationCompressor if bits == 8 else PackedQuantizationCompressor
    tensors = load_file(str(directory / "model.safetensors"))
    layers = {n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")}
    dense_tensors = {n: t for n, t in tensors.items() if not any(n.startswith(f"{layer}.") for layer in layers)}
    for layer in layers:
        module = {n.removeprefix(f"{layer}."): t for n, t in tensors.items() if n.startswith(f"{layer}.")}
        dense_tensors[f"{layer}.weight"] = compressor.decompress(module, scheme)["weight"].float().contiguous()
    out.mkdir()
    save_file(dense_tensors, str(out / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("method", sorted(SCHEMES))
@pytest.mark.parametrize("family", sorted(PARAMS))
def test_loads_its_own_integers_and_decodes_the_dequantized_ids(
    written: dict, tmp_path: Path, family: str, method: str
) -> None:
    """The loaded weights are the library's decompression exactly (no requantization: the
    checkpoint's integers and scales), MoE experts included, and the model decodes the ids of
    the dense checkpoint the library decompresses, in fp32."""
    directory = written[family, method]
    llm = LLM(directory, dtype="float32", device="cpu")
    assert llm.quantization == method and llm.engine.loaded.quantization == method
    twin_dir = _library_dense(directory, *SCHEMES[method], tmp_path / "dense")
    twin = LLM(twin_dir, dtype="float32", device="cpu")
    twin_params = dict(twin.engine.loaded.model.named_parameters())
    quantized = 0
    for name, param in llm.engine.loaded.model.named_parameters():
        if is_quantized(param):
            quantized += 1
            stacked, _, index = name.rpartition(".")
            want = twin_params[stacked][int(index)] if stacked in twin_params else twin_params[name]
            assert torch.equal(dense(param), want), name
        else:
            assert torch.equal(param, twin_params[name]), name  # embedding, LM head, routers, norms
    assert quantized > 0
    ids = llm.generate(list(range(5, 17)), **PARAMS[family])[0].output_ids
    assert ids == twin.generate(list(range(5, 17)), **PARAMS[family])[0].output_ids


def test_verify_passes_a_sound_checkpoint(written: dict) -> None:
    for directory in written.values():
        report = verify_directory(directory)
        assert report.ok, report.failures


def _edit(directory: Path, out: Path, change: dict) -> Path:
    """A copy of `directory` with tensors replaced (None: removed)."""
    out.mkdir()
    tensors = load_file(str(directory / "model.safetensors"))
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((directory / "config.json").read_text())
    return out


LAYER = "model.transformer.blocks.0.attn_out"


def test_missing_scales_are_refused_and_reported(written: dict, tmp_path: Path) -> None:
    broken = _edit(written["llada", "int4"], tmp_path / "broken", {f"{LAYER}.weight_scale": None})
    with pytest.raises(UsageError, match=rf"{LAYER}.weight_packed is quantized but its scales .* are missing"):
        LLM(broken, dtype="float32", device="cpu")
    failures = [(f.file, f.check, f.problem) for f in verify_directory(broken).failures]
    assert failures == [
        (
            "model.safetensors",
            "quantization",
            f"{LAYER}.weight_packed is quantized but its scales ({LAYER}.weight_scale) are missing",
        )
    ]


def test_misshapen_and_impossible_scales_are_reported(written: dict, tmp_path: Path) -> None:
    source = written["llada", "int4"]
    scales = load_file(str(source / "model.safetensors"))
    other = "model.transformer.blocks.1.attn_out.weight_scale"
    zeroed = scales[other].clone()
    zeroed[3, 1] = 0.0
    broken = _edit(
        source,
        tmp_path / "broken",
        {f"{LAYER}.weight_scale": scales[f"{LAYER}.weight_scale"][:, :1].contiguous(), other: zeroed},
    )
    problems = sorted(f.problem for f in verify_directory(broken).failures)
    assert problems == [
        f"{LAYER}.weight_scale: shape [64, 1], expected [64, 2] for {LAYER}.weight_packed [64, 8] (int4, groups of 32)",
        f"{other}: 1 of 128 scales are not finite and positive",
    ]
    with pytest.raises(UsageError, match="expected \\[64, 2\\]"):
        LLM(broken, dtype="float32", device="cpu")
    zero_only = _edit(source, tmp_path / "zero", {other: zeroed})
    with pytest.raises(UsageError, match="1 of 128 scales are not finite and positive"):
        LLM(zero_only, dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
        ({"format": "float-quantized", "weights": {"type": "float"}}, "dlm loads int8 \\(channel\\) or int4"),
        ({"weights": {"symmetric": False}}, "asymmetric weights"),
        ({"input_activations": {"num_bits": 8, "type": "int"}}, "activation quantization is not supported"),
        ({"weights": {"group_size": 16}}, "int4 needs groups of 128, 64, 32"),
    ],
)
def test_schemes_dlm_cannot_serve_are_refused(written: dict, tmp_path: Path, change: dict, message: str) -> None:
    source = written["llada", "int4"]
    config = json.loads((source / "config.json").read_text())
    quant = config["quantization_config"]
    group = quant["config_groups"]["group_0"]
    for key, value in change.items():
        if key in ("quant_method", "format"):
            quant[key] = value
        elif key == "weights":
            group["weights"].update(value)
        else:
            group[key] = value
    out = tmp_path / "other"
    out.mkdir()
    (out / "model.safetensors").symlink_to(source / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=message):
        LLM(out, dtype="float32", device="cpu")
    assert any(f.check == "quantization" and f.file == "config.json" for f in verify_directory(out).failures)


def test_another_method_than_the_checkpoints_is_refused(written: dict) -> None:
    with pytest.raises(UsageError, match=r"already quantized \(int8, compressed-tensors\): --quantization int4"):
        LLM(written["llada", "int8"], dtype="float32", device="cpu", quantization="int4")
    assert LLM(written["llada", "int8"], dtype="float32", device="cpu", quantization="int8").quantization == "int8"


def test_estimate_plans_the_checkpoints_method(written: dict) -> None:
    """`dlm estimate` of a pre-quantized checkpoint plans its method unless told otherwise."""
    from dlm.cli.estimate.plan import Serving
    from dlm.cli.estimate.plan import estimate as plan

    report = plan(str(written["llada", "int4"]), Serving())
    assert report["serving"]["quantization"] == "int4"


@pytest.mark.slow
def test_fetch_verify_serve(written: dict) -> None:
    """The path a release takes: into the store, verified (scales included), served; /health
    names the method."""
    from tests.cli_process import dlm
    from tests.serving import in_process_server

    fetched = dlm("fetch", str(written["llada2_moe", "int4"]), "--name", "w4a16", "--json")
    assert fetched.returncode == 0, fetched.stderr
    verified = dlm("verify", "w4a16", "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stdout + verified.stderr
    with in_process_server(model="w4a16", dtype="float32", device="cpu", warmup=False) as client:
        assert client.get("/health").json()["quantization"] == "int4"
        body = {"model": "w4a16", "prompt": [5, 6, 7, 8], "max_tokens": 32}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] > 0


@pytest.mark.slow
def test_tensor_parallel_is_refused_with_the_reason(written: dict) -> None:
    from dlm.engine.parallel.distributed import ParallelConfig

    with pytest.raises(Exception, match="pre-quantized checkpoints are not split over tensor-parallel ranks"):
        LLM(written["llada", "int8"], dtype="float32", device="cpu", parallel=ParallelConfig(tensor_parallel_size=2))
