"""A short self-test of every Triton kernel on one device: does it compile there, and does it
agree with its torch twin on small inputs?

Triton compiles each kernel for the device and dtype it first meets, so a wheel, driver or
architecture the kernels were never built for shows up only on that machine. `dlm doctor`
reports this test; `dlm serve` runs it at start where the dispatch would pick Triton and
switches any kernel that fails to its torch twin (`guard`), so a broken kernel costs speed,
never wrong tokens. Inputs are small (milliseconds once compiled) and seeded; outputs are
compared in float64 with a tolerance per dtype, and argmax ids must be equal (the inputs give
every row a clear winner, so a tie cannot excuse a difference).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dlm.kernels import dispatch
from dlm.kernels.token_stats import TokenStats, combine, merge

log = logging.getLogger("dlm.kernels")

# Largest relative difference (to the twin's largest magnitude) a kernel may show.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class KernelResult:
    """`status`: ok, mismatch (ran, disagrees with its twin), error (did not compile or
    run), skipped (not tested on this device) or absent (triton is not installed)."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "error")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class _Inputs:
    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.generator = torch.Generator().manual_seed(0)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.generator) * scale).to(self.device, self.dtype)


def _lm_head(x: _Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states whose logits have a clear winner per row (a margin of several units)."""
    weight = x.randn(300, 64, scale=64**-0.5)
    targets = torch.randint(0, 300, (12,), generator=x.generator).to(x.device)
    return (weight[targets].float() * 8).to(x.dtype), weight


def _compare_stats(a: TokenStats, b: TokenStats) -> tuple[bool, str]:
    if not torch.equal(a.token.cpu(), b.token.cpu()):
        return False, "argmax ids differ"
    pairs = [(a.prob, b.prob), (a.entropy, b.entropy), (a.margin, b.margin)]
    if any((x is None) != (y is None) for x, y in pairs):
        return False, "one side lacks a statistic the other computed"
    err = max(_rel(x, y) for x, y in pairs if x is not None and y is not None)
    return err < 1e-3, f"max rel err {err:.1e}"


def _token_stats(run: Callable, x: _Inputs) -> tuple[bool, str]:
    hidden, weight = _lm_head(x)
    for temperature in (0.0, 0.9):
        outs = [
            impl(
                hidden,
                weight,
                temperature=temperature,
                generator=torch.Generator(device=x.device).manual_seed(1),
                want_entropy=True,
                want_margin=True,
            )
            for impl in (run, dispatch.torch_twin("token_stats"))
        ]
        ok, detail = _compare_stats(*outs)
        if not ok:
            return ok, f"T={temperature}: {detail}"
    return True, detail


def _token_stats_partial(run: Callable, x: _Inputs) -> tuple[bool, str]:
    hidden, weight = _lm_head(x)
    kw = dict(temperature=0.9, seed=7, want_entropy=True, want_margin=True, vocab_start=300)
    outs = [combine(merge(impl(hidden, weight, **kw))) for impl in (run, dispatch.torch_twin("token_stats_partial"))]
    return _compare_stats(*outs)


def _rms_norm(run: Callable, x: _Inputs) -> tuple[bool, str]:
    a, r, w = x.randn(20, 96), x.randn(20, 96), 1 + x.randn(96, scale=0.1)
    err = 0.0
    for zero_centred in (False, True):
        out, res = run(a, w, 1e-5, residual=r, zero_centred=zero_centred)
        ref, ref_res = dispatch.torch_twin("rms_norm")(a, w, 1e-5, residual=r, zero_centred=zero_centred)
        err = max(err, _rel(out, ref), _rel(res, ref_res))
    return err < TOLERANCE[x.dtype], f"max rel err {err:.1e}"


def _rotary(run: Callable, x: _Inputs) -> tuple[bool, str]:
    q, k = x.randn(2, 4, 10, 32), x.randn(2, 2, 10, 32)
    angles = (torch.rand(2, 10, 16, generator=x.generator) * 50).to(x.device)
    ours, twins = (q.clone(), k.clone()), (q.clone(), k.clone())
    run(*ours, angles.cos(), angles.sin())  # partial rotary: 16 of 32 dims
    dispatch.torch_twin("rotary")(*twins, angles.cos(), angles.sin())
    err = max(_rel(ours[0], twins[0]), _rel(ours[1], twins[1]))
    return err < TOLERANCE[x.dtype], f"max rel err {err:.1e}"


def _attention(run: Callable, x: _Inputs) -> tuple[bool, str]:
    q, k, v = x.randn(2, 4, 8, 32), x.randn(2, 2, 40, 32), x.randn(2, 2, 40, 32)
    kv_lens = torch.tensor([40, 23], device=x.device)
    positions = (kv_lens - 8)[:, None] + torch.arange(8, device=x.device)
    err = 0.0
    for block_size in (None, 8):
        kw = dict(kv_lens=kv_lens, q_positions=positions, block_size=block_size)
        err = max(err, _rel(run(q, k, v, **kw), dispatch.torch_twin("attention")(q, k, v, **kw)))
    return err < TOLERANCE[x.dtype], f"max rel err {err:.1e}"


def _fused_moe(run: Callable, x: _Inputs) -> tuple[bool, str]:
    t, e, d, f = 12, 4, 32, 48
    a = x.randn(t, d)
    w13, w2 = x.randn(e, 2 * f, d, scale=d**-0.5), x.randn(e, d, f, scale=f**-0.5)
    weights, ids = torch.randn(t, e, generator=x.generator).softmax(-1).topk(2, -1)
    weights, ids = weights.to(x.device), ids.to(x.device)
    err = _rel(run(a, w13, w2, ids, weights), dispatch.torch_twin("fused_moe")(a, w13, w2, ids, weights))
    return err < TOLERANCE[x.dtype], f"max rel err {err:.1e}"


CHECKS: dict[str, Callable[[Callable, _Inputs], tuple[bool, str]]] = {
    "token_stats": _token_stats,
    "token_stats_partial": _token_stats_partial,
    "rms_norm": _rms_norm,
    "rotary": _rotary,
    "attention": _attention,
    "fused_moe": _fused_moe,
}


def check_kernel(name: str, device: torch.device, dtype: torch.dtype) -> KernelResult:
    """Compile and run Triton kernel `name` on `device` in `dtype` against its torch twin."""
    start = time.perf_counter()
    try:
        ok, detail = CHECKS[name](dispatch.triton_kernel(name), _Inputs(device, dtype))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # a compile or launch failure is this test's finding, not a crash
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return KernelResult(name, "error", f"{type(exc).__name__}: {first}"[:300], time.perf_counter() - start)
    return KernelResult(name, "ok" if ok else "mismatch", detail, time.perf_counter() - start)


def unavailable(device: torch.device) -> str | None:
    """Why the kernels cannot be tested on `device` (None: they can)."""
    if not dispatch.triton_available():
        return "absent"
    if device.type != "cuda" and not dispatch.interpreting():
        return "skipped"
    return None


def run(device: torch.device, dtype: torch.dtype) -> list[KernelResult]:
    """Every Triton kernel's result on `device`; on a device Triton cannot compile for
    (CPU without `TRITON_INTERPRET=1`) or without triton, each is reported skipped/absent."""
    why = unavailable(device)
    if why == "absent":
        return [KernelResult(name, "absent", "triton is not installed") for name in dispatch.triton_kernels()]
    if why == "skipped":
        detail = f"no Triton compiler for {device.type} (TRITON_INTERPRET=1 runs the interpreter)"
        return [KernelResult(name, "skipped", detail) for name in dispatch.triton_kernels()]
    return [check_kernel(name, device, dtype) for name in dispatch.triton_kernels()]


def guard(device: torch.device, dtype: torch.dtype) -> list[KernelResult]:
    """Before serving: where the dispatch would run Triton on `device`, test every kernel and
    switch each that fails to its torch twin (logged). Returns the results (empty when the
    dispatch runs the twins there anyway)."""
    if dispatch.backend(device) != "triton":
        return []
    results = run(device, dtype)
    for result in results:
        if result.failed:
            dispatch.fall_back(result.name, f"self-test {result.status}: {result.detail}")
            log.warning(
                "kernel %s failed its self-test (%s: %s); using its torch twin",
                result.name,
                result.status,
                result.detail,
            )
        else:
            log.info("kernel %s self-test %s (%s)", result.name, result.status, result.detail)
    return results
