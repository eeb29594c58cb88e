"""What the Triton kernels need to know about where they run.

`TRITON_INTERPRET=1` runs the kernels on CPU tensors through Triton's numpy interpreter:
that is how they are tested without an accelerator. The interpreter stores bfloat16 as raw
uint16: `tl.dot` would multiply those bit patterns as integers, so under it bf16 tiles are
upcast to fp32 before a dot (exact: bf16 products are exact in fp32, only the accumulation
order can differ from the tensor-core path), and its fp32 -> bf16 cast truncates, so kernels
round through `round_to`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlm.kernels.dispatch import interpreting


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast `dtype` tiles before `tl.dot` (see module docstring)."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to nearest-even in `dtype`. For bf16 the rounding is done in integer
    arithmetic: the interpreter's fp32 -> bf16 cast truncates, the GPU's rounds; this agrees
    with torch on both."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
