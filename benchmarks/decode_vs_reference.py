"""Time dlm's decoding against the literal reference loops on the same weights: one table.

The reference loops (tests/oracles/reference_loop.py) run the LM head and a float64 softmax
over every fed position at every step, as LLaDA's `generate()` and Fast-dLLM's
`generate_with_dual_cache()` do; dlm decides only the masked positions of the current block,
plain and with lossless multi-token steps (`drafts`, dlm/engine/decoding/drafts.py). All three run
in this process, on the same loaded weights, alternating within each repeat, and must give
identical ids. For every checkpoint x dtype x setting the table gives forwards, tokens per
forward, tok/s and the time ratio reference / dlm; then, per checkpoint, what bounds dlm's
step: the share of a plain step spent in the transformer forward (the rest: LM-head
statistics on the decided rows and the commit).

Checkpoints: `tiny` (the LLaDA reference checkpoint, $DLM_REFERENCE_DIR), `default` (the
embedded model) and `llada8` (8 layers, 1024 hidden, 32K vocab, random, written to a temp dir
by dlm/engine/checkpoint_writer.py). Settings: `llada` (LLaDA's generate: no cache, one token a
step) and `dual` (Fast-dLLM dual cache + threshold 0.9).

    python benchmarks/decode_vs_reference.py [--models tiny,default,llada8] [--dtypes float32,auto]
        [--gen-length 32] [--repeats 1] [--drafts 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.vs_peers import write_llada_shaped  # noqa: E402
from dlm.engine.llm import LLM  # noqa: E402
from dlm.kernels import dispatch  # noqa: E402
from dlm.kernels.token_stats import TokenStats  # noqa: E402
from tests.oracles.reference_loop import reference_generate  # noqa: E402

SETTINGS = {"llada": {"cache": "none", "threshold": None}, "dual": {"cache": "dual", "threshold": 0.9}}
Run = Callable[[], tuple[list[int], int]]


def model_dir(name: str, scratch: Path) -> str | None:
    if name == "tiny":
        reference = Path(os.environ.get("DLM_REFERENCE_DIR", ROOT.parent / "shared" / "reference"))  # as the tests
        return str(reference / "models" / "llada_tiny_v2")
    if name == "llada8":
        return str(write_llada_shaped(scratch / "llada8"))
    return None  # the embedded default model


def runs(llm: LLM, prompt: list[int], kwargs: dict, drafts: int) -> dict[str, Run]:
    """The reference loop, dlm plain and dlm with `drafts` candidates, each -> (ids, forwards)."""

    def dlm(width: int) -> Run:
        def run() -> tuple[list[int], int]:
            out = llm.generate(prompt, early_stop=False, drafts=width, **kwargs)[0]
            return out.output_ids, out.nfe

        return run

    def reference() -> tuple[list[int], int]:
        model, mask = llm.engine.loaded.model, llm.config.mask_token_id
        x, nfe = reference_generate(model, torch.tensor([prompt]), mask_id=mask, **kwargs)
        return x[0, len(prompt) :].tolist(), nfe

    return {"reference": reference, "dlm": dlm(0), "drafts": dlm(drafts)}


def timed(runs: dict[str, Run], repeats: int) -> dict[str, tuple[float, list[int], int]]:
    """Each run's median seconds, ids and forwards; the runs alternate within every repeat."""
    for run in runs.values():
        run()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, tuple[list[int], int]] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            results[name] = run()
            seconds[name].append(time.perf_counter() - start)
    return {name: (statistics.median(seconds[name]), *results[name]) for name in runs}


def step_shares(llm: LLM, prompt: list[int], kwargs: dict) -> tuple[float, float, float]:
    """One plain dlm run timed from inside, so every part is measured under the same load:
    (seconds in all, in the transformer forwards, in the LM-head statistics)."""
    model = llm.engine.loaded.model
    spent = {"forward": 0.0, "head": 0.0}
    began = [0.0]

    def before(*_: object) -> None:
        began[0] = time.perf_counter()

    def after(*_: object) -> None:
        spent["forward"] += time.perf_counter() - began[0]

    original = dispatch.token_stats

    def head(*args: Any, **kw: Any) -> TokenStats:
        start = time.perf_counter()
        out = original(*args, **kw)
        spent["head"] += time.perf_counter() - start
        return out

    hooks = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    dispatch.token_stats = head  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        llm.generate(prompt, early_stop=False, **kwargs)
        total = time.perf_counter() - start
    finally:
        for hook in hooks:
            hook.remove()
        dispatch.token_stats = original  # type: ignore[assignment]
    return total, spent["forward"], spent["head"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,default,llada8")
    ap.add_argument("--dtypes", default="float32,auto")
    ap.add_argument("--settings", default="llada,dual")
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--prompt-length", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--drafts", type=int, default=4, help="candidates per forward for the lossless column")
    args = ap.parse_args()
    gen = args.gen_length
    if gen % args.block_length:  # the reference loops split gen_length into whole blocks
        ap.error(f"--gen-length ({gen}) must be a multiple of --block-length ({args.block_length})")
    print(
        f"gen {gen}  block {args.block_length}  prompt {args.prompt_length}  drafts {args.drafts}  "
        f"threads {torch.get_num_threads()}  repeats {args.repeats} (median)"
    )
    header = "| model | dtype | setting | reference s (fwd) | dlm s (fwd) | dlm+drafts s (fwd) | identical | "
    header += "tok/fwd dlm / +drafts | tok/s ref / dlm / +drafts | ratio dlm / +drafts |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    bounds = []
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            measured: dict[str, str] = {}
            for dtype in args.dtypes.split(","):
                llm = LLM(model_dir(model, Path(scratch)), dtype=dtype, device="cpu")
                resolved = llm.dtype_choice.name
                label = resolved if dtype == resolved else f"{dtype} ({resolved})"
                if resolved in measured:
                    print(f"| {model} | {label} | all | = the {measured[resolved]} rows | | | | | | |")
                    continue
                measured[resolved] = dtype
                prompt = torch.randint(
                    0, llm.config.vocab_size - 8, (args.prompt_length,), generator=torch.Generator().manual_seed(0)
                ).tolist()
                common = dict(gen_length=gen, steps=gen, block_length=args.block_length)
                for setting in args.settings.split(","):
                    kwargs = {**common, **SETTINGS[setting]}

                    r = timed(runs(llm, prompt, kwargs, args.drafts), args.repeats)
                    identical = r["reference"][1] == r["dlm"][1] == r["drafts"][1]
                    failed |= not identical
                    (ts, _, tn), (ds, _, dn), (ls, _, ln) = r["reference"], r["dlm"], r["drafts"]
                    print(
                        f"| {model} | {label} | {setting} | {ts:.2f} ({tn}) | {ds:.2f} ({dn}) | {ls:.2f} ({ln}) | "
                        f"{identical} | {gen / dn:.2f} / {gen / ln:.2f} | {gen / ts:.1f} / {gen / ds:.1f} / "
                        f"{gen / ls:.1f} | {ts / ds:.2f}x / {ts / ls:.2f}x |",
                        flush=True,
                    )
                    total, fwd, head = step_shares(llm, prompt, kwargs)
                    bounds.append(
                        f"{model} {label} {setting}: transformer forwards {100 * fwd / total:.0f}%, LM-head "
                        f"statistics {100 * head / total:.0f}%, the rest {100 * (1 - (fwd + head) / total):.0f}% "
                        f"of a plain run ({total:.2f} s)"
                    )
    print("what bounds a plain dlm run (timed inside one run):")
    for line in bounds:
        print("  " + line)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
