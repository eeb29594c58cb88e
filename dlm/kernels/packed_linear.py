"""bf16 linear layers on a CPU with weights packed once into oneDNN's blocked layout.

Why: on a CPU with native bf16 (AVX512-BF16, AMX) `F.linear` hands oneDNN a plain row-major
weight, and oneDNN reorders it into its blocked (VNNI) layout inside every call: at a short
canvas that reorder is a large share of the matmul. On this project's 2-core AMX VM the
104M-parameter LLaDA's linears took 1.2-1.7x less time with the weight packed once at load
(1024/2816-wide layers, 1-113 rows, 1 or 2 threads; `benchmarks/packed_linear.py`), and its
step 1.22-1.28x less. The product is bit-identical to `F.linear` on the plain weight (the same
oneDNN kernel, given its operand in the layout it would have made), which the tests check;
fp32 gains nothing (MKL's sgemm reads the plain layout), so only bf16 is packed.

`PackedLinearWeight` stands where the dense weight stood (like torchao's quantized tensors,
dlm/engine/quantized_weights.py): `F.linear` with it runs `mkldnn._linear_pointwise` on the
packed operand, and the model's code is unchanged. It holds no plain copy (memory as the dense
weight); any other op sees the dense weight, unpacked for that call (oneDNN's reorder back is
exact): nothing in the engine does that on a serving path, and it is logged once per op so a
slow path never hides. Views (slicing) are refused: the engine does not slice a weight of a
library's layout (`is_quantized` in dlm/engine/quantized_weights.py).

The torch twin is `F.linear` on the dense weight; which one runs is decided once, at load, by
`dlm.kernels.dispatch.prepare_linear_weight` (`DLM_KERNELS=torch` keeps every weight plain).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

log = logging.getLogger("dlm.kernels")

# Smaller weights stay plain: the packed call's fixed cost (a Python dispatch, ~5 us) outweighs
# the reorder it saves below about this many weights (a 1024 x 512 layer; 128- and 256-wide
# layers ran 0.74-0.99x, 512 x 1536 1.45-1.67x; `benchmarks/packed_linear.py --shapes`).
MIN_WEIGHTS = 2**19
# The row count oneDNN chooses the blocked layout for: a short canvas (a prompt and a block).
# It only tunes speed: products are identical at every row count (tests check 1 to 904 rows).
ROWS_HINT = 64


@cache
def supported(dtype: torch.dtype, device_type: str) -> bool:
    """Whether weights of `dtype` on `device_type` can be packed: bf16 on a CPU whose oneDNN
    computes bf16 natively (on one without, bf16 is emulated and packing is not measured)."""
    if device_type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:  # private ops of torch's oneDNN integration (what inductor packs with): absent, no packing
        return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and bool(
            torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):
        return False


def linear_packed(x: torch.Tensor, weight: PackedLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) with the packed operand; equal to the twin, `F.linear`
    on the dense weight."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, weight.packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


_unpacked_ops: set[str] = set()


class PackedLinearWeight(torch.Tensor):
    """A [out, in] bf16 weight held in oneDNN's blocked layout (an opaque mkldnn tensor)."""

    packed: torch.Tensor

    @staticmethod
    def __new__(cls, packed: torch.Tensor) -> PackedLinearWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, packed.shape, dtype=packed.dtype, device=torch.device("cpu"), requires_grad=False
        )

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]  # base repr reads values
        return f"PackedLinearWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def dense(self) -> torch.Tensor:
        """The plain [out, in] weight (oneDNN's reorder back is exact)."""
        return self.packed.to_dense()

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        """What it holds, for byte counts (`dlm.engine.quantized_weights.storage_bytes`)."""
        return ["packed"], None

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(*args, **kwargs)
            if isinstance(weight, PackedLinearWeight) and not isinstance(x, PackedLinearWeight):
                if x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype):
                    return linear_packed(x, weight, bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch types it as a plain function
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:  # nn.Parameter(weight) detaches it
            return PackedLinearWeight(args[0].packed)
        if func.is_view:
            raise NotImplementedError(f"{func} would view a packed linear weight; unpack it with .dense() first")
        name = str(func)
        if name not in _unpacked_ops:
            _unpacked_ops.add(name)
            log.warning("%s on a packed linear weight: it is unpacked for each such call (slow)", name)

        def unpack(t: Any) -> Any:
            return t.dense() if isinstance(t, PackedLinearWeight) else t

        return func(*tree_map(unpack, args), **tree_map(unpack, kwargs))


def _linear_args(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return input, weight, bias


def pack(weight: torch.Tensor) -> PackedLinearWeight:
    """A dense [out, in] bf16 CPU weight in oneDNN's blocked layout (`supported` must hold)."""
    return PackedLinearWeight(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT))


def layout_of(module: torch.nn.Module) -> str:
    """How `module`'s linear weights are held, as `/health` reports it: "onednn-packed" when
    any is packed, else "dense" (fp32, small layers, `DLM_KERNELS=torch`, other devices)."""
    return "onednn-packed" if any(isinstance(p, PackedLinearWeight) for p in module.parameters()) else "dense"
