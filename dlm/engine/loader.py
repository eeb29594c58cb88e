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
the source names for a parameter, or None for the default rule. A damaged checkpoint (a
malformed index, a shard missing or not a file, a file safetensors cannot read) is a failed
operation, `damaged_weights`, said alike here and by `dlm estimate`, which reads the index
through `shard_index` (so this module imports torch only where weights are read).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from dlm.engine.errors import DlmError, UsageError
from dlm.engine.utf8_paths import utf8_path

if TYPE_CHECKING:  # imported where weights are read: `dlm estimate` reads the index through
    import torch  # `shard_index` without paying for (or needing) torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
REFETCH = "fetch the checkpoint again (`dlm verify` checks every file of a checkpoint)"


def damaged_weights(where: Path, problem: object) -> DlmError:
    """A weight file (or the index) that cannot be read as one: the checkpoint is damaged, so
    the operation failed (exit 1, as a disk error would) rather than was asked wrongly; the
    message names the file and the fix. Every reader of weights (the loader, `dlm estimate`'s
    headers) says it this way, so a damage reads the same from every entry point."""
    return DlmError(f"cannot read the weights in {where}: {problem}; {REFETCH}")


def require_file(path: Path) -> None:
    """Refuse a weight file (or the index) replaced by a directory or a device: opening one
    fails with the OS's words ("No such device") and no file name, or, for a FIFO, hangs."""
    if not path.is_file():
        raise damaged_weights(path, "it is a directory, not a file" if path.is_dir() else "it is not a regular file")


def shard_index(model_dir: Path) -> dict[str, Path] | None:
    """The sharded index of `model_dir` (`model.safetensors.index.json`), checked and resolved:
    each tensor name -> the shard file holding it; None when there is no index.

    The one place an index is parsed and checked, for every reader of it (the loader, `dlm
    estimate`'s headers): it comes from the checkpoint, so whatever is wrong with it (not
    UTF-8 JSON, no `weight_map` of tensor name -> shard file name, a shard outside the
    directory, missing or not a file) is a damaged checkpoint, refused as `damaged_weights`
    naming the file, rather than a traceback from whichever reader tripped over it first.
    """
    index = Path(model_dir) / INDEX_NAME
    if not index.exists():
        return None
    require_file(index)
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except OSError as exc:
        raise damaged_weights(index, exc.strerror or exc) from None
    except RecursionError:
        raise damaged_weights(index, "not a valid safetensors index (JSON nested too deeply)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged_weights(index, f"not a valid safetensors index (not UTF-8 JSON: {exc})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(file, str) and file for name, file in weight_map.items()
    ):
        raise damaged_weights(
            index, "not a valid safetensors index (weight_map must map tensor names to shard file names)"
        )
    if not weight_map:
        raise damaged_weights(index, "not a valid safetensors index (its weight_map names no tensor)")
    locations: dict[str, Path] = {}
    for name, file in weight_map.items():
        relative = PurePosixPath(file)
        if relative.is_absolute() or ".." in relative.parts:
            raise damaged_weights(index, f"it names shard {file}, outside the checkpoint directory")
        locations[name] = index.parent / relative
    for file in sorted(set(locations.values())):
        if not file.exists():
            raise damaged_weights(index, f"it names shard {file.name}, which is missing")
        require_file(file)
    return locations


def tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it.

    Prefers the sharded index when present (that is what transformers does); otherwise
    every `*.safetensors` file in the directory is scanned.
    """
    model_dir = Path(model_dir)
    indexed = shard_index(model_dir)
    if indexed is not None:
        return indexed
    return {name: file for file in _shard_files(model_dir) for name in _headers(file)}


def _shard_files(model_dir: Path) -> list[Path]:
    """The weight files: the ones the sharded index names, else every `*.safetensors`."""
    indexed = shard_index(model_dir)
    files = sorted(set(indexed.values())) if indexed is not None else sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UsageError(f"no safetensors weights in {model_dir}")
    return files


def _headers(file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor of `file` and its shape, from the safetensors header (no data read)."""
    require_file(file)
    try:
        with utf8_path(file) as readable, safe_open(readable, framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except SafetensorError as exc:
        raise damaged_weights(file, exc) from None
    except OSError as exc:  # unreadable: permissions, an I/O error
        raise damaged_weights(file, exc.strerror or exc) from None


def stored_values(model_dir: Path) -> int:
    """How many values the checkpoint's tensors hold (what `check_fits_weights` compares)."""
    return sum(math.prod(shape) for file in _shard_files(model_dir) for shape in _headers(file).values())


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
    import torch

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


def shape_mismatches(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, str]]:
    """The tensors whose shapes (from the safetensors headers, no weight read) loading them
    into `model` would refuse, as (checkpoint tensor, problem): what `load_weights` checks
    once it has read them, asked of a model built on meta (`dlm verify`). A parameter's
    sources are joined on dim 0 as `_read` joins them; one with a `weight_loader` (a reshape)
    is held to its element count; one split across ranks (`shard`), or with a source the
    checkpoint holds in another form or lacks (`missing_tensors`), is not compared."""
    params = dict(model.named_parameters())
    found = []
    for name, srcs in parameter_sources(model, shapes).items():
        param = params[name]
        if getattr(param, "shard", None) is not None or any(src not in shapes for src in srcs):
            continue
        parts = [tuple(shapes[src]) for src in srcs]
        shown = srcs[0] if len(srcs) == 1 else f"{name} (from {', '.join(srcs)})"
        if len(parts) > 1 and (not parts[0] or any(part[1:] != parts[0][1:] or not part for part in parts)):
            found.append((srcs[0], f"tensor {shown}: shapes {parts} cannot be joined on dim 0"))
            continue
        shape = parts[0] if len(parts) == 1 else (sum(part[0] for part in parts), *parts[0][1:])
        expected = tuple(param.shape)
        if getattr(param, "weight_loader", None) is not None:
            fits = math.prod(shape) == math.prod(expected)
        else:
            fits = shape == expected
        if not fits:
            found.append((srcs[0], f"tensor {shown} has shape {shape}, the model expects {expected}"))
    return found


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
        raise damaged_weights(model_dir, exc) from None


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
    import torch

    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(src: str) -> Any:
            file = locations[src]
            assert isinstance(file, Path)
            if file not in handles:
                try:
                    with utf8_path(file) as readable:  # the handle stays open once its path is gone
                        handles[file] = stack.enter_context(safe_open(readable, framework="pt", device="cpu"))
                except OSError as exc:  # gone or replaced since it was listed, unreadable
                    raise damaged_weights(file, exc.strerror or exc) from None
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
