"""Quantized weights in memory: torchao tensors for the methods of dlm/engine/quantization.py.

A quantized weight is a torchao tensor subclass standing where the dense weight stood, so
`F.linear` (every linear layer) dispatches to torchao's kernel and nothing else in the model
changes. Stacked routed experts ([E, rows, inputs]) become one quantized tensor per expert
(an `nn.ParameterList`): torchao's CPU int4 tensor is 2-D only, and the fused-MoE twin
(`dlm.kernels.moe`) takes either form, indexing `w[e]`.

Weights are quantized as the loader places them (`Quantizer`), one tensor at a time, so peak
memory is the quantized model plus one dense tensor. Under tensor parallelism each rank
quantizes the shard it read: rows split over ranks quantize exactly as the whole tensor;
inputs split over ranks (row-parallel layers) get per-rank row scales / groups.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.errors import UsageError
from dlm.engine.parallel import state as parallel_state
from dlm.engine.quantization import METHODS, Method, check_runs


@contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Whatever imports torchao inside (dlm, or transformers' model classes, which import it
    when it is installed): a CPU build of torch cannot load torchao's CUDA extensions, which
    it reports as warnings on every import, and torch warns about how torchao registers its
    enums; neither concerns a user of dlm."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        pytree.setLevel(level)


@cache
def torchao() -> Any:
    """torchao, imported on first use (it takes a second) and quietly (`quiet_torchao_import`)."""
    with quiet_torchao_import():
        try:
            import torchao as module
            import torchao.prototype.quantization.int4  # noqa: F401 - the CPU int4 tensor
        except ImportError as exc:  # pragma: no cover - a dependency of dlm
            raise UsageError(f"quantized weights need torchao ({exc})") from exc
    return module


def row_scales(row_absmax: torch.Tensor) -> torch.Tensor:
    """int8 scales [..., rows, 1] of rows whose largest magnitudes are `row_absmax` [..., rows],
    by torchao's own symmetric rule (what `Int8Tensor.from_hp` computes from a whole row).
    Stacked experts' rows ([E, rows]) are taken as one list of rows: torchao's rule reads a
    2-D input only."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine

    extremes = torch.stack((-row_absmax.reshape(-1), row_absmax.reshape(-1)), dim=-1).float()
    scale, _ = choose_qparams_affine(
        input=extremes,
        mapping_type=MappingType.SYMMETRIC,
        block_size=[1, 2],
        target_dtype=torch.int8,
        quant_min=-128,
        quant_max=127,
        scale_dtype=torch.float32,
        zero_point_dtype=torch.int8,
        keepdim=True,
        eps=torch.finfo(torch.float32).eps,
    )
    return scale.reshape(*row_absmax.shape, 1)


def quantize(
    method: Method, weight: torch.Tensor, device: torch.device, group: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """One [rows, inputs] weight (already in the activation dtype) -> the method's torchao
    tensor on `device`: int4 in groups of `group` inputs; int8 with the given row `scale`
    (a tensor-parallel shard of a row takes the whole row's) or its own."""
    ao = torchao()
    if method.name == "int8":
        from torchao.quantization.granularity import PerRow

        return ao.quantization.Int8Tensor.from_hp(weight.to(device), PerRow(), scale=scale)
    if method.name == "int4":
        if device.type == "cpu":
            from torchao.prototype.quantization.int4 import Int4OpaqueTensor

            # Rows beyond a multiple of the kernel's tile are padded with zeros; the tensor
            # keeps the true shape, and torchao's linear drops the padded outputs.
            rows = weight.shape[0]
            padded = F.pad(weight, (0, 0, 0, method.stored_shape(rows, weight.shape[1], "cpu")[0] - rows))
            q = Int4OpaqueTensor.from_hp(padded, [1, group])
            return (
                q
                if rows == padded.shape[0]
                else Int4OpaqueTensor(q.qdata, q.scale_and_zero, q.block_size, weight.shape)
            )
        from torchao.quantization import Int4TilePackedTo4dTensor

        # torchao pads to tinygemm's tile itself (the method's "cuda" tiles) and keeps the true shape.
        return Int4TilePackedTo4dTensor.from_hp(weight.to(device), [1, group])
    if method.name == "fp8":
        from torchao.quantization import Float8Tensor
        from torchao.quantization.granularity import PerRow

        return Float8Tensor.from_hp(weight.to(device), float8_dtype=torch.float8_e4m3fn, granularity=PerRow())
    raise AssertionError(f"no torchao tensor for {method.name}")  # METHODS and this function go together


def from_integers(
    method: Method, values: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A pre-quantized [rows, inputs] weight, its signed integer `values` times `scale`
    ([rows, 1] per row, or [rows, inputs / group]), as the method's torchao tensor holding
    exactly those integers and scales (no requantization)."""
    ao = torchao()
    rows, inputs = values.shape
    if method.name == "int8":
        q, s = values.to(device=device, dtype=torch.int8), scale.to(device=device, dtype=torch.float32)
        return ao.quantization.Int8Tensor(q, s, [1, inputs], dtype, zero_point=torch.zeros_like(q[:, :1]))
    if method.name == "int4" and device.type == "cpu":
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor
        from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

        # tinygemm reads (u - 8) * scale + zero for u in [0, 15]: a signed value v is u = v + 8
        # with zero 0. Rows are padded with zeros to the kernel's tile, as `quantize` does.
        pad = method.stored_shape(rows, inputs, "cpu")[0] - rows
        unsigned = F.pad(values.to(torch.int32) + 8, (0, 0, 0, pad), value=8)
        scale = F.pad(scale.to(dtype), (0, 0, 0, pad), value=1.0)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
        scale_and_zero = pack_tinygemm_scales_and_zeros(scale, torch.zeros_like(scale), dtype)
        return Int4OpaqueTensor(packed, scale_and_zero, [1, group], torch.Size((rows, inputs)))
    raise UsageError(f"pre-quantized {method.name} weights load on a CPU only (this model runs on {device.type})")


def is_quantized(t: torch.Tensor) -> bool:
    """Whether `t` is a weight held in a library's layout (a torchao quantized tensor, or a
    oneDNN-packed bf16 one: dlm/kernels/packed_linear.py) rather than a plain dense tensor:
    such a weight is only multiplied (`F.linear`), never sliced."""
    return type(t) not in (torch.Tensor, nn.Parameter)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """The dense [rows, inputs] matrix a quantized weight multiplies by, as its own kernel
    computes it: the product with the identity (x @ W.T at x = I) is exact, every other
    term being zero. For tests and checks, not for serving."""
    eye = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)
    return F.linear(eye, weight).T.contiguous()


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes a (possibly quantized) tensor holds: the sum over a torchao tensor's inner
    tensors (data, scales, zeros)."""
    if not is_quantized(t):
        return t.nbytes
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return sum(storage_bytes(getattr(t, n)) for n in names)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter of `model`, quantized ones at their stored size."""
    return sum(storage_bytes(p) for p in model.parameters())


def quantizable(model: nn.Module) -> set[str]:
    """The parameters a quantization method applies to: the weight of every `nn.Linear`
    (the parallel linears are `nn.Linear`) unless its module sets `keep_precision` (routers),
    and every parameter marked `stacked_experts` (routed experts, [E, rows, inputs])."""
    names = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, nn.Linear) and not getattr(module, "keep_precision", False):
            names.add(prefix + "weight")
        for attr, param in module.named_parameters(recurse=False):
            if getattr(param, "stacked_experts", False):
                names.add(prefix + attr)
    return names


@dataclass(frozen=True)
class Quantizer:
    """How the loader places the parameters of one model under `method`: quantizable ones
    quantized (`groups`: each one's inputs per scale), the others as they would be without
    it. Under tensor parallelism a layer whose inputs are split over ranks (`split`) is
    quantized as the whole tensor would be: int4 groups never straddle a shard, and int8 row
    scales are taken over the whole row (each rank's row maxima, gathered), so every rank
    holds exactly its slice of the single-process quantized weight."""

    method: Method
    groups: dict[str, int]
    split: frozenset[str]
    dtype: torch.dtype
    device: torch.device
    # Pre-quantized parameters: their integer values arrive as the tensor, and this gives
    # their scales (the sources' concatenated) by parameter name.
    scales: Callable[[str], torch.Tensor] | None = None
    given: frozenset[str] = frozenset()

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor | nn.Module:
        if name in self.given:
            assert self.scales is not None
            return self._given(name, tensor, self.scales(name))
        tensor = tensor.to(dtype=self.dtype)
        if name not in self.groups:
            return tensor.to(device=self.device)
        scale = None
        if self.method.name == "int8" and name in self.split:
            scale = row_scales(parallel_state.all_gather(tensor.abs().amax(dim=-1)).amax(dim=0))
        group = self.groups[name]
        if tensor.dim() == 3:
            return nn.ParameterList(
                nn.Parameter(
                    quantize(self.method, e, self.device, group, None if scale is None else scale[i]),
                    requires_grad=False,
                )
                for i, e in enumerate(tensor)
            )
        return quantize(self.method, tensor, self.device, group, scale)

    def _given(self, name: str, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | nn.Module:
        group = self.groups[name]
        if values.dim() == 3:  # stacked experts: their scales arrive concatenated over the experts
            scale = scale.reshape(values.shape[0], values.shape[1], -1)
            return nn.ParameterList(
                nn.Parameter(from_integers(self.method, v, s, group, self.dtype, self.device), requires_grad=False)
                for v, s in zip(values, scale)
            )
        return from_integers(self.method, values, scale, group, self.dtype, self.device)


def quantizer(model: nn.Module, method: Method, dtype: torch.dtype, device: torch.device) -> Quantizer:
    """The loader's placement for `model` under `method`, refused here, before any weight is
    read, when this device or dtype cannot run it or a layer's shape cannot take it."""
    check_runs(method, device.type, str(dtype).replace("torch.", ""))
    names = quantizable(model)
    if not names:
        raise UsageError(f"--quantization {method.name}: this model has no layers dlm can quantize")
    params = dict(model.named_parameters())
    groups, split = {}, set()
    for name in sorted(names):
        local = params[name].shape[-1]
        inputs = getattr(params[name], "split_inputs", local)  # the whole row's, when split over ranks
        group = method.group_for(inputs, name)
        if local != inputs:
            split.add(name)
            method.check_split(inputs, local, group, name)
        groups[name] = group if method.scale == "group" else local
    return Quantizer(method, groups, frozenset(split), dtype, device)


def probe(method: Method, device: torch.device) -> str | None:
    """Whether `method` runs on `device` here: a small weight quantized and multiplied, its
    product checked against the dense one. None when it works, else why not."""
    try:
        check_runs(method, device.type, "bfloat16" if method.dtypes.get(device.type) else "float32")
        if method.min_capability is not None and device.type == "cuda":
            have = torch.cuda.get_device_capability(device)
            if have < method.min_capability:
                needed = ".".join(map(str, method.min_capability))
                return f"needs compute capability {needed}+, this GPU has {have[0]}.{have[1]}"
        dtype = torch.bfloat16 if method.dtypes.get(device.type) else torch.float32
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 256, generator=gen).to(dtype)
        x = torch.randn(4, 256, generator=gen).to(dtype)
        weight = quantize(method, w, device, method.group_size(w.shape[1]) or w.shape[1])
        got = F.linear(x.to(device), weight).float().cpu()
        want = F.linear(x.float(), w.float())
        error = ((got - want).norm() / want.norm()).item()
        if not error < 0.2:  # int4 of a Gaussian weight errs by ~0.1; a broken kernel by ~1
            return f"its product differs from the dense one by {error:.0%}"
        return None
    except UsageError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a probe reports whatever stops the method
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def probe_all(devices: list[torch.device]) -> dict[str, dict[str, str | None]]:
    """`probe` of every method on every device: method -> device -> None or why not."""
    return {name: {str(d): probe(m, d) for d in devices} for name, m in METHODS.items()}
