"""Which floating-point type the model runs in: `--dtype auto` decided per device.

On CUDA the checkpoint's 16-bit dtype is kept; a float32 (or unstated) checkpoint runs in
bf16 where the GPU supports it, else fp16 (as GPU servers do: half the memory traffic of a
decode step). A bf16 checkpoint on a GPU without bf16 runs in fp16.

On CPU bf16 is a trap unless the CPU computes it natively: without AVX512-BF16 or AMX a bf16
matmul is emulated and can be 80x slower than fp32, while with them it is several times
faster. So `auto` picks bf16 only when the CPU advertises a native bf16 instruction set AND a
millisecond matmul probe (measured once per process, at the first load) confirms that bf16
beats fp32 by `BF16_MIN_SPEEDUP`; otherwise fp32. The choice and the measured ratio are
logged and reported by `dlm doctor` and the server's `/health`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from dlm.engine.errors import UsageError

log = logging.getLogger("dlm.engine")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# CPU instruction sets that compute bf16 natively (/proc/cpuinfo flag names): x86 AVX512-BF16
# and AMX-BF16, and the Arm BF16 extension (its `Features` line).
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# bf16 must beat fp32 by this factor in the probe: below it the 16-bit rounding buys no speed.
BF16_MIN_SPEEDUP = 1.2
# The probe: an activation-shaped matmul [rows, k] @ [k, k], a few hundred microseconds in
# fp32 on one core, repeated; the best of the repeats counts (least disturbed by neighbours).
PROBE_SHAPE = (128, 512)
PROBE_REPEATS = 5


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in and why: `requested` as given, `reason` in words,
    `bf16_speedup` the probe's fp32 time over bf16 time where it ran."""

    dtype: torch.dtype
    requested: str
    device: str
    reason: str
    bf16_speedup: float | None = None

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.name,
            "requested": self.requested,
            "device": self.device,
            "reason": self.reason,
            "bf16_speedup": None if self.bf16_speedup is None else round(self.bf16_speedup, 2),
        }


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 `flags`, Arm `Features`); empty where
    the file is absent (macOS, Windows): no native bf16 is assumed there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16_flags() -> list[str]:
    """The native bf16 instruction sets this CPU advertises."""
    flags = cpu_flags()
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def _matmul_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of one `a @ b`."""
    start = time.perf_counter()
    torch.matmul(a, b)
    return time.perf_counter() - start


@cache
def bf16_speedup() -> float:
    """fp32 matmul time over bf16 matmul time on this CPU, measured once per process: the
    two dtypes alternate and the best time of each counts, so load from other processes
    slows both alike rather than biasing the ratio."""
    rows, k = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    fp32 = (torch.randn(rows, k, generator=generator), torch.randn(k, k, generator=generator))
    bf16 = tuple(t.to(torch.bfloat16) for t in fp32)
    for a, b in (fp32, bf16):
        torch.matmul(a, b)  # first call: kernel selection, packing buffers
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    for _ in range(PROBE_REPEATS):
        for a, b in (fp32, bf16):
            best[a.dtype] = min(best[a.dtype], _matmul_seconds(a, b))
    return best[torch.float32] / best[torch.bfloat16]


def _cpu_choice(requested: str) -> DtypeChoice:
    flags = native_bf16_flags()
    if not flags:
        return DtypeChoice(torch.float32, requested, "cpu", "no native bf16 on this CPU (avx512_bf16/amx_bf16)")
    speedup = bf16_speedup()
    if speedup >= BF16_MIN_SPEEDUP:
        reason = f"CPU has {'+'.join(flags)}; bf16 matmul {speedup:.1f}x fp32"
        return DtypeChoice(torch.bfloat16, requested, "cpu", reason, speedup)
    reason = f"CPU has {'+'.join(flags)} but bf16 matmul is only {speedup:.2f}x fp32 (< {BF16_MIN_SPEEDUP})"
    return DtypeChoice(torch.float32, requested, "cpu", reason, speedup)


def _cuda_choice(requested: str, device: torch.device, checkpoint: str | None) -> DtypeChoice:
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    stored = DTYPES.get(str(checkpoint).removeprefix("torch."))
    if stored == torch.float16 or (stored == torch.bfloat16 and bf16):
        return DtypeChoice(stored, requested, str(device), f"the checkpoint's dtype ({checkpoint})")
    stated = f"{checkpoint or 'unstated'} checkpoint"
    if bf16:
        return DtypeChoice(torch.bfloat16, requested, str(device), f"{stated}; the GPU has bf16")
    return DtypeChoice(torch.float16, requested, str(device), f"{stated}; the GPU lacks bf16")


def choose_dtype(requested: str, device: torch.device, checkpoint: str | None = None) -> DtypeChoice:
    """The dtype for a model on `device`: `requested` unless it is 'auto' (see the module
    docstring); `checkpoint` is the checkpoint's stated dtype (config `torch_dtype`)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise UsageError(f"unknown dtype {requested!r}; use auto, {', '.join(DTYPES)}")
        return DtypeChoice(DTYPES[requested], requested, str(device), "requested")
    if device.type == "cuda":
        choice = _cuda_choice(requested, device, checkpoint)
    elif device.type == "cpu":
        choice = _cpu_choice(requested)
    else:  # mps, xpu, ...: 16-bit support varies, fp32 always works
        choice = DtypeChoice(torch.float32, requested, str(device), f"no dtype rule for {device.type}")
    log.info("dtype auto on %s: %s (%s)", choice.device, choice.name, choice.reason)
    return choice


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a checkpoint's config.json states (`torch_dtype`, or `dtype` as newer
    transformers write it, at the top or in a multimodal model's `text_config`)."""
    from dlm.engine.config import read_config_json

    raw = read_config_json(Path(model_dir))
    nested = raw.get("text_config")
    text: dict = nested if isinstance(nested, dict) else {}
    found = raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return found if isinstance(found, str) else None
