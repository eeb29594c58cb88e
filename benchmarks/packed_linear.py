"""bf16 linear layers with weights packed once for oneDNN (dlm/kernels/packed_linear.py)
against plain weights (`F.linear`, the twin), side by side in one run.

1. Layers: each shape (default: the linears of an 8-layer, 1024-wide LLaDA: packed q/k/v,
   output, packed gate/up, down) at several row counts and thread counts, plain and packed
   alternated in rounds; the median time of each, their ratio, and whether the products are
   bit-identical.
2. With `--model DIR`: the model's denoising step, loaded twice (packed: the default; plain:
   `DLM_KERNELS=torch`), one request of `--gen-length` tokens in one block of as many steps,
   alternated in rounds at each thread count; ms per step, the ratio and whether the ids match.

    python benchmarks/packed_linear.py [--model DIR] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = "3072x1024,1024x1024,5632x1024,1024x2816"  # out x in
ROWS = "1,64,113,300,904"


def layers(args: argparse.Namespace, threads: list[int]) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from benchmarks.kernel_speed import timed
    from dlm.kernels.packed_linear import pack

    cpu = torch.device("cpu")
    rows_list = [int(r) for r in args.rows.split(",")]
    table = []
    for shape in args.shapes.split(","):
        out, inputs = (int(v) for v in shape.split("x"))
        w = (torch.randn(out, inputs) / inputs**0.5).bfloat16()
        packed = pack(w)
        for t in threads:
            torch.set_num_threads(t)
            for rows in rows_list:
                x = torch.randn(rows, inputs).bfloat16()
                plain_fn = functools.partial(F.linear, x, w)
                packed_fn = functools.partial(F.linear, x, packed)
                times: dict[str, list[float]] = {"plain": [], "packed": []}
                for _ in range(args.rounds):  # alternated, each round a median after a warm-up
                    times["plain"].append(timed(plain_fn, cpu, args.repeats))
                    times["packed"].append(timed(packed_fn, cpu, args.repeats))
                plain, fast = statistics.median(times["plain"]), statistics.median(times["packed"])
                table.append(
                    dict(
                        shape=shape,
                        threads=t,
                        rows=rows,
                        plain_ms=plain * 1e3,
                        packed_ms=fast * 1e3,
                        ratio=plain / fast,
                        identical=bool(torch.equal(plain_fn(), packed_fn())),
                    )
                )
    return table


def model_steps(args: argparse.Namespace, threads: list[int]) -> list[dict]:
    from dlm.engine.cpu_plan import apply_threads
    from dlm.engine.llm import LLM
    from dlm.engine.params import GenerationParams

    llms, given = {}, os.environ.get("DLM_KERNELS")
    for name, kernels in (("packed", "auto"), ("plain", "torch")):
        os.environ["DLM_KERNELS"] = kernels  # decided at load: each LLM keeps its weights' layout
        llms[name] = LLM(args.model, dtype="bfloat16", device="cpu")
    if given is None:
        os.environ.pop("DLM_KERNELS")
    else:
        os.environ["DLM_KERNELS"] = given
    n = args.gen_length
    params = GenerationParams(gen_length=n, steps=n, block_length=n)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    table = []
    for t in threads:
        apply_threads(t)
        ms: dict[str, list[float]] = {"packed": [], "plain": []}
        ids = {}
        for llm in llms.values():
            llm.generate(prompt, params)  # warm-up at this thread count
        for r in range(args.rounds):
            for name in llms if r % 2 == 0 else reversed(llms):
                out = llms[name].generate(prompt, params)[0]
                ms[name].append(out.seconds / out.nfe * 1e3)
                ids[name] = out.output_ids
        plain, fast = statistics.median(ms["plain"]), statistics.median(ms["packed"])
        table.append(
            dict(threads=t, plain_ms=plain, packed_ms=fast, ratio=plain / fast, identical=ids["plain"] == ids["packed"])
        )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="out x in, comma-separated")
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20, help="calls per timed round (layers): their median counts")
    ap.add_argument("--model", type=Path, help="also time this checkpoint's denoising step")
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from dlm.kernels.packed_linear import supported

    if not supported(torch.bfloat16, "cpu"):
        sys.exit("error: this CPU's oneDNN computes no native bf16: dlm packs no weight here")
    threads = sorted({1, torch.get_num_threads()})
    print(f"load average {os.getloadavg()[0]:.2f} at start; threads {threads}")
    result = {"layers": layers(args, threads)}
    print("| layer (out x in) | threads | rows | plain ms | packed ms | plain / packed | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in result["layers"]:
        print(
            f"| {r['shape']} | {r['threads']} | {r['rows']} | {r['plain_ms']:.3f} | {r['packed_ms']:.3f} "
            f"| **{r['ratio']:.2f}** | {r['identical']} |"
        )
    if args.model is not None:
        result["model"] = model_steps(args, threads)
        print(f"\n{args.model.name}, bf16, {args.gen_length} tokens in one block, {args.rounds} rounds:")
        print("| threads | plain ms/step | packed ms/step | plain / packed | same ids |")
        print("|---|---|---|---|---|")
        for r in result["model"]:
            print(
                f"| {r['threads']} | {r['plain_ms']:.1f} | {r['packed_ms']:.1f} | **{r['ratio']:.2f}** "
                f"| {r['identical']} |"
            )
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
