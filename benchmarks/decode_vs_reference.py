"""Time dlm's decoding against the literal reference loop on the same checkpoint.

The reference loop (tests/oracles/reference_loop.py) runs the LM head and a float64
softmax over every position of the canvas at every step, as LLaDA's `generate()` does; dlm
decides only the masked positions of the current block. Both run in this process, on the
same weights, alternating, and must produce identical ids; the ratio is what we report.

    python benchmarks/decode_vs_reference.py [MODEL_DIR] --gen-length 128 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.llm import LLM  # noqa: E402
from tests.oracles.reference_loop import reference_generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: embedded model)")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--prompt-length", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    prompt = [
        int(t)
        for t in torch.randint(
            0, llm.config.vocab_size - 8, (args.prompt_length,), generator=torch.Generator().manual_seed(0)
        )
    ]
    steps = args.steps or args.gen_length
    kwargs = dict(gen_length=args.gen_length, steps=steps, block_length=args.block_length, threshold=args.threshold)

    def ours() -> tuple[list[int], int]:
        out = llm.generate(prompt, **kwargs)[0]
        return out.output_ids, out.nfe

    def reference() -> tuple[list[int], int]:
        x, nfe = reference_generate(
            llm.engine.loaded.model, torch.tensor([prompt]), mask_id=llm.config.mask_token_id, **kwargs
        )
        return x[0, len(prompt) :].tolist(), nfe

    ours(), reference()  # warm-up
    times: dict[str, list[float]] = {"dlm": [], "reference": []}
    results = {}
    for _ in range(args.repeats):
        for name, fn in (("dlm", ours), ("reference", reference)):
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    identical = results["dlm"] == results["reference"]
    best = {k: min(v) for k, v in times.items()}
    print(
        f"model {llm.model_dir.name}  vocab {llm.config.logits_size}  gen {args.gen_length}  "
        f"block {args.block_length}  steps {steps}  threshold {args.threshold}  dtype {args.dtype}"
    )
    for name in ("reference", "dlm"):
        print(
            f"  {name:9s} best {best[name]:.3f}s  median {statistics.median(times[name]):.3f}s  nfe {results[name][1]}"
        )
    print(f"identical outputs: {identical}")
    print(f"speed ratio (reference / dlm, best of {args.repeats}): {best['reference'] / best['dlm']:.2f}x")
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
