"""On a CUDA machine: compile every Triton kernel for real, check it against its torch twin
at serving shapes, check the engine's ids through Triton equal the twins' for every family
(and, with two or more GPUs, tensor parallel over NCCL equals one GPU), check the memory
ceiling, then time the kernels (benchmarks/kernels.py). Not run in CI (there is no GPU there); prepared so one
short session on an accelerator gives the figures for docs/benchmarks.md.

    python benchmarks/gpu_check.py [--json gpu.json]     # exits 1 if a check fails
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def kernel_checks(dtype: torch.dtype) -> list[tuple[str, bool, str]]:
    from kernels.attention import attention_torch
    from kernels.attention_triton import attention_triton
    from kernels.moe import fused_moe_torch
    from kernels.moe_triton import fused_moe_triton
    from kernels.rms_norm import rms_norm_torch
    from kernels.rms_norm_triton import rms_norm_triton
    from kernels.rotary import rotary_torch
    from kernels.rotary_triton import rotary_triton
    from kernels.token_stats import token_stats_torch
    from kernels.token_stats_triton import token_stats_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=dev) * scale).to(dtype)  # noqa: E731
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out = []
    h, w = rand(32, 1024), rand(157184, 1024, scale=1024**-0.5)
    for temp in (0.0, 0.9):
        a = token_stats_triton(
            h,
            w,
            temperature=temp,
            generator=torch.Generator(device=dev).manual_seed(1),
            want_entropy=True,
            want_margin=True,
        )
        b = token_stats_torch(
            h,
            w,
            temperature=temp,
            generator=torch.Generator(device=dev).manual_seed(1),
            want_entropy=True,
            want_margin=True,
        )
        agree = (a.token == b.token).float().mean().item()
        err = max(rel_err(a.prob, b.prob), rel_err(a.entropy, b.entropy))
        out.append((f"token_stats T={temp}", agree >= 0.97 and err < 1e-3, f"ids agree {agree:.3f}, err {err:.2e}"))
    x, r, nw = rand(4096, 4096), rand(4096, 4096), 1 + rand(4096, scale=0.1)
    for zc in (False, True):
        a, sa = rms_norm_triton(x, nw, 1e-5, residual=r, zero_centred=zc)
        b, sb = rms_norm_torch(x, nw, 1e-5, residual=r, zero_centred=zc)
        e = rel_err(a, b)
        out.append((f"rms_norm zero_centred={zc}", e < tol and torch.equal(sa, sb), f"err {e:.2e}"))
    cos_sin = torch.rand(4, 512, 64, device=dev) * 50
    for rd in (128, 64):
        q, k = rand(4, 32, 512, 128), rand(4, 8, 512, 128)
        q2, k2 = q.clone(), k.clone()
        rotary_triton(q, k, cos_sin[..., :rd].cos(), cos_sin[..., :rd].sin())
        rotary_torch(q2, k2, cos_sin[..., :rd].cos(), cos_sin[..., :rd].sin())
        e = max(rel_err(q, q2), rel_err(k, k2))
        out.append((f"rotary dims={rd}", e < tol, f"err {e:.2e}"))
    q, k, v = rand(8, 32, 512, 128), rand(8, 8, 512, 128), rand(8, 8, 512, 128)
    lens = torch.linspace(100, 512, 8, device=dev).long()
    pos = torch.arange(512, device=dev).expand(8, 512)
    for bs in (None, 1, 4, 32):
        kw = dict(kv_lens=lens, q_positions=pos, block_size=bs)
        ref = attention_torch(q.double(), k.double(), v.double(), **kw)
        ea, eb = rel_err(attention_triton(q, k, v, **kw), ref), rel_err(attention_torch(q, k, v, **kw), ref)
        out.append((f"attention block={bs}", ea <= 2 * eb + tol, f"triton err {ea:.2e}, twin err {eb:.2e}"))
    mx = rand(256, 2048)
    w13, w2 = rand(64, 2048, 2048, scale=2048**-0.5), rand(64, 2048, 1024, scale=1024**-0.5)
    wt, ids = torch.randn(256, 64, generator=g, device=dev).softmax(-1).topk(8, -1)
    e = rel_err(fused_moe_triton(mx, w13, w2, ids, wt), fused_moe_torch(mx, w13, w2, ids, wt))
    out.append(("fused_moe", e < tol, f"err {e:.2e}"))
    return out


def engine_checks() -> list[tuple[str, bool, str]]:
    """Per family (MoE ones through the fused MoE kernel): the same ids with the torch twins
    and with the Triton kernels; with two or more GPUs, also tensor parallel over NCCL."""
    from engine.llm import LLM
    from engine.parallel.distributed import ParallelConfig
    from tests.tp_checkpoints import PARAMS, PROMPT, write_family

    out = []
    for family, params in PARAMS.items():
        llm = LLM(write_family(Path(tempfile.mkdtemp()), family), dtype="float32", device="cuda")
        ids = {}
        for choice in ("torch", "auto"):
            os.environ["DLM_KERNELS"] = choice
            ids[choice] = [o.output_ids for o in llm.generate([PROMPT, PROMPT[:7]], **params)]
        os.environ.pop("DLM_KERNELS")
        out.append((f"{family} ids torch == triton", ids["torch"] == ids["auto"], ""))
        if torch.cuda.device_count() >= 2:
            with LLM(
                llm.model_dir, dtype="float32", device="cuda", parallel=ParallelConfig(tensor_parallel_size=2)
            ) as tp:
                split = [o.output_ids for o in tp.generate([PROMPT, PROMPT[:7]], **params)]
            out.append((f"{family} ids TP 2 (NCCL) == 1 GPU", split == ids["auto"], ""))
        del llm
    return out


def memory_cap_check() -> tuple[str, bool, str]:
    """--gpu-memory-utilization: beyond the share, allocation fails."""
    from engine.runtime.engine import cap_device_memory

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    cap_device_memory(device, 0.25)
    try:
        torch.empty(int(total * 0.5), dtype=torch.uint8, device=device)
        refused = False
    except torch.OutOfMemoryError:
        refused = True
    finally:
        cap_device_memory(device, 1.0)
        torch.cuda.empty_cache()
    return ("memory cap refuses 50% under a 25% cap", refused, "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=Path("gpu_benchmarks.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device")
    checks = kernel_checks(torch.float32) + kernel_checks(torch.bfloat16) + engine_checks() + [memory_cap_check()]
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name:32s} {detail}")
    bench = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--device", "cuda", "--json", str(args.json)],
        check=False,
    )
    sys.exit(0 if all(ok for _, ok, _ in checks) and bench.returncode == 0 else 1)


if __name__ == "__main__":
    main()
