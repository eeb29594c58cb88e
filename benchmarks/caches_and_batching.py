"""Cache modes and batching on the tiny checkpoints: dlm against the reference-style loops.

Part 1, per family and cache mode (none / prefix / dual): tokens/s of dlm against the
straightforward reference-style loop (tests/oracles/reference_loop.py: full logits and a
softmax over every fed row at every step, Fast-dLLM's cache handling), on the same weights,
alternating, at identical outputs (the script fails otherwise).
Part 2: the throughput of one batch of 8 prompts of different lengths against the same 8
requests decoded one after another, with identical per-request outputs.

    python benchmarks/caches_and_batching.py [--llada DIR] [--dream DIR] [--threads N]

Without model directories it uses the embedded default model (LLaDA) and a Dream checkpoint
of the same shape with random weights, written to a temporary directory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dlm.engine.llm import LLM  # noqa: E402
from tests.oracles.reference_loop import reference_dream_generate, reference_generate  # noqa: E402


def tiny_dream(directory: Path) -> Path:
    from dlm.engine.checkpoint_writer import dream_config, random_dream_tensors, save_checkpoint
    from dlm.engine.default_model import MAX_LENGTH

    config = dream_config(
        4096,
        4095,
        4093,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=MAX_LENGTH,
    )
    save_checkpoint(directory, config, random_dream_tensors(config, seed=1))
    return directory


def best_of(repeats: int, fns: dict[str, Callable[[], object]]) -> tuple[dict[str, float], dict[str, object]]:
    """Best wall time of each function over `repeats` alternating rounds (after a warm-up)."""
    results = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}, results


def prompts(llm: LLM, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [8 + (5 * i) % 17 for i in range(count)]
    return [torch.randint(0, llm.config.vocab_size - 8, (n,), generator=g).tolist() for n in lengths]


def cache_modes(llm: LLM, gen: int, block: int, repeats: int) -> bool:
    family = llm.engine.family.name
    prompt = prompts(llm, 1)[0]
    model, mask = llm.engine.loaded.model, llm.config.mask_token_id
    ok = True
    for cache in ("none", "prefix", "dual"):
        kwargs = dict(gen_length=gen, steps=gen, block_length=block, cache=cache)

        def ours(kwargs: dict = kwargs) -> tuple[list[int], int]:
            out = llm.generate(prompt, early_stop=False, **kwargs)[0]
            return out.output_ids, out.nfe

        def reference(kwargs: dict = kwargs) -> tuple[list[int], int]:
            if family == "dream":
                x, nfe = reference_dream_generate(model, torch.tensor([prompt]), mask_id=mask, alg="entropy", **kwargs)
            else:
                x, nfe = reference_generate(model, torch.tensor([prompt]), mask_id=mask, **kwargs)
            return x[0, len(prompt) :].tolist(), nfe

        best, results = best_of(repeats, {"reference": reference, "dlm": ours})
        same = results["dlm"] == results["reference"]
        ok &= same
        print(
            f"  {family:5s} cache {cache:6s} reference {gen / best['reference']:8.1f} tok/s   "
            f"dlm {gen / best['dlm']:8.1f} tok/s   x{best['reference'] / best['dlm']:.2f}   "
            f"nfe {results['dlm'][1]}   identical {same}"
        )
    return ok


def batching(llm: LLM, gen: int, block: int, cache: str, repeats: int) -> bool:
    batch = prompts(llm, 8, seed=1)
    kwargs = dict(gen_length=gen, steps=gen, block_length=block, cache=cache)
    best, results = best_of(
        repeats,
        {
            "sequential": lambda: [llm.generate(p, **kwargs)[0].output_ids for p in batch],
            "batch8": lambda: [o.output_ids for o in llm.generate(batch, **kwargs)],
        },
    )
    same = results["sequential"] == results["batch8"]
    tokens = 8 * gen
    print(
        f"  {llm.engine.family.name:5s} cache {cache:6s} 8 sequential {tokens / best['sequential']:8.1f} tok/s   "
        f"batch 8 {tokens / best['batch8']:8.1f} tok/s   x{best['sequential'] / best['batch8']:.2f}   identical {same}"
    )
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llada", default=None, help="LLaDA checkpoint dir (default: embedded model)")
    ap.add_argument("--dream", default=None, help="Dream checkpoint dir (default: a random tiny one)")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (both sides)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        models = [
            LLM(args.llada, dtype=args.dtype, device="cpu"),
            LLM(args.dream or tiny_dream(Path(tmp)), dtype=args.dtype, device="cpu"),
        ]
        print(
            f"gen {args.gen_length}, block {args.block_length}, steps = gen, {args.dtype}, "
            f"{torch.get_num_threads()} threads, best of {args.repeats}"
        )
        print("cache modes (dlm vs the reference-style loop, batch 1):")
        ok = all([cache_modes(llm, args.gen_length, args.block_length, args.repeats) for llm in models])
        print("batching (8 prompts of 8-24 tokens):")
        ok &= all(
            [
                batching(llm, args.gen_length, args.block_length, cache, args.repeats)
                for llm in models
                for cache in ("none", "dual")
            ]
        )
    if not ok:
        sys.exit("outputs differ")


if __name__ == "__main__":
    main()
