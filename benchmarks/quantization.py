"""Quantized weights on this CPU: bf16 against int8 and int4, side by side in one run.

Two models:
- the embedded default model: exact-match accuracy per task on its held-out prompts
  (scripts/train_tiny_dllm.py's evaluation, the model card's numbers) and the pass rate of its
  known-answer suite (`dlm validate --suite default-model`), in bf16, for each method;
- an 8-layer, 1024-hidden, 32K-vocabulary LLaDA with random weights (170M: `write_llada_shaped`
  in benchmarks/vs_peers.py, 102.8M parameters in its layers, the part quantization applies
  to, plus 2 x 33.6M of embedding and LM head): weight bytes and process RSS after loading
  (each method loaded in a fresh process), and decode tokens/s, the three methods loaded
  together and decoded in alternation, round after round, so a busy neighbour slows all alike.

Reports medians with the spread (min-max) over rounds and the 1-minute load average at each
round: the machine is shared.

    python benchmarks/quantization.py [--rounds 5] [--per-task 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

METHODS = (None, "int8", "int4")
DTYPE = "bfloat16"


def name(method: str | None) -> str:
    return method or "bf16"


def accuracy(per_task: int) -> dict[str, dict]:
    """Default model: exact match per task and the known-answer suite, per method."""
    from train_tiny_dllm import evaluate

    from dlm.cli.checks.suite import DEFAULT_MODEL_SUITE, load_suite
    from dlm.engine import default_model
    from dlm.engine.llm import LLM

    directory = default_model.ensure_default_model()
    suite = load_suite(DEFAULT_MODEL_SUITE)
    questions = [case.messages[0]["content"] for case in suite.cases if case.messages]
    out = {}
    for method in METHODS:
        tasks = evaluate(directory, per_task, dtype=DTYPE, quantization=method)
        llm = LLM(directory, dtype=DTYPE, device="cpu", quantization=method)
        texts = [o.text for o in llm.generate(questions, gen_length=suite.defaults["max_tokens"], chat=True)]
        passed = sum(bool(re.search(c.expect.regex[0], t)) for c, t in zip(suite.cases, texts, strict=True))
        out[name(method)] = {
            "tasks": {k: round(100 * v, 1) for k, v in tasks.items()},
            "mean": round(100 * statistics.mean(tasks.values()), 2),
            "suite": f"{passed}/{len(texts)}",
        }
        print(f"default model {name(method)}: mean {out[name(method)]['mean']}%, suite {passed}/{len(texts)}")
    return out


# RSS after loading, and again once the C allocator has returned what loading freed (the
# dense tensors read before quantizing): what the model holds from then on.
CHILD = """
import ctypes, gc, json, sys
from dlm.engine.llm import LLM
from dlm.engine.quantized_weights import weight_bytes
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
llm = LLM(sys.argv[1], dtype=sys.argv[2], device="cpu", quantization=None if sys.argv[3] == "none" else sys.argv[3])
rss = status("VmRSS")
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
out = {"weight_bytes": weight_bytes(llm.engine.loaded.model), "rss": rss, "rss_trimmed": status("VmRSS")}
print(json.dumps(out | {"peak_rss": status("VmHWM")}))
"""


def memory(model: Path) -> dict[str, dict]:
    """Weight bytes and RSS after loading, each method in a fresh process."""
    out = {}
    for method in METHODS:
        run = subprocess.run(
            [sys.executable, "-c", CHILD, str(model), DTYPE, method or "none"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        out[name(method)] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def speed(model: Path, rounds: int, gen_length: int) -> dict[str, dict]:
    """Decode tokens/s, the methods alternated in each round."""
    from dlm.engine.llm import LLM
    from dlm.engine.params import GenerationParams

    llms = {name(m): LLM(model, dtype=DTYPE, device="cpu", quantization=m) for m in METHODS}
    prompt = list(range(10, 42))
    params = GenerationParams(gen_length=gen_length, block_length=gen_length, steps=gen_length, early_stop=False)
    for llm in llms.values():  # warm-up
        llm.generate(prompt, params)
    rates: dict[str, list[float]] = {k: [] for k in llms}
    loads = []
    for i in range(rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for key, llm in llms.items():
            rates[key].append(llm.generate(prompt, params)[0].tokens_per_second)
        print(f"round {i + 1}: " + ", ".join(f"{k} {r[-1]:.2f} tok/s" for k, r in rates.items()), flush=True)
    # Each round's ratio to bf16 compares decodes seconds apart: less exposed to the load than
    # a ratio of medians taken over the whole run.
    return {
        key: {
            "median": round(statistics.median(r), 2),
            "min": round(min(r), 2),
            "max": round(max(r), 2),
            "ratio_per_round": [round(a / b, 2) for a, b in zip(r, rates["bf16"])],
            "median_ratio": round(statistics.median(a / b for a, b in zip(r, rates["bf16"])), 2),
        }
        for key, r in rates.items()
    } | {"load_average_1m": loads}  # type: ignore[operator]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-task", type=int, default=50)
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dlm-dtype-auto")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    from benchmarks.vs_peers import write_llada_shaped

    big = write_llada_shaped(args.workdir / "llada-8x1024")
    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    report["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    report["memory"] = memory(big)
    report["speed"] = speed(big, args.rounds, args.gen_length)
    if not args.skip_accuracy:
        report["accuracy"] = accuracy(args.per_task)
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    base_mem = report["memory"]["bf16"]
    for method in METHODS:
        key = name(method)
        mem, spd = report["memory"][key], report["speed"][key]
        print(
            f"170M LLaDA {key:5s}: weights {mem['weight_bytes'] / 2**20:8.1f} MiB "
            f"({mem['weight_bytes'] / base_mem['weight_bytes']:.2f}x), RSS {mem['rss'] / 2**20:8.1f} MiB "
            f"({mem['rss'] / base_mem['rss']:.2f}x), trimmed {mem['rss_trimmed'] / 2**20:8.1f} MiB "
            f"({mem['rss_trimmed'] / base_mem['rss_trimmed']:.2f}x), "
            f"{spd['median']:.2f} tok/s [{spd['min']}-{spd['max']}], per-round ratio {spd['median_ratio']:.2f}x "
            f"{spd['ratio_per_round']}"
        )
    print(f"load average (1 min) per round: {report['speed']['load_average_1m']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
