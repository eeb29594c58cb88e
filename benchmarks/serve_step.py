"""Per-step time of `dlm serve` against `dlm generate`'s engine on the same model, alternated.

Both at their default settings (dtype auto, the CPU plan's threads): a `dlm serve` process
answers one chat request at a time, and its `dlm_step_duration_seconds` histogram gives the
mean forward time of those requests; in this process `LLM.generate` (what `dlm generate`
runs) decodes the same prompt ids with the same settings and divides its time by its
forwards. Rounds alternate the two, so a busy neighbour slows both alike; the ratio
serve / generate per round is printed with its spread (goal: 1.0 within noise).

    python benchmarks/serve_step.py [MODEL_DIR] --rounds 5 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peers import DlmServer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: embedded model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=3, help="requests per side per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from dlm.engine.llm import LLM
    from dlm.engine.params import GenerationParams

    llm = LLM(args.model)
    messages = [{"role": "user", "content": "What is 19 + 81?"}]
    prompt = llm.encode(llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    n = args.max_tokens
    params = GenerationParams(gen_length=n, steps=n, block_length=n)
    body = {"messages": messages, "max_tokens": n, "steps": n, "block_length": n, "temperature": 0}
    llm.generate(prompt, params)
    serve_ms, generate_ms = [], []
    with DlmServer(args.model) as server:
        server.chat(body)  # first request: lazy initialisation on the server's side
        for _ in range(args.rounds):
            before = server.step_seconds()
            for _ in range(args.requests):
                server.chat(body)
            seconds, steps = (a - b for a, b in zip(server.step_seconds(), before))
            serve_ms.append(seconds / steps * 1000)
            results = [llm.generate(prompt, params)[0] for _ in range(args.requests)]
            generate_ms.append(sum(r.seconds for r in results) / sum(r.nfe for r in results) * 1000)
        threads = server.health().get("dtype", {})
    ratios = [s / g for s, g in zip(serve_ms, generate_ms)]
    row = {
        "model": str(llm.model_dir),
        "dtype": llm.dtype_choice.to_dict(),
        "server_dtype": threads,
        "serve_ms_per_step": [round(x, 3) for x in serve_ms],
        "generate_ms_per_step": [round(x, 3) for x in generate_ms],
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
    }
    print(
        f"{Path(row['model']).name}: serve {statistics.median(serve_ms):.2f} ms/step, generate "
        f"{statistics.median(generate_ms):.2f} ms/step, serve/generate median {row['ratio_median']} "
        f"(range {row['ratio_min']}-{row['ratio_max']}); dtype {llm.dtype_choice.name}, "
        f"{llm.dtype_choice.threads} thread(s)"
    )
    if args.json:
        args.json.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
