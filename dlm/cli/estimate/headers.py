"""Tensor names, dtypes and shapes from safetensors headers, without reading any weights.

A safetensors file starts with an 8-byte little-endian header length and a JSON header
listing every tensor. Reading only that (locally, or over the hub with ranged requests)
tells what a checkpoint holds in milliseconds and without torch, which is what
`dlm estimate` needs to cross-check the parameter count it derives from config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dlm.cli.store.safetensors_format import DTYPE_BITS, check_safetensors
from dlm.engine.loader import damaged_weights, require_file, shard_index


@dataclass(frozen=True)
class TensorHeader:
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class CheckpointHeaders:
    """Every tensor of a checkpoint (all shards), by name."""

    source: str
    tensors: dict[str, TensorHeader] = field(default_factory=dict)

    @property
    def parameter_count(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data: the checkpoint's size on disk, less headers."""
        return sum(t.numel * DTYPE_BITS.get(t.dtype, 0) // 8 for t in self.tensors.values())

    def count_by_dtype(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
        return dict(sorted(counts.items()))


def read_file_header(path: Path) -> dict[str, TensorHeader]:
    """Tensors listed in one local .safetensors file's header.

    A file whose header `dlm verify` finds wrong (`check_safetensors`: an unknown dtype,
    offsets that overlap or run past the file, a shape its bytes do not hold, JSON that does
    not parse) is a damaged checkpoint: refused as the loader refuses it (`damaged_weights`:
    exit 1, the file and the fix named). Only well-formed entries were checked before, so a
    shape of 10^30 or an unknown dtype was planned and said to match config.json."""
    path = Path(path)
    require_file(path)
    try:
        report = check_safetensors(path)
    except OSError as exc:
        raise damaged_weights(path, exc.strerror or exc) from None
    if report.problems:
        more = f" (and {len(report.problems) - 1} more: dlm verify lists them)" if len(report.problems) > 1 else ""
        raise damaged_weights(path, report.problems[0] + more)
    return {name: TensorHeader(dtype, shape) for name, (dtype, shape) in report.shapes.items()}


def local_headers(directory: Path) -> CheckpointHeaders | None:
    """All tensors of a local checkpoint directory, or None when it holds no safetensors.

    The shard list comes from `model.safetensors.index.json` when present, read and checked
    by the loader's `shard_index`, so a damaged index is refused here as loading refuses it;
    otherwise every `*.safetensors` file counts.
    """
    directory = Path(directory)
    indexed = shard_index(directory)
    files = sorted(set(indexed.values())) if indexed is not None else sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    result = CheckpointHeaders(str(directory))
    for file in files:
        result.tensors.update(read_file_header(file))
    return result


def hub_headers(repo_id: str, revision: str | None = None) -> CheckpointHeaders | None:
    """All tensors of a hub repository, read with ranged requests (no weights downloaded).
    None when the repository holds no safetensors weights."""
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError

    try:
        meta = get_safetensors_metadata(repo_id, revision=revision)
    except NotASafetensorsRepoError:
        return None
    result = CheckpointHeaders(f"hf://{repo_id}")
    for file_meta in meta.files_metadata.values():
        for name, info in file_meta.tensors.items():
            result.tensors[name] = TensorHeader(str(info.dtype), tuple(int(s) for s in info.shape))
    return result
