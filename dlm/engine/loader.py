"""Load safetensors checkpoints (single file or sharded index) into a model built on `meta`.

Why meta: the model is created without storage, and each parameter is materialised exactly
once from the checkpoint (read, cast, placed), so peak memory is the model plus one tensor,
never two copies of the weights. Models name their parameters as the checkpoint does, except
packed projections: a model may declare `packed_modules = {"qkv_proj": ("q_proj", "k_proj",
"v_proj")}`, and such a parameter is the concatenation (dim 0) of its sources, so one matmul
replaces three. A parameter may also carry a `weight_loader(param, tensor) -> tensor`
attribute when it needs a transform (a reshape). A tensor-parallel shard carries a `shard`
(`Shard`): which ranges of each source tensor it holds; those ranges are read with
safetensors' `get_slice`, so a rank never reads (or holds) more than its part. A model whose
checkpoints come in several layouts (one tensor per expert or stacked experts, a text model
nested under `model.language_model.`) may define `tensor_sources(name, available)` returning
the source names for a parameter, or None for the default rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dlm.engine.errors import DlmError, UsageError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it.

    Prefers the sharded index when present (that is what transformers does); otherwise
    every `*.safetensors` file in the directory is scanned.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise UsageError(f"{index} is not a valid safetensors index: {exc}") from exc
        locations: dict[str, Path] = {name: model_dir / file for name, file in weight_map.items()}
        for file in set(locations.values()):
            if not file.exists():
                raise UsageError(f"{index} names shard {file.name}, which is missing")
        return locations
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UsageError(f"no safetensors weights in {model_dir}")
    locations = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    locations[name] = file
        except SafetensorError as exc:
            raise _damaged(model_dir, exc) from None
    return locations


def _damaged(model_dir: Path, exc: SafetensorError) -> DlmError:
    """A weight file safetensors cannot read (truncated, overwritten): reading the checkpoint
    failed, an operation's failure (exit 1), as a disk error would be."""
    return DlmError(f"cannot read the weights in {model_dir}: {exc}; `dlm verify` checks every file of a checkpoint")


Index = tuple[slice, ...]


@dataclass(frozen=True)
class Shard:
    """What part of its checkpoint sources a parameter holds on this rank.

    `reads(i, shape)` gives, for source i (in `checkpoint_sources` order) of full shape
    `shape`, the index tuples to read from it; every piece read, over all sources in order,
    is concatenated along `cat_dim` (or `cat_dim(shape of the first source)` when the
    checkpoint may come in layouts of different ranks)."""

    reads: Callable[[int, tuple[int, ...]], list[Index]]
    cat_dim: int | Callable[[tuple[int, ...]], int] = 0


def _set_parameter(model: torch.nn.Module, name: str, value: torch.Tensor | torch.nn.Module) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if isinstance(value, torch.nn.Module):  # a list of per-expert (quantized) weights replaces the stacked one
        delattr(module, attr)
        setattr(module, attr, value)
    else:
        setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


def checkpoint_sources(name: str, packed: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Checkpoint tensor names that make up model parameter `name`, in concatenation order."""
    module_path, _, attr = name.rpartition(".")
    owner, _, leaf = module_path.rpartition(".")
    if leaf in packed:
        prefix = f"{owner}." if owner else ""
        return [f"{prefix}{part}.{attr}" for part in packed[leaf]]
    return [name]


def parameter_sources(model: torch.nn.Module, available: Collection[str]) -> dict[str, list[str]]:
    """For each parameter of `model`, the checkpoint tensors it is read from, given the
    tensor names the checkpoint holds (a model with several layouts picks by them)."""
    packed: Mapping[str, tuple[str, ...]] = getattr(model, "packed_modules", {})
    custom = getattr(model, "tensor_sources", None)
    return {
        name: (custom(name, available) if custom is not None else None) or checkpoint_sources(name, packed)
        for name, _ in model.named_parameters()
    }


def missing_tensors(model: torch.nn.Module, available: Collection[str]) -> list[str]:
    """The tensors `model` needs that a checkpoint holding `available` lacks (what loading
    it would refuse; `dlm verify` asks this of a model built on meta, reading no weight)."""
    return [src for srcs in parameter_sources(model, available).values() for src in srcs if src not in available]


def load_weights(
    model: torch.nn.Module,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    on_tensor: Callable[[str], None] | None = None,
    place: Callable[[str, torch.Tensor], torch.Tensor | torch.nn.Module] | None = None,
    decoded: Mapping[str, Callable[[], torch.Tensor]] | None = None,
) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`. `place` turns a
    parameter's tensor as read into what the model holds (default: cast to `dtype`, moved to
    `device`); quantization places a quantized tensor, or a list of them for stacked experts
    (dlm/engine/quantized_weights.py). `decoded`: tensors the checkpoint holds in another
    form (a pre-quantized layer's `weight`, dlm/engine/compressed_tensors.py), read whole by
    their function."""
    decoded = decoded or {}
    locations: dict[str, object] = {**tensor_locations(model_dir), **decoded}
    sources = parameter_sources(model, locations)
    missing = missing_tensors(model, locations)
    if missing:
        raise UsageError(
            f"checkpoint {model_dir} lacks tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    params = dict(model.named_parameters())
    try:
        _read(model, model_dir, locations, sources, params, dtype, device, on_tensor, place, decoded)
    except SafetensorError as exc:
        raise _damaged(model_dir, exc) from None


def _read(
    model: torch.nn.Module,
    model_dir: Path,
    locations: dict[str, object],
    sources: dict[str, list[str]],
    params: dict[str, torch.nn.Parameter],
    dtype: torch.dtype,
    device: torch.device,
    on_tensor: Callable[[str], None] | None,
    place: Callable[[str, torch.Tensor], torch.Tensor | torch.nn.Module] | None,
    decoded: Mapping[str, Callable[[], torch.Tensor]],
) -> None:
    """Read each parameter's sources (or decode them), shape-check, cast and place it."""
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(src: str) -> Any:
            file = locations[src]
            assert isinstance(file, Path)
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            return handles[file]

        for name, srcs in sources.items():
            param = params[name]
            shard: Shard | None = getattr(param, "shard", None)
            dim = 0
            if shard is None:
                parts = [decoded[src]() if src in decoded else handle(src).get_tensor(src) for src in srcs]
            else:
                parts, cat_dim = [], shard.cat_dim
                for i, src in enumerate(srcs):
                    view = handle(src).get_slice(src)
                    shape = tuple(view.get_shape())
                    parts += [view[index] for index in shard.reads(i, shape)]
                    if i == 0:  # a callable cat_dim reads the first source's shape
                        dim = cat_dim(shape) if callable(cat_dim) else cat_dim
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
            del parts
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                tensor = loader(param, tensor)
            if tuple(tensor.shape) != tuple(param.shape):
                shown = srcs[0] if len(srcs) == 1 else f"{name} (from {', '.join(srcs)})"
                where = locations[srcs[0]]
                file = where.name if isinstance(where, Path) else model_dir.name
                raise UsageError(
                    f"tensor {shown} in {file} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
                )
            _set_parameter(model, name, tensor.to(device=device, dtype=dtype) if place is None else place(name, tensor))
            if on_tensor is not None:
                on_tensor(name)
