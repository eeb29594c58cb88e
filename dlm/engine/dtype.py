"""Which floating-point type the model runs in: `--dtype auto` decided per device.

On CUDA the checkpoint's 16-bit dtype is kept; a float32 (or unstated) checkpoint runs in
bf16 where the GPU supports it, else fp16 (as GPU servers do: half the memory traffic of a
decode step). A bf16 checkpoint on a GPU without bf16 runs in fp16.

On CPU the choice is per model: bf16 is a trap unless the CPU computes it natively (without
AVX512-BF16 or AMX a bf16 matmul is emulated, 80x slower than fp32), and even then it wins
only at large enough shapes (3-4x fp32 at a 1024-wide layer, yet 1.3-1.5x slower for the
128-wide default model, whose steps are casts and elementwise work). So on a CPU with native
bf16, `auto` times a forward of the model's own layer shape in both dtypes and keeps bf16
only where it is faster (dlm/engine/cpu_plan.py, which also decides the intra-op threads;
cached per machine and shape under $DLM_HOME). The choice, the measured ratio and the threads
are logged and reported by `dlm doctor` and the server's `/health`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlm.engine import cpu_plan
from dlm.engine.cpu_plan import ModelShape
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


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in and why: `requested` as given, `reason` in words,
    `bf16_speedup` the probe's fp32 time over bf16 time where it ran, `threads` the intra-op
    threads its forwards run with on a CPU (None: not planned, torch's setting stands)."""

    dtype: torch.dtype
    requested: str
    device: str
    reason: str
    bf16_speedup: float | None = None
    threads: int | None = None

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
            "threads": self.threads,
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


def _cpu_choice(requested: str, shape: ModelShape | None, timer: cpu_plan.Timer | None) -> DtypeChoice:
    """`requested` (a dtype name, or auto) on the CPU for a model of `shape`."""
    if requested != "auto":
        dtype = DTYPES[requested]
        if shape is None:
            return DtypeChoice(dtype, requested, "cpu", "requested")
        return DtypeChoice(dtype, requested, "cpu", "requested", threads=cpu_plan.plan(shape, [dtype], timer).threads)
    flags = native_bf16_flags()
    if not flags:
        planned = None if shape is None else cpu_plan.plan(shape, [torch.float32], timer).threads
        reason = "no native bf16 on this CPU (avx512_bf16/amx_bf16)"
        return DtypeChoice(torch.float32, requested, "cpu", reason, threads=planned)
    if shape is None:  # a checkpoint no native family reads (--backend transformers)
        return DtypeChoice(torch.float32, requested, "cpu", "no model shape to time bf16 against fp32")
    plan = cpu_plan.plan(shape, [torch.float32, torch.bfloat16], timer)
    n = cpu_plan.max_team()
    fast = [cpu_plan.Candidate(torch.bfloat16, t) for t in sorted({1, n})]
    slow = [cpu_plan.Candidate(torch.float32, t) for t in sorted({1, n})]
    ratios = [r for s, f in zip(slow, fast) if (r := plan.ratio(s, f)) is not None]
    speedup = max(ratios) if ratios else None
    measured = "cached" if plan.cached else "measured"
    if plan.dtype == torch.bfloat16:
        reason = f"CPU has {'+'.join(flags)}; bf16 {speedup:.2f}x fp32 at this model's shape ({measured})"
    else:
        reason = (
            f"CPU has {'+'.join(flags)} but bf16 is only {speedup:.2f}x fp32 at this model's shape "
            f"(< {cpu_plan.BF16_MIN_SPEEDUP}; {measured})"
        )
    return DtypeChoice(plan.dtype, requested, "cpu", reason, speedup, plan.threads)


def _cuda_choice(requested: str, device: torch.device, checkpoint: str | None) -> DtypeChoice:
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    stored = DTYPES.get(str(checkpoint).removeprefix("torch."))
    if stored == torch.float16 or (stored == torch.bfloat16 and bf16):
        return DtypeChoice(stored, requested, str(device), f"the checkpoint's dtype ({checkpoint})")
    stated = f"{checkpoint or 'unstated'} checkpoint"
    if bf16:
        return DtypeChoice(torch.bfloat16, requested, str(device), f"{stated}; the GPU has bf16")
    return DtypeChoice(torch.float16, requested, str(device), f"{stated}; the GPU lacks bf16")


def choose_dtype(
    requested: str,
    device: torch.device,
    checkpoint: str | None = None,
    shape: ModelShape | None = None,
    timer: cpu_plan.Timer | None = None,
) -> DtypeChoice:
    """The dtype for a model on `device`: `requested` unless it is 'auto' (see the module
    docstring); `checkpoint` is the checkpoint's stated dtype (config `torch_dtype`); `shape`
    the model's dimensions, which on a CPU also plan its intra-op threads (`threads`), timed
    by `timer` (the loaded model's forward) or else one layer of the shape."""
    if requested != "auto" and requested not in DTYPES:
        raise UsageError(f"unknown dtype {requested!r}; use auto, {', '.join(DTYPES)}")
    if device.type == "cpu":
        choice = _cpu_choice(requested, shape, timer)
        if requested != "auto":
            return choice
    elif requested != "auto":
        return DtypeChoice(DTYPES[requested], requested, str(device), "requested")
    elif device.type == "cuda":
        choice = _cuda_choice(requested, device, checkpoint)
    else:  # mps, xpu, ...: 16-bit support varies, fp32 always works
        choice = DtypeChoice(torch.float32, requested, str(device), f"no dtype rule for {device.type}")
    threads = "" if choice.threads is None else f", {choice.threads} intra-op thread(s)"
    log.info("dtype auto on %s: %s (%s)%s", choice.device, choice.name, choice.reason, threads)
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
