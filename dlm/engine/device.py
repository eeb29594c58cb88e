"""Which device the model runs on, checked before anything loads: a device this build or
machine lacks, or a `DLM_KERNELS` choice the device cannot run, is a usage error (one
`error:` line), not a traceback from the first tensor placed there."""

from __future__ import annotations

import re

import torch

from dlm.engine.errors import UsageError
from dlm.kernels import dispatch

# The devices dlm runs on, as every --device and `device` setting spells them (any case).
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?", re.ASCII)  # cuda:١ is no device torch knows


def device_name(device: str) -> str:
    """`device` checked against the spellings dlm accepts, lower-cased; on any machine (a
    deployment is planned where it does not run). torch knows more device types (meta, mps,
    xla) that dlm does not run on: refused here, not by a failure deep in the load."""
    if not isinstance(device, str) or not DEVICE_NAME.fullmatch(device.lower()):
        raise UsageError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device.lower()


def resolve_device(device: str) -> torch.device:
    device = device_name(device)
    if device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except RuntimeError as exc:
            raise UsageError(f"unknown device {device!r}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise UsageError(f"device {device!r}: no CUDA device is available (torch {torch.__version__}, {build})")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise UsageError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    try:
        dispatch.backend(resolved)
    except dispatch.KernelChoiceError as exc:
        raise UsageError(str(exc)) from None
    return resolved
