"""The one place that picks a kernel implementation; the engine calls kernels only here.

`DLM_KERNELS` chooses:
  auto (default)  Triton for CUDA tensors when triton is installed, the torch twins elsewhere;
  torch           the torch twins everywhere;
  triton          Triton everywhere. CPU tensors then need `TRITON_INTERPRET=1` (Triton's
                  interpreter: how the kernels are tested without an accelerator).
Every kernel has a torch twin in `dlm/kernels/<name>.py` and a Triton version with the same
signature in `dlm/kernels/<name>_triton.py`, imported only when first chosen.

Linear layers are the one CPU kernel: under `auto` and `triton`, bf16 weights on a CPU with
native bf16 are packed at load into oneDNN's blocked layout (`dlm/kernels/packed_linear.py`,
`prepare_linear_weight`); under `torch` they stay plain and run `F.linear`, the twin.

A Triton kernel that failed its self-test on this process's device (`dlm.kernels.selftest`,
run by `dlm serve` at start) is switched off with `fall_back`: every later call of it runs
the torch twin, whatever `DLM_KERNELS` says.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from functools import cache
from typing import Any, ParamSpec, TypeVar, cast

import torch

from dlm.kernels import packed_linear
from dlm.kernels.attention import attention_torch, masked_attention_torch
from dlm.kernels.gumbel import draw_seed
from dlm.kernels.moe import fused_moe_torch
from dlm.kernels.rms_norm import rms_norm_torch
from dlm.kernels.rotary import rotary_torch
from dlm.kernels.token_stats import TokenStats, VocabShard, combine, merge, token_stats_partial_torch, token_stats_torch

P = ParamSpec("P")
R = TypeVar("R")

_TORCH: dict[str, Callable[..., Any]] = {
    "token_stats": token_stats_torch,
    "token_stats_partial": token_stats_partial_torch,
    "rms_norm": rms_norm_torch,
    "rotary": rotary_torch,
    "attention": attention_torch,
    "masked_attention": masked_attention_torch,  # torch only: no Triton kernel yet
    "fused_moe": fused_moe_torch,
}
_TRITON_MODULES = {
    "token_stats": "dlm.kernels.token_stats_triton",
    "token_stats_partial": "dlm.kernels.token_stats_triton",
    "rms_norm": "dlm.kernels.rms_norm_triton",
    "rotary": "dlm.kernels.rotary_triton",
    "attention": "dlm.kernels.attention_triton",
    "fused_moe": "dlm.kernels.moe_triton",
}


CHOICES = ("auto", "torch", "triton")
# Triton kernels switched off in this process: name -> why (see `fall_back`).
_fallen_back: dict[str, str] = {}


class KernelChoiceError(ValueError):
    """`DLM_KERNELS` names no choice, or one this device or install cannot run."""


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _choice() -> str:
    choice = os.environ.get("DLM_KERNELS", "auto").lower()
    if choice not in CHOICES:
        raise KernelChoiceError(f"DLM_KERNELS must be auto, torch or triton, not {choice!r}")
    return choice


def backend(device: torch.device) -> str:
    """'triton' or 'torch' for tensors on `device`, per `DLM_KERNELS`."""
    choice = _choice()
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise KernelChoiceError("DLM_KERNELS=triton but triton is not installed")
    if device.type != "cuda" and not interpreting():
        raise KernelChoiceError(
            f"DLM_KERNELS=triton on {device.type} tensors needs a CUDA device or TRITON_INTERPRET=1"
        )
    return "triton"


def linear_layout(dtype: torch.dtype, device: torch.device) -> str:
    """How linear weights of `dtype` on `device` are held: "onednn-packed" (packed once at
    load, `dlm.kernels.packed_linear`) or "dense" (plain, `F.linear`)."""
    return "onednn-packed" if _choice() != "torch" and packed_linear.supported(dtype, device.type) else "dense"


def prepare_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's dense [out, in] weight as the layer will hold it (`linear_layout`;
    a weight under `packed_linear.MIN_WEIGHTS` stays plain, where packing does not pay)."""
    if linear_layout(weight.dtype, weight.device) == "dense" or weight.numel() < packed_linear.MIN_WEIGHTS:
        return weight
    return packed_linear.pack(weight)


def triton_kernels() -> list[str]:
    """The kernels that have a Triton version."""
    return list(_TRITON_MODULES)


def fall_back(name: str, reason: str) -> None:
    """Run the torch twin for kernel `name` from now on in this process."""
    if name not in _TRITON_MODULES:
        raise KeyError(f"{name!r} has no Triton kernel")
    _fallen_back[name] = reason


def fallbacks() -> dict[str, str]:
    """The kernels switched to their torch twin in this process, and why."""
    return dict(_fallen_back)


def torch_twin(name: str) -> Callable[..., Any]:
    return _TORCH[name]


def triton_kernel(name: str) -> Callable[..., Any]:
    """The Triton version of kernel `name` (imports its module: needs triton)."""
    return _triton(name)


@cache
def _triton(name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(_TRITON_MODULES[name]), f"{name}_triton")


def implementation(name: str, device: torch.device) -> Callable[..., Any]:
    if name in _TRITON_MODULES and name not in _fallen_back and backend(device) == "triton":
        return _triton(name)
    return _TORCH[name]


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    shard: VocabShard | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    **kwargs: Any,
) -> TokenStats:
    """LM head + softmax statistics (`dlm.kernels.token_stats`). With `shard`, `weight` is this
    device's vocabulary range: its statistics are reduced to one partial, the devices'
    partials gathered and combined, so every device gets the statistics of the whole
    vocabulary. Every device draws the same sampling seed from its (identically seeded)
    `generator`, and the noise of a token depends only on (seed, row, vocab id)."""
    device = hidden.device
    if shard is None:
        return implementation("token_stats", device)(
            hidden, weight, temperature=temperature, generator=generator, **kwargs
        )
    seed = draw_seed(generator, device) if temperature > 0 else 0
    part = implementation("token_stats_partial", device)(
        hidden, weight, temperature=temperature, seed=seed, vocab_start=shard.start, **kwargs
    )
    return combine(shard.gather(merge(part)))


def _dispatched(name: str, twin: Callable[P, R]) -> Callable[P, R]:
    """Kernel `name` with its torch twin's signature and docstring, run by the implementation
    `implementation` picks for the device of its first argument (always a tensor)."""

    @functools.wraps(twin)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        device = cast(torch.Tensor, args[0]).device
        return cast(R, implementation(name, device)(*args, **kwargs))

    return call


rms_norm = _dispatched("rms_norm", rms_norm_torch)
rotary = _dispatched("rotary", rotary_torch)
attention = _dispatched("attention", attention_torch)
masked_attention = _dispatched("masked_attention", masked_attention_torch)  # torch only: no Triton kernel yet
_fused_moe = _dispatched("fused_moe", fused_moe_torch)


@functools.wraps(fused_moe_torch)
def fused_moe(x: torch.Tensor, w13: Any, w2: Any, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    # The Triton kernel reads stacked dense experts; one (quantized) weight per expert runs
    # through the twin, whose matmuls dispatch to the weights' own kernels.
    if isinstance(w13, torch.Tensor):
        return _fused_moe(x, w13, w2, topk_ids, topk_weights)
    return fused_moe_torch(x, w13, w2, topk_ids, topk_weights)
