"""How close a dlm step is to what this CPU can compute: the floor under any server's step.

For the 104M LLaDA checkpoint of benchmarks/vs_peers.py (or the default model) at vs_peers'
request (a suite chat prompt, 32 tokens in one block of 32 steps), it prints the matmul work of
one forward (the linear layers over the whole canvas, attention, the LM head on the masked
rows), the rate of one large bf16/fp32 GEMM (2048^3) at 1 thread and at every core, and dlm's
step in the model's dtype at each count: the step's rate as a share of the GEMM's says how
much any implementation, with the same forwards, could still gain. Counts and dtypes
alternate in rounds; the best of each counts (a busy neighbour slows all alike).

    python benchmarks/compute_floor.py [--model 104m|default] [--rounds 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GEN = 32


def forward_flops(config: dict[str, int], canvas: int) -> float:
    """Multiply-adds x 2 of one bidirectional forward over `canvas` tokens with the LM head on
    the GEN masked rows (what dlm computes; a server running the head on every row does more)."""
    d, ffn, layers = config["d_model"], config["mlp_hidden_size"], config["n_layers"]
    linear = 4 * d * d + 3 * d * ffn  # QKV + output projection, SwiGLU's gate, up and down
    attention = 2 * canvas * d  # scores and their weighted sum, per query row
    return 2.0 * layers * canvas * (linear + attention) + 2.0 * GEN * d * config["vocab_size"]


def gemm_seconds(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Seconds of one size^3 matmul in `dtype` at this thread's count (after one untimed)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("104m", "default"), default="104m")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (dlm's `auto` picks it per CPU)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dlm-bench")
    args = ap.parse_args()

    from benchmarks.vs_peers import default_model, prompts, write_104m
    from dlm.engine.cpu_plan import default_threads
    from dlm.engine.llm import LLM

    model_dir = write_104m(args.workdir / "llada-8x1024-104m") if args.model == "104m" else default_model()
    config = json.loads((model_dir / "config.json").read_text())
    llm = LLM(model_dir, dtype=args.dtype, thread_governor=False)
    question = prompts(1)[0][-1]["content"]
    kwargs = {"chat": True, "gen_length": GEN, "steps": GEN, "block_length": GEN, "temperature": 0.0}
    canvas = len(llm.generate(question, **kwargs)[0].prompt_ids) + GEN
    flops = forward_flops(config, canvas)
    counts = sorted({1, default_threads()})
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for n in counts:
            torch.set_num_threads(n)
            seconds = gemm_seconds(llm.dtype)
            best["gemm", n] = min(best.get(("gemm", n), seconds), seconds)
            out = llm.generate(question, **kwargs)[0]
            seconds = out.seconds / out.nfe
            best["step", n] = min(best.get(("step", n), seconds), seconds)
    print(f"{args.model}, {llm.dtype}, canvas {canvas} tokens: {flops / 1e9:.2f} GFLOP per forward")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| threads | GEMM 2048^3 GFLOP/s | dlm step ms | step GFLOP/s | share of the GEMM rate |")
    print("|---|---|---|---|---|")
    for n in counts:
        gemm = 2 * 2048**3 / best["gemm", n] / 1e9
        step = best["step", n]
        rate = flops / step / 1e9
        print(f"| {n} | {gemm:.0f} | {step * 1000:.1f} | {rate:.0f} | {rate / gemm:.0%} |")


if __name__ == "__main__":
    main()
