"""`--dtype auto` against the faster of float32 and bfloat16, side by side on this machine.

For the default model and the 104M random LLaDA of benchmarks/vs_peers.py (8 layers, 1024
hidden, the default model's tokenizer), decode the same prompt with `dtype=float32`,
`bfloat16` and `auto` (the engine `dlm generate` runs, at the threads auto's CPU plan chose),
alternating the three in rounds so a busy neighbour slows all alike, and report each one's
median decode time and `auto`'s ratio to the faster fixed dtype (the acceptance bound is
1.10). `auto` measures afresh (a new DLM_HOME for the run, so no cached plan answers) and
prints what it chose and why.

    python benchmarks/dtype_auto.py [--rounds 3] [--gen-length 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.vs_peers import write_104m  # noqa: E402

DTYPES = ("float32", "bfloat16", "auto")


def measure(model: Path | None, rounds: int, gen_length: int) -> dict:
    from dlm.engine.llm import LLM
    from dlm.engine.params import GenerationParams

    llms = {dtype: LLM(model, dtype=dtype, device="cpu") for dtype in DTYPES}
    torch.set_num_threads(llms["auto"].dtype_choice.threads or torch.get_num_threads())
    prompt = list(range(10, 26))
    params = GenerationParams(gen_length=gen_length, block_length=gen_length, steps=gen_length, early_stop=False)
    for llm in llms.values():  # warm-up: first-call allocations and kernel selection
        llm.generate(prompt, params)
    seconds: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    for _ in range(rounds):
        for dtype, llm in llms.items():
            seconds[dtype].append(llm.generate(prompt, params)[0].seconds)
    median = {dtype: statistics.median(s) for dtype, s in seconds.items()}
    fastest = min(median["float32"], median["bfloat16"])
    return {
        "model": str(llms["auto"].model_dir),
        "auto": llms["auto"].dtype_choice.to_dict(),
        "median_seconds": {k: round(v, 4) for k, v in median.items()},
        "bf16_over_fp32": round(median["bfloat16"] / median["float32"], 3),
        "auto_over_fastest": round(median["auto"] / fastest, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-length", type=int, default=16)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dlm-vs-peers")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["DLM_HOME"] = tempfile.mkdtemp(prefix="dlm-home-")  # auto measures now
    big = write_104m(args.workdir / "llada-8x1024-104m")
    rows = [measure(None, args.rounds, args.gen_length), measure(big, args.rounds, args.gen_length)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, gen_length {args.gen_length}")
    for row in rows:
        s = row["median_seconds"]
        print(
            f"{Path(row['model']).name:32s} fp32 {s['float32']:.3f}s  bf16 {s['bfloat16']:.3f}s  "
            f"auto({row['auto']['dtype']}) {s['auto']:.3f}s  bf16/fp32 {row['bf16_over_fp32']:.2f}  "
            f"auto/fastest {row['auto_over_fastest']:.2f}"
        )
        print(f"    auto: {row['auto']['reason']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
