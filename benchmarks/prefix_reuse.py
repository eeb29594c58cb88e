"""Cross-request prefix reuse: time to first token of a request whose prompt shares a long
prefix with an earlier one, against the first request, side by side in one process.

    python benchmarks/prefix_reuse.py [MODEL_DIR] [--family sdar] [--prefix 2048] [--tail 32]
        [--gen-length 32] [--threshold 0.9] [--repeats 3] [--dtype float32]

Without MODEL_DIR a tiny random block-causal checkpoint of `--family` is written to a temp dir
(`--hidden`/`--layers` make it bigger). Each repeat uses a fresh engine with the prefix cache on
and decodes, one after the other, `prefix + tail_a` (cold: nothing cached) then `prefix +
tail_b` (warm: the prefix's pages are reused); a third engine with the cache off decodes
`prefix + tail_b` too, and its ids must equal the warm request's. Time to first token is what a
streaming client sees: arrival to the first committed answer token (the committed prefix
non-empty). Reported: median TTFT cold and warm, the ratio warm/cold (the acceptance bound is
0.30), tokens fed to the first forward, and whether the ids are identical.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.block_args import block_parser  # noqa: E402
from dlm.engine.block_checkpoints import write_tiny  # noqa: E402
from dlm.engine.llm import LLM  # noqa: E402
from dlm.engine.params import GenerationParams  # noqa: E402
from dlm.engine.runtime.request import RequestState  # noqa: E402

BUDGET = 4 << 30


def ttft(llm: LLM, prompt: list[int], params: GenerationParams) -> tuple[float, RequestState]:
    """Seconds from submitting `prompt` alone to its first committed answer token; the request
    then runs to its end (its pages are published as its context is cached)."""
    start = time.perf_counter()
    seq = llm.engine.add_request(prompt, params)
    first = None
    while not seq.finished:
        llm.engine.step()
        if first is None and seq.committed_prefix:
            first = time.perf_counter() - start
    assert first is not None
    return first, seq


def main() -> None:
    ap = block_parser(__doc__, family="sdar")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=32)
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--hidden", type=int, help="hidden size of the written checkpoint")
    ap.add_argument("--layers", type=int, help="layers of the written checkpoint")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    if args.model:
        path = Path(args.model)
    else:
        size = {"max_position_embeddings": args.prefix + 2 * args.tail + 2 * args.gen_length + 64}
        if args.hidden:
            size["hidden_size"] = args.hidden
        if args.layers:
            size["num_hidden_layers"] = args.layers
        path = write_tiny(Path(tempfile.mkdtemp(prefix="dlm-bench-")), args.family, **size)
    vocab = LLM(path, dtype=args.dtype, device=args.device).config.vocab_size
    prefix = [(13 * i) % (vocab - 16) + 1 for i in range(args.prefix)]
    tail_a = [(7 * i + 5) % (vocab - 16) + 1 for i in range(args.tail)]
    tail_b = [(11 * i + 3) % (vocab - 16) + 1 for i in range(args.tail)]
    params = GenerationParams(gen_length=args.gen_length, threshold=args.threshold, cache="block")

    cold, warm, plain = [], [], []
    same = True
    fed: dict[str, int] = {}
    for _ in range(args.repeats + 1):  # the first round warms the allocator and the kernels up
        reusing = LLM(path, dtype=args.dtype, device=args.device)
        reusing.engine.enable_prefix_cache(BUDGET)
        without = LLM(path, dtype=args.dtype, device=args.device)
        t_cold, s_cold = ttft(reusing, prefix + tail_a, params)
        t_warm, s_warm = ttft(reusing, prefix + tail_b, params)
        t_plain, s_plain = ttft(without, prefix + tail_b, params)
        same = same and s_warm.generated_ids == s_plain.generated_ids
        cold.append(t_cold)
        warm.append(t_warm)
        plain.append(t_plain)
        fed = {"cold": s_cold.query_lengths[0], "warm": s_warm.query_lengths[0], "off": s_plain.query_lengths[0]}
    cold, warm, plain = cold[1:], warm[1:], plain[1:]
    row = {
        "family": reusing.config.family,
        "dtype": args.dtype,
        "prefix_tokens": args.prefix,
        "ttft_cold_s": statistics.median(cold),
        "ttft_warm_s": statistics.median(warm),
        "ttft_cache_off_s": statistics.median(plain),
        "ratio_warm_over_cold": statistics.median(w / c for w, c in zip(warm, cold)),
        "first_forward_tokens": fed,
        "identical_ids": same,
    }
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(
            f"{row['family']} {args.dtype}, {args.prefix}-token shared prefix: "
            f"TTFT cold {row['ttft_cold_s'] * 1e3:.1f} ms, "
            f"warm {row['ttft_warm_s'] * 1e3:.1f} ms (cache off {row['ttft_cache_off_s'] * 1e3:.1f} ms); "
            f"warm/cold {row['ratio_warm_over_cold']:.3f} (bound 0.30); first forward fed {fed}; "
            f"identical ids: {same}"
        )
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
