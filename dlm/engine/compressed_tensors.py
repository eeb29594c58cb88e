"""Pre-quantized checkpoints in the compressed-tensors format (what llm-compressor writes and
vLLM / transformers read; the format of the W8A16 and W4A16 releases on the hub).

config.json carries `quantization_config` with `quant_method: "compressed-tensors"`, a
`format`, `config_groups` (each: target layers and the `weights` arguments) and `ignore`
(layers left dense, usually `lm_head` and the routers). A quantized linear layer `X` is
stored as its integer data, `X.weight` (int8, formats int-quantized / naive-quantized) or
`X.weight_packed` (int32 words each holding 32 / bits consecutive values offset by
2^(bits-1), lowest bits first; format pack-quantized, with `X.weight_shape`), and its
`X.weight_scale` (one per output row, or per group of inputs); the weight is value x scale.

dlm serves the weight-only integer schemes its methods hold exactly, with no requantization:
- `int8`: 8-bit, symmetric, one scale per row (strategy `channel`) -> torchao's Int8Tensor;
- `int4`: 4-bit, symmetric, scales per group of 32, 64 or 128 inputs (strategy `group`,
  format pack-quantized) -> torchao's CPU int4 tensor with those scales and zero points 0.
Anything else (other quant_methods such as gptq/awq, fp8 or nvfp4 formats, asymmetric
weights, activation quantization) is refused with what the checkpoint says.
Reading the scheme and checking the headers are torch-free (`dlm verify`, `dlm estimate`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.engine.errors import UsageError
from dlm.engine.quantization import INT4_GROUP_SIZES

QUANT_METHOD = "compressed-tensors"
FORMATS = {8: ("int-quantized", "naive-quantized", "pack-quantized"), 4: ("pack-quantized",)}
SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's quantization, as dlm holds it."""

    method: str  # "int8" | "int4" (dlm/engine/quantization.py)
    bits: int
    group_size: int | None  # inputs per scale; None: one scale per row
    format: str
    ignore: tuple[str, ...]


def read_scheme(raw: Mapping[str, Any]) -> Scheme | None:
    """The checkpoint's quantization from its config.json (None when it has none); one dlm
    cannot serve is a usage error saying what it is."""
    config = raw.get("quantization_config") or raw.get("compression_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method != QUANT_METHOD:
        raise UsageError(
            f"quantization_config.quant_method {method!r} is not supported: dlm loads compressed-tensors "
            "int8 / int4 checkpoints (or quantizes bf16/fp32 ones with --quantization)"
        )
    groups = [g for g in (config.get("config_groups") or {}).values() if isinstance(g, dict)]
    if len(groups) != 1:
        raise UsageError(f"compressed-tensors: dlm loads one config group, this checkpoint has {len(groups)}")
    group, fmt = groups[0], groups[0].get("format") or config.get("format")
    weights = group.get("weights") or {}
    if group.get("input_activations") is not None:
        raise UsageError("compressed-tensors: activation quantization is not supported (dlm serves weight-only)")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    described = f"{bits}-bit {kind} weights, strategy {strategy}, format {fmt}"
    if kind != "int" or bits not in FORMATS or fmt not in FORMATS[bits]:
        raise UsageError(f"compressed-tensors {described}: dlm loads int8 (channel) or int4 (group, pack-quantized)")
    if not weights.get("symmetric", True):
        raise UsageError(f"compressed-tensors {described}: asymmetric weights (zero points) are not supported")
    if bits == 8 and strategy != "channel":
        raise UsageError(f"compressed-tensors {described}: int8 weights need one scale per row (strategy channel)")
    group_size = weights.get("group_size")
    if bits == 4 and (strategy != "group" or group_size not in INT4_GROUP_SIZES):
        sizes = ", ".join(map(str, INT4_GROUP_SIZES))
        raise UsageError(f"compressed-tensors {described}, group {group_size}: int4 needs groups of {sizes}")
    return Scheme(
        "int8" if bits == 8 else "int4",
        bits,
        group_size if bits == 4 else None,
        fmt,
        tuple(config.get("ignore") or ()),
    )


@dataclass(frozen=True)
class Header:
    dtype: str  # safetensors' spelling: I8, I32, BF16, ...
    shape: tuple[int, ...]


def quantized_layers(headers: Mapping[str, Header]) -> list[str]:
    """The layers stored quantized: those with a `weight_scale`, or integer data without one."""
    layers = {n.removesuffix(".weight_scale") for n in headers if n.endswith(".weight_scale")}
    layers |= {n.removesuffix(".weight_packed") for n in headers if n.endswith(".weight_packed")}
    layers |= {n.removesuffix(".weight") for n, h in headers.items() if n.endswith(".weight") and h.dtype == "I8"}
    return sorted(layers)


def header_problems(headers: Mapping[str, Header], scheme: Scheme) -> list[tuple[str, str]]:
    """Every quantized layer's data and scales, checked against each other and the scheme
    from the headers alone: present, of an integer / float dtype, of matching shapes.
    Each problem comes with the tensor it concerns."""
    problems = []
    for layer in quantized_layers(headers):
        scale = headers.get(f"{layer}.weight_scale")
        packed = headers.get(f"{layer}.weight_packed")
        data = packed or headers.get(f"{layer}.weight")
        stored = f"{layer}.weight_packed" if packed else f"{layer}.weight"
        if data is None:
            problems.append(
                (
                    f"{layer}.weight_scale",
                    f"{layer}.weight_scale has no {layer}.weight_packed or int8 {layer}.weight to scale",
                )
            )
            continue
        if scale is None:
            problems.append((stored, f"{stored} is quantized but its scales ({layer}.weight_scale) are missing"))
            continue
        want = "I32" if packed else "I8"
        if data.dtype != want or len(data.shape) != 2:
            problems.append((stored, f"{stored}: {data.dtype} {list(data.shape)}, expected a 2-D {want} tensor"))
            continue
        rows, columns = data.shape
        inputs = columns * 32 // scheme.bits if packed else columns
        if packed:
            shape = headers.get(f"{layer}.weight_shape")
            if shape is None:
                problems.append((stored, f"{stored} has no {layer}.weight_shape"))
        groups = 1 if scheme.group_size is None else inputs // scheme.group_size
        if scale.dtype not in SCALE_DTYPES:
            problems.append(
                (
                    f"{layer}.weight_scale",
                    f"{layer}.weight_scale: dtype {scale.dtype}, expected {'/'.join(SCALE_DTYPES)}",
                )
            )
        elif tuple(scale.shape) != (rows, groups):
            problems.append(
                (
                    f"{layer}.weight_scale",
                    f"{layer}.weight_scale: shape {list(scale.shape)}, expected [{rows}, {groups}] for {stored} "
                    f"{list(data.shape)} ({scheme.method}"
                    + (f", groups of {scheme.group_size})" if groups > 1 else ")"),
                )
            )
        if (packed is None) != (scheme.format != "pack-quantized"):
            problems.append(
                (stored, f"{stored}: stored {'packed' if packed else 'unpacked'}, the format is {scheme.format}")
            )
    return problems


def read_headers(files: list[Path]) -> dict[str, Header]:
    """Every tensor's dtype and shape, from the safetensors headers (no data read)."""
    import json
    import struct

    headers = {}
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                headers[name] = Header(info["dtype"], tuple(info["shape"]))
    return headers


def value_problems(read: Callable[[str], Any], headers: Mapping[str, Header]) -> list[tuple[str, str]]:
    """Scales that cannot be: not finite, or not positive (a zero scale erases its row or
    group; a negative one flips it). `read(name)` returns a tensor."""
    problems = []
    for layer in quantized_layers(headers):
        name = f"{layer}.weight_scale"
        if name not in headers:
            continue
        scale = read(name).float()
        bad = int((~scale.isfinite() | (scale <= 0)).sum())
        if bad:
            problems.append((name, f"{name}: {bad} of {scale.numel()} scales are not finite and positive"))
    return problems


def ignored(layer: str, scheme: Scheme) -> bool:
    """Whether the checkpoint left `layer` dense (its `ignore` list: names or `re:` patterns)."""
    for rule in scheme.ignore:
        if rule.startswith("re:") and re.match(rule[3:], layer):
            return True
        if layer == rule or layer.endswith(f".{rule}") or layer == rule.removesuffix(".weight"):
            return True
    return False


def unpack(packed: Any, bits: int, inputs: int) -> Any:
    """int32 words [rows, words] -> int8 values [rows, inputs] (4 or 8 bits, little-endian)."""
    import torch

    raw = packed.contiguous().view(torch.uint8)  # each word's bytes, lowest first
    if bits == 4:
        raw = torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(raw.shape[0], -1)
    offset = 1 << (bits - 1)
    return (raw[:, :inputs].to(torch.int16) - offset).to(torch.int8)


def placement(model: Any, model_dir: Path, scheme: Scheme, dtype: Any, device: Any) -> tuple[Any, dict[str, Any]]:
    """(the loader's `place`, its `decoded` tensors) for a pre-quantized checkpoint: every
    quantized layer's `weight` is decoded from its integer data; a parameter dlm quantizes
    receives those integers and its scales (`Quantizer.given`), one dlm keeps dense (a
    router, the LM head) the dequantized weight. Refused, before any data is read, when the
    headers are wrong (missing or misshapen scales, `header_problems`), a parameter mixes
    quantized and dense sources, or this device cannot hold the scheme; when a layer's scales
    are read, scales that are not finite and positive are refused too."""
    import torch
    from safetensors import safe_open

    from dlm.engine.loader import parameter_sources, tensor_locations
    from dlm.engine.quantization import METHODS, check_runs
    from dlm.engine.quantized_weights import Quantizer, quantizable
    from dlm.engine.utf8_paths import utf8_path

    method = METHODS[scheme.method]
    check_runs(method, device.type, str(dtype).replace("torch.", ""))
    locations = tensor_locations(model_dir)
    headers = read_headers(sorted(set(locations.values())))
    problems = header_problems(headers, scheme)
    if problems:
        more = f" (and {len(problems) - 1} more; `dlm verify` lists them)" if len(problems) > 1 else ""
        raise UsageError(f"{model_dir.name}: {problems[0][1]}{more}")
    layers = quantized_layers(headers)

    def read(name: str) -> Any:
        with utf8_path(locations[name]) as readable, safe_open(readable, framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def scale_of(layer: str) -> Any:
        scale = read(f"{layer}.weight_scale")
        bad = value_problems(lambda _: scale, {f"{layer}.weight_scale": headers[f"{layer}.weight_scale"]})
        if bad:
            raise UsageError(f"{model_dir.name}: {bad[0][1]}")
        return scale

    def integers(layer: str) -> Any:
        if f"{layer}.weight_packed" not in headers:
            return read(f"{layer}.weight")
        rows, words = headers[f"{layer}.weight_packed"].shape
        return unpack(read(f"{layer}.weight_packed"), scheme.bits, words * 32 // scheme.bits)

    def dequantized(layer: str) -> Any:
        values, scale = integers(layer).float(), scale_of(layer).float()
        return values * scale.repeat_interleave(values.shape[1] // scale.shape[1], dim=1)

    names = {f"{layer}.weight": layer for layer in layers}
    sources = parameter_sources(model, {**locations, **names})
    wanted = quantizable(model)
    given, groups, integer_sources = set(), {}, set()
    for param, srcs in sources.items():
        held = [s in names for s in srcs]
        if not any(held):
            continue
        if not all(held):
            raise UsageError(f"{param} mixes quantized and dense checkpoint tensors ({', '.join(srcs)})")
        if param in wanted:
            given.add(param)
            integer_sources.update(srcs)
            groups[param] = scheme.group_size or 0
    decoded = {
        src: (lambda layer=layer: integers(layer))
        if src in integer_sources
        else (lambda layer=layer: dequantized(layer))
        for src, layer in names.items()
    }

    def scales(param: str) -> Any:
        return torch.cat([scale_of(names[src]) for src in sources[param]])

    return Quantizer(method, groups, frozenset(), dtype, device, scales, frozenset(given)), decoded
