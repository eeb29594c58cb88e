"""Time each kernel against the unfused torch path and report peak memory.

For every kernel, up to three paths on the same inputs: `unfused` (the straightforward torch
code: full logits, explicit attention matrix, dense experts, separate add and norm),
`twin` (the torch twin the engine runs on CPU) and, on CUDA, `triton`. Peak memory is the
largest amount of tensor memory live during the call above what existed before it
(`dlm.kernels.peak_memory` on CPU, the CUDA allocator's peak on CUDA). Shapes default to a
serving step (32 decided positions, vocab 157184; 8 x 512-token canvases) scaled down on
CPU so the run stays short; `--full` uses the GPU shapes anywhere. On CUDA each path is also
timed queued (`queued`: calls back to back between two CUDA events) beside the synchronised
median per call.

    python benchmarks/kernel_speed.py [--device cuda] [--dtype bfloat16] [--full] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dlm.kernels.attention import attention_torch, dllm_mask  # noqa: E402
from dlm.kernels.moe import fused_moe_torch  # noqa: E402
from dlm.kernels.peak_memory import PeakTensorMemory  # noqa: E402
from dlm.kernels.rms_norm import rms_norm_torch  # noqa: E402
from dlm.kernels.rotary import rotary_torch  # noqa: E402
from dlm.kernels.token_stats import token_stats_torch, token_stats_unfused  # noqa: E402


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up (compilation, caches)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def queued(fn: Callable[[], Any], repeats: int) -> float:
    """CUDA: seconds per call of `repeats` calls issued back to back, timed by CUDA events
    around them: the host's launches overlap the device's work, as in a step that queues
    its kernels, where `timed` (each call synchronised) adds the launch path to every call.
    On an H200 the default token statistics took 0.78 ms per synchronised call and 0.69 ms
    under triton's do_bench (docs/benchmarks.md), so both are reported."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with PeakTensorMemory() as memory:
        fn()
    return memory.peak


def unfused_attention(q, k, v, *, kv_lens, q_positions, block_size):
    """The [Tq, Tk] score matrix materialised, GQA by repeating the key/value heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    mask = dllm_mask(kv_lens, q_positions, block_size, k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1).to(v.dtype)) @ v


def unfused_moe(x, w13, w2, topk_ids, topk_weights):
    """Every expert on every token; routing weights zero where a token does not go."""
    e, f = w13.shape[0], w2.shape[2]
    dense = torch.zeros((x.shape[0], e), dtype=torch.float32, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights.float())
    gate_up = torch.einsum("td,efd->etf", x, w13)
    act = F.silu(gate_up[..., :f]) * gate_up[..., f:]
    out = torch.einsum("etf,edf->etd", act, w2).float()
    return (out * dense.T[..., None]).sum(0).to(x.dtype)


def unfused_norm(x, weight, eps, *, residual, zero_centred):
    summed = x + residual
    h = summed.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), summed


def unfused_rotary(q, k, cos, sin):
    """Out of place: new q and k tensors (the layers' path before the in-place kernel)."""

    def rotate(x):
        half = x.shape[-1] // 2
        rot = x.float()
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return (rot * cos[:, None] + rotated * sin[:, None]).to(x.dtype)

    return rotate(q), rotate(k)


def cases(device: torch.device, dtype: torch.dtype, full: bool) -> dict[str, tuple[dict, dict[str, Callable]]]:
    """Kernel -> (shape description, {path: zero-argument call})."""
    small = device.type == "cpu" and not full
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)  # noqa: E731
    triton_ok = device.type == "cuda"
    out: dict[str, tuple[dict, dict[str, Callable]]] = {}

    n, vocab, d = 32, 157184, (256 if small else 4096)
    hidden, weight = rand(n, d), rand(vocab, d, scale=d**-0.5)
    kw = dict(want_entropy=True, want_margin=True)
    paths = {
        "unfused": lambda: token_stats_unfused(hidden, weight, **kw),
        "twin": lambda: token_stats_torch(hidden, weight, **kw),
    }
    if triton_ok:
        from dlm.kernels.token_stats_triton import token_stats_triton

        paths["triton"] = lambda: token_stats_triton(hidden, weight, **kw)
    out["token_stats"] = (dict(positions=n, vocab=vocab, hidden=d), paths)

    b, t, hq, hkv, hd, bs = (2, 256, 8, 2, 64, 32) if small else (8, 512, 32, 8, 128, 32)
    q, k, v = rand(b, hq, t, hd), rand(b, hkv, t, hd), rand(b, hkv, t, hd)
    lens = torch.linspace(t // 2, t, b, device=device).long()
    for name, block in (("attention_bidirectional", None), ("attention_block_causal", bs)):
        pos = torch.arange(t, device=device).expand(b, t)
        akw = dict(kv_lens=lens, q_positions=pos, block_size=block)
        paths = {
            "unfused": lambda akw=akw: unfused_attention(q, k, v, **akw),
            "twin": lambda akw=akw: attention_torch(q, k, v, **akw),
        }
        if triton_ok:
            from dlm.kernels.attention_triton import attention_triton

            paths["triton"] = lambda akw=akw: attention_triton(q, k, v, **akw)
        out[name] = (dict(batch=b, tokens=t, q_heads=hq, kv_heads=hkv, head_dim=hd, block=block), paths)

    rows, hidden_size = (1024, 1024) if small else (8192, 4096)
    x, res, w = rand(rows, hidden_size), rand(rows, hidden_size), 1 + rand(hidden_size, scale=0.1)
    nkw = dict(residual=res, zero_centred=False)
    paths = {"unfused": lambda: unfused_norm(x, w, 1e-5, **nkw), "twin": lambda: rms_norm_torch(x, w, 1e-5, **nkw)}
    if triton_ok:
        from dlm.kernels.rms_norm_triton import rms_norm_triton

        paths["triton"] = lambda: rms_norm_triton(x, w, 1e-5, **nkw)
    out["add_rms_norm"] = (dict(rows=rows, hidden=hidden_size), paths)

    angles = torch.rand(b, t, hd, generator=g, device=device) * 100
    cos, sin = angles.cos(), angles.sin()
    rq, rk = rand(b, hq, t, hd), rand(b, hkv, t, hd)
    paths = {"unfused": lambda: unfused_rotary(rq, rk, cos, sin), "twin": lambda: rotary_torch(rq, rk, cos, sin)}
    if triton_ok:
        from dlm.kernels.rotary_triton import rotary_triton

        paths["triton"] = lambda: rotary_triton(rq, rk, cos, sin)
    out["rotary"] = (dict(batch=b, tokens=t, q_heads=hq, kv_heads=hkv, head_dim=hd), paths)

    tokens, experts, topk, dm, ff = (64, 16, 4, 256, 256) if small else (256, 64, 8, 2048, 1024)
    mx = rand(tokens, dm)
    w13, w2 = rand(experts, 2 * ff, dm, scale=dm**-0.5), rand(experts, dm, ff, scale=ff**-0.5)
    weights, ids = torch.randn(tokens, experts, generator=g, device=device).softmax(-1).topk(topk, -1)
    paths = {
        "unfused": lambda: unfused_moe(mx, w13, w2, ids, weights),
        "twin": lambda: fused_moe_torch(mx, w13, w2, ids, weights),
    }
    if triton_ok:
        from dlm.kernels.moe_triton import fused_moe_triton

        paths["triton"] = lambda: fused_moe_triton(mx, w13, w2, ids, weights)
    out["fused_moe"] = (dict(tokens=tokens, experts=experts, topk=topk, hidden=dm, ffn=ff), paths)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--full", action="store_true", help="GPU-sized shapes even on CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", nargs="*", help="kernel names to run")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{hardware}, {dtype}, torch {torch.__version__}", file=sys.stderr)
    results = []
    for name, (shape, paths) in cases(device, dtype, args.full).items():
        if args.only and name not in args.only:
            continue
        row: dict[str, Any] = {"kernel": name, "shape": shape}
        for path, fn in paths.items():
            with torch.inference_mode():
                row[f"{path}_ms"] = timed(fn, device, args.repeats) * 1e3
                if device.type == "cuda":
                    row[f"{path}_queued_ms"] = queued(fn, 4 * args.repeats) * 1e3
                row[f"{path}_peak_mib"] = peak_bytes(fn, device) / 2**20
        best = "triton" if "triton" in paths else "twin"
        row["speedup"] = row["unfused_ms"] / row[f"{best}_ms"]
        row["memory_ratio"] = row[f"{best}_peak_mib"] / max(row["unfused_peak_mib"], 1e-9)
        results.append(row)
        cols = "  ".join(
            f"{p} {row[f'{p}_ms']:8.2f} ms"
            + (f" (queued {row[f'{p}_queued_ms']:.2f})" if f"{p}_queued_ms" in row else "")
            + f" {row[f'{p}_peak_mib']:8.1f} MiB"
            for p in paths
        )
        print(f"{name:24s} {cols}  speedup x{row['speedup']:.2f}  memory x{row['memory_ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"hardware": hardware, "dtype": str(dtype), "results": results}, indent=1))


if __name__ == "__main__":
    main()
