"""Server overhead: the same requests through `dlm serve` (HTTP, validation, scheduling,
streaming plumbing) versus generated in process by the engine directly.

At concurrency C, the in-process side decodes the prompts C at a time in one batch (the
best the engine can do); the server side sends C requests at a time from C client threads
to a `dlm serve` process allowed C sequences per forward. Both sides use the same model,
dtype, device and thread count; each level is timed `--repeats` times and the median kept.
Overhead = server time / in-process time - 1 (goal: under 10% at concurrency 8).

    python benchmarks/serve_overhead.py [MODEL_DIR] --requests 16 --max-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import torch  # noqa: E402

from dlm.engine.home import dlm_home  # noqa: E402
from dlm.engine.llm import LLM  # noqa: E402
from dlm.engine.params import GenerationParams  # noqa: E402
from tests.serving import ServerProcess  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: embedded model)")
    ap.add_argument("--requests", type=int, default=16, help="requests per timed run")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--prompt-length", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the result here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    g = torch.Generator().manual_seed(0)
    prompts = [
        [int(t) for t in torch.randint(2, llm.config.vocab_size - 8, (args.prompt_length,), generator=g)]
        for _ in range(args.requests)
    ]
    params = GenerationParams(gen_length=args.max_tokens, block_length=args.block_length, steps=args.steps)

    def in_process(c: int) -> tuple[float, int]:
        start, nfe = time.perf_counter(), 0
        for i in range(0, len(prompts), c):
            nfe += sum(s.nfe for s in llm.engine.generate(prompts[i : i + c], params))
        return time.perf_counter() - start, nfe

    server = ServerProcess(
        [
            str(llm.model_dir),
            "--max-num-seqs",
            str(max(levels)),
            "--max-queue",
            str(args.requests),
            "--dtype",
            args.dtype,
            "--device",
            args.device,
            "--max-tokens",
            str(args.max_tokens),
            "--max-steps",
            str(max(args.steps or args.max_tokens, 1)),
        ],
        dlm_home(),
        env={"OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    bodies = [
        {
            "prompt": p,
            "max_tokens": args.max_tokens,
            "block_length": args.block_length,
            **({"steps": args.steps} if args.steps else {}),
        }
        for p in prompts
    ]
    try:
        server.wait_ready()
        client = httpx.Client(base_url=server.url, timeout=600, limits=httpx.Limits(max_connections=max(levels)))

        def one(body: dict) -> int:
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["denoising_steps"]

        def over_http(c: int) -> tuple[float, int]:
            start = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                nfe = sum(pool.map(one, bodies))
            return time.perf_counter() - start, nfe

        in_process(max(levels)), over_http(max(levels))  # warm-up both paths
        report: dict = {
            "model": str(llm.model_dir),
            "dtype": str(llm.dtype).replace("torch.", ""),
            "device": str(llm.device),
            "threads": torch.get_num_threads(),
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "levels": {},
        }
        for c in levels:
            runs = {"in_process": [], "server": []}
            nfes = {}
            for _ in range(args.repeats):
                for name, fn in (("in_process", in_process), ("server", over_http)):
                    seconds, nfes[name] = fn(c)
                    runs[name].append(seconds)
            local, remote = statistics.median(runs["in_process"]), statistics.median(runs["server"])
            report["levels"][c] = {
                "in_process_s": round(local, 4),
                "server_s": round(remote, 4),
                "overhead_pct": round(100 * (remote / local - 1), 1),
                # The server ends a request at its first committed EOS; the engine's generate()
                # runs every block. Per-forward time compares the two on equal work.
                "in_process_nfe": nfes["in_process"],
                "server_nfe": nfes["server"],
                "per_forward_overhead_pct": round(
                    100 * ((remote / nfes["server"]) / (local / nfes["in_process"]) - 1), 1
                ),
            }
    finally:
        server.terminate()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
