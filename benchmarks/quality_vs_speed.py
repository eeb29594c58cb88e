"""Speed at measured quality: accuracy per task against tokens per forward and tokens per second.

dLLM decoding settings (fewer steps per block, shorter blocks, confidence thresholds, the
factor rule, approximate caches) trade accuracy for tokens per forward; a speed figure means
nothing without the accuracy it kept. This script decodes the held-out task prompts of the
model trained by scripts/train_tiny_dllm.py with dlm's engine in float32 over a grid
of settings and writes, for each, exact-match accuracy per task, mean tokens per forward
(generated tokens / model forwards, per request) and tokens per second (all generated tokens
of the batch / wall time). It writes docs/quality-vs-speed.md (table, chosen setting) and
docs/quality-vs-speed.png (the Pareto plot). Later decoding work adds rows to GRID.

    python benchmarks/quality_vs_speed.py [--model DIR] [--per-task N] [--threads N] [--rows 1,2,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from train_tiny_dllm import OUT, evaluation_set  # noqa: E402

from dlm.engine.llm import LLM  # noqa: E402

# (label, request fields, batch size). The first row is the exact default: the reference point.
GRID: list[tuple[str, dict[str, Any], int]] = [
    ("default: gen 128, block 32, 1 token/step", {}, 64),
    ("gen 32 (one block)", {"gen_length": 32}, 64),
    ("gen 32, 2 tokens/step", {"gen_length": 32, "steps": 16}, 64),
    ("gen 32, 4 tokens/step", {"gen_length": 32, "steps": 8}, 64),
    ("gen 32, block 8, 2 tokens/step", {"gen_length": 32, "block_length": 8, "steps": 16}, 64),
    ("gen 32, random remasking", {"gen_length": 32, "remasking": "random"}, 64),
    ("gen 32, threshold 0.9", {"gen_length": 32, "threshold": 0.9}, 64),
    ("gen 32, threshold 0.7", {"gen_length": 32, "threshold": 0.7}, 64),
    ("gen 32, threshold 0.5", {"gen_length": 32, "threshold": 0.5}, 64),
    ("gen 32, factor 1.0", {"gen_length": 32, "factor": 1.0}, 64),
    ("threshold 0.9", {"threshold": 0.9}, 64),
    ("threshold 0.9, prefix cache", {"threshold": 0.9, "cache": "prefix"}, 64),
    ("threshold 0.9, dual cache", {"threshold": 0.9, "cache": "dual"}, 64),
    ("gen 32, threshold 0.9, batch 1", {"gen_length": 32, "threshold": 0.9}, 1),
    ("gen 32, threshold 0.9, batch 8", {"gen_length": 32, "threshold": 0.9}, 8),
    # Lossless multi-token steps (dlm/engine/decoding/drafts.py): the default's exact ids, fewer forwards.
    ("default + drafts 1", {"drafts": 1}, 64),
    ("default + drafts 4", {"drafts": 4}, 64),
]


@dataclass
class Row:
    index: int  # in GRID
    label: str
    fields: dict[str, Any]
    batch: int
    accuracy: dict[str, float]
    mean_accuracy: float
    tokens_per_forward: float
    tokens_per_second: float


def measure(llm: LLM, pairs: list[tuple[str, str, str]], fields: dict[str, Any], batch: int) -> dict[str, Any]:
    """Decode every (task, question, answer) in chunks of `batch`; exact match after strip."""
    right: dict[str, list[bool]] = {}
    per_forward: list[float] = []
    tokens, seconds = 0, 0.0
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        start = time.perf_counter()
        outs = llm.generate([q for _, q, _ in chunk], chat=True, temperature=0.0, **fields)
        seconds += time.perf_counter() - start
        for (task, _, answer), out in zip(chunk, outs, strict=True):
            right.setdefault(task, []).append(out.text.strip() == answer)
            per_forward.append(len(out.output_ids) / max(1, out.nfe))
            tokens += len(out.output_ids)
    accuracy = {task: sum(r) / len(r) for task, r in right.items()}
    return {
        "accuracy": accuracy,
        "mean_accuracy": sum(accuracy.values()) / len(accuracy),
        "tokens_per_forward": sum(per_forward) / len(per_forward),
        "tokens_per_second": tokens / seconds,
    }


def pareto(rows: list[Row]) -> list[Row]:
    """Rows no other row beats on both mean accuracy and tokens per forward."""
    return [
        r
        for r in rows
        if not any(
            o.mean_accuracy >= r.mean_accuracy
            and o.tokens_per_forward >= r.tokens_per_forward
            and (o.mean_accuracy, o.tokens_per_forward) != (r.mean_accuracy, r.tokens_per_forward)
            for o in rows
        )
    ]


def chosen(rows: list[Row]) -> Row:
    """The most tokens per forward among rows within 1 point of the exact default (row 0)."""
    keep = [r for r in rows if r.mean_accuracy >= rows[0].mean_accuracy - 0.01]
    return max(keep, key=lambda r: r.tokens_per_forward)


def plot(rows: list[Row], path: Path, model: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    front = sorted(pareto(rows), key=lambda r: r.tokens_per_forward)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([r.tokens_per_forward for r in rows], [100 * r.mean_accuracy for r in rows], s=18)
    ax.plot([r.tokens_per_forward for r in front], [100 * r.mean_accuracy for r in front], "r-", label="Pareto front")
    for r in rows:
        ax.annotate(
            str(r.index),
            (r.tokens_per_forward, 100 * r.mean_accuracy),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set(xlabel="tokens per forward", ylabel="mean exact-match accuracy (%)", xscale="log")
    ax.set_title(f"{model.name}: quality vs speed (row numbers as in the table)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows: list[Row], per_task: int, threads: int, model: Path) -> str:
    tasks = list(rows[0].accuracy)
    best = chosen(rows)
    front = {r.label for r in pareto(rows)}
    head = "| # | setting | batch | " + " | ".join(tasks) + " | mean | tokens/forward | tokens/s | Pareto |"
    lines = [head, "|" + "---|" * (len(tasks) + 7)]
    for r in rows:
        cells = " | ".join(f"{100 * r.accuracy[t]:.0f}" for t in tasks)
        mark = "yes" if r.label in front else ""
        lines.append(
            f"| {r.index} | {r.label} | {r.batch} | {cells} | {100 * r.mean_accuracy:.1f} | "
            f"{r.tokens_per_forward:.2f} | {r.tokens_per_second:.0f} | {mark} |"
        )
    return "\n".join(
        [
            "# Quality vs speed",
            "",
            "Generated by `benchmarks/quality_vs_speed.py` (do not edit by hand; rerun it). Model: "
            f"`{model.name}` (see its model card), float32, CPU, {threads} thread(s); "
            f"up to {per_task} held-out prompts per task (never trained on), chat template, temperature 0, "
            "exact match. Accuracy in %; tokens/forward = generated tokens / model forwards per request "
            "(EOS padding included, as papers count it); tokens/s = generated tokens of the whole run / wall "
            "time on a shared 2-core machine (compare rows, not machines).",
            "",
            "\n".join(lines),
            "",
            f"**Chosen**: row {best.index} ({best.label}) gives the most tokens per forward "
            f"({best.tokens_per_forward:.2f}, against {rows[0].tokens_per_forward:.2f} for the exact default) "
            f"while keeping mean accuracy within 1 point of row 0 ({100 * best.mean_accuracy:.1f}% against "
            f"{100 * rows[0].mean_accuracy:.1f}%).",
            "",
            "![accuracy against tokens per forward](quality-vs-speed.png)",
            "",
            "Settings are request fields (`dlm generate` flags, `/v1` body fields). Row 0 is dlm's default: "
            "gen_length 128 with block_length 32 and one token per step, low-confidence remasking, no cache. "
            "The sample is small (a point is one prompt in up to 14-20 per task), so differences of a "
            "few points are noise; the ranking of settings is the signal.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=str(OUT), help="checkpoint directory (default: the training script's output)"
    )
    parser.add_argument("--per-task", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default=None, help="comma-separated GRID rows to run besides row 0 (default: all)")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = Path(args.model)
    llm = LLM(model, dtype="float32", device="cpu")
    pairs = [(task, q, a) for task, items in evaluation_set(args.per_task).items() for q, a in items]
    # Row 0 (the exact default) is always measured: the other rows are judged against it.
    picked = range(len(GRID)) if args.rows is None else sorted({0, *(int(i) for i in args.rows.split(","))})
    rows = []
    for i in picked:
        label, fields, batch = GRID[i]
        result = measure(llm, pairs, fields, batch)
        rows.append(Row(i, label, fields, batch, **result))
        print(json.dumps({"row": i, "label": label, **result}), flush=True)
    out = Path(args.out)
    (out / "quality-vs-speed.md").write_text(markdown(rows, args.per_task, args.threads, model))
    plot(rows, out / "quality-vs-speed.png", model)


if __name__ == "__main__":
    main()
