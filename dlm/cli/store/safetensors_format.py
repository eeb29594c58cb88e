"""Structural check of a safetensors file, without loading any tensor.

Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON mapping tensor names
to {dtype, shape, data_offsets}, then the data. A file is sound when the header parses, every
dtype is known, each tensor's byte span equals its element count times its dtype size, the
spans tile the data region from 0 without gap or overlap, and the file ends exactly where the
last span does. These are the conditions the safetensors library itself enforces, checked
here so that `dlm verify` names every problem instead of failing on the first.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAX_HEADER = 100_000_000
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


@dataclass
class SafetensorsReport:
    """What one file holds (`tensors`, each entry's dtype and shape in `shapes` when it
    declares them well) and what is wrong with it (`problems`)."""

    tensors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)


def _tensor_problems(name: str, info: object) -> tuple[str | None, tuple[int, int] | None]:
    """Return (problem, span) for one header entry; span is None when unusable."""
    if not isinstance(info, dict):
        return f"tensor {name}: entry is not an object", None
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        return f"tensor {name}: unknown dtype {dtype!r}", None
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"tensor {name}: invalid shape {shape!r}", None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        return f"tensor {name}: invalid data_offsets {offsets!r}", None
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    span = offsets[1] - offsets[0]
    if bits != span * 8:
        return (f"tensor {name}: shape {shape} x {dtype} needs {bits / 8:g} bytes, data_offsets span {span}"), (
            offsets[0],
            offsets[1],
        )
    return None, (offsets[0], offsets[1])


def check_safetensors(path: Path) -> SafetensorsReport:
    report = SafetensorsReport()
    size = path.stat().st_size
    if size < 8:
        report.problems.append(f"file is {size} bytes, shorter than the 8-byte header length")
        return report
    with open(path, "rb") as handle:
        (n,) = struct.unpack("<Q", handle.read(8))
        if n > MAX_HEADER:
            report.problems.append(f"header length {n} exceeds the {MAX_HEADER}-byte limit")
            return report
        if 8 + n > size:
            report.problems.append(f"header length {n} runs past the end of the {size}-byte file")
            return report
        raw = handle.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        report.problems.append(f"header is not valid UTF-8 JSON: {exc}")
        return report
    except RecursionError:  # was a traceback of `dlm verify`
        report.problems.append("header is JSON nested too deeply")
        return report
    if not isinstance(header, dict):
        report.problems.append("header is not a JSON object")
        return report
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        report.problems.append("__metadata__ must map strings to strings")
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        report.tensors.append(name)
        problem, span = _tensor_problems(name, info)
        if problem:
            report.problems.append(problem)
        elif isinstance(info, dict):
            report.shapes[name] = (info["dtype"], tuple(info["shape"]))
        if span is not None:
            spans.append((span[0], span[1], name))
    data_size = size - 8 - n
    expected = 0
    for begin, end, name in sorted(spans):
        if begin != expected:
            kind = "overlaps the previous tensor" if begin < expected else f"leaves a gap at byte {expected}"
            report.problems.append(f"tensor {name}: data_offsets start at {begin} and {kind}")
        expected = max(expected, end)
    if expected > data_size:
        report.problems.append(
            f"tensor data ends at byte {expected} but the file holds only {data_size} data bytes (truncated?)"
        )
    elif expected < data_size:
        report.problems.append(f"{data_size - expected} bytes follow the last tensor")
    return report
