"""Block diffusion vs AR mode on one block-causal checkpoint, and long-context memory.

    python benchmarks/block_diffusion.py [MODEL_DIR] [--family pangu] [--gen-length 128]
        [--threshold 0.9] [--repeats 3] [--long 4096,8192,16384,32768]

Without MODEL_DIR a tiny random checkpoint of `--family` is written to a temp dir (random
weights: tokens per forward then reflect random confidences, not a trained model's).
Both modes use the exact block KV cache on the same weights; reported per mode: forwards,
tokens per forward (TPF) and tokens/s (median of the repeats).

`--long` decodes a few tokens after prompts of the given lengths, each in a fresh process,
and reports prefill time, cache bytes and peak RSS: the cache grows linearly with the
context and the chunked prefill keeps attention memory at O(chunk x context).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.block_args import block_parser  # noqa: E402
from dlm.engine.block_checkpoints import write_tiny  # noqa: E402
from dlm.engine.llm import LLM  # noqa: E402
from dlm.engine.params import GenerationParams  # noqa: E402


def _model(args: argparse.Namespace, max_length: int = 8192) -> Path:
    if args.model:
        return Path(args.model)
    return write_tiny(Path(tempfile.mkdtemp(prefix="dlm-bench-")), args.family, max_position_embeddings=max_length)


def compare_modes(args: argparse.Namespace) -> None:
    llm = LLM(_model(args), dtype=args.dtype, device=args.device)
    prompt = [(13 * i) % (llm.config.vocab_size - 16) + 1 for i in range(args.prompt_length)]
    modes = {
        "diffusion": GenerationParams(gen_length=args.gen_length, threshold=args.threshold, cache="block"),
        "ar": GenerationParams(gen_length=args.gen_length, mode="ar", cache="block"),
    }
    rows = {}
    for name, params in modes.items():
        llm.engine.generate([prompt], params)  # warm-up
        times, seq = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            seq = llm.engine.generate([prompt], params)[0]
            times.append(time.perf_counter() - start)
        assert seq is not None
        tokens = len(seq.output_ids)
        seconds = statistics.median(times)
        rows[name] = {
            "tokens": tokens,
            "forwards": seq.nfe,
            "tokens_per_forward": round(tokens / seq.nfe, 3),
            "tokens_per_second": round(tokens / seconds, 1),
            "seconds": round(seconds, 4),
        }
    rows["diffusion_speedup"] = round(rows["diffusion"]["tokens_per_second"] / rows["ar"]["tokens_per_second"], 2)
    print(json.dumps({"model": llm.config.family, "threshold": args.threshold, **rows}, indent=2))


def one_long(args: argparse.Namespace, length: int) -> dict:
    llm = LLM(_model(args, max_length=length + 64), dtype=args.dtype, device=args.device)
    prompt = [(7 * i) % (llm.config.vocab_size - 16) + 1 for i in range(length)]
    start = time.perf_counter()
    seq = llm.engine.generate([prompt], GenerationParams(gen_length=8, block_length=4, threshold=0.6, cache="block"))[0]
    seconds = time.perf_counter() - start
    return {
        "prompt_tokens": length,
        "seconds": round(seconds, 2),
        "forwards": seq.nfe,
        "cache_tokens": seq.cache.length,
        "cache_mib": round(seq.cache.nbytes / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    ap = block_parser(__doc__, family="pangu")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--long", default=None, help="comma-separated prompt lengths")
    ap.add_argument("--one-long", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_long:
        print(json.dumps(one_long(args, args.one_long)))
    elif args.long:
        base = [
            sys.executable,
            __file__,
            *([args.model] if args.model else []),
            "--family",
            args.family,
            "--dtype",
            args.dtype,
            "--device",
            args.device,
        ]
        for length in (int(n) for n in args.long.split(",")):
            out = subprocess.run([*base, "--one-long", str(length)], capture_output=True, text=True, check=True)
            print(out.stdout.strip())
    else:
        compare_modes(args)


if __name__ == "__main__":
    main()
