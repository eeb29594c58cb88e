"""The one place that picks a kernel implementation.

`DLM_KERNELS=torch` forces the pure-torch twins everywhere; `auto` (default) would use a
Triton kernel for CUDA tensors where one is registered in `_TRITON`. The engine calls
kernels only through the functions below.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from kernels.token_stats import TokenStats, token_stats_torch

_TORCH: dict[str, Callable[..., Any]] = {"token_stats": token_stats_torch}
_TRITON: dict[str, Callable[..., Any]] = {}  # CUDA implementations, registered by name


def backend(name: str, device: torch.device) -> str:
    """'triton' or 'torch' for kernel `name` on `device`."""
    choice = os.environ.get("DLM_KERNELS", "auto").lower()
    if choice not in {"auto", "torch", "triton"}:
        raise ValueError(f"DLM_KERNELS must be auto, torch or triton, not {choice!r}")
    if choice == "torch" or name not in _TRITON or device.type != "cuda":
        return "torch"
    return "triton"


def implementation(name: str, device: torch.device) -> Callable[..., Any]:
    return (_TRITON if backend(name, device) == "triton" else _TORCH)[name]


def token_stats(hidden: torch.Tensor, weight: torch.Tensor, **kwargs: Any) -> TokenStats:
    return implementation("token_stats", hidden.device)(hidden, weight, **kwargs)
