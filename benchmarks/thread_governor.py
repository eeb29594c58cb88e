"""Per-step time with the thread governor (dlm/engine/runtime/thread_governor.py) on against
off (the CPU plan's fixed threads), alternated in rounds on one loaded model.

Each round decodes `--requests` prompts one after another (`--gen-length` tokens in one block
of as many steps: one token per forward) with the governor off, then on (the order alternates
between rounds; the governor persists across rounds, as in a server). Printed per round: the
load average, ms per step off and on, their ratio and the share of the governed steps that
ran with every core; then the median and range of the ratios. The ids of every request are
compared between the two (the command says where they differ).

    python benchmarks/thread_governor.py [MODEL_DIR] --rounds 6 --requests 4 --gen-length 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: embedded model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from dlm.engine.cpu_plan import apply_threads, default_threads
    from dlm.engine.llm import LLM
    from dlm.engine.params import GenerationParams

    llm = LLM(args.model, dtype=args.dtype, thread_governor=True)
    governor = llm.thread_governor
    if governor is None:
        sys.exit(f"error: no governor: the plan's threads ({llm.dtype_choice.threads}) are all {default_threads()}")
    n = args.gen_length
    params = GenerationParams(gen_length=n, steps=n, block_length=n)
    prompts = [[5 + i, 6, 7, 8 + i] * (4 + i % 4) for i in range(args.requests)]
    team_steps = [0, 0]  # governed steps with every core, all governed steps

    def count(_: object) -> None:
        team_steps[0] += torch.get_num_threads() == governor.team
        team_steps[1] += 1

    def run(on: bool) -> tuple[float, list[list[int]]]:
        llm.thread_governor = governor if on else None
        apply_threads(governor.threads if on else governor.base)
        outs = [llm.generate(p, params, on_step=count if on else None)[0] for p in prompts]
        return sum(o.seconds for o in outs) / sum(o.nfe for o in outs) * 1000, [o.output_ids for o in outs]

    run(False)
    rows = []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        team_steps[:] = [0, 0]
        result = {}
        for on in (False, True) if r % 2 == 0 else (True, False):
            result[on] = run(on)
        row = {
            "load": round(load, 2),
            "off_ms": round(result[False][0], 2),
            "on_ms": round(result[True][0], 2),
            "ratio": round(result[True][0] / result[False][0], 3),
            "team_share": round(team_steps[0] / max(1, team_steps[1]), 2),
            "same_ids": sum(a == b for a, b in zip(result[False][1], result[True][1])),
        }
        rows.append(row)
        print(
            f"round {r + 1}: load {row['load']:.2f}  off {row['off_ms']:.1f} ms/step  on {row['on_ms']:.1f}  "
            f"on/off {row['ratio']:.2f}  steps with {governor.team} threads {row['team_share']:.0%}  "
            f"same ids {row['same_ids']}/{len(prompts)}",
            flush=True,
        )
    ratios = [row["ratio"] for row in rows]
    print(
        f"{Path(str(llm.model_dir)).name} {llm.dtype_choice.name}, plan {governor.base} thread(s), "
        f"team {governor.team}: "
        f"on/off median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}), "
        f"load {min(r['load'] for r in rows):.1f}-{max(r['load'] for r in rows):.1f}, "
        f"home switches {governor.switches}"
    )
    if args.json:
        args.json.write_text(json.dumps({"model": str(llm.model_dir), "rounds": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
